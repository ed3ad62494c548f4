"""The expert pager: a page never asked for is served whole at its first touch, resident bytes
stay within the budget (the pager's count held against ``/proc/self/smaps``), the file comes
back on release, llama.cpp's logits are bit-identical at 1 and 2 threads under a roomy and a
hard budget, at the minimum (one slice per compute thread) with a deep queue and past every
expert (2**63-1), a budget a byte below the minimum is refused before loading, every fault is
served at the minimum whatever the queue depth, a refused userfaultfd or an unmapped model
is one warning line and the page cache, an interrupt stops a run whose threads wait in
faults, and a killed run leaves nothing behind."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama.prefetcher.pager import (
    ExpertPager,
    PagerRefused,
    budget_shortfall,
    minimum_budget,
    open_userfaultfd,
    pager_library,
    slice_span,
    smaps_resident,
)
from moepack.llama.prefetcher.prefetch import ExpertRanges
from moepack.llama.prefetcher.streamer import ExpertStreamer, StreamOptions
from moepack.llama.runtime.memory_plan import memory_for_experts
from moepack.storage.linux import LIBC, PAGE_SIZE


def _uffd_reason() -> str | None:
    lib = pager_library()
    if lib is None:
        return "no C compiler here"
    try:
        fd, _how = open_userfaultfd(lib)
    except PagerRefused as e:
        return str(e)
    os.close(fd)
    return None


REASON = _uffd_reason()
needs_uffd = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PROMPT = "the quick brown fox jumps over the lazy dog"
LONG = " ".join([PROMPT] * 9)  # more than 64 tokens: the prefill speculates whole layers


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("pager") / "m.gguf", spec).paths[0]


class Mapped:
    """The file mapped as llama.cpp maps it (whole, read-only, shared), and its bytes."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(fd).st_size
        self.addr = int(LIBC.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0))
        os.close(fd)
        self.data = path.read_bytes()

    def read(self, offset: int, n: int) -> bytes:
        return ctypes.string_at(self.addr + offset, n)

    def close(self) -> None:
        LIBC.munmap(self.addr, self.size)


def _layout(path: Path) -> ExpertRanges:
    with MoeModel(path) as m:
        return ExpertRanges(m)


@needs_uffd
def test_a_page_of_an_expert_never_asked_for_is_served_whole_at_its_first_touch(small):
    layout = _layout(small)
    mapped = Mapped(small)
    pager = ExpertPager([small], layout, 4 << 20, queue_depth=4)
    try:
        block = layout.blocks[1]
        _shard, base, size = (int(v) for v in layout.table(block)[1])
        lo = base + 5 * size  # expert 5 of the layer's second matrix
        assert pager.stats.resident_pages == 0
        assert mapped.read(lo + size // 2, 64) == mapped.data[lo + size // 2 : lo + size // 2 + 64]
        st = pager.stats
        assert st.faults_unasked == 1 and st.fault_waits == 1 and st.reads >= 1
        first, last = lo // PAGE_SIZE, (lo + size - 1) // PAGE_SIZE
        assert st.resident_pages == last - first + 1  # the whole slice, edge pages included
        # every other byte of it is there already: no more faults, the file's bytes
        assert mapped.read(lo, size) == mapped.data[lo : lo + size]
        assert pager.stats.faults == st.faults
        assert smaps_resident(pager.ranges()) == st.resident_pages * PAGE_SIZE
    finally:
        pager.release()
        mapped.close()


def _kernel_moves() -> bool:
    """Linux 6.8 and later have UFFDIO_MOVE."""
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 8)


@needs_uffd
@pytest.mark.parametrize("place", ["move", "copy"])
def test_resident_bytes_never_exceed_the_budget_and_agree_with_smaps(small, place, monkeypatch):
    monkeypatch.setenv("MOEPACK_PAGER_PLACE", place)  # read by the C pager as it starts
    layout = _layout(small)
    mapped = Mapped(small)
    budget = 24 * 18 * PAGE_SIZE  # 24 slices of the 16 x 3 x 3 there are
    pager = ExpertPager([small], layout, budget, queue_depth=3)
    rng = np.random.default_rng(7)
    try:
        assert pager.expert_bytes > 4 * budget
        for step in range(60):
            block = int(rng.choice(layout.blocks))
            experts = [int(e) for e in rng.choice(16, size=4, replace=False)]
            rows = layout.slice_rows(block, experts)
            kind = int(rng.choice([0, 0, 1, 2]))
            pager.push(block, kind, rows)
            for _s, _e, off, n in rows[rng.choice(len(rows), size=3)].tolist():
                at = off + int(rng.integers(0, n - 16))
                assert mapped.read(at, 16) == mapped.data[at : at + 16], step
            pager.wait_idle()
            st = pager.stats
            assert st.peak_pages <= st.budget_pages == budget // PAGE_SIZE
            assert smaps_resident(pager.ranges()) == st.resident_pages * PAGE_SIZE, step
        st = pager.stats
        assert st.forced_evictions > 0 and st.evicted_pieces > 0 and st.errors == 0
        if place == "copy":
            assert st.spare_pages == 0 == st.moved_pages == st.recycled_pages
        elif _kernel_moves():  # the read's pages moved into place, evicted ones reused
            assert st.spare_pages > 0 and st.recycled_pages > 0
            # all of them but what an O_DIRECT completion still held past a millisecond
            # (copied instead: a loaded machine has some)
            assert st.read_bytes // 2 <= st.moved_pages * PAGE_SIZE <= st.read_bytes
        # whatever stayed, every expert byte reads as the file's
        whole = mapped.read(0, mapped.size)
        assert whole == mapped.data
        assert pager.stats.peak_pages <= budget // PAGE_SIZE
        pager.drop_all()
        assert pager.stats.resident_pages == 0 == smaps_resident(pager.ranges())
    finally:
        pager.release()
        mapped.close()


@needs_uffd
def test_release_maps_the_file_back_at_the_same_addresses(small):
    layout = _layout(small)
    mapped = Mapped(small)
    pager = ExpertPager([small], layout, 4 << 20)
    ranges = pager.ranges()
    assert mapped.read(0, mapped.size) == mapped.data  # through the pager
    pager.release()
    pager.release()  # idempotent
    try:
        assert mapped.read(0, mapped.size) == mapped.data  # through the file again
        inode = str(os.stat(small).st_ino)
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if any(a < hi and lo < a + n for a, n in ranges):
                assert line.split()[4] == inode, line
    finally:
        mapped.close()


SLICE = 69632  # one expert slice of `small` and `model`: 17 pages, not page-aligned


@needs_uffd
def test_the_minimum_is_one_slice_per_compute_thread(small):
    layout = _layout(small)
    span = (SLICE // PAGE_SIZE + 1) * PAGE_SIZE  # its pages, and one more: it need not start on one
    assert slice_span(layout) == span
    assert [minimum_budget(layout, t) for t in (1, 2, 3)] == [span, 2 * span, 3 * span]
    assert budget_shortfall(2 * span, layout, 2) is None
    short = budget_shortfall(2 * span - 1, layout, 2)
    assert short is not None and f"`memory` {2 * span} or more" in short
    with pytest.raises(PagerRefused, match=f"{2 * span:,} bytes"):
        ExpertPager([small], layout, 2 * span - 1, threads=2)


def _read_all(addr: int, slices: list[tuple[int, int]], out: dict[int, bytes]) -> None:
    """Copy every slice out of the mapping with the GIL let go (``ctypes.memmove``), so two
    threads fault at once, as llama.cpp's do."""
    for off, n in slices:
        buf = ctypes.create_string_buffer(n)
        ctypes.memmove(buf, addr + off, n)
        out[off] = buf.raw


def _faulting_threads(mapped: Mapped, pager: ExpertPager, plan: list[list[tuple[int, int]]]):
    """Each list of slices read by a thread of its own while the pager is given demand,
    speculation and evictions; the threads' copies, once all have ended (a deadlock guard
    fails the test, and the pager's release then lets the threads finish on the file)."""
    got: list[dict[int, bytes]] = [{} for _ in plan]
    threads = [
        threading.Thread(target=_read_all, args=(mapped.addr, work, out), daemon=True)
        for work, out in zip(plan, got, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if any(t.is_alive() for t in threads):
        pager.release()
        pytest.fail(f"faults never served: {pager.stats}")
    return got


@needs_uffd
@pytest.mark.parametrize("place", ["move", "copy"])
@pytest.mark.parametrize("qd", [1, 64])
@pytest.mark.parametrize("slices", [2, 4])
def test_every_fault_is_served_at_the_minimum_whatever_the_queue_depth(
    small, place, qd, slices, monkeypatch
):
    """Two faulting threads, a budget of two slices (the minimum at 2 threads) or four (what
    was once the minimum, and deadlocked once the spare pool of 64 reads had filled it)."""
    monkeypatch.setenv("MOEPACK_PAGER_PLACE", place)
    layout = _layout(small)
    mapped = Mapped(small)
    budget = slices // 2 * minimum_budget(layout, 2)
    pager = ExpertPager([small], layout, budget, queue_depth=qd, threads=2)
    rng = np.random.default_rng(qd + slices)
    try:
        plan = []
        for _ in range(2):
            rows = [
                layout.slice_rows(int(b), [int(e) for e in rng.choice(16, 4, replace=False)])
                for b in rng.choice(layout.blocks, 6)
            ]
            plan.append([(int(off), int(n)) for r in rows for _s, _e, off, n in r.tolist()])
        for block in layout.blocks:  # work for the readers beside the faults
            pager.push(block, 0, layout.slice_rows(block, range(8)))
            pager.push(block, 1, layout.slice_rows(block, range(8, 16)))
            pager.push(block, 2, layout.slice_rows(block, range(4)))
        got = _faulting_threads(mapped, pager, plan)
        for work, out in zip(plan, got, strict=True):
            assert all(out[off] == mapped.data[off : off + n] for off, n in work)
        pager.wait_idle()
        st = pager.stats
        assert st.peak_pages <= st.budget_pages == budget // PAGE_SIZE and st.errors == 0
        assert st.fault_waits > 0 and st.forced_evictions > 0
        assert smaps_resident(pager.ranges()) == st.resident_pages * PAGE_SIZE
    finally:
        pager.release()
        mapped.close()


@needs_uffd
@pytest.mark.parametrize("budget", [(1 << 63) - 1, 1 << 63, 1 << 64])
def test_a_budget_past_every_expert_is_held_to_what_can_be_resident(small, budget):
    layout = _layout(small)
    mapped = Mapped(small)
    pager = ExpertPager([small], layout, budget)
    try:
        st = pager.stats
        assert (
            pager.budget
            == (st.total_pages + st.spare_pages) * PAGE_SIZE
            == pager.expert_bytes + st.spare_pages * PAGE_SIZE
        )
        assert st.budget_pages * PAGE_SIZE == pager.budget
        out: dict[int, bytes] = {}
        got = _faulting_threads(mapped, pager, [[(0, mapped.size)]])
        out = got[0]
        assert out[0] == mapped.data and pager.stats.forced_evictions == 0
    finally:
        pager.release()
        mapped.close()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_budget_below_the_minimum_is_refused_before_loading(small, command, capsys):
    low = minimum_budget(_layout(small), 2)
    # --memory counts the whole run: one byte short of the minimum left for the experts
    memory = memory_for_experts(small, low - 1, n_ctx=512)
    args = [command, small, *(["-p", PROMPT] if command == "run" else ["--port", 0])]
    args += [] if command == "run" else ["--prefix-cache", 0]  # serve's would count too
    args += ["--threads", 2, "--ctx", 512, "--prefetch", "--pager", "on", "--memory", memory]
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith(f"moepack: error: {small}: "), err
    assert f"{low:,} bytes for the experts (the pager's minimum at 2 compute thread(s))" in err
    assert f"--memory is {memory:,} bytes" in err and "--ctx 256 fits" in err


def test_a_model_llama_cpp_did_not_map_gets_the_page_cache_and_one_line(small):
    warnings: list[str] = []
    streamer = ExpertStreamer(small, StreamOptions(memory=8 << 20), warn=warnings.append)
    try:
        streamer.attach(threads=1)  # nothing maps the file in this process
        assert streamer.pager is None
        assert len(warnings) == 1 and "the page-cache prefetcher runs instead" in warnings[0]
        assert streamer.report()["pager_fallback"] is not None
    finally:
        streamer.close()
    on = ExpertStreamer(small, StreamOptions(memory=8 << 20, pager="on"))
    try:
        with pytest.raises(BadInput, match="`pager` is on"):
            on.attach(threads=1)
    finally:
        on.close()


def test_pager_options_are_checked():
    with pytest.raises(BadInput, match="`pager` is one of"):
        StreamOptions(pager="yes").validate()
    with pytest.raises(BadInput, match="memory budget must be positive"):
        StreamOptions(memory=0).validate()
    with pytest.raises(BadInput, match="overlap"):
        StreamOptions(pager="on", mode="serial").validate()


# -- in llama.cpp ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("pagerun") / "m.gguf", spec).paths[0]


EXPERT = 3 * 69632  # one expert of the model above, its three matrices
BUDGETS = {
    "roomy": StreamOptions(pager="on", memory=64 << 20),
    # six experts a layer: the live cache holds four, the rest is the reads' room
    "hard": StreamOptions(pager="on", memory=6 * 4 * EXPERT + (1 << 16)),
    # no live cache, a third of one layer's experts: the pager's own LRU evicts inside layers
    "hard-pager-lru": StreamOptions(pager="on", memory=1 << 20, cache="kernel"),
    # one slice per compute thread and nothing more, 64 reads deep: the least that runs
    "minimum": StreamOptions(pager="on", memory=0, queue_depth=64),  # memory: per thread count
    # held to what can ever be resident
    "past-every-expert": StreamOptions(pager="on", memory=(1 << 63) - 1),
}


@pytest.mark.slow
@needs_uffd
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_logits_are_bit_identical_with_the_pager(budget, threads, model, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    from moepack.llama.runtime.run import RunOptions, run_model

    base = RunOptions(n_predict=8, threads=threads, cold=True)
    stock = run_model(model, LONG, base, logits_out=tmp_path / "a.npy")
    opts = BUDGETS[budget]
    if budget == "minimum":
        opts = replace(opts, memory=minimum_budget(_layout(model), threads))
    paged = run_model(model, LONG, replace(base, prefetch=opts), logits_out=tmp_path / "b.npy")
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape[0] == 9 and np.array_equal(a, b)  # the prefill's last logits, then decode
    assert stock.generated == paged.generated
    pg = paged.stream["pager"] if paged.stream else None
    assert pg is not None and pg["peak_resident_bytes"] <= pg["budget_bytes"]
    assert pg["budget_bytes"] == min(opts.memory, pg["expert_bytes"] + pg["spare_bytes"])
    assert pg["threads"] == threads
    for phase in (paged.prefill, paged.decode):
        assert phase.prefetch["pager_read_bytes"] > 0 and phase.prefetch["pager_errors"] == 0
    if budget not in ("roomy", "past-every-expert"):
        forced = sum(p.prefetch["pager_forced_evictions"] for p in (paged.prefill, paged.decode))
        evicted = paged.decode.prefetch["evicted_pieces"]
        assert forced > 0 if budget in ("hard-pager-lru", "minimum") else evicted > 0


@pytest.mark.slow
@needs_uffd
def test_the_library_hook_pages_and_gives_the_file_back(model):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed")
    from moepack.llama import prefetching

    def llama():
        return llama_cpp.Llama(
            str(model), n_ctx=256, n_threads=1, verbose=False, seed=0, logits_all=True
        )

    def complete(llm):
        text = llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
        return text, np.array(llm.scores[: llm.n_tokens]).tobytes()

    plain = llama()
    want = complete(plain)
    plain.close()
    llm = llama()
    hook = prefetching(llm, StreamOptions(pager="on", memory=2 << 20, cache="kernel"))
    assert hook.report()["pager"]["budget_bytes"] == 2 << 20
    assert complete(llm) == want
    assert hook.snapshot()["pager_read_bytes"] > 0
    hook.detach()  # the file is mapped back: the Llama goes on computing from it
    assert hook.streamer.pager is not None and not hook.streamer.pager.active
    llm.reset()
    assert complete(llm) == want
    again = prefetching(llm, StreamOptions(pager="on", memory=2 << 20))
    assert complete(llm) == want
    llm.close()  # its stack lets the pager go before the model is freed
    assert again.streamer.pager is not None and not again.streamer.pager.active


_SECCOMP = r"""
import ctypes, runpy, sys
# deny userfaultfd(2) and /dev/userfaultfd's USERFAULTFD_IOC_NEW with EPERM, allow the rest
prog = [(0x20, 0, 0, 0), (0x15, 4, 0, 323), (0x15, 0, 2, 16), (0x20, 0, 0, 24),
        (0x15, 1, 0, 0xAA00), (0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050001)]
class F(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]
class P(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(F))]
arr = (F * len(prog))(*[F(*p) for p in prog])
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(P(len(prog), arr)), 0, 0) == 0  # SECCOMP_MODE_FILTER
sys.argv = ["moepack", *sys.argv[1:]]
runpy.run_module("moepack", run_name="__main__")
"""


def _env() -> dict[str, str]:
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names x86_64 numbers")
def test_a_refused_userfaultfd_is_one_warning_and_the_page_cache(model):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    memory = memory_for_experts(model, 4 << 20, n_ctx=4096)  # 4 MiB for the experts
    args = ["run", str(model), "-p", PROMPT, "-n", "3", "--prefetch", "--memory", str(memory)]
    r = subprocess.run(
        [sys.executable, "-c", _SECCOMP, *args, "--json"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moepack: warning: userfaultfd is refused")
    assert "the page-cache prefetcher runs instead" in lines[0]
    stream = json.loads(r.stdout)["stream"]
    assert stream["pager"] is None and "EPERM" in stream["pager_fallback"]
    r = subprocess.run(
        [sys.executable, "-c", _SECCOMP, *args, "--pager", "on"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("moepack: error:") and "`pager` is on" not in lines[0]
    assert "--pager is on" in lines[0] and "userfaultfd is refused" in lines[0]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _paging(pid: int) -> bool:
    """Whether ``pid`` holds a userfaultfd (its pager has taken the experts over)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if "userfaultfd" in os.readlink(fd):
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
@needs_uffd
@pytest.mark.parametrize("how", ["sigkill-worker", "sigterm-cli"])
def test_a_killed_run_leaves_nothing_behind(how, model, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "moepack", "run", str(model), "-p", PROMPT, "-n", "30000"]
    memory = memory_for_experts(model, 2 << 20, n_ctx=32768)
    cmd += ["--ctx", "32768", "--prefetch", "--pager", "on", "--memory", str(memory)]
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**_env(), "TMPDIR": str(work)},
    )
    deadline = time.monotonic() + 300
    worker = None
    while worker is None:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the pager never started"
        kids = _children(proc.pid)
        if kids and _paging(kids[0]):
            worker = kids[0]
        time.sleep(0.02)
    assert proc.stdout is not None
    proc.stdout.read(1)  # generating: a piece of text is out
    if how == "sigkill-worker":
        os.kill(worker, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=300)
    while not _gone(worker):
        assert time.monotonic() < deadline, "the worker outlived the run"
        time.sleep(0.02)
    if how == "sigterm-cli":
        assert proc.returncode == 128 + signal.SIGTERM, err
    else:
        assert proc.returncode not in (0, None), err
    assert err.decode().count("moepack: error:") <= 1
    assert list(work.iterdir()) == []  # no scratch folder, no spool, no memfd file
    assert set(os.listdir("/dev/shm")) <= shm_before


def _waiting_in_a_fault(pid: int) -> bool:
    """Whether a thread of ``pid`` waits in the kernel for a userfaultfd fault to be served."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "wchan").read_text().strip() == "handle_userfault":
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
@needs_uffd
@pytest.mark.parametrize(
    ("target", "sig"),
    [("cli", signal.SIGTERM), ("cli", signal.SIGINT), ("worker", signal.SIGTERM)],
)
def test_an_interrupt_stops_a_run_whose_threads_wait_in_faults(target, sig, model, tmp_path):
    """Every read held (a device that stopped answering): llama.cpp's threads wait in faults,
    where no Python handler runs; the interrupt still ends the run in one line."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    cmd = [sys.executable, "-m", "moepack", "run", str(model), "-p", PROMPT, "-n", "30000"]
    memory = memory_for_experts(model, 2 << 20, n_ctx=32768)
    cmd += ["--ctx", "32768", "--prefetch", "--pager", "on", "--memory", str(memory)]
    cmd += ["--cache", "kernel"]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**_env(), "MOEPACK_PAGER_HOLD_READS": "1"},
    )
    deadline = time.monotonic() + 300  # deadlock guards only: each wait is for an event
    worker = None
    while worker is None or not _waiting_in_a_fault(worker):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "no thread ever waited in a fault"
        kids = _children(proc.pid)
        worker = kids[0] if kids and _paging(kids[0]) else None
        time.sleep(0.02)
    os.kill(proc.pid if target == "cli" else worker, sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the interrupt did not stop the run")
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert out == b"" and len(lines) == 1, lines
    if target == "cli":
        assert proc.returncode == 128 + sig, lines
        assert lines[0] == "moepack: interrupted; no output was written"
    else:  # the run itself was not interrupted: its worker was stopped
        assert proc.returncode == 2, lines
        assert lines[0].startswith(f"moepack: error: {model}: llama.cpp could not run")
        assert "stopped (SIGTERM) while llama.cpp waited for expert reads" in lines[0]
    while not _gone(worker):
        assert time.monotonic() < deadline, "the worker outlived the run"
        time.sleep(0.02)


@pytest.mark.slow
@needs_uffd
def test_a_run_at_the_largest_memory_given_on_the_command_line(model, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    cmd = [sys.executable, "-m", "moepack", "run", str(model), "-p", PROMPT, "-n", "4"]
    cmd += ["--prefetch", "--pager", "on", "--json", "--memory", str((1 << 63) - 1)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    pg = json.loads(r.stdout)["stream"]["pager"]
    assert pg["budget_bytes"] == pg["expert_bytes"] + pg["spare_bytes"]


@pytest.mark.slow
@needs_uffd
@pytest.mark.parametrize(("threads", "budget"), [(1, "2M"), (2, "minimum")])
def test_serve_pages_the_experts_and_shows_it_in_metrics(model, threads, budget):
    pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
    from served import Served, logit_bias

    experts = 2 << 20 if budget == "2M" else minimum_budget(_layout(model), threads)
    total = memory_for_experts(model, experts, n_ctx=512)  # --memory counts the whole run
    pager = ["--prefetch", "--pager", "on", "--memory", total, "--qd", 8 if threads == 1 else 64]
    pager += ["--prefix-cache", 0]  # a prefix cache would count in --memory too
    body = {
        "model": model.stem,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": logit_bias(model),
    }
    texts = []
    for args in ([], [*pager, "--cache", "kernel"]):
        with Served(model, "--ctx", 512, "--threads", threads, *args) as s:
            status, text = s.post("/v1/completions", json.dumps(body).encode())
            assert status == 200, text
            texts.append(json.loads(text)["choices"][0]["text"])
            m = s.wait_idle()
            code, lines = s.stop()
            assert code == 128 + signal.SIGTERM, lines
    assert texts[0] == texts[1]
    assert m["moepack_pager_enabled"] == 1 and m["moepack_pager_budget_bytes"] == experts
    assert 0 < m["moepack_pager_peak_resident_bytes"] <= experts
    assert m["moepack_pager_read_bytes_total"] > 0
