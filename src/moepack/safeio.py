"""Writing outputs without ever losing data.

Every file moepack writes goes through ``AtomicOutputs``: each destination is written to a
temporary file beside it, fsynced, and only renamed into place once *all* destinations of
the operation are complete. On any exception or interrupt the temporaries are removed and
nothing at the destinations changes. Destinations that are (or would overwrite) an input are
refused before anything is opened for writing.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from .errors import BadInput, MoepackError


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_destination(
    dest: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]
) -> Path:
    """Refuse a destination that is an input or whose folder is missing; return it as a Path."""
    path = Path(dest)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"output folder {str(parent)!r} does not exist", path)
    if path.is_dir():
        raise BadInput("output path is a directory", path)
    for src in inputs:
        src_path = Path(src)
        if path.resolve() == src_path.resolve() or _same_file(path, src_path):
            raise BadInput(f"output would overwrite the input {str(src_path)!r}", path)
    if not os.access(parent, os.W_OK):
        raise BadInput(f"output folder {str(parent)!r} is not writable", path)
    return path


def check_free_space(folder: str | os.PathLike[str], needed: int, what: str) -> None:
    """Fail early, with a clear message, when ``needed`` bytes will not fit in ``folder``."""
    usage = shutil.disk_usage(folder)
    if usage.total == 0:  # ramfs and friends report no capacity at all: nothing to check
        return
    free = usage.free
    if needed > free:
        raise BadInput(
            f"not enough free space: {what} needs {needed:,} bytes, {free:,} are free", folder
        )


# Problems with the file a user named, in moepack's words rather than the C library's.
_OPEN_WORDS = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "no such file (a part of the path is not a folder)",
    errno.EISDIR: "is a folder, not a file",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
# A write that ran out of room: nothing is left behind, and the message says so.
_WRITE_WORDS = {
    errno.ENOSPC: "no space left on device (nothing was written)",
    errno.EDQUOT: "disk quota exceeded (nothing was written)",
    errno.EFBIG: "file too large for this filesystem (nothing was written)",
}


def os_error_text(exc: OSError) -> str:
    """The one wording of an OSError in moepack's messages (no path, lower-case)."""
    if exc.errno in _WRITE_WORDS:
        return _WRITE_WORDS[exc.errno]
    if exc.errno in _OPEN_WORDS:
        return _OPEN_WORDS[exc.errno]
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def describe_os_error(exc: OSError, path: str | os.PathLike[str] | None) -> MoepackError:
    """Map an OSError from reading or writing to a one-line user error (``BadInput`` when
    the file named cannot be opened as asked)."""
    target = path if path is not None else exc.filename
    if exc.errno in _OPEN_WORDS:
        return BadInput(os_error_text(exc), target)
    return MoepackError(os_error_text(exc), target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class AtomicOutputs:
    """A group of output files that appear together or not at all.

    Use as a context manager::

        with AtomicOutputs(inputs=[model]) as out:
            fh = out.open(dest)
            fh.write(...)
        # all destinations renamed into place here, after fsync

    Leaving the block by exception (including KeyboardInterrupt) removes every temporary.
    """

    def __init__(self, inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
        self._inputs = [Path(p) for p in inputs]
        self._pending: list[tuple[Path, Path, BinaryIO]] = []
        self._committed = False

    def open(self, dest: str | os.PathLike[str]) -> BinaryIO:
        """A writable binary file whose contents land at ``dest`` when the group commits."""
        path = check_destination(dest, self._inputs)
        if any(_same_file(path, d) or path.resolve() == d.resolve() for d, _, _ in self._pending):
            raise BadInput("the same output path is written twice", path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".moepack-tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual mode
        fh = os.fdopen(fd, "w+b")
        self._pending.append((path, Path(tmp), fh))
        return fh

    def __enter__(self) -> AtomicOutputs:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            try:
                self._commit()
            except BaseException:
                self._discard()
                raise
        else:
            self._discard()

    def _commit(self) -> None:
        for dest, _tmp, fh in self._pending:
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as e:
                raise describe_os_error(e, dest) from None
        for _dest, _tmp, fh in self._pending:
            fh.close()
        for dest, tmp, _fh in self._pending:
            os.replace(tmp, dest)
        for folder in {dest.parent for dest, _, _ in self._pending}:
            _fsync_dir(folder)
        self._committed = True

    def _discard(self) -> None:
        for _dest, tmp, fh in self._pending:
            try:
                fh.close()
            except OSError:
                pass
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._pending.clear()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(
    dest: str | os.PathLike[str], data: bytes, inputs: Sequence[str | os.PathLike[str]] = ()
) -> Path:
    """Write a small file atomically (plans, traces, manifests, surfaces)."""
    try:
        with AtomicOutputs(inputs) as out:
            out.open(dest).write(data)
    except OSError as e:
        raise describe_os_error(e, dest) from None
    return Path(dest)
