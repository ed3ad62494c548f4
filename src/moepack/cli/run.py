"""CLI for ``moepack run``: generation in llama.cpp with the optional expert prefetcher."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..llama.runtime.choice import Prefetch
from ..llama.runtime.draft import DraftOptions
from ..llama.runtime.prompts import workload
from ..llama.runtime.run import RunOptions, RunResult, run_model
from .draft import draft_options
from .options import (
    batch_option,
    ctx_option,
    file_path,
    force_option,
    input_path,
    json_option,
    n_predict_option,
    prompt_options,
    threads_batch_option,
    threads_option,
)
from .prefetch import prefetch_options
from .render import emit, human_bytes, notes, stdout, table, warn


def _render(con: Console, r: RunResult) -> None:
    con.print()
    rows = []
    for name, ph in (("prefill", r.prefill), ("decode", r.decode)):
        j = ph.to_json()
        hit = j["expert_hit_rate"]
        rows.append(
            [
                name,
                ph.tokens,
                f"{ph.tokens_per_second:.2f}",
                human_bytes(j["bytes_read_per_token"]),
                f"{j['major_faults_per_token']:.1f}",
                "-" if hit is None else f"{100 * hit:.0f} %",
                human_bytes(j["prefetch_bytes_per_token"]),
                f"{1e3 * j['cpu_seconds'] / ph.tokens:.0f}" if ph.tokens else "-",
            ]
        )
    st = r.stream or {}
    if r.prefetch is None:
        how = "llama.cpp's own mmap reads"
    elif r.prefetch.mode == "serial":
        how = f"serial prefetch with {st.get('engine')} at queue depth {st.get('queue_depth')}"
    elif st.get("pager"):
        how = "overlapped prefetch, experts paged by moepack"
    else:
        how = "overlapped prefetch through the page cache"
    con.print(
        table(
            f"{r.model.name}: {how}, {r.threads} thread(s)"
            + (
                f" ({r.threads_batch} for prompts)"
                if r.threads_batch and r.threads_batch != r.threads
                else ""
            ),
            [
                "phase",
                "tokens",
                "tokens/s",
                "read/token",
                "major faults/token",
                "experts cached",
                "prefetched/token",
                "CPU ms/token",
            ],
            rows,
            right={1, 2, 3, 4, 5, 6, 7},
        )
    )
    notes = []
    pg = st.get("pager")
    if pg:
        notes.append(
            f"experts paged by moepack through {pg['userfaultfd']}, "
            f"{'O_DIRECT' if pg['o_direct'] else 'buffered'} reads at queue depth "
            f"{pg['queue_depth']}, placed by UFFDIO_{pg.get('placing', 'copy').upper()}: "
            f"budget {human_bytes(pg['budget_bytes'])}, at most "
            f"{human_bytes(pg['peak_resident_bytes'])} resident of "
            f"{human_bytes(pg['expert_bytes'])}"
        )
    if st.get("pinned_bytes"):
        notes.append(f"{human_bytes(st['pinned_bytes'])} of dense weights locked in memory")
    la = st.get("lookahead")
    if la:
        notes.append(
            f"lookahead ({la['predictors']}, up to {la['budget']} experts/layer): recall "
            f"{100 * la['recall']:.0f} %, precision {100 * la['precision']:.0f} %, "
            f"{human_bytes(la['bytes_read'])} read ahead, {human_bytes(la['bytes_wasted'])} unused"
        )
    w = r.weights
    if w:
        anon = w.get("anon_bytes_of_load")
        notes.append(
            f"weights: placement {w['placement']} ({w['reason']}); {len(w['repacked'])} "
            f"tensors repacked, experts {'in' if w['experts_mapped'] else 'copied out of'} the "
            f"file's mapping"
            + (f"; {human_bytes(anon)} of anonymous memory taken by the load" if anon else "")
        )
    d = r.decode.draft_summary()
    if d is not None:
        notes.append(draft_note(r.draft.kind, d))
    for n in notes:
        con.print(n, markup=False, highlight=False)


def draft_note(kind: str, d: dict[str, object]) -> str:
    """One line on what drafting did (``RunPhaseTotals.draft_summary``)."""
    rate = d["acceptance_rate"]
    line = (
        f"drafts ({kind}): {d['accepted']} of {d['drafted']} accepted"
        + ("" if rate is None else f" ({100 * float(rate):.0f} %)")  # type: ignore[arg-type]
        + f" in {d['verify_passes']} verification passes, {d['single_passes']} passes without"
    )
    if d["verify_passes"] and d["routed_per_verified_batch"]:
        line += (
            f"; experts per layer and verified batch {d['experts_per_verified_batch']:.1f} "
            f"of {d['routed_per_verified_batch']:.1f} routed"
        )
    return line + f"; {human_bytes(float(d['bytes_per_accepted_token']))} read per accepted token"  # type: ignore[arg-type]


@click.command("run")
@click.argument("model", type=input_path)
@prompt_options
@n_predict_option(32)
@prefetch_options
@draft_options
@threads_option(None)
@threads_batch_option
@batch_option
@ctx_option(4096, 8, "Context length (tokens) of the llama.cpp context.")
@click.option(
    "--readaround",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Fault read-around on the expert ranges of llama.cpp's mapping (auto: off where "
    "the overlapped prefetch manages the experts, with the live cache or the pager; on "
    "when the model fits).",
)
@click.option(
    "--no-readaround",
    is_flag=True,
    help="The same as --readaround off (MADV_RANDOM on the expert ranges).",
)
@click.option(
    "--spin",
    type=click.IntRange(min=0),
    default=None,
    help="How long ggml's OpenMP threads spin-wait before they sleep (GOMP_SPINCOUNT; "
    "default: 10000 when prefetching a model larger than memory, OpenMP's own otherwise).",
)
@click.option(
    "--cold",
    is_flag=True,
    help="Drop the model's pages (this file's only) after each prompt, so decode starts cold.",
)
@click.option(
    "--trace",
    "trace_out",
    type=file_path,
    help="Also capture the routing of every token to this trace (.moetrace, .pmxtrace, …).",
)
@json_option
@force_option
def run_cmd(
    model: Path,
    prompt: tuple[str, ...],
    prompt_file: Path | None,
    chat: bool,
    n_predict: int,
    prefetch: Prefetch,
    memory: int | str,
    lookahead_trace: Path | None,
    placement: str,
    draft: DraftOptions,
    threads: int | None,
    threads_batch: int | None,
    batch: int,
    n_ctx: int,
    readaround: str,
    no_readaround: bool,
    spin: int | None,
    cold: bool,
    trace_out: Path | None,
    as_json: bool,
) -> None:
    """Generate text with llama.cpp after each prompt, in order, and report tokens/s,
    bytes read, page faults, expert cache hits and CPU time per token."""
    prompts = workload(prompt, prompt_file)
    last = [0]

    def show(index: int, piece: str) -> None:
        if index != last[0]:  # the next prompt's text starts on its own line
            stdout.out("")
            last[0] = index
        stdout.out(piece, end="", highlight=False)

    options = RunOptions(
        n_predict=n_predict,
        threads=threads,
        threads_batch=threads_batch,
        batch=batch,
        n_ctx=n_ctx,
        chat=chat,
        prefetch=prefetch,
        memory=memory,
        readaround="off" if no_readaround else readaround,
        cold=cold,
        spin=spin,
        lookahead_trace=str(lookahead_trace) if lookahead_trace else None,
        placement=placement,
        draft=draft,
    )
    result = run_model(
        model,
        prompts,
        options,
        trace_out=trace_out,
        on_piece=None if as_json else show,
        on_warning=lambda message: warn([message]),
        on_note=lambda message: notes([message]),
    )
    emit(result, as_json, _render)
