"""HTTP that uvicorn refuses before the application runs, answered in the API's error shape.

A request h11 cannot read — a ``Content-Length`` that is no number, a header line without a
colon, a request line of three words it does not know — never reaches the application or the
guard: uvicorn's h11 protocol answers it itself, 400 ``Invalid HTTP request received.`` in
plain text, which no API client reads as an error of its API. ``shaped_protocol`` is uvicorn's
own h11 protocol with that one answer replaced: JSON in the shape of the API the request line's
path belongs to (``Shapes``; OpenAI's when it names none), ``Connection: close`` as before.
"""

from __future__ import annotations

from typing import Any

from .shapes import ApiProblem, Shapes

HEAD_BYTES = 8192
"""What is kept of a request's first bytes to find its path (a request line is shorter)."""
UNREADABLE = ApiProblem(
    400,
    "the request is not HTTP/1.1 this server can read (a request line or header it cannot "
    "parse, such as a Content-Length that is not a number)",
    code="invalid_http",
)


def path_of(head: bytes) -> str:
    """The path of the request line at the start of ``head`` ("" when there is none)."""
    words = head.split(b"\r\n", 1)[0].split(b" ")
    if len(words) < 2:
        return ""
    return words[1].split(b"?", 1)[0].decode("latin-1")


def shaped_protocol(shapes: Shapes) -> type[Any]:
    """uvicorn's ``H11Protocol`` answering what h11 refuses in ``shapes`` (for
    ``uvicorn.Config(http=…)``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ShapedH11Protocol(H11Protocol):
        _head = b""

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # the start of a request
                self._head = bytes(data[:HEAD_BYTES])
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            body = shapes.render(path_of(self._head), UNREADABLE)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return ShapedH11Protocol
