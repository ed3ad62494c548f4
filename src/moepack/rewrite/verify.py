"""``verify``: account for every byte of a repacked GGUF against its original.

Passes only if the repacked file has the original's metadata (moepack's provenance keys aside,
and those must be consistent; ``general.alignment`` and a split's tensor count as the layout
makes them), the original's tensors with their types and shapes or fused gate+up pairs
(``pairing``), each byte-identical or permuted along the expert axis with one permutation per
MoE block (a fused slice is the original gate slice followed by the original up slice), data in
tensor-info order at any alignment, zero bytes in every gap and in the padding, nothing after
the data, and every permutation within the block's expert-order rules (routing groups and the
like, see ``checkpoint.expert_index``). The permutation comes from the file's provenance keys, a
plan, or — with neither — is discovered by matching expert slices; the layout is read from the
headers, and a layout provenance must record it exactly (what undo needs). The first difference
is named by tensor, slot and file offset.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import MoeBlock, MoeModel
from ..checkpoint.provenance import RepackProvenance, pack_kv, read_provenance
from ..errors import BadInput
from ..keys import REPACK_PREFIX
from ..layout.plan import Plan
from ..progress import NULL_PROGRESS, ProgressSink
from .compare import RangeComparer, pair_reads, single_reads
from .header import shard_metadata
from .mapped_compare import MappedComparer
from .pairing import Paired, PairingError, pair_tensors

SIGNATURE_BYTES = 4096


@dataclass
class Difference:
    """The first thing found that makes the repacked file not a faithful repack."""

    file: str
    what: str  # metadata / tensors / header-padding / data / gap / trailing / provenance / plan /
    # expert-index (a permutation llama.cpp's routing does not allow)
    message: str
    tensor: str | None = None
    slot: int | None = None
    offset: int | None = None  # absolute byte offset in the repacked file


@dataclass
class VerifyResult:
    ok: bool
    original: list[Path]
    repacked: list[Path]
    permutation_source: str
    metadata_keys: int = 0
    tensors_compared: int = 0
    tensors_identical: int = 0
    tensors_permuted: int = 0
    blocks_permuted: list[int] = field(default_factory=list)
    # per permuted block, repacked slot -> ORIGINAL's expert, as verify found it (from the
    # provenance, the plan or the slices): what maps the repacked file's routing back
    # (None when verify stopped before it knew the permutation)
    permutations: dict[int, list[int]] | None = None
    bytes_compared: int = 0
    seconds: float = 0.0
    difference: Difference | None = None
    # the layout found in the headers: fused blocks, data alignment, tensors reordered or not
    blocks_fused: list[int] = field(default_factory=list)
    alignment: int = 0
    tensor_order: str = "original"
    shards: int = 0  # the repacked file's


class _Failed(Exception):
    def __init__(self, diff: Difference) -> None:
        super().__init__(diff.message)
        self.diff = diff


def _fail(
    file: Path,
    what: str,
    message: str,
    *,
    tensor: str | None = None,
    slot: int | None = None,
    offset: int | None = None,
) -> NoReturn:
    raise _Failed(Difference(str(file), what, message, tensor, slot, offset))


def verify(
    original: str | os.PathLike[str],
    repacked: str | os.PathLike[str],
    plan: Plan | None = None,
    plan_path: str | os.PathLike[str] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
) -> VerifyResult:
    """Compare ``repacked`` with ``original``; ``ok`` is False with the first ``difference``.

    ``assume_expert`` / ``assume_not_expert``: as for ``repack`` (tensors declared expert-axis
    are expected permuted with their block; everything else must be byte-identical)."""
    t0 = time.perf_counter()
    rpath = Path(repacked)
    if not rpath.exists():
        raise BadInput("no such file", rpath)
    if rpath.is_dir():
        raise BadInput("is a directory, expected a GGUF file", rpath)
    with MoeModel(original, assume_expert, assume_not_expert) as orig:
        if plan is not None:
            plan.check_against(orig, plan_path)
        try:
            rep = MoeModel(rpath, assume_expert, assume_not_expert)
        except BadInput as e:
            diff = Difference(e.path or str(rpath), "format", f"not a readable GGUF: {e.message}")
            return VerifyResult(False, orig.shard_paths, [rpath], "none", difference=diff)
        with rep:
            result = VerifyResult(True, orig.shard_paths, rep.shard_paths, "identity")
            with MappedComparer() as cmp:
                try:
                    _verify(orig, rep, plan, result, cmp, progress)
                except _Failed as f:
                    result.ok = False
                    result.difference = f.diff
                finally:
                    progress.finish()
                result.bytes_compared = cmp.bytes_compared
    result.seconds = time.perf_counter() - t0
    return result


def _verify(
    orig: MoeModel,
    rep: MoeModel,
    plan: Plan | None,
    res: VerifyResult,
    cmp: RangeComparer,
    progress: ProgressSink,
) -> None:
    rfile = rep.shard_paths[0]
    try:
        prov_r = read_provenance(rep)
    except BadInput as e:
        _fail(Path(e.path or rfile), "provenance", e.message)
    if len(orig.shards) != len(rep.shards) and (prov_r is None or prov_r.shards is None):
        _fail(rfile, "shards", f"{len(rep.shards)} shard(s), the original has {len(orig.shards)}")
    canonical = [(k, pack_kv(k, t, v)) for k, t, v in prov_r.to_kv()] if prov_r else []
    n_tensors = sum(len(s.tensors) for s in rep.shards)
    for i, r_shard in enumerate(rep.shards):
        o_shard = orig.shards[min(i, len(orig.shards) - 1)]
        try:  # what the metadata of a rewrite into these shards at this alignment must be
            want = shard_metadata(orig, i, len(rep.shards), n_tensors, r_shard.alignment)
        except BadInput as e:
            _fail(Path(e.path or r_shard.path), "metadata", e.message)
        _check_header(o_shard, r_shard, want + canonical)
        res.metadata_keys += len(r_shard.kv)
    try:
        paired = pair_tensors(orig, rep)
    except PairingError as e:
        _fail(rep.shard_paths[e.shard], "tensors", e.message, tensor=e.tensor)
    _check_layout_record(orig, rep, prov_r, paired, res)

    # ---------------------------------------------------------------- permutations
    perms = _permutations(orig, rep, prov_r, plan, res, paired)
    for block in orig.blocks:
        if block.index in perms:
            why = block.violation(perms[block.index])
            if why is not None:
                _fail(
                    rfile,
                    "expert-index",
                    f"block {block.index}: the experts were moved in a way that changes what "
                    f"llama.cpp computes: {why}",
                    tensor=block.tensors[0].name,
                )
    for row in paired:
        for p in row:
            if p.block is not None:
                p.tensor.perm = perms.get(p.block)
    res.blocks_permuted = sorted(perms)
    res.permutations = {b: [int(x) for x in perms[b]] for b in sorted(perms)}

    # ---------------------------------------------------------------- bytes
    total = sum(t.n_bytes for t in rep.tensors.values())
    progress.start(f"verifying {rep.path.name}", total)
    ofds = [os.open(p, os.O_RDONLY) for p in orig.shard_paths]
    rfds = [os.open(p, os.O_RDONLY) for p in rep.shard_paths]
    try:
        for i, shard in enumerate(rep.shards):
            _check_shard(shard, paired[i], rfds[i], ofds, cmp, res, progress)
    finally:
        for fd in ofds + rfds:
            os.close(fd)


def _check_header(o: GgufFile, r: GgufFile, want: list[tuple[str, bytes]]) -> None:
    """The repacked shard's header must be ``want`` (``header.shard_metadata``: the original's,
    entry for entry and in order, a changed alignment ``general.alignment`` set in place or
    appended, a split's keys as the repacked file's shards have them; then exactly moepack's
    canonical provenance entries), and nothing else."""
    if o.version != r.version:
        _fail(r.path, "metadata", f"GGUF version {r.version}, original has {o.version}")
    if r.alignment < 1 or r.alignment & (r.alignment - 1):
        _fail(r.path, "metadata", f"general.alignment {r.alignment} is not a power of two")
    have = [(k, r.raw_kv(k)) for k in _ordered(r)]
    want_keys, have_keys = [k for k, _ in want], [k for k, _ in have]
    for i, ((wk, wraw), (hk, hraw)) in enumerate(zip(want, have, strict=False)):
        if wk != hk:
            if hk not in want_keys:
                _fail(r.path, "metadata", f"metadata key {hk!r} is not in the original")
            if wk not in have_keys:
                _fail(r.path, "metadata", f"metadata key {wk!r} is missing")
            _fail(r.path, "metadata", f"metadata entry {i} is {hk!r}, expected {wk!r} (reordered)")
        if wraw != hraw:
            what = (
                "is not in moepack's canonical form"
                if hk.startswith(REPACK_PREFIX)
                else "has a different value"
            )
            _fail(r.path, "metadata", f"metadata key {hk!r} {what}", offset=r.kv[hk].start)
    if len(have) > len(want):
        _fail(r.path, "metadata", f"metadata key {have[len(want)][0]!r} is not in the original")
    if len(want) > len(have):
        _fail(r.path, "metadata", f"metadata key {want[len(have)][0]!r} is missing")
    # Tensors are paired with the original's by ``pairing`` (the order of their entries is
    # free: it only decides the layout, which is checked here and with the data).
    # Layout: ggml (llama.cpp) requires each tensor's data to follow the previous entry's,
    # padded to the alignment; a file that breaks this does not load, whatever its bytes.
    expect = 0
    for t in r.tensors:
        if t.rel_offset != expect:
            _fail(
                r.path,
                "layout",
                f"tensor {t.name!r} data is at offset {t.rel_offset:,} of the data section; "
                f"llama.cpp expects {expect:,} (data must follow the tensor-info order)",
                tensor=t.name,
                offset=t.offset,
            )
        expect = t.rel_offset + t.n_bytes + (-(t.rel_offset + t.n_bytes)) % r.alignment


def _ordered(shard: GgufFile) -> list[str]:
    return sorted(shard.kv, key=lambda k: shard.kv[k].start)


def _check_shard(
    shard: GgufFile,
    paired: list[Paired],
    rfd: int,
    ofds: list[int],
    cmp: RangeComparer,
    res: VerifyResult,
    progress: ProgressSink,
) -> None:
    pad = shard.data_offset - shard.header_end
    items = sorted(paired, key=lambda p: p.entry.offset)
    # Every read below, in order, so both files are read ahead concurrently.
    reads = single_reads(rfd, shard.header_end, pad)
    pos = shard.data_offset
    for p in items:
        reads += single_reads(rfd, pos, p.entry.offset - pos)
        p.tensor.rel_offset = p.entry.rel_offset
        for osh, src, dst, n in p.tensor.ranges(shard.data_offset):
            reads += pair_reads(ofds[osh], src, rfd, dst, n)
        pos = p.entry.end
    reads += single_reads(rfd, pos, shard.size - pos)
    cmp.expect(reads)
    at = cmp.first_nonzero(rfd, shard.header_end, pad)
    if at is not None:
        _fail(
            shard.path,
            "header-padding",
            "non-zero byte in the padding after the header",
            offset=shard.header_end + at,
        )
    pos = shard.data_offset
    for p in items:
        t = p.entry
        at = cmp.first_nonzero(rfd, pos, t.offset - pos)
        if at is not None:
            _fail(
                shard.path,
                "gap",
                f"non-zero byte in the padding before tensor {t.name!r}",
                offset=pos + at,
            )
        res.tensors_compared += 1
        for osh, src, dst, n in p.tensor.ranges(shard.data_offset):
            at = cmp.first_difference(ofds[osh], src, rfd, dst, n)
            if at is not None:
                _fail_slice(shard, p, dst + at)
        if p.tensor.perm is None and not p.fused:
            res.tensors_identical += 1
        else:
            res.tensors_permuted += 1
        progress.advance(t.n_bytes)
        pos = t.end
    tail = shard.size - pos
    if tail not in (0, (-pos) % shard.alignment):
        _fail(
            shard.path,
            "trailing",
            f"{tail:,} bytes after the last tensor (expected none, or padding to the alignment)",
            offset=pos,
        )
    at = cmp.first_nonzero(rfd, pos, tail)
    if at is not None:
        _fail(shard.path, "trailing", "non-zero byte after the last tensor", offset=pos + at)


def _fail_slice(shard: GgufFile, p: Paired, offset: int) -> NoReturn:
    """The first difference, at absolute ``offset`` of the repacked file, named by slot."""
    t, desc = p.entry, p.tensor
    within = offset - t.offset
    if desc.n_expert == 1:
        _fail(
            shard.path,
            "data",
            f"tensor {t.name!r} differs from the original at byte {within:,} of the tensor",
            tensor=t.name,
            offset=offset,
        )
    slot, at = divmod(within, desc.slice_bytes)
    expert = int(desc.perm[slot]) if desc.perm is not None else slot
    what = " and ".join(part.source.name for part in desc.parts)
    _fail(
        shard.path,
        "data",
        f"tensor {t.name!r} slice {slot} does not match original slice {expert} of {what} "
        f"(first difference at byte {at:,} of the slice)",
        tensor=t.name,
        slot=slot,
        offset=offset,
    )


# -------------------------------------------------------------------- layout record
def _check_layout_record(
    orig: MoeModel,
    rep: MoeModel,
    prov_r: RepackProvenance | None,
    paired: list[list[Paired]],
    res: VerifyResult,
) -> None:
    """A file whose layout differs from its original's must say so in its provenance, exactly
    as undo needs it (fused blocks, the original alignment, the tensor order), and a file that
    records a layout must have it. Relative to the very original when ``orig`` is a repack."""
    rfile = rep.shard_paths[0]
    prov_o = read_provenance(orig)
    index: dict[str, tuple[int, int]] = {}  # original tensor -> (repacked index, half)
    fused: set[int] = set()
    shard_of: list[int] = []  # repacked tensor (global index) -> its shard
    k = 0
    for si, row in enumerate(paired):
        for p in row:
            for half, part in enumerate(p.tensor.parts):
                index[part.source.name] = (k, half)
            if p.fused and p.block is not None:
                fused.add(p.block)
            shard_of.append(si)
            k += 1
    rel = [index[t.name] for s in orig.shards for t in s.tensors]
    same_order = all(i == j and h == 0 for j, (i, h) in enumerate(rel))
    if prov_o is not None and prov_o.order is not None:
        base = prov_o.order.tolist()
        order = []
        for v in base:
            i, h = divmod(int(v), 2)
            if not 0 <= i < len(rel):
                _fail(orig.shard_paths[0], "provenance", "recorded tensor order is out of range")
            j, h2 = rel[i]
            order.append(2 * j + (h2 if h2 else h))
    else:
        order = [2 * i + h for i, h in rel]
    if prov_o is not None and prov_o.alignment is not None:
        record, very = prov_o.alignment, prov_o.alignment or GGUF_DEFAULT_ALIGNMENT
    else:
        record = int(orig.shards[0].get_int("general.alignment", 0) or 0)
        very = orig.shards[0].alignment
    want_align = None if rep.shards[0].alignment == very else record
    all_fused = sorted(fused | set(prov_o.fused if prov_o is not None else []))
    changed = (
        bool(all_fused)
        or want_align is not None
        or not same_order
        or (prov_o is not None and prov_o.changes_layout)
    )
    # which shard of the very original each of its tensors was in, and is in now
    if prov_o is not None and prov_o.shards is not None:
        homes = [i for i, n in enumerate(prov_o.shards) for _ in range(n)]
    elif prov_o is not None and prov_o.order is not None:
        of_orig = [i for i, s in enumerate(orig.shards) for _ in s.tensors]
        homes = [of_orig[int(v) // 2] for v in prov_o.order.tolist()]
    else:
        homes = [i for i, s in enumerate(orig.shards) for _ in s.tensors]
    if len(homes) != len(order):
        _fail(orig.shard_paths[0], "provenance", "recorded shard counts do not fit its tensors")
    n_homes = max(homes) + 1 if homes else 1
    same_shards = len(rep.shards) == n_homes and all(
        shard_of[v // 2] == homes[k] for k, v in enumerate(order)
    )
    want_shards = None if same_shards else [homes.count(i) for i in range(n_homes)]
    changed = changed or not same_shards
    res.blocks_fused = sorted(fused)
    res.alignment = rep.shards[0].alignment
    res.tensor_order = "original" if same_order else "changed"
    res.shards = len(rep.shards)
    if prov_r is None:
        return  # nothing recorded: the bytes alone are checked
    if not changed and not prov_r.changes_layout:
        return
    if not prov_r.changes_layout:
        _fail(
            rfile,
            "provenance",
            "the file's layout differs from the original's, but its provenance does not record it (undo would fail)",
        )
    if sorted(prov_r.fused) != all_fused:
        _fail(
            rfile,
            "provenance",
            f"provenance says blocks {sorted(prov_r.fused)} were fused, the file fuses {all_fused}",
        )
    if prov_r.alignment != want_align:
        _fail(
            rfile,
            "provenance",
            f"provenance records the original alignment as {prov_r.alignment}, expected {want_align}",
        )
    if prov_r.order is None or prov_r.order.tolist() != order:
        _fail(rfile, "provenance", "provenance's tensor order does not describe the original's")
    if prov_r.shards != want_shards:
        _fail(
            rfile,
            "provenance",
            f"provenance records the original's shards as {prov_r.shards}, expected "
            f"{want_shards} (None: cut where the original's were)",
        )


# -------------------------------------------------------------------- permutations
def _permutations(
    orig: MoeModel,
    rep: MoeModel,
    prov_r: RepackProvenance | None,
    plan: Plan | None,
    res: VerifyResult,
    paired: list[list[Paired]],
) -> dict[int, np.ndarray]:
    """Per MoE block, repacked slot -> original slot (non-identity blocks only).

    From the repacked file's provenance when it has some (relative to the original's own
    provenance, if the original is itself a repack), else from the plan, else discovered."""
    rfile = rep.shard_paths[0]
    prov_o = read_provenance(orig)
    perms: dict[int, np.ndarray] = {}
    if prov_r is not None:
        res.permutation_source = "provenance"
        expected = prov_o.original_fingerprint if prov_o else orig.fingerprint
        if prov_r.original_fingerprint != expected:
            _fail(
                rfile,
                "provenance",
                f"file says it was made from model {prov_r.original_fingerprint}, the original given is {expected}",
            )
        moe = {b.index for b in orig.blocks}
        for b in prov_r.perms:
            if b not in moe:
                _fail(
                    rfile, "provenance", f"provenance permutes block {b}, which is not a MoE block"
                )
        for block in orig.blocks:
            rel = _relative(prov_o, prov_r, block, rfile)
            if rel is not None:
                perms[block.index] = rel
        if plan is not None:
            for block in orig.blocks:
                want = plan.perm_for(block.index)
                want = want if want is not None else np.arange(block.n_expert)
                have = perms.get(block.index, np.arange(block.n_expert))
                if not np.array_equal(want, have):
                    _fail(
                        rfile,
                        "plan",
                        f"block {block.index}: the plan disagrees with the file's recorded permutation",
                    )
    elif plan is not None:
        res.permutation_source = "plan"
        perms = {lp.block: lp.perm for lp in plan.layers if not lp.is_identity}
    else:
        res.permutation_source = "discovered"
        perms = _discover(orig, rep, paired)
    return perms


def _relative(
    prov_o: RepackProvenance | None, prov_r: RepackProvenance, block: MoeBlock, rfile: Path
) -> np.ndarray | None:
    n = block.n_expert
    pr = prov_r.perm(block.index, n)
    if len(pr) != n or not np.array_equal(np.sort(pr), np.arange(n)):
        _fail(
            rfile,
            "provenance",
            f"recorded permutation for block {block.index} is not a permutation of {n} experts",
        )
    if prov_o is not None:
        po = prov_o.perm(block.index, n)
        rel = np.argsort(po)[pr]
    else:
        rel = pr
    return None if np.array_equal(rel, np.arange(n)) else rel


Located = tuple[int, int, int, int, int]
"""Where one original tensor's expert slices sit: (shard, base, stride, start, length); slot
``s``'s bytes are ``length`` bytes at ``base + s * stride + start``."""


def _located_in_original(block: MoeBlock) -> dict[str, Located]:
    return {
        t.name: (t.shard, t.entry.offset, t.slice_bytes, 0, t.slice_bytes) for t in block.tensors
    }


def _located_in_repacked(paired: list[list[Paired]], block: int) -> dict[str, Located]:
    out: dict[str, Located] = {}
    for row in paired:
        for p in row:
            if p.block != block:
                continue
            start = 0
            for part in p.tensor.parts:
                out[part.source.name] = (
                    p.shard,
                    p.entry.offset,
                    p.tensor.slice_bytes,
                    start,
                    part.length,
                )
                start += part.length
    return out


def _discover(orig: MoeModel, rep: MoeModel, paired: list[list[Paired]]) -> dict[int, np.ndarray]:
    """Match each repacked slot to the original expert with the same bytes (block-wide
    signature over the original's expert tensors, wherever the repacked file holds them)."""
    perms: dict[int, np.ndarray] = {}
    cmp = RangeComparer()  # closed below, with the descriptors
    ofds = [os.open(p, os.O_RDONLY) for p in orig.shard_paths]
    rfds = [os.open(p, os.O_RDONLY) for p in rep.shard_paths]
    try:
        for block in orig.blocks:
            names = sorted(t.name for t in block.tensors)  # the same order in both files
            o_loc, r_loc = _located_in_original(block), _located_in_repacked(paired, block.index)
            o_parts = [o_loc[n] for n in names]
            r_parts = [r_loc[n] for n in names]
            n = block.n_expert
            o_sig = _signatures(n, o_parts, ofds, cmp, full=False)
            if len(set(o_sig)) < len(o_sig):  # identical heads: fall back to whole-slice hashes
                o_sig = _signatures(n, o_parts, ofds, cmp, full=True)
                r_sig = _signatures(n, r_parts, rfds, cmp, full=True)
            else:
                r_sig = _signatures(n, r_parts, rfds, cmp, full=False)
            pool: dict[bytes, list[int]] = {}
            for e, sig in enumerate(o_sig):
                pool.setdefault(sig, []).append(e)
            perm = np.empty(n, dtype=np.int64)
            for slot, sig in enumerate(r_sig):
                cands = pool.get(sig)
                if not cands:
                    shard, base, stride, start, _ = r_parts[0]
                    _fail(
                        rep.shard_paths[shard],
                        "data",
                        f"block {block.index} slot {slot}: no expert of the original has these bytes",
                        tensor=names[0],
                        slot=slot,
                        offset=base + slot * stride + start,
                    )
                perm[slot] = cands.pop(0)
            if not np.array_equal(perm, np.arange(n)):
                perms[block.index] = perm
    finally:
        cmp.close()
        for fd in ofds + rfds:
            os.close(fd)
    return perms


def _signatures(
    n_expert: int, parts: list[Located], fds: list[int], cmp: RangeComparer, full: bool
) -> list[bytes]:
    sigs = []
    for e in range(n_expert):
        h = hashlib.blake2b(digest_size=20)
        for shard, base, stride, start, length in parts:
            n = length if full else min(length, SIGNATURE_BYTES)
            off = base + e * stride + start
            done = 0
            while done < n:
                k = min(n - done, 1 << 24)
                h.update(cmp.head(fds[shard], off + done, k))
                done += k
        sigs.append(h.digest())
    return sigs
