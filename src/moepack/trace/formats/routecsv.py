"""BigMoeOnEdge's route trace CSV (``# route_trace v1``), captured from llama.cpp on device.

A ``#`` preamble (``model=… arch=… n_layer=… n_expert=… n_expert_used=…``, then per-layer
byte counts), a header row, then one row per routed expert:
``turn,phase,step,layer,slot,expert,weight[,residency,expert_bytes,dropped]``. Columns are read
by name; ``phase`` 0 is prefill and 1 decode; ``layer`` is the model's block index (dense
blocks never appear), so the distinct layers become the trace's block map; ``weight`` is
``nan`` when the runtime did not expose it.

Reading needs every token to route through every listed layer. llama.cpp sends only the last
prompt token through the final block during prefill, so prefill tokens that miss a layer are
dropped, and the provenance ``notes`` say how many. A trace has one prefill prefix: prefill
tokens of later turns count as decode (also noted). Written files carry the routing, phases,
weights (``nan`` when absent) and the model name; not the fingerprint or other provenance.
Writing needs a block map (the ``layer`` column is the model's block): a trace without one is
refused rather than written with invented block numbers.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ...errors import BadInput
from ...inputs import read_capped
from ..core import NEED_BLOCK_MAP, RoutingTrace, TraceNeeds, check_trace_shape, token_chunks
from ._api import FormatModule, ReadOptions, WriteOptions
from ._common import lost_items, resolve_n_expert
from ._textnum import format_rows

NAME = "routecsv"
EXTENSIONS = (".csv",)
DESCRIPTION = "BigMoeOnEdge route_trace v1 CSV (llama.cpp capture; long format)"
VERSIONS = (1,)
MAGIC = b"# route_trace v1"
REQUIRED = ("step", "layer", "slot", "expert")
_KV = re.compile(r"\b(n_layer|n_expert|n_expert_used)=(\d+)")
_KEPT_PROVENANCE = ("source", "model", "arch")
# The file is parsed as text in memory (Python rows, many times its size at the peak), so
# larger files are refused up front rather than allowed to exhaust memory.
MAX_ROUTE_CSV = 256 << 20


def detect(head: bytes) -> bool:
    return head.startswith(MAGIC)


def _preamble(lines: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for line in lines:
        body = line.lstrip("#").strip()
        if body.startswith("model="):
            m = re.match(r"model=(.*?)\s+arch=(\S*)", body)
            if m:
                meta["model"], meta["arch"] = m.group(1), m.group(2)
            for key, value in _KV.findall(body):
                meta[key] = int(value)
    return meta


MAX_FIELD = 1 << 20  # the longest field a route CSV may hold (the model name, at most)


def _column(rows: list[list[str]], idx: int, name: str, first_line: int, path: Path) -> np.ndarray:
    col = [r[idx] if idx < len(r) else "" for r in rows]
    try:
        return np.array(col, dtype=np.int64)
    except (ValueError, OverflowError):  # find the culprit for the message
        for i, v in enumerate(col):
            try:
                fits = -(1 << 63) <= int(v) < 1 << 63
            except ValueError:
                fits = None
            if fits is not True:
                shown = v if len(v) <= 40 else v[:40] + "…"
                why = "not an integer" if fits is None else "out of range"
                raise BadInput(
                    f"line {first_line + i}: column {name!r} holds {shown!r}, {why}", path
                ) from None
        raise BadInput(f"column {name!r} holds a value that is not an integer", path) from None


def _text(path: Path) -> str:
    data = read_capped(path, "route trace", MAX_ROUTE_CSV)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise BadInput(
            f"line {line}: byte {data[e.start]:#04x} at offset {e.start:,} is not UTF-8 text",
            path,
        ) from None


def _csv_rows(body: str, first_line: int, path: Path) -> list[list[str]]:
    """The CSV rows of ``body``, a field over ``MAX_FIELD`` or a NUL byte a one-line error."""
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_FIELD)
    reader = csv.reader(io.StringIO(body))
    try:
        return list(reader)
    except csv.Error as e:
        raise BadInput(f"line {first_line + reader.line_num - 1}: not CSV ({e})", path) from None
    finally:
        csv.field_size_limit(limit)


def read(path: Path, options: ReadOptions) -> RoutingTrace:
    text = _text(path)
    all_lines = text.splitlines()
    n_pre = 0
    while n_pre < len(all_lines) and all_lines[n_pre].startswith("#"):
        n_pre += 1
    if not all_lines or not all_lines[0].startswith(MAGIC.decode()):
        raise BadInput(f"not a route trace: the first line must be {MAGIC.decode()!r}", path)
    meta = _preamble(all_lines[:n_pre])
    if n_pre >= len(all_lines):
        raise BadInput("route trace has no header row", path)
    table = _csv_rows("\n".join(all_lines[n_pre:]), n_pre + 1, path)
    del text, all_lines
    header = [h.strip() for h in table[0]]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise BadInput(f"route trace header lacks column(s) {', '.join(missing)}", path)
    rows = [r for r in table[1:] if r and any(c.strip() for c in r)]
    del table
    if not rows:
        raise BadInput("route trace has no routing rows", path)
    first = n_pre + 2
    widths = {len(r) for r in rows}
    if min(widths) < len(header):
        i = next(i for i, r in enumerate(rows) if len(r) < len(header))
        raise BadInput(
            f"line {first + i}: {len(rows[i])} fields, the header has {len(header)}", path
        )
    col = {name: i for i, name in enumerate(header)}

    def ints(name: str, default: int) -> np.ndarray:
        if name not in col:
            return np.full(len(rows), default, dtype=np.int64)
        return _column(rows, col[name], name, first, path)

    turn, phase, step = ints("turn", 0), ints("phase", 1), ints("step", 0)
    layer, slot, expert = ints("layer", 0), ints("slot", 0), ints("expert", 0)
    for name, arr in (("phase", phase), ("layer", layer), ("slot", slot), ("expert", expert)):
        if arr.min() < 0:
            i = int(np.argmax(arr < 0))
            raise BadInput(f"line {first + i}: negative {name} {int(arr[i])}", path)
    if not np.isin(phase, (0, 1)).all():
        i = int(np.argmax(~np.isin(phase, (0, 1))))
        raise BadInput(f"line {first + i}: phase must be 0 (prefill) or 1 (decode)", path)

    n_expert = resolve_n_expert(
        meta.get("n_expert"),
        options.n_expert,
        options.n_expert_source,
        path,
        declared_by="the preamble says",
        missing="route trace preamble has no n_expert",
    )
    k = meta.get("n_expert_used") or int(slot.max()) + 1
    if k > n_expert:
        raise BadInput(
            f"the preamble says n_expert_used={k}, more than its {n_expert} experts"
            if meta.get("n_expert_used")
            else f"slot {k - 1} is routed, but there are only {n_expert} experts",
            path,
        )
    if int(slot.max()) >= k:
        i = int(np.argmax(slot >= k))
        raise BadInput(f"line {first + i}: slot {int(slot[i])} but n_expert_used is {k}", path)
    if int(expert.max()) >= n_expert:
        i = int(np.argmax(expert >= n_expert))
        raise BadInput(
            f"line {first + i}: expert id {int(expert[i])} is out of range for {n_expert} experts",
            path,
        )

    keys = np.stack([turn, phase, step], axis=1)
    tok_keys, tok_idx = np.unique(keys, axis=0, return_inverse=True)
    tok_idx = tok_idx.reshape(-1)
    blocks, layer_idx = np.unique(layer, return_inverse=True)
    layer_idx = layer_idx.reshape(-1)
    n_tok, n_layer = len(tok_keys), len(blocks)
    check_trace_shape(n_expert, n_layer, k, path, "the route trace")
    # Everything below is sized by the rows present, never by tokens × layers: a file whose
    # tokens each name a different layer must not make the reader allocate their product.
    pair = tok_idx * n_layer + layer_idx  # (token, layer), < rows² < 2**63
    cell = pair * k + slot
    order = np.argsort(cell, kind="stable")
    sc = cell[order]
    dup = np.flatnonzero(sc[1:] == sc[:-1])
    if dup.size:
        a, b = order[dup[0]], order[dup[0] + 1]
        raise BadInput(f"lines {first + a} and {first + b} route the same slot twice", path)
    pairs, per_pair = np.unique(pair, return_counts=True)
    partial = np.flatnonzero(per_pair < k)
    if partial.size:
        t, li = divmod(int(pairs[partial[0]]), n_layer)
        tk = tok_keys[t]
        raise BadInput(
            f"turn {tk[0]} step {tk[2]} layer {int(blocks[li])} lists "
            f"{int(per_pair[partial[0]])} of {k} slots",
            path,
        )
    pair_tok = pairs // n_layer
    complete = np.bincount(pair_tok, minlength=n_tok) == n_layer
    notes: list[str] = []
    incomplete = np.flatnonzero(~complete)
    if incomplete.size:
        decode_bad = incomplete[tok_keys[incomplete, 1] == 1]
        if decode_bad.size:
            t = int(decode_bad[0])
            have = set((pairs[pair_tok == t] % n_layer).tolist())
            li = next(i for i in range(n_layer) if i not in have)
            raise BadInput(
                f"decode token at turn {tok_keys[t, 0]} step {tok_keys[t, 2]} has no routing for "
                f"layer {int(blocks[li])}",
                path,
            )
        in_incomplete = ~complete[pair_tok]
        seen = np.bincount(pairs[in_incomplete] % n_layer, minlength=n_layer)
        missing_layers = [int(blocks[li]) for li in np.flatnonzero(seen < incomplete.size)]
        notes.append(
            f"dropped {incomplete.size} prefill tokens that do not route through every layer "
            f"(missing layer(s) {missing_layers}; llama.cpp routes only the last prompt token "
            "through the final block)"
        )
    keep = np.flatnonzero(complete)
    if keep.size == 0:
        raise BadInput("no token routes through every layer", path)
    new_tok = np.cumsum(complete) - 1  # a kept token's place among the kept ones
    kept_rows = complete[tok_idx]
    kept_cell = (new_tok[tok_idx[kept_rows]] * n_layer + layer_idx[kept_rows]) * k + slot[kept_rows]
    ids_kept = np.zeros(keep.size * n_layer * k, dtype=np.int64)
    ids_kept[kept_cell] = expert[kept_rows]
    ids_all = ids_kept.reshape(keep.size, n_layer, k)
    phases = tok_keys[keep, 1]
    prefill = int(np.argmax(phases != 0)) if (phases != 0).any() else int(phases.size)
    late_prefill = int(np.count_nonzero(phases[prefill:] == 0))
    if late_prefill:
        notes.append(
            f"{late_prefill} prefill tokens of later turns are counted as decode "
            "(a trace has one prefill prefix)"
        )
    weights = None
    if "weight" in col:
        try:
            w_all = np.array([r[col["weight"]] for r in rows], dtype=np.float64)
        except (ValueError, OverflowError):
            raise BadInput("column 'weight' holds a value that is not a number", path) from None
        if np.isfinite(w_all).all():
            w_kept = np.zeros(keep.size * n_layer * k, dtype=np.float32)
            with np.errstate(over="ignore"):
                w_kept[kept_cell] = w_all[kept_rows]
            if not np.isfinite(w_kept).all():
                raise BadInput("column 'weight' holds a value too large for float32", path)
            weights = w_kept.reshape(keep.size, n_layer, k)
        elif np.isfinite(w_all).any():
            notes.append("router weights dropped: some are nan (not exposed by the runtime)")
    dtype = np.uint8 if n_expert <= 256 else (np.uint16 if n_expert <= 65536 else np.uint32)
    provenance: dict[str, Any] = {"source": "route_trace v1"}
    for key in ("model", "arch"):
        if meta.get(key):
            provenance[key] = meta[key]
    if notes:
        provenance["notes"] = notes
    return RoutingTrace(
        ids=ids_all.astype(dtype),
        n_expert=n_expert,
        weights=weights,
        prefill_tokens=prefill,
        block_map=[int(b) for b in blocks],
        provenance=provenance,
        path=path,
    )


def lost(trace: RoutingTrace, options: WriteOptions) -> list[str]:
    carries = ["weights", "prefill", "block_map", "provenance"]
    out = lost_items(trace, carries)
    extra = sorted(k for k in trace.provenance if k not in _KEPT_PROVENANCE)
    if extra:
        out.append(f"provenance ({', '.join(extra)})")
    return out


def write(trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> None:
    if trace.block_map is None:
        raise TraceNeeds(
            "a route trace names the model's block of every row, and this trace has no block "
            "map to say which blocks its layers are",
            options.path,
            need=NEED_BLOCK_MAP,
        )
    prov = trace.provenance
    blocks = np.array(trace.block_map)
    n_layer = int(blocks.max()) + 1
    model = str(prov.get("model", "")).replace("\n", " ")
    arch = str(prov.get("arch", "")).replace(" ", "_").replace("\n", "")
    fh.write(
        (
            f"{MAGIC.decode()}\n# model={model} arch={arch} n_layer={n_layer} "
            f"n_expert={trace.n_expert} n_expert_used={trace.k}\n"
            "turn,phase,step,layer,slot,expert,weight\n"
        ).encode()
    )
    L, k = trace.layers, trace.k
    options.progress.start("writing route trace", trace.tokens, unit="tokens")
    try:
        for sl in token_chunks(trace.tokens, L * k * 7, 1 << 21):
            ids = np.asarray(trace.ids[sl]).reshape(-1)
            n = sl.stop - sl.start
            tok = np.arange(sl.start, sl.stop, dtype=np.int64)
            rows = np.empty((ids.size, 6), dtype=np.int64)
            rows[:, 0] = 0
            rows[:, 1] = np.repeat((tok >= trace.leading_prefill).astype(np.int64), L * k)
            rows[:, 2] = np.repeat(tok, L * k)
            rows[:, 3] = np.tile(np.repeat(blocks, k), n)
            rows[:, 4] = np.tile(np.arange(k), n * L)
            rows[:, 5] = ids
            body = format_rows(rows).replace(b" ", b",")
            if trace.weights is None:
                fh.write(body.replace(b"\n", b",nan\n"))
            else:
                w = np.asarray(trace.weights[sl]).reshape(-1).tolist()
                lines = body.split(b"\n")[:-1]
                fh.write(
                    b"".join(
                        a + b"," + f"{x:.9g}".encode() + b"\n"
                        for a, x in zip(lines, w, strict=True)
                    )
                )
            options.progress.advance(n)
    finally:
        options.progress.finish()


PLUGIN = FormatModule(__name__)
