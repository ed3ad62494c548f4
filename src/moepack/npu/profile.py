"""``LayoutProfile``: how one runtime version lays a layer's tensors into device buffers.

A profile is data. For a geometry and layer kind it returns buffers; each buffer is a list of
``Placement``s: *which* source units of *which* tensor go *where*, in *what order*, with
*which* interleave — plus where each fact came from (``Provenance``). The shared packer
(``plan`` + ``packer``) turns placements into index arrays; nothing in a profile moves bytes.

Unit kinds (how a placement cuts its source tensor):

* ``tile``    whole tiles, ``unit_size == src_pitch`` (5,120 or 8,704 B)
* ``trim``    the first ``unit_size`` bytes of each tile (the seed's ``tile[0:4736]``)
* ``window``  raw 4,736-B windows ``x[4736j : 4736(j+1)]`` (the v1.0.x runtime)
* ``element`` 2-byte elements (used for the router's transpose)
* ``bytes``   the whole tensor, copied as is

Schemes: ``pair512`` (consecutive units A, B split into 512-B chunks and interleaved:
``out[1024c + 512s + t] = tile_s[512c + t]``) or ``none``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from ..errors import BadInput
from .geometry import Geometry, LayerKind


class Status(StrEnum):
    """How much a fact is worth, strongest first."""

    VERIFIED = "verified"  # byte-checked against a vendor dump or the runtime's own function
    REPORTED = "reported"  # from read patterns / descriptors in the notes; no byte oracle
    CLAIMED = "claimed"  # its source says verified; later notes dispute it
    INFERRED = "inferred"  # this project's inference (extrapolated, assumed unchanged)
    UNVERIFIED = "unverified"  # the source gives no layout; an assumption placed to fill the gap

    @property
    def rank(self) -> int:
        return list(Status).index(self)


STATUS_HELP = {
    Status.VERIFIED: "byte-checked against a vendor dump or the runtime's own function",
    Status.REPORTED: "reported by the notes (read pattern, descriptors); no byte oracle",
    Status.CLAIMED: "claimed by its source, disputed by later notes",
    Status.INFERRED: "this project's inference (extrapolated or assumed unchanged)",
    Status.UNVERIFIED: "the source gives no layout: an assumption, not a known fact",
}

UNIT_KINDS = ("tile", "trim", "window", "element", "bytes")
SCHEMES = ("none", "pair512")
CHUNK = 512


@dataclass(frozen=True)
class Provenance:
    status: Status
    source: str  # short citation: "ref §4 vendor dump, 0 mismatches"
    note: str = ""


# Where the tensor names (geometry.ROLE_NAMES) come from: every placement is only as good
# as the name that finds its tensor in a real file.
TENSOR_NAMES = Provenance(
    Status.UNVERIFIED,
    "ref §1: the 'model.layer.L.' prefix and short names (ssm_a, ssm_dt.bias, ssm_conv1d, "
    "qkv_proj, shared_expert_gate, moe_router, up/gate/down experts, share_up/gate/down)",
    "the full suffixes (e.g. 'mlp.up_exps_proj.weight', 'linear_attn.qkv_proj.weight') are "
    "moepack's guess, chosen to keep the alphabetical order the notes describe; a real file "
    "may spell them differently (then pack reports the tensors as missing)",
)


@dataclass(frozen=True, eq=False)
class Placement:
    """Output units ``k = 0..n-1`` of one source tensor, laid into a buffer.

    Unit ``k`` reads tensor bytes ``[src_origin + order[k]*src_pitch, + unit_size)`` and lands
    at ``offset + (k // run) * (run*unit_size + gap) + (k % run) * unit_size``. ``length``
    (if set) cuts the placement short, mid-unit if need be.
    """

    buffer: str
    offset: int
    role: str
    unit: str
    unit_size: int
    src_pitch: int
    order: np.ndarray
    rule: str
    provenance: Provenance
    scheme: str = "none"
    run: int = 0
    gap: int = 0
    length: int | None = None
    src_origin: int = 0
    region: str = ""

    def __post_init__(self) -> None:
        order = np.ascontiguousarray(self.order, dtype=np.int64)
        order.setflags(write=False)
        object.__setattr__(self, "order", order)
        if self.run == 0:
            object.__setattr__(self, "run", max(len(order), 1))
        if self.unit not in UNIT_KINDS:
            raise ValueError(f"unknown unit kind {self.unit!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}")
        if self.scheme == "pair512" and (self.unit_size % CHUNK or len(order) % 2 or self.run % 2):
            raise ValueError("pair512 needs whole 512-B chunks and whole pairs per run")

    @property
    def count(self) -> int:
        return len(self.order)

    @property
    def nbytes(self) -> int:
        full = self.count * self.unit_size
        return full if self.length is None else min(self.length, full)

    @property
    def run_pitch(self) -> int:
        return self.run * self.unit_size + self.gap

    @property
    def extent(self) -> int:
        """Bytes from ``offset`` to the end of the last unit (runs and gaps included)."""
        if self.count == 0:
            return 0
        n_runs = -(-self.count // self.run)
        last = self.count - (n_runs - 1) * self.run
        full = (n_runs - 1) * self.run_pitch + last * self.unit_size
        if self.length is not None and self.length < self.count * self.unit_size:
            # length only cuts contiguous placements (checked by the plan compiler)
            return self.length
        return full

    @property
    def status(self) -> Status:
        return self.provenance.status

    def dst_offsets(self) -> np.ndarray:
        """Buffer offset of each unit."""
        k = np.arange(self.count, dtype=np.int64)
        return self.offset + (k // self.run) * self.run_pitch + (k % self.run) * self.unit_size

    def src_offsets(self) -> np.ndarray:
        """Tensor byte offset of each unit."""
        return self.src_origin + self.order * self.src_pitch

    def unit_name(self) -> str:
        return {"tile": "tiles", "trim": "trimmed tiles", "window": "windows"}.get(
            self.unit, self.unit + "s" if self.unit == "element" else "bytes"
        )

    def describe_units(self) -> str:
        if self.unit == "bytes":
            return f"{self.nbytes:,} B"
        return f"{self.count:,} {self.unit_name()} of {self.unit_size:,} B"

    def locate(self, pos: int) -> tuple[int, int]:
        """For a byte at ``offset + pos`` (inside this placement): (unit k, byte in unit)."""
        run_i, in_run = divmod(pos, self.run_pitch)
        if in_run >= self.run * self.unit_size:
            raise ValueError("position falls in a gap between runs")
        if self.scheme == "pair512":
            pair, in_pair = divmod(in_run, 2 * self.unit_size)
            c, rest = divmod(in_pair, 2 * CHUNK)
            s, t = divmod(rest, CHUNK)
            return run_i * self.run + 2 * pair + s, c * CHUNK + t
        k, b = divmod(in_run, self.unit_size)
        return run_i * self.run + k, b

    def digest_into(self, h: hashlib._Hash) -> None:
        h.update(
            repr(
                (
                    self.buffer,
                    self.offset,
                    self.role,
                    self.unit,
                    self.unit_size,
                    self.src_pitch,
                    self.scheme,
                    self.run,
                    self.gap,
                    self.length,
                    self.src_origin,
                )
            ).encode()
        )
        h.update(self.order.tobytes())


@dataclass(frozen=True)
class ZeroFill:
    """A documented stretch of zero bytes (anything unplaced is zero too, but unexplained)."""

    offset: int
    size: int
    provenance: Provenance
    what: str = "zero"


@dataclass(frozen=True)
class BufferSpec:
    """One device buffer of a layer."""

    name: str
    size: int
    arg: int | None
    placements: tuple[Placement, ...]
    size_provenance: Provenance
    zero: tuple[ZeroFill, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LayerLayout:
    """What a profile says about one layer kind."""

    kind: LayerKind
    buffers: tuple[BufferSpec, ...]
    unplaced: dict[str, str] = field(default_factory=dict)  # role -> why
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def roles(self) -> list[str]:
        seen: dict[str, None] = {}
        for b in self.buffers:
            for p in b.placements:
                seen.setdefault(p.role, None)
        return list(seen)

    def digest(self, buffer: str | None = None) -> str:
        """sha256 of the buffers' placements (all, or one buffer's); computed once."""
        key = ("digest", buffer)
        if key not in self._memo:
            self._memo[key] = self._digest(buffer)
        return self._memo[key]

    def _digest(self, buffer: str | None) -> str:
        h = hashlib.sha256()
        for b in self.buffers:
            if buffer is not None and b.name != buffer:
                continue
            h.update(repr((b.name, b.size)).encode())
            for p in b.placements:
                p.digest_into(h)
        return h.hexdigest()


Builder = Callable[[Geometry, LayerKind], LayerLayout]


@dataclass(frozen=True, eq=False)
class LayoutProfile:
    """A named runtime layout. ``layout(geo, kind)`` builds (and caches) its buffers."""

    name: str
    runtime: str
    summary: str
    provenance: Provenance
    build: Builder
    aliases: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict, repr=False)

    def clear_cache(self) -> None:
        self._cache.clear()

    def layout(self, geo: Geometry, kind: LayerKind) -> LayerLayout:
        """The profile's buffers for one layer kind; ``BadInput`` if its formulas do not
        apply to this geometry (e.g. v1.0.x's down windows in groups of 8 with 1 expert)."""
        key = (geo, kind)
        if key not in self._cache:
            try:
                self._cache[key] = self.build(geo, kind)
            except ValueError as e:
                raise BadInput(
                    f"profile {self.name} cannot lay out a {kind.value}-attention layer of "
                    f"geometry {geo.name}: {e}"
                ) from None
        return self._cache[key]
