"""CLI for the GGUF half: inspect, synth, plan, repack, verify, demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from .. import keys
from ..binding import shape_only_warning
from ..checkpoint.archs import arch_names
from ..checkpoint.inspect import InspectResult, inspect_model
from ..checkpoint.routing import RoutingSpec
from ..checkpoint.synth import WEIGHT_TYPES, SynthSpec
from ..demo import NO_LLAMA_ENV, DemoResult, run_demo
from ..errors import BadInput, VerificationFailed
from ..layout.coactivation_plan import PlanOutcome
from ..layout.plan import load_plan
from ..layout.plan_output import write_plan_files, write_searched_plan
from ..layout.planner import PlannerResult, SearchOptions
from ..planted.synth_with_trace import SynthPairResult, synth_model_with_trace
from ..rewrite.repack import RepackResult, repack
from ..rewrite.undo import undo as undo_repack
from ..rewrite.verify import VerifyResult, verify
from .hints import PLAN_HINTS, hints
from .options import (
    assume_options,
    block_map_option,
    cost_depth_option,
    count_option,
    json_option,
    merge_gap_option,
    n_expert_option,
    out_option,
    path_out,
    quiet_option,
    seed_option,
)
from .render import RichProgress, emit, human_bytes, stdout, table, warn


# ------------------------------------------------------------------ inspect
def _render_inspect(con: Console, r: InspectResult) -> None:
    shards = f" ({len(r.shards)} shards)" if len(r.shards) > 1 else ""
    con.print(f"[bold]{r.path}[/bold]{shards}")
    rows: list[list[Any]] = [
        ["architecture", r.architecture],
        ["GGUF version / alignment", f"{r.gguf_version} / {r.alignment}"],
        ["file size", f"{human_bytes(r.file_bytes)} ({r.file_bytes:,} B)"],
        ["tensors", r.n_tensors],
        ["blocks", f"{r.block_count} ({len(r.moe_blocks)} MoE, {len(r.dense_blocks)} dense)"],
    ]
    if r.not_run_blocks:
        rows.append(
            [
                "not run by llama.cpp",
                f"{'blocks' if len(r.not_run_blocks) > 1 else 'block'} "
                f"{', '.join(map(str, r.not_run_blocks))}: next-token prediction (MTP)",
            ]
        )
    rows += [
        ["experts / top-k", f"{r.n_expert if r.n_expert >= 0 else 'varies'} / {r.top_k}"],
    ]
    if r.expert_groups > 1:
        rows.append(
            [
                "routing groups",
                f"{r.expert_groups} groups, {r.expert_groups_used} chosen per token "
                f"(experts move only within a group or with their group)",
            ]
        )
    rows += [
        [
            "expert bytes",
            f"{human_bytes(r.expert_bytes)} = {100 * r.expert_share:.1f} % of the file",
        ],
        ["fingerprint", r.fingerprint],
    ]
    if r.provenance:
        blocks = r.provenance.get(keys.REPACK_BLOCKS, "")
        rows.append(
            [
                "repacked by moepack",
                f"from {r.provenance.get(keys.REPACK_ORIGINAL)}, blocks {blocks}",
            ]
        )
        if keys.REPACK_ORDER in r.provenance:
            fused = r.provenance.get(keys.REPACK_FUSED)
            was = r.provenance.get(keys.REPACK_ALIGNMENT)
            parts = [f"gate+up fused in blocks {fused}" if fused else "nothing fused"]
            if was is not None:
                parts.append(f"original alignment {was or 'default (32)'}")
            rows.append(["moepack layout", "; ".join(parts) + "; original tensor order recorded"])
    con.print(table(None, ["model", ""], rows))
    if not r.layers:
        con.print(
            "No MoE blocks found (no tensor has the expert count as its outermost dimension)."
        )
    else:
        lrows = []
        for layer in r.layers:
            lrows.append(
                [
                    layer.block if layer.runs else f"{layer.block} (not run)",
                    layer.n_expert,
                    layer.top_k,
                    "\n".join(f"{t.name.split('.', 2)[2]}" for t in layer.tensors),
                    "\n".join(f"{t.type}" for t in layer.tensors),
                    "\n".join(f"{t.bits_per_weight:.2f}" for t in layer.tensors),
                    "\n".join(human_bytes(t.slice_bytes) for t in layer.tensors),
                    human_bytes(layer.bytes_per_expert),
                ]
            )
        con.print(
            table(
                "MoE blocks",
                [
                    "block",
                    "experts",
                    "top-k",
                    "expert-axis tensors",
                    "type",
                    "bits/w",
                    "slice",
                    "bytes/expert",
                ],
                lrows,
                right={0, 1, 2, 5, 6, 7},
            )
        )
    rules = [(layer.block, c) for layer in r.layers for c in layer.constraints]
    if rules:
        con.print(
            table(
                "Expert order rules (llama.cpp reads expert indices here)",
                ["block", "rule", "group size", "groups move", "detail"],
                [
                    [
                        b,
                        c["kind"],
                        c["group_size"],
                        "yes" if c["movable"] else "no",
                        c["description"],
                    ]
                    for b, c in rules
                ],
                right={0, 2},
            )
        )
    if r.flagged:
        con.print(
            table(
                "Tensors left alone (reported, not guessed)",
                ["tensor", "role", "reason"],
                [[f.name, f.role, f.reason] for f in r.flagged],
            )
        )


@click.command("inspect")
@click.argument("model", type=path_out)
@assume_options
@json_option
def inspect_cmd(
    model: Path, assume_expert: tuple[str, ...], assume_not_expert: tuple[str, ...], as_json: bool
) -> None:
    """Where MODEL's expert bytes sit: per model and per MoE block (any shard of a split file)."""
    emit(inspect_model(model, assume_expert, assume_not_expert), as_json, _render_inspect)


# ------------------------------------------------------------------ repack
def _render_repack(con: Console, r: RepackResult) -> None:
    for o in r.outputs:
        con.print(f"wrote {o}")
    fused = f", {len(r.blocks_fused)} blocks fused" if r.blocks_fused else ""
    con.print(
        f"layout {r.layout} (alignment {r.alignment}): {len(r.blocks_permuted)} blocks "
        f"permuted{fused}, {r.tensors_permuted} tensors permuted, {r.tensors_copied} copied "
        f"byte for byte; {human_bytes(r.bytes_written)} in {r.seconds:.2f} s"
    )
    con.print(
        "permutation and layout recorded in the file's metadata"
        if r.provenance_recorded
        else "no provenance keys written"
    )
    for n in r.notes:
        con.print(n)


@click.command("repack")
@click.argument("model", type=path_out)
@click.option("--plan", "plan_path", type=path_out, help="Plan (.moeplan or .pmxplan).")
@click.option(
    "--undo",
    is_flag=True,
    help="Return a repacked MODEL to its original order (from its provenance).",
)
@click.option(
    "--layout",
    default=None,
    help="reorder, fused, pipeline, identity or a + combination (fused+reorder); "
    "default reorder with --plan. fused only where llama.cpp's loader takes ffn_gate_up_exps.",
)
@click.option(
    "--align",
    "alignment",
    type=click.IntRange(min=0),
    default=0,
    help="Start every tensor (and every slice whose size allows) on this power of two "
    "(general.alignment); default the model's own.",
)
@out_option("Output GGUF (split inputs give split outputs).")
@click.option(
    "--keep-header", is_flag=True, help="Keep the header byte-identical (records no provenance)."
)
@assume_options
@json_option
@quiet_option
def repack_cmd(
    model: Path,
    plan_path: Path | None,
    undo: bool,
    layout: str | None,
    alignment: int,
    out: Path,
    keep_header: bool,
    assume_expert: tuple[str, ...],
    assume_not_expert: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a drop-in copy of MODEL with experts reordered by a plan and/or laid out anew
    (fused gate+up, pipeline order, aligned), or undo such a copy from its provenance."""
    progress = RichProgress(not quiet and not as_json)
    if undo:
        if plan_path is not None or layout is not None or alignment:
            raise BadInput(
                "--undo takes no --plan, --layout or --align: the file says what to undo"
            )
        result = undo_repack(model, out, progress=progress)
        emit(result, as_json, _render_repack)
        return
    if plan_path is None and layout is None and not alignment:
        raise BadInput("give --plan PLAN, --layout LAYOUT, --align N, or --undo")
    plan = load_plan(plan_path) if plan_path is not None else None
    result = repack(
        model,
        plan,
        out,
        keep_header=keep_header,
        plan_path=plan_path,
        progress=progress,
        assume_expert=assume_expert,
        assume_not_expert=assume_not_expert,
        layout=layout,
        alignment=alignment,
    )
    warn(result.warnings)
    emit(result, as_json, _render_repack)


# ------------------------------------------------------------------ verify
_SOURCE = {
    "provenance": "from the file's provenance",
    "plan": "from the plan",
    "discovered": "discovered from the bytes",
    "identity": "none",
}


def _render_verify(con: Console, r: VerifyResult) -> None:
    d = r.difference
    if d is not None and d.what == "format":
        con.print(f"[bold red]VERIFICATION FAILED[/bold red] — {d.file}: {d.message}")
        return
    con.print(
        f"{r.tensors_compared} tensors compared, {r.tensors_identical} byte-identical, "
        f"{r.tensors_permuted} matched as permuted or fused ({len(r.blocks_permuted)} blocks; "
        f"permutation {_SOURCE.get(r.permutation_source, r.permutation_source)}); "
        f"{r.metadata_keys} metadata keys equal"
    )
    if r.blocks_fused or r.tensor_order != "original" or r.alignment:
        fused = f"gate+up fused in {len(r.blocks_fused)} blocks, " if r.blocks_fused else ""
        con.print(f"layout: {fused}tensor order {r.tensor_order}, alignment {r.alignment}")
    con.print(f"{human_bytes(r.bytes_compared)} compared in {r.seconds:.2f} s")
    if r.ok:
        con.print(
            "[bold green]OK[/bold green] — the repacked file holds exactly the original weights."
        )
    else:
        d = r.difference
        assert d is not None
        where = f" (offset {d.offset:,})" if d.offset is not None else ""
        con.print(f"[bold red]VERIFICATION FAILED[/bold red] — {d.file}: {d.message}{where}")


@click.command("verify")
@click.argument("original", type=path_out)
@click.argument("repacked", type=path_out)
@click.option("--plan", "plan_path", type=path_out, help="Check against this plan too.")
@assume_options
@json_option
@quiet_option
def verify_cmd(
    original: Path,
    repacked: Path,
    plan_path: Path | None,
    assume_expert: tuple[str, ...],
    assume_not_expert: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Account for every byte of REPACKED against ORIGINAL; exit 1 naming the first difference."""
    plan = load_plan(plan_path) if plan_path else None
    if plan is not None and plan.model_fingerprint is None:
        warn([shape_only_warning("plan", plan_path, original)])
    result = verify(
        original,
        repacked,
        plan,
        plan_path,
        progress=RichProgress(not quiet and not as_json),
        assume_expert=assume_expert,
        assume_not_expert=assume_not_expert,
    )
    emit(result, as_json, _render_verify)
    if not result.ok:
        d = result.difference
        assert d is not None
        raise VerificationFailed(d.message, d.file)


# ------------------------------------------------------------------ plan
def _render_plan(con: Console, r: PlanOutcome) -> None:
    rows = [
        [
            x.block,
            f"{x.requests_before:.2f}",
            f"{x.requests_after:.2f}",
            f"{x.speedup:.3f}x",
            "reorder" if x.changed else "leave alone",
        ]
        for x in r.layers
    ]
    con.print(
        table(
            f"Plan from {r.trace_tokens:,} tokens ({r.phase}): read requests per token",
            ["block", "before", "after", "fewer by", "verdict"],
            rows,
            right={0, 1, 2, 3},
        )
    )
    before, after = r.requests_before, r.requests_after
    con.print(
        f"all MoE blocks: {before:.2f} -> {after:.2f} requests per token ({before / after if after else 1:.3f}x)"
    )
    h = r.held_out
    if h is not None:
        part = (
            f"the {h['held_out_prompts']} held-out prompts"
            if h["by"] == "prompts"
            else f"held-out tokens {h['held_out_tokens'][0]}:{h['held_out_tokens'][1]}"
        )
        con.print(
            f"on {part}: {h['requests_before']:.2f} -> {h['requests_after']:.2f} requests per "
            f"token ({h['held_out_gain']:.3f}x; on the planning part {h['train_gain']:.3f}x, "
            f"gap {h['gap']:+.3f})"
        )


def _held_out_words(r: PlannerResult) -> str:
    h = r.held_out
    if h is not None and h.by == "prompts":
        return (
            f"trained on {h.train_prompts} prompts (tokens {r.train_tokens[0]}:"
            f"{r.train_tokens[1]}), judged on the {h.held_prompts} held-out prompts after them"
        )
    return (
        f"trained on tokens {r.train_tokens[0]}:{r.train_tokens[1]}, judged on "
        f"{r.held_tokens[0]}:{r.held_tokens[1]}"
    )


def _render_search(con: Console, r: PlannerResult) -> None:
    rows = [
        [
            b.block,
            b.candidate,
            f"{b.train_gain:.3f}x",
            f"{b.held_gain:.3f}x",
            b.left_alone or "reordered",
        ]
        for b in r.blocks
    ]
    con.print(
        table(
            f"plan (objective: {'modelled read time' if r.timed else 'requests'} at queue depth "
            f"{r.queue_depth}; {_held_out_words(r)})",
            ["block", "start", "train gain", "held-out gain", "outcome"],
            rows,
            right={2, 3},
        )
    )
    con.print(
        f"held-out gain {r.gain('held'):.3f}x (train {r.gain('train'):.3f}x, gap "
        f"{r.gain('train') - r.gain('held'):+.3f})"
    )
    for note in r.notes:
        con.print(f"note: {note}")


@click.command("plan")
@click.argument("model", type=path_out)
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=path_out,
    help="Routing trace (any supported format).",
)
@out_option("Plan to write (.moeplan, or .pmxplan for the peer).")
@n_expert_option("Expert count for text traces that lack one.")
@click.option(
    "--phase", type=click.Choice(["all", "prefill", "decode"]), default="all", show_default=True
)
@click.option(
    "--map",
    "map_path",
    type=path_out,
    default=None,
    help="Also draw a co-activation map (PNG): before and after the plan.",
)
@click.option(
    "--map-block", type=int, default=None, help="Block for --map (default: the most improved)."
)
@block_map_option
@click.option(
    "--keep-group-order",
    is_flag=True,
    help="In models with routing groups, reorder experts only within each group (by default "
    "whole groups are ordered too).",
)
@click.option(
    "--search",
    is_flag=True,
    help="Seriation + local search on the cost model's read time, judged on held-out tokens.",
)
@click.option(
    "--surface",
    "surface_path",
    type=path_out,
    default=None,
    help="With --search: bandwidth surface (the objective becomes read time).",
)
@click.option(
    "--holdout",
    type=float,
    default=None,
    help="Share of the tokens kept to judge the plan (the last whole prompts when the trace "
    "records several, else the last tokens); the plan is made on the rest. Default with "
    "--search: 0.25; without it, no tokens are held out.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="With --search: seed.")
@click.option(
    "--engine",
    default=None,
    help="With --search: the read engine the model will be served with (checked against the "
    "queue depth and the surface's engine).",
)
@cost_depth_option("With --search: reads in flight; the cost model times requests at this depth.")
@merge_gap_option("With --search: read through gaps of up to this many slices when cheaper.")
@json_option
def plan_cmd(
    model: Path,
    trace_path: Path,
    out: Path,
    n_expert: int | None,
    phase: str,
    map_path: Path | None,
    map_block: int | None,
    block_map: list[int] | None,
    keep_group_order: bool,
    search: bool,
    surface_path: Path | None,
    holdout: float | None,
    seed: int,
    engine: str | None,
    queue_depth: int,
    merge_gap: int,
    as_json: bool,
) -> None:
    """Order each MoE block's experts so that experts chosen together sit together."""
    if search:
        with hints(PLAN_HINTS):
            options = SearchOptions(
                queue_depth=queue_depth,
                engine=engine,
                merge_gap=merge_gap,
                holdout=0.25 if holdout is None else holdout,
                seed=seed,
                order_groups=not keep_group_order,
            )
            result = write_searched_plan(
                model,
                trace_path,
                out,
                options,
                surface_path=surface_path,
                n_expert=n_expert,
                block_map=block_map,
            )
        emit(result, as_json, _render_search)
        if not as_json:
            stdout.print(f"wrote {out}")
        return
    with hints(PLAN_HINTS):
        outcome = write_plan_files(
            model,
            trace_path,
            out,
            map_path=map_path,
            n_expert=n_expert,
            phase=phase,
            map_block=map_block,
            block_map=block_map,
            order_groups=not keep_group_order,
            holdout=holdout,
        )
    warn(outcome.warnings)
    emit(outcome, as_json, _render_plan)
    if not as_json:
        stdout.print(f"wrote {out}")
        if map_path is not None:
            stdout.print(f"wrote {map_path} (co-activation map of block {outcome.map_block})")


# ------------------------------------------------------------------ synth
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
    help="Shared experts per MoE block (deepseek2, qwen2moe; default 1).",
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
    help="Write ffn_gate_up_exps fused (deepseek2, mistral4).",
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
    type=click.Path(path_type=Path),
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
    glm4moe) that llama.cpp runs, optionally with planted routing, a routing trace and prompts."""
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


# ------------------------------------------------------------------ demo
def _demo_source_lines(con: Console, r: DemoResult) -> None:
    """Steps 1-3: where the model, the routing and the plan came from."""
    size = f"{human_bytes(r.model_bytes)}, qwen3moe"
    p = r.planning
    if r.held_out is None:
        con.print(
            f"[bold]1. synth[/bold]   {r.model} ({size}) and {r.trace} "
            f"(synthetic trace, {r.trace_tokens:,} tokens with planted clusters)"
        )
        con.print(
            f"[bold]2. plan[/bold]    {r.plan}: {p.requests_before:.2f} -> "
            f"{p.requests_after:.2f} read requests per token over {len(p.layers)} MoE blocks "
            "(on the synthetic trace it was made from)"
        )
        return
    h = r.held_out
    con.print(
        f"[bold]1. synth[/bold]   {r.model} ({size}, routing planted for llama.cpp) and "
        f"{r.prompt_count} prompts in {r.prompts}"
    )
    con.print(
        f"[bold]2. capture[/bold] {r.trace}: real llama.cpp routing of {r.trace_tokens:,} "
        f"tokens over {r.prompt_count} prompts, {r.capture_seconds:.1f} s"
    )
    con.print(
        f"[bold]3. plan[/bold]    {r.plan} from prompts 1-{h.split.train_prompts} "
        f"({h.split.train.tokens:,} tokens); on the {h.split.held_out_prompts} held-out "
        f"prompts ({h.split.held_out.tokens:,} tokens): {h.requests_before:.2f} -> "
        f"{h.requests_after:.2f} read requests per token over {len(p.layers)} MoE blocks"
    )


def _render_demo(con: Console, r: DemoResult) -> None:
    _demo_source_lines(con, r)
    n = 3 if r.held_out is None else 4
    rp = r.repacked
    con.print(
        f"[bold]{n}. repack[/bold]  {rp.outputs[0]}: {rp.tensors_permuted} tensors permuted, "
        f"{rp.tensors_copied} copied, {rp.seconds:.2f} s"
    )
    v = r.verified
    verdict = (
        "OK, every byte accounted for"
        if v.ok
        else f"FAILED: {v.difference.message if v.difference else ''}"
    )
    con.print(
        f"[bold]{n + 1}. verify[/bold]  {v.tensors_compared} tensors, "
        f"{human_bytes(v.bytes_compared)} compared: {verdict}"
    )
    if r.judge is not None and r.routing is not None:
        j, g = r.judge, r.routing
        con.print(
            f"[bold]{n + 2}. llama.cpp[/bold] same {j.tokens} tokens through both files: "
            f"max |Δlogit| {j.max_abs_diff:.2e}, argmax agrees on "
            f"{100 * j.argmax_agreement:.0f} %; routing of {g.tokens:,} tokens mapped back "
            f"through the permutation: {100 * g.same_set:.0f} % as sets, "
            f"{100 * g.same_order:.0f} % in order"
        )
    else:
        con.print(
            f"[dim]{n + 2}. llama.cpp not used (not installed, or --no-llama): the trace was "
            "synthetic and no llama.cpp judgement ran; ./dev test installs it[/dim]"
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


def register(cli: click.Group) -> None:
    """Add the GGUF commands to ``cli``."""
    for cmd in (demo_cmd, inspect_cmd, synth_cmd, plan_cmd, repack_cmd, verify_cmd):
        cli.add_command(cmd)
