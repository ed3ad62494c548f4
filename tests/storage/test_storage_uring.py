"""The ctypes io_uring ring: reads, accounting that survives Ctrl-C, bounded drain, counters,
short reads, the DEFER_TASKRUN requirement, and the subprocess checks of PyPI bindings."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moepack.storage import Mode, read_ranges
from moepack.storage import buffers as buffers_mod
from moepack.storage.buffers import BufferPool
from moepack.storage.engines import uring as uring_engine
from moepack.storage.measure import RandomWork
from moepack.storage.uring import bindings
from moepack.storage.uring import ring as ring_mod
from moepack.storage.uring.ring import Ring, RingUnsupported, ring_unavailable_reason

pytestmark = pytest.mark.skipif(ring_unavailable_reason() is not None, reason="no io_uring here")


def in_thread(fn, timeout: float = 30.0):
    """Run ``fn`` in a thread (a ring is used by the thread that made it); a hang fails the
    test instead of hanging the suite."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below
            box["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_ring_reads_and_reports_errors(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    ring = Ring(3)
    pool = BufferPool(3, 1000)
    try:
        assert ring.entries == 4 and ring.space() == 4
        flags = ring_mod.IORING_SETUP_SINGLE_ISSUER | ring_mod.IORING_SETUP_DEFER_TASKRUN
        assert ring.flags & flags == flags  # completions only ever posted in our own thread
        ring.prep_read(fd, pool.addresses[0], 1000, 17, 0, 0)
        ring.prep_read(fd, pool.addresses[1], 1000, len(data) - 10, 0, 1)
        ring.prep_read(-1 & 0x7FFFFFFF, pool.addresses[2], 10, 0, 0, 2)  # a bad descriptor
        assert ring.outstanding == 3  # prepared, not yet submitted, counts
        ring.submit_and_wait(3)
        got = dict(ring.reap())
        assert got[0] == 1000 and bytes(pool.views[0]) == data[17:1017]
        assert got[1] == 10 and bytes(pool.views[1][:10]) == data[-10:]
        assert got[2] == -errno.EBADF  # reported, not raised
        assert ring.ready() == 0 and ring.reap() == [] and ring.outstanding == 0
        assert (ring.dropped, ring.overflow) == (0, 0)
    finally:
        ring.close()
        pool.close()
        os.close(fd)


def test_ring_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="1 to 32768 entries"):
        Ring(40000)
    with pytest.raises(ValueError):
        Ring(0)


def test_outstanding_counts_reads_whose_completions_the_caller_lost(
    data_file: tuple[Path, bytes],
) -> None:
    """Ctrl-C may cut the caller between reaping and its own bookkeeping; the ring's count
    (prepared - reaped) is what a drain trusts, and it is exact at every step."""
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    ring, pool = Ring(8), BufferPool(8, 4096)
    try:
        for i in range(8):
            ring.prep_read(fd, pool.addresses[i], 4096, i * 4096, 0, i)
        ring.submit_and_wait(8)
        assert ring.outstanding == 8 and ring.ready() == 8
        ring.reap()  # results thrown away, as an interrupted caller would
        assert ring.outstanding == 0
        assert ring.drain(timeout=5) is True  # nothing to wait for: returns at once
    finally:
        ring.close()
        pool.close()
        os.close(fd)


def test_drain_is_bounded_it_cancels_what_never_completes() -> None:
    """A read of an empty pipe never completes: drain waits, cancels it, and reaps it."""

    def body() -> tuple[bool, int, int]:
        r, w = os.pipe()
        ring, pool = Ring(4), BufferPool(2, 4096)
        try:
            ring.prep_read(r, pool.addresses[0], 100, 0, 0, 0)
            ring.prep_read(r, pool.addresses[1], 100, 0, 0, 1)
            ring.submit_and_wait(0)
            assert ring.outstanding == 2
            ok = ring.drain(timeout=0.05, grace=20)
            return ok, ring.outstanding, ring.overflow
        finally:
            ring.close()
            pool.close()
            os.close(r)
            os.close(w)

    assert in_thread(body) == (True, 0, 0)


def test_a_second_ctrl_c_hurries_the_drain() -> None:
    def body() -> bool:
        r, w = os.pipe()
        ring, pool = Ring(2), BufferPool(1, 4096)
        try:
            ring.prep_read(r, pool.addresses[0], 100, 0, 0, 0)
            return ring.drain(timeout=3600, grace=20, hurry=lambda: True)
        finally:
            ring.close()
            pool.close()
            os.close(r)
            os.close(w)

    assert in_thread(body) is True


def test_a_read_that_cannot_be_reaped_keeps_its_buffer_mapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the drain fails (here: io_uring_enter errors out), the ring is still closed and
    the buffers are abandoned, never unmapped under a read that may still be running."""

    def body() -> tuple[bool, bool, bool, bool]:
        r, w = os.pipe()
        ring, pool = Ring(2), BufferPool(1, 4096)
        try:
            ring.prep_read(r, pool.addresses[0], 100, 0, 0, 0)
            ring.submit_and_wait(0)

            def broken(timeout: float) -> int:
                raise OSError(errno.EBADF, "io_uring_enter: broken")

            monkeypatch.setattr(ring, "wait", broken)
            uring_engine._finish(ring, pool)
            return ring.closed, pool._mm.closed, pool in buffers_mod._ABANDONED, pool.closed
        finally:
            os.close(r)
            os.close(w)

    assert in_thread(body) == (True, False, True, True)
    monkeypatch.setattr(buffers_mod, "_ABANDONED", [])


def test_no_buffers_are_left_behind_when_the_ring_cannot_be_made(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = data_file
    made: list[BufferPool] = []

    class Recording(BufferPool):
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, **k)  # type: ignore[arg-type]
            made.append(self)

    def no_ring(entries: int) -> Ring:
        raise OSError(errno.ENOMEM, "io_uring_setup: out of memory")

    monkeypatch.setattr(uring_engine, "BufferPool", Recording)
    monkeypatch.setattr(uring_engine, "Ring", no_ring)
    with pytest.raises(OSError, match="out of memory"):
        read_ranges(path, [(0, 4096)], engine="uring", queue_depth=4)
    assert all(p.closed for p in made)


def test_counters_stay_zero_and_a_nonzero_one_is_an_error(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    seen: list[tuple[int, int, int]] = []

    class Checked(Ring):
        def close(self) -> None:
            if not self.closed:
                seen.append((self.dropped, self.overflow, self.outstanding))
            super().close()

    monkeypatch.setattr(uring_engine, "Ring", Checked)
    ranges = [(random.Random(i).randrange(len(data)), 70_000) for i in range(300)]
    for engine in ("uring", "uring-batch"):
        for mode in Mode:
            out = read_ranges(path, ranges, engine=engine, mode=mode, queue_depth=16, widen=True)
            assert out.data == [data[o : o + n] for o, n in ranges]
    assert len(seen) == 6 and set(seen) == {(0, 0, 0)}

    ring = Ring(2)
    try:
        ring.check_counters()
        ring._cq[ring._cq_overflow_i] = 3  # as if the kernel had lost three completions
        with pytest.raises(OSError, match="CQ overflow 3"):
            ring.check_counters()
    finally:
        ring.close()


def test_short_reads_are_continued(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel may return fewer bytes than asked (signals, page-cache races): the engine
    continues each read where it stopped. Simulated by capping what is asked of the ring."""
    path, data = data_file
    rng = random.Random(5)
    original = Ring.prep_read
    capped = [0]

    def short(self, fd, addr, length, offset, rw_flags, user_data):
        if length > 8192 and rng.random() < 0.7:
            capped[0] += 1
            length = rng.randrange(1, length // 4096) * 4096  # aligned, so O_DIRECT too
        return original(self, fd, addr, length, offset, rw_flags, user_data)

    monkeypatch.setattr(Ring, "prep_read", short)
    ranges = [(rng.randrange(len(data)), rng.randrange(0, 400_000)) for _ in range(400)]
    ranges.append((len(data) - 5000, 100_000))  # short at the end of the file as well
    for engine in ("uring", "uring-batch"):
        for mode in Mode:
            for qd in (1, 5, 64):
                out = read_ranges(path, ranges, engine=engine, mode=mode, queue_depth=qd,
                                  widen=True)  # fmt: skip
                bad = [r for r, got in zip(ranges, out.data, strict=True)
                       if got != data[r[0] : r[0] + r[1]]]  # fmt: skip
                assert not bad, (engine, mode, qd, bad[:3])
    assert capped[0] > 1000


def test_kernel_without_defer_taskrun_falls_back_to_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without DEFER_TASKRUN, completions could be posted by another CPU while Python reads
    them with plain loads; the ring refuses, the engines say why, probe picks threads."""
    from moepack.storage.probe import default_engine

    def old_kernel(entries: int, flags: int):
        if flags & ring_mod.IORING_SETUP_DEFER_TASKRUN:
            raise OSError(errno.EINVAL, "Invalid argument")
        raise AssertionError("only the DEFER_TASKRUN set-up may be tried")

    monkeypatch.setattr(ring_mod, "_setup", old_kernel)
    monkeypatch.setattr(uring_engine, "_unavailable", [])
    with pytest.raises(RingUnsupported, match="DEFER_TASKRUN"):
        Ring(4)
    reason = ring_unavailable_reason()
    assert reason is not None and "DEFER_TASKRUN" in reason
    assert "DEFER_TASKRUN" in (uring_engine.UringSlidingEngine().unavailable_reason() or "")
    assert default_engine() == "threads"


_DRIVER = textwrap.dedent(
    """
    import os, random, signal, sys, threading
    from moepack.storage import Mode, get_engine, open_file
    from moepack.storage.measure import RandomWork

    path, engine, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(int(sys.argv[4]))
    with open(path, "rb") as fh:
        fh.read()  # warm: every read is a page-cache copy, the run is CPU-bound
    def rings():
        fds = os.listdir("/proc/self/fd")
        return sum("io_uring" in os.readlink(f"/proc/self/fd/{n}") for n in fds
                   if os.path.exists(f"/proc/self/fd/{n}"))
    with open_file(path, Mode.BUFFERED, random_access=False) as f:
        for i in range(rounds):
            work = RandomWork(f.size, 4096, wrap=True, seed=i)
            work.start(3600.0)
            timer = threading.Timer(rng.uniform(0.02, 0.25), os.kill,
                                    (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                get_engine(engine).run(f, work, 64)
            except KeyboardInterrupt:
                pass
            else:
                sys.exit(f"round {i}: the run ended without the interrupt")
            timer.join()
            assert rings() == 0, "a ring was left open"
            print("round", i, work.issued, flush=True)
    print("done")
    """
)


def _rings_open() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum("io_uring" in os.readlink(f"/proc/self/fd/{n}") for n in fds
               if os.path.exists(f"/proc/self/fd/{n}"))  # fmt: skip


@pytest.mark.parametrize("engine", ["uring", "uring-batch"])
def test_ctrl_c_the_instant_the_ring_exists_leaves_no_ring_open(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """A Ctrl-C that lands as the ring is set up (on a busy machine the driver below sent
    some before the first read) stops the run and leaves no ring behind."""
    from moepack.storage import get_engine, open_file
    from moepack.storage.measure import RandomWork

    real_setup = ring_mod._setup

    def setup_then_ctrl_c(entries: int, flags: int):
        made = real_setup(entries, flags)
        signal.raise_signal(signal.SIGINT)
        return made

    monkeypatch.setattr(ring_mod, "_setup", setup_then_ctrl_c)
    before = _rings_open()
    with open_file(data_file[0], Mode.BUFFERED, random_access=False) as f:
        work = RandomWork(f.size, 4096, wrap=True, seed=0)
        work.start(3600.0)
        with pytest.raises(KeyboardInterrupt):
            get_engine(engine).run(f, work, 8)
    assert work.issued == 0 and _rings_open() == before


@pytest.mark.parametrize("engine", ["uring", "uring-batch"])
def test_ctrl_c_during_a_cpu_bound_run_always_stops(tmp_path: Path, engine: str) -> None:
    """Many interrupts at random points of a warm 4 KiB QD 64 run: each one stops the engine
    (no completion lost from the count, no hang), with the ring closed."""
    data = tmp_path / "warm.bin"
    data.write_bytes(os.urandom(16 << 20))
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.Popen(
        [sys.executable, str(driver), str(data), engine, "12", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"hung after: {out.strip().splitlines()[-1:]}")
    assert p.returncode == 0 and out.strip().endswith("done"), (out, err)
    assert out.count("round") == 12


# Only a hang guard: a stop costs well under a second of CPU (measured: 2-4 s of wall time
# with four times as many busy loops as cores), waits at most uring's DRAIN_SECONDS +
# CANCEL_GRACE_SECONDS (12 s) for reads in flight, and then the interpreter's exit; 300 s
# (the server tests' STOP_SECONDS) leaves that a hundredth of a core on a busy machine. The
# 20 s it was called a starved stop a hang (the interpreter's exit alone, its garbage
# collection, took over 10 s there). Starting, up to the first read, is guarded the same way.
STOP_SECONDS = 300


def _has_open(pid: int, path: str) -> bool:
    try:
        return path in [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
    except OSError:  # the process or one of its descriptors went meanwhile
        return False


def test_ctrl_c_stops_the_cli_cleanly_every_time(run_cli, mounted) -> None:
    """Ctrl-C through the CLI while io_uring reads at RAM speed (tmpfs, QD 64): a one-line
    error and exit 130, each time, and never a hang."""
    d = mounted("tmpfs", "size=80m")
    r = run_cli("probe", str(d), "--sizes", "4K", "--depths", "1", "--cell-seconds", "0.01",
                "--corpus-size", "32M", "-q")  # fmt: skip
    assert r.returncode == 0, r.stderr
    rng = random.Random(3)
    corpus = str(d / "moepack-corpus.bin")
    for _ in range(3):
        p = subprocess.Popen(
            [sys.executable, "-m", "moepack.cli.main", "probe", str(d), "--engine", "uring",
             "--sizes", "4K", "--depths", "64", "--cell-seconds", "60", "--corpus-size", "32M",
             "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        # the signal must find the probe reading (not the interpreter starting, however
        # long that takes on a busy machine): wait for the corpus to be open, not for a time
        deadline = time.monotonic() + STOP_SECONDS
        while not _has_open(p.pid, corpus):
            assert p.poll() is None, f"the probe ended before it read: {p.communicate()}"
            assert time.monotonic() < deadline, "the probe never opened its corpus"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))  # somewhere in the 60 s cell
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"moepack probe hung after Ctrl-C (still running {STOP_SECONDS} s later)")
        assert p.returncode == 130, (out, err)
        assert err.strip().splitlines()[-1].startswith("moepack: interrupted"), err
        assert "Traceback" not in err


def _swallow_ctrl_c() -> None:
    """A Ctrl-C in code that catches every exception and goes on, as Cython's module set-up
    does (``except: pass``; numpy.random's, imported as the first cell is made)."""
    try:
        signal.raise_signal(signal.SIGINT)
    except BaseException:
        pass


class _SwallowsOnce:
    """A measuring workload whose ``complete`` swallows a Ctrl-C once ``at`` reads are done."""

    def __init__(self, work: RandomWork, at: int) -> None:
        self.work, self.at, self.max_length = work, at, work.max_length

    def next(self) -> tuple[int, int, int] | None:
        return self.work.next()

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.work.complete(token, data, nbytes, latency_ns)
        if len(self.work.latencies) == self.at:
            _swallow_ctrl_c()


@pytest.mark.parametrize("engine", ["uring", "uring-batch"])
@pytest.mark.parametrize("swallowed_after", [0, 100])
def test_a_ctrl_c_that_something_swallowed_still_stops_the_run(
    data_file: tuple[Path, bytes], engine: str, swallowed_after: int
) -> None:
    """Under the command line's handlers, a Ctrl-C whose ``KeyboardInterrupt`` third-party
    code caught, before the run or during it, stops the run within a queue's worth of reads,
    not at the end of the cell."""
    from moepack import interrupts
    from moepack.storage import get_engine, open_file

    qd = 8
    saved = interrupts.saved_handlers()
    interrupts.install()
    try:
        with open_file(data_file[0], Mode.BUFFERED, random_access=False) as f:
            work = RandomWork(f.size, 4096, wrap=False, seed=0)  # 780 reads, then it ends
            work.start(3600.0)
            if swallowed_after == 0:
                _swallow_ctrl_c()
            with pytest.raises(KeyboardInterrupt):
                get_engine(engine).run(f, _SwallowsOnce(work, swallowed_after), qd)
    finally:
        interrupts.restore(saved)
    assert len(work.latencies) <= swallowed_after + qd
    assert not work.exhausted and _rings_open() == 0


_OTHER_THREAD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from moepack.storage import Mode, get_engine, open_file
    from moepack.storage.measure import RandomWork

    r, w = os.pipe()
    waiter = threading.Thread(target=os.read, args=(r, 1), daemon=True)  # waits in C, as
    waiter.start()  # OpenBLAS's thread does: SIGINT unblocked, never running Python

    class SignalsTheWaiter(RandomWork):
        def complete(self, token, data, nbytes, latency_ns):
            super().complete(token, data, nbytes, latency_ns)
            if len(self.latencies) == 100:  # the kernel picked the waiter for the SIGINT
                signal.pthread_kill(waiter.ident, signal.SIGINT)

    with open_file(sys.argv[1], Mode.BUFFERED, random_access=False) as f:
        work = SignalsTheWaiter(f.size, 4096, wrap=True, seed=0)
        work.start(3600.0)
        try:
            get_engine(sys.argv[2]).run(f, work, 64)
        except KeyboardInterrupt:
            print("stopped", flush=True)
    """
)


@pytest.mark.parametrize("engine", ["uring", "uring-batch"])
def test_a_sigint_another_thread_receives_still_stops_the_run(
    data_file: tuple[Path, bytes], engine: str
) -> None:
    """A process-wide SIGINT may be handed to any thread that does not block it. Python's
    handler then runs in that thread and only marks the signal; the main thread, waiting in
    ``io_uring_enter``, acts on it once the wait returns (CPython re-checks for signals when
    it takes the GIL back), so no wakeup descriptor in the ring is needed."""
    p = subprocess.run(
        [sys.executable, "-c", _OTHER_THREAD, str(data_file[0]), engine],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=STOP_SECONDS,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "stopped", (p.stdout, p.stderr)


_SWALLOWING_CLI = textwrap.dedent(
    """
    import abc, signal, sys
    from moepack.cli.main import main

    register, fired = abc.ABCMeta.register, []

    def ctrl_c_inside(cls, subclass):
        # Cython's memoryview set-up in numpy.random's modules, imported when the first cell
        # is made: `try: Sequence.register(_memoryviewslice) ... except: pass`
        if subclass.__name__ == "_memoryviewslice" and not fired:
            fired.append(cls.__name__)
            sys.stderr.write("ctrl-c lands in Cython's registration\\n")
            signal.raise_signal(signal.SIGINT)
        return register(cls, subclass)

    abc.ABCMeta.register = ctrl_c_inside
    main(sys.argv[1:], whole_process=True)
    """
)


def test_ctrl_c_inside_a_module_that_swallows_it_still_stops_the_probe(tmp_path: Path) -> None:
    """The Ctrl-C under load that left ``probe --engine uring`` reading for whole cells: it
    landed while numpy.random imported, and Cython's set-up code swallowed the exception."""
    script = tmp_path / "probe.py"
    script.write_text(_SWALLOWING_CLI)
    p = subprocess.run(
        [sys.executable, str(script), "probe", str(tmp_path), "--engine", "uring", "--sizes",
         "4K", "--depths", "64", "--cell-seconds", "2", "--corpus-size", "4M", "-q"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=STOP_SECONDS,
    )  # fmt: skip
    assert "ctrl-c lands in Cython's registration" in p.stderr, (
        "numpy.random was imported before the probe ran; this test needs another place",
        p.stderr,
    )
    assert p.returncode == 130, (p.stdout, p.stderr)  # not 0: the whole probe ran
    assert p.stderr.strip().splitlines()[-1].startswith("moepack: interrupted"), p.stderr
    assert "Traceback" not in p.stderr


def test_binding_that_dies_of_sigill_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding that kills its process (as PyPI liburing does here) cannot take us down."""
    monkeypatch.setattr(
        bindings,
        "_CHECKS",
        {
            "crashes": "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n",
            "missing": "import moepack_no_such_binding\n",
            "works": "print('ok 1.2')\n",
        },
    )
    checks = bindings.check_bindings(timeout=30)
    assert [b.name for b in checks] == ["crashes", "missing", "works", "ctypes (built in)"]
    got = {b.name: b for b in checks}
    assert not got["crashes"].usable and "SIGILL" in got["crashes"].detail
    assert not got["missing"].usable and got["missing"].detail == "not installed"
    assert got["works"].usable and got["works"].detail == "creates a ring (version 1.2)"
    assert got["ctypes (built in)"].usable
