"""CLI for ``moepack fit``: parsing and rendering only (the library is ``moepack.fit``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..fit.command import PROMPT_TOKENS, FitResult, fit_model
from ..fit.estimate import Estimate, MemoryPoint
from ..fit.hitrate import RECENCY_SOURCE
from .options import SizeType, file_path, json_option, quiet_option
from .render import RichProgress, emit, human_bytes, notes, print_wide, put, styled, table


def _tps(pair: tuple[float, float]) -> str:
    lo, hi = pair
    fmt = "{:.2f}" if hi < 100 else "{:.0f}"
    if abs(hi - lo) <= 0.005 * max(hi, 1e-9):
        return fmt.format(lo)
    return f"{fmt.format(lo)}–{fmt.format(hi)}"


def _hit(e: Estimate) -> str:
    if e.hit is None or e.runner == "stock":
        return "-"
    lo, hi = e.hit.low, e.hit.high
    return f"{100 * lo:.0f} %" if abs(hi - lo) < 0.005 else f"{100 * lo:.0f}–{100 * hi:.0f} %"


def _setting(p: MemoryPoint, e: Estimate) -> str:
    if e.runner == "stock":
        return f"-t {e.threads}"
    if p.fits:
        return f"-t {e.threads} (prefetch not needed)"
    if p.settings.get("cache") is None:
        return f"-t {e.threads} --prefetch (too little memory for the live cache)"
    return f"-t {e.threads} --prefetch --cache {human_bytes(p.cache_bytes)} --pin-dense on"


def _rows(p: MemoryPoint) -> list[list[Any]]:
    rows = []
    for e in (p.stock, p.prefetch):
        name = "llama.cpp (stock)" if e.runner == "stock" else "moepack run --prefetch"
        rows.append(
            [
                human_bytes(p.memory),
                name,
                _tps(e.decode_tps),
                _tps(e.prefill_tps),
                _hit(e),
                human_bytes(e.read_per_token[1]) if e.read_per_token[1] else "0",
                e.limiter,
                f"{e.bound_tps:.2f}" if e.bound_tps < 100 else f"{e.bound_tps:.0f}",
                _setting(p, e),
            ]
        )
    return rows


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
    fits = (
        styled("fits in memory", "bold green") if m.fits else styled("does not fit", "bold yellow")
    )
    put(
        con,
        "  ",
        fits,
        f": needs {human_bytes(r.fit_memory)}, {human_bytes(r.memory)} "
        f"({r.memory_source}); verdict: ",
        styled(m.verdict, "bold"),
    )
    rows = [row for p in r.points for row in _rows(p)]
    cols = [
        "memory",
        "runner",
        "decode tok/s",
        "prefill tok/s",
        "expert hits",
        "read/token",
        "limit",
        "bound tok/s",
        "settings",
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
        f"knee: {knee} (the least memory for run --prefetch within "
        f"{100 * (1 - k['share']):.0f} % of its best, {k['best_tps']:.2f} tok/s); "
        f"below {human_bytes(r.min_memory)} its live cache cannot hold one token's experts",
    )
    cal = r.calibration
    put(
        con,
        f"compute: calibrated in llama.cpp ({'cached' if cal.cached else 'measured now'}, "
        f"{cal.measured}) on a generated {cal.spec.get('arch')} {cal.spec.get('weight_type')} "
        f"model of these per-layer shapes; prefill of a {r.prompt_tokens}-token prompt",
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
    if r.verify:
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
        print_wide(
            con,
            table(
                f"verify at {human_bytes(v.memory)} ({held}{human_bytes(v.available)} left)",
                ["figure", "estimated tok/s", "measured tok/s", "error"],
                vrows,
                right={1, 2, 3},
            ),
        )
        notes(v.notes)
    notes(r.notes)


@click.command("fit")
@click.argument("model")
@click.option(
    "--memory", type=SizeType(), help="Memory to judge for (default: what is available now)."
)
@click.option(
    "--threads",
    "-t",
    type=click.IntRange(min=1),
    help="llama.cpp threads (default: 1 and every core, the better).",
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
    help="Run the model (stock and --prefetch) at --memory and show estimated against measured.",
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
    trace: Path | None,
    probe: bool,
    verify: bool,
    prompt_tokens: int,
    timeout: float,
    as_json: bool,
    quiet: bool,
) -> None:
    """Will MODEL (a GGUF, any shard of a split set, or an http(s) URL read for its header
    only) run on this machine, and how fast: decode and prefill tokens/s with stock llama.cpp
    and with moepack run --prefetch, what limits each, the settings, the knee, and the same
    at two other memory sizes."""
    say_notes = (lambda m: None) if quiet or as_json else (lambda m: notes([m]))
    result = fit_model(
        model,
        memory=memory,
        threads=threads,
        trace=trace,
        probe=probe,
        verify=verify,
        prompt_tokens=prompt_tokens,
        timeout=timeout,
        progress=RichProgress(not quiet and not as_json),
        on_note=say_notes,
    )
    emit(result, as_json, _render)
