"""Temporaries that name their owner, commit journals, and sweeping what a dead run left.

Every temporary moepack makes is called ``.<what>.<pid>-<start>-<random>.moepack-tmp``, where
``start`` is the owning process's start time (``/proc/PID/stat`` field 22, clock ticks since
boot), so a pid reused by another process is not mistaken for the owner. A group of outputs
switches into place by a *journal*, ``.moepack-commit.<pid>-<start>-<random>.moepack-journal``,
written (fsynced, renamed) into every folder the group touches before the first rename: once
one exists, the group is decided, and whoever finds the journal of a dead process — the next
run that writes into that folder — finishes the renames in that folder (each folder has its
copy, and a journal never reaches beyond its own folder). Temporaries of dead processes
without a journal are removed. Both are reported, since they are the user's disk.

A folder output switches by exchanging two names (``swap``) and needs no journal; where the
filesystem refuses the exchange its journal holds a *switch* (``staged``, ``dest``,
``aside``): the old folder is renamed aside, then the new one into place, and a run that
finds the journal finishes only the second rename (the destination is missing) or leaves the
old folder (it is still there), then removes what is left.

``kill_point`` is a test hook: ``MOEPACK_KILL_AT=<step>`` makes the process SIGKILL itself at
that step of a commit, so tests stop a real run at each of its riskiest instants.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import one_line
from .interrupts import deferred

TMP_SUFFIX = ".moepack-tmp"
JOURNAL_SUFFIX = ".moepack-journal"
# DOTALL and fullmatch: an output named with a newline has a temporary named with one too
_OWNED = re.compile(
    r"\.(?P<what>.*)\.(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]+\.moepack-(?P<kind>tmp|journal)",
    re.DOTALL,
)
_JOURNAL_KEY = "moepack_commit"
PID_MAX = (1 << 31) - 1
"""The largest pid a process can have (pid_t); a name claiming a larger one has no owner."""
MAX_JOURNAL_BYTES = 16 << 20
"""A journal lists one group's renames: more than this is not one moepack wrote."""
KILL_AT = "MOEPACK_KILL_AT"


def kill_point(step: str) -> None:
    """SIGKILL this process here when ``$MOEPACK_KILL_AT`` names ``step`` (tests only)."""
    if os.environ.get(KILL_AT) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (0 where /proc is missing), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:  # no /proc, or another user's process hidden (hidepid): ask the kernel
        return _exists_without_proc(pid)
    fields = raw[raw.rfind(b")") + 2 :].split()
    if fields[0] == b"Z":  # a zombie has finished: what it owned is no one's now
        return None
    return int(fields[19])  # field 22 of stat; 20 after "pid (comm)" and counting from 0


def _exists_without_proc(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0
    return 0


_own: tuple[int, str] | None = None


def owner_tag() -> str:
    """``<pid>-<start>`` of this process (recomputed after a fork)."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:
        _own = (pid, f"{pid}-{process_start(pid) or 0}")
    return _own[1]


def temp_name(what: str, suffix: str = TMP_SUFFIX) -> str:
    """A hidden name for a temporary of ``what`` that says which process owns it."""
    return f".{what}.{owner_tag()}-{os.urandom(4).hex()}{suffix}"


def _owner_gone(pid: int, start: int) -> bool:
    if not 0 < pid <= PID_MAX:  # no process has this pid (os.kill would overflow on it)
        return True
    now = process_start(pid)
    return now is None or (now != start and now != 0 and start != 0)


def is_temporary(name: str) -> bool:
    """True for the name of a temporary or journal of any moepack run."""
    return _OWNED.fullmatch(name) is not None


@dataclass
class Journal:
    """What one group commit does, in order: renames, then removals, then cleanup."""

    renames: list[tuple[Path, Path]]
    removes: list[Path] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)  # staging folders, removed at the end
    copies: list[Path] = field(default_factory=list)  # the journal files themselves
    # folder outputs where the exchange is refused: (staged, dest, aside), see the module doc
    switches: list[tuple[Path, Path, Path]] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)  # switches a finisher found not begun

    def encode(self) -> bytes:
        doc = {
            _JOURNAL_KEY: 1,
            "renames": [[str(a), str(b)] for a, b in self.renames],
            "switches": [[str(a), str(b), str(c)] for a, b, c in self.switches],
            "removes": [str(p) for p in self.removes],
            "cleanup": [str(p) for p in self.cleanup],
            "copies": [str(p) for p in self.copies],
        }
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, data: bytes) -> Journal:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get(_JOURNAL_KEY) != 1:
            raise ValueError("not a moepack commit journal")
        return cls(
            renames=[(Path(a), Path(b)) for a, b in doc["renames"]],
            removes=[Path(p) for p in doc["removes"]],
            cleanup=[Path(p) for p in doc["cleanup"]],
            copies=[Path(p) for p in doc["copies"]],
            switches=[(Path(a), Path(b), Path(c)) for a, b, c in doc.get("switches", [])],
        )

    def within(self, folder: Path) -> Journal:
        """Only the steps inside ``folder``: what a sweep of that folder may carry out. A
        journal is a file anyone who can write to the folder could have put there, so it
        never reaches beyond it; every folder of a group holds its own copy."""
        here = _real(folder)

        def inside(p: Path) -> bool:
            return _real(p.parent) == here and is_temporary(p.name)

        return Journal(
            renames=[(a, b) for a, b in self.renames if inside(a) and _real(b.parent) == here],
            removes=[p for p in self.removes if _real(p.parent) == here],
            cleanup=[p for p in self.cleanup if inside(p)],
            copies=[p for p in self.copies if inside(p)],
            switches=[
                (a, b, c)
                for a, b, c in self.switches
                if inside(a) and inside(c) and _real(b.parent) == here
            ],
        )

    def folders(self) -> list[Path]:
        dests = [b for _a, b in self.renames] + [b for _a, b, _c in self.switches]
        return list(parents(dests + self.removes))

    def write(self) -> None:
        """Put a copy of the journal into every folder the group touches, durably."""
        self.copies = [f / temp_name("moepack-commit", JOURNAL_SUFFIX) for f in self.folders()]
        data = self.encode()
        try:
            for copy in self.copies:
                part = copy.parent / temp_name("moepack-commit")
                try:
                    with open(part, "wb") as fh:
                        fh.write(data)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(part, copy)
                finally:
                    part.unlink(missing_ok=True)
            for folder in self.folders():
                fsync_dir(folder)
        except BaseException:  # undecided: no copy may survive to be finished later
            for copy in self.copies:
                copy.unlink(missing_ok=True)
            raise

    def apply(self, finishing: bool = False) -> list[Path]:
        """Do (or, ``finishing`` a dead run's, finish) the commit; every step may already have
        been done. Returns the destinations it put in place."""
        placed = []
        for n, (tmp, dest) in enumerate(self.renames):
            try:
                os.replace(tmp, dest)
                placed.append(dest)
            except FileNotFoundError:  # renamed before the owner stopped
                pass
            if n == 0:
                kill_point("commit-renamed-first")
        for staged, dest, aside in self.switches:
            if not finishing and os.path.lexists(dest):
                os.rename(dest, aside)  # a finisher never moves the user's folder
                kill_point("switch-aside")
            if finishing and os.path.lexists(staged) and os.path.lexists(dest):
                self.kept.append(dest)  # not begun: the old folder stays, the new one goes
            if os.path.lexists(staged) and not os.path.lexists(dest):
                os.rename(staged, dest)  # the old one is aside: the new one goes in
                placed.append(dest)
                kill_point("switch-placed")
        for path in self.removes:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        for folder in self.folders():
            fsync_dir(folder)
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        for copy in self.copies:
            try:
                copy.unlink()
            except FileNotFoundError:
                pass
        for folder in self.folders():
            fsync_dir(folder)
        return placed


def _real(path: Path) -> Path:
    """Symlinks resolved as far as they go (a loop does not raise, as ``Path.resolve`` does)."""
    return Path(os.path.realpath(path))


def fsync_dir(folder: Path) -> None:
    """Make renames in ``folder`` durable (best effort where a folder cannot be opened)."""
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


@dataclass
class Swept:
    """What a sweep of one folder did."""

    folder: Path
    completed: list[Path] = field(default_factory=list)  # outputs an interrupted commit placed
    kept: list[Path] = field(default_factory=list)  # folders a commit killed before its switch
    finished: list[str] = field(default_factory=list)  # journals carried out and removed
    removed: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes)
    unreadable: list[str] = field(default_factory=list)  # journals that could not be read

    def __bool__(self) -> bool:
        return bool(self.completed or self.kept or self.finished or self.removed or self.unreadable)

    def message(self) -> str:
        """One line saying what was done to the user's folder."""
        parts = []
        if self.completed:
            names = ", ".join(p.name for p in self.completed)
            parts.append(f"finished an interrupted commit (put in place: {names})")
        if self.kept:
            names = ", ".join(p.name for p in self.kept)
            parts.append(
                f"dropped an interrupted commit that had not switched {names} (kept as it was)"
            )
        if self.finished and not self.completed and not self.kept:
            # killed after its renames: only the journal was left
            parts.append(
                "finished an interrupted commit (its outputs were already in place; removed "
                f"its journal {', '.join(self.finished)})"
            )
        if self.removed:
            total = sum(n for _name, n in self.removed)
            names = ", ".join(name for name, _n in self.removed)
            parts.append(
                f"removed {len(self.removed)} leftover(s) of killed runs, {total:,} bytes: {names}"
            )
        if self.unreadable:
            parts.append(f"removed unreadable commit journal(s): {', '.join(self.unreadable)}")
        # a leftover of an output named with a newline is named with one: shown escaped
        return one_line(f"{self.folder}: " + "; ".join(parts))


def sweep(folder: Path, done: Swept | None = None) -> Swept:
    """Finish the commits and remove the temporaries of moepack runs in ``folder`` whose
    process is gone. Live processes' files are never touched. ``done`` (when given) is filled
    as the sweep goes, so an interrupt can still say what was done before it."""
    done = done if done is not None else Swept(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return done
    dead = []
    for name in names:
        m = _OWNED.fullmatch(name)
        if m and _owner_gone(int(m["pid"]), int(m["start"])):
            dead.append((name, m["kind"]))
    for name, kind in dead:  # journals first: they still need their temporaries
        if kind == "journal":
            _replay(folder / name, done)
    for name, kind in dead:
        path = folder / name
        if kind == "tmp" and os.path.lexists(path):
            size = _size(path)
            with deferred():  # one removal and its record, whole: what is said was done
                if _remove(path):
                    done.removed.append((name, size))
    return done


@dataclass(frozen=True)
class PendingJournal:
    """A commit journal found in a folder: a group of outputs that may be half switched."""

    name: str
    pid: int
    alive: bool  # its owner still runs: the commit is under way right now


def pending_journals(folder: Path) -> list[PendingJournal]:
    """The commit journals in ``folder``, live owners' and dead ones' alike."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        m = _OWNED.fullmatch(name)
        if m and m["kind"] == "journal":
            pid, start = int(m["pid"]), int(m["start"])
            found.append(PendingJournal(name, pid, not _owner_gone(pid, start)))
    return found


def finish_journals(folder: Path, done: Swept) -> None:
    """Carry out the journals dead runs left in ``folder`` (the first part of a sweep, for a
    reader: temporaries are left to the next writer)."""
    for journal in pending_journals(folder):
        if not journal.alive:
            _replay(folder / journal.name, done)


def _replay(path: Path, done: Swept) -> None:
    try:
        data = read_journal(path)
    except FileNotFoundError:  # another run finished it just now
        return
    except IsADirectoryError:  # not a file moepack makes: not ours to remove
        return
    except OSError:  # a FIFO, a device, a symlink, too long: not a journal moepack wrote
        data = None
    try:
        journal = Journal.decode(data) if data is not None else None
    except (ValueError, KeyError, TypeError, RecursionError):  # forged, nested
        journal = None
    if journal is None:
        done.unreadable.append(path.name)
        _unlink(path)
        return
    try:
        mine = journal.within(path.parent)
        done.completed.extend(mine.apply(finishing=True))
        done.kept.extend(mine.kept)
    except OSError:  # a step that cannot be done (a rename onto a folder): forged
        done.unreadable.append(path.name)
        _unlink(path)
        return
    _unlink(path)  # apply removed it already when it lists itself among its copies
    done.finished.append(path.name)


def read_journal(path: Path) -> bytes:
    """A journal's bytes: a regular file (a symlink is not followed, a FIFO not waited on)
    of at most ``MAX_JOURNAL_BYTES``; ``OSError`` otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_JOURNAL_BYTES:
            raise OSError(f"{path} is not a journal")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_JOURNAL_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_JOURNAL_BYTES:
        raise OSError(f"{path} is not a journal")
    return data


def _unlink(path: Path) -> bool:
    """Remove the name ``path`` (never what a symlink points to); False when it could not."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def _size(path: Path) -> int:
    """Bytes a leftover holds (a folder's files, never followed through symlinks)."""
    try:
        if path.is_dir() and not path.is_symlink():
            total = 0
            for p in path.rglob("*"):
                try:
                    st = p.lstat()
                except OSError:
                    continue
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
            return total
        return path.lstat().st_size
    except OSError:
        return 0


def _remove(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    return _unlink(path)


def parents(paths: Iterable[Path]) -> Sequence[Path]:
    """The distinct folders of ``paths``, in first-seen order."""
    return list({p.parent: None for p in paths})
