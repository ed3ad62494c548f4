"""``moepack synth``: parsing and rendering only (the library is
``planted.synth_with_trace``; ``--dry-run`` is ``checkpoint.synth_plan.plan_synth``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..checkpoint.archs import arch_names
from ..checkpoint.shapes import SHAPES, shape_names, synth_spec
from ..checkpoint.synth import WEIGHT_TYPES, SynthSpec
from ..checkpoint.synth_plan import SynthPlan, plan_synth
from ..planted.synth_with_trace import SynthPairResult, synth_model_with_trace
from .options import (
    count_option,
    force_option,
    json_option,
    out_option,
    path_out,
    quiet_option,
    seed_option,
)
from .render import RichProgress, emit, human_bytes


def _types(types: dict[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))


def _render_synth(con: Console, r: SynthPairResult) -> None:
    model = r.model
    for p in model.paths:
        con.print(f"wrote {p}")
    con.print(
        f"{model.spec.arch}: {model.tensors} tensors, {human_bytes(model.file_bytes)}, "
        f"{model.spec.weight_type} ({_types(model.types)})"
    )
    if r.trace:
        what = "the prompts' planted routing" if model.spec.routing else "planted clusters"
        con.print(f"wrote {r.trace} ({r.tokens:,} tokens, {what})")
    if r.prompts:
        con.print(f"wrote {r.prompts} ({r.prompt_count} prompts moving between topics)")
    if model.spec.routing is not None:
        rt = model.spec.routing
        con.print(
            f"planted routing: clusters of {rt.cluster_size}, stay {rt.stay}, "
            f"coupling {rt.coupling}, skew {rt.skew}"
        )


def _render_plan(con: Console, plan: SynthPlan) -> None:
    spec = plan.spec
    con.print(
        f"{spec.arch} {spec.weight_type}: {len(plan.tensors)} tensors "
        f"({_types(plan.type_counts())}), {plan.file_bytes:,} bytes "
        f"({human_bytes(plan.file_bytes)}) in {len(plan.shard_bytes)} file(s); nothing written"
    )


def _shapes_epilog() -> str:
    lines = ["Shapes (--shape; flags given override their sizes):"]
    lines += [f"  {s.name}: {s.model} ({dict(s.sizes)['arch']})" for s in SHAPES]
    return "\b\n" + "\n".join(lines)


def _size(flag: str, low: int, what: str) -> Any:
    return click.option(flag, type=click.IntRange(min=low), default=None, help=f"{what}.")


@click.command("synth", epilog=_shapes_epilog())
@out_option("Model to write (.gguf).")
@click.option(
    "--trace-out",
    type=path_out,
    default=None,
    help="Also write a routing trace here (.moetrace, .pmxtrace, .txt); with --routing, the "
    "routing the prompts will show (--tokens and --prefill do not apply).",
)
@click.option(
    "--shape",
    type=click.Choice(shape_names(), case_sensitive=False),
    default=None,
    help="Every size of a published model (listed below, each from its config.json).",
)
@click.option(
    "--arch",
    type=click.Choice(arch_names()),
    default=None,
    help=f"MoE family (llama.cpp architecture) to write (default {SynthSpec.arch}, or the shape's).",
)
@_size("--layers", 1, f"Blocks (default {SynthSpec.layers}, or the shape's)")
@_size("--experts", 2, f"Routed experts per block (default {SynthSpec.experts}, or the shape's)")
@_size("--top-k", 1, f"Experts per token (default {SynthSpec.top_k}, or the shape's)")
@_size("--hidden", 32, f"Model width (default {SynthSpec.hidden}, or the shape's)")
@_size("--expert-ffn", 32, f"Expert FFN width (default {SynthSpec.expert_ffn}, or the shape's)")
@_size("--heads", 1, f"Attention heads (default {SynthSpec.heads}, or the shape's)")
@_size("--kv-heads", 1, f"Key/value heads (default {SynthSpec.kv_heads}, or the shape's)")
@_size("--head-dim", 2, f"Head width (default {SynthSpec.head_dim}, or the shape's)")
@_size("--vocab", 262, f"Vocabulary size (default {SynthSpec.vocab}, or the shape's)")
@click.option(
    "--weight-type",
    type=click.Choice(WEIGHT_TYPES),
    default="F32",
    show_default=True,
    help="F32 … Q5_1: every weight in that type; Q2_K … Q6_K, MXFP4_MOE: llama.cpp's own "
    "per-tensor mix for that file type, quantised by ggml (needs llama.cpp).",
)
@click.option(
    "--shared-experts",
    type=click.IntRange(min=0),
    default=None,
    help="Shared experts per MoE block (deepseek2, qwen2moe, qwen3next, qwen35moe; default 1).",
)
@click.option(
    "--expert-groups",
    type=click.IntRange(min=1),
    default=None,
    help="Expert groups for grouped routing (deepseek2; default 4 when they fit).",
)
@click.option(
    "--groups-used",
    type=click.IntRange(min=1),
    default=None,
    help="Groups a token may route to (deepseek2; default half the groups).",
)
@click.option(
    "--dense-layers",
    type=click.IntRange(min=0),
    default=None,
    help="Dense leading blocks (deepseek2, mistral4, glm4moe; default 1 when there are "
    "enough layers).",
)
@click.option(
    "--fused-gate-up",
    is_flag=True,
    default=False,
    help="Write ffn_gate_up_exps fused (deepseek2, mistral4, qwen3next, qwen35moe).",
)
@click.option(
    "--dense-ffn",
    type=click.IntRange(min=32),
    default=None,
    help="FFN width of the dense leading blocks (deepseek2, mistral4, glm4moe; default "
    "--expert-ffn).",
)
@click.option(
    "--linear-heads",
    type=click.IntRange(min=1),
    default=None,
    help="Delta-net value heads (qwen3next, qwen35moe; default --heads).",
)
@click.option(
    "--linear-key-heads",
    type=click.IntRange(min=1),
    default=None,
    help="Delta-net key heads (qwen3next, qwen35moe; default --kv-heads).",
)
@click.option(
    "--linear-head-dim",
    type=click.IntRange(min=2),
    default=None,
    help="Delta-net head width (qwen3next, qwen35moe; default --head-dim).",
)
@click.option(
    "--nextn-layers",
    type=click.IntRange(min=0),
    default=None,
    help="Next-token-prediction (MTP) blocks at the end, which llama.cpp never runs "
    "(glm4moe: default 1; deepseek2, mistral4: default 0).",
)
@click.option(
    "--routing",
    "routing_text",
    default=None,
    metavar="SPEC",
    help="Plant routing llama.cpp really follows: cluster=8,stay=0.8,coupling=1,skew=1 "
    "(cluster defaults to --top-k; '' takes every default).",
)
@click.option(
    "--prompts-out",
    type=path_out,
    default=None,
    help="Also write prompts that move between topics (.jsonl, or one text per line).",
)
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@seed_option()
@count_option("--split-max-size", 0, "Split into shards of at most this many bytes.", low=0)
@count_option("--tokens", 4096, "Trace length.")
@count_option("--prefill", 0, "Prefill tokens at the start of the trace.", low=0)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Tensors written at once (default: every core).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    default=False,
    help="Write nothing: say each type's tensor count and the file's exact size.",
)
@json_option
@quiet_option
@force_option
def synth_cmd(
    out: Path,
    trace_out: Path | None,
    shape: str | None,
    arch: str | None,
    layers: int | None,
    experts: int | None,
    top_k: int | None,
    hidden: int | None,
    expert_ffn: int | None,
    heads: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    vocab: int | None,
    weight_type: str,
    shared_experts: int | None,
    expert_groups: int | None,
    groups_used: int | None,
    dense_layers: int | None,
    fused_gate_up: bool,
    dense_ffn: int | None,
    linear_heads: int | None,
    linear_key_heads: int | None,
    linear_head_dim: int | None,
    nextn_layers: int | None,
    routing_text: str | None,
    prompts_out: Path | None,
    n_prompts: int,
    prompt_tokens: int,
    seed: int,
    split_max_size: int,
    tokens: int,
    prefill: int,
    threads: int | None,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a synthetic MoE checkpoint (qwen3moe, deepseek2, mistral4, qwen2moe, mixtral, gpt-oss,
    glm4moe, qwen3next, qwen35moe) that llama.cpp runs, optionally with planted routing, a routing trace and prompts.

    --shape gives every size of a published model; flags given as well override them."""
    spec = synth_spec(
        shape,
        arch=arch,
        layers=layers,
        experts=experts,
        top_k=top_k,
        hidden=hidden,
        expert_ffn=expert_ffn,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        weight_type=weight_type,
        seed=seed,
        shared_experts=shared_experts,
        expert_groups=expert_groups,
        groups_used=groups_used,
        dense_layers=dense_layers,
        fused_gate_up=fused_gate_up or None,
        dense_ffn=dense_ffn,
        linear_heads=linear_heads,
        linear_key_heads=linear_key_heads,
        linear_head_dim=linear_head_dim,
        nextn_layers=nextn_layers,
        routing_text=routing_text,
    )
    if dry_run:
        emit(plan_synth(spec, split_max_size), as_json, _render_plan)
        return
    result = synth_model_with_trace(
        out,
        spec,
        split_max_size=split_max_size,
        trace_out=trace_out,
        tokens=tokens,
        prefill=prefill,
        progress=RichProgress(not quiet and not as_json),
        prompts_out=prompts_out,
        n_prompts=n_prompts,
        prompt_tokens=prompt_tokens,
        threads=threads,
    )
    emit(result, as_json, _render_synth)
