"""Hold most of RAM so that only a chosen amount is left for the page cache: how benchmarks
and ``fit --verify`` run a model on "a machine with N GiB" without changing the machine.

Anonymous private memory, every page touched (there is no swap here, so it cannot be paged
out), released when the process exits. It never touches system settings. Safety on a shared
machine: it re-reads MemAvailable every 100 ms and releases everything at once when
MemAvailable falls below 1 GiB (another process needs the memory more than the benchmark), or
when the process that started it is gone;
its own OOM score is raised so that, if memory runs out faster than that, the kernel kills the
holder and not someone else's work.

    python -m moepack.memhold --leave 1.5G     # prints "held N" when ready; Ctrl-C/SIGTERM ends

As a library: ``with MemoryHold(leave_bytes) as h: ...`` runs the holder as a child process.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

GIB = 1 << 30
FLOOR = 1 * GIB  # release everything below this much MemAvailable (by default)
MIN_FLOOR = 128 << 20  # never closer to running out than this
CHUNK = 32 << 20  # each chunk takes ~0.1 s to touch here: MemAvailable is re-read that often
CHECK_SECONDS = 0.1


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _touch(mm: mmap.mmap) -> None:
    """Write every page (a page never written is not memory yet)."""
    anchor = ctypes.c_char.from_buffer(mm)
    ctypes.memset(ctypes.addressof(anchor), 1, len(mm))
    del anchor


def hold(leave: int, floor: int = FLOOR) -> None:
    """Hold memory until MemAvailable is about ``leave``; keep watching; never return until a
    signal (or the safety floor, ``floor`` bytes of MemAvailable) ends it."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    chunks: list[mmap.mmap] = []
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    while not stop:
        avail = mem_available()
        if avail < floor:
            break
        if avail - CHUNK < leave or avail - CHUNK < floor:
            break
        mm = mmap.mmap(-1, CHUNK, flags=flags)
        _touch(mm)
        chunks.append(mm)
    held = len(chunks) * CHUNK
    print(f"held {held} available {mem_available()}", flush=True)
    parent = os.getppid()
    while not stop:
        time.sleep(CHECK_SECONDS)
        if mem_available() < floor:
            print(f"released: MemAvailable fell below {floor >> 20} MiB", flush=True)
            break
        if os.getppid() != parent:  # the benchmark died without stopping us
            break
    for mm in chunks:
        mm.close()
    chunks.clear()


class MemoryHold:
    """A holder child process that leaves about ``leave`` bytes available; stopped on exit.
    ``floor``: the MemAvailable below which it lets go. 1 GiB suits a shared machine; a
    benchmark whose own run locks most of what is left (the live cache) needs a lower one on a
    machine of its own, or its own run makes the holder let go."""

    def __init__(self, leave: int, floor: int = FLOOR) -> None:
        self.leave = leave
        self.floor = floor
        self.held = 0
        self.available = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> MemoryHold:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moepack.memhold"]
            + ["--leave", str(self.leave), "--floor", str(self.floor)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().split()
        if len(line) < 4 or line[0] != "held":
            self.__exit__(None, None, None)
            raise RuntimeError(f"memory holder did not start: {line}")
        self.held, self.available = int(line[1]), int(line[3])
        return self

    def alive(self) -> bool:
        """False once the holder let go (the safety floor was hit)."""
        return self._proc is not None and self._proc.poll() is None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leave", required=True, help="bytes to leave available (e.g. 1.5G)")
    ap.add_argument("--floor", default=str(FLOOR), help="let go below this MemAvailable")
    args = ap.parse_args()
    leave, floor = parse_size(args.leave), parse_size(args.floor)
    if floor < MIN_FLOOR:
        print(f"--floor must be at least {MIN_FLOOR >> 20} MiB", file=sys.stderr)
        return 2
    if leave < floor:
        print(f"--leave must be at least the floor ({floor >> 20} MiB)", file=sys.stderr)
        return 2
    hold(leave, floor)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
