"""Two builds of llama.cpp against each other in the same run: ``moepack run``'s prefill and
decode tokens/s with the llama-cpp-python of one venv (A, by default this one) and another
(B, ``--b``: e.g. the portable build), as native / portable ratios.

Both run this checkout's moepack (``PYTHONPATH``); only llama.cpp differs. Every measured run
is a fresh process (``run_model``: a llama.cpp worker), A and B take turns, the order reversed
each round, and a ratio is taken pair by pair (the machine's speed drifts between pairs, not
within one). The models are ``bench_run``'s planted-routing qwen3moe (64 experts, top-8,
hidden 1024, expert FFN 512) at ``--layers`` per weight type, about 2 GB each, written once
into ``--dir``. Each run prefills a prompt of two of its topic prompts (about 256 tokens) and
then decodes ``--tokens`` tokens of the next prompt's text one at a time (``continuation``:
the same tokens in A and B, so their logits compare bit for bit). Parts:

- ``cached``: the whole file in the page cache (read through before each run), llama.cpp's
  own placement (``--placement defaults``: Q4_0 and Q4_K repacked at load, AMX where the
  build has it), no prefetcher: the compute alone;
- ``pressure``: under the memory holder (``--leave``), the file's pages dropped before each
  run, decode cold: the expert prefetcher with the pager (``--prefetch --pager on``, what
  ``run`` chooses where a model does not fit) at a budget of ``--memory`` (0.6 GiB, under
  half of each model's experts; ``auto`` takes all but 256 MiB of what the holder leaves, and
  the run's other memory then takes MemAvailable under the holder's floor, which lets go). A
  run counts only if the holder held through it.

Printed per weight type, part and thread count: A's and B's median tok/s (range) for prefill
and decode, the median of the per-pair ratios A/B (range), the same of B's CPU time per token
over A's (less swayed by a busy machine's other work than wall time; at 2 threads it includes
OpenMP's spinning), and whether A's logits equal B's (else the largest difference, against
the logits' standard deviation).

``--hide-amx A`` runs side A with the AMX tile state refused (a seccomp filter on
``arch_prctl``), so ggml's AMX buffer type does not start: with ``--b`` the same Python, what
AMX adds to a native build.

    .venv/bin/python benchmarks/bench_build.py --b /path/to/portable/.venv/bin/python
    .venv/bin/python benchmarks/bench_build.py --b ... --types Q4_0 --parts cached --rounds 5
    .venv/bin/python benchmarks/bench_build.py --b .venv/bin/python --hide-amx A --parts cached
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_run  # noqa: E402
from memhold import MemoryHold, parse_size  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
LAYERS = {"Q8_0": 12, "Q4_0": 24, "Q4_K_M": 22}
"""About 1.4 GB each: more than the pager keeps under the holder, small enough to write quickly."""

IDENTIFY = """
import json, llama_cpp
from moepack.llama.runtime import ggml_backend as g
print(json.dumps({"llama_cpp": llama_cpp.__file__, "version": llama_cpp.__version__,
                  "features": sorted(g.cpu_features()), "extra_bufts": sorted(g.cpu_extra_bufts())}))
"""


@dataclass
class Run:
    """One measured run of one build."""

    prefill: float
    decode: float
    prompt_tokens: int
    cpu_ms: dict[str, float]  # CPU milliseconds per token, per phase (all threads)
    held: bool = True
    weights: dict[str, Any] = field(default_factory=dict)


def child_env() -> dict[str, str]:
    """This checkout's moepack ahead of either venv's own install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def identify(python: str, amx_hidden: bool) -> dict[str, Any]:
    """The llama-cpp-python a Python runs, its CPU backend's compiled features and extra
    buffer types."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_build; "
            "bench_build.hide_amx()\n" if amx_hidden else "") + IDENTIFY  # fmt: skip
    out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         env=child_env(), check=True)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# seccomp: arch_prctl(ARCH_REQ_XCOMP_PERM, ...) fails with EPERM, everything else is allowed
HIDE_AMX = [(0x20, 0, 0, 0), (0x15, 0, 2, 158), (0x20, 0, 0, 16), (0x15, 1, 0, 0x1023),
            (0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050001)]  # fmt: skip


def hide_amx() -> None:
    """Refuse this process and its children the AMX tile state, so that ggml's AMX buffer
    type does not start (``ggml_amx_init``) and the same build runs without it."""
    import ctypes

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]  # fmt: skip

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(HIDE_AMX))(*[Insn(*i) for i in HIDE_AMX])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.byref(Prog(len(HIDE_AMX), insns)), 0, 0) != 0:  # SECCOMP filter
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def other_holders() -> list[int]:
    """Memory holders of other processes (another benchmark on this machine)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moepack.memhold" in cmd and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def wait_for_other_holders() -> None:
    """Hold memory only when nobody else does: two holders starve each other's runs."""
    said = False
    while other_holders():
        if not said:
            print("    waiting: another memory holder is running", flush=True)
            said = True
        time.sleep(30)


def one_run(job: dict[str, Any]) -> dict[str, Any]:
    """Inside the measuring Python: one ``run_model`` as the job says; what it measured."""
    if job.get("hide_amx"):
        hide_amx()
    from moepack.llama.prefetcher.streamer import StreamOptions
    from moepack.llama.runtime.run import RunOptions, run_model

    prefetch = StreamOptions(pager="on", memory=job["memory"]) if job["pressure"] else None
    opts = RunOptions(n_predict=job["tokens"], threads=job["threads"], n_ctx=1024, batch=512,
                      placement="auto" if job["pressure"] else "defaults", prefetch=prefetch,
                      cold=job["pressure"], spin=job["spin"])  # fmt: skip
    r = run_model(job["model"], job["prompt"], opts, continuation=job["continuation"],
                  logits_out=job["logits"])  # fmt: skip
    w = r.weights or {}
    cpu = {p: x.to_json()["cpu_seconds"] / max(1, x.tokens) for p, x in
           (("prefill", r.prefill), ("decode", r.decode))}  # fmt: skip
    return {
        "prefill": r.prefill.tokens_per_second,
        "decode": r.decode.tokens_per_second,
        "cpu_ms": {p: 1e3 * v for p, v in cpu.items()},
        "prompt_tokens": r.prompt_tokens,
        "weights": {k: w.get(k) for k in ("placement", "experts_mapped", "buffer_types")},
    }


def measure(python: str, job: dict[str, Any]) -> Run:
    proc = subprocess.run([python, __file__, "--one", json.dumps(job)], capture_output=True,
                          text=True, env=child_env())  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{python}: the run failed:\n{proc.stderr[-2000:]}")
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    return Run(d["prefill"], d["decode"], d["prompt_tokens"], d["cpu_ms"], weights=d["weights"])


def compare(a: Path, b: Path) -> str:
    """``same`` when the logits are equal bit for bit, else the largest difference."""
    x, y = np.load(a), np.load(b)
    if x.shape == y.shape and np.array_equal(x, y):
        return "same"
    if x.shape != y.shape:
        return f"shapes {x.shape} / {y.shape}"
    d = float(np.abs(x - y).max())
    return f"max |d| {d:.2g} ({d / float(y.std()):.2g} sd)"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def cell(args: argparse.Namespace, wtype: str, part: str, threads: int, model: Path,
         prompts: list[str], scratch: Path) -> None:  # fmt: skip
    """A and B ``args.rounds`` times each, alternated, on one model, part and thread count."""
    pressure = part == "pressure"
    job = {"model": str(model), "prompt": " ".join(prompts[:2]), "continuation": prompts[2],
           "tokens": args.tokens, "threads": threads, "pressure": pressure,
           "memory": args.memory if args.memory == "auto" else parse_size(args.memory),
           "spin": args.spin}  # fmt: skip
    runs: dict[str, list[Run]] = {"A": [], "B": []}
    logits: list[str] = []
    hold: MemoryHold | None = None
    try:
        for rnd in range(args.rounds):
            order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
            for side in order:
                python = args.a if side == "A" else args.b
                out = scratch / f"{side}.npy"
                if pressure:
                    if hold is None or not hold.alive():
                        if hold is not None:
                            hold.__exit__(None, None, None)
                        wait_for_other_holders()
                        hold = MemoryHold(parse_size(args.leave), args.hold_floor).__enter__()
                    bench_run.drop_confirmed(model)
                else:
                    bench_run.warm(model)
                hide = side in args.hide_amx
                r = measure(python, job | {"logits": str(out), "hide_amx": hide})
                r.held = hold.alive() if hold is not None else True
                runs[side].append(r)
            logits.append(compare(scratch / "A.npy", scratch / "B.npy"))
            a, b = runs["A"][-1], runs["B"][-1]
            print(f"    {wtype} {part} t{threads} round {rnd + 1}: prefill A {a.prefill:.1f} "
                  f"B {b.prefill:.1f}, decode A {a.decode:.2f} B {b.decode:.2f} tok/s, "
                  f"held {a.held and b.held}, logits {logits[-1]}", flush=True)  # fmt: skip
    finally:
        if hold is not None:
            hold.__exit__(None, None, None)
    pairs = [(a, b) for a, b in zip(runs["A"], runs["B"], strict=True) if a.held and b.held]
    if not pairs:
        print(f"  {wtype:7} {part:8} t{threads}: no pair the holder held through")
        return
    for phase in ("prefill", "decode"):
        av = [getattr(a, phase) for a, _ in pairs]
        bv = [getattr(b, phase) for _, b in pairs]
        ratios = [x / y for x, y in zip(av, bv, strict=True) if y > 0]
        # CPU time per token: B's over A's (above 1: A computes the token with less CPU)
        cpu = [b.cpu_ms[phase] / a.cpu_ms[phase] for a, b in pairs if a.cpu_ms[phase] > 0]
        print(f"  {wtype:7} {part:8} t{threads} {phase:7} A {spread(av)}  B {spread(bv)}  "
              f"A/B {spread(ratios)}  CPU B/A {spread(cpu)}  n={len(pairs)}", flush=True)  # fmt: skip
    same = sorted(set(logits))
    w = runs["A"][0].weights, runs["B"][0].weights
    print(f"  {wtype:7} {part:8} t{threads} logits A vs B: {', '.join(same)}; "
          f"{runs['A'][0].prompt_tokens}-token prompt; weights A {w[0]}, B {w[1]}", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--a", default=sys.executable, help="Python of build A (default: this one)")
    ap.add_argument("--b", help="Python of build B (e.g. the portable build's venv)")
    ap.add_argument("--hide-amx", default="", choices=["", "A", "B", "AB"],
                    help="run these sides with AMX refused (seccomp): the build without it")  # fmt: skip
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-build"))
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--parts", default="cached,pressure")
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--spin", type=int, default=None,
                    help="GOMP_SPINCOUNT of the runs (default: run's own choice; on a busy "
                    "machine 2 threads spinning on 2 cores wait for each other's time slices: "
                    "10000 measures the kernels instead)")  # fmt: skip
    ap.add_argument("--leave", default="1.5G", help="memory the holder leaves (pressure)")
    ap.add_argument("--memory", default="0.6G",
                    help="the pager's budget under pressure (auto takes all but 256 MiB of what "
                    "is left, and the holder at its floor lets go)")  # fmt: skip
    ap.add_argument("--hold-floor", type=parse_size, default=parse_size("256M"),
                    help="the holder lets go below this MemAvailable")  # fmt: skip
    ap.add_argument(
        "--drop-models",
        action="store_true",
        help="delete each model after its cells (a few GB of disk at a time)",
    )
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(json.loads(args.one))))
        return 0
    if not args.b:
        ap.error("--b (the other build's Python) is required")
    args.dir.mkdir(parents=True, exist_ok=True)
    for side, python in (("A", args.a), ("B", args.b)):
        who = identify(python, side in args.hide_amx)
        print(f"{side}: {python}: llama-cpp-python {who['version']}, CPU backend "
              f"{' '.join(who['features'])}; extra buffer types {', '.join(who['extra_bufts'])}")  # fmt: skip
    threads = sorted({int(t) for t in args.threads.split(",")})
    parts = args.parts.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} alternated rounds, "
          f"medians (range) of the pairs{' the holder held through' if 'pressure' in parts else ''}",
          flush=True)  # fmt: skip
    for wtype in args.types.split(","):
        model, prompts = bench_run.ensure_model(LAYERS[wtype], args.dir, "qwen3moe",
                                                weight_type=wtype)  # fmt: skip
        print(f"{model.name}: {model.stat().st_size / 1e9:.2f} GB", flush=True)
        try:
            with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
                for part in parts:
                    for t in threads:
                        cell(args, wtype, part, t, model, prompts, Path(scratch))
        finally:
            if args.drop_models:
                model.unlink()
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
