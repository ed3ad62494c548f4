"""The expert pager: a page never asked for is served whole at its first touch, resident bytes
stay within the budget (the pager's count held against ``/proc/self/smaps``), the file comes
back on release, llama.cpp's logits are bit-identical at 1 and 2 threads under a roomy and a
hard budget, a refused userfaultfd or an unmapped model is one warning line and the page
cache, and a killed run leaves nothing behind."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama.prefetcher.pager import (
    ExpertPager,
    PagerRefused,
    open_userfaultfd,
    pager_library,
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


def test_a_model_llama_cpp_did_not_map_gets_the_page_cache_and_one_line(small):
    warnings: list[str] = []
    streamer = ExpertStreamer(small, StreamOptions(memory=8 << 20), warn=warnings.append)
    try:
        streamer.attach()  # nothing maps the file in this process
        assert streamer.pager is None
        assert len(warnings) == 1 and "the page-cache prefetcher runs instead" in warnings[0]
        assert streamer.report()["pager_fallback"] is not None
    finally:
        streamer.close()
    on = ExpertStreamer(small, StreamOptions(memory=8 << 20, pager="on"))
    try:
        with pytest.raises(BadInput, match="`pager` is on"):
            on.attach()
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
    paged = run_model(model, LONG, replace(base, prefetch=opts), logits_out=tmp_path / "b.npy")
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape[0] == 9 and np.array_equal(a, b)  # the prefill's last logits, then decode
    assert stock.generated == paged.generated
    pg = paged.stream["pager"] if paged.stream else None
    assert pg is not None and pg["peak_resident_bytes"] <= pg["budget_bytes"] == opts.memory
    for phase in (paged.prefill, paged.decode):
        assert phase.prefetch["pager_read_bytes"] > 0 and phase.prefetch["pager_errors"] == 0
    if budget != "roomy":
        forced = sum(p.prefetch["pager_forced_evictions"] for p in (paged.prefill, paged.decode))
        evicted = paged.decode.prefetch["evicted_pieces"]
        assert forced > 0 if budget == "hard-pager-lru" else evicted > 0


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


@pytest.mark.slow
@needs_uffd
def test_serve_pages_the_experts_and_shows_it_in_metrics(model):
    pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
    from served import Served, logit_bias

    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": logit_bias(model)}
    texts = []
    memory = memory_for_experts(model, 2 << 20, n_ctx=512)
    for args in ([], ["--prefetch", "--pager", "on", "--memory", memory, "--cache", "kernel"]):
        with Served(model, "--ctx", 512, "--threads", 1, *args) as s:
            status, text = s.post("/v1/completions", json.dumps(body).encode())
            assert status == 200, text
            texts.append(json.loads(text)["choices"][0]["text"])
            m = s.wait_idle()
            code, lines = s.stop()
            assert code == 128 + signal.SIGTERM, lines
    assert texts[0] == texts[1]
    assert m["moepack_pager_enabled"] == 1 and m["moepack_pager_budget_bytes"] == 2 << 20
    assert 0 < m["moepack_pager_peak_resident_bytes"] <= 2 << 20
    assert m["moepack_pager_read_bytes_total"] > 0
