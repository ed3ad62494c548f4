"""``moepack synth``: parsing and rendering only (the library is
``planted.synth_with_trace``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..checkpoint.archs import arch_names
from ..checkpoint.routing import RoutingSpec
from ..checkpoint.synth import WEIGHT_TYPES, SynthSpec
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


def _render_synth(con: Console, r: SynthPairResult) -> None:
    model = r.model
    for p in model.paths:
        con.print(f"wrote {p}")
    con.print(
        f"{model.spec.arch}: {model.tensors} tensors, {human_bytes(model.file_bytes)}, {model.spec.weight_type}"
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


@click.command("synth")
@out_option("Model to write (.gguf).")
@click.option(
    "--trace-out",
    type=path_out,
    default=None,
    help="Also write a routing trace here (.moetrace, .pmxtrace, .txt); with --routing, the "
    "routing the prompts will show (--tokens and --prefill do not apply).",
)
@click.option(
    "--arch",
    type=click.Choice(arch_names()),
    default=SynthSpec.arch,
    show_default=True,
    help="MoE family (llama.cpp architecture) to write.",
)
@count_option("--layers", SynthSpec.layers)
@count_option("--experts", SynthSpec.experts, None, low=2)
@count_option("--top-k", SynthSpec.top_k)
@count_option("--hidden", SynthSpec.hidden, None, low=32)
@count_option("--expert-ffn", SynthSpec.expert_ffn, None, low=32)
@count_option("--heads", SynthSpec.heads)
@count_option("--kv-heads", SynthSpec.kv_heads)
@count_option("--head-dim", SynthSpec.head_dim, None, low=2)
@count_option("--vocab", SynthSpec.vocab, None, low=262)
@click.option("--weight-type", type=click.Choice(WEIGHT_TYPES), default="F32", show_default=True)
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
    help="Dense leading blocks (deepseek2; default 1 when there are 2+ layers).",
)
@click.option(
    "--fused-gate-up",
    is_flag=True,
    default=False,
    help="Write ffn_gate_up_exps fused (deepseek2, mistral4, qwen3next, qwen35moe).",
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
@json_option
@quiet_option
@force_option
def synth_cmd(
    out: Path,
    trace_out: Path | None,
    arch: str,
    layers: int,
    experts: int,
    top_k: int,
    hidden: int,
    expert_ffn: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    weight_type: str,
    shared_experts: int | None,
    expert_groups: int | None,
    groups_used: int | None,
    dense_layers: int | None,
    fused_gate_up: bool,
    nextn_layers: int | None,
    routing_text: str | None,
    prompts_out: Path | None,
    n_prompts: int,
    prompt_tokens: int,
    seed: int,
    split_max_size: int,
    tokens: int,
    prefill: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a synthetic MoE checkpoint (qwen3moe, deepseek2, mistral4, qwen2moe, mixtral, gpt-oss,
    glm4moe, qwen3next, qwen35moe) that llama.cpp runs, optionally with planted routing, a routing trace and prompts."""
    spec = SynthSpec(
        layers,
        experts,
        top_k,
        hidden,
        expert_ffn,
        heads,
        kv_heads,
        head_dim,
        vocab,
        weight_type=weight_type,
        seed=seed,
        arch=arch,
        shared_experts=shared_experts,
        expert_groups=expert_groups,
        groups_used=groups_used,
        dense_layers=dense_layers,
        fused_gate_up=fused_gate_up,
        nextn_layers=nextn_layers,
        routing=RoutingSpec.parse(routing_text, top_k) if routing_text is not None else None,
    )
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
    )
    emit(result, as_json, _render_synth)
