"""A remote GGUF's header and tensor index over HTTP Range requests, nothing more.

``fetch_index`` reads the first 64 KiB of each shard, scans how long the header is
(``header.scan_header``) and asks for exactly what is missing until the tensor index is
complete, so a 200 GB download costs a few MB to judge. A split set's shards are found by
name (``NAME-0000i-of-0000N.gguf`` beside the one given) and every one is read. Each shard's
header is written at the start of a sparse local file of the shard's full size (the size the
server's ``Content-Range`` gives), so ``MoeModel`` opens the mirror as it opens a download:
every tensor range is checked against the real file size, and no tensor byte is stored.

Redirects are followed (urllib's handler keeps the ``Range`` header). A server that ignores
``Range`` (a 200 with the whole file), an answer shorter than asked for, a header that runs
past the file's end, a file that is no GGUF, an HTTP error or no answer within ``timeout``
seconds is one ``BadInput`` naming the URL.
"""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..checkpoint.model import SPLIT_RE
from ..errors import BadInput
from .header import HeaderExtent, NeedMore, NotGguf, scan_header

FIRST_READ = (
    64 << 10
)  # grown fourfold (or to what the header says it needs) until it holds the index
MAX_SHARDS = 4096
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
USER_AGENT = "moepack-fit (HTTP Range: header and tensor index only)"


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


class RangeReader:
    """Byte ranges of one URL; counts its requests."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self.requests = 0
        self.total: int | None = None

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
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                if resp.status != 206:
                    raise self._fail(
                        f"the server does not answer Range requests (HTTP {resp.status} "
                        "instead of 206 Partial Content); fit reads only the header and "
                        "needs them"
                    )
                got = _RANGE.fullmatch((resp.headers.get("Content-Range") or "").strip())
                if not got or int(got.group(1)) != start:
                    raise self._fail(
                        "the server's Content-Range "
                        f"{resp.headers.get('Content-Range')!r} does not answer "
                        f"bytes={start}-{end - 1}"
                    )
                total = int(got.group(3))
                if self.total is not None and total != self.total:
                    raise self._fail(
                        f"the file's size changed while reading ({self.total:,} then {total:,})"
                    )
                self.total = total
                want = min(end, total) - start
                data = resp.read(want + 1)
        except BadInput:
            raise
        except urllib.error.HTTPError as e:
            if e.code == 416:
                raise self._fail(
                    f"the server has no bytes {start}-{end - 1} (HTTP 416): the file is "
                    "empty or truncated"
                ) from None
            raise self._fail(f"HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError | socket.timeout):
                raise self._timeout() from None
            raise self._fail(f"cannot connect: {e.reason}") from None
        except TimeoutError:
            raise self._timeout() from None
        except (OSError, ValueError) as e:
            raise self._fail(f"the transfer failed: {e}") from None
        if len(data) != want:
            raise self._fail(
                f"the server sent {len(data):,} bytes for a range of {want:,}: truncated answer"
            )
        return data

    def _timeout(self) -> BadInput:
        return self._fail(f"no answer within {self.timeout:g} s (timeout)")


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
    url: str, name: str, folder: Path, timeout: float, note: Callable[[str], None]
) -> tuple[RemoteShard, int]:
    reader = RangeReader(url, timeout)
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
    with open(local, "wb") as fh:
        fh.write(buf[: extent.index_end])
        fh.truncate(total)  # sparse: the tensor data is never fetched nor stored
    note(f"{name}: header and tensor index {extent.index_end:,} bytes of {total:,}")
    return RemoteShard(url, name, total, len(buf), extent, local), reader.requests


def fetch_index(
    url: str,
    folder: Path,
    timeout: float = 30.0,
    on_note: Callable[[str], None] | None = None,
) -> RemoteIndex:
    """Every shard's header and tensor index of the GGUF at ``url``, mirrored sparse into
    ``folder`` (the caller's temporary folder); ``on_note`` hears what is read as it goes."""
    note = on_note or (lambda _m: None)
    if not is_url(url):
        raise BadInput("not an http(s) URL", url)
    shards, requests = [], 0
    for shard_url, name in shard_urls(url):
        shard, n = _one_shard(shard_url, name, folder, timeout, note)
        shards.append(shard)
        requests += n
    return RemoteIndex(url, shards, requests)
