"""CLI for ``moepack run``: generation in llama.cpp with the optional expert prefetcher."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..errors import BadInput
from ..llama.run import RunResult, run_model
from ..storage.engine import MAX_QUEUE_DEPTH
from .options import json_option
from .render import emit, human_bytes, stderr, stdout, table


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from ``--prompt`` or the whole text of ``--prompt-file`` (exactly one)."""
    if (prompt is None) == (prompt_file is None):
        raise BadInput("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise BadInput("no such file", prompt_file)
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadInput("the prompt file is not UTF-8 text", prompt_file) from None
        if not prompt.strip():
            raise BadInput("the prompt file is empty", prompt_file)
    assert prompt is not None
    if not prompt.strip():
        raise BadInput("the prompt is empty")
    return prompt


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


def register(cli: click.Group) -> None:
    @cli.command("run")
    @click.argument("model", type=click.Path(path_type=Path))
    @click.option("--prompt", help="The prompt text.")
    @click.option(
        "--prompt-file", type=click.Path(path_type=Path), help="A UTF-8 file holding the prompt."
    )
    @click.option(
        "--n-predict",
        type=click.IntRange(min=0),
        default=32,
        show_default=True,
        help="Tokens to generate (greedy).",
    )
    @click.option(
        "--prefetch",
        is_flag=True,
        help="Read each layer's chosen experts into the page cache before its matmuls run.",
    )
    @click.option("--engine", default="threads", show_default=True, help="Prefetch read engine.")
    @click.option(
        "--qd",
        "queue_depth",
        type=click.IntRange(1, MAX_QUEUE_DEPTH),
        default=8,
        show_default=True,
        help="Prefetch queue depth.",
    )
    @click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=2,
        show_default=True,
        help="llama.cpp compute threads.",
    )
    @click.option(
        "--ctx",
        "n_ctx",
        type=click.IntRange(min=8),
        default=4096,
        show_default=True,
        help="Context length (tokens) of the llama.cpp context.",
    )
    @click.option(
        "--no-readaround",
        is_flag=True,
        help="MADV_RANDOM on the expert ranges of llama.cpp's mapping (no fault read-around).",
    )
    @click.option(
        "--cold",
        is_flag=True,
        help="Drop the model's pages (this file's only) after the prompt, so decode starts cold.",
    )
    @click.option(
        "--trace",
        "trace_out",
        type=click.Path(path_type=Path),
        help="Also capture the routing of every token to this trace (.moetrace, .pmxtrace, …).",
    )
    @json_option
    def run_cmd(
        model: Path,
        prompt: str | None,
        prompt_file: Path | None,
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
        """Generate text with llama.cpp and report tokens/s, bytes read, page faults and
        prefetch time per token."""
        text = read_prompt(prompt, prompt_file)

        def show(piece: str) -> None:
            stdout.out(piece, end="", highlight=False)

        def warn(message: str) -> None:
            stderr.print(
                f"moepack: warning: {message}", markup=False, highlight=False, soft_wrap=True
            )

        result = run_model(
            model,
            text,
            n_predict=n_predict,
            prefetch=prefetch,
            engine=engine,
            queue_depth=queue_depth,
            threads=threads,
            n_ctx=n_ctx,
            no_readaround=no_readaround,
            cold=cold,
            trace_out=trace_out,
            on_piece=None if as_json else show,
            on_warning=warn,
        )
        emit(result, as_json, _render)
