"""Read modes (buffered, O_DIRECT, RWF_DONTCACHE) and opening a file for one of them.

Opening checks that the filesystem really serves the mode (a trial read), so an unsupported
mode is a clear ``ModeUnsupported`` naming the filesystem, not a confusing error mid-run.
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from ..errors import BadInput
from ..safeio import os_error_text
from .device import block_logical_size, describe_device
from .linux import PAGE_SIZE, RWF_DONTCACHE, DioAlign, advise_random, statx_dio_align


class Mode(enum.StrEnum):
    """How a read goes through (or around) the page cache."""

    BUFFERED = "buffered"
    DIRECT = "direct"
    DONTCACHE = "dontcache"

    @property
    def label(self) -> str:
        return {"buffered": "buffered", "direct": "O_DIRECT", "dontcache": "DONTCACHE"}[self.value]


class ModeUnsupported(BadInput):
    """This filesystem (or kernel) cannot serve the requested mode."""


def _fs_name(path: Path) -> str:
    try:
        return describe_device(path).filesystem
    except OSError:
        return "this filesystem"


def dio_alignment(path: str | os.PathLike[str], fd: int | None = None) -> DioAlign:
    """O_DIRECT alignment for ``path``: statx DIOALIGN, else the block device's logical block
    size, else (given an O_DIRECT descriptor) the smallest power of two a trial read accepts."""
    p = Path(path)
    found = statx_dio_align(p)
    if found is not None:
        if found.offset == 0:
            raise ModeUnsupported(
                f"{_fs_name(p)} does not support O_DIRECT for this file "
                "(statx reports no direct-I/O alignment)",
                p,
            )
        return found
    lbs = block_logical_size(p)
    if lbs:
        return DioAlign(mem=lbs, offset=lbs, source="block device")
    if fd is not None:
        size = os.fstat(fd).st_size
        a = 512
        while a <= PAGE_SIZE:
            try:
                _trial_read(fd, a, 0, offset=a if size >= 2 * a else 0)
                return DioAlign(mem=a, offset=a, source="trial reads")
            except OSError:
                a *= 2
    raise ModeUnsupported(
        f"{_fs_name(p)} reports no O_DIRECT alignment (no statx DIOALIGN, no block device, "
        "no aligned trial read succeeded)",
        p,
    )


@dataclass
class OpenFile:
    """A file opened for one mode; engines read through ``fd`` with ``rw_flags``."""

    path: Path
    fd: int
    mode: Mode
    size: int
    align: DioAlign | None = None
    rw_flags: int = 0
    _closed: bool = field(default=False, repr=False)

    @property
    def offset_align(self) -> int:
        """Offsets and lengths must be multiples of this (1 outside O_DIRECT)."""
        return self.align.offset if self.align else 1

    @property
    def mem_align(self) -> int:
        return self.align.mem if self.align else 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _trial_read(fd: int, length: int, flags: int, offset: int = 0) -> None:
    buf = mmap.mmap(-1, max(length, PAGE_SIZE))
    view = memoryview(buf)
    try:
        os.preadv(fd, [view[:length]], offset, flags)
    finally:
        view.release()
        buf.close()


def open_file(path: str | os.PathLike[str], mode: Mode, random_access: bool = True) -> OpenFile:
    """Open ``path`` read-only for ``mode``; raise ``ModeUnsupported`` when it cannot be served.

    ``random_access`` turns readahead off (as fio does for random reads) so a buffered read
    brings in only the bytes asked for.
    """
    p = Path(path)
    if not p.exists():
        raise BadInput("file does not exist", p)
    if not p.is_file():
        raise BadInput("not a regular file", p)
    align: DioAlign | None = None
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    rw_flags = 0
    if mode is Mode.DIRECT:
        o_direct = getattr(os, "O_DIRECT", None)
        if o_direct is None:
            raise ModeUnsupported("this platform has no O_DIRECT", p)
        flags |= o_direct
    elif mode is Mode.DONTCACHE:
        rw_flags = RWF_DONTCACHE
    try:
        fd = os.open(p, flags)
    except OSError as e:
        if mode is Mode.DIRECT and e.errno == errno.EINVAL:
            raise ModeUnsupported(f"{_fs_name(p)} does not support O_DIRECT", p) from None
        raise BadInput(os_error_text(e), p) from None
    try:
        size = os.fstat(fd).st_size
        if mode is Mode.DIRECT:
            align = dio_alignment(p, fd)
            try:
                _trial_read(fd, align.offset, 0)
            except OSError as e:
                raise ModeUnsupported(
                    f"{_fs_name(p)} refused an aligned O_DIRECT read ({os_error_text(e)})", p
                ) from None
        elif mode is Mode.DONTCACHE:
            try:
                _trial_read(fd, 1, RWF_DONTCACHE)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise ModeUnsupported(
                        f"{_fs_name(p)} does not support RWF_DONTCACHE reads "
                        "(needs Linux 6.14+ and filesystem support)",
                        p,
                    ) from None
                raise
        if random_access and mode is not Mode.DIRECT:
            advise_random(fd)
    except BaseException:
        os.close(fd)
        raise
    return OpenFile(path=p, fd=fd, mode=mode, size=size, align=align, rw_flags=rw_flags)
