"""The server's listening socket, made by the command's process and inherited by each worker
it starts: the port is bound once (a port in use is one line before any model loads) and
stays bound while a worker that died is replaced, so clients queue in the kernel's backlog
instead of meeting a refused connection."""

from __future__ import annotations

import os
import socket

from ..errors import BadInput


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: one the system picks)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)  # create_server adds the address
        raise BadInput(f"cannot listen here: {why}", f"{host}:{port}") from None


def url_of(sock: socket.socket) -> tuple[str, int, str]:
    """(host, port, the API's base URL) of a listening socket."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return host, int(port), f"http://{shown}:{port}/v1"
