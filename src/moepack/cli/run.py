"""CLI for ``moepack run``: generation in llama.cpp with the optional expert prefetcher."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..llama.prompts import workload
from ..llama.run import PrefetchOptions, RunOptions, RunResult, run_model
from .options import (
    ctx_option,
    engine_options,
    file_path,
    force_option,
    input_path,
    json_option,
    n_predict_option,
    prompt_options,
    threads_option,
)
from .render import emit, human_bytes, stdout, table, warn


def _render(con: Console, r: RunResult) -> None:
    con.print()
    rows = []
    for name, ph in (("prefill", r.prefill), ("decode", r.decode)):
        j = ph.to_json()
        rows.append(
            [
                name,
                ph.tokens,
                f"{ph.tokens_per_second:.2f}",
                human_bytes(j["bytes_read_per_token"]),
                f"{j['major_faults_per_token']:.1f}",
                f"{j['prefetch_reads_per_token']:.1f}",
                f"{j['prefetch_seconds']:.3f} s ({100 * j['prefetch_share']:.0f} %)",
            ]
        )
    how = (
        f"prefetch with {r.engine} at queue depth {r.queue_depth}"
        if r.prefetch
        else "llama.cpp's own mmap reads"
    )
    con.print(
        table(
            f"{r.model.name}: {how}, {r.threads} thread(s)",
            [
                "phase",
                "tokens",
                "tokens/s",
                "read/token",
                "major faults/token",
                "prefetch reads/token",
                "prefetching",
            ],
            rows,
            right={1, 2, 3, 4, 5, 6},
        )
    )


@click.command("run")
@click.argument("model", type=input_path)
@prompt_options
@n_predict_option(32)
@click.option(
    "--prefetch",
    is_flag=True,
    help="Read each layer's chosen experts into the page cache before its matmuls run.",
)
@engine_options("Prefetch read engine.", "Prefetch queue depth.")
@threads_option()
@ctx_option(4096, 8, "Context length (tokens) of the llama.cpp context.")
@click.option(
    "--no-readaround",
    is_flag=True,
    help="MADV_RANDOM on the expert ranges of llama.cpp's mapping (no fault read-around).",
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
    prefetch: bool,
    engine: str,
    queue_depth: int,
    threads: int,
    n_ctx: int,
    no_readaround: bool,
    cold: bool,
    trace_out: Path | None,
    as_json: bool,
) -> None:
    """Generate text with llama.cpp after each prompt, in order, and report tokens/s,
    bytes read, page faults and prefetch time per token."""
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
        n_ctx=n_ctx,
        chat=chat,
        prefetch=PrefetchOptions(engine, queue_depth) if prefetch else None,
        no_readaround=no_readaround,
        cold=cold,
    )
    result = run_model(
        model,
        prompts,
        options,
        trace_out=trace_out,
        on_piece=None if as_json else show,
        on_warning=lambda message: warn([message]),
    )
    emit(result, as_json, _render)
