"""Several tokens per expert read: ``run --prefetch --draft`` against plain ``--prefetch``
under memory pressure, and the default thread count against ``-t 1`` and every core.

The models are ``bench_run``'s (written once into ``--dir``): the 3.5 GB qwen3moe with planted
routing (``cluster=8,stay=0.8,coupling=0.95,skew=1``: consecutive tokens share experts) and
the same shapes with random routing; the draft model is a 2-layer synthetic one written with
the same vocabulary (for the planted model its routing spec and seed, for the random one
none), 4 MB. Decode feeds a given text token by token (``run_model(continuation=…)``), so the
routing — and what prompt lookup's drafts must match to be accepted — is that text's:

- ``quote``: a passage of a planted prompt, then its first words again; the continuation is
  the passage (an answer quoting its context);
- ``rewrite``: the same with one word of the passage changed in the continuation (a function
  rewritten with one change);
- ``free``: the first 16 words of a prompt, the continuation its other words (free text).

Every run is a fresh process under the memory holder (``--leave``, default 1.5G), its decode
cold (the model's pages dropped after the prompt), in alternated pairs. Configurations:
``prefetch`` (plain ``--prefetch``), ``lookup`` (``--draft prompt-lookup``), ``model``
(``--draft-model`` the small model), each at 1 thread; the threads part runs plain
``--prefetch`` on ``free`` at 1 thread, every core and the default. Printed per workload and
configuration: decode tok/s (median, range), the median pair ratio to ``prefetch``,
acceptance, experts per layer and verified batch against k × top-k, MB read per accepted
token, CPU ms per token, and the I/O bound (the disk's buffered bandwidth, fio at the slice
size with 8 readers, over the MB per accepted token); and whether the greedy choice (the
argmax of every logits row) is the same as without drafts, with the largest logit difference
as a share of the row's largest logit.

    .venv/bin/python benchmarks/bench_draft.py --model planted
    .venv/bin/python benchmarks/bench_draft.py --model random
    .venv/bin/python benchmarks/bench_draft.py --threads-only --model planted,random
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import SYNTH_ARGS, drop_confirmed, ensure_model, fio_buffered  # noqa: E402
from headline import record  # noqa: E402
from memhold import GIB, MemoryHold, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.llama.prefetcher.streamer import StreamOptions  # noqa: E402
from moepack.llama.runtime.draft import DraftOptions  # noqa: E402
from moepack.llama.runtime.run import RunOptions, RunResult, default_threads, run_model  # noqa: E402

CONFIGS = ("prefetch", "lookup", "model")
WORKLOADS = ("quote", "rewrite", "free")


def ensure_draft(folder: Path, planted: bool) -> Path:
    """A 2-layer model with the big one's vocabulary (same synth vocabulary arguments)."""
    path = folder / f"draft-{'routed' if planted else 'random'}.gguf"
    if path.exists():
        return path
    moepack = Path(sys.executable).with_name("moepack")
    small = ["--layers", "2", "--experts", "16", "--top-k", "2", "--hidden", "256",
             "--expert-ffn", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
             "--vocab", "4096", "--weight-type", "Q8_0", "--seed", "7"]  # fmt: skip
    if planted:
        at = SYNTH_ARGS.index("--routing")
        small += SYNTH_ARGS[at : at + 2] + ["--prompts", "16", "--prompt-tokens", "128"]
    subprocess.run([str(moepack), "synth", "--out", str(path), *small, "-q"], check=True)
    return path


def workload(name: str, words: list[str]) -> tuple[str, str]:
    """(prompt, continuation) of a workload from one prompt's words."""
    passage = words[:64]
    if name == "free":
        return " ".join(words[:16]), " ".join(words[16:])
    again = passage[:4]
    rest = list(passage[4:])
    if name == "rewrite":
        rest[len(rest) // 2] = words[-1] if words[-1] != rest[len(rest) // 2] else words[-2]
    return " ".join(passage) + " " + " ".join(again), " ".join(rest + words[64:])


@dataclass
class Sample:
    model: str
    work: str
    config: str
    threads: str  # as asked: a count, or "default"
    result: RunResult
    logits: np.ndarray
    same: tuple[bool, float] = (True, 0.0)  # greedy choice and logits against plain --prefetch

    def row(self) -> dict[str, Any]:
        d = self.result.decode
        j = d.to_json()
        dr = j["draft"] or {}
        return {
            "tps": d.tokens_per_second,
            "mb": j["bytes_read_per_token"] / 1e6,
            "cpu_ms": 1e3 * j["cpu_seconds"] / d.tokens if d.tokens else 0.0,
            "accept": dr.get("acceptance_rate"),
            "drafted": dr.get("drafted", 0),
            "union": dr.get("experts_per_verified_batch"),
            "routed": dr.get("routed_per_verified_batch"),
            "per_pass": dr.get("tokens_per_verify_pass"),
        }


def one_run(
    label: str, path: Path, draft_path: Path, work: str, config: str, threads: int | None,
    words: list[str], tokens: int, folder: Path,
) -> Sample:  # fmt: skip
    draft = DraftOptions()
    if config == "lookup":
        draft = DraftOptions("prompt-lookup")
    elif config == "model":
        draft = DraftOptions("model", model=str(draft_path))
    prompt, continuation = workload(work, words)
    options = RunOptions(n_predict=tokens, n_ctx=1024, threads=threads, cold=True,
                         prefetch=StreamOptions(), draft=draft)  # fmt: skip
    out = folder / "logits.npy"
    r = run_model(path, prompt, options, continuation=continuation, logits_out=out)
    asked = "default" if threads is None else str(threads)
    return Sample(label, work, config, asked, r, np.load(out))


def serve_once(path: Path, prompt: str, tokens: int, draft: list[str]) -> dict[str, float]:
    """One fresh ``moepack serve --prefetch -t 1 [--draft …]`` answering one greedy completion
    of ``prompt`` through the ``openai`` client: client-side decode tok/s (tokens after the
    first over the time after the first chunk) and the server's draft counters."""
    import openai

    drop_confirmed(path)
    cmd = [sys.executable, "-m", "moepack", "serve", str(path), "--port", "0", "--threads", "1",
           "--ctx", "1024", "--prefetch", *draft]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            found = re.search(r"(http://\S+/v1)", line)
            if found:
                url = found.group(1)
                break
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
        t0 = time.perf_counter()
        first, n = 0.0, 0
        for chunk in client.completions.create(model=path.stem, prompt=prompt, max_tokens=tokens,
                                               temperature=0, stream=True):  # fmt: skip
            if chunk.choices and chunk.choices[0].text:
                n += 1
                first = first or time.perf_counter()
        seconds = time.perf_counter() - (first or t0)
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    out = {"tps": (n - 1) / seconds if n > 1 and seconds > 0 else 0.0, "chunks": n}
    for line in metrics.splitlines():
        if line.startswith("moepack_draft_tokens_total"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def compare(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    """(same argmax on every row, largest |difference| as a share of the row's largest)."""
    same = bool(np.array_equal(a.argmax(axis=1), b.argmax(axis=1)))
    worst = float((np.abs(a - b).max(axis=1) / np.abs(a).max(axis=1)).max())
    return same, worst


def measure(args: argparse.Namespace, label: str, path: Path, draft_path: Path,
            words: list[str], runs: list[tuple[str, str, int | None]]) -> list[Sample]:  # fmt: skip
    """Every (workload, config, threads) of ``runs``, ``args.pairs`` times, order alternating."""
    out: list[Sample] = []
    for i in range(args.pairs):
        for work in dict.fromkeys(r[0] for r in runs):
            mine = [r for r in runs if r[0] == work]
            order = mine if i % 2 == 0 else list(reversed(mine))
            got = {}
            for _w, config, threads in order:
                s = one_run(label, path, draft_path, work, config, threads, words, args.tokens,
                            args.dir)  # fmt: skip
                got[(config, threads)] = s
                row = s.row()
                acc = "-" if row["accept"] is None else f"{row['accept']:.2f}"
                tuned = s.result.thread_tuning
                chose = "" if tuned is None else (
                    f"  tuned: chose {tuned['chosen']} of {tuned['choices']}, passes "
                    f"{tuned['passes']}, s/pass {tuned['seconds_per_pass']}")  # fmt: skip
                print(f"  {label} {work:<7} {config:<8} t{s.threads}={s.result.threads} pair {i + 1}: "
                      f"{row['tps']:6.2f} tok/s  MB/tok {row['mb']:7.1f}  accept {acc}{chose}",
                      flush=True)  # fmt: skip
            base = got.get(("prefetch", 1))
            for s in got.values():
                s.same = compare(base.logits, s.logits) if base is not None else (True, 0.0)
            out += got.values()
    return out


def report(samples: list[Sample], gbps: float) -> list[str]:
    lines = []
    keys = list(dict.fromkeys((s.model, s.work, s.config, s.threads) for s in samples))
    for model, work, config, threads in keys:
        ss = [
            s
            for s in samples
            if (s.model, s.work, s.config, s.threads) == (model, work, config, threads)
        ]
        base = [
            s
            for s in samples
            if (s.model, s.work, s.config, s.threads) == (model, work, "prefetch", "1")
        ]
        rows = [s.row() for s in ss]
        tps = [r["tps"] for r in rows]
        ratio = statistics.median(
            a.row()["tps"] / b.row()["tps"] for a, b in zip(ss, base, strict=True)
        )

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            vals = [r[key] for r in rows if r[key] is not None]
            return statistics.median(vals) if vals else float("nan")

        same = all(s.same[0] for s in ss)
        worst = max(s.same[1] for s in ss)
        bound = gbps * 1e3 / med("mb") if med("mb") > 0 else float("inf")
        lines.append(
            f"{model:<8} {work:<7} {config:<8} t{threads:<7} {statistics.median(tps):6.2f} "
            f"({min(tps):.2f}-{max(tps):.2f}) {ratio:5.2f}x  accept {med('accept'):4.2f}  "
            f"tok/pass {med('per_pass'):4.2f}  experts/batch {med('union'):5.1f} of {med('routed'):5.1f}  "
            f"MB/accepted {med('mb'):6.1f}  CPU ms/tok {med('cpu_ms'):5.0f}  "
            f"I/O bound {bound:5.2f} tok/s  same greedy {same} (logits within {100 * worst:.2f} %)"
        )  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-draft"))
    ap.add_argument("--model", default="planted", help="planted, random or both (planted,random).")
    ap.add_argument("--threads-only", action="store_true",
                    help="Plain --prefetch on free text at 1 thread, every core and the default.")  # fmt: skip
    ap.add_argument("--with-threads", action="store_true",
                    help="Also plain --prefetch on free text at every core and the default.")  # fmt: skip
    ap.add_argument("--leave", default="1.5G")
    ap.add_argument(
        "--hold-floor", type=parse_size, default=GIB,
        help="the holder lets go below this MemAvailable (1G suits a shared machine; the "
        "live cache locks most of what is left, so on a machine of its own use 256M)",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=32, help="Of the big model (32: 3.5 GB).")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--serve", action="store_true",
                    help="moepack serve --prefetch with and without --draft prompt-lookup, the "
                    "quote prompt through the openai client (the model's own greedy text).")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=0, help="Which planted prompt the text is from.")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    models = args.model.split(",")
    cores = len(os.sched_getaffinity(0))
    samples: list[Sample] = []
    held: dict[str, str] = {}  # the models whose runs the holder held through: their description
    gbps = 0.0
    for label in models:
        path, prompts = ensure_model(args.layers, args.dir, "qwen3moe", planted=label == "planted")
        draft_path = ensure_draft(args.dir, planted=label == "planted")
        words = prompts[args.prompt].split()
        with MoeModel(path) as m:
            size, slice_bytes = m.file_bytes, m.blocks[0].weight_tensors[0].slice_bytes
        if not gbps:
            gbps = fio_buffered(path, slice_bytes, 8) / 1e9
            print(f"disk: fio buffered randread {slice_bytes // 1024} KiB x 8 readers "
                  f"{gbps:.2f} GB/s", flush=True)  # fmt: skip
        if args.serve:
            prompt = workload("quote", words)[0]
            with MemoryHold(parse_size(args.leave), args.hold_floor) as hold:
                print(f"{label} serve: {hold.available / GIB:.2f} GiB left", flush=True)
                got: dict[str, list[dict[str, float]]] = {"plain": [], "draft": []}
                for i in range(args.pairs):
                    order = ["plain", "draft"] if i % 2 == 0 else ["draft", "plain"]
                    for which in order:
                        extra = ["--draft", "prompt-lookup"] if which == "draft" else []
                        r = serve_once(path, prompt, args.tokens, extra)
                        got[which].append(r)
                        print(f"  serve {which:<5} pair {i + 1}: {r}", flush=True)
                ratios = [
                    d["tps"] / p["tps"] for d, p in zip(got["draft"], got["plain"], strict=True)
                ]
                print(f"serve {label}: --draft prompt-lookup at {statistics.median(ratios):.2f}x "
                      f"plain --prefetch through the openai client (pairs {ratios})")  # fmt: skip
                if hold.alive():
                    record_serve(args, label, got, ratios, size)
            continue
        if args.threads_only:
            runs = [("free", "prefetch", t) for t in (1, cores, None)]
        else:
            runs = [(w, c, 1) for w in args.workloads.split(",") for c in CONFIGS]
            if args.with_threads:
                runs += [("free", "prefetch", cores), ("free", "prefetch", None)]
        with MemoryHold(parse_size(args.leave), args.hold_floor) as hold:
            print(f"{label}: {path.name} {size / 1e9:.2f} GB; holding {hold.held / GIB:.1f} GiB, "
                  f"{hold.available / GIB:.2f} GiB left; default threads here "
                  f"{default_threads(path)} of {cores} cores; {args.tokens} tokens, "
                  f"{args.pairs} alternated pairs, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
            samples += measure(args, label, path, draft_path, words, runs)
            if hold.alive():
                print(f"  {label}: the holder held {hold.held / GIB:.1f} GiB to the end "
                      f"(floor {args.hold_floor >> 20} MiB)", flush=True)  # fmt: skip
                held[label] = (
                    f"bench_run.py's {label}-routing qwen3moe ({args.layers} layers, "
                    f"Q8_0, {size / 1e9:.2f} GB), {hold.available / GIB:.2f} GiB left"
                )
            else:
                print(f"  {label}: the holder let go during the runs: not valid")
    print()
    for line in report(samples, gbps):
        print(line)
    if args.threads_only:
        record_threads(samples, held)
    else:
        for label, model in held.items():
            record_drafts(samples, label, model)


def pair_ratios(
    samples: list[Sample], model: str, work: str, config: str, threads: str
) -> list[float]:
    """``config``'s tok/s over plain ``--prefetch`` at ``-t 1``, pair by pair (as ``report``)."""
    ss = [
        s
        for s in samples
        if (s.model, s.work, s.config, s.threads) == (model, work, config, threads)
    ]
    base = [
        s
        for s in samples
        if (s.model, s.work, s.config, s.threads) == (model, work, "prefetch", "1")
    ]
    return [a.row()["tps"] / b.row()["tps"] for a, b in zip(ss, base, strict=True)]


def median_of(
    samples: list[Sample], model: str, work: str, config: str, threads: str, key: str
) -> float:
    vals = [
        s.row()[key]
        for s in samples
        if (s.model, s.work, s.config, s.threads) == (model, work, config, threads)
        and s.row()[key] is not None
    ]
    return statistics.median(vals) if vals else float("nan")


def suffix(label: str) -> tuple[str, str]:
    """The results file's suffix and the title's: the planted model is the headline's."""
    return ("", "") if label == "planted" else (f"-{label}", f", {label} routing")


def record_drafts(samples: list[Sample], label: str, model: str) -> None:
    """Prompt lookup on quoting text against plain ``--prefetch``, as benchmarks/README.md's
    table shows it."""
    quote = pair_ratios(samples, label, "quote", "lookup", "1")
    if not quote:
        return
    ratio = statistics.median(quote)
    free = pair_ratios(samples, label, "free", "lookup", "1")
    same = all(s.same[0] for s in samples if s.model == label)
    figures: dict[str, float | int | str | bool | None] = {
        "lookup tok/s": median_of(samples, label, "quote", "lookup", "1", "tps"),
        "prefetch tok/s": median_of(samples, label, "quote", "prefetch", "1", "tps"),
        "acceptance": median_of(samples, label, "quote", "lookup", "1", "accept"),
        "tokens per pass": median_of(samples, label, "quote", "lookup", "1", "per_pass"),
        "MB per accepted token": median_of(samples, label, "quote", "lookup", "1", "mb"),
        "greedy tokens identical": same,
    }
    if free:
        figures["free text, lookup / prefetch"] = statistics.median(free)
    record(
        f"draft-lookup{suffix(label)[0]}",
        title=f"Drafts: prompt lookup under memory pressure{suffix(label)[1]}",
        what="decode tok/s with `--draft prompt-lookup` on text that quotes its context, 1 thread",
        ratio=ratio,
        yardstick="plain `run --prefetch`",
        yardstick_value=median_of(samples, label, "quote", "prefetch", "1", "tps"),
        unit="tok/s",
        figures=figures,
        target="≥ 1.6× on repeating text, ≥ 0.95× on free text (issue 27)",
        met=ratio >= 1.6 and (not free or statistics.median(free) >= 0.95),
        target_value=f"{ratio:.2f}×" + (f" and {statistics.median(free):.2f}×" if free else ""),
        detail=(f"free text {statistics.median(free):.2f}×; " if free else "")
        + f"greedy tokens {'identical' if same else 'NOT identical'} in every configuration",
        model=model,
    )


def record_threads(samples: list[Sample], held: dict[str, str]) -> None:
    """The default thread count against ``-t 1``, the worse of the models the holder held
    for, as benchmarks/README.md's table shows it."""
    pairs = {label: pair_ratios(samples, label, "free", "prefetch", "default") for label in held}
    pairs = {label: r for label, r in pairs.items() if r}
    if not pairs:
        return
    worst = min(pairs, key=lambda label: statistics.median(pairs[label]))
    ratio = statistics.median(pairs[worst])
    chosen = {
        label: sorted(
            {s.result.threads for s in samples if s.model == label and s.threads == "default"}
        )
        for label in pairs
    }
    record(
        "thread-default",
        title="Default thread count under memory pressure",
        what="decode tok/s of plain `--prefetch` at the default (tuned) thread count, the worse "
        f"of {len(pairs)} model(s) ({worst} routing)",
        ratio=ratio,
        yardstick="`-t 1`",
        yardstick_value=median_of(samples, worst, "free", "prefetch", "1", "tps"),
        unit="tok/s",
        figures={f"{label}: default / -t 1": statistics.median(r) for label, r in pairs.items()}
        | {f"{label}: threads chosen": ", ".join(map(str, c)) for label, c in chosen.items()},
        target="never slower than `-t 1`, in every pair",
        met=all(x >= 1 for r in pairs.values() for x in r),
        target_value="pairs "
        + "; ".join(f"{', '.join(f'{x:.2f}' for x in r)} ({label})" for label, r in pairs.items()),
        detail="; ".join(
            f"{label} routing {statistics.median(r):.2f}× ({', '.join(map(str, chosen[label]))} "
            "threads chosen)"
            for label, r in pairs.items()
        ),
        model=" and ".join(held[label] for label in pairs) + ", free text",
    )


def record_serve(
    args: argparse.Namespace,
    label: str,
    got: dict[str, list[dict[str, float]]],
    ratios: list[float],
    size: int,
) -> None:
    """``serve --draft prompt-lookup`` against ``serve --prefetch``, as benchmarks/README.md's
    table shows it."""
    drafted = statistics.median(r.get("drafted", 0.0) for r in got["draft"])
    accepted = statistics.median(r.get("accepted", 0.0) for r in got["draft"])
    record(
        f"draft-serve{suffix(label)[0]}",
        title=f"Drafts through `serve`{suffix(label)[1]}",
        what="streamed decode tok/s of `serve --prefetch --draft prompt-lookup` through the "
        "`openai` client",
        ratio=statistics.median(ratios),
        yardstick="`serve --prefetch` without drafts",
        yardstick_value=statistics.median(r["tps"] for r in got["plain"]),
        unit="tok/s",
        figures={
            "with drafts tok/s": statistics.median(r["tps"] for r in got["draft"]),
            "pair ratios": ", ".join(f"{r:.2f}" for r in ratios),
            "drafted": drafted,
            "accepted": accepted,
        },
        detail=f"{drafted:g} tokens drafted, {accepted:g} accepted (the server's counters)",
        model=f"bench_run.py's {label}-routing qwen3moe ({args.layers} layers, Q8_0, "
        f"{size / 1e9:.2f} GB), 1 thread, {args.leave} left",
    )


if __name__ == "__main__":
    main()
