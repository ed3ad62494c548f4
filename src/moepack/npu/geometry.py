"""The 35B's tensors: names, dtypes and shapes per layer kind, at full or scaled size.

Layers are *linear* (GatedDeltaNet) or *full* attention (every 4th: 3, 7, ..., 39). A tensor
is addressed by its *role* (``up_exps``, ``qkv``, ...) so that profiles are written once for
every layer; ``Geometry.name(role, layer)`` gives the file's name (singular ``model.layer.L.``
prefix, reference section 1).

``Geometry.full()`` is the real model (733 tensors, 673 ending in ``.weight``). The scaled
geometry keeps every formula's constants intact and only has fewer experts: 7, the smallest
count for which the v1.0.x pool's "down windows in groups of 8" divides evenly (7 x 655,360 B
= 968 whole 4,736-B windows). Attention and SSM tensors keep their full shapes because
profile constants (e.g. gate_proj's windows 224..1879) are tied to them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from ..blocklist import MAX_INDEX, format_index_list, parse_index_list
from ..errors import BadInput
from ..keys import GEOMETRY
from .codecs import Q4NX_TILE, Q8_0_TILE
from .q4nx import Q4nxFile, TensorSpec

FULL_EXPERTS = 256
SCALED_EXPERTS = 7
LAYER_RE = re.compile(r"^model\.layer\.(\d+)\.(.+)$")


class LayerKind(StrEnum):
    LINEAR = "linear"
    FULL = "full"


# role -> (suffix after "model.layer.L.", kinds)
ROLE_NAMES: dict[str, str] = {
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "moe_router": "moe_router.weight",
    "shared_expert_gate": "shared_expert_gate.weight",
    "up_exps": "mlp.up_exps_proj.weight",
    "gate_exps": "mlp.gate_exps_proj.weight",
    "down_exps": "mlp.down_exps_proj.weight",
    "share_up": "mlp.share_up_proj.weight",
    "share_gate": "mlp.share_gate_proj.weight",
    "share_down": "mlp.share_down_proj.weight",
    # linear attention (GatedDeltaNet)
    "qkv": "linear_attn.qkv_proj.weight",
    "ssm_out": "linear_attn.ssm_out.weight",
    "gate_proj": "self_attn.gate_proj.weight",
    "ssm_conv1d": "linear_attn.ssm_conv1d.weight",
    "ssm_norm": "linear_attn.ssm_norm.weight",
    "ssm_a": "linear_attn.ssm_a",
    "ssm_dt_bias": "linear_attn.ssm_dt.bias",
    "ssm_alpha": "linear_attn.ssm_alpha_proj.weight",
    "ssm_beta": "linear_attn.ssm_beta_proj.weight",
    # full attention
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
SHARED_EXPERT_ROLES = ("share_up", "share_gate", "share_down")
ATTENTION_PROJ_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_NORM_ROLES = ("q_norm", "k_norm")
COMMON_ROLES = (
    "input_layernorm",
    "post_attention_layernorm",
    "moe_router",
    "shared_expert_gate",
    "up_exps",
    "gate_exps",
    "down_exps",
    *SHARED_EXPERT_ROLES,
)
LINEAR_ROLES = COMMON_ROLES + (
    "qkv",
    "ssm_out",
    "gate_proj",
    "ssm_conv1d",
    "ssm_norm",
    "ssm_a",
    "ssm_dt_bias",
    "ssm_alpha",
    "ssm_beta",
)
FULL_ROLES = COMMON_ROLES + ATTENTION_PROJ_ROLES + ATTENTION_NORM_ROLES
GLOBAL_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@dataclass(frozen=True)
class TensorShape:
    """Expected dtype and shape of one role; tile tensors are I8 ``[a, H, S]``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def tile_size(self) -> int | None:
        if self.dtype == "I8" and len(self.shape) == 3 and self.shape[2] in (Q4NX_TILE, Q8_0_TILE):
            return self.shape[2]
        return None

    @property
    def n_tiles(self) -> int:
        return self.shape[0] * self.shape[1] if self.tile_size else 0

    @property
    def h(self) -> int:
        return self.shape[1] if self.tile_size else 0

    @property
    def nbytes(self) -> int:
        return TensorSpec("x", self.dtype, self.shape).nbytes

    def text(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Geometry:
    """Model dimensions; everything the profiles and ``synth`` need."""

    name: str
    n_layers: int = 40
    hidden: int = 2048
    n_experts: int = FULL_EXPERTS
    expert_ffn: int = 512
    shared_ffn: int = 512
    vocab: int = 248320
    full_attention_every: int = 4
    conv_dim: int = 8192  # qkv_proj out
    z_dim: int = 4096  # self_attn.gate_proj out, ssm_out in
    n_v_heads: int = 32  # ssm_a, ssm_dt.bias
    head_v_dim: int = 128  # ssm_norm
    conv_kernel: int = 4
    q_out: int = 8192  # q_proj (with gate)
    kv_out: int = 512
    attn_out_in: int = 4096  # o_proj in
    head_dim: int = 256  # q_norm, k_norm
    lm_head_rows: int = 7760  # lm_head [7760, 8, 8704] (implied shape)

    @staticmethod
    def full() -> Geometry:
        return Geometry("full")

    @staticmethod
    def scaled(n_experts: int = SCALED_EXPERTS) -> Geometry:
        if not 1 <= n_experts <= FULL_EXPERTS:
            raise BadInput(
                f"expert count {n_experts} is out of range: the model has {FULL_EXPERTS}, a "
                f"scaled geometry 1 to {FULL_EXPERTS}"
            )
        return Geometry(f"scaled-{n_experts}", n_experts=n_experts, vocab=1024, lm_head_rows=32)

    @staticmethod
    def named(name: object) -> Geometry:
        if name == "full":
            return Geometry.full()
        if name == "scaled":
            return Geometry.scaled()
        m = re.fullmatch(r"scaled-(\d{1,6})", name) if isinstance(name, str) else None
        if m:
            return Geometry.scaled(int(m.group(1)))
        shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:37] + "..."
        raise BadInput(f"unknown geometry {shown}; use 'full', 'scaled' or 'scaled-N'")

    def kind(self, layer: int) -> LayerKind:
        if (layer + 1) % self.full_attention_every == 0:
            return LayerKind.FULL
        return LayerKind.LINEAR

    def roles(self, kind: LayerKind) -> tuple[str, ...]:
        return LINEAR_ROLES if kind == LayerKind.LINEAR else FULL_ROLES

    @staticmethod
    def name_of(role: str, layer: int) -> str:
        return f"model.layer.{layer}.{ROLE_NAMES[role]}"

    def shape(self, role: str) -> TensorShape:
        h = self.hidden
        tiles_in = h // 256
        q8 = Q8_0_TILE
        table = {
            "input_layernorm": TensorShape("BF16", (h,)),
            "post_attention_layernorm": TensorShape("BF16", (h,)),
            "moe_router": TensorShape("BF16", (h, self.n_experts)),
            "shared_expert_gate": TensorShape("BF16", (h,)),
            "up_exps": TensorShape(
                "I8", (self.n_experts * self.expert_ffn // 32, tiles_in, Q4NX_TILE)
            ),
            "gate_exps": TensorShape(
                "I8", (self.n_experts * self.expert_ffn // 32, tiles_in, Q4NX_TILE)
            ),
            "down_exps": TensorShape(
                "I8", (self.n_experts * h // 32, self.expert_ffn // 256, Q4NX_TILE)
            ),
            "share_up": TensorShape("I8", (self.shared_ffn // 32, tiles_in, q8)),
            "share_gate": TensorShape("I8", (self.shared_ffn // 32, tiles_in, q8)),
            "share_down": TensorShape("I8", (h // 32, self.shared_ffn // 256, q8)),
            "qkv": TensorShape("I8", (self.conv_dim // 32, tiles_in, q8)),
            "ssm_out": TensorShape("I8", (h // 32, self.z_dim // 256, q8)),
            "gate_proj": TensorShape("I8", (self.z_dim // 32, tiles_in, q8)),
            "ssm_conv1d": TensorShape("BF16", (self.conv_kernel, self.conv_dim)),
            "ssm_norm": TensorShape("BF16", (self.head_v_dim,)),
            "ssm_a": TensorShape("F32", (self.n_v_heads,)),
            "ssm_dt_bias": TensorShape("F32", (self.n_v_heads,)),
            "ssm_alpha": TensorShape("BF16", (h, self.n_v_heads)),
            "ssm_beta": TensorShape("BF16", (h, self.n_v_heads)),
            "q_proj": TensorShape("I8", (self.q_out // 32, tiles_in, q8)),
            "k_proj": TensorShape("I8", (self.kv_out // 32, tiles_in, q8)),
            "v_proj": TensorShape("I8", (self.kv_out // 32, tiles_in, q8)),
            "o_proj": TensorShape("I8", (h // 32, self.attn_out_in // 256, q8)),
            "q_norm": TensorShape("BF16", (self.head_dim,)),
            "k_norm": TensorShape("BF16", (self.head_dim,)),
        }
        return table[role]

    def layer_specs(self, layer: int) -> list[TensorSpec]:
        kind = self.kind(layer)
        return [
            TensorSpec(self.name_of(r, layer), self.shape(r).dtype, self.shape(r).shape)
            for r in self.roles(kind)
        ]

    def global_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec("model.embed_tokens.weight", "BF16", (self.vocab, self.hidden)),
            TensorSpec("model.norm.weight", "BF16", (self.hidden,)),
            TensorSpec("lm_head.weight", "I8", (self.lm_head_rows, self.hidden // 256, Q8_0_TILE)),
        ]

    def model_specs(
        self, layers: list[int] | None = None, globals_: bool = True
    ) -> list[TensorSpec]:
        layers = list(range(self.n_layers)) if layers is None else layers
        specs = [s for layer in layers for s in self.layer_specs(layer)]
        return specs + (self.global_specs() if globals_ else [])


# How each tensor implies the expert count n: (role, dtype, shape with n as None, factor of n
# in its one n-dependent dimension). From the full geometry: up/gate [16n, 8, 5120],
# down [64n, 2, 5120], router [2048, n].
_EVIDENCE = (
    ("up_exps", "I8", (None, 8, Q4NX_TILE), 16),
    ("gate_exps", "I8", (None, 8, Q4NX_TILE), 16),
    ("down_exps", "I8", (None, 2, Q4NX_TILE), 64),
    ("moe_router", "BF16", (2048, None), 1),
)


def expert_votes(model: Q4nxFile) -> dict[int, list[str]]:
    """Expert count -> the tensors whose shape implies it (every layer's experts and router)."""
    votes: dict[int, list[str]] = {}
    for layer in model_layers(model):
        for role, dtype, pattern, factor in _EVIDENCE:
            name = Geometry.name_of(role, layer)
            e = model.entries.get(name)
            if e is None or e.dtype != dtype or len(e.shape) != len(pattern):
                continue
            if any(p is not None and d != p for d, p in zip(e.shape, pattern, strict=True)):
                continue
            dim = e.shape[pattern.index(None)]
            n, rest = divmod(dim, factor)
            if not rest and 1 <= n <= FULL_EXPERTS:
                votes.setdefault(n, []).append(name)
    return votes


def _some(names: list[str], k: int = 3) -> str:
    return ", ".join(repr(n) for n in names[:k]) + (
        f" and {len(names) - k} more" if len(names) > k else ""
    )


def detect(model: Q4nxFile) -> Geometry:
    """The model's geometry, from the shapes of every layer's expert and router tensors.

    The expert count most tensors agree on wins, so one malformed tensor is reported as the
    bad one (by ``check_tensors``) instead of making every other tensor look wrong. The
    ``moepack.geometry`` metadata (written by ``synth``) is only believed when it agrees.
    """
    layers = model_layers(model)
    if not layers:
        raise BadInput(
            "no 'model.layer.N.' tensors: not a Qwen3.6-35B-A3B .q4nx, or one that names its "
            "tensors otherwise (bind them: 'moepack npu inspect `write_names`', 'npu pack "
            "`names`')",
            model.path,
        )
    meta_name = model.metadata.get(GEOMETRY)
    meta = None
    if meta_name is not None:
        try:
            meta = Geometry.named(meta_name)
        except BadInput as e:
            raise BadInput(f"metadata '{GEOMETRY}': {e.message}", model.path) from None
    votes = expert_votes(model)
    if not votes:
        if meta is not None:
            return meta
        raise BadInput(
            f"cannot tell the model's size: no layer has {ROLE_NAMES['up_exps']!r} shaped "
            "I8[16*experts, 8, 5120] (nor gate/down experts or a router of a usable shape)",
            model.path,
        )
    ranked = sorted(votes.items(), key=lambda kv: -len(kv[1]))
    n, names = ranked[0]
    if len(ranked) > 1 and len(ranked[1][1]) == len(names):
        raise BadInput(
            "cannot tell the expert count: "
            + "; ".join(f"{k} by {_some(v)}" for k, v in ranked[:3]),
            model.path,
        )
    if meta is not None:
        if meta.n_experts != n:
            raise BadInput(
                f"metadata '{GEOMETRY}' says {meta.name} ({meta.n_experts} experts), but "
                f"the tensors say {n} experts ({_some(names)})",
                model.path,
            )
        return meta
    return Geometry.full() if n == FULL_EXPERTS else Geometry.scaled(n)


def model_layers(model: Q4nxFile) -> list[int]:
    found = set()
    for name in model.entries:
        m = LAYER_RE.match(name)
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def parse_layers(
    spec: str | Sequence[int] | None, available: list[int] | None = None, limit: int = 40
) -> list[int]:
    """``"0-39"``, ``"3,7,10-12"`` (or those numbers, already parsed) -> sorted unique layer
    numbers, checked against the file's layers (``available``) or, without a file, ``limit``."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "all")):
        if available is None:
            return list(range(limit))
        return list(available)
    cap = limit if available is None else max(MAX_INDEX, limit)
    if isinstance(spec, str):
        layers = parse_index_list(spec, "layer", limit=cap, unique=True)
    else:
        layers = sorted(set(int(x) for x in spec))
        if layers and (layers[0] < 0 or layers[-1] >= cap):
            bad = layers[0] if layers[0] < 0 else layers[-1]
            raise BadInput(f"layer {bad} is out of range (the model has {limit} layers)")
    if available is not None:
        have_set = set(available)
        missing = [x for x in layers if x not in have_set]
        if missing:
            have = format_index_list(available)
            raise BadInput(
                f"layer(s) {format_index_list(missing)} not in the model (it has layers {have})"
            )
    return layers


MAX_NAMED = 24


def tensor_problems(model: Q4nxFile, geo: Geometry, layer: int, roles: Iterable[str]) -> list[str]:
    """Every role that is missing or has another dtype/shape than the geometry expects."""
    problems = []
    for role in roles:
        name = geo.name_of(role, layer)
        want = geo.shape(role)
        e = model.entries.get(name)
        if e is None:
            problems.append(f"tensor {name!r} is missing (expected {want.text()})")
        elif e.dtype != want.dtype or tuple(e.shape) != want.shape:
            problems.append(f"tensor {name!r} is {e.spec()}, expected {want.text()}")
    return problems


def check_layers(model: Q4nxFile, geo: Geometry, roles_by_layer: dict[int, list[str]]) -> None:
    """Every role of every layer exists with the expected dtype and shape; one error that
    names every problem tensor (up to ``MAX_NAMED`` of them, then how many more)."""
    problems = [
        p
        for layer, roles in roles_by_layer.items()
        for p in tensor_problems(model, geo, layer, roles)
    ]
    if not problems:
        return
    text = "; ".join(problems[:MAX_NAMED])
    if len(problems) > MAX_NAMED:
        text += f"; and {len(problems) - MAX_NAMED} more"
    if len(problems) > 1:
        text = f"{len(problems)} tensor problems: {text}"
    if any("is missing" in p for p in problems):
        text += (
            " (tensor-name suffixes are moepack's reading of ref §1; see 'moepack npu map', "
            "and 'moepack npu inspect' to bind the file's own names)"
        )
    raise BadInput(text, model.path)


def check_tensors(model: Q4nxFile, geo: Geometry, layer: int, roles: list[str]) -> None:
    """Every role a profile needs exists with the expected dtype and shape (names them all)."""
    check_layers(model, geo, {layer: roles})
