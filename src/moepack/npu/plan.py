"""Compile a profile's placements for one layer into gather segments.

A segment is a contiguous run of the destination buffer made of equal *granules* of ``g``
bytes whose source byte offsets are all congruent to ``r`` modulo ``g``: the source can then
be viewed as rows ``file[r:].reshape(-1, g)`` and the whole segment is one ``np.take`` into
the buffer. Granules are 512-B chunks for pair-interleaved tiles, whole units otherwise; a
granule is split (down to 16 B) when tensors start at offsets that break the congruence, and
only if even that fails does a segment fall back to fancy indexing over a byte-offset view.
Adjacent segments from different placements merge, so a whole 533 MB weight buffer is
typically a handful of ``np.take`` calls over ~1 M indices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BadInput
from .geometry import Geometry, LayerKind, TensorShape
from .profile import CHUNK, BufferSpec, LayerLayout, LayoutProfile, Placement

if TYPE_CHECKING:
    from .q4nx import Q4nxFile

MIN_GRANULE = 16


@dataclass(frozen=True)
class TensorRef:
    """Where a placement's tensor lives in the source byte space."""

    role: str
    name: str
    start: int
    nbytes: int
    shape: TensorShape


@dataclass
class Segment:
    dst: int
    g: int
    r: int
    src: np.ndarray  # take: row indices of file[r:].reshape(-1, g); bytes: absolute offsets
    mode: str  # "take" | "bytes"

    @property
    def n(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> int:
        return len(self.src) * self.g

    def src_abs(self) -> np.ndarray:
        return self.src * self.g + self.r if self.mode == "take" else self.src


@dataclass
class BufferPlan:
    spec: BufferSpec
    refs: list[TensorRef]  # one per placement, same order
    segments: list[Segment]
    pieces: np.ndarray  # [k, 3] (dst_start, dst_end, placement index), sorted
    base: int = 0  # segments' source offsets are relative to this source byte
    src_end: int = 0  # end of the last source byte read, relative to ``base``

    @cached_property
    def segment_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        starts = np.array([s.dst for s in self.segments], dtype=np.int64)
        ends = np.array([s.dst + s.nbytes for s in self.segments], dtype=np.int64)
        return starts, ends

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.spec.placements

    def placement_at(self, offset: int) -> int | None:
        """Index of the placement covering buffer ``offset`` (None in a gap)."""
        i = int(np.searchsorted(self.pieces[:, 0], offset, side="right")) - 1
        if i >= 0 and offset < self.pieces[i, 1]:
            return int(self.pieces[i, 2])
        return None

    @cached_property
    def _gap_array(self) -> np.ndarray:
        return np.array(self.gaps(), dtype=np.int64).reshape(-1, 2)

    def gaps_between(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The gaps clipped to ``[lo, hi)``."""
        g = self._gap_array
        i0 = int(np.searchsorted(g[:, 1], lo, side="right"))
        i1 = int(np.searchsorted(g[:, 0], hi, side="left"))
        return [(max(lo, s), min(hi, e)) for s, e in g[i0:i1].tolist()]

    def gaps(self) -> list[tuple[int, int]]:
        """Byte ranges no placement covers (zero in the packed buffer)."""
        out, at = [], 0
        for s, e in self.pieces[:, :2].tolist():
            if s > at:
                out.append((at, s))
            at = max(at, e)
        if at < self.size:
            out.append((at, self.size))
        return out


@dataclass
class LayerPackPlan:
    profile: str
    layer: int
    kind: LayerKind
    layout: LayerLayout
    buffers: list[BufferPlan]
    tensors: dict[str, TensorRef] = field(default_factory=dict)

    def buffer(self, name: str) -> BufferPlan:
        for b in self.buffers:
            if b.name == name:
                return b
        names = ", ".join(b.name for b in self.buffers)
        raise BadInput(
            f"profile {self.profile} has no buffer {name!r} for a {self.kind.value} "
            f"layer (it has: {names})"
        )

    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.buffers)


def _divisors_desc(g: int) -> list[int]:
    return sorted(
        {d for i in range(1, int(g**0.5) + 1) if g % i == 0 for d in (i, g // i)}, reverse=True
    )


def _granules(p: Placement, start: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(dst offsets, absolute src offsets, granule size) lists for one placement."""
    dst_u = p.dst_offsets()
    src_u = start + p.src_offsets()
    if p.scheme == "pair512":
        c = np.arange(p.unit_size // CHUNK, dtype=np.int64)
        a_dst = dst_u[0::2]
        dst = a_dst[:, None, None] + CHUNK * (2 * c[None, :, None] + np.arange(2)[None, None, :])
        src = np.stack([src_u[0::2], src_u[1::2]], axis=-1)[:, None, :] + CHUNK * c[None, :, None]
        return [(dst.ravel(), src.ravel(), CHUNK)]
    if p.length is not None and p.length < p.count * p.unit_size:
        full, tail = divmod(p.length, p.unit_size)
        out = [(dst_u[:full], src_u[:full], p.unit_size)]
        if tail:
            out.append((dst_u[full : full + 1], src_u[full : full + 1], tail))
        return out
    return [(dst_u, src_u, p.unit_size)]


def _choose(src: np.ndarray, g: int) -> tuple[int, str]:
    if len(src) == 0:
        return g, "take"
    for d in _divisors_desc(g):
        if d < MIN_GRANULE and d != g:
            break
        if np.all(src % d == src[0] % d):
            return d, "take"
    return g, "bytes"


def _pieces(dst: np.ndarray, src: np.ndarray, g: int, pidx: int) -> list[tuple]:
    """Split granules into contiguous-destination pieces, each in take- or bytes-mode."""
    if len(dst) == 0:
        return []
    d, mode = _choose(src, g)
    if d != g:
        k = g // d
        dst = (dst[:, None] + d * np.arange(k)).ravel()
        src = (src[:, None] + d * np.arange(k)).ravel()
    breaks = np.flatnonzero(np.diff(dst) != d) + 1
    out = []
    for ds, ss in zip(np.split(dst, breaks), np.split(src, breaks), strict=True):
        if mode == "take":
            r = int(ss[0] % d)
            out.append((int(ds[0]), d, r, (ss - r) // d, mode, pidx))
        else:
            out.append((int(ds[0]), d, 0, ss, mode, pidx))
    return out


def compile_buffer(spec: BufferSpec, refs: list[TensorRef], source_size: int | None) -> BufferPlan:
    """Segments for one buffer; ``source_size=None`` skips the bounds check (the caller
    checks ``src_end`` against each source it uses the plan with)."""
    raw: list[tuple] = []
    src_end = 0
    for i, (p, ref) in enumerate(zip(spec.placements, refs, strict=True)):
        _check_source(p, ref, spec)
        for dst, src, g in _granules(p, ref.start):
            if not len(src):
                continue
            if src.min() < 0 or (source_size is not None and src.max() + g > source_size):
                raise BadInput(f"{ref.name}: placement reads past the source ({source_size:,} B)")
            src_end = max(src_end, int(src.max()) + g)
            raw.extend(_pieces(dst, src, g, i))
    raw.sort(key=lambda t: t[0])
    pieces = np.array([(t[0], t[0] + len(t[3]) * t[1], t[5]) for t in raw], dtype=np.int64).reshape(
        -1, 3
    )
    if len(pieces):
        if pieces[0, 0] < 0 or pieces[-1, 1] > spec.size:
            raise ValueError(f"{spec.name}: a placement falls outside the {spec.size:,}-B buffer")
        bad = np.flatnonzero(pieces[1:, 0] < pieces[:-1, 1])
        if len(bad):
            a, b = pieces[bad[0]], pieces[bad[0] + 1]
            pa, pb = spec.placements[a[2]].role, spec.placements[b[2]].role
            raise ValueError(f"{spec.name}: placements of {pa} and {pb} overlap at {b[0]:#x}")
    segments: list[Segment] = []
    group: list[tuple] = []

    def flush() -> None:
        if group:
            d0, g, r, _, mode, _ = group[0]
            src = np.concatenate([t[3] for t in group]) if len(group) > 1 else group[0][3]
            segments.append(Segment(d0, g, r, src, mode))
            group.clear()

    end = -1
    for t in raw:
        if group and t[0] == end and (t[1], t[2], t[4]) == (group[0][1], group[0][2], group[0][4]):
            group.append(t)
        else:
            flush()
            group.append(t)
        end = t[0] + len(t[3]) * t[1]
    flush()
    return BufferPlan(spec, refs, segments, pieces, 0, src_end)


def _check_source(p: Placement, ref: TensorRef, spec: BufferSpec) -> None:
    if p.count == 0:
        return
    hi = int(p.order.max()) * p.src_pitch + p.src_origin + p.unit_size
    if p.length is not None and p.length < p.count * p.unit_size:
        last = p.length - (p.count - 1) * p.unit_size
        hi = max(
            int(p.order[:-1].max(initial=0)) * p.src_pitch + p.src_origin + p.unit_size,
            int(p.order[-1]) * p.src_pitch + p.src_origin + last,
        )
    if int(p.order.min()) < 0 or p.src_origin < 0 or hi > ref.nbytes:
        raise BadInput(
            f"{spec.name}: placement of {ref.name} needs bytes up to {hi:,}, the tensor has "
            f"{ref.nbytes:,}"
        )


# Compiled buffers, keyed by profile layout and the layer's tensor layout *relative to its
# first tensor*: every layer of a kind in a file shares one (the tensors of a layer sit in
# the same order and sizes), so a 40-layer pack compiles two plans, not forty.
_COMPILED: OrderedDict[tuple, tuple[LayerLayout, list[BufferPlan]]] = OrderedDict()
COMPILED_KEEP = 4


def clear_compiled() -> None:
    """Forget compiled plans (and every profile's built layouts): a fresh process's state,
    for benchmarks that time what a single ``pack`` run pays."""
    from .profiles import all_profiles

    _COMPILED.clear()
    for prof in all_profiles():
        prof.clear_cache()


def compile_layer(
    profile: LayoutProfile,
    geo: Geometry,
    layer: int,
    tensors: dict[str, TensorRef],
    source_size: int,
) -> LayerPackPlan:
    """Compile every buffer of ``layer``; ``tensors`` maps role -> where it is in the source."""
    kind = geo.kind(layer)
    lay = profile.layout(geo, kind)
    used = list(dict.fromkeys(p.role for b in lay.buffers for p in b.placements))
    base = min((tensors[r].start for r in used), default=0)
    shape = tuple((r, tensors[r].start - base, tensors[r].nbytes) for r in used)
    key = (profile.name, id(lay), shape)
    hit = _COMPILED.get(key)
    if hit is None:
        rel = {r: replace(tensors[r], start=tensors[r].start - base) for r in used}
        compiled = [
            compile_buffer(spec, [rel[p.role] for p in spec.placements], None)
            for spec in lay.buffers
        ]
        _COMPILED[key] = (lay, compiled)  # the layout is kept so that its id stays unique
        while len(_COMPILED) > COMPILED_KEEP:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
        compiled = hit[1]
    buffers = []
    for spec, cb in zip(lay.buffers, compiled, strict=True):
        refs = [tensors[p.role] for p in spec.placements]
        if base + cb.src_end > source_size:
            name = refs[0].name if refs else spec.name
            raise BadInput(f"{name}: placement reads past the source ({source_size:,} B)")
        buffers.append(BufferPlan(spec, refs, cb.segments, cb.pieces, base, cb.src_end))
    return LayerPackPlan(profile.name, layer, kind, lay, buffers, tensors)


def model_refs(
    model: Q4nxFile, geo: Geometry, layer: int, roles: list[str]
) -> dict[str, TensorRef]:
    """TensorRefs for a layer's roles in an open ``Q4nxFile`` (absolute file offsets)."""
    out = {}
    for role in roles:
        name = geo.name_of(role, layer)
        e = model.entry(name)
        out[role] = TensorRef(role, name, model.data_start + e.begin, e.nbytes, geo.shape(role))
    return out


def retained_intervals(p: Placement) -> np.ndarray:
    """[k, 2] tensor byte ranges a placement keeps (may overlap, unsorted)."""
    s = p.src_offsets()
    e = s + p.unit_size
    if p.length is not None and p.length < p.count * p.unit_size:
        full, tail = divmod(p.length, p.unit_size)
        s, e = s[: full + (1 if tail else 0)].copy(), e[: full + (1 if tail else 0)].copy()
        if tail:
            e[-1] = s[-1] + tail
    return np.stack([s, e], axis=1)


def merge_intervals(iv: np.ndarray) -> np.ndarray:
    """Sorted, disjoint union of [start, end) intervals."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    run_end = np.maximum.accumulate(iv[:, 1])
    new = np.concatenate([[True], iv[1:, 0] > run_end[:-1]])
    starts = iv[new, 0]
    idx = np.flatnonzero(new)
    ends = run_end[np.concatenate([idx[1:] - 1, [len(iv) - 1]])]
    return np.stack([starts, ends], axis=1)


def retained_by_role(placements: Iterable[Placement]) -> dict[str, np.ndarray]:
    """Per role: the sorted, disjoint tensor byte ranges some placement keeps."""
    per: dict[str, list[np.ndarray]] = {}
    for p in placements:
        per.setdefault(p.role, []).append(retained_intervals(p))
    return {role: merge_intervals(np.concatenate(ivs)) for role, ivs in per.items()}
