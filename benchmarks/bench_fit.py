"""``moepack fit``'s estimates against measured runs: what ``run`` does with no flags.

Per cell ``fit_model(..., verify=True)`` asks run's own code what it will choose (engine,
budget, threads), estimates decode and prefill tokens/s, then runs the model exactly so (a
fresh ``run_model`` with the same flags, the model's pages dropped before it) and sets
estimate beside measurement, the choice beside run's own, the verdict (fits / streams / too
slow / refused) beside the one the run shows. Hit rates come from routing captured on other
prompts than the measured one (bound by shape, as ``--trace`` is). Cells accumulate in a JSON
results file, so the work runs in chunks.

**Real shapes** (``--real q4_0,q4km,q36``): the models of ``benchmarks/bench_real.py``
(written once by its ``build`` part into ``benchmarks/.real-models``; ``--dir`` points
elsewhere), each at ``--leave`` memory left on the machine (``moepack.memhold``: what run
then sees as available) and at ``--threads`` (``auto``: run chooses; a number: ``-t N``).
Results in ``DIR/fit-results.json``::

    .venv/bin/python benchmarks/bench_fit.py --real q4_0 --leave 20G,12G,8G --threads 1,2
    .venv/bin/python benchmarks/bench_fit.py --real q4_0,q4km,q36 --report

``--url``: the same estimates from an HTTP URL (the tests' range server on the models'
folder, reading only the ranges asked), nothing run; the report sets each beside the file's
cell (run's choice the same, the decode estimate's difference)::

    .venv/bin/python benchmarks/bench_fit.py --real q4_0,q4km,q36 --leave 12G --threads auto --url

**Small generated models** (``--models a,b,c``): three families and types, planted and
random routing, at the model fitting (no flags) and with ``--memory`` holding about half or a
quarter of the experts (the pager's hard budget: no holder needed), at 1 thread and every
core. Results in ``DIR/results.json`` (``DIR``: ``/tmp/moepack-bench-fit``)::

    .venv/bin/python benchmarks/bench_fit.py --models a --levels fit,half
    .venv/bin/python benchmarks/bench_fit.py --report

**The overlap shares** (``--overlap``): a 4-layer model of Qwen3-30B-A3B's layer shape
(Q4_0), decoded fully cached (the compute) and streamed through the pager and the page-cache
prefetcher at three budgets (each run's own bytes per token at the device's bandwidth: the
reads), in turns, at 1 thread and every core; the share of the shorter term the overlap hides
is fitted per engine and thread setting and kept for ``fit`` on this CPU
(``<cache>/fit/overlap-*.json``). Run it first on a quiet machine.

Also ``--http``: a split 3-shard model's header and tensor index over HTTP as a share of
its bytes.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.fit.calibrate import cpu_name, filler_text  # noqa: E402
from moepack.fit.command import fit_model  # noqa: E402
from moepack.fit.device import storage_profile  # noqa: E402
from moepack.fit.overlap import Overlap, fitted_share, overlap_factors, save_overlap  # noqa: E402
from moepack.fit.remote import fetch_index  # noqa: E402
from moepack.fit.verify import Figure, drop_model  # noqa: E402
from moepack.llama.prefetcher.streamer import StreamOptions  # noqa: E402
from moepack.llama.runtime.memory_plan import memory_for_experts  # noqa: E402
from moepack.llama.runtime.prompts import text_prompt  # noqa: E402
from moepack.llama.runtime.run import RunOptions, cores, run_model  # noqa: E402
from moepack.memhold import GIB, mem_available, parse_size  # noqa: E402

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
OVERLAP_MODEL = ("--arch qwen3moe --layers 4 --experts 128 --top-k 8 --hidden 2048 "
                 "--expert-ffn 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 4096 "
                 "--weight-type Q4_0 --seed 3")  # fmt: skip
LEVELS = ("fit", "half", "quarter")
DECODE_TOKENS = 16
REAL_TOKENS = 32
SMALL_DIR = Path("/tmp/moepack-bench-fit")


def moepack() -> str:
    return str(Path(sys.executable).with_name("moepack"))


def filler(n: int, seed: int) -> str:
    """``n`` one-letter words (one token each in the generated vocabulary)."""
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(list("acegikmoqsuwy"), size=n))


# -- the models ------------------------------------------------------------------------------


def ensure_model(name: str, folder: Path) -> tuple[Path, list[str]]:
    """A small model and its prompts (planted models' own, else filler), written once."""
    spec = MODELS[name]
    path = folder / f"fit-{name}.gguf"
    prompts = path.with_suffix(".prompts.txt")
    planted = "--routing" in spec["args"].split()
    if not path.exists():
        print(f"writing {path} ({spec['what']}) ...", flush=True)
        cmd = [moepack(), "synth", "--out", str(path), *spec["args"].split(), *COMMON, "-q"]
        if planted:
            cmd += ["--prompts-out", str(prompts)]
        else:
            cut = cmd.index("--prompts")
            del cmd[cut : cut + 4]  # no prompts without planted routing
        subprocess.run(cmd, check=True)
    if planted:
        return path, prompts.read_text(encoding="utf-8").splitlines()
    return path, [filler(128, seed) for seed in range(8)]


def real_model(name: str, folder: Path) -> Path:
    """A real-shaped model of ``bench_real.py`` (its ``build`` part writes it)."""
    import bench_real

    if name not in bench_real.MODELS:
        raise SystemExit(f"unknown real model {name!r}; known: {', '.join(bench_real.MODELS)}")
    path = bench_real.model_path(folder, name)
    if not path.exists():
        raise SystemExit(
            f"{path} is not there: write it with "
            f"`benchmarks/bench_real.py build --models {name} --dir {folder}`"
        )
    return path


def ensure_trace(path: Path, held_out: list[str], tokens: int = DECODE_TOKENS) -> Path:
    """Routing captured on other prompts than the measured ones (``held_out``), as run runs
    the model with no flags here, written once beside it."""
    trace = path.with_suffix(".moetrace")
    if not trace.exists():
        print(f"capturing routing of {path.name} on held-out prompts ...", flush=True)
        run_model(path, [text_prompt(p) for p in held_out],
                  RunOptions(n_predict=tokens), trace_out=trace)  # fmt: skip
    return trace


def real_trace(path: Path, prompt_tokens: int, tokens: int) -> Path:
    """Routing of a held-out prompt like the measured one (``prompt_tokens`` with BOS) and a
    continuation decoded token by token as the measured run decodes it (greedy output of a
    random model repeats itself, and would route unlike it), written once beside it."""
    trace = path.with_suffix(".moetrace")
    if not trace.exists():
        n = max(64, tokens)
        print(f"capturing routing of {path.name} on a held-out prompt ...", flush=True)
        run_model(path, filler(prompt_tokens - 1, 2), RunOptions(n_predict=n),
                  continuation=filler(n + 1, 3), trace_out=trace)  # fmt: skip
    return trace


# -- one cell --------------------------------------------------------------------------------


def cell_record(r: Any, t0: float, **what: Any) -> dict[str, Any]:
    assert r.verify is not None
    cell = {
        **what,
        "file_bytes": r.shape.file_bytes,
        "active_expert_bytes": r.shape.active_expert_bytes,
        "fit_memory": r.fit_memory,
        "available": r.available,
        "verdict": r.main.verdict,
        "measured_verdict": r.verify.verdict,
        "choice_same": r.verify.choice.get("same"),
        "point": r.main.to_json(),
        "verify": r.verify.to_json(),
        "overlap": r.overlap.to_json(),
        "seconds": time.time() - t0,
        "load": os.getloadavg()[0],
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    return cell


def small_memory(level: str, path: Path) -> int | None:
    """``--memory`` of a level: none where the model fits, else what holds about half or a
    quarter of the experts beside the context (the pager's hard budget)."""
    if level == "fit":
        return None
    share = {"half": 0.5, "quarter": 0.25}[level]
    with MoeModel(path) as m:
        experts = int(share * m.expert_bytes)
    return memory_for_experts(path, experts, n_ctx=4096)


def run_small(name: str, level: str, threads: int, folder: Path) -> dict[str, Any]:
    path, prompts = ensure_model(name, folder)
    trace = ensure_trace(path, prompts[2:5])
    memory = small_memory(level, path)
    t0 = time.time()
    r = fit_model(str(path), memory=memory, threads=threads, trace=trace, verify=True,
                  verify_stock=True, verify_text=(prompts[0], prompts[1]),
                  verify_tokens=DECODE_TOKENS, on_note=print)  # fmt: skip
    return cell_record(r, t0, model=name, what=MODELS[name]["what"], level=level,
                       threads=threads, memory=memory)  # fmt: skip


def run_real(
    name: str, leave: int, threads: str, folder: Path, tokens: int, prompt_tokens: int
) -> dict[str, Any]:
    path = real_model(name, folder)
    trace = real_trace(path, prompt_tokens, tokens)
    t = None if threads == "auto" else int(threads)
    text = (filler(prompt_tokens - 1, 0), filler(tokens + 1, 1))  # the BOS makes it whole
    t0 = time.time()
    r = fit_model(str(path), available=leave, threads=t, trace=trace, verify=True,
                  verify_text=text, verify_tokens=tokens, prompt_tokens=prompt_tokens,
                  on_note=print)  # fmt: skip
    return cell_record(r, t0, model=name, what=f"real {name}", leave=leave, threads=threads,
                       prompt_tokens=prompt_tokens)  # fmt: skip


def run_real_url(
    name: str, leave: int, threads: str, folder: Path, tokens: int, prompt_tokens: int
) -> dict[str, Any]:
    """The same estimate from an HTTP URL (the tests' range server on the models' folder):
    the header and tensor index read over Range, nothing run; what run would choose and the
    figures, to set beside the file's."""
    from rangeserver import serving

    path = real_model(name, folder)
    trace = real_trace(path, prompt_tokens, tokens)
    t = None if threads == "auto" else int(threads)
    t0 = time.time()
    with serving(path.parent) as srv:
        r = fit_model(f"{srv.url}/{path.name}", available=leave, threads=t, trace=trace,
                      verify_tokens=tokens, prompt_tokens=prompt_tokens,
                      on_note=print)  # fmt: skip
    assert r.remote is not None
    return {
        "url": True,
        "model": name,
        "leave": leave,
        "threads": threads,
        "remote": r.remote.to_json(),
        "verdict": r.main.verdict,
        "run": r.run_json(),
        "serve": r.main.served.to_json(),
        "point": r.main.to_json(),
        "seconds": time.time() - t0,
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def report_urls(doc: dict[str, Any]) -> None:
    """Each URL cell beside the file's: the bytes read, and whether run's choice and the
    figures are the file's."""
    urls = [(k, doc[k]) for k in sorted(doc) if doc[k].get("url") is True]
    if not urls:
        return
    print()
    print(f"{'model':<6} {'memory':>9} {'thr':>4} {'read over HTTP':>22} {'decode':>11} "
          f"{'prefill':>7}  same as the file")  # fmt: skip
    for key, c in urls:
        file = doc.get(key.removesuffix("/url"))
        run, p = c["run"], c["point"]["run"]
        decode = f"{p['decode_tps']['low']:.2f}-{p['decode_tps']['high']:.2f}"
        same = "no file cell"
        if file is not None:
            fp = file["point"]
            choice = fp["choice"]
            keys = ("engine", "budget_bytes", "threads", "thread_choices", "threads_batch")
            same_choice = all(choice.get(k) == run.get(k) for k in keys)
            fd = fp["run"]["decode_tps"]
            err = p["decode_tps"]["high"] / fd["high"] - 1 if fd["high"] else float("inf")
            same = f"choice {'same' if same_choice else 'DIFFERENT'}, decode {100 * err:+.1f} %"
        read = f"{c['remote']['bytes_read'] / 1e6:.1f} MB ({100 * c['remote']['share_read']:.4f} %)"
        print(f"{c['model']:<6} {c['leave'] / GIB:>7.0f}G {c['threads']!s:>4} {read:>22} "
              f"{decode:>11} {p['prefill_tps']['low']:7.2f}  {same}")  # fmt: skip
        serve = c["serve"]
        print(f"{'':>8}run: {run['summary']}")
        print(f"{'':>6}serve: {serve['refusal'] or serve['summary']}")


# -- the overlap shares ----------------------------------------------------------------------


def overlap_model(folder: Path) -> Path:
    path = folder / "overlap-q4_0.gguf"
    if not path.exists():
        print(f"writing {path} (4 layers of Qwen3-30B-A3B's shape, Q4_0) ...", flush=True)
        subprocess.run([moepack(), "synth", "--out", str(path), *OVERLAP_MODEL.split(), "-q"],
                       check=True)  # fmt: skip
    return path


def _warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(16 << 20)
        while fh.readinto(buf):
            pass


def measure_overlap(folder: Path, rounds: int, tokens: int, counts: list[int]) -> dict[str, Any]:
    """Cached and streamed runs in turns; (io, compute, measured) per streamed run."""
    path = overlap_model(folder)
    with MoeModel(path) as m:
        experts = m.expert_bytes
        slice_bytes = m.blocks[0].weight_tensors[0].slice_bytes
    storage = storage_profile(path)
    prompt, cont = filler_text(64), filler_text(tokens + 1)
    n = cores()
    cells: dict[str, list[list[float]]] = {}
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        for t in counts if i % 2 == 0 else counts[::-1]:
            _warm(path)
            opts = RunOptions(n_predict=tokens, threads=t, prefetch=None,
                              placement="experts-mapped")  # fmt: skip
            cached = run_model(path, prompt, opts, continuation=cont)
            compute = cached.decode.seconds / max(1, cached.decode.tokens)
            for share in (0.15, 0.35, 0.6):
                memory = memory_for_experts(path, int(share * experts), n_ctx=4096)
                for engine in ("pager", "page cache"):
                    drop_model(path)
                    pager = "on" if engine == "pager" else "off"
                    opts = RunOptions(n_predict=tokens, threads=t, memory=memory,
                                      prefetch=StreamOptions(pager=pager))  # fmt: skip
                    r = run_model(path, prompt, opts, continuation=cont)
                    d = r.decode.to_json()
                    if engine == "pager":
                        moved = d["pager_read_bytes_per_token"]
                        bw = storage.pager_bandwidth(slice_bytes, 8)
                    else:  # what the device delivered, or what the prefetcher asked for
                        moved = max(d["bytes_read_per_token"], d["prefetch_bytes_per_token"])
                        bw = storage.bandwidth(slice_bytes, 8)
                    seconds = 1 / d["tokens_per_second"] if d["tokens_per_second"] else 0.0
                    key = f"{engine}/{'all' if t >= n else 'spare'}"
                    cells.setdefault(key, []).append([moved / bw, compute, seconds])
                    row = {"round": i, "threads": t, "share": share, "engine": engine,
                           "compute_s": compute, "io_s": moved / bw, "seconds": seconds,
                           "mb_per_token": moved / 1e6, "hit": d["cache_hit_rate"],
                           "load": os.getloadavg()[0]}  # fmt: skip
                    runs.append(row)
                    print(f"  t{t} {engine:>10} {share:.2f}: io {1e3 * moved / bw:6.1f} ms, "
                          f"compute {1e3 * compute:6.1f} ms, pass {1e3 * seconds:6.1f} ms, "
                          f"load {row['load']:.1f}", flush=True)  # fmt: skip
    return {"cells": cells, "runs": runs}


def part_overlap(folder: Path, rounds: int, tokens: int, counts: list[int]) -> None:
    """Fit the shares and keep them for fit on this CPU; a setting not measured keeps the
    shares fit had (the defaults, or an earlier measurement)."""
    got = measure_overlap(folder, rounds, tokens, sorted(set(counts)))
    cells = got["cells"]
    shares = {k: fitted_share([(c[0], c[1], c[2]) for c in v]) for k, v in cells.items()}
    cpu = cpu_name()
    had = overlap_factors(cpu)
    load = statistics.median(r["load"] for r in got["runs"])
    overlap = Overlap(
        pager_spare=shares.get("pager/spare", had.pager_spare),
        pager_all=shares.get("pager/all", had.pager_all),
        page_cache_spare=shares.get("page cache/spare", had.page_cache_spare),
        page_cache_all=shares.get("page cache/all", had.page_cache_all),
        source=(
            f"measured by benchmarks/bench_fit.py --overlap on this CPU ({', '.join(sorted(shares))}"
            f", load {load:.1f})"
        ),
        measured=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        cells=sum(len(v) for v in cells.values()),
    )
    path = save_overlap(cpu, overlap)
    for k, v in sorted(shares.items()):
        print(f"{k:>16}: share {v:.2f} ({len(cells[k])} runs)")
    print(f"kept in {path}")
    (folder / "overlap-runs.json").write_text(json.dumps(got, indent=1))


# -- results and the report ------------------------------------------------------------------


def load(results: Path) -> dict[str, Any]:
    return json.loads(results.read_text()) if results.exists() else {}


def save(results: Path, doc: dict[str, Any]) -> None:
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, results)


def reestimate(cell: dict[str, Any], folder: Path) -> None:
    """The estimate of a measured cell again, from the current cost model and the cached
    storage profile, calibration and overlap shares; the measurement stays, the first
    estimate is kept beside it (``estimated_first``)."""
    if "leave" in cell:
        path = real_model(cell["model"], folder)
        trace = path.with_suffix(".moetrace")
        t = None if cell["threads"] == "auto" else int(cell["threads"])
        r = fit_model(str(path), available=cell["leave"], threads=t, trace=trace,
                      verify_tokens=cell["verify"]["runs"][0]["decode_tokens"],
                      prompt_tokens=cell.get("prompt_tokens", 128))  # fmt: skip
    else:
        path, prompts = ensure_model(cell["model"], folder)
        trace = ensure_trace(path, prompts[2:5])
        r = fit_model(str(path), memory=cell["memory"], threads=cell["threads"], trace=trace)
    cell["verdict"] = r.main.verdict
    cell["point"] = r.main.to_json()
    by_name = {
        "run decode": r.main.run.run_decode_tps,
        "run prefill": r.main.run.prefill_tps,
        "stock decode": r.main.stock.run_decode_tps,
        "stock prefill": r.main.stock.prefill_tps,
    }
    for f in cell["verify"]["figures"]:
        if f["figure"] not in by_name:  # a runner of an earlier round (`prefetch`)
            continue
        f.setdefault("estimated_first", f["estimated"])
        lo, hi = by_name[f["figure"]]
        f["estimated"] = {"low": lo, "high": hi}
        f["error"] = Figure(f["figure"], (lo, hi), f["measured"]).error
    cell["reestimated"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def report(doc: dict[str, Any]) -> None:
    cells = [doc[k] for k in sorted(doc) if k.count("/") >= 2 and not doc[k].get("url")]
    print(f"{'model':<6} {'memory':>9} {'thr':>4} {'run chose':<26} {'figure':<13} "
          f"{'estimated':>13} {'measured':>9} {'error':>7}  verdict est/measured")  # fmt: skip
    errors: dict[str, list[float]] = {}
    verdicts_ok = choices_ok = 0
    for c in cells:
        ok = c["verdict"] == c["measured_verdict"]
        verdicts_ok += ok
        choices_ok += bool(c.get("choice_same"))
        run = c["verify"]["runs"][0]
        threads = run.get("threads_chosen", run.get("threads"))  # an earlier round had no choice
        chose = f"{run.get('engine', run['runner'])} t{threads}/{run.get('threads_batch', threads)}"
        if run.get("budget_bytes"):
            chose += f" {run['budget_bytes'] / GIB:.1f}G"
        memory = (
            f"{c['leave'] / GIB:.0f}G left"
            if "leave" in c
            else (f"{c['memory'] / GIB:.2f}G" if c.get("memory") else "no flag")
        )
        for i, f in enumerate(c["verify"]["figures"]):
            lo, hi = f["estimated"]["low"], f["estimated"]["high"]
            mid = (lo * hi) ** 0.5
            err = mid / f["measured"] - 1 if f["measured"] else float("inf")
            errors.setdefault(f["figure"], []).append(err)
            est = f"{lo:.2f}" if abs(hi - lo) < 0.005 * hi else f"{lo:.2f}-{hi:.2f}"
            tag = (
                f"{c['verdict']}/{c['measured_verdict']}{'' if ok else ' WRONG'}"
                + ("" if c.get("choice_same") else " (choice differs)")
                if i == 0
                else ""
            )
            print(f"{c['model']:<6} {memory:>9} {c['threads']!s:>4} {chose if i == 0 else '':<26} "
                  f"{f['figure']:<13} {est:>13} {f['measured']:9.2f} {100 * err:+6.0f}%  {tag}")  # fmt: skip
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
        print(f"{name:<13} cells {len(v):>2}  median |error| {100 * statistics.median(a):5.1f} %  "
              f"worst {100 * max(a):5.1f} %")  # fmt: skip
    a = [abs(e) for e in every]
    print(f"{'all':<13} cells {len(every):>2}  median |error| {100 * statistics.median(a):5.1f} %  "
          f"worst {100 * max(a):5.1f} % (target: median <= 20 %)")  # fmt: skip
    print(f"verdicts right: {verdicts_ok} of {len(cells)}; run chose as estimated: "
          f"{choices_ok} of {len(cells)}")  # fmt: skip


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
        cmd = [moepack(), "synth", "--out", str(split / "fit-a.gguf"), *MODELS["a"]["args"].split(),
               *COMMON, "-q", "--split-max-size", str(size // 3 + (64 << 20))]  # fmt: skip
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
    ap.add_argument("--dir", type=Path, default=None,
                    help=f"models' folder (default: {SMALL_DIR}; with --real, bench_real's)")  # fmt: skip
    ap.add_argument("--results", type=Path, default=None,
                    help="default: DIR/results.json (DIR/fit-results.json with --real)")  # fmt: skip
    ap.add_argument("--models", default="", help=f"small models: any of {','.join(MODELS)}")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--real", default="", help="real shapes of bench_real.py: q4_0,q4km,q36")
    ap.add_argument("--leave", default="20G,12G,8G", help="memory left (real shapes)")
    ap.add_argument("--threads", default=None,
                    help="1,N (default: 1 and every core); auto: run chooses")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=REAL_TOKENS, help="decoded (real shapes)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--again", action="store_true", help="measure cells already in the results")
    ap.add_argument("--http", action="store_true", help="the split model's header over HTTP")
    ap.add_argument("--url", action="store_true",
                    help="with --real: fit each model from an HTTP URL instead, nothing run "
                         "(the report sets it beside the file's cell)")  # fmt: skip
    ap.add_argument("--overlap", action="store_true", help="measure the overlap shares")
    ap.add_argument("--rounds", type=int, default=2, help="--overlap: rounds of runs")
    ap.add_argument("--prepare", action="store_true", help="write the models and traces only")
    ap.add_argument("--report", action="store_true", help="print every cell and the errors")
    ap.add_argument("--reestimate", action="store_true",
                    help="estimate the measured cells again with the current model (no runs)")  # fmt: skip
    args = ap.parse_args()
    real = [r for r in args.real.split(",") if r]
    if args.dir is None:
        import bench_real

        args.dir = bench_real.DEFAULT_DIR if real else SMALL_DIR
    args.dir.mkdir(parents=True, exist_ok=True)
    results = args.results or args.dir / ("fit-results.json" if real else "results.json")
    doc = load(results)
    counts = args.threads or f"1,{cores()}"
    if args.report or args.reestimate:  # what is there, nothing measured
        real, args.models, args.overlap = [], "", False
    if args.overlap:
        part_overlap(args.dir, args.rounds, DECODE_TOKENS, [int(t) for t in counts.split(",")])
    for name in real:
        path = real_model(name, args.dir)
        if args.prepare:
            real_trace(path, args.prompt_tokens, args.tokens)
            continue
        for leave in [parse_size(x) for x in args.leave.split(",")]:
            for threads in counts.split(","):
                key = f"real/{name}/{leave >> 20}M/{threads}" + ("/url" if args.url else "")
                if key in doc and not args.again:
                    continue
                print(f"== {key}: MemAvailable {mem_available() / GIB:.1f} GiB, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
                measure = run_real_url if args.url else run_real
                doc[key] = measure(name, leave, threads, args.dir, args.tokens,
                                   args.prompt_tokens)  # fmt: skip
                save(results, doc)
    for name in filter(None, args.models.split(",")):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        if args.prepare:
            path, prompts = ensure_model(name, args.dir)
            ensure_trace(path, prompts[2:5])
            continue
        for level in args.levels.split(","):
            if level not in LEVELS:
                ap.error(f"unknown level {level!r}; known: {', '.join(LEVELS)}")
            for threads in sorted({int(t) for t in counts.split(",")}):
                key = f"{name}/{level}/{threads}"
                if key in doc and not args.again:
                    continue
                print(f"== {key}: MemAvailable {mem_available() / GIB:.1f} GiB, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
                doc[key] = run_small(name, level, threads, args.dir)
                save(results, doc)
    if args.reestimate:
        for key in sorted(k for k in doc if k.count("/") >= 2 and not doc[k].get("url")):
            reestimate(doc[key], args.dir)
        save(results, doc)
    if args.http:
        doc["http"] = http_check(args.dir)
        save(results, doc)
    if args.report or not (args.models or real or args.overlap or args.http):
        report(doc)
        report_urls(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
