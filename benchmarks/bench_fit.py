"""``moepack fit``'s estimates against measured runs (issue 29).

Three generated models of different sizes, top-k, quantisation types and families, planted
and random routing; each at three memory sizes (the model fitting, about half of its experts
in memory, about a quarter) x 1 thread and every core. Per cell ``fit_model(..., verify=True)``
estimates and then runs the model, stock and ``--prefetch``, under the memory holder: decode
and prefill tokens/s estimated against measured, and the verdict (fits / streams / too
slow) against the one the runs show. The hit rates come from a routing trace captured on
other prompts than the measured one (bound by shape, as ``--trace`` is).

Also: the header and tensor index of a split 3-shard model read over HTTP (a range server on
127.0.0.1) as a share of its bytes.

Cells accumulate in ``--results`` (JSON), so the work can run in chunks, each under the
benchmark lock and under ~10 minutes:

    .venv/bin/python benchmarks/bench_fit.py --models a --levels fit,half
    .venv/bin/python benchmarks/bench_fit.py --models a --levels quarter
    ...
    .venv/bin/python benchmarks/bench_fit.py --report          # every cell, errors, verdicts
    .venv/bin/python benchmarks/bench_fit.py --http
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.fit.command import fit_model  # noqa: E402
from moepack.fit.estimate import SLOW_TPS  # noqa: E402
from moepack.fit.remote import fetch_index  # noqa: E402
from moepack.fit.verify import Figure  # noqa: E402
from moepack.llama.runtime.prompts import text_prompt  # noqa: E402
from moepack.llama.runtime.run import RunOptions, run_model  # noqa: E402
from moepack.memhold import GIB, mem_available  # noqa: E402

COMMON = ["--heads", "8", "--kv-heads", "2", "--head-dim", "128", "--vocab", "4096",
          "--prompts", "8", "--prompt-tokens", "128", "--seed", "7"]  # fmt: skip
MODELS: dict[str, dict[str, Any]] = {
    "a": {
        "what": "qwen3moe 24 layers x 64 experts, top-8, Q8_0, planted routing",
        "args": "--arch qwen3moe --layers 24 --experts 64 --top-k 8 --hidden 1024 --expert-ffn 512 "
        "--weight-type Q8_0 --routing cluster=8,stay=0.8,coupling=0.95,skew=1",
    },
    "b": {
        "what": "qwen3moe 24 layers x 32 experts, top-4, F16, random routing",
        "args": "--arch qwen3moe --layers 24 --experts 32 --top-k 4 --hidden 1024 --expert-ffn 512 "
        "--weight-type F16",
    },
    "c": {
        "what": "mixtral 20 layers x 16 experts, top-2, Q5_0, planted routing",
        "args": "--arch mixtral --layers 20 --experts 16 --top-k 2 --hidden 2048 --expert-ffn 1536 "
        "--weight-type Q5_0 --routing cluster=4,stay=0.8,coupling=0.9,skew=1",
    },
}
LEVELS = ("fit", "half", "quarter")
DECODE_TOKENS = 16


def filler(n: int, seed: int) -> str:
    """``n`` one-letter words (one token each in the generated vocabulary)."""
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(list("acegikmoqsuwy"), size=n))


def ensure_model(name: str, folder: Path) -> tuple[Path, list[str]]:
    """The model and its prompts (planted models' own, else filler), written once."""
    spec = MODELS[name]
    path = folder / f"fit-{name}.gguf"
    prompts = path.with_suffix(".prompts.txt")
    planted = "--routing" in spec["args"].split()
    if not path.exists():
        print(f"writing {path} ({spec['what']}) ...", flush=True)
        cmd = [str(Path(sys.executable).with_name("moepack")), "synth", "--out", str(path),
               *spec["args"].split(), *COMMON, "-q"]  # fmt: skip
        if planted:
            cmd += ["--prompts-out", str(prompts)]
        else:
            cut = cmd.index("--prompts")
            del cmd[cut : cut + 4]  # no prompts without planted routing
        subprocess.run(cmd, check=True)
    if planted:
        return path, prompts.read_text(encoding="utf-8").splitlines()
    return path, [filler(128, seed) for seed in range(8)]


def ensure_trace(path: Path, prompts: list[str]) -> Path:
    """Routing captured on other prompts than the measured ones (prompts 2..4)."""
    trace = path.with_suffix(".moetrace")
    if not trace.exists():
        print(f"capturing routing of {path.name} on held-out prompts ...", flush=True)
        run_model(path, [text_prompt(p) for p in prompts[2:5]], RunOptions(n_predict=DECODE_TOKENS, threads=2),
                  trace_out=trace)  # fmt: skip
    return trace


def level_memory(level: str, fit_memory: int, min_memory: int) -> int:
    """The memory of a level: the model fitting with room to spare (on a shared machine the
    others' processes grow into what the holder left), or the live cache holding about half
    or a quarter of the experts (never below what the holder can leave, 1.1 GiB)."""
    if level == "fit":
        return fit_memory + 3 * GIB // 2
    share = {"half": 0.5, "quarter": 0.25}[level]
    return max(int(1.1 * GIB), int(min_memory + share * (fit_memory - min_memory)))


def measured_verdict(cell: dict[str, Any]) -> str:
    """What the runs show: nothing streamed (the stock run read almost nothing per decoded
    token), else streams when the faster runner reached the slow line, else too slow."""
    runs = {r["runner"]: r for r in cell["verify"]["runs"]}
    active = cell["active_expert_bytes"]
    if runs["stock"]["decode_read_per_token"] < 0.05 * active:
        return "fits"
    best = max(r["decode_tps"] for r in runs.values())
    return "streams" if best >= SLOW_TPS else "too slow"


def run_cell(name: str, level: str, threads: int, folder: Path) -> dict[str, Any]:
    path, prompts = ensure_model(name, folder)
    trace = ensure_trace(path, prompts)
    probe = fit_model(str(path), threads=threads, trace=trace)  # sizes only, cached parts
    memory = level_memory(level, probe.fit_memory, probe.min_memory)
    text = (prompts[0], prompts[1])
    t0 = time.time()
    r = fit_model(str(path), memory=memory, threads=threads, trace=trace, verify=True,
                  verify_text=text, verify_tokens=DECODE_TOKENS, on_note=print)  # fmt: skip
    assert r.verify is not None
    cell = {
        "model": name,
        "what": MODELS[name]["what"],
        "level": level,
        "threads": threads,
        "memory": memory,
        "file_bytes": r.shape.file_bytes,
        "active_expert_bytes": r.shape.active_expert_bytes,
        "fit_memory": r.fit_memory,
        "verdict": r.main.verdict,
        "point": r.main.to_json(),
        "verify": r.verify.to_json(),
        "seconds": time.time() - t0,
        "load": os.getloadavg()[0],
        "when": time.strftime("%H:%M", time.gmtime()),
    }
    cell["measured_verdict"] = measured_verdict(cell)
    return cell


def reestimate(cell: dict[str, Any], folder: Path) -> None:
    """The estimate of a measured cell again, from the current cost model and the cached
    storage profile and calibration; the measurement stays, the first estimate is kept
    beside it (``estimated_first``)."""
    path, prompts = ensure_model(cell["model"], folder)
    trace = ensure_trace(path, prompts)
    r = fit_model(str(path), memory=cell["memory"], threads=cell["threads"], trace=trace)
    cell["verdict"] = r.main.verdict
    cell["point"] = r.main.to_json()
    by_name = {}
    for est in (r.main.stock, r.main.prefetch):
        by_name[f"{est.runner} decode"] = est.decode_tps
        by_name[f"{est.runner} prefill"] = est.prefill_tps
    for f in cell["verify"]["figures"]:
        f.setdefault("estimated_first", f["estimated"])
        lo, hi = by_name[f["figure"]]
        f["estimated"] = {"low": lo, "high": hi}
        f["error"] = Figure(f["figure"], (lo, hi), f["measured"]).error
    cell["reestimated"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def load(results: Path) -> dict[str, Any]:
    return json.loads(results.read_text()) if results.exists() else {}


def save(results: Path, doc: dict[str, Any]) -> None:
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, results)


def report(doc: dict[str, Any]) -> None:
    cells = [doc[k] for k in sorted(doc) if k.count("/") == 2]
    print(f"{'model':<5} {'memory':>8} {'thr':>3} {'figure':<17} {'estimated':>13} {'measured':>9} "
          f"{'error':>7}  verdict est/measured")  # fmt: skip
    errors: dict[str, list[float]] = {}
    verdicts_ok = 0
    for c in cells:
        ok = c["verdict"] == c["measured_verdict"]
        verdicts_ok += ok
        for i, f in enumerate(c["verify"]["figures"]):
            lo, hi = f["estimated"]["low"], f["estimated"]["high"]
            mid = (lo * hi) ** 0.5
            err = mid / f["measured"] - 1 if f["measured"] else float("inf")
            errors.setdefault(f["figure"], []).append(err)
            est = f"{lo:.2f}" if abs(hi - lo) < 0.005 * hi else f"{lo:.2f}-{hi:.2f}"
            tag = (
                f"{c['verdict']}/{c['measured_verdict']}{'' if ok else ' WRONG'}" if i == 0 else ""
            )
            print(f"{c['model']:<5} {c['memory'] / GIB:7.2f}G {c['threads']:>3} {f['figure']:<17} "
                  f"{est:>13} {f['measured']:9.2f} {100 * err:+6.0f}%  {tag}")  # fmt: skip
    every = [e for v in errors.values() for e in v]
    if "http" in doc:
        h = doc["http"]
        print(f"HTTP: {h['shards']} shards, {h['bytes_read']:,} of {h['total_bytes']:,} bytes "
              f"read ({100 * h['share']:.4f} %, target <= 1 %) in {h['requests']} requests, "
              f"index {'identical' if h['same_index'] else 'DIFFERENT'}")  # fmt: skip
    if not every:
        print("no cells yet")
        return
    print()
    for name, v in errors.items():
        a = [abs(e) for e in v]
        print(f"{name:<17} cells {len(v):>2}  median |error| {100 * statistics.median(a):5.1f} %  "
              f"worst {100 * max(a):5.1f} %")  # fmt: skip
    a = [abs(e) for e in every]
    print(f"{'all':<17} cells {len(every):>2}  median |error| {100 * statistics.median(a):5.1f} %  "
          f"worst {100 * max(a):5.1f} % (targets: median <= 20 %, worst <= 35 %)")  # fmt: skip
    print(f"verdicts right: {verdicts_ok} of {len(cells)}")


def http_check(folder: Path) -> dict[str, Any]:
    """Model a split into 3 shards, served over HTTP, its index read by ``fetch_index``."""
    from rangeserver import serving

    base, _ = ensure_model("a", folder)
    split = folder / "split"
    split.mkdir(exist_ok=True)
    shards = sorted(split.glob("fit-a-*-of-00003.gguf"))
    if len(shards) != 3:
        size = base.stat().st_size
        print(f"writing a 3-shard copy of {base.name} ...", flush=True)
        cmd = [str(Path(sys.executable).with_name("moepack")), "synth", "--out",
               str(split / "fit-a.gguf"), *MODELS["a"]["args"].split(), *COMMON, "-q",
               "--split-max-size", str(size // 3 + (64 << 20))]  # fmt: skip
        subprocess.run(cmd, check=True)
        shards = sorted(split.glob("fit-a-*-of-00003.gguf"))
    assert len(shards) == 3, shards
    mirror = folder / "mirror"
    mirror.mkdir(exist_ok=True)
    with serving(split) as srv:
        index = fetch_index(f"{srv.url}/{shards[0].name}", mirror)
    with MoeModel(index.local) as remote, MoeModel(shards[0]) as local:
        same = {n: (t.offset, t.n_bytes) for n, t in remote.tensors.items()} == {
            n: (t.offset, t.n_bytes) for n, t in local.tensors.items()
        }
    for s in index.shards:
        s.local.unlink()
    return {"shards": len(index.shards), "bytes_read": index.bytes_read,
            "total_bytes": index.total_bytes, "share": index.share_read,
            "requests": index.requests, "same_index": same}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-fit"))
    ap.add_argument("--results", type=Path, default=None, help="default: DIR/results.json")
    ap.add_argument("--models", default="", help=f"any of {','.join(MODELS)}")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--again", action="store_true", help="measure cells already in the results")
    ap.add_argument("--http", action="store_true", help="the split model's header over HTTP")
    ap.add_argument("--prepare", action="store_true", help="write the models and traces only")
    ap.add_argument("--report", action="store_true", help="print every cell and the errors")
    ap.add_argument("--reestimate", action="store_true",
                    help="estimate the measured cells again with the current model (no runs)")  # fmt: skip
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    results = args.results or args.dir / "results.json"
    doc = load(results)
    for name in filter(None, args.models.split(",")):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        if args.prepare:
            path, prompts = ensure_model(name, args.dir)
            ensure_trace(path, prompts)
            continue
        for level in args.levels.split(","):
            if level not in LEVELS:
                ap.error(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
            for threads in sorted({int(t) for t in args.threads.split(",")}):
                key = f"{name}/{level}/{threads}"
                if key in doc and not args.again:
                    continue
                print(f"== {key}: MemAvailable {mem_available() / GIB:.1f} GiB, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
                doc[key] = run_cell(name, level, threads, args.dir)
                save(results, doc)
    if args.reestimate:
        for key in sorted(k for k in doc if k.count("/") == 2):
            reestimate(doc[key], args.dir)
        save(results, doc)
    if args.http:
        doc["http"] = http_check(args.dir)
        save(results, doc)
    if args.report or not args.models:
        report(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
