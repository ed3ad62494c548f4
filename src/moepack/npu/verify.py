"""Compare a captured device buffer with what a profile produces for the same layer.

The packed buffer is built in memory, the dump is mapped, and both are compared in bounded
chunks. The report gives the match percentage overall and per placement, and the first
mismatching runs named by buffer offset -> tensor, unit (tile / window), 512-B chunk and
byte. ``auto`` tries every profile whose buffer has the dump's size and ranks them.
``locate`` searches the model for where a mismatching unit's bytes really came from — e.g.
the seed's row 0 that straddles share_up's 824-B tail and up_exps' first 3,912 B.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BadInput
from ..inputs import regular_file
from ..pages import mapped_releaser
from ..progress import NULL_PROGRESS, ProgressSink
from .gather import Release
from .geometry import detect, model_layers, tensor_problems
from .packer import layer_plan, pack_buffer
from .plan import BufferPlan
from .profile import CHUNK, Status
from .profiles import all_profiles, get_profile
from .q4nx import Q4nxFile

COMPARE_STEP = 8 * 1024 * 1024
NEEDLE = 64


@dataclass
class SourceRef:
    """Where a buffer byte comes from under a profile."""

    tensor: str
    role: str
    region: str
    unit: str  # tile | trim | window | element | bytes
    unit_index: int
    byte_in_unit: int
    tensor_offset: int
    tile: int | None
    chunk: int | None
    byte_in_chunk: int | None
    status: str

    def text(self) -> str:
        parts = [self.tensor]
        if self.unit == "window":
            parts.append(f"window {self.unit_index}")
        if self.tile is not None:
            parts.append(f"tile {self.tile}")
            parts.append(f"chunk {self.chunk} (+{self.byte_in_chunk})")
        elif self.unit == "element":
            parts.append(f"element {self.unit_index}")
        else:
            parts.append(f"byte {self.tensor_offset:,}")
        return ", ".join(parts)


@dataclass
class Located:
    """Where a dump unit's bytes were found in the model file."""

    buffer_offset: int
    length: int
    file_offset: int | None
    matching: int  # bytes of the unit that equal the file from file_offset on
    pieces: list[str] = field(default_factory=list)  # "tensor[a:b] (n B)"
    note: str = ""

    def text(self) -> str:
        if self.file_offset is None:
            return self.note or "not found in the layer's tensors"
        return f"{' + '.join(self.pieces)} ({self.matching:,}/{self.length:,} B match)"


@dataclass
class Mismatch:
    """The first differing byte of a unit (a 512-B chunk for pair-interleaved tiles)."""

    offset: int
    unit_start: int
    unit_length: int
    differing: int  # bytes of that unit that differ
    expected: int
    got: int
    source: SourceRef | None
    zone: str  # placement region or "zero"
    located: Located | None = None


@dataclass
class PlacementScore:
    region: str
    tensor: str
    offset: int
    nbytes: int
    matching: int
    status: str

    @property
    def percent(self) -> float:
        return 100.0 * self.matching / self.nbytes if self.nbytes else 100.0


@dataclass(kw_only=True)
class ProfileScore:
    """One profile's verdict. When the dump's size differs from a buffer size the profile
    only infers, the overlap is compared (``compared`` bytes) and placed bytes past the
    dump's end count as ``missing``; the verdict covers ``judged = compared + missing``."""

    profile: str
    size: int | None
    comparable: bool
    reason: str = ""
    matching: int = 0
    placements: list[PlacementScore] = field(default_factory=list)
    zero_bytes: int = 0
    zero_matching: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    size_status: str = ""
    compared: int = 0
    missing: int = 0  # placed bytes past the end of a shorter dump
    extra: int = 0  # dump bytes past the end of the profile's buffer (not judged)
    extra_nonzero: int = 0

    @property
    def judged(self) -> int:
        return self.compared + self.missing

    @property
    def percent(self) -> float:
        return 100.0 * self.matching / self.judged if self.comparable and self.judged else 0.0

    @property
    def size_differs(self) -> bool:
        return self.comparable and self.compared != self.size or self.extra > 0


@dataclass
class DumpVerifyResult:
    dump: str
    dump_size: int
    model: str
    layer: int
    kind: str
    buffer: str
    scores: list[ProfileScore]

    @property
    def best(self) -> ProfileScore:
        return self.scores[0]

    @property
    def match(self) -> bool:
        return self.best.comparable and self.best.matching == self.best.judged


def source_of(bp: BufferPlan, offset: int) -> SourceRef | None:
    i = bp.placement_at(offset)
    if i is None:
        return None
    p, ref = bp.placements[i], bp.refs[i]
    k, b = p.locate(offset - p.offset)
    toff = p.src_origin + int(p.order[k]) * p.src_pitch + b
    tile = chunk = in_chunk = None
    ts = ref.shape.tile_size
    if ts and p.unit != "bytes":
        tile, rest = divmod(toff, ts)
        chunk, in_chunk = divmod(rest, CHUNK)
    return SourceRef(
        ref.name,
        p.role,
        p.region,
        p.unit,
        int(p.order[k]),
        b,
        toff,
        tile,
        chunk,
        in_chunk,
        p.status.value,
    )


def _unit_extent(bp: BufferPlan, offset: int) -> tuple[int, int]:
    """The contiguous buffer bytes of the unit (or 512-B chunk, for pairs) holding offset."""
    i = bp.placement_at(offset)
    if i is None:
        return offset, min(NEEDLE, bp.size - offset)
    p = bp.placements[i]
    _k, b = p.locate(offset - p.offset)
    if p.scheme == "pair512":
        return offset - (b % CHUNK), CHUNK
    start = offset - b
    return start, min(p.unit_size, p.offset + p.extent - start)


def _partition(bp: BufferPlan) -> tuple[np.ndarray, np.ndarray]:
    """Starts and owners (placement index, -1 for zero) of a partition of the buffer."""
    starts, owners, at = [], [], 0
    for s, e, pi in bp.pieces.tolist():
        if s > at:
            starts.append(at)
            owners.append(-1)
        starts.append(s)
        owners.append(pi)
        at = e
    if at < bp.size:
        starts.append(at)
        owners.append(-1)
    return np.array(starts, dtype=np.int64), np.array(owners, dtype=np.int64)


def compare(
    expected: np.ndarray,
    dump: np.ndarray,
    bp: BufferPlan,
    max_mismatches: int = 10,
    advance: Callable[[int], None] | None = None,
    release: Release | None = None,
    limit: int | None = None,
) -> tuple[int, np.ndarray, list[tuple[int, int, int, int, int, int]]]:
    """Matching bytes, mismatches per partition owner, and the first mismatching units as
    (first differing offset, unit start, unit length, bytes differing, expected, got);
    only the first ``limit`` bytes (default: the whole buffer) are compared."""
    limit = bp.size if limit is None else limit
    starts, owners = _partition(bp)
    bad_by_owner = np.zeros(len(bp.placements) + 1, dtype=np.int64)  # last slot = zero region
    found: list[tuple[int, int, int, int, int, int]] = []
    bad_total = 0
    resume = 0
    for c0 in range(0, limit, COMPARE_STEP):
        c1 = min(limit, c0 + COMPARE_STEP)
        ne = expected[c0:c1] != dump[c0:c1]
        n_bad = int(np.count_nonzero(ne))
        if n_bad:
            bad_total += n_bad
            i0 = int(np.searchsorted(starts, c0, side="right")) - 1
            i1 = int(np.searchsorted(starts, c1, side="left"))
            local = np.maximum(starts[i0:i1], c0) - c0
            counts = np.add.reduceat(ne.view(np.uint8), local, dtype=np.int64)
            np.add.at(bad_by_owner, owners[i0:i1], counts)
            pos = max(c0, resume)
            while len(found) < max_mismatches and pos < c1:
                rest = ne[pos - c0 :]
                if not rest.any():
                    break
                first = pos + int(np.argmax(rest))
                us, ul = _unit_extent(bp, first)
                ue = min(limit, max(us + ul, first + 1))
                differing = int(np.count_nonzero(expected[us:ue] != dump[us:ue]))
                found.append(
                    (first, us, ue - us, differing, int(expected[first]), int(dump[first]))
                )
                pos = resume = ue
        if advance:
            advance(c1 - c0)
        if release:
            release(c0, c1)
    return limit - bad_total, bad_by_owner, found


def locate(model: Q4nxFile, dump: np.ndarray, bp: BufferPlan, offset: int) -> Located:
    """Search the model around the layer's tensors for the dump unit holding ``offset``."""
    start, length = _unit_extent(bp, offset)
    length = max(0, min(length, len(dump) - start))  # a short dump ends inside the unit
    unit = bytes(dump[start : start + length])
    needle = unit[:NEEDLE]
    if len(set(needle)) <= 1:
        return Located(start, length, None, 0, note="constant bytes: not locatable")
    refs = bp.refs
    lo = max(model.data_start, min(r.start for r in refs) - (1 << 20))
    hi = min(model.size, max(r.start + r.nbytes for r in refs) + (1 << 20))
    found = model.find(needle, lo, hi)
    if found < 0:
        return Located(start, length, None, 0, note="not found near the layer's tensors")
    have = model.u8[found : found + length]
    eq = have == np.frombuffer(unit[: len(have)], dtype=np.uint8)  # the file may end first
    matching = int(np.argmin(eq)) if not eq.all() else len(eq)
    return Located(
        start, length, found, matching, describe_file_range(model, found, found + length)
    )


def describe_file_range(model: Q4nxFile, lo: int, hi: int) -> list[str]:
    """``[lo, hi)`` of the file as tensor pieces: ``name[a:b] (n B)``."""
    out = []
    for e in sorted(model.entries.values(), key=lambda t: t.begin):
        a, b = model.data_start + e.begin, model.data_start + e.end
        s, t = max(a, lo), min(b, hi)
        if s < t:
            out.append(f"{e.name}[{s - a:,}:{t - a:,}] ({t - s:,} B)")
    return out


def _open_dump(path: Path) -> tuple[np.ndarray, mmap.mmap | None, int]:
    size = regular_file(path, "file").st_size
    if size == 0:
        return np.zeros(0, np.uint8), None, 0
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=np.uint8), mm, size


def verify_dump(
    dump_path: str | os.PathLike[str],
    model_path: str | os.PathLike[str],
    layer: int,
    buffer: str = "weights",
    profile: str | None = None,
    max_mismatches: int = 10,
    locate_first: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
) -> DumpVerifyResult:
    """Score a dump against one profile (or ``"auto"``: every profile, ranked)."""
    dump_p = Path(dump_path)
    with Q4nxFile(model_path) as model:
        geo = detect(model)
        if layer not in model_layers(model):
            raise BadInput(f"layer {layer} is not in the model", model_path)
        kind = geo.kind(layer)
        auto = profile == "auto"
        profs = all_profiles() if auto else [get_profile(profile)]
        dump, mm, dump_size = _open_dump(dump_p)
        scores: list[ProfileScore] = []
        try:
            for prof in profs:
                try:
                    lay = prof.layout(geo, kind)
                except BadInput as e:
                    if not auto:
                        raise
                    scores.append(
                        ProfileScore(
                            profile=prof.name, size=None, comparable=False, reason=e.message
                        )
                    )
                    continue
                names = [b.name for b in lay.buffers]
                if buffer not in names:
                    if not auto:
                        raise BadInput(
                            f"profile {prof.name} has no {buffer!r} buffer for a {kind.value} "
                            f"layer (it has: {', '.join(names)})"
                        )
                    scores.append(
                        ProfileScore(
                            profile=prof.name,
                            size=None,
                            comparable=False,
                            reason=f"no {buffer!r} buffer",
                        )
                    )
                    continue
                spec = lay.buffer(buffer)
                size = spec.size
                size_status = spec.size_provenance.status
                if size != dump_size and size_status.rank > Status.REPORTED.rank:
                    pass  # the size is only inferred: compare the overlap, report the difference
                elif size != dump_size:
                    why = f"buffer is {size:,} B ({size_status.value}), the dump {dump_size:,} B"
                    if not auto:
                        raise BadInput(
                            f"dump is {dump_size:,} bytes; profile {prof.name}'s {buffer} buffer "
                            f"for layer {layer} ({kind.value}) is {size:,} bytes (a "
                            f"{size_status.value} size: {spec.size_provenance.source})",
                            dump_p,
                        )
                    scores.append(
                        ProfileScore(profile=prof.name, size=size, comparable=False, reason=why)
                    )
                    continue
                problems = tensor_problems(model, geo, layer, lay.roles()) if auto else []
                if problems:
                    why = f"{len(problems)} tensor problem(s), e.g. {problems[0]}"
                    scores.append(
                        ProfileScore(profile=prof.name, size=size, comparable=False, reason=why)
                    )
                    continue
                plan = layer_plan(model, prof, geo, layer)
                bp = plan.buffer(buffer)
                progress.start(f"{prof.name}: packing layer {layer} {buffer}", 2 * size)
                expected = pack_buffer(model, bp, progress.advance)
                progress.advance(size - sum(s.nbytes for s in bp.segments))
                release = mapped_releaser(mm)
                n = min(size, dump_size)
                matching, bad, runs = compare(
                    expected, dump, bp, max_mismatches, progress.advance, release, n
                )
                progress.finish()
                score = _score(prof.name, bp, matching, bad, runs, n)
                score.size_status = size_status.value
                if dump_size > size:
                    score.extra = dump_size - size
                    score.extra_nonzero = _count_nonzero(dump, size, dump_size, release)
                if score.size_differs:
                    score.reason = _size_note(score, dump_size, spec.size_provenance.source)
                for m in score.mismatches[:locate_first]:
                    m.located = locate(model, dump, bp, m.offset)
                scores.append(score)
                del expected
                model.drop_pages(model.data_start, model.size)
        finally:
            progress.finish()
            del dump
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view is still held (by an error's traceback): the
                    pass  # map is released with it, and the error itself must be what shows
    scores.sort(key=lambda s: (not s.comparable, -s.percent, -s.matching))
    if not any(s.comparable for s in scores):
        raise BadInput(
            f"dump is {dump_size:,} bytes; no profile's {buffer} buffer for layer {layer} "
            f"({kind.value}) has that size: "
            + "; ".join(f"{s.profile}: {s.reason}" for s in scores),
            dump_p,
        )
    return DumpVerifyResult(
        str(dump_p), dump_size, str(model_path), layer, kind.value, buffer, scores
    )


def _count_nonzero(dump: np.ndarray, lo: int, hi: int, release: Release | None) -> int:
    n = 0
    for c0 in range(lo, hi, COMPARE_STEP):
        c1 = min(hi, c0 + COMPARE_STEP)
        n += int(np.count_nonzero(dump[c0:c1]))
        if release:
            release(c0, c1)
    return n


def _size_note(score: ProfileScore, dump_size: int, source: str) -> str:
    text = (
        f"dump {dump_size:,} B, buffer {score.size:,} B ({score.size_status}: {source}); "
        f"compared the first {score.compared:,} B"
    )
    if score.missing:
        text += f"; {score.missing:,} placed B lie past the dump's end"
    if score.extra:
        text += f"; the dump's last {score.extra:,} B ({score.extra_nonzero:,} nonzero) are past the buffer"
    return text


def _score(
    name: str,
    bp: BufferPlan,
    matching: int,
    bad: np.ndarray,
    runs: list[tuple[int, int, int, int, int, int]],
    compared: int | None = None,
) -> ProfileScore:
    compared = bp.size if compared is None else compared
    places = []
    placed_bytes = np.zeros(len(bp.placements), dtype=np.int64)
    placed_in = np.zeros(len(bp.placements), dtype=np.int64)
    for s, e, pi in bp.pieces.tolist():
        placed_bytes[pi] += e - s
        placed_in[pi] += max(0, min(e, compared) - s)
    for i, (p, ref) in enumerate(zip(bp.placements, bp.refs, strict=True)):
        n = int(placed_bytes[i])
        places.append(
            PlacementScore(
                p.region, ref.name, p.offset, n, int(placed_in[i]) - int(bad[i]), p.status.value
            )
        )
    zero = compared - int(placed_in.sum())
    mism = []
    for off, us, ul, differing, exp, got in runs:
        src = source_of(bp, off)
        mism.append(Mismatch(off, us, ul, differing, exp, got, src, src.region if src else "zero"))
    missing = int(placed_bytes.sum() - placed_in.sum())
    return ProfileScore(
        profile=name,
        size=bp.size,
        comparable=True,
        reason="",
        matching=matching,
        placements=places,
        zero_bytes=zero,
        zero_matching=zero - int(bad[-1]),
        mismatches=mism,
        compared=compared,
        missing=missing,
    )
