"""What every API's routes do around llama-cpp-python's calls: take the model's lock as its
own routes take it (requests of every API queue on the one model), and close a stream of
chunks a client left early (the generation stops at its next token)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any


def model_lock() -> Any:
    """The model's lock, as llama-cpp-python's routes take it."""
    import llama_cpp.server.app as server_app

    return asynccontextmanager(server_app.get_llama_proxy)()


def close_chunks(chunks: Any) -> None:
    """Close a generator of chunks (nothing for a finished answer)."""
    close = getattr(chunks, "close", None)
    if close is not None:
        close()
