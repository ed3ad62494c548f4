"""``MoeModel``: a GGUF MoE checkpoint (single file or split shards) seen as expert slices.

Opening reads only headers. The model knows, per transformer block, which tensors carry the
expert axis, each tensor's slice geometry (bytes per expert, offset of slice ``e``), and which
tensors it could not classify. Its ``fingerprint`` binds plans and traces to it.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import Keys
from gguf.constants import GGML_QUANT_SIZES

from ..errors import BadInput
from ..keys import REPACK_PREFIX
from ..safeio import settle_for_reading
from .expert_index import TOKEN_TABLE_BASES, IndexConstraint, first_violation, index_constraints
from .experts import Classification, Role, classify, significant_ne, split_block_name
from .gguf_file import GgufFile, TensorEntry
from .hparams import check_hparams
from .nextn import NEXTN_KEY, blocks_run

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# A split checkpoint's bookkeeping differs per shard and is no part of the model's identity.
_SPLIT_KEYS = frozenset(
    {
        Keys.Split.LLM_KV_SPLIT_NO,
        Keys.Split.LLM_KV_SPLIT_COUNT,
        Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
    }
)


@dataclass(frozen=True)
class ExpertTensor:
    """A tensor with the expert axis outermost: ``n_expert`` contiguous slices."""

    entry: TensorEntry
    shard: int
    block: int
    kind: str
    n_expert: int

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def slice_bytes(self) -> int:
        return self.entry.n_bytes // self.n_expert

    def slice_offset(self, expert: int) -> int:
        """Absolute file offset of expert ``expert``'s slice."""
        return self.entry.offset + expert * self.slice_bytes


@dataclass(frozen=True)
class FlaggedTensor:
    """A block tensor that moepack will not permute, with the reason."""

    name: str
    block: int
    role: Role
    reason: str


@dataclass
class MoeBlock:
    """One transformer block that has routed experts."""

    index: int
    n_expert: int
    top_k: int
    tensors: list[ExpertTensor] = field(default_factory=list)
    constraints: list[IndexConstraint] = field(default_factory=list)
    # False for a multi-token-prediction block llama.cpp loads but its graph never runs
    # (``checkpoint.nextn``): no routing to capture there, its bytes still repacked and verified
    runs: bool = True

    def violation(self, perm: np.ndarray) -> str | None:
        """Why ``perm`` would change what llama.cpp computes for this block, or None."""
        return first_violation(self.constraints, perm)

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one expert occupies across all expert-axis tensors of the block."""
        return sum(t.slice_bytes for t in self.tensors)

    @property
    def expert_bytes(self) -> int:
        return sum(t.entry.n_bytes for t in self.tensors)

    @property
    def weight_tensors(self) -> list[ExpertTensor]:
        """The expert matrices (what a token's routing makes the runtime read)."""
        return [t for t in self.tensors if t.kind in ("gate", "up", "down", "gate_up")]


def find_shards(path: Path) -> list[Path]:
    """All shards of a split checkpoint given any one of them, or ``[path]``."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1:
        raise BadInput("split file name says 0 shards", path)
    shards = [
        path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf")
        for i in range(1, count + 1)
    ]
    missing = [s.name for s in shards if not s.exists()]
    if missing:
        raise BadInput(f"split checkpoint is missing shard(s): {', '.join(missing)}", path)
    return shards


class MoeModel:
    """A GGUF MoE checkpoint opened for inspection, repacking and verification."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        assume_expert: tuple[str, ...] = (),
        assume_not_expert: tuple[str, ...] = (),
    ) -> None:
        self.path = Path(path)
        # a killed repack or synth may have left its shards half switched: finished or refused
        settle_for_reading(self.path.parent)
        self.shard_paths = find_shards(self.path)
        self.shards = [GgufFile(p) for p in self.shard_paths]
        self._check_split()
        first = self.shards[0]
        arch = first.get(Keys.General.ARCHITECTURE, "")
        if not isinstance(arch, str) or not arch:
            raise BadInput(
                f"metadata has no {Keys.General.ARCHITECTURE} string", self.shard_paths[0]
            )
        self.architecture = arch
        self.n_expert_meta = first.get_int(Keys.LLM.EXPERT_COUNT.format(arch=arch), allow_list=True)
        self.top_k = int(first.get_int(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), 0) or 0)
        self.block_count = int(first.get_int(Keys.LLM.BLOCK_COUNT.format(arch=arch), 0) or 0)
        # llama.cpp reads these for every architecture (grouped routing when count > 1)
        self.n_expert_group = int(
            first.get_int(Keys.LLM.EXPERT_GROUP_COUNT.format(arch=arch), 0) or 0
        )
        self.n_expert_group_used = int(
            first.get_int(Keys.LLM.EXPERT_GROUP_USED_COUNT.format(arch=arch), 0) or 0
        )
        self.experts_per_chunk = int(
            first.get_int(Keys.LLM.EXPERTS_PER_GROUP.format(arch=arch), 0) or 0
        )
        self.nextn_layers = int(first.get_int(NEXTN_KEY.format(arch=arch), 0) or 0)
        self.tensor_shard: dict[str, int] = {}
        self.tensors: dict[str, TensorEntry] = {}
        for i, shard in enumerate(self.shards):
            for t in shard.tensors:
                if t.name in self.tensors:
                    raise BadInput(f"tensor {t.name!r} appears in two shards", shard.path)
                self.tensors[t.name] = t
                self.tensor_shard[t.name] = i
        # metadata that lies about the tensors (llama.cpp refuses the file): refused here, so
        # nothing below, nor any reader above, computes from a block count of 2**31 - 1
        check_hparams(first, arch, self.tensors, self.shard_paths[0])
        self.blocks: list[MoeBlock] = []
        self.flagged: list[FlaggedTensor] = []
        self.classification: dict[str, Classification] = {}
        # the leading blocks llama.cpp's graph runs (all of them when the file has no count)
        self.blocks_run = (
            blocks_run(arch, self.block_count, self.nextn_layers, self.tensors)
            if self.block_count
            else None
        )
        self._detect(assume_expert, assume_not_expert)
        self._check_top_k()
        self._fingerprint: str | None = None

    # ----------------------------------------------------------------- structure
    def _check_split(self) -> None:
        n = len(self.shards)
        split = Keys.Split
        if n == 1 and split.LLM_KV_SPLIT_COUNT not in self.shards[0].kv:
            return
        total = 0
        for i, shard in enumerate(self.shards):
            count = shard.get(split.LLM_KV_SPLIT_COUNT)
            no = shard.get(split.LLM_KV_SPLIT_NO)
            if count is None or no is None:
                raise BadInput(
                    f"shard lacks {split.LLM_KV_SPLIT_COUNT} / {split.LLM_KV_SPLIT_NO} metadata",
                    shard.path,
                )
            if int(count) != n or int(no) != i:
                raise BadInput(
                    f"shard says it is {int(no) + 1} of {int(count)}, expected {i + 1} of {n}",
                    shard.path,
                )
            total += len(shard.tensors)
        expected = self.shards[0].get(split.LLM_KV_SPLIT_TENSORS_COUNT)
        if expected is not None and int(expected) != total:
            raise BadInput(
                f"{split.LLM_KV_SPLIT_TENSORS_COUNT} is {int(expected)} but the shards hold "
                f"{total} tensors",
                self.shards[0].path,
            )

    def _check_top_k(self) -> None:
        """``BadInput`` naming the keys when a MoE file routes each token to none of its
        experts or to more than it has: llama.cpp refuses such a file at load (it asserts
        ``0 < n_expert_used <= n_expert``), so nothing moepack says about it could hold."""
        used_key = Keys.LLM.EXPERT_USED_COUNT.format(arch=self.architecture)
        count_key = Keys.LLM.EXPERT_COUNT.format(arch=self.architecture)
        if used_key not in self.shards[0].kv:
            return  # no routing metadata: experts found by shape alone, top-k unknown
        counts = [b.n_expert for b in self.blocks if b.n_expert > 0]
        if not counts and isinstance(self.n_expert_meta, int):
            counts = [self.n_expert_meta] if self.n_expert_meta > 0 else []
        if not counts:
            return  # no experts: a dense model's routing keys mean nothing
        fewest = min(counts)
        if self.top_k == 0:
            raise BadInput(
                f"{used_key} is 0 with {count_key} {fewest}: a MoE model routes every token to "
                "at least one expert (llama.cpp refuses the file)",
                self.shard_paths[0],
            )
        if self.top_k > fewest:
            raise BadInput(
                f"{used_key} is {self.top_k}, more than {count_key} {fewest}: a token cannot "
                "route to more experts than a block has (llama.cpp refuses the file)",
                self.shard_paths[0],
            )

    def expert_count_for(self, block: int) -> int:
        """The routed-expert count of ``block`` (scalar metadata or a per-layer array)."""
        v = self.n_expert_meta
        if isinstance(v, list):
            return int(v[block]) if block < len(v) else 0
        return int(v or 0)

    def _detect(self, assume_expert: tuple[str, ...], assume_not_expert: tuple[str, ...]) -> None:
        by_block: dict[int, list[str]] = {}
        for name in self.tensors:
            parts = split_block_name(name)
            if parts is not None:
                by_block.setdefault(parts[0], []).append(name)
        for b in sorted(by_block):
            n_expert = self.expert_count_for(b)
            runs = self.blocks_run is None or b < self.blocks_run
            block = MoeBlock(index=b, n_expert=n_expert, top_k=self.top_k, runs=runs)
            for name in by_block[b]:
                entry = self.tensors[name]
                c = classify(
                    name,
                    entry.ne,
                    n_expert,
                    assume_expert,
                    assume_not_expert,
                    GGML_QUANT_SIZES[entry.ggml_type][0],
                )
                self.classification[name] = c
                if c.role is Role.EXPERT:
                    block.tensors.append(
                        ExpertTensor(entry, self.tensor_shard[name], b, c.kind, n_expert)
                    )
                elif c.role in (Role.AMBIGUOUS, Role.GROUP_AXIS):
                    self.flagged.append(FlaggedTensor(name, b, c.role, c.reason))
            if block.weight_tensors:
                tables = [
                    n
                    for n in by_block[b]
                    if (split_block_name(n) or (0, ""))[1] in TOKEN_TABLE_BASES
                ]
                block.constraints = index_constraints(
                    self.architecture,
                    n_expert,
                    self.n_expert_group,
                    self.n_expert_group_used,
                    self.experts_per_chunk,
                    sorted(tables),
                )
                block.tensors.sort(key=lambda t: (t.shard, t.entry.offset))
                self.blocks.append(block)
            elif block.tensors:
                # Router-like tensors without expert matrices: not a MoE block we can reason about.
                for t in block.tensors:
                    self.flagged.append(
                        FlaggedTensor(
                            t.name,
                            b,
                            Role.AMBIGUOUS,
                            "expert-axis tensor in a block without expert matrices",
                        )
                    )

    @property
    def n_expert(self) -> int:
        """The expert count shared by all MoE blocks (0 if none, -1 if it varies)."""
        counts = {b.n_expert for b in self.blocks}
        return counts.pop() if len(counts) == 1 else (0 if not counts else -1)

    @property
    def moe_block_indices(self) -> list[int]:
        return [b.index for b in self.blocks]

    @property
    def run_block_indices(self) -> list[int]:
        """The MoE blocks llama.cpp runs (multi-token-prediction blocks left out)."""
        return [b.index for b in self.blocks if b.runs]

    @property
    def not_run_block_indices(self) -> list[int]:
        """MoE blocks llama.cpp loads but never runs (``checkpoint.nextn``)."""
        return [b.index for b in self.blocks if not b.runs]

    def block(self, index: int) -> MoeBlock:
        for b in self.blocks:
            if b.index == index:
                return b
        raise BadInput(f"block {index} is not a MoE block of this model", self.path)

    def ambiguous_in(self, block: int) -> list[FlaggedTensor]:
        return [f for f in self.flagged if f.block == block and f.role is Role.AMBIGUOUS]

    @property
    def file_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def expert_bytes(self) -> int:
        return sum(b.expert_bytes for b in self.blocks)

    # ----------------------------------------------------------------- identity
    def provenance(self) -> dict[str, object]:
        """moepack's own metadata keys recorded in this file (empty for an untouched model).

        ``repack`` writes the same keys into every shard; shards that disagree are an error."""
        found: list[tuple[int, list[bytes]]] = []
        for i, shard in enumerate(self.shards):
            keys = [k for k in shard.kv if k.startswith(REPACK_PREFIX)]
            found.append((i, [shard.raw_kv(k) for k in keys]))
        first = found[0][1]
        for i, raw in found[1:]:
            if raw != first:
                raise BadInput(
                    "shards disagree about moepack's provenance keys", self.shard_paths[i]
                )
        shard = self.shards[0]
        return {k: shard.kv[k].value() for k in shard.kv if k.startswith(REPACK_PREFIX)}

    @property
    def fingerprint(self) -> str:
        """Identity of this checkpoint *and its expert order*, cheap to compute.

        Hashes the metadata (moepack's and split keys aside), every tensor's name, type and
        shape, the first bytes of every tensor, and the first bytes of every expert slice of
        each block's smallest expert-shaped tensor. A repacked file therefore differs from its
        original (its slices moved), while a re-split copy of the same file does not.
        """
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256(b"moepack-fingerprint-v1\0")
        kvs: dict[str, bytes] = {}
        for shard in self.shards:
            raw = shard.reader.data
            for key, kv in shard.kv.items():
                if key.startswith(REPACK_PREFIX) or key in _SPLIT_KEYS:
                    continue
                kvs.setdefault(key, bytes(raw[kv.start : kv.end]))
        for key in sorted(kvs):
            h.update(kvs[key])
        for name in sorted(self.tensors):
            t = self.tensors[name]
            raw = self.shards[self.tensor_shard[name]].reader.data
            h.update(f"{name}\0{t.ggml_type.value}\0{t.ne}\0".encode())
            h.update(bytes(raw[t.offset : t.offset + min(t.n_bytes, 64)]))
        # Expert order: the first bytes of every slice of each block's smallest tensor whose
        # outermost dimension is the expert count (usually the router). Chosen by shape only,
        # so the identity does not depend on how tensors were classified.
        smallest: dict[int, TensorEntry] = {}
        for name, t in self.tensors.items():
            parts = split_block_name(name)
            ne = significant_ne(t.ne)
            if parts is None or not ne:
                continue
            e = self.expert_count_for(parts[0])
            if e > 1 and ne[-1] == e:
                cur = smallest.get(parts[0])
                if cur is None or (t.n_bytes, t.name) < (cur.n_bytes, cur.name):
                    smallest[parts[0]] = t
        for b in sorted(smallest):
            t = smallest[b]
            raw = self.shards[self.tensor_shard[t.name]].reader.data
            e = significant_ne(t.ne)[-1]
            step = t.n_bytes // e
            idx = t.offset + np.arange(e, dtype=np.int64)[:, None] * step
            idx = idx + np.arange(min(step, 16), dtype=np.int64)[None, :]
            h.update(np.asarray(raw[idx.ravel()]).tobytes())
        return h.hexdigest()[:32]

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def __enter__(self) -> MoeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
