"""A real HTTP server on 127.0.0.1 that serves a folder with Range requests, for ``fit``'s
remote reader: started by a test, in a thread, on a free port. Its ``mode`` makes it
misbehave the ways servers do: ignore Range (200 with the whole file), stop short of the
range it announced, never answer, or redirect every path elsewhere."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path, mode: str = "range") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder = folder
        self.mode = mode
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.bytes_sent = 0

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
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._send(body[: len(body) // 2] if srv.mode == "short" else body)

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
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)
