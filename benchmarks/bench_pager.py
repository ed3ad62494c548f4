"""The expert pager (issue 26) against the page-cache prefetcher and stock llama.cpp, on
``bench_run``'s models, pressure and bound definitions. One part per invocation (each well
under ten minutes; run every one under a lock of your own if the machine is shared):

- ``mech``: what placing read bytes costs: ``UFFDIO_COPY`` into anonymous memory, a memfd
  filled by the ``O_DIRECT`` read itself and ``UFFDIO_CONTINUE``, the read alone, and
  ``UFFDIO_MOVE`` of the read's pages with evicted pages recycled (``csrc/uffd_place.c``),
  random 1 MiB chunks of the model, CPU and wall milliseconds per GB, alternated rounds;
- ``disk``: fio's direct random reads of one expert slice at queue depth 8 (libaio) against
  the pager's own reads of every slice once, in random order, 24 slices at a time as a
  layer's misses come, each batch waited for (the pager outside llama.cpp, over a map of the
  file made as llama.cpp makes it);
- ``run``: decode under pressure (``--leave``: the memory holder), ``stock``, ``overlap``
  (the page-cache prefetcher, today's defaults) and ``pager`` (the same with ``--pager on``,
  ``--memory auto``; ``pager-copy``: placed by ``UFFDIO_COPY``, ``MOEPACK_PAGER_PLACE=copy``), alternated pairs at 1 thread and every core, fresh process each, decode
  cold, logits compared with stock's; the fully cached compute time per token first (stock,
  warm, no holder) for the bound ``1/max(io, compute)`` with ``io`` = the run's read bytes per
  token at the ``disk`` part's bandwidth (``--gbps``, from that part);
- ``nohold``: no memory holder, ``--memory`` of the same size (``--leave``): the pager's tok/s,
  its peak resident bytes against the budget, and ``Cached`` of ``/proc/meminfo`` before and
  after (the model's experts must not grow it), alternated with ``pager`` under the holder;
- ``cached``: no holder, the model warm in the page cache and the pager's budget over the
  model: stock, overlap and pager in alternated pairs at 1 thread and every core (the
  issue's "fully cached ≥ 0.97× stock"), logits compared with stock's;
- ``prefill``: a 512-token prompt under pressure, stock, overlap and pager;
- ``q4k``: whether llama.cpp's CPU weight repacking moves expert tensors of a ``Q4_K`` model
  out of its mapping (resident anonymous memory of a process that loaded it, against the
  expert bytes). The other parts take ``--weight-type Q4_K_M`` (``bench_run``'s Q4_K_M
  model, quantised by llama.cpp; ``--layers 48`` is issue 25's 3.0 GB one).

    .venv/bin/python benchmarks/bench_pager.py mech
    .venv/bin/python benchmarks/bench_pager.py run --leave 1.5G --pairs 3
    .venv/bin/python benchmarks/bench_pager.py run --weight-type Q4_K_M --layers 48
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_run  # noqa: E402
from bench_storage import ensure_fio  # noqa: E402
from headline import record  # noqa: E402
from memhold import GIB, MemoryHold, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.llama.prefetcher import cbuild  # noqa: E402
from moepack.llama.prefetcher.pager import ExpertPager  # noqa: E402
from moepack.llama.prefetcher.prefetch import ExpertRanges  # noqa: E402
from moepack.llama.prefetcher.streamer import StreamOptions  # noqa: E402
from moepack.llama.runtime.run import RunOptions, RunResult, run_model  # noqa: E402
from moepack.storage.linux import LIBC, PAGE_SIZE, cachestat  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS: dict[str, dict[str, Any]] = {
    "stock": {"prefetch": None},
    "overlap": {"prefetch": StreamOptions(pager="off")},
    "pager": {"prefetch": StreamOptions(pager="on")},
    "pager-copy": {"prefetch": StreamOptions(pager="on")},  # MOEPACK_PAGER_PLACE=copy
}


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


# -- mech ----------------------------------------------------------------------------------


def place_lib() -> ctypes.CDLL:
    cc = cbuild.compiler()
    assert cc, "no C compiler"
    out = Path("/tmp") / f"moepack-uffd-place-{os.getpid()}.so"
    proc = cbuild.compile_to(
        cc, HERE / "csrc" / "uffd_place.c", list(cbuild.build_flags({}, ())), out
    )
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(out))
    out.unlink()
    lib.moepack_bench_place.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    return lib


def part_mech(args: argparse.Namespace, model: Path) -> None:
    lib = place_lib()
    chunk, total = 1 << 20, args.mech_mb << 20
    n = total // chunk
    size = model.stat().st_size
    fd = os.open(model, os.O_RDONLY | os.O_DIRECT)
    modes = (0, 1, 2, 3)
    got: dict[int, list[np.ndarray]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
            offs = np.random.default_rng(100 * r + mode).permutation(size // chunk - 1)[:n]
            offs = offs.astype(np.int64) * chunk
            out = np.zeros(5, dtype=np.int64)
            rc = lib.moepack_bench_place(mode, fd, offs.ctypes.data, n, chunk, out.ctypes.data)
            assert rc == 0, os.strerror(-rc)
            got[mode].append(out[:4] / (total / 1e9) / 1e6)  # ms per GB
    os.close(fd)
    names = {0: "UFFDIO_COPY (anonymous)", 1: "memfd + UFFDIO_CONTINUE", 2: "O_DIRECT read alone",
             3: "UFFDIO_MOVE, pages recycled"}  # fmt: skip
    print(f"placing {args.mech_mb} MiB of random 1 MiB chunks, O_DIRECT, {args.rounds} rounds "
          "alternated; medians, ms per GB (place: read + place; touch: one byte a page)")  # fmt: skip
    cpu = {}
    for mode, rows in got.items():
        m = np.median(np.stack(rows), axis=0)
        cpu[mode] = float(m[1])
        print(f"  {names[mode]:<26} place wall {m[0]:7.1f} cpu {m[1]:6.1f} | "
              f"touch wall {m[2]:5.1f} cpu {m[3]:5.1f}")  # fmt: skip
    move, copy = cpu[3] - cpu[2], cpu[0] - cpu[2]  # placing alone: the read's own CPU taken off
    record(
        "pager-placing",
        title="Pager: placing read bytes",
        what="CPU to place read bytes with `UFFDIO_MOVE` (pages recycled), the read excluded",
        ratio=move / copy,
        yardstick="`UFFDIO_COPY` into anonymous memory",
        yardstick_value=copy,
        unit="CPU ms/GB",
        figures={f"{names[m]} CPU ms/GB, read included": c for m, c in cpu.items()},
        detail=f"{move:.0f} against {copy:.0f} CPU ms per GB; with the read {cpu[3]:.0f} "
        f"against {cpu[0]:.0f}",
        model=f"{args.mech_mb} MiB of random 1 MiB chunks of {describe(args, model)}, O_DIRECT",
    )


# -- disk ----------------------------------------------------------------------------------


def fio_direct(path: Path, bs: int, qd: int) -> float:
    fio = ensure_fio()
    cmd = [fio, "--name=direct", f"--filename={path}", "--rw=randread", f"--bs={bs}",
           "--direct=1", "--ioengine=libaio", f"--iodepth={qd}", "--numjobs=1",
           f"--size={path.stat().st_size // bs * bs}", "--runtime=20", "--time_based=0",
           "--output-format=json"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]["read"]["bw_bytes"])


def pager_reads(path: Path, qd: int, batch: int, seed: int, budget: int) -> float:
    """The pager's bytes/s: every slice once, random order, ``batch`` slices of one layer at
    a time, each batch waited for."""
    with MoeModel(path) as m:
        layout = ExpertRanges(m)
    rng = np.random.default_rng(seed)
    work = []
    for block in layout.blocks:
        per = max(1, batch // layout.table(block).shape[0])
        ids = rng.permutation(layout.n_expert[block])
        work += [(block, ids[i : i + per]) for i in range(0, ids.size, per)]
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    pager = ExpertPager([path], layout, budget, queue_depth=qd)
    try:
        t0 = time.perf_counter()
        for i in rng.permutation(len(work)):
            block, ids = work[i]
            pager.push(block, 0, layout.slice_rows(block, ids))
            pager.wait_idle()
        dt = time.perf_counter() - t0
        st = pager.stats
    finally:
        pager.release()
        LIBC.munmap(addr, size)
    return st.read_bytes / dt


def part_disk(args: argparse.Namespace, model: Path) -> None:
    with MoeModel(model) as m:
        slice_bytes = m.blocks[0].weight_tensors[0].slice_bytes
    fio, ours = [], []
    for r in range(args.rounds):
        fio.append(fio_direct(model, slice_bytes, args.qd))
        ours.append(pager_reads(model, args.qd, 24, r, 1 * GIB))
    f, o = statistics.median(fio), statistics.median(ours)
    print(f"direct random reads of {slice_bytes // 1024} KiB at QD {args.qd}, {args.rounds} "
          f"rounds: fio {f / 1e9:.2f} GB/s ({', '.join(f'{x / 1e9:.2f}' for x in fio)}); "
          f"the pager, 24 slices a batch, {o / 1e9:.2f} GB/s "
          f"({', '.join(f'{x / 1e9:.2f}' for x in ours)}): {o / f:.2f} of fio")  # fmt: skip
    record(
        "pager-reads",
        title="Pager: reads against fio",
        what="the pager's direct reads of every slice once, 24 a batch",
        ratio=o / f,
        yardstick=f"fio's direct random reads of one slice at QD {args.qd}, libaio",
        yardstick_value=f / 1e9,
        unit="GB/s",
        figures={
            "pager GB/s": o / 1e9,
            "fio GB/s": f / 1e9,
            "slice KiB": slice_bytes // 1024,
            "rounds": args.rounds,
        },
        target="≥ 0.9 of fio (issue 26)",
        met=o / f >= 0.9,
        model=describe(args, model),
    )


# -- runs ----------------------------------------------------------------------------------


def one(config: str, model: Path, args: argparse.Namespace, threads: int, cold: bool,
        extra: dict[str, Any] | None = None, logits: Path | None = None) -> RunResult:  # fmt: skip
    words = args.prompt.split()
    kw = dict(CONFIGS[config])
    if extra:
        kw.update(extra)
    opts = RunOptions(n_predict=args.tokens, n_ctx=256, threads=threads, cold=cold, **kw)
    # the pager places with UFFDIO_MOVE where the kernel has it; pager-copy measures the copy
    os.environ["MOEPACK_PAGER_PLACE"] = "copy" if config == "pager-copy" else "move"
    try:
        return run_model(model, " ".join(words[:16]), opts, continuation=" ".join(words[16:]),
                         logits_out=logits)  # fmt: skip
    finally:
        del os.environ["MOEPACK_PAGER_PLACE"]


def summary(r: RunResult) -> dict[str, float]:
    d = r.decode.to_json()
    pg = (r.stream or {}).get("pager") or {}
    return {
        "tps": r.decode.tokens_per_second,
        "mb": d["bytes_read_per_token"] / 1e6,
        "pager_mb": d["pager_read_bytes_per_token"] / 1e6,
        "cpu_ms": 1e3 * d["cpu_seconds"] / max(1, r.decode.tokens),
        "hit": d["expert_hit_rate"] or 0.0,
        "faults": d["major_faults_per_token"] + d["pager_faults_per_token"],
        "moved": r.decode.prefetch.get("pager_moved_pages", 0)
        * PAGE_SIZE
        / max(1, r.decode.prefetch.get("pager_read_bytes", 0)),
        "peak": pg.get("peak_resident_bytes", 0) / GIB,
        "budget": pg.get("budget_bytes", 0) / GIB,
    }


def part_run(args: argparse.Namespace, model: Path) -> None:
    threads = args.threads
    cached: dict[int, float] = {}
    cached_cpu: dict[int, float] = {}
    for t in threads:  # the fully cached compute time per token (stock, warm)
        runs = []
        for _ in range(2):
            bench_run.warm(model)
            runs.append(one("stock", model, args, t, False))
        cached[t] = statistics.median(1 / r.decode.tokens_per_second for r in runs)
        cached_cpu[t] = statistics.median(summary(r)["cpu_ms"] for r in runs)
        print(f"  fully cached stock t{t}: {1 / cached[t]:.2f} tok/s, "
              f"{cached_cpu[t]:.1f} CPU ms/token", flush=True)  # fmt: skip
    configs = args.configs.split(",")
    logits = args.dir / "pager-logits"
    logits.mkdir(exist_ok=True)
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    hold = MemoryHold(parse_size(args.leave), args.hold_floor).__enter__()
    print(f"holding {hold.held / GIB:.1f} GiB, {hold.available / GIB:.2f} GiB left", flush=True)
    try:
        for t in threads:
            for i in range(args.pairs):
                order = configs if i % 2 == 0 else list(reversed(configs))
                for c in order:
                    if not hold.alive():  # a fresh holder: every run starts under pressure
                        hold.__exit__(None, None, None)
                        hold = MemoryHold(parse_size(args.leave), args.hold_floor).__enter__()
                        print(f"  the holder again: {hold.available / GIB:.2f} GiB left")
                    r = one(c, model, args, t, True, logits=logits / f"{c}.npy")
                    row = summary(r)
                    row["valid"] = float(hold.alive())  # under the holder from start to end
                    rows.setdefault((c, t), []).append(row)
                    if not hold.alive():
                        print(f"  the holder let go during {c} t{t} pair {i + 1}", flush=True)
                same = {c: bool(np.array_equal(np.load(logits / f"{c}.npy"),
                                               np.load(logits / "stock.npy"))) for c in configs}  # fmt: skip
                print(f"  t{t} pair {i + 1}: " + ", ".join(
                    f"{c} {rows[(c, t)][-1]['tps']:.2f} tok/s" for c in configs)
                    + f"; logits identical {same}", flush=True)  # fmt: skip
    finally:
        hold.__exit__(None, None, None)
    print(f"\n under {args.leave} left, {args.tokens} decode tokens, medians of {args.pairs} "
          f"pairs; io at {args.gbps} GB/s")  # fmt: skip
    print(" thr config     tok/s (range)     MB/tok pager MB/t  CPU ms/t (x cached)  hit  faults"
          "  overl bound  of it  peak/budget GiB")  # fmt: skip
    print(" (medians of the runs the holder held through; how many of them: n)")
    table: dict[tuple[str, int], dict[str, float]] = {}
    for (c, t), every in rows.items():
        rs = [r for r in every if r["valid"]]
        if not rs:
            print(f"  t{t} {c:<9} no valid run")
            continue

        def med(k: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[k] for r in rs)

        tps = [r["tps"] for r in rs]
        io = med("mb") * 1e6 / (args.gbps * 1e9)
        bound = 1 / max(io, cached[t])
        table[(c, t)] = {
            "tps": med("tps"),
            "of_bound": med("tps") / bound,
            "n": len(rs),
            "cpu_x": med("cpu_ms") / cached_cpu[t],
        }
        print(f"  t{t} {c:<9} {med('tps'):6.2f} ({min(tps):.2f}-{max(tps):.2f})  {med('mb'):7.1f} "
              f"{med('pager_mb'):7.1f}  {med('cpu_ms'):7.1f} ({med('cpu_ms') / cached_cpu[t]:.2f}x)"
              f"  {med('hit'):.2f} {med('faults'):6.1f}  {bound:6.2f}  {med('tps') / bound:5.2f}"
              f"  {med('peak'):.2f}/{med('budget'):.2f}  moved {med('moved'):.2f}  n {len(rs)}")  # fmt: skip
    record_run(args, model, table)


def record_run(
    args: argparse.Namespace, model: Path, table: dict[tuple[str, int], dict[str, float]]
) -> None:
    """The pager against the page-cache prefetcher at the fewest threads, from the runs the
    holder held through, as benchmarks/README.md's table shows it."""
    t = min(args.threads)
    pager, overlap = table.get(("pager", t)), table.get(("overlap", t))
    if pager is None or overlap is None:
        return
    ratio = pager["tps"] / overlap["tps"]
    more = {
        f"{n} threads": table[("pager", n)]["tps"] / table[("overlap", n)]["tps"]
        for n in args.threads[1:]
        if ("pager", n) in table and ("overlap", n) in table
    }
    target, met, value = None, None, None
    if args.random:
        target, met = "≥ the page-cache prefetcher's tok/s (issue 26)", ratio >= 1
    elif args.weight_type == "Q8_0":
        target = "≥ 0.8 of the overlapped bound, CPU ≤ 1.1× cached (issue 26)"
        met = pager["of_bound"] >= 0.8 and pager["cpu_x"] <= 1.1
        value = f"{pager['of_bound']:.2f} and {pager['cpu_x']:.2f}×"
    record(
        f"pager-pressure{variant(args)[0]}",
        title=f"Pager: decode under memory pressure{variant(args)[1]}",
        what=f"decode tok/s with `--pager on` (read pages moved in by `UFFDIO_MOVE`), "
        f"{args.leave} left, {t} thread{'s' if t > 1 else ''}",
        ratio=ratio,
        yardstick="the page-cache prefetcher of `run --prefetch`",
        yardstick_value=overlap["tps"],
        unit="tok/s",
        figures={
            "pager tok/s": pager["tps"],
            "page-cache prefetcher tok/s": overlap["tps"],
            "of the overlapped bound": pager["of_bound"],
            "CPU per token / cached": pager["cpu_x"],
            "valid pager runs": int(pager["n"]),
        }
        | more,
        target=target,
        met=met,
        target_value=value,
        detail="; ".join(
            [
                f"{int(pager['n'])} valid pager run(s)",
                f"{pager['of_bound']:.2f} of the overlapped bound",
            ]
            + [f"{n} {r:.2f}×" for n, r in more.items()]
        ),
        model=describe(args, model),
    )


def variant(args: argparse.Namespace) -> tuple[str, str]:
    """The results file's suffix and the title's, for a model other than the planted Q8_0."""
    key, title = "", ""
    if args.random:
        key, title = key + "-random", title + ", random routing"
    if args.weight_type != "Q8_0":
        key, title = (
            key + f"-{bench_run.WEIGHT_TAGS[args.weight_type]}",
            title + f", {args.weight_type}",
        )
    return key, title


def describe(args: argparse.Namespace, model: Path) -> str:
    routing = "random" if args.random else "planted"
    return (
        f"bench_run.py's {routing}-routing qwen3moe ({args.layers} layers × 64 experts, "
        f"top-8, {args.weight_type}, {model.stat().st_size / 1e9:.2f} GB)"
    )


def part_nohold(args: argparse.Namespace, model: Path) -> None:
    budget = parse_size(args.leave)
    got: dict[str, list[dict[str, float]]] = {"nohold": [], "hold": []}
    growth: list[float] = []
    own: list[float] = []
    for i in range(args.pairs):
        for kind in ("nohold", "hold") if i % 2 == 0 else ("hold", "nohold"):
            if kind == "nohold":
                bench_run.drop_confirmed(model)
                c0 = meminfo("Cached")
                r = one("pager", model, args, 1, True, {"prefetch": StreamOptions(
                    pager="on", memory=budget)})  # fmt: skip
                growth.append((meminfo("Cached") - c0) / 1e6)
                fd = os.open(model, os.O_RDONLY)
                try:  # of that, the model file's own pages (Cached is the whole machine's)
                    own.append(cachestat(fd, 0, 0).nr_cache * PAGE_SIZE / 1e6)
                finally:
                    os.close(fd)
            else:
                with MemoryHold(budget, args.hold_floor) as hold:
                    r = one("pager", model, args, 1, True)
                    assert hold.alive(), "the holder let go"
            got[kind].append(summary(r))
            print(
                f"  pair {i + 1} {kind}: {got[kind][-1]['tps']:.2f} tok/s, peak "
                f"{got[kind][-1]['peak']:.3f} of {got[kind][-1]['budget']:.3f} GiB",
                flush=True,
            )
    a = statistics.median(r["tps"] for r in got["nohold"])
    b = statistics.median(r["tps"] for r in got["hold"])
    with MoeModel(model) as m:
        dense = (model.stat().st_size - m.expert_bytes) / 1e6
    print(f"\n --memory {args.leave}, no holder: {a:.2f} tok/s; under the holder at {args.leave}: "
          f"{b:.2f} ({a / b:.2f}x); peak resident {max(r['peak'] for r in got['nohold']):.3f} "
          f"GiB of {got['nohold'][0]['budget']:.3f}; Cached grew {statistics.median(growth):.0f} MB, "
          f"the model file's own pages {statistics.median(own):.0f} MB "
          f"(the dense part of the model is {dense:.0f} MB)")  # fmt: skip
    peak = max(r["peak"] for r in got["nohold"])
    budget_gib = got["nohold"][0]["budget"]
    record(
        f"pager-nohold{variant(args)[0]}",
        title=f"Pager: `--memory` without the memory holder{variant(args)[1]}",
        what=f"decode tok/s with `--memory {args.leave}` and no holder",
        ratio=a / b,
        yardstick=f"the pager under the memory holder at {args.leave}, automatic budget",
        yardstick_value=b,
        unit="tok/s",
        figures={
            "no holder tok/s": a,
            "under the holder tok/s": b,
            "peak resident GiB": peak,
            "budget GiB": budget_gib,
            "Cached grew MB": statistics.median(growth),
            "of which the model file's pages MB": statistics.median(own),
            "dense part MB": dense,
        },
        target="within 10 % of the run under the holder (issue 26)",
        met=abs(a / b - 1) <= 0.1,
        detail=f"peak resident {peak:.3f} of {budget_gib:.3f} GiB; `Cached` grew "
        f"{statistics.median(growth):.0f} MB, {statistics.median(own):.0f} MB of them the model "
        f"file's (its dense part {dense:.0f} MB)",
        model=describe(args, model),
    )


def part_cached(args: argparse.Namespace, model: Path) -> None:
    configs = args.configs.split(",")
    logits = args.dir / "cached-logits"
    logits.mkdir(exist_ok=True)
    size = model.stat().st_size
    vs_stock: dict[tuple[str, int], float] = {}
    stock_tps: dict[int, float] = {}
    for t in args.threads:
        rows: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
        for i in range(args.pairs):
            for c in configs if i % 2 == 0 else list(reversed(configs)):
                bench_run.warm(model)
                extra = (
                    {"prefetch": StreamOptions(pager="on", memory=2 * size)}
                    if c == "pager"
                    else None
                )
                r = one(c, model, args, t, False, extra, logits=logits / f"{c}.npy")
                rows[c].append(summary(r))
            same = {c: bool(np.array_equal(np.load(logits / f"{c}.npy"),
                                           np.load(logits / "stock.npy"))) for c in configs}  # fmt: skip
            print(f"  t{t} pair {i + 1}: " + ", ".join(
                f"{c} {rows[c][-1]['tps']:.2f} tok/s" for c in configs)
                + f"; logits identical {same}", flush=True)  # fmt: skip
        base = statistics.median(r["tps"] for r in rows["stock"])
        for c in configs:
            tps = [r["tps"] for r in rows[c]]
            ratios = [a["tps"] / b["tps"] for a, b in zip(rows[c], rows["stock"], strict=True)]
            vs_stock[(c, t)], stock_tps[t] = statistics.median(ratios), base
            print(f"  t{t} {c:<8} {statistics.median(tps):6.2f} tok/s ({min(tps):.2f}-"
                  f"{max(tps):.2f}), {statistics.median(ratios):.2f}x stock (pairs "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}), CPU "
                  f"{statistics.median(r['cpu_ms'] for r in rows[c]):.1f} ms/token, read "
                  f"{statistics.median(r['pager_mb'] for r in rows[c]):.1f} pager MB/token "
                  f"(stock median {base:.2f})", flush=True)  # fmt: skip
    t = min(args.threads)
    if ("overlap", t) in vs_stock:
        ratio = vs_stock[("overlap", t)]
        record(
            f"prefetch-cached{variant(args)[0]}",
            title=f"`run --prefetch` with the model fully cached{variant(args)[1]}",
            what="decode tok/s of the page-cache prefetcher (the pager off, as `--pager auto` "
            f"leaves it), {t} thread{'s' if t > 1 else ''}",
            ratio=ratio,
            yardstick="stock llama.cpp",
            yardstick_value=stock_tps[t],
            unit="tok/s",
            figures={f"{c} t{n} / stock": r for (c, n), r in vs_stock.items()}
            | {"pairs": args.pairs},
            target="≥ 0.97× stock (issues 19, 26)",
            met=ratio >= 0.97,
            detail="; ".join(
                f"{c} at {n} threads {r:.2f}×"
                for (c, n), r in vs_stock.items()
                if (c, n) != ("overlap", t) and c != "stock"
            ),
            model=f"{describe(args, model)}, warm",
        )


def part_prefill(args: argparse.Namespace, model: Path, prompts: list[str]) -> None:
    text = " ".join(prompts[:4])
    by_threads: dict[int, dict[str, float]] = {}
    with MemoryHold(parse_size(args.leave), args.hold_floor) as hold:
        for t in args.threads:
            rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
            for i in range(args.pairs):
                for c in list(CONFIGS) if i % 2 == 0 else list(reversed(CONFIGS)):
                    bench_run.drop_confirmed(model)
                    r = run_model(model, text, RunOptions(n_predict=0, n_ctx=1024, batch=512,
                                                          threads=t, **CONFIGS[c]))  # fmt: skip
                    rates[c].append(r.prefill.tokens_per_second)
                    n = r.prefill.tokens
            med = {c: statistics.median(v) for c, v in rates.items()}
            print(f"  t{t} prefill of {n} tokens under {args.leave}: " + ", ".join(
                f"{c} {v:.2f} tok/s" for c, v in med.items())
                + f"; pager / overlap {med['pager'] / med['overlap']:.2f}x", flush=True)  # fmt: skip
            by_threads[t] = med
        if not hold.alive():
            print("  the holder let go during the runs: not valid")
            return
    t = min(by_threads)
    med = by_threads[t]
    more = {f"{th} threads": m["pager"] / m["overlap"] for th, m in by_threads.items() if th != t}
    record(
        f"pager-prefill{variant(args)[0]}",
        title=f"Pager: prefill under memory pressure{variant(args)[1]}",
        what=f"prefill tok/s of a {n}-token prompt with `--pager on`, {args.leave} left, "
        f"{t} thread{'s' if t > 1 else ''}",
        ratio=med["pager"] / med["overlap"],
        yardstick="the page-cache prefetcher of `run --prefetch`",
        yardstick_value=med["overlap"],
        unit="tok/s",
        figures={f"{c} tok/s": v for c, v in med.items()} | more,
        target="≥ the page-cache prefetcher's tok/s (issue 26)",
        met=med["pager"] >= med["overlap"],
        detail="; ".join(f"{k} {r:.2f}×" for k, r in more.items()) or None,
        model=describe(args, model),
    )


def part_q4k(args: argparse.Namespace, model: Path) -> None:
    probe = (
        "import llama_cpp, sys\n"
        "m = llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)\n"
        "m.eval(m.tokenize(b'hello'))\n"
        "rss = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('Rss')}\n"
        "print(rss['RssAnon'] * 1024, rss['RssFile'] * 1024)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe, str(model)], capture_output=True,
                         text=True, check=True).stdout.split()  # fmt: skip
    with MoeModel(model) as m:
        experts, size = m.expert_bytes, model.stat().st_size
    print(f"{model.name}: {size / 1e9:.2f} GB, experts {experts / 1e9:.2f} GB; a process that "
          f"loaded it and ran one pass: RssAnon {int(out[0]) / 1e9:.2f} GB, RssFile "
          f"{int(out[1]) / 1e9:.2f} GB")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["mech", "disk", "run", "nohold", "cached", "prefill", "q4k"])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-pager"))
    ap.add_argument("--random", action="store_true", help="the random-routing model")
    ap.add_argument("--weight-type", default="Q8_0", choices=sorted(bench_run.WEIGHT_TAGS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--leave", default="1.5G")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--hold-floor", type=parse_size, default=GIB,
        help="the holder lets go below this MemAvailable (1G suits a shared machine; the "
        "live cache locks most of what is left, so on a machine of its own use 256M)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=1.0, help="the disk's bandwidth for the bound")
    ap.add_argument("--mech-mb", type=int, default=512)
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--configs", default="stock,overlap,pager")
    args = ap.parse_args()
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.part == "q4k":
        args.weight_type = "Q4_K_M"
    model, prompts = bench_run.ensure_model(
        args.layers, args.dir, "qwen3moe", planted=not args.random, weight_type=args.weight_type
    )
    args.prompt = prompts[0]
    print(f"model {model.name}: {model.stat().st_size / 1e9:.2f} GB, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    if args.part == "mech":
        part_mech(args, model)
    elif args.part == "disk":
        part_disk(args, model)
    elif args.part == "run":
        part_run(args, model)
    elif args.part == "nohold":
        part_nohold(args, model)
    elif args.part == "cached":
        part_cached(args, model)
    elif args.part == "q4k":
        part_q4k(args, model)
    else:
        part_prefill(args, model, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
