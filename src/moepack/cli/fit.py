"""CLI for ``moepack fit``: parsing and rendering only (the library is ``moepack.fit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..fit.command import N_BATCH, N_CTX, PROMPT_TOKENS, FitResult, fit_model
from ..fit.estimate import Estimate, MemoryPoint
from ..fit.hitrate import RECENCY_SOURCE
from .flags import reword
from .options import SizeType, ctx_option, file_path, json_option, quiet_option
from .render import (
    RichProgress,
    emit,
    human_bytes,
    notes,
    print_wide,
    put,
    styled,
    table,
    warn,
)

RUNNERS = {
    "run": "run (no flags)",
    "serve": "serve (no flags)",
    "stock": "llama.cpp --no-prefetch",
}


def _tps(pair: tuple[float, float]) -> str:
    lo, hi = pair
    fmt = "{:.2f}" if hi < 100 else "{:.0f}"
    if abs(hi - lo) <= 0.005 * max(hi, 1e-9):
        return fmt.format(lo)
    return f"{fmt.format(lo)}–{fmt.format(hi)}"


def _hit(e: Estimate) -> str:
    if e.hit is None:
        return "-"
    lo, hi = e.hit.low, e.hit.high
    return f"{100 * lo:.0f} %" if abs(hi - lo) < 0.005 else f"{100 * lo:.0f}–{100 * hi:.0f} %"


def _threads(e: Estimate) -> str:
    lo, hi = e.threads
    decode = str(lo) if lo == hi else f"{lo}–{hi}"
    return f"{decode} / {e.threads_batch}"


def _rows(p: MemoryPoint, roles: tuple[str, ...]) -> list[list[Any]]:
    rows = []
    for e in (p.run, p.serve, p.stock):
        if e.role not in roles:
            continue
        if e.runner == "refused":
            rows.append([human_bytes(p.memory), RUNNERS[e.role], "refused", "-", "-", "-",
                         "memory", "-", "-"])  # fmt: skip
            continue
        engine = e.runner if e.role != "stock" else "mmap"
        rows.append(
            [
                human_bytes(p.memory),
                f"{RUNNERS[e.role]}: {engine}",
                _tps(e.decode_tps),
                _tps(e.prefill_tps),
                _hit(e),
                human_bytes(e.read_per_token[1]) if e.read_per_token[1] else "0",
                e.limiter,
                f"{e.bound_tps:.2f}" if e.bound_tps < 100 else f"{e.bound_tps:.0f}",
                _threads(e),
            ]
        )
    return rows


def _arithmetic(r: FitResult) -> str:
    """run's memory plan, term by term."""
    plan = r.main.choice.plan
    ctx = plan.context
    where = (
        f"--memory {human_bytes(plan.total)}"
        if plan.asked
        else f"{human_bytes(r.available)} available ({r.available_source}), less the margin: "
        f"{human_bytes(plan.total)}"
    )
    kv = (
        f"KV {human_bytes(ctx.state_bytes)} at {ctx.n_ctx} tokens, compute "
        f"{human_bytes(ctx.compute_bytes)}"
        if ctx.compute_bytes
        else f"context at most {human_bytes(ctx.bytes)} ({ctx.n_ctx} tokens, a bound)"
    )
    return (
        f"  memory: {where} = dense {human_bytes(plan.dense)} + {kv} + run "
        f"{human_bytes(plan.runtime)}"
        + (f" + prefix cache {human_bytes(plan.prefix_cache)}" if plan.prefix_cache else "")
        + f" + experts {human_bytes(plan.experts)}"
    )


def _render(con: Console, r: FitResult) -> None:
    s = r.shape
    shards = f", {len(r.remote.shards) if r.remote else 1} shard(s)"
    put(con, styled(r.model, "bold"), f": {s.architecture}, {human_bytes(s.file_bytes)}{shards}")
    if r.remote:
        put(
            con,
            f"  read {human_bytes(r.remote.bytes_read)} of it over HTTP "
            f"({100 * r.remote.share_read:.3f} % of its bytes, {r.remote.requests} requests)",
        )
    put(
        con,
        f"  {s.moe_layers} MoE layers x {s.n_expert} experts, top-{s.top_k}, "
        f"{s.expert_type} experts of {human_bytes(s.bytes_per_expert)}; "
        f"{human_bytes(s.dense_bytes)} dense, read every token",
    )
    m = r.main
    put(con, _arithmetic(r))
    fits = (
        styled("fits in memory", "bold green") if m.fits else styled("does not fit", "bold yellow")
    )
    put(
        con,
        "  ",
        fits,
        f": the model and its context need --memory {human_bytes(r.fit_memory)}; verdict: ",
        styled(m.verdict, "bold"),
    )
    if m.choice.refusal:
        put(con, "  ", styled("run would refuse", "bold red"), f": {reword(m.choice.refusal)}")
    else:
        chosen = m.run.threads[0] if m.run.threads[0] == m.run.threads[1] else None
        put(con, "  ", styled("run with no flags", "bold"), f": {m.choice.describe(chosen)}")
    served = m.served
    if served.refusal:
        put(con, "  ", styled("serve would refuse", "bold red"), f": {reword(served.refusal)}")
    else:
        put(con, "  ", styled("serve with no flags", "bold"), f": {served.describe()}")
    rows = _rows(m, ("run", "serve", "stock"))
    for p in r.points[1:]:
        rows += _rows(p, ("run", "stock"))
    cols = [
        "memory",
        "runner",
        "decode tok/s",
        "prefill tok/s",
        "expert hits",
        "read/token",
        "limit",
        "bound tok/s",
        "threads",
    ]
    print_wide(con, table(None, cols, rows, right={2, 3, 4, 5, 7}))
    k = r.knee
    knee = (
        human_bytes(k["low"])
        if k["low"] == k["high"]
        else (f"{human_bytes(k['high'])}–{human_bytes(k['low'])}")
    )
    put(
        con,
        f"knee: --memory {knee} (the least for run within "
        f"{100 * (1 - k['share']):.0f} % of its best, {k['best_tps']:.2f} tok/s); "
        f"below {human_bytes(r.min_memory)} run refuses",
    )
    cal = r.calibration
    put(
        con,
        f"compute: calibrated in llama.cpp ({'cached' if cal.cached else 'measured now'}, "
        f"{cal.measured}) on a generated {cal.spec.get('arch')} {cal.spec.get('weight_type')} "
        f"model of these per-layer shapes"
        + (", repacked and mapped" if cal.repacks_experts else "")
        + f"; prefill of a {r.prompt_tokens}-token prompt from a cold start",
    )
    ov = r.overlap
    put(
        con,
        f"overlap: the pager hides {100 * ov.pager_spare:.0f} % of the shorter of reads and "
        f"compute with a core to spare, {100 * ov.pager_all:.0f} % on every core ({ov.source})",
    )
    st = r.storage
    dev = st.device.get("block_device") or st.device.get("source")
    put(
        con,
        f"storage: {dev} ({st.device.get('filesystem')}), "
        f"{'cached' if st.cached else 'measured now'} {st.measured}; --probe measures again",
    )
    if r.hit_source == "trace":
        put(con, "expert hits: from the trace, per-layer LRU at each budget")
    else:
        put(
            con,
            "expert hits: no trace; a range from uniform routing (the floor) to a "
            f"recency prior ({RECENCY_SOURCE}); --trace T narrows it",
        )
    if r.verify and r.verify.runs:
        v = r.verify
        vrows = []
        for f in v.figures:
            lo, hi = f.estimated
            vrows.append(
                [
                    f.name,
                    _tps((lo, hi)),
                    f"{f.measured:.2f}",
                    "inside" if f.error == 0 else f"{100 * f.error:+.0f} %",
                ]
            )
        held = f"{human_bytes(v.held)} held, " if v.held else ""
        same = "as estimated" if v.choice.get("same") else "NOT as estimated"
        print_wide(
            con,
            table(
                f"verify: {held}{human_bytes(v.available)} left; run chose {same}; "
                f"verdict {v.verdict}",
                ["figure", "estimated tok/s", "measured tok/s", "error"],
                vrows,
                right={1, 2, 3},
            ),
        )
    if r.verify:
        notes(r.verify.notes)
    notes(r.notes)


@click.command("fit")
@click.argument("model")
@click.option(
    "--memory",
    type=SizeType(),
    help="What run would be given as --memory: the bytes the whole run may take "
    "(default: the memory available less run's margin, as run with no flags).",
)
@click.option(
    "--threads",
    "-t",
    type=click.IntRange(min=1),
    help="What run would be given as --threads (default: run chooses, as it does).",
)
@click.option(
    "--threads-batch",
    type=click.IntRange(min=1),
    help="What run would be given as --threads-batch (default: as run, --threads when given, "
    "else every core).",
)
@ctx_option(N_CTX, 8, "The context run would be given (--ctx), counted in its memory plan.")
@click.option(
    "--batch",
    type=click.IntRange(min=1, max=65536),
    default=N_BATCH,
    show_default=True,
    help="What run would be given as --batch: prompt tokens per llama.cpp pass.",
)
@click.option(
    "--trace",
    type=file_path,
    help="A routing trace (any format moepack reads) for the expert hit rates, bound by shape.",
)
@click.option(
    "--probe",
    is_flag=True,
    help="Measure the storage again (it is measured once per device and cached).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Run the model as run would (from a cold start) and show estimated against measured.",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=PROMPT_TOKENS,
    show_default=True,
    help="The prompt length prefill is estimated (and verified) for.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Seconds to wait for an HTTP answer.",
)
@json_option
@quiet_option
def fit_cmd(
    model: str,
    memory: int | None,
    threads: int | None,
    threads_batch: int | None,
    n_ctx: int,
    batch: int,
    trace: Path | None,
    probe: bool,
    verify: bool,
    prompt_tokens: int,
    timeout: float,
    as_json: bool,
    quiet: bool,
) -> None:
    """Will MODEL (a GGUF, any shard of a split set, or an http(s) URL read for its header
    only) run on this machine, and how fast: what moepack run and serve will choose with no
    flags (the engine, the memory budget, the threads), its decode and prefill tokens/s, what
    limits it, stock llama.cpp's mmap beside it, the knee, and the same at two other memory
    sizes."""
    say_notes = (lambda m: None) if quiet or as_json else (lambda m: notes([m]))
    result = fit_model(
        model,
        memory=memory,
        threads=threads,
        threads_batch=threads_batch,
        n_ctx=n_ctx,
        n_batch=batch,
        trace=trace,
        probe=probe,
        verify=verify,
        prompt_tokens=prompt_tokens,
        timeout=timeout,
        progress=RichProgress(not quiet and not as_json),
        on_note=say_notes,
    )
    refusal = result.main.choice.refusal
    if refusal:
        warn([f"run would refuse: {refusal}"])
    emit(result, as_json, _render)
