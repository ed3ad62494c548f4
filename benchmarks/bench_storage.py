"""moepack's read engines against fio, on equal buffers, measured in the same run on one file.

Random reads of 64 KiB and 1 MiB at queue depth 1, 8 and 32, O_DIRECT, one file. The headline
is the comparison on *equal buffers*, twice:

- huge pages: moepack's buffers on transparent huge pages vs fio with ``--iomem=shmhuge``
  (hugetlb pages, reserved for the run through /proc/sys/vm/nr_hugepages when root and given
  back afterwards, also on error or Ctrl-C);
- 4 KiB pages: moepack with ordinary pages (``buffers.use_huge_pages = False``) vs fio's
  default malloc'd buffers (THP is ``madvise`` on the usual distribution, so they are 4 KiB
  pages).

On this virtio disk the buffers' page size alone changes GB/s by up to 2.5x (a 1 MiB read is
one physically contiguous segment or 256), so comparing moepack on huge pages with fio on
4 KiB pages measures the buffers, not the read path. The third table is that buffer effect,
for both tools.

The device is a shared virtual disk whose speed flips between throttled and unthrottled
states within seconds, so each cell is measured in two phases:

1. every engine of both tools runs ``--rounds`` times, interleaved (order flipping each round);
   each tool's best engine is the one with the best median;
2. the two best engines run as ``--pairs`` back-to-back pairs (order alternating), and the
   cell's ratio is the median of the per-pair ratios moepack / fio, with the middle half of
   the pair ratios (25th..75th percentile) for the noise.

Every run of either tool is a fresh process that allocates its buffers and then reads (the
clock starts at the first request in both), so both draw the kernel's page placement under
the same conditions (see ``run_moepack``).

Target: ratio >= 0.9 in every cell on equal buffers. Then, where Python's overhead shows:
requests served from the page cache (4 KiB, no device wait), per engine, in µs per request.

    .venv/bin/python benchmarks/bench_storage.py [--dir /var/tmp/moepack-bench]
        [--file-size 4G] [--seconds 0.5] [--rounds 3] [--pairs 15] [--keep] [--json out.json]

fio is installed from Debian (apt-get) when it is missing. The 4 GiB test file is removed at
the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from headline import record
from moepack.storage import buffers
from moepack.storage.corpus import ensure_corpus, remove_corpus
from moepack.storage.engine import get_engine
from moepack.storage.measure import RandomWork
from moepack.storage.modes import Mode, open_file
from moepack.storage.units import format_size, parse_size

SIZES = [64 << 10, 1 << 20]
DEPTHS = [1, 8, 32]
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGETLB_PAGE = 2 << 20


def ensure_fio() -> str:
    fio = shutil.which("fio")
    if fio:
        return fio
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("bench_storage: fio is missing and cannot be installed here (needs root + apt)")
    print("bench_storage: installing fio (apt-get) ...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True, env=env)
    fio = shutil.which("fio")
    if not fio:
        sys.exit("bench_storage: fio did not install")
    return fio


def fio_engines(fio: str) -> list[str]:
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True).stdout.split()
    return [e for e in ("io_uring", "libaio", "psync") if e in out]


def _free_hugepages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


@contextmanager
def hugetlb_pages(needed: int):
    """Reserve ``needed`` free hugetlb pages for fio's shmhuge buffers while the block runs,
    and put nr_hugepages back as it was afterwards (also on error, Ctrl-C or SIGTERM).
    Yields why huge pages are not available, or None."""
    try:
        old = int(NR_HUGEPAGES.read_text())
    except (OSError, ValueError) as e:
        yield f"cannot read {NR_HUGEPAGES}: {e}"
        return
    free = _free_hugepages()
    if free >= needed:
        yield None
        return
    if os.geteuid() != 0:
        yield f"fio's shmhuge needs {needed} free hugetlb pages ({free} free) and root to reserve them"
        return
    previous_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        NR_HUGEPAGES.write_text(str(old + needed - free))
        got = _free_hugepages()
        yield None if got >= needed else f"reserved only {got} of {needed} hugetlb pages"
    finally:
        NR_HUGEPAGES.write_text(str(old))
        signal.signal(signal.SIGTERM, previous_term)


def run_fio(fio: str, path: Path, engine: str, bs: int, qd: int, seconds: float, mem: str) -> float:
    cmd = [
        fio, "--name=bench", f"--filename={path}", "--rw=randread", f"--bs={bs}",
        f"--iodepth={qd}", "--direct=1", f"--ioengine={engine}", f"--iomem={mem}",
        f"--runtime={round(seconds * 1000)}ms",
        "--time_based", "--randrepeat=0", "--output-format=json",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio {engine} --iomem={mem} failed: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]["read"]["bw_bytes"]


def interleave(a: list, b: list) -> list:
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i : i + 1] + b[i : i + 1]
    return out


def run_moepack(
    path: Path, eng: str, bs: int, qd: int, seconds: float, seed: int, huge: bool
) -> float:
    """One moepack run in a fresh process, as every fio run is one: each tool then allocates
    its buffers in the same conditions. With 4 KiB pages that matters: where the kernel puts
    a buffer's pages (contiguous runs, or scattered: one DMA segment per page) depends on what
    the process freed before; a long-lived Python process that has churned through memory
    gets scattered pages where a fresh one often gets contiguous runs. The clock starts at
    the first request, so start-up is not timed (as in fio)."""
    code = (
        "import sys; from moepack.storage import buffers, get_engine, open_file, Mode;"
        "from moepack.storage.measure import measure_cell;"
        "p, e, bs, qd, s, seed, huge = sys.argv[1:];"
        "buffers.use_huge_pages = huge == '1';"
        "f = open_file(p, Mode.DIRECT);"
        "print(measure_cell(f, get_engine(e), int(bs), int(qd), float(s), int(seed)).bytes_per_sec)"
    )
    args = [str(path), eng, str(bs), str(qd), str(seconds), str(seed), "1" if huge else "0"]
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"moepack {eng} failed: {p.stderr.strip()[-300:]}")
    return float(p.stdout.split()[-1])


def compare(
    fio: str, path: Path, f_engines: list[str], args: argparse.Namespace, huge: bool
) -> list[dict]:
    """Every cell on equal buffers: both tools on huge pages, or both on 4 KiB pages."""
    mem = "shmhuge" if huge else "malloc"
    buffers.use_huge_pages = huge
    results = []
    seed = [1000 if huge else 2000]
    try:

        def run(tool: str, eng: str, bs: int, qd: int) -> float:
            if tool == "fio":
                return run_fio(fio, path, eng, bs, qd, args.seconds, mem) / 1e9
            seed[0] += 1
            return run_moepack(path, eng, bs, qd, args.seconds, seed[0], huge) / 1e9

        for bs in SIZES:
            for qd in DEPTHS:
                results.append(cell(run, f_engines, bs, qd, args))
    finally:
        buffers.use_huge_pages = True
    return results


def cell(run, f_engines: list[str], bs: int, qd: int, args: argparse.Namespace) -> dict:
    m_eng = ["pread", "uring"] if qd == 1 else ["threads", "uring", "uring-batch"]
    f_eng = [e for e in f_engines if qd == 1 or e != "psync"]
    runs: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        order = interleave([("fio", e) for e in f_eng], [("moepack", e) for e in m_eng])
        for tool, eng in reversed(order) if rnd % 2 else order:
            runs.setdefault(f"{tool}:{eng}", []).append(run(tool, eng, bs, qd))
    med = {k: statistics.median(v) for k, v in runs.items()}
    fio_best = max((k for k in med if k.startswith("fio:")), key=med.__getitem__)
    moe_best = max((k for k in med if k.startswith("moepack:")), key=med.__getitem__)
    pairs = []
    for i in range(args.pairs):
        order = [fio_best, moe_best] if i % 2 == 0 else [moe_best, fio_best]
        got = {k: run(*k.split(":"), bs, qd) for k in order}
        pairs.append((got[fio_best], got[moe_best]))
    ratios = [m / fv for fv, m in pairs if fv > 0]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    row = {
        "request_bytes": bs,
        "queue_depth": qd,
        "fio_best": fio_best.split(":")[1],
        "fio_gbps": statistics.median(p[0] for p in pairs),
        "moepack_best": moe_best.split(":")[1],
        "moepack_gbps": statistics.median(p[1] for p in pairs),
        "ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "pair_ratios": ratios,
        "pairs_gbps": pairs,
        "phase1_medians_gbps": med,
        "phase1_runs_gbps": runs,
    }
    detail = "  ".join(f"{k}={v:.3f}" for k, v in med.items())
    print(f"  {format_size(bs):>4} QD{qd:<2} {detail}")
    print(f"{'':10}pairs {fio_best} vs {moe_best}: " + " ".join(f"{r:.2f}" for r in ratios))
    sys.stdout.flush()
    return row


def print_table(title: str, results: list[dict]) -> float:
    print(f"\n{title}")
    head = (
        f"{'size':>5} {'QD':>3} | {'fio best (pairs)':>20} | {'moepack best (pairs)':>24} "
        "| ratio | middle half"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        flag = "" if r["ratio"] >= 0.9 else "  < 0.9"
        print(
            f"{format_size(r['request_bytes']):>5} {r['queue_depth']:>3} | "
            f"{r['fio_gbps']:6.3f} GB/s {r['fio_best']:>9} | "
            f"{r['moepack_gbps']:6.3f} GB/s {r['moepack_best']:>13} | {r['ratio']:5.2f} "
            f"| {r['ratio_q1']:.2f}..{r['ratio_q3']:.2f}{flag}"
        )
    worst = min(r["ratio"] for r in results)
    print(f"worst cell {worst:.2f} (target >= 0.90)")
    return worst


def print_buffer_effect(huge: list[dict], small: list[dict]) -> list[dict]:
    """Per cell: each tool's GB/s on huge pages over its GB/s on 4 KiB pages."""
    print("\nbuffer effect: huge-page buffers vs 4 KiB-page buffers, per tool (pair medians)")
    head = f"{'size':>5} {'QD':>3} | {'fio 4K -> huge GB/s':>24} | {'moepack 4K -> huge GB/s':>27}"
    print(head)
    print("-" * len(head))
    out = []
    for h, s in zip(huge, small, strict=True):
        fx = h["fio_gbps"] / s["fio_gbps"] if s["fio_gbps"] else float("nan")
        mx = h["moepack_gbps"] / s["moepack_gbps"] if s["moepack_gbps"] else float("nan")
        print(
            f"{format_size(h['request_bytes']):>5} {h['queue_depth']:>3} | "
            f"{s['fio_gbps']:5.3f} -> {h['fio_gbps']:5.3f} ({fx:4.2f}x) | "
            f"{s['moepack_gbps']:5.3f} -> {h['moepack_gbps']:5.3f} ({mx:4.2f}x)"
        )
        out.append({"request_bytes": h["request_bytes"], "queue_depth": h["queue_depth"],
                    "fio_4k_gbps": s["fio_gbps"], "fio_huge_gbps": h["fio_gbps"],
                    "moepack_4k_gbps": s["moepack_gbps"],
                    "moepack_huge_gbps": h["moepack_gbps"]})  # fmt: skip
    return out


def record_headline(huge: list[dict], small: list[dict], size: int) -> None:
    """The worst cell on equal buffers, as benchmarks/README.md's table shows it."""
    cells = [(r, "huge pages") for r in huge] + [(r, "4 KiB pages") for r in small]
    worst, pages = min(cells, key=lambda c: c[0]["ratio"])
    where = f"{format_size(worst['request_bytes'])} QD {worst['queue_depth']} on {pages}"
    record(
        "storage-reads",
        title="Read engines against fio",
        what=f"O_DIRECT random reads, the worst of {len(cells)} cells (64 KiB and 1 MiB at "
        "QD 1, 8, 32, equal buffers), GB/s",
        ratio=worst["ratio"],
        yardstick=f"fio's best engine in that cell, {worst['fio_best']} at {where}",
        yardstick_value=worst["fio_gbps"],
        unit="GB/s",
        figures={
            f"moepack GB/s ({worst['moepack_best']})": worst["moepack_gbps"],
            f"fio GB/s ({worst['fio_best']})": worst["fio_gbps"],
            "middle half of the pair ratios": f"{worst['ratio_q1']:.2f}..{worst['ratio_q3']:.2f}",
            "worst cell, huge pages": min((r["ratio"] for r in huge), default=None),
            "worst cell, 4 KiB pages": min(r["ratio"] for r in small),
        },
        target="≥ 0.9 in every cell (issue 3)",
        met=worst["ratio"] >= 0.9,
        detail=f"moepack's {worst['moepack_best']} {worst['moepack_gbps']:.3f} GB/s",
        model=f"one {size / 2**30:.0f} GiB file, O_DIRECT",
    )


def overhead(path: Path, seconds: float) -> dict[str, float]:
    """Microseconds per 4 KiB request served from the page cache: the Python-side cost."""
    out = {}
    with open_file(path, Mode.BUFFERED) as f:
        for eng, qd in [("pread", 1), ("mmap", 1), ("uring", 1), ("uring", 8), ("threads", 8)]:
            fd = os.open(path, os.O_RDONLY)
            os.pread(fd, f.size, 0)  # warm the cache: no device wait below
            os.close(fd)
            work = RandomWork(f.size, 4096, wrap=True, seed=1)
            work.start(seconds)
            get_engine(eng).run(f, work, qd)
            dt = time.perf_counter_ns() - (work.t0_ns or time.perf_counter_ns())
            out[f"{eng} QD{qd}"] = dt / 1e3 / max(1, len(work.latencies))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/moepack-bench", help="folder for the test file")
    ap.add_argument("--file-size", default="4G", help="size of the test file (default 4G)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per run")
    ap.add_argument("--rounds", type=int, default=3, help="phase 1: rounds of every engine")
    ap.add_argument("--pairs", type=int, default=15, help="phase 2: back-to-back pairs")
    ap.add_argument("--keep", action="store_true", help="keep the test file afterwards")
    ap.add_argument("--json", help="also write every run here")
    args = ap.parse_args()

    fio = ensure_fio()
    version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    folder = Path(args.dir)
    made_folder = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    corpus = None
    try:
        corpus = ensure_corpus(folder, parse_size(args.file_size))  # refuses a user's file
        run_all(fio, version, corpus.path, corpus.size, args)
    finally:
        if not args.keep and corpus is not None:
            remove_corpus(folder)
            print(f"\nremoved the test file from {folder} (--keep keeps it)")
        if made_folder and not args.keep:
            try:
                folder.rmdir()
            except OSError:
                pass


def run_all(fio: str, version: str, path: Path, size: int, args: argparse.Namespace) -> None:
    f_engines = fio_engines(fio)
    print(f"{version}; file {path} ({size / 2**30:.1f} GiB), O_DIRECT randread")
    print(
        f"{args.seconds:g} s per run; {args.rounds} rounds of every engine, then {args.pairs} "
        "back-to-back pairs of the two best, per cell"
    )
    print(f"fio engines {', '.join(f_engines)}; moepack engines pread/threads, uring, uring-batch")
    thp = buffers.huge_page_size()
    needed = -(-max(SIZES) * max(DEPTHS) // HUGETLB_PAGE) + 2

    huge: list[dict] = []
    why_not = "transparent huge pages are off here" if not thp else None
    if thp:
        with hugetlb_pages(needed) as why_not:
            if why_not is None:
                print("\n[equal buffers: huge pages — moepack THP, fio --iomem=shmhuge]")
                huge = compare(fio, path, f_engines, args, huge=True)
    print("\n[equal buffers: 4 KiB pages — moepack use_huge_pages=False, fio malloc]")
    small = compare(fio, path, f_engines, args, huge=False)

    print("\nratio = median over back-to-back pairs of moepack's best / fio's best engine")
    worst = {}
    if huge:
        worst["huge"] = print_table(
            "equal buffers, huge pages (moepack THP vs fio --iomem=shmhuge):", huge
        )
    else:
        print(f"\n(no huge-page comparison: {why_not})")
    worst["4k"] = print_table("equal buffers, 4 KiB pages (moepack vs fio malloc):", small)
    effect = print_buffer_effect(huge, small) if huge else []
    record_headline(huge, small, size)

    small_file = path.parent / "overhead.bin"
    small_file.write_bytes(os.urandom(64 << 20))
    try:
        ovh = overhead(small_file, 1.0)
    finally:
        small_file.unlink()
    print("\nPython-side cost per request (4 KiB, page-cache hits, no device wait):")
    for k, v in ovh.items():
        print(f"  {k:<12} {v:6.1f} µs/request")
    if args.json:
        doc = {"fio": version, "equal_huge": huge, "equal_4k": small, "buffer_effect": effect,
               "worst": worst, "overhead_us": ovh}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
