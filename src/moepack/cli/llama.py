"""CLI for llama.cpp runs: ``moepack trace capture`` and ``moepack check-dropin``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..errors import BadInput, VerificationFailed
from ..llama.capture import CaptureOptions, CaptureResult, capture_trace
from ..llama.dropin import DropinResult, check_dropin
from ..llama.prompts import Prompt, read_prompt_file, text_prompt
from ..trace.formats import FORMATS
from .options import json_option, quiet_option
from .render import RichProgress, emit, human_bytes, stderr, table

path_in = click.Path(exists=True, dir_okay=False, path_type=Path)


class TokenProgress(RichProgress):
    """The progress bar with a tokens/s column for token counts (bytes as usual)."""

    def start(self, description: str, total: int, unit: str = "B") -> None:
        if unit != "tok":
            super().start(description, total, unit)
            return
        self.finish()
        if not self._enabled:
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=max(total, 1), rate="")

    def advance(self, amount: int) -> None:
        if self._progress is None:
            return
        self._progress.advance(self._task, amount)
        task = self._progress.tasks[0]
        speed = task.speed
        if speed:
            self._progress.update(self._task, rate=f"{speed:.1f} tok/s")


def _prompts(prompt: tuple[str, ...], prompt_file: Path | None) -> list[Prompt]:
    out = [text_prompt(p) for p in prompt]
    if prompt_file is not None:
        out += read_prompt_file(prompt_file)
    if not out:
        raise BadInput("give a workload: --prompt TEXT or --prompt-file FILE")
    return out


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


def register(cli: click.Group) -> None:
    """Add ``trace capture`` to the ``trace`` group, and ``check-dropin``."""
    register_dropin(cli)
    trace_group = cli.commands.get("trace")
    if not isinstance(trace_group, click.Group):
        raise RuntimeError("moepack.cli.llama registers after moepack.cli.trace")

    @trace_group.command("capture")
    @click.argument("model", type=path_in)
    @click.option(
        "--out",
        "-o",
        type=click.Path(dir_okay=False, path_type=Path),
        required=True,
        help="Trace to write (format from the extension, or --to).",
    )
    @click.option(
        "--to",
        "fmt",
        type=click.Choice(sorted(FORMATS)),
        default=None,
        help="Output format (default: from the extension).",
    )
    @click.option("--prompt", "-p", multiple=True, help="A prompt (repeatable).")
    @click.option(
        "--prompt-file",
        type=path_in,
        default=None,
        help="One prompt per line, or JSONL with a 'prompt' or chat 'messages' field.",
    )
    @click.option("--chat", is_flag=True, help="Render prompts with the model's chat template.")
    @click.option("--n-predict", "-n", type=click.IntRange(min=0), default=0, show_default=True)
    @click.option(
        "--temp", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0: greedy."
    )
    @click.option(
        "--top-p",
        type=click.FloatRange(min=0, max=1, min_open=True),
        default=1.0,
        show_default=True,
    )
    @click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
    @click.option("--threads", "-t", type=click.IntRange(min=1), default=2, show_default=True)
    @click.option(
        "--ctx",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Context length (0: the model's).",
    )
    @click.option("--batch", type=click.IntRange(min=1), default=512, show_default=True)
    @click.option(
        "--ubatch",
        type=click.IntRange(min=1),
        default=512,
        show_default=True,
        help="llama.cpp micro-batch.",
    )
    @json_option
    @quiet_option
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
        ctx: int,
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
            n_ctx=ctx,
            n_batch=batch,
            n_ubatch=ubatch,
        )
        result = capture_trace(
            model,
            out,
            _prompts(prompt, prompt_file),
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
            sys.exit(130)


def _render_dropin(con: Console, r: DropinResult) -> None:
    rows = [[g.name, "pass" if g.ok else "FAIL", g.summary] for g in r.gates]
    con.print(table(f"check-dropin: {r.candidate} vs {r.original}", ["gate", "", "evidence"], rows))
    out = next((g for g in r.gates if g.name == "output"), None)
    if out is not None:
        ppl = out.numbers["perplexity"]
        con.print(
            f"perplexity over {r.tokens:,} tokens: original {ppl['original']:.4f}, candidate "
            f"{ppl['candidate']:.4f}, original with F16 KV {ppl['original_f16_kv']:.4f}"
        )
    con.print("PASS" if r.ok else "FAIL")


def register_dropin(cli: click.Group) -> None:
    @cli.command("check-dropin")
    @click.argument("original", type=path_in)
    @click.argument("candidate", type=path_in)
    @click.option(
        "--tokens",
        type=click.IntRange(min=2),
        default=1024,
        show_default=True,
        help="Tokens of text the output gate compares.",
    )
    @click.option(
        "--text",
        "text_file",
        type=path_in,
        default=None,
        help="UTF-8 text to run (default: the Python standard library's documentation).",
    )
    @click.option("--window", type=click.IntRange(min=2), default=256, show_default=True)
    @click.option("--threads", "-t", type=click.IntRange(min=1), default=2, show_default=True)
    @json_option
    @quiet_option
    def dropin_cmd(
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
        text = None
        if text_file is not None:
            try:
                text = text_file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise BadInput("not UTF-8 text", text_file) from None
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
            failed = ", ".join(g.name for g in result.gates if not g.ok)
            raise VerificationFailed(f"not a drop-in: the {failed} gate(s) failed", candidate)
