"""The corpus file that ``probe`` and ``kio`` read: created once, reused, removed on request.

Random bytes (so no layer below can compress or deduplicate them), written through a
temporary file and renamed into place, so an interrupted creation leaves nothing behind.
Its pages are dropped from the page cache right after creation: measurements start cold.

The name alone proves nothing — a user may have a file called ``moepack-corpus.bin``. A
corpus therefore starts with a mark (``MARK``, 32 bytes), and a file without it is never
reused, replaced or removed. The mark is *part of* the corpus, not a header before it: the
file stays a whole number of MiB and every request offset stays where it was, so O_DIRECT
alignment is unchanged; 32 non-random bytes in at least 1 MiB are read like the rest.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..pages import drop_cached
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import AtomicOutputs, check_free_space, describe_os_error, replacing

CORPUS_NAME = "moepack-corpus.bin"
MARK = b"moepack corpus v1\n".ljust(32, b"\0")  # the first bytes of every corpus
_CHUNK = 8 << 20
_GRAIN = 1 << 20  # corpus sizes are whole MiB: every request size up to 1 MiB divides them


@dataclass(frozen=True)
class Corpus:
    path: Path
    size: int
    created: bool  # False when an existing corpus of the right size was reused


def corpus_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / CORPUS_NAME


def is_corpus(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (not a link) that starts with the corpus mark."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size < len(MARK):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        head = os.pread(fd, len(MARK), 0)
        drop_cached(fd)  # measurements start cold: do not leave the first page cached
    except OSError:
        return False
    finally:
        os.close(fd)
    return head == MARK


def _refuse_unmarked(path: Path, what: str) -> None:
    """A file of the corpus's name that is not a corpus (a user's file, or a corpus of a
    moepack before the mark) is left alone: one line naming it."""
    if os.path.lexists(path) and not is_corpus(path):
        raise BadInput(f"not a moepack corpus (it lacks the corpus mark): {what}", path)


def check_directory(directory: str | os.PathLike[str], writable: bool = True) -> Path:
    """A clear error for a missing folder, a file, or (when writing) a read-only one."""
    d = Path(directory)
    if not d.exists():
        raise BadInput("directory does not exist", d)
    if not d.is_dir():
        raise BadInput("not a directory", d)
    if writable:
        why = unwritable(d)
        if why:
            raise BadInput(f"{why}; cannot create the corpus", d)
    return d


def unwritable(directory: str | os.PathLike[str]) -> str | None:
    """Why no file can be made in ``directory`` (a read-only filesystem, no permission)."""
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        return "directory is on a read-only filesystem"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "directory is not writable"
    return None


def ensure_corpus(
    directory: str | os.PathLike[str],
    size: int,
    progress: ProgressSink = NULL_PROGRESS,
    seed: int = 0x5EED,
) -> Corpus:
    """The corpus in ``directory`` of ``size`` bytes (rounded up to a MiB), made if needed."""
    if size < _GRAIN:
        raise BadInput(f"corpus size must be at least 1 MiB, got {size:,} bytes")
    size = -(-size // _GRAIN) * _GRAIN
    d = check_directory(directory, writable=False)
    path = corpus_path(d)
    _refuse_unmarked(path, "it is neither used nor replaced; move it away or use another folder")
    if path.exists() and path.stat().st_size == size:
        return Corpus(path, size, created=False)
    check_directory(d, writable=True)
    existing = path.stat().st_size if path.exists() else 0
    if os.statvfs(d).f_blocks:  # ramfs and the like report no capacity at all
        check_free_space(d, max(0, size - existing) + _CHUNK, f"a {size:,}-byte corpus")
    import numpy as np  # only making a corpus needs it (the engines listing checks files)

    rng = np.random.default_rng(seed)
    progress.start(f"creating corpus {path.name}", size)
    try:  # a corpus of another size is moepack's own (marked) scratch file: replaced
        with replacing(), AtomicOutputs() as out:
            fh = out.open(path)
            left = size
            while left:
                n = min(_CHUNK, left)
                chunk = rng.bytes(n)
                fh.write(MARK + chunk[len(MARK) :] if left == size else chunk)
                left -= n
                progress.advance(n)
    except OSError as e:
        raise describe_os_error(e, path) from None
    finally:
        progress.finish()
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cached(fd)
    finally:
        os.close(fd)
    return Corpus(path, size, created=True)


def remove_corpus(directory: str | os.PathLike[str]) -> Path | None:
    """Delete the corpus in ``directory``; the removed path, or ``None`` if there was none.
    A file of the corpus's name without the corpus mark is refused, never deleted."""
    d = check_directory(directory, writable=False)
    path = corpus_path(d)
    if not os.path.lexists(path):
        return None
    _refuse_unmarked(path, "not removed; delete it yourself if it should go")
    try:
        path.unlink()
    except OSError as e:
        raise describe_os_error(e, path) from None
    return path
