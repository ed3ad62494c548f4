"""The one way moepack runs llama.cpp: in a child process that streams events to its parent.

llama.cpp aborts its whole process on some bad models (``GGML_ASSERT`` → SIGABRT), so the
process the user started never loads a model itself. Every llama.cpp job (``run``, ``trace
capture``, ``check-dropin``'s runs, the judge, ``serve``) is a worker module run as
``python -m <module> JOB_JSON EVENT_FD``:

- **events**: the worker writes one JSON object per line to the pipe ``EVENT_FD``
  (``{"event": kind, …}``): ``warning``, ``error`` (input the worker refuses, with an
  optional ``path``) and ``done`` (the result) mean the same to every caller; any other kind
  (progress, generated text) goes to the caller's ``on_event``. stdout is not used (native
  code may print there); stderr is drained as it comes, its last lines kept for the error.
- **interrupts**: the worker runs in a session of its own, so a terminal's Ctrl-C reaches
  only the parent; the parent passes each interrupt on (SIGINT) from its signal handler and
  keeps reading, raising nothing (``interrupts.forwarding``: an exception raised as a read
  returns would lose the event it read, such as the server's last answered request). A worker
  takes the first as a stop request (``Channel.stopping``, checked between decode calls: what
  it wrote ends on a token boundary) and a second as "stop now". Python runs those handlers
  only between bytecodes of the main thread, so each interrupt is also a byte on the
  worker's signal wakeup pipe (``interrupts.wakeup_pipe``), which native code that can hold
  llama.cpp's threads (the expert pager) watches. ``Outcome.interrupted`` tells the caller;
  an interrupted worker that sent no ``done`` is a ``KeyboardInterrupt``.
- **death**: a worker that dies without ``done`` is one ``LlamaFailed`` line (the signal, or
  the last line it wrote to stderr); a parent that dies however it dies, SIGKILL included,
  takes its worker with it (``PR_SET_PDEATHSIG``, set by the worker before it loads
  anything, with a check that the parent did not die first).
- **scratch**: each run's job file and spool live in an owner-named folder (``leftovers``)
  that is removed when the run ends and swept by the next run if this process is killed.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from ... import interrupts
from ...errors import BadInput
from ...leftovers import temp_name
from ...safeio import sweep_folder

PARENT_ENV = "MOEPACK_LLAMA_PARENT"
"""The parent's pid, so a worker can tell that it was orphaned before it asked to die with it."""

STDERR_LINES = 20
EXIT_REFUSED = 3
"""A worker's exit status after an ``error`` event."""

_PR_SET_PDEATHSIG = 1
_BUILD_PATH = re.compile(r"^\S*/(?=[^/\s]+:\d+: )")


class LlamaFailed(BadInput):
    """llama.cpp could not load or run this model (the worker died, or refused the input)."""


class WorkerDied(LlamaFailed):
    """The worker ended without a result and without refusing its input (a signal, or an exit
    of its own): a caller that can start it again (a server) tells this from a refusal."""


@dataclass(frozen=True)
class Outcome:
    """How a worker ended: its ``done`` event and whether an interrupt stopped it early."""

    done: dict[str, Any]
    interrupted: bool
    warnings: tuple[str, ...] = ()


EventHandler = Callable[[dict[str, Any]], None]


class Warnings(list[str]):
    """A worker's warnings, each kept and passed on (to ``on_warning``) once: a worker says
    the same thing at every prompt or request."""

    def __init__(self, on_warning: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.on_warning = on_warning

    def __call__(self, message: str) -> None:
        if message not in self:
            self.append(message)
            if self.on_warning:
                self.on_warning(message)


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported (looked up, not imported: that is slow)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@contextmanager
def scratch_folder(what: str, near: Path | None = None) -> Iterator[Path]:
    """An owner-named folder for one run's job file and spool, beside ``near`` (a trace's
    destination, so the spool is on its file system) or in the system's temporary folder;
    what a killed run left there is swept first, and the folder goes when the run ends."""
    parent = near if near is not None else Path(tempfile.gettempdir())
    sweep_folder(parent)
    with interrupts.deferred():  # made and owned together: a killed run's is swept by name
        folder = parent / temp_name(what)
        folder.mkdir(mode=0o700)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _StderrTail:
    """Reads a worker's stderr on a thread as it comes (a full pipe would stall the worker)
    and keeps its last non-empty lines."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self._thread.start()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            if line.strip():
                # ggml's assertions name their source file by its build path: keep the name
                self.lines.append(_BUILD_PATH.sub("", line.strip()))
        stream.close()

    def last(self) -> str | None:
        self._thread.join(timeout=5)
        return self.lines[-1] if self.lines else None


def could_not_run(why: str, model: str | os.PathLike[str] | None) -> LlamaFailed:
    """The one sentence for every way llama.cpp fails on a model, with the reason."""
    return LlamaFailed(f"llama.cpp could not run this model: {why}", model)


def failure(returncode: int, last_line: str | None, model: Path | None) -> WorkerDied:
    """The error for a worker that died without a result: the signal, or its last words."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        tail = f": {last_line}" if last_line else ""
        why = f"it aborted ({name}){tail}"
    else:
        why = last_line or f"the worker exited with status {returncode}"
    why = why.replace("moepack: error: ", "", 1)  # native code's own line: said once
    return WorkerDied(f"llama.cpp could not run this model: {why}", model)


def run_worker(
    module: str,
    job: Mapping[str, Any],
    *,
    folder: Path,
    model: Path | None = None,
    on_event: EventHandler | None = None,
    on_warning: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Outcome:
    """Run ``python -m module`` on ``job`` (written into ``folder``) and stream its events.

    Returns the worker's ``done`` event. Raises ``LlamaFailed`` for an ``error`` event (its
    message, naming its ``path`` or ``model``) or a worker that died without ``done``, and
    ``KeyboardInterrupt`` when an interrupt stopped it before ``done``. ``env``: variables
    the worker starts with (read by native libraries as they load, such as OpenMP's);
    ``pass_fds``: file descriptors the worker inherits, under the same numbers (a server's
    listening socket)."""
    if not llama_cpp_available():
        raise LlamaFailed("llama.cpp is not installed: pip install 'moepack[llama]'")
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(dict(job)))
    rfd, wfd = os.pipe()
    # GGML_NO_BACKTRACE: an abort would otherwise run gdb on the worker to print a backtrace
    child_env = dict(
        os.environ,
        **(env or {}),
        **{PARENT_ENV: str(os.getpid()), "GGML_NO_BACKTRACE": "1"},
    )
    started: list[subprocess.Popen[str]] = []
    early = [0]  # interrupts that came before the worker had a pid

    def pass_on(signum: int) -> None:
        if started:
            _signal(started[0], signal.SIGINT)
        else:
            early[0] += 1

    # every interrupt is passed on from the handler, nothing raised: an exception raised the
    # instant a line was read (the line and the signal often come together: the worker said
    # it answered, and the user stopped it) would lose that line, and a started worker is
    # always waited for
    with interrupts.forwarding(pass_on) as forwarded:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, str(job_path), str(wfd)],
                pass_fds=(wfd, *pass_fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env,
                start_new_session=True,
            )
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
        started.append(proc)
        for _ in range(early[0]):
            _signal(proc, signal.SIGINT)
        events = _read_events(proc, rfd, on_event, on_warning)
    interrupted = events.interrupted or bool(forwarded.signals)
    if events.error is not None:
        path = events.error.get("path")
        message = str(events.error.get("message", "llama.cpp refused the input"))
        raise LlamaFailed(message, path or model)
    if events.done is None:
        if interrupted:
            raise KeyboardInterrupt
        raise failure(proc.returncode, events.tail.last(), model)
    return Outcome(events.done, interrupted, tuple(events.warnings))


@dataclass
class _Events:
    """What a worker said, read to its end."""

    tail: _StderrTail
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False  # a KeyboardInterrupt came from a handler not forwarded


def _read_events(
    proc: subprocess.Popen[str],
    rfd: int,
    on_event: EventHandler | None,
    on_warning: Callable[[str], None] | None,
) -> _Events:
    """Read the worker's events until it closes the pipe, then wait for it to end."""
    assert proc.stderr is not None
    got = _Events(_StderrTail(proc.stderr))
    with os.fdopen(rfd, "r", encoding="utf-8", errors="replace") as events:
        lines = iter(events)
        while True:
            try:
                line = next(lines, None)
                if line is None:
                    break
                _take(line, got, on_event, on_warning)
            except KeyboardInterrupt:  # a handler of the caller's raised it: pass it on too
                got.interrupted = True
                _signal(proc, signal.SIGINT)
    while True:
        try:
            proc.wait()
            break
        except KeyboardInterrupt:
            got.interrupted = True
            _signal(proc, signal.SIGINT)
    return got


def _take(
    line: str,
    got: _Events,
    on_event: EventHandler | None,
    on_warning: Callable[[str], None] | None,
) -> None:
    """One event line: the result, a refusal, a warning (each said once) or the caller's."""
    try:
        event = json.loads(line)
    except ValueError:
        return
    if not isinstance(event, dict):
        return
    kind = event.get("event")
    if kind == "done":
        got.done = event
    elif kind == "error":
        got.error = event
    elif kind == "warning":
        text = str(event.get("message", ""))
        if text not in got.warnings:
            got.warnings.append(text)
            if on_warning is not None:
                on_warning(text)
    elif on_event is not None:
        on_event(event)


def _signal(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


# -- the worker's side ------------------------------------------------------------------------


class Channel:
    """A worker's end: events to the parent, and whether the parent asked it to stop."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
        self.stopping = False
        self._lock = threading.Lock()

    def send(self, event: str, **fields: Any) -> None:
        """One event line (thread-safe: a server's threads may report at once)."""
        line = json.dumps({"event": event, **fields}) + "\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()

    def warn(self, message: str) -> None:
        self.send("warning", message=message)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:  # the second interrupt: stop now
            os._exit(128 + signum)
        self.stopping = True

    def close(self) -> None:
        try:
            self._out.close()
        except OSError:
            pass


def die_with_parent() -> None:
    """Be killed when the parent dies (Linux), and exit now if it already has."""
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)


WorkerBody = Callable[[dict[str, Any], Channel], "dict[str, Any] | None"]


def worker_main(argv: list[str], body: WorkerBody) -> int:
    """A worker's ``main``: read the job, wire the channel and interrupts, run ``body``.

    ``body`` returns the ``done`` event's fields (None: it sent ``done`` itself). A
    ``BadInput`` it raises becomes an ``error`` event (exit status 3)."""
    job_path, fd = argv
    die_with_parent()
    channel = Channel(int(fd))
    for sig in interrupts.INTERRUPT_SIGNALS:
        signal.signal(sig, channel._on_signal)
    interrupts.wakeup_pipe()  # native threads see a stop while llama.cpp's wait in C
    try:
        job = json.loads(Path(job_path).read_text(encoding="utf-8"))
        result = body(job, channel)
        if result is not None:
            channel.send("done", **result)
        return 0
    except BadInput as e:
        channel.send("error", message=e.message, path=e.path)
        return EXIT_REFUSED
    finally:
        channel.close()
