"""``verify``: account for every byte of a repacked GGUF against its original.

Passes only if the repacked file has the original's metadata (moepack's provenance keys aside,
and those must be consistent), the same tensors with the same types and shapes, each tensor
byte-identical or permuted along the expert axis with one permutation per MoE block, zero bytes
in every gap and in the padding, nothing after the data, and every permutation within the
block's expert-order rules (routing groups and the like, see ``checkpoint.expert_index``). The permutation comes from the
file's provenance keys, a plan, or — with neither — is discovered by matching expert slices.
The first difference is named by tensor, slot and file offset.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import PROVENANCE_PREFIX, MoeBlock, MoeModel
from ..errors import BadInput
from ..layout.plan import Plan
from ..progress import NULL_PROGRESS, ProgressSink
from .compare import RangeComparer, pair_reads, single_reads
from .mapped_compare import MappedComparer
from .provenance import RepackProvenance, pack_kv, read_provenance

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
    bytes_compared: int = 0
    seconds: float = 0.0
    difference: Difference | None = None


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
    if len(orig.shards) != len(rep.shards):
        _fail(rfile, "shards", f"{len(rep.shards)} shard(s), the original has {len(orig.shards)}")
    try:
        prov_r = read_provenance(rep)
    except BadInput as e:
        _fail(Path(e.path or rfile), "provenance", e.message)
    canonical = [(k, pack_kv(k, t, v)) for k, t, v in prov_r.to_kv()] if prov_r else []
    for o_shard, r_shard in zip(orig.shards, rep.shards, strict=True):
        _check_header(o_shard, r_shard, canonical)
        res.metadata_keys += len(r_shard.kv)

    # ---------------------------------------------------------------- permutations
    perms = _permutations(orig, rep, prov_r, plan, res)
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
    perm_of = {t.name: perms[b.index] for b in orig.blocks if b.index in perms for t in b.tensors}
    res.blocks_permuted = sorted(perms)

    # ---------------------------------------------------------------- bytes
    total = sum(t.n_bytes for t in rep.tensors.values())
    progress.start(f"verifying {rep.path.name}", total)
    ofds = [os.open(p, os.O_RDONLY) for p in orig.shard_paths]
    rfds = [os.open(p, os.O_RDONLY) for p in rep.shard_paths]
    try:
        for i, shard in enumerate(rep.shards):
            _check_shard(orig, shard, rfds[i], ofds, perm_of, cmp, res, progress)
    finally:
        for fd in ofds + rfds:
            os.close(fd)


def _check_header(o: GgufFile, r: GgufFile, provenance: list[tuple[str, bytes]]) -> None:
    """The repacked shard's header must be the original's, entry for entry and in order, with
    exactly moepack's canonical provenance entries appended (and nothing else)."""
    if o.version != r.version:
        _fail(r.path, "metadata", f"GGUF version {r.version}, original has {o.version}")
    want = [(k, o.raw_kv(k)) for k in _ordered(o) if not k.startswith(PROVENANCE_PREFIX)]
    want += provenance
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
                if hk.startswith(PROVENANCE_PREFIX)
                else "has a different value"
            )
            _fail(r.path, "metadata", f"metadata key {hk!r} {what}", offset=r.kv[hk].start)
    if len(have) > len(want):
        _fail(r.path, "metadata", f"metadata key {have[len(want)][0]!r} is not in the original")
    if len(want) > len(have):
        _fail(r.path, "metadata", f"metadata key {want[len(have)][0]!r} is missing")
    # Tensors: the same set, with the same types and shapes (the order of their entries is
    # free: it only decides the layout, which is checked with the data).
    o_infos = {t.name: t for t in o.tensors}
    for t in r.tensors:
        ot = o_infos.get(t.name)
        if ot is None:
            _fail(r.path, "tensors", f"extra tensor {t.name!r}", tensor=t.name)
        if (ot.ggml_type, ot.ne) != (t.ggml_type, t.ne):
            _fail(
                r.path,
                "tensors",
                f"tensor {t.name!r} is {t.type_name}{list(t.ne)}, original is {ot.type_name}{list(ot.ne)}",
                tensor=t.name,
            )
    missing = set(o_infos) - {t.name for t in r.tensors}
    if missing:
        name = min(missing, key=lambda n: o_infos[n].offset)
        _fail(r.path, "tensors", f"tensor {name!r} is missing", tensor=name)
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
    orig: MoeModel,
    shard: GgufFile,
    rfd: int,
    ofds: list[int],
    perm_of: dict[str, np.ndarray],
    cmp: RangeComparer,
    res: VerifyResult,
    progress: ProgressSink,
) -> None:
    pad = shard.data_offset - shard.header_end
    # Every read below, in order, so both files are read ahead concurrently.
    reads = single_reads(rfd, shard.header_end, pad)
    pos = shard.data_offset
    for t in sorted(shard.tensors, key=lambda t: t.offset):
        reads += single_reads(rfd, pos, t.offset - pos)
        o, ofd, perm = orig.tensors[t.name], ofds[orig.tensor_shard[t.name]], perm_of.get(t.name)
        if perm is None:
            reads += pair_reads(ofd, o.offset, rfd, t.offset, t.n_bytes)
        else:
            step = t.n_bytes // len(perm)
            for slot, e in enumerate(perm):
                reads += pair_reads(
                    ofd, o.offset + int(e) * step, rfd, t.offset + slot * step, step
                )
        pos = t.end
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
    for t in sorted(shard.tensors, key=lambda t: t.offset):
        at = cmp.first_nonzero(rfd, pos, t.offset - pos)
        if at is not None:
            _fail(
                shard.path,
                "gap",
                f"non-zero byte in the padding before tensor {t.name!r}",
                offset=pos + at,
            )
        o = orig.tensors[t.name]
        ofd = ofds[orig.tensor_shard[t.name]]
        perm = perm_of.get(t.name)
        res.tensors_compared += 1
        if perm is None:
            at = cmp.first_difference(ofd, o.offset, rfd, t.offset, t.n_bytes)
            if at is not None:
                _fail(
                    shard.path,
                    "data",
                    f"tensor {t.name!r} differs from the original at byte {at:,} of the tensor",
                    tensor=t.name,
                    offset=t.offset + at,
                )
            res.tensors_identical += 1
        else:
            step = t.n_bytes // len(perm)
            for slot, expert in enumerate(perm):
                at = cmp.first_difference(
                    ofd, o.offset + int(expert) * step, rfd, t.offset + slot * step, step
                )
                if at is not None:
                    _fail(
                        shard.path,
                        "data",
                        f"tensor {t.name!r} slice {slot} does not match original slice {int(expert)} "
                        f"(first difference at byte {at:,} of the slice)",
                        tensor=t.name,
                        slot=slot,
                        offset=t.offset + slot * step + at,
                    )
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


# -------------------------------------------------------------------- permutations
def _permutations(
    orig: MoeModel,
    rep: MoeModel,
    prov_r: RepackProvenance | None,
    plan: Plan | None,
    res: VerifyResult,
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
        perms = _discover(orig, rep)
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


def _discover(orig: MoeModel, rep: MoeModel) -> dict[int, np.ndarray]:
    """Match each repacked slot to the original expert with the same bytes (block-wide signature)."""
    perms: dict[int, np.ndarray] = {}
    cmp = RangeComparer()  # closed below, with the descriptors
    ofds = [os.open(p, os.O_RDONLY) for p in orig.shard_paths]
    rfds = [os.open(p, os.O_RDONLY) for p in rep.shard_paths]
    try:
        for block in orig.blocks:
            rblock = rep.block(block.index)
            o_sig = _signatures(block, ofds, cmp, full=False)
            if len(set(o_sig)) < len(o_sig):  # identical heads: fall back to whole-slice hashes
                o_sig = _signatures(block, ofds, cmp, full=True)
                r_sig = _signatures(rblock, rfds, cmp, full=True)
            else:
                r_sig = _signatures(rblock, rfds, cmp, full=False)
            pool: dict[bytes, list[int]] = {}
            for e, s in enumerate(o_sig):
                pool.setdefault(s, []).append(e)
            perm = np.empty(block.n_expert, dtype=np.int64)
            for slot, s in enumerate(r_sig):
                cands = pool.get(s)
                if not cands:
                    t = rblock.tensors[0]
                    _fail(
                        rep.shard_paths[t.shard],
                        "data",
                        f"block {block.index} slot {slot}: no expert of the original has these bytes",
                        tensor=t.name,
                        slot=slot,
                        offset=t.slice_offset(slot),
                    )
                perm[slot] = cands.pop(0)
            if not np.array_equal(perm, np.arange(block.n_expert)):
                perms[block.index] = perm
    finally:
        cmp.close()
        for fd in ofds + rfds:
            os.close(fd)
    return perms


def _signatures(block: MoeBlock, fds: list[int], cmp: RangeComparer, full: bool) -> list[bytes]:
    sigs = []
    for e in range(block.n_expert):
        h = hashlib.blake2b(digest_size=20)
        for t in sorted(block.tensors, key=lambda t: t.name):  # same order in both files
            n = t.slice_bytes if full else min(t.slice_bytes, SIGNATURE_BYTES)
            off = t.slice_offset(e)
            done = 0
            while done < n:
                k = min(n - done, 1 << 24)
                h.update(cmp.head(fds[t.shard], off + done, k))
                done += k
        sigs.append(h.digest())
    return sigs
