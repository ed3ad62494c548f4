"""``moepack demo``: parsing and rendering only (the library is ``demo.run_demo``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from ..demo import NO_LLAMA_ENV, DemoResult, run_demo
from ..errors import VerificationFailed
from .options import json_option, path_out, quiet_option
from .render import RichProgress, emit, human_bytes, put, styled


def _step(label: str) -> Text:
    return styled(label, "bold")


def _demo_source_lines(con: Console, r: DemoResult) -> None:
    """Steps 1-3: where the model, the routing and the plan came from."""
    size = f"{human_bytes(r.model_bytes)}, qwen3moe"
    p = r.planning
    if r.held_out is None:
        put(
            con,
            _step("1. synth"),
            f"   {r.model} ({size}) and {r.trace} "
            f"(synthetic trace, {r.trace_tokens:,} tokens with planted clusters)",
        )
        put(
            con,
            _step("2. plan"),
            f"    {r.plan}: {p.requests_before:.2f} -> "
            f"{p.requests_after:.2f} read requests per token over {len(p.layers)} MoE blocks "
            "(on the synthetic trace it was made from)",
        )
        return
    h = r.held_out
    put(
        con,
        _step("1. synth"),
        f"   {r.model} ({size}, routing planted for llama.cpp) and "
        f"{r.prompt_count} prompts in {r.prompts}",
    )
    put(
        con,
        _step("2. capture"),
        f" {r.trace}: real llama.cpp routing of {r.trace_tokens:,} "
        f"tokens over {r.prompt_count} prompts, {r.capture_seconds:.1f} s",
    )
    put(
        con,
        _step("3. plan"),
        f"    {r.plan} from prompts 1-{h.split.train_prompts} "
        f"({h.split.train.tokens:,} tokens); on the {h.split.held_out_prompts} held-out "
        f"prompts ({h.split.held_out.tokens:,} tokens): {h.requests_before:.2f} -> "
        f"{h.requests_after:.2f} read requests per token over {len(p.layers)} MoE blocks",
    )


def _render_demo(con: Console, r: DemoResult) -> None:
    _demo_source_lines(con, r)
    n = 3 if r.held_out is None else 4
    rp = r.repacked
    put(
        con,
        _step(f"{n}. repack"),
        f"  {rp.outputs[0]}: {rp.tensors_permuted} tensors permuted, "
        f"{rp.tensors_copied} copied, {rp.seconds:.2f} s",
    )
    v = r.verified
    verdict = (
        "OK, every byte accounted for"
        if v.ok
        else f"FAILED: {v.difference.message if v.difference else ''}"
    )
    put(
        con,
        _step(f"{n + 1}. verify"),
        f"  {v.tensors_compared} tensors, {human_bytes(v.bytes_compared)} compared: {verdict}",
    )
    if r.judge is not None and r.routing is not None:
        j, g = r.judge, r.routing
        put(
            con,
            _step(f"{n + 2}. llama.cpp"),
            f" same {j.tokens} tokens through both files: "
            f"max |Δlogit| {j.max_abs_diff:.2e}, argmax agrees on "
            f"{100 * j.argmax_agreement:.0f} %; routing of {g.tokens:,} tokens mapped back "
            f"through the permutation: {100 * g.same_set:.0f} % as sets, "
            f"{100 * g.same_order:.0f} % in order",
        )
    else:
        con.print(
            styled(
                f"{n + 2}. llama.cpp not used (not installed, or --no-llama): the trace was "
                "synthetic and no llama.cpp judgement ran; ./dev test installs it",
                "dim",
            )
        )


def _demo_failure(r: DemoResult) -> str | None:
    """Why the demo's repack is not a drop-in, or None."""
    if not r.verified.ok:
        return "the demo's repacked file did not verify"
    if r.judge is not None and not r.judge.ok:
        return "llama.cpp gives the demo's repacked file different logits"
    if r.routing is not None and not r.routing.ok:
        return "the demo's repacked routing does not map back through its permutation"
    return None


@click.command("demo")
@click.option(
    "--dir",
    "folder",
    type=path_out,
    default=Path("moepack-demo"),
    show_default=True,
)
@click.option(
    "--no-llama",
    is_flag=True,
    help="Use a synthetic trace and skip llama.cpp even if it is installed "
    f"(or set {NO_LLAMA_ENV}=1).",
)
@json_option
@quiet_option
def demo_cmd(folder: Path, no_llama: bool, as_json: bool, quiet: bool) -> None:
    """Synth -> capture real routing -> plan (scored on held-out prompts) -> repack ->
    verify -> llama.cpp judgement, end to end; a synthetic trace without llama.cpp."""
    result = run_demo(
        folder,
        use_llama=False if no_llama else None,
        progress=RichProgress(not quiet and not as_json),
    )
    emit(result, as_json, _render_demo)
    failure = _demo_failure(result)
    if failure is not None:
        raise VerificationFailed(failure, result.repacked.outputs[0])
