"""A real HTTP server on 127.0.0.1 that serves a folder with Range requests, for ``fit``'s
remote reader: started by a test, in a thread, on a free port. Its ``mode`` makes it
misbehave the ways servers do: ignore Range (200 with the whole file), stop short of the
range it announced, never answer, or redirect every path elsewhere; and the ways broken or
hostile ones do (``MISBEHAVIOURS``): a ``Content-Range`` total of 10^30 or one its own
range runs past, a 200 KB header line, 150 header lines, a chunked body whose chunk size is
no number, a status line that is none, or an answer dripped a byte at a time for as long as
the client waits (its status line and headers, or its body). A dripping server stops after ``DRIP_CAP`` seconds, so a client
that does not bound its wait fails a test instead of hanging it."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
DRIP_CAP = 60.0  # seconds a dripping answer lasts at most
DRIP_STEP = 0.05  # seconds between two dripped bytes
# mode -> what the client must say (a part of its one line)
MISBEHAVIOURS = {
    "hugetotal": "no file is that large",
    "pasttotal": "is not a range of the file",
    "longline": "not valid HTTP",
    "manyheaders": "not valid HTTP",
    "badchunk": "not valid HTTP",
    "badstatus": "not valid HTTP",
    "drip-head": "no answer within",
    "drip-body": "no answer within",
}


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path, mode: str = "range") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder = folder
        self.mode = mode
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.bytes_sent = 0
        self.stopping = threading.Event()
        self.mutate: Callable[[bytes], bytes] = lambda answer: answer  # mode "mutate"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: RangeServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        srv = self.server
        srv.requests.append((self.path, self.headers.get("Range")))
        if srv.mode == "hang":
            time.sleep(5)
            return
        path = self.path.split("?")[0]
        if srv.mode == "redirect" and not path.startswith("/real/"):
            self.send_response(302)
            self.send_header("Location", "/real" + path)
            self.end_headers()
            return
        name = path.removeprefix("/real/").lstrip("/")
        file = srv.folder / name
        if not file.is_file():
            self.send_error(404, "Not Found")
            return
        size = file.stat().st_size  # a real-sized model is read only where it is asked
        rng = _RANGE.fullmatch(self.headers.get("Range") or "")
        if srv.mode == "norange" or rng is None:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            with open(file, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    if not self._send(chunk):
                        break
            return
        start = int(rng.group(1))
        end = min(int(rng.group(2)) if rng.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.end_headers()
            return
        with open(file, "rb") as fh:
            fh.seek(start)
            body = fh.read(end + 1 - start)
        if srv.mode in MISBEHAVIOURS:
            self._misbehave(start, end, size, body)
            return
        if srv.mode == "mutate":
            self.close_connection = True
            head = (
                f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end}/{size}"
                f"\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            self._raw(srv.mutate(head.encode() + body))
            return
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._send(body[: len(body) // 2] if srv.mode == "short" else body)

    def _misbehave(self, start: int, end: int, size: int, body: bytes) -> None:
        """Write the answer of a broken or hostile server, byte for byte."""
        mode = self.server.mode
        self.close_connection = True
        status = b"HTTP/1.1 206 Partial Content\r\n"
        crange = f"Content-Range: bytes {start}-{end}/{size}\r\n".encode()
        length = f"Content-Length: {len(body)}\r\n".encode()
        if mode == "hugetotal":
            crange = f"Content-Range: bytes {start}-{end}/{10**30}\r\n".encode()
            self._raw(status + crange + length + b"\r\n" + body)
        elif mode == "pasttotal":  # the range ends past the size it gives
            crange = f"Content-Range: bytes {start}-{end}/{end}\r\n".encode()
            self._raw(status + crange + length + b"\r\n" + body)
        elif mode == "longline":
            self._raw(status + crange + b"X-Long: " + b"a" * 200_000 + b"\r\n" + length + b"\r\n")
        elif mode == "manyheaders":
            many = b"".join(b"X-Header-%d: %d\r\n" % (i, i) for i in range(150))
            self._raw(status + crange + many + length + b"\r\n" + body)
        elif mode == "badchunk":
            chunked = b"Transfer-Encoding: chunked\r\n"
            self._raw(status + crange + chunked + b"\r\n" + b"zz-not-hex\r\n" + body[:64])
        elif mode == "badstatus":
            self._raw(b"NOT HTTP AT ALL \x00\xff\r\n" + crange + length + b"\r\n" + body)
        elif mode == "drip-head":
            self._raw(status + crange)
            self._drip(b"X-Drip: ", b"a")
        elif mode == "drip-body":
            self._raw(status + crange + length + b"\r\n")
            self._drip(b"", body[:1] or b"\0")

    def _raw(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _drip(self, first: bytes, byte: bytes) -> None:
        """``first``, then ``byte`` every ``DRIP_STEP`` seconds until the client goes, the
        server stops or ``DRIP_CAP`` seconds pass."""
        self._raw(first)
        t0 = time.monotonic()
        while not self.server.stopping.is_set() and time.monotonic() - t0 < DRIP_CAP:
            try:
                self.wfile.write(byte)
                self.wfile.flush()
            except OSError:  # the client gave up
                return
            time.sleep(DRIP_STEP)
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, body: bytes) -> bool:
        """Write ``body``; False once the client has gone."""
        try:
            self.wfile.write(body)
            self.server.bytes_sent += len(body)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True


@contextmanager
def serving(folder: Path, mode: str = "range") -> Iterator[RangeServer]:
    """A ``RangeServer`` on ``folder`` for the duration of the block."""
    srv = RangeServer(folder, mode)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stopping.set()
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)
