"""End-to-end decode tokens/s under memory pressure: stock llama.cpp (its mmap faults) against
``moepack run --prefetch``, measured in the same run.

A synthetic qwen3moe of several GB with planted routing that llama.cpp really follows
(``moepack synth --routing``: co-activation clusters of 8, topics that persist; 32 layers x 64
experts, top-8, Q8_0, hidden 1024, expert FFN 512: 544 KiB slices, 3.5 GB) is written once into
``--dir`` with its topic-moving prompts. Decode feeds the rest of one prompt token by token
(``run_model(continuation=…)``), so decode routes like that text rather than like greedy
output of random weights. For each page-cache
size a helper (``memhold.py``) holds the rest of RAM as touched anonymous memory — it releases
everything if MemAvailable falls below 1 GiB — and each configuration runs in pairs, the order
alternating, every run a fresh llama.cpp process. Under pressure every decode starts cold: the
run drops the model's own pages after the prompt (nothing machine-wide). With the whole model
cached (``full``) nothing is held or dropped and the file is read in once first; ``cold``
holds nothing but starts every decode cold (the page cache can take the whole model).

Printed per size and configuration: median decode tokens/s (range), the median of the pair
ratios against stock, major faults, MB read (``/proc/self/io``) and prefetch reads per token,
the share of decode time spent prefetching, CPU-busy share (CPU seconds / wall / threads), CPU
milliseconds per token (on a shared machine the steadiest measure of work done), and
the model's resident fraction when the run ended. Also ``read_ahead_kb`` of the model's disk.

Configurations: ``stock``, ``prefetch``, ``prefetch-nora`` (prefetch plus MADV_RANDOM on the
expert ranges of llama.cpp's mapping), ``reordered`` (prefetch on a file repacked with a plan
from routing captured by ``moepack run --trace`` on this model), and where the architecture's
llama.cpp loader takes a fused gate+up (``--arch deepseek2``) ``fused`` and ``fused-reordered``
(prefetch on the drop-in ``repack --layout fused`` / ``fused+reorder`` files).

    .venv/bin/python benchmarks/bench_run.py --leave 1.5G,2.2G,full --pairs 3 --tokens 12
    .venv/bin/python benchmarks/bench_run.py --small      # a 0.4 GB model, a quick check
    .venv/bin/python benchmarks/bench_run.py --arch deepseek2 --configs stock,prefetch,fused,fused-reordered
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memhold import GIB, MemoryHold, mem_available, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.checkpoint.fused_archs import takes_fused_gate_up  # noqa: E402
from moepack.layout.coactivation_plan import plan_files  # noqa: E402
from moepack.layout.plan import Plan, load_plan, save_plan  # noqa: E402
from moepack.llama.run import PrefetchOptions, RunOptions, RunResult, run_model  # noqa: E402
from moepack.rewrite.repack import repack  # noqa: E402
from moepack.storage import linux  # noqa: E402
from moepack.storage.device import describe_device  # noqa: E402

SYNTH_ARGS = [
    "--experts",
    "64",
    "--top-k",
    "8",
    "--hidden",
    "1024",
    "--expert-ffn",
    "512",
    "--heads",
    "8",
    "--kv-heads",
    "2",
    "--head-dim",
    "128",
    "--vocab",
    "4096",
    "--weight-type",
    "Q8_0",
    "--routing",
    "cluster=8,stay=0.8,coupling=0.95,skew=1",
    "--prompts",
    "16",
    "--prompt-tokens",
    "128",
    "--seed",
    "7",
]


def ensure_model(layers: int, folder: Path, arch: str) -> tuple[Path, list[str]]:
    """The planted-routing model and its prompts, written once (reused when present)."""
    name = "moe" if arch == "qwen3moe" else arch  # the qwen3moe file keeps its old name
    path = folder / f"{name}-{layers}x64-q8-routed.gguf"
    prompts = path.with_suffix(".prompts.txt")
    if not path.exists() or not prompts.exists():
        print(f"writing {path} ...", flush=True)
        moepack = Path(sys.executable).with_name("moepack")
        cmd = [str(moepack), "synth", "--out", str(path), "--layers", str(layers), "--arch", arch]
        cmd += SYNTH_ARGS
        subprocess.run([*cmd, "--prompts-out", str(prompts), "-q"], check=True)
    return path, prompts.read_text(encoding="utf-8").splitlines()


REWRITES: dict[str, str | None] = {  # config -> the repack layout of its file (None: the model)
    "stock": None,
    "prefetch": None,
    "prefetch-nora": None,
    "reordered": "reorder",
    "fused": "fused",
    "fused-reordered": "fused+reorder",
}


def ensure_plan(model: Path, prompts: list[str], threads: int) -> Plan:
    """A plan from routing llama.cpp produced on other prompts than the measured one."""
    path = model.with_suffix(".plan.json")
    if path.exists():
        return load_plan(path)
    trace = model.with_suffix(".moetrace")
    print("capturing routing for the plan (held-out prompts) ...", flush=True)
    run_model(
        model, " ".join(prompts[1:4]), RunOptions(n_predict=0, threads=threads), trace_out=trace
    )
    outcome = plan_files(model, trace)
    save_plan(outcome.plan, path)
    return outcome.plan


def ensure_rewrite(model: Path, layout: str, prompts: list[str], threads: int) -> Path:
    """``model`` repacked as ``layout`` (a reorder with the plan of ``ensure_plan``)."""
    suffix = "reordered" if layout == "reorder" else layout.replace("+", "-")
    out = model.with_name(f"{model.stem}-{suffix}.gguf")
    if out.exists():
        return out
    plan = ensure_plan(model, prompts, threads) if "reorder" in layout else None
    print(f"writing {out.name} ({layout}) ...", flush=True)
    repack(model, plan, out, layout=None if layout == "reorder" else layout)
    return out


def read_ahead_kb(path: Path) -> str:
    try:
        dev = describe_device(path).block_device
        base = Path("/sys/block") / str(dev).split("/")[-1]
        return (base / "queue" / "read_ahead_kb").read_text().strip()
    except (OSError, AttributeError):
        return "?"


def resident_fraction(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = linux.cachestat(fd, 0, 0).nr_cache
    finally:
        os.close(fd)
    return pages * linux.PAGE_SIZE / path.stat().st_size


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


@dataclass
class Sample:
    config: str
    result: RunResult
    resident: float

    def row(self) -> dict[str, float]:
        d = self.result.decode
        j = d.to_json()
        return {
            "tps": d.tokens_per_second,
            "faults": j["major_faults_per_token"],
            "mb_read": j["bytes_read_per_token"] / 1e6,
            "pf_reads": j["prefetch_reads_per_token"],
            "pf_share": j["prefetch_share"],
            "cpu_share": j["cpu_seconds"] / d.seconds / self.result.threads if d.seconds else 0,
            "cpu_ms": 1e3 * j["cpu_seconds"] / d.tokens if d.tokens else 0.0,
            "resident": self.resident,
        }


CONFIGS: dict[str, dict[str, Any]] = {
    "stock": {},
    "prefetch": {"prefetch": True},
    "prefetch-nora": {"prefetch": True, "no_readaround": True},
    "reordered": {"prefetch": True},
    "fused": {"prefetch": True},
    "fused-reordered": {"prefetch": True},
}


def one_run(config: str, files: dict[str, Path], args: argparse.Namespace, cold: bool) -> Sample:
    path = files[config]
    kw = dict(CONFIGS[config])
    words = args.prompt.split()
    options = RunOptions(
        n_predict=args.tokens,
        n_ctx=256,  # a small KV cache: the memory left is for the page cache
        threads=args.threads,
        prefetch=PrefetchOptions(args.engine, args.qd) if kw.get("prefetch") else None,
        no_readaround=bool(kw.get("no_readaround")),
        cold=cold,
    )
    r = run_model(path, " ".join(words[:16]), options, continuation=" ".join(words[16:]))
    return Sample(config, r, resident_fraction(path))


def measure_size(
    label: str, files: dict[str, Path], configs: list[str], args: argparse.Namespace
) -> dict[str, list[Sample]]:
    full = label == "full"
    out: dict[str, list[Sample]] = {c: [] for c in configs}
    for i in range(args.pairs):
        order = configs if i % 2 == 0 else list(reversed(configs))
        for c in order:
            if full:
                warm(files[c])
            s = one_run(c, files, args, cold=not full)
            out[c].append(s)
            row = s.row()
            print(
                f"  {label:>6} pair {i + 1} {c:<14} {row['tps']:7.2f} tok/s  "
                f"faults/tok {row['faults']:7.1f}  MB/tok {row['mb_read']:7.1f}  "
                f"resident {row['resident']:.2f}",
                flush=True,
            )
    return out


def summarize(label: str, samples: dict[str, list[Sample]]) -> list[str]:
    lines = []
    stock = [s.row()["tps"] for s in samples.get("stock", [])]
    for c, ss in samples.items():
        rows = [s.row() for s in ss]
        tps = [r["tps"] for r in rows]
        ratio = (
            statistics.median(r["tps"] / b for r, b in zip(rows, stock, strict=True) if b > 0)
            if stock and c != "stock"
            else 1.0
        )

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        lines.append(
            f"{label:>6} {c:<14} {statistics.median(tps):7.2f} ({min(tps):.2f}-{max(tps):.2f})"
            f" {ratio:6.2f}x {med('faults'):8.1f} {med('mb_read'):8.1f} {med('pf_reads'):8.1f}"
            f" {100 * med('pf_share'):6.0f}% {100 * med('cpu_share'):6.0f}% {med('cpu_ms'):7.1f}"
            f" {med('resident'):6.2f}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-run"))
    ap.add_argument("--small", action="store_true", help="an 8-layer model (0.9 GB)")
    ap.add_argument("--leave", default="1.5G,2.2G,full", help="page-cache sizes, or 'full'")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", default="threads")
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument(
        "--configs",
        default="stock,prefetch,prefetch-nora,reordered",
        help=f"any of {', '.join(CONFIGS)} (fused ones need an architecture that takes them)",
    )
    ap.add_argument("--arch", default="qwen3moe", help="synthetic MoE family (moepack synth)")
    args = ap.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    if any("fused" in c for c in configs) and not takes_fused_gate_up(args.arch):
        ap.error(f"llama.cpp does not load a fused gate+up for {args.arch!r}")
    args.dir.mkdir(parents=True, exist_ok=True)
    model, prompts = ensure_model(8 if args.small else 32, args.dir, args.arch)
    args.prompt = prompts[0]
    files = {c: model for c in configs}
    for c in configs:
        layout = REWRITES[c]
        if layout is not None:
            files[c] = ensure_rewrite(model, layout, prompts, args.threads)
    size = model.stat().st_size
    with MoeModel(model) as m:
        expert_share = m.expert_bytes / size
    print(
        f"model {model.name}: {size / 1e9:.2f} GB ({100 * expert_share:.0f} % experts), "
        f"read_ahead_kb {read_ahead_kb(model)}, MemAvailable {mem_available() / GIB:.1f} GiB, "
        f"threads {args.threads}, prefetch {args.engine} QD {args.qd}, {args.tokens} tokens, "
        f"{args.pairs} alternated pairs",
        flush=True,
    )
    summary: list[str] = []
    for label in args.leave.split(","):
        t0 = time.time()
        if label in ("full", "cold"):
            samples = measure_size(label, files, configs, args)
        else:
            leave = parse_size(label)
            with MemoryHold(leave) as hold:
                print(
                    f"holding {hold.held / GIB:.1f} GiB, {hold.available / GIB:.2f} GiB left "
                    f"(model {size / GIB:.2f} GiB)",
                    flush=True,
                )
                samples = measure_size(label, files, configs, args)
                if not hold.alive():
                    print(f"  {label}: the holder let go (MemAvailable < 1 GiB): not valid")
        summary += summarize(label, samples)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    print()
    print(
        " cache config         decode tok/s (range)   vs stock faults/t  MB/tok  reads/t "
        "prefetch   CPU  CPU ms/t resident"
    )
    for line in summary:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
