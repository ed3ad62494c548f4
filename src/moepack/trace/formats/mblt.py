"""mbolt's routing log, ``MBLT`` version 1, read and written.

A little-endian int32 stream: ``0x544C424D`` ("MBLT"), version 1, n_expert; then records
``layer, k, n_tokens, ids[n_tokens * k]`` (token-major) in graph order, layers ascending
within one forward pass. ``layer`` is the GGUF block (mbolt's patch reads llama.cpp's
``<name>-<il>`` nodes), so the layers a log names are its block map.

Passes: a record whose layer is not above the previous one starts a new forward pass. Decode
passes route one token; in a prefill pass llama.cpp routes only the last token at the final
layer (it prunes outputs nobody asked for), so that record is shorter. A ``RoutingTrace``
holds complete tokens only: of such a pruned pass the reader keeps the last token and counts
the others in ``provenance["mblt"]["pruned_tokens"]``. Prompts are inferred (a prefill pass
after a decode pass starts a new one) into the trace's prompt segments (and
``provenance["mblt"]["passes"]``).

Written from a ``RoutingTrace``: the prefill of each captured prompt as one pass with full
records (nothing pruned: the trace has every layer of every token), each decode token as its
own pass. The format carries no router weights, fingerprint or provenance.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...errors import BadInput
from ..core import (
    CHUNK_CELLS,
    MAX_EXPERTS,
    MAX_LAYER_EXPERTS,
    MAX_LAYERS,
    PromptSegment,
    RoutingTrace,
    id_dtype_for,
)
from ._api import FormatModule, ReadOptions, WriteOptions
from ._common import (
    CARRY_BLOCK_MAP,
    CARRY_PREFILL,
    CARRY_SEGMENTS,
    file_size,
    lost_items,
    read_exact_head,
)

NAME = "mblt"
EXTENSIONS = (".mblt",)
DESCRIPTION = "mbolt's MBLT v1 routing log (int32 records per layer and forward pass)"
VERSIONS = (1,)
ORDER = 200  # listed after moepack's own and the older peers' formats
MAGIC = 0x544C424D
_HEAD = struct.Struct("<iii")
MAGIC_BYTES = struct.pack("<i", MAGIC)


def detect(head: bytes) -> bool:
    return head.startswith(MAGIC_BYTES)


def lost(trace: RoutingTrace, options: WriteOptions) -> list[str]:
    # a prompt's prefill is one multi-token pass: one of a single token reads as decode
    whole = trace.segments is None or all(s.prefill >= 2 for s in trace.segments)
    return lost_items(
        trace, (CARRY_BLOCK_MAP, CARRY_PREFILL) + ((CARRY_SEGMENTS,) if whole else ())
    )


class _Passes:
    """Accumulates the records of one forward pass and turns finished passes into tokens."""

    def __init__(self, path: Path, n_expert: int) -> None:
        self.path = path
        self.layers: list[int] | None = None
        self.k: int | None = None
        self.rows: list[np.ndarray] = []  # complete tokens, [n, layers, k], in order
        self.dtype = id_dtype_for(n_expert)
        self.n_expert = n_expert
        self.pruned = 0
        self.max_layers = min(MAX_LAYERS, MAX_LAYER_EXPERTS // n_expert)
        self.passes: list[tuple[int, int]] = []  # (tokens kept, phase: 1 prefill / 0 decode)
        self._cur: list[tuple[int, np.ndarray]] = []

    def add(self, layer: int, k: int, ids: np.ndarray, offset: int) -> None:
        if self.k is None:
            self.k = k
        elif k != self.k:
            raise BadInput(f"record at byte {offset}: k={k}, earlier records {self.k}", self.path)
        if self._cur and layer <= self._cur[-1][0]:
            self.end()
        if self.layers is None and len(self._cur) + 1 > self.max_layers:
            # refused as it grows, before a pass of a million records is gathered
            raise BadInput(
                f"record at byte {offset}: the first forward pass routes more than "
                f"{self.max_layers:,} layers (moepack accepts at most {MAX_LAYERS:,} layers and "
                f"{MAX_LAYER_EXPERTS:,} (layer, expert) pairs; the log has {self.n_expert:,} "
                "experts)",
                self.path,
            )
        if self.layers is not None and len(self._cur) >= len(self.layers):
            raise BadInput(
                f"record at byte {offset}: forward pass {len(self.passes) + 1} routes more "
                f"layers than the {len(self.layers)} of earlier passes",
                self.path,
            )
        self._cur.append((layer, ids.reshape(-1, k)))

    def add_decode_block(self, rows: np.ndarray, k: int) -> int:
        """Take whole one-token passes from ``rows`` (records ``[m, 3 + k]``) at once, when
        they start a pass and repeat the known layer order; return how many records."""
        if self._cur and rows.shape[0] and rows[0, 0] <= self._cur[-1][0]:
            self.end()  # the first record starts a new pass, as ``add`` would find
        if self._cur or self.layers is None or self.k != k:
            return 0
        n_layers = len(self.layers)
        q = rows.shape[0] // n_layers
        if q == 0:
            return 0
        lay = rows[: q * n_layers, 0].reshape(q, n_layers)
        good = np.all(lay == np.asarray(self.layers)[None, :], axis=1)
        q = int(np.argmin(good)) if not good.all() else q
        if q == 0:
            return 0
        block = rows[: q * n_layers, 3:].reshape(q, n_layers, k)
        if block.min() < 0 or block.max() >= self.n_expert:
            return 0  # let the record-by-record path name the bad record
        self.rows.append(block.astype(self.dtype))
        self.passes.extend([(1, 0)] * q)
        return q * n_layers

    def end(self) -> None:
        if not self._cur:
            return
        layers = [la for la, _ in self._cur]
        if self.layers is None:
            self.layers = layers
        elif layers != self.layers:
            raise BadInput(
                f"forward pass {len(self.passes) + 1} routes layers {layers}, earlier passes "
                f"{self.layers}",
                self.path,
            )
        n = self._cur[0][1].shape[0]
        counts = [a.shape[0] for _, a in self._cur]
        if all(c == n for c in counts):
            kept = [a for _, a in self._cur]
        elif counts[-1] == 1 and all(c == n for c in counts[:-1]):
            kept = [a[-1:] for _, a in self._cur]  # the last layer was pruned to the last token
            self.pruned += n - 1
        else:
            raise BadInput(
                f"forward pass {len(self.passes) + 1} routes {counts} tokens per layer "
                "(only the final layer of a prefill may route fewer, and then one)",
                self.path,
            )
        block = np.stack(kept, axis=1)
        if block.size and (block.min() < 0 or block.max() >= self.n_expert):
            raise BadInput(
                f"forward pass {len(self.passes) + 1}: expert id out of range for "
                f"{self.n_expert} experts",
                self.path,
            )
        self.rows.append(block.astype(self.dtype))
        self.passes.append((block.shape[0], 1 if n > 1 else 0))
        self._cur = []


def read(path: Path, options: ReadOptions) -> RoutingTrace:
    head = read_exact_head(path, _HEAD.size, "MBLT magic, version and expert count")
    magic, version, n_expert = _HEAD.unpack(head)
    if magic != MAGIC:
        raise BadInput(f"not an MBLT log: magic is {magic:#x}, expected {MAGIC:#x}", path)
    if version != 1:
        raise BadInput(f"unsupported MBLT version {version} (this reads version 1)", path)
    if not 1 <= n_expert <= MAX_EXPERTS:
        raise BadInput(
            f"MBLT header says n_expert={n_expert:,}; moepack accepts 1 to {MAX_EXPERTS:,}", path
        )
    if options.n_expert is not None and options.n_expert != n_expert:
        given = options.n_expert_source or "n_expert was given as"
        raise BadInput(f"the header says n_expert={n_expert}, but {given} {options.n_expert}", path)
    size = file_size(path)
    if (size - _HEAD.size) % 4:
        raise BadInput(f"trailing bytes: {size - _HEAD.size} after the header is not int32s", path)
    words = np.memmap(path, dtype="<i4", mode="r", offset=_HEAD.size) if size > 12 else None
    if words is None:
        raise BadInput("the MBLT log holds no records", path)
    acc = _Passes(path, n_expert)
    _walk(words, acc, path)
    acc.end()
    if not acc.rows:
        raise BadInput("the MBLT log holds no complete token", path)
    ids = np.concatenate(acc.rows)
    runs = _runs(acc)
    return RoutingTrace(
        ids=ids,
        n_expert=n_expert,
        segments=[PromptSegment(r["start"], r["prefill"], r["decode"]) for r in runs],
        block_map=acc.layers,
        provenance={"mblt": {"version": 1, "pruned_tokens": acc.pruned, "passes": runs}},
        path=path,
    )


def _runs(acc: _Passes) -> list[dict[str, int]]:
    """Prompt segments inferred from the passes: ``{start, prefill, decode}``."""
    out: list[dict[str, int]] = []
    pos = 0
    for n, prefill in acc.passes:
        if prefill and (not out or out[-1]["decode"]):
            out.append({"start": pos, "prefill": 0, "decode": 0})
        if not out:
            out.append({"start": pos, "prefill": 0, "decode": 0})
        out[-1]["prefill" if prefill else "decode"] += n
        pos += n
    return out


def _walk(words: np.ndarray, acc: _Passes, path: Path) -> None:
    """Read every record; runs of one-token records are taken in whole vectorised blocks."""
    total = words.shape[0]
    p = 0
    while p < total:
        if p + 3 > total:
            raise BadInput(f"truncated: a record header at byte {12 + 4 * p} is cut off", path)
        layer, k, n = (int(v) for v in words[p : p + 3])
        if layer < 0 or k < 1 or k > acc.n_expert or n < 1:
            raise BadInput(
                f"record at byte {12 + 4 * p}: layer {layer}, k {k}, n_tokens {n} (k must be "
                f"1..{acc.n_expert}, n_tokens >= 1)",
                path,
            )
        if n == 1:
            stride = 3 + k
            m = min((total - p) // stride, max(1, CHUNK_CELLS // stride))
            if m == 0:
                raise BadInput(
                    f"truncated: the record at byte {12 + 4 * p} needs {k} ids, the file "
                    f"holds {total - p - 3}",
                    path,
                )
            rows = np.asarray(words[p : p + m * stride]).reshape(m, stride)
            ok = (rows[:, 1] == k) & (rows[:, 2] == 1) & (rows[:, 0] >= 0)
            bad = np.flatnonzero(~ok)
            m = int(bad[0]) if bad.size else m
            taken = acc.add_decode_block(rows[:m], k)
            for r in rows[taken:m]:
                acc.add(int(r[0]), k, r[3:], 12 + 4 * p + 4 * stride * taken)
                p += stride
            p += taken * stride
            continue
        end = p + 3 + n * k
        if end > total:
            raise BadInput(
                f"truncated: the record at byte {12 + 4 * p} needs {n * k} ids, the file "
                f"holds {total - p - 3}",
                path,
            )
        acc.add(layer, k, np.asarray(words[p + 3 : end]), 12 + 4 * p)
        p = end


def _passes_of(trace: RoutingTrace) -> list[tuple[int, int]]:
    """(start, n_tokens) of every forward pass to write: each prompt's prefill as one pass,
    then one pass per decoded token."""
    out: list[tuple[int, int]] = []
    for s in trace.prompt_segments:
        if s.prefill:
            out.append((s.start, s.prefill))
        out += [(s.start + s.prefill + i, 1) for i in range(s.decode)]
    return out


def write(trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> None:
    layers = trace.block_map if trace.block_map is not None else list(range(trace.layers))
    k = trace.k
    fh.write(_HEAD.pack(MAGIC, 1, trace.n_expert))
    options.progress.start("writing MBLT", trace.tokens, unit="tok")
    try:
        passes = _passes_of(trace)
        i = 0
        while i < len(passes):
            start, n = passes[i]
            if n > 1:
                ids = np.asarray(trace.ids[start : start + n]).astype("<i4")
                for li, layer in enumerate(layers):
                    fh.write(struct.pack("<iii", layer, k, n))
                    fh.write(np.ascontiguousarray(ids[:, li, :]).tobytes())
                options.progress.advance(n)
                i += 1
                continue
            j = i  # a run of consecutive one-token passes, written as one block
            limit = max(1, CHUNK_CELLS // max(1, trace.layers * (3 + k)))
            while (
                j < len(passes)
                and passes[j][1] == 1
                and passes[j][0] == start + (j - i)
                and j - i < limit
            ):
                j += 1
            m = j - i
            block = np.empty((m, trace.layers, 3 + k), dtype="<i4")
            block[:, :, 0] = np.asarray(layers, dtype="<i4")[None, :]
            block[:, :, 1] = k
            block[:, :, 2] = 1
            block[:, :, 3:] = np.asarray(trace.ids[start : start + m])
            fh.write(block.tobytes())
            options.progress.advance(m)
            i = j
    finally:
        options.progress.finish()


PLUGIN = FormatModule(__name__)
