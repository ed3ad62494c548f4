"""What a stop request (the first SIGTERM or Ctrl-C the worker is passed) does to the requests.

A server stops within seconds, whatever it is running: the generation in progress ends at its
next token (``Completions.generate`` asks ``cut``) and is answered as a whole response
(``finish_reason`` "length", the text so far); a prompt being fed to llama.cpp in batches is
cut at the next batch (``engage`` sets llama.cpp's abort callback, which ggml takes up for
each graph it starts from then on: nothing is called before the stop) and answered 503; every
request still waiting for the model is answered 503 ``server_stopping`` when it gets it
(``admit``). uvicorn meanwhile stops accepting connections and waits for the answers; the
worker then writes what it owes (the trace's last segment) and ends. ``report`` tells the
parent of each request cut or refused, so the command can say what the stop did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .shapes import ApiProblem, Refused

STOPPING = ApiProblem(
    503,
    "the server is stopping: this request was not run",
    code="server_stopping",
    kind="server_error",
)
CUT = ApiProblem(
    503,
    "the server stopped while this request's prompt was fed to the model",
    code="server_stopping",
    kind="server_error",
)


class Stopping:
    """The stop as the requests see it. ``requested``: whether a stop was asked for;
    ``report``: told ``"cut"`` or ``"refused"`` for each request the stop touched."""

    def __init__(self, requested: Callable[[], bool], report: Callable[[str], None]) -> None:
        self.requested = requested
        self.report = report
        self.cut_short = 0
        self.refused = 0
        self._abort: Any = None  # the ctypes callback, kept alive while llama.cpp holds it

    def admit(self) -> None:
        """Before a request runs on the model: refused (503) once the server is stopping."""
        if self.requested():
            self.refused += 1
            self.report("refused")
            raise Refused(STOPPING)

    def cut(self) -> bool:
        """Whether the generation in progress should end at this token."""
        return self.requested()

    def on_cut(self) -> None:
        self.cut_short += 1
        self.report("cut")

    def failed(self, exc: BaseException) -> BaseException:
        """What a request that failed during the stop is answered with: llama.cpp's
        aborted batch (``llama_decode`` returned 2) is the stop's doing, not the request's."""
        if self.requested() and not isinstance(exc, Refused):
            self.on_cut()
            return Refused(CUT)
        return exc

    def engage(self, llm: Any) -> None:
        """The stop was asked for: a batch llama.cpp starts from now on is aborted."""
        if self._abort is not None:
            return
        import llama_cpp

        self._abort = llama_cpp.ggml_abort_callback(lambda _data: True)
        llama_cpp.llama_set_abort_callback(llm.ctx, self._abort, None)
