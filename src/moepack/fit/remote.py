"""A remote GGUF's header and tensor index over HTTP Range requests, nothing more.

``fetch_index`` reads the first 64 KiB of each shard, scans how long the header is
(``header.scan_header``) and asks for exactly what is missing until the tensor index is
complete, so a 200 GB download costs a few MB to judge. A split set's shards are found by
name (``NAME-0000i-of-0000N.gguf`` beside the one given) and every one is read. Each shard's
header is written at the start of a sparse local file of the shard's full size (the size the
server's ``Content-Range`` gives), so ``MoeModel`` opens the mirror as it opens a download:
every tensor range is checked against the real file size, and no tensor byte is stored.

Redirects are followed (urllib's handler keeps the ``Range`` header). ``timeout`` bounds the
whole header fetch, every request in it included, not each read: a server that sends a byte
a second never holds ``fit`` longer than that (each receive waits only for what is left).
A server that ignores ``Range`` (a 200 with the whole file), an answer shorter or longer
than asked for, a ``Content-Range`` that does not answer the request or names a size no
file has, a malformed answer (status line, header lines too long or too many, a broken
chunked body), a header that runs past the file's end, a file that is no GGUF, an HTTP error
or no whole answer in time is one ``BadInput`` naming the URL.
"""

from __future__ import annotations

import functools
import http.client
import io
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..checkpoint.model import SPLIT_RE
from ..errors import BadInput
from ..safeio import os_error_text
from .header import HeaderExtent, NeedMore, NotGguf, scan_header

FIRST_READ = (
    64 << 10
)  # grown fourfold (or to what the header says it needs) until it holds the index
MAX_SHARDS = 4096
MAX_FILE_BYTES = (1 << 63) - 1  # off_t: a Content-Range total past it names no file
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
USER_AGENT = "moepack-fit (HTTP Range: header and tensor index only)"
_SHOWN = 120  # characters of a server's malformed line quoted in an error


def is_url(text: str) -> bool:
    """``http://`` or ``https://`` (what ``fit`` reads remotely)."""
    return text.lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class RemoteShard:
    url: str
    name: str
    total_bytes: int  # the file's size on the server
    bytes_read: int  # header bytes fetched
    extent: HeaderExtent
    local: Path  # the sparse mirror

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "total_bytes": self.total_bytes,
            "bytes_read": self.bytes_read,
            "header_bytes": self.extent.index_end,
        }


@dataclass(frozen=True)
class RemoteIndex:
    url: str
    shards: list[RemoteShard]
    requests: int

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.shards)

    @property
    def share_read(self) -> float:
        return self.bytes_read / self.total_bytes if self.total_bytes else 0.0

    @property
    def local(self) -> Path:
        return self.shards[0].local

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "shards": [s.to_json() for s in self.shards],
            "requests": self.requests,
            "bytes_read": self.bytes_read,
            "total_bytes": self.total_bytes,
            "share_read": self.share_read,
        }


class Deadline:
    """The instant a whole header fetch must be done by (``time.monotonic`` seconds)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; ``TimeoutError`` when none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the {self.seconds:g} s deadline passed")
        return left


class _BoundedReads(io.RawIOBase):
    """A response's bytes from the socket, each receive waiting only until the deadline, so
    a server that drips a byte at a time cannot stretch the request past it."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)  # counts as a user of the socket
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _BoundedSocket:
    """A connected socket whose sends and the response read from it end at the deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_BoundedReads(self._sock, self._deadline))

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:  # close, setsockopt, fileno, ...
        return getattr(self._sock, name)


class _BoundedHTTP(http.client.HTTPConnection):
    """``HTTPConnection`` whose connection waits only until the deadline (so does a TLS
    handshake: the socket's timeout covers it whole) and whose reads are bounded."""

    def __init__(self, host: str, *, deadline: Deadline, **kwargs: Any) -> None:
        kwargs["timeout"] = deadline.left()
        super().__init__(host, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = _BoundedSocket(self.sock, self._deadline)


class _BoundedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, *, deadline: Deadline, **kwargs: Any) -> None:
        kwargs["timeout"] = deadline.left()
        super().__init__(host, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = _BoundedSocket(self.sock, self._deadline)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_BoundedHTTP, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        factory = functools.partial(_BoundedHTTPS, deadline=self._deadline)
        return self.do_open(factory, req, context=getattr(self, "_context", None))


def _quoted(text: object) -> str:
    shown = str(text)
    return shown if len(shown) <= _SHOWN else shown[:_SHOWN] + "…"


class RangeReader:
    """Byte ranges of one URL; counts its requests. Every request ends by ``deadline``."""

    def __init__(self, url: str, timeout: float, deadline: Deadline | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self.deadline = deadline or Deadline(timeout)
        self.requests = 0
        self.total: int | None = None
        # the default handlers (proxies from the environment, redirects, errors) with the
        # connections replaced by deadline-bounded ones
        self._opener = urllib.request.build_opener(
            _HTTPHandler(self.deadline), _HTTPSHandler(self.deadline)
        )

    def _fail(self, problem: str) -> BadInput:
        return BadInput(problem, self.url)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start`` .. ``end - 1`` (fewer only where the file ends first)."""
        if self.total is not None:
            end = min(end, self.total)
        if end <= start:
            return b""
        req = urllib.request.Request(
            self.url, headers={"Range": f"bytes={start}-{end - 1}", "User-Agent": USER_AGENT}
        )
        self.requests += 1
        try:
            with self._opener.open(req, timeout=self.deadline.left()) as resp:
                want = self._check_answer(resp, start, end)
                data = resp.read(want + 1)
        except BadInput:
            raise
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 416:
                raise self._fail(
                    f"the server has no bytes {start}-{end - 1} (HTTP 416): the file is "
                    "empty or truncated"
                ) from None
            raise self._fail(f"HTTP {e.code} {_quoted(e.reason)}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError | socket.timeout):
                raise self._timeout() from None
            if isinstance(e.reason, http.client.HTTPException):
                raise self._malformed(e.reason) from None
            raise self._fail(f"cannot connect: {_quoted(e.reason)}") from None
        except TimeoutError:
            raise self._timeout() from None
        except http.client.HTTPException as e:
            raise self._malformed(e) from None
        except (OSError, ValueError, OverflowError) as e:
            raise self._fail(f"the transfer failed: {_quoted(e)}") from None
        if len(data) < want:
            raise self._fail(
                f"the server sent {len(data):,} bytes for a range of {want:,}: truncated answer"
            )
        if len(data) > want:
            raise self._fail(f"the server sent more than the {want:,} bytes of its range")
        return data

    def _check_answer(self, resp: http.client.HTTPResponse, start: int, end: int) -> int:
        """How many bytes the answer must hold, once its status and ``Content-Range`` are
        an answer to ``bytes=start-(end-1)``."""
        if resp.status != 206:
            raise self._fail(
                f"the server does not answer Range requests (HTTP {resp.status} "
                "instead of 206 Partial Content); fit reads only the header and "
                "needs them"
            )
        said = resp.headers.get("Content-Range") or ""
        got = _RANGE.fullmatch(said.strip())
        if not got or int(got.group(1)) != start:
            raise self._fail(
                f"the server's Content-Range {_quoted(said)!r} does not answer "
                f"bytes={start}-{end - 1}"
            )
        first, last, total = (int(g) for g in got.groups())
        if total > MAX_FILE_BYTES:
            raise self._fail(
                f"the server's Content-Range says the file has {total} bytes: no file is that "
                f"large (at most {MAX_FILE_BYTES:,})"
            )
        if not first <= last < total:
            raise self._fail(
                f"the server's Content-Range {_quoted(said)!r} is not a range of the file"
            )
        if self.total is not None and total != self.total:
            raise self._fail(
                f"the file's size changed while reading ({self.total:,} then {total:,})"
            )
        self.total = total
        return min(end, total) - start

    def _malformed(self, e: http.client.HTTPException) -> BadInput:
        if isinstance(e, http.client.IncompleteRead):
            detail = f"the body ended after {len(e.partial):,} bytes, or its chunks are broken"
        elif isinstance(e, http.client.BadStatusLine):
            detail = f"its status line is {_quoted(getattr(e, 'line', ''))!r}"
        else:  # LineTooLong, too many headers, ...
            detail = _quoted(e) or type(e).__name__
        return self._fail(f"the server's answer is not valid HTTP: {detail}")

    def _timeout(self) -> BadInput:
        return self._fail(
            f"no answer within {self.timeout:g} s (timeout, for the whole header fetch)"
        )


def shard_urls(url: str) -> list[tuple[str, str]]:
    """``(url, file name)`` of every shard of the set ``url`` belongs to (itself alone when
    its name is not ``…-0000i-of-0000N.gguf``)."""
    parts = urllib.parse.urlsplit(url)
    name = urllib.parse.unquote(PurePosixPath(parts.path).name)
    if not name:
        raise BadInput("the URL names no file", url)
    m = SPLIT_RE.match(name)
    if not m:
        return [(url, name)]
    count = int(m.group("count"))
    if not 1 <= count <= MAX_SHARDS:
        raise BadInput(f"the split name says {count} shards (1 to {MAX_SHARDS})", url)
    out = []
    base = parts.path[: parts.path.rfind("/") + 1]
    for i in range(1, count + 1):
        shard = f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf"
        path = base + urllib.parse.quote(shard)
        out.append((urllib.parse.urlunsplit(parts._replace(path=path)), shard))
    return out


def _one_shard(
    url: str,
    name: str,
    folder: Path,
    timeout: float,
    deadline: Deadline,
    note: Callable[[str], None],
) -> tuple[RemoteShard, int]:
    reader = RangeReader(url, timeout, deadline)
    buf = reader.read(0, FIRST_READ)
    while True:
        try:
            extent = scan_header(buf)
            break
        except NeedMore as more:
            total = reader.total or 0
            if more.size > total:
                raise BadInput(
                    f"the file ends at byte {total:,}, inside its own header (it needs "
                    f"{more.size:,} bytes): truncated",
                    url,
                ) from None
            grow = max(more.size, 4 * len(buf))
            note(f"{name}: the header needs more than {len(buf):,} bytes, reading to {grow:,}")
            buf += reader.read(len(buf), grow)
        except NotGguf as e:
            raise BadInput(str(e), url) from None
    total = int(reader.total or len(buf))
    local = folder / name
    try:
        with open(local, "wb") as fh:
            fh.write(buf[: extent.index_end])
            fh.truncate(total)  # sparse: the tensor data is never fetched nor stored
    except OSError as e:
        raise BadInput(
            f"the server says the file has {total:,} bytes; its header's sparse mirror of that "
            f"size cannot be made here ({os_error_text(e)})",
            url,
        ) from None
    note(f"{name}: header and tensor index {extent.index_end:,} bytes of {total:,}")
    return RemoteShard(url, name, total, len(buf), extent, local), reader.requests


def fetch_index(
    url: str,
    folder: Path,
    timeout: float = 30.0,
    on_note: Callable[[str], None] | None = None,
) -> RemoteIndex:
    """Every shard's header and tensor index of the GGUF at ``url``, mirrored sparse into
    ``folder`` (the caller's temporary folder), all within ``timeout`` seconds; ``on_note``
    hears what is read as it goes."""
    note = on_note or (lambda _m: None)
    if not is_url(url):
        raise BadInput("not an http(s) URL", url)
    shards, requests = [], 0
    deadline = Deadline(timeout)  # the whole fetch, every shard and request in it
    for shard_url, name in shard_urls(url):
        shard, n = _one_shard(shard_url, name, folder, timeout, deadline, note)
        shards.append(shard)
        requests += n
    return RemoteIndex(url, shards, requests)
