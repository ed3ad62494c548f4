"""Writing outputs without ever losing data.

Every file moepack writes goes through ``AtomicOutputs``: each destination is written to a
temporary file beside it, fsynced, and switched into place only once *all* destinations of
the operation are complete — as a whole: several outputs commit through a journal (see
``leftovers``), so even a kill mid-switch leaves all old or, after the next run into that
folder, all new files. A folder output (``AtomicOutputs.folder``) is built whole beside its
destination and switched in by exchanging the two names in one system call (``swap``), so
a reader of it never meets a mix at all. A reader of a group of outputs calls
``settle_for_reading`` first: a journal a killed run left there is finished, or refused. On any exception or interrupt the temporaries are removed and nothing
at the destinations changes; after a kill the next run removes them and says so.
Destinations that are (or would overwrite) an input are refused before anything is opened
for writing, and so is a destination where a file already exists unless replacing was asked
for (``replacing``: the command line's ``--force``); that is the one rule for every output.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from . import leftovers, swap
from .errors import BadInput, MoepackError
from .interrupts import deferred


def real(path: str | os.PathLike[str]) -> Path:
    """``path`` with symlinks resolved, as far as they go: a symlink loop is left as it is
    (``Path.resolve`` raises ``RuntimeError`` on one), so comparing paths never crashes."""
    return Path(os.path.realpath(path))


_replace_existing = False


@contextmanager
def replacing(allowed: bool = True) -> Iterator[None]:
    """Within this block, an output may replace a file that exists at its destination (what
    ``--force`` asks for); outside, ``check_destination`` refuses one. ``allowed=False``
    changes nothing (an outer block's permission stands), so a flag can be passed as it is.
    Process-wide, not per thread: a command is one process, and writers may use threads."""
    global _replace_existing
    before = _replace_existing
    _replace_existing = before or allowed
    try:
        yield
    finally:
        _replace_existing = before


def replacing_allowed() -> bool:
    """Whether outputs may replace existing files here (inside ``replacing``)."""
    return _replace_existing


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


_SPECIAL = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def check_destination(
    dest: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]]
) -> Path:
    """Refuse a destination that is an input, whose folder is missing, or where a file exists
    (unless ``replacing``); return it as a Path."""
    path = Path(dest)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"output folder {str(parent)!r} does not exist", path)
    if path.is_dir():
        raise BadInput("output path is a directory", path)
    if path.is_symlink() and not path.exists() and real(path) == path.absolute():
        raise BadInput("output path is a symlink that loops", path)
    try:
        mode = path.stat().st_mode  # through a symlink: what the name stands for
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        # a device, FIFO or socket: an output switched into place by rename would replace it
        kind = next((name for test, name in _SPECIAL if test(mode)), "a special file")
        raise BadInput(
            f"output path is {kind}, not a regular file; moepack writes over regular files only",
            path,
        )
    for src in inputs:
        src_path = Path(src)
        if real(path) == real(src_path) or _same_file(path, src_path):
            raise BadInput(f"output would overwrite the input {str(src_path)!r}", path)
    if not _replace_existing and (path.exists() or path.is_symlink()):
        raise BadInput("a file already exists here; pass `force` to replace it", path)
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


def _default_notice(message: str) -> None:
    warnings.warn(message, LeftoversSwept, stacklevel=3)


class LeftoversSwept(UserWarning):
    """A folder held what a killed moepack run left; it was finished or removed."""


_notice: Callable[[str], None] = _default_notice
_swept: set[Path] = set()
_written: list[Path] = []


def set_notice(hook: Callable[[str], None]) -> None:
    """Where sweeping says what it did to a folder (the CLI prints one warning line)."""
    global _notice
    _notice = hook


def written_outputs() -> list[Path]:
    """Every destination this process has put in place, in order (to say what an interrupt
    that came after the work did not undo)."""
    return list(_written)


def sweep_folder(folder: str | os.PathLike[str]) -> leftovers.Swept:
    """Finish or remove what killed moepack runs left in ``folder`` (once per process)."""
    path = real(folder if str(folder) else ".")
    if path in _swept:
        return leftovers.Swept(path)
    _swept.add(path)
    done = leftovers.Swept(path)
    try:  # not deferred: every step may be redone, so an interrupt may stop it anywhere
        leftovers.sweep(path, done)
    finally:  # what was done before an interrupt is said too
        if done:
            _notice(done.message())
    return done


SETTLE_WAIT = 2.0
"""Seconds a reader waits for a live run's commit (its renames take milliseconds) to end."""


def settle_for_reading(folder: str | os.PathLike[str]) -> None:
    """Before reading a group of outputs in ``folder``: a commit a killed run left half done
    there is finished when this process may write there (and said in one warning line), and
    refused in one line where it may not; a live run's commit is waited for, briefly."""
    path = real(folder if str(folder) else ".")
    pending = leftovers.pending_journals(path)
    deadline = time.monotonic() + SETTLE_WAIT
    while any(j.alive for j in pending) and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = leftovers.pending_journals(path)
    if not pending:
        return
    live = [j for j in pending if j.alive]
    if live:
        raise BadInput(
            f"a moepack run (pid {live[0].pid}) is switching outputs into this folder right now "
            f"({live[0].name}); read them once it has finished",
            path,
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise BadInput(
            f"a killed moepack run left a commit half done here ({pending[0].name}): the files "
            "may be a mix of old and new ones; run any moepack command that writes into this "
            "folder, as a user who may write here, to finish it",
            path,
        )
    done = leftovers.Swept(path)
    try:
        leftovers.finish_journals(path, done)
    finally:
        if done:
            _notice(done.message())


@dataclass
class _Pending:
    dest: Path
    tmp: Path
    fh: BinaryIO | None  # None: a staged path or an adopted file the caller wrote


class AtomicOutputs:
    """A group of outputs that appear together or not at all.

    Use as a context manager::

        with AtomicOutputs(inputs=[model]) as out:
            fh = out.open(dest)                  # a file object, or
            name = out.staged_path(dest2)        # a name for a writer that opens files itself
            fh.write(...)
        # everything switched into place here, after fsync

    Each temporary is named after its owning process (``leftovers``) and owned by the group
    from the instant it exists. One output commits by one rename; several commit through a
    journal that the next run into each of their folders finishes there if this process is
    killed mid-way, so the destinations hold all old or all new files. Leaving the block by
    exception (including ``KeyboardInterrupt``) removes every temporary and changes nothing.
    """

    def __init__(self, inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
        self._inputs = [Path(p) for p in inputs]
        self._pending: list[_Pending] = []
        self._removes: list[Path] = []
        self._staged_dirs: list[Path] = []
        self._folder: _FolderOutput | None = None
        self._committed = False

    @property
    def committed(self) -> bool:
        """True once every output is in place."""
        return self._committed

    def _claim(self, dest: str | os.PathLike[str]) -> Path:
        path = check_destination(dest, self._inputs)
        if any(_same_file(path, p.dest) or real(path) == real(p.dest) for p in self._pending):
            raise BadInput("the same output path is written twice", path)
        sweep_folder(path.parent)
        return path

    def open(self, dest: str | os.PathLike[str]) -> BinaryIO:
        """A writable binary file whose contents land at ``dest`` when the group commits."""
        path = self._claim(dest)
        with deferred():  # created and owned in one step: an interrupt cannot fall between
            tmp = path.parent / leftovers.temp_name(path.name)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 & ~_umask())
            entry = _Pending(path, tmp, None)
            self._pending.append(entry)
            entry.fh = os.fdopen(fd, "w+b")
        return entry.fh

    def staged_path(self, dest: str | os.PathLike[str]) -> Path:
        """A name beside ``dest`` for a writer that creates the file itself (gguf-py's
        ``GGUFWriter``, llama.cpp's quantiser); it lands at ``dest`` when the group commits."""
        path = self._claim(dest)
        with deferred():
            tmp = path.parent / leftovers.temp_name(path.name)
            self._pending.append(_Pending(path, tmp, None))
        return tmp

    def staged_dir(self, folder: str | os.PathLike[str]) -> Path:
        """An empty scratch folder inside ``folder``, removed with the group: for writers
        that make several files at once (split GGUF shards); ``adopt`` what should stay."""
        where = Path(folder if str(folder) else ".")
        sweep_folder(where)
        with deferred():
            path = where / leftovers.temp_name("moepack-staging")
            self._staged_dirs.append(path)
            path.mkdir()
        return path

    def adopt(self, staged: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
        """Make the finished file ``staged`` (typically in a ``staged_dir``) land at ``dest``
        when the group commits. It moves beside ``dest`` now (copied across filesystems)."""
        src = Path(staged)
        tmp = self.staged_path(dest)
        with deferred():
            try:
                os.rename(src, tmp)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                shutil.copyfile(src, tmp)
                src.unlink()

    def folder(
        self, dest: str | os.PathLike[str], carry_over: Callable[[str], bool] | None = None
    ) -> Path:
        """An empty folder beside ``dest`` to build a folder output in (files written there
        directly, each closed by the caller); at the commit every file in it is fsynced and
        it replaces ``dest`` whole (``swap.exchange``), the old folder removed after. Entries
        of the old folder ``carry_over`` accepts (files a user keeps there) are hard-linked
        into the new one first. The group holds nothing else."""
        if self._pending or self._removes or self._folder is not None:
            raise ValueError("a folder output commits alone")
        path = Path(dest)
        where = path.parent if str(path.parent) else Path(".")
        if not where.is_dir():
            raise BadInput(f"output folder {str(where)!r} does not exist", path)
        if os.path.lexists(path) and not path.is_dir():
            raise BadInput("output path exists and is not a folder", path)
        sweep_folder(where)
        with deferred():
            staged = where / leftovers.temp_name(path.name)
            self._folder = _FolderOutput(path, staged, carry_over or (lambda _name: False))
            staged.mkdir()
        return staged

    def remove_on_commit(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` as part of the commit (a stale file the new outputs replace)."""
        p = Path(path)
        sweep_folder(p.parent)
        self._removes.append(p)

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
        if self._folder is not None:
            self._commit_folder(self._folder)
            return
        for p in self._pending:  # make every byte durable first: this part may be interrupted
            try:
                if p.fh is not None:
                    p.fh.flush()
                    os.fsync(p.fh.fileno())
                    p.fh.close()
                else:
                    _fsync_file(p.tmp)
            except FileNotFoundError:
                raise MoepackError("the writer did not create its output", p.dest) from None
            except OSError as e:
                raise describe_os_error(e, p.dest) from None
        journal = leftovers.Journal(
            renames=[(p.tmp, p.dest) for p in self._pending],
            removes=list(self._removes),
            cleanup=list(self._staged_dirs),
        )
        with deferred():  # the switch runs whole; an interrupt is raised after it
            try:
                if len(journal.renames) + len(journal.removes) > 1:
                    journal.write()
                    leftovers.kill_point("commit-journal")
                journal.apply()
            except OSError as e:
                where = journal.renames[0][1] if journal.renames else None
                raise describe_os_error(e, where) from None
            self._committed = True
            _forget_inside(self._staged_dirs)
            _written.extend(p.dest for p in self._pending)
            self._pending.clear()
            self._staged_dirs.clear()
            self._removes.clear()

    def _commit_folder(self, f: _FolderOutput) -> None:
        try:
            _fsync_tree(f.staged)
        except OSError as e:
            raise describe_os_error(e, f.dest) from None
        with deferred():  # the switch runs whole; an interrupt is raised after it
            try:
                f.switch()
            except OSError as e:
                raise describe_os_error(e, f.dest) from None
            self._committed = True
            self._folder = None
            _written.append(f.dest)

    def _discard(self) -> None:
        if self._folder is not None:
            with deferred():
                if not self._folder.begun:
                    shutil.rmtree(self._folder.staged, ignore_errors=True)
                self._folder = None
        with deferred():  # all of the cleanup, even when a second signal comes
            for p in self._pending:
                if p.fh is not None:
                    try:
                        p.fh.close()
                    except OSError:
                        pass
                try:
                    p.tmp.unlink()
                except FileNotFoundError:
                    pass
            for d in self._staged_dirs:
                shutil.rmtree(d, ignore_errors=True)
            _forget_inside(self._staged_dirs)
            self._pending.clear()
            self._staged_dirs.clear()
            self._removes.clear()


@contextmanager
def scratch_file(folder: str | os.PathLike[str], what: str) -> Iterator[Path]:
    """An empty file of the caller's own (never an output) in ``folder``, named after this
    process like every temporary, owned from the instant it exists and removed afterwards."""
    where = Path(folder if str(folder) else ".")
    sweep_folder(where)
    path = where / leftovers.temp_name(what)
    try:
        with deferred():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        yield path
    finally:
        with deferred():
            path.unlink(missing_ok=True)


def _forget_inside(folders: list[Path]) -> None:
    """Files a nested group committed into a staging folder are not outputs the user has: they
    were moved on (adopted) or removed with the folder."""
    if folders:
        _written[:] = [p for p in _written if not any(p.is_relative_to(d) for d in folders)]


@dataclass
class _FolderOutput:
    """A folder built at ``staged`` that replaces ``dest`` whole."""

    dest: Path
    staged: Path
    carry_over: Callable[[str], bool]
    # the switch began and may not be undone by removing ``staged`` (it holds the old folder,
    # or the new one a journal still names)
    begun: bool = False

    def switch(self) -> None:
        """Put the new folder in place: one exchange of names (or, into an empty spot, one
        rename); where the filesystem refuses the exchange, two renames under a journal.
        Once the new folder is in place, removing the old one is best effort (what is left
        is a dead process's temporary for the next run)."""
        parent = self.staged.parent
        leftovers.kill_point("folder-staged")
        if not os.path.lexists(self.dest):
            os.rename(self.staged, self.dest)
            leftovers.fsync_dir(parent)
            return
        old = os.stat(self.dest)
        os.chmod(self.staged, stat.S_IMODE(old.st_mode))
        for name in sorted(os.listdir(self.dest)):
            if self.carry_over(name):  # the same file, a second name in the new folder
                os.link(self.dest / name, self.staged / name, follow_symlinks=False)
        leftovers.fsync_dir(self.staged)
        try:
            swap.exchange(self.staged, self.dest)
        except swap.ExchangeUnsupported:
            self._two_renames(parent)
            return
        self.begun = True
        leftovers.fsync_dir(parent)
        leftovers.kill_point("folder-exchanged")
        try:
            _remove_tree(self.staged)  # the old folder, now at the staging name
        except OSError:
            pass

    def _two_renames(self, parent: Path) -> None:
        aside = parent / leftovers.temp_name(self.dest.name)
        journal = leftovers.Journal(
            renames=[], switches=[(self.staged, self.dest, aside)], cleanup=[aside, self.staged]
        )
        journal.write()
        leftovers.kill_point("folder-journal")
        try:
            journal.apply()
        except OSError:
            if os.path.lexists(self.dest):  # the old folder is where it was: undecided
                for copy in journal.copies:
                    copy.unlink(missing_ok=True)
                raise
            try:  # old aside, new not in: put the old one back
                os.rename(aside, self.dest)
            except OSError:  # leave it all to the journal: the next run puts the new one in
                self.begun = True
                raise
            for copy in journal.copies:
                copy.unlink(missing_ok=True)
            raise


def _remove_tree(folder: Path) -> None:
    """Remove a folder of files (the old side of a switch), never following a symlink."""
    for n, name in enumerate(sorted(os.listdir(folder))):
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        if n == 0:
            leftovers.kill_point("folder-removing")
    folder.rmdir()


def _fsync_tree(folder: Path) -> None:
    """Make every file of a staged folder, and the folder itself, durable."""
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            _fsync_file(Path(entry.path))
    leftovers.fsync_dir(folder)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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
