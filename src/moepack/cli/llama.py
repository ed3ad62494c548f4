"""CLI for llama.cpp runs: ``moepack trace capture`` and ``moepack check-dropin``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from .. import interrupts
from ..errors import VerificationFailed
from ..llama.judge.dropin import DropinResult, check_dropin
from ..llama.runtime.capture import CaptureOptions, CaptureResult, capture_trace
from ..llama.runtime.prompts import read_text_file, workload
from .options import (
    count_option,
    ctx_option,
    file_path,
    force_option,
    json_option,
    n_predict_option,
    path_in,
    prompt_options,
    quiet_option,
    seed_option,
    threads_option,
    trace_format_option,
)
from .render import TokenProgress, emit, human_bytes, stderr, table


def _render_capture(con: Console, r: CaptureResult) -> None:
    rows: list[list[Any]] = [
        ["trace", f"{r.out} ({r.format}, {human_bytes(r.saved.bytes)})"],
        ["prompts", r.prompts],
        ["tokens", f"{r.tokens:,} ({r.prefill_tokens:,} prefill, {r.decode_tokens:,} decode)"],
        ["MoE layers", f"{r.layers} (blocks {r.block_map[0]}-{r.block_map[-1]})"],
        ["experts", f"top-{r.k} of {r.n_expert}"],
        ["speed", f"{r.tokens_per_second:.1f} tokens/s ({r.seconds:.1f} s)"],
    ]
    if r.dropped:
        rows.append(["dropped by the format", "; ".join(r.dropped)])
    if r.truncated:
        rows.append(["truncated", "interrupted: complete up to its last token"])
    con.print(table("capture", ["", ""], rows))


@click.command("capture")
@click.argument("model", type=path_in)
@click.option(
    "--out",
    "-o",
    type=file_path,
    required=True,
    help="Trace to write (format from the extension, or --to).",
)
@trace_format_option("--to", "fmt", "Output format (default: from the extension).")
@prompt_options
@n_predict_option(0)
@click.option(
    "--temp", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0: greedy."
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=1.0,
    show_default=True,
)
@seed_option("Sampling seed (with --temp > 0).")
@threads_option()
@ctx_option(0, 0, "Context length (0: the model's).")
@count_option("--batch", 512, "llama.cpp batch (tokens per decode call).")
@count_option("--ubatch", 512, "llama.cpp micro-batch.")
@json_option
@quiet_option
@force_option
def capture_cmd(
    model: Path,
    out: Path,
    fmt: str | None,
    prompt: tuple[str, ...],
    prompt_file: Path | None,
    chat: bool,
    n_predict: int,
    temp: float,
    top_p: float,
    seed: int,
    threads: int,
    n_ctx: int,
    batch: int,
    ubatch: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Run MODEL in llama.cpp and record every token's top-k experts per MoE layer."""
    options = CaptureOptions(
        n_predict=n_predict,
        chat=chat,
        temp=temp,
        top_p=top_p,
        seed=seed,
        threads=threads,
        n_ctx=n_ctx,
        n_batch=batch,
        n_ubatch=ubatch,
    )
    result = capture_trace(
        model,
        out,
        workload(prompt, prompt_file),
        options,
        format=fmt,
        progress=TokenProgress(not quiet),
    )
    emit(result, as_json, _render_capture)
    if result.truncated:
        stderr.print(
            f"moepack: interrupted: {result.out} holds the first {result.tokens:,} tokens "
            "and is marked truncated",
            markup=False,
            highlight=False,
        )
        sys.exit(128 + interrupts.last_signal())  # 143 for SIGTERM, 129 for SIGHUP


def _render_dropin(con: Console, r: DropinResult) -> None:
    rows = [[g.name, "pass" if g.ok else "FAIL", g.summary] for g in r.gates]
    con.print(table(f"check-dropin: {r.candidate} vs {r.original}", ["gate", "", "evidence"], rows))
    out = next((g for g in r.gates if g.name == "output"), None)
    if out is not None:
        ppl = out.numbers["perplexity"]
        moved = ppl.get("position_control")
        con.print(
            f"perplexity over {r.tokens:,} tokens: original {ppl['original']:.4f}, candidate "
            f"{ppl['candidate']:.4f}, original with F16 KV {ppl['original_f16_kv']:.4f}"
            + (f", original with its experts reordered {moved:.4f}" if moved is not None else "")
        )
    con.print("PASS" if r.ok else "FAIL")


@click.command("check-dropin")
@click.argument("original", type=path_in)
@click.argument("candidate", type=path_in)
@count_option("--tokens", 1024, "Tokens of text the output gate compares.", low=2)
@click.option(
    "--text",
    "text_file",
    type=path_in,
    default=None,
    help="UTF-8 text to run (default: the Python standard library's documentation).",
)
@count_option("--window", 256, "Perplexity window (tokens).", low=2)
@threads_option()
@json_option
@quiet_option
def check_dropin_cmd(
    original: Path,
    candidate: Path,
    tokens: int,
    text_file: Path | None,
    window: int,
    threads: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Bytes, control, routing and output gates: is CANDIDATE a drop-in for ORIGINAL?"""
    text = read_text_file(text_file) if text_file is not None else None
    result = check_dropin(
        original,
        candidate,
        n_tokens=tokens,
        text=text,
        window=window,
        threads=threads,
        progress=TokenProgress(not quiet),
    )
    emit(result, as_json, _render_dropin)
    if not result.ok:
        raise VerificationFailed(result.failure(), candidate)
