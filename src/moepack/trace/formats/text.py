"""The text trace: one line per (token, layer), ``<token> <layer> <expert> <expert> …``.

Whitespace-separated, ``#`` starts a comment, lines in any order, every (token, layer) pair
exactly once, the same number of experts on every line. This is the peer tool's documented
text form (which its own command line cannot read).

The expert count is never guessed from the largest id: it comes from the caller (``n_expert``,
``--n-expert``), from the model, or from a declaration line that moepack writes at the top::

    # moepack: n_expert=128 prefill_tokens=16 block_map=0,1,2,3 model_fingerprint=ab12…

A ``#`` line is a comment to every other reader, so files written here stay plain text traces.
Router weights and provenance are not carried. Parsing and formatting are vectorised.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...blocklist import parse_index_list
from ...errors import BadInput
from ...inputs import regular_file
from ..core import RoutingTrace, _first_duplicate, id_dtype_for, token_chunks
from ._api import FormatModule, ReadOptions, WriteOptions
from ._common import (
    CARRY_BLOCK_MAP,
    CARRY_FINGERPRINT,
    CARRY_PREFILL,
    lost_items,
    resolve_n_expert,
)
from ._textnum import LineBlock, format_rows, iter_numeric_lines

NAME = "text"
EXTENSIONS = (".txt", ".trace", ".tsv")
DESCRIPTION = "text, one line per (token, layer): token layer expert expert ..."
VERSIONS = (1,)
CARRIES = (CARRY_PREFILL, CARRY_BLOCK_MAP, CARRY_FINGERPRINT)
_KEYS = ("n_expert", "prefill_tokens", "block_map", "model_fingerprint")


def detect(head: bytes) -> bool:
    return False  # no magic: recognised by extension or named explicitly


def _directives(found: list[tuple[int, bytes]], path: Path) -> dict[str, object]:
    meta: dict[str, object] = {}
    for line, text in found:
        for item in text.decode("utf-8", "replace").split():
            key, eq, value = item.partition("=")
            if not eq:
                raise BadInput(f"line {line}: moepack declaration {item!r} is not key=value", path)
            if key not in _KEYS:
                continue  # a newer writer's key: not ours to interpret
            if key in meta:
                raise BadInput(f"line {line}: {key} is declared twice", path)
            try:
                if key in ("n_expert", "prefill_tokens"):
                    meta[key] = int(value)
                elif key == "block_map":
                    meta[key] = None if value == "none" else parse_index_list(value, what=key)
                else:
                    meta[key] = None if value == "none" else value
            except ValueError:
                raise BadInput(f"line {line}: bad value in {item!r}", path) from None
            except BadInput as e:
                raise BadInput(f"line {line}: {e.message}", path) from None
    return meta


def _smallest(values: np.ndarray) -> np.ndarray:
    top = int(values.max()) if values.size else 0
    dt = np.uint8 if top < 1 << 8 else np.uint16 if top < 1 << 16 else np.uint32
    return values.astype(dt) if top < 1 << 32 else values.astype(np.int64)


def _refuse_first(block: LineBlock, bad: np.ndarray, path: Path, why: str) -> None:
    """BadInput naming the first line ``bad`` flags; ``why`` may name its ``{numbers}`` and
    ``{experts}`` (numbers less token and layer)."""
    if bad.any():
        i = int(np.argmax(bad))
        n = int(block.counts[i])
        raise BadInput(f"line {int(block.lines[i])}: " + why.format(numbers=n, experts=n - 2), path)


def read(path: Path, options: ReadOptions) -> RoutingTrace:
    regular_file(path, "trace file")
    found: list[tuple[int, bytes]] = []
    tokens: list[np.ndarray] = []
    layers: list[np.ndarray] = []
    experts: list[np.ndarray] = []
    row_lines: list[np.ndarray] = []
    width: int | None = None
    width_line = 0
    for block in iter_numeric_lines(path, found):
        if block.lines.size == 0:
            continue
        _refuse_first(
            block,
            block.counts < 3,
            path,
            "expected '<token> <layer> <expert> ...', got {numbers} number(s)",
        )
        if width is None:
            width, width_line = int(block.counts[0]), int(block.lines[0])
        _refuse_first(
            block,
            block.counts != width,
            path,
            f"{{experts}} experts, but line {width_line} has {width - 2} "
            "(every line must list the same number)",
        )
        table = block.values.reshape(-1, width)
        tokens.append(table[:, 0].astype(np.int64))
        layers.append(table[:, 1].astype(np.int64))
        experts.append(_smallest(table[:, 2:]))
        row_lines.append(block.lines)
        del table, block
    meta = _directives(found, path)
    if width is None:
        raise BadInput("text trace holds no (token, layer) lines", path)
    declared = meta.get("n_expert")
    assert declared is None or isinstance(declared, int)
    n_expert = resolve_n_expert(
        declared,
        options.n_expert,
        options.n_expert_source,
        path,
        declared_by="the file declares",
        missing="text trace does not say how many experts each layer has",
    )
    k = width - 2
    ex = np.concatenate(experts)
    lines = np.concatenate(row_lines)
    del experts, row_lines
    if int(ex.max()) >= n_expert:
        r, j = np.argwhere(ex >= n_expert)[0]
        raise BadInput(
            f"line {int(lines[r])}: expert id {int(ex[r, j])} is out of range for "
            f"{n_expert} experts",
            path,
        )
    dup = _first_duplicate(ex)
    if dup is not None:
        raise BadInput(
            f"line {int(lines[dup])}: an expert appears twice in {ex[dup].tolist()}", path
        )
    token, layer = np.concatenate(tokens), np.concatenate(layers)
    n_tokens, n_layers = int(token.max()) + 1, int(layer.max()) + 1
    key = token * n_layers + layer
    del tokens, layers
    in_order = bool(np.all(key[1:] > key[:-1]))  # what moepack writes: no sort needed
    order = np.arange(key.size) if in_order else np.argsort(key, kind="stable")
    sk = key if in_order else key[order]
    dups = np.flatnonzero(sk[1:] == sk[:-1])
    if dups.size:
        a, b = order[dups[0]], order[dups[0] + 1]
        raise BadInput(
            f"token {int(token[a])} layer {int(layer[a])} appears twice (lines "
            f"{int(lines[a])} and {int(lines[b])})",
            path,
        )
    if sk.size != n_tokens * n_layers:
        differs = np.flatnonzero(sk != np.arange(sk.size, dtype=np.int64))
        gap = int(differs[0]) if differs.size else int(sk.size)
        t, l_ = divmod(gap, n_layers)
        raise BadInput(
            f"token {t} layer {l_} is missing: the lines cover {n_tokens} tokens × {n_layers} "
            f"layers, and every (token, layer) must appear exactly once",
            path,
        )
    dtype = id_dtype_for(n_expert)
    ids = (ex if in_order else ex[order]).astype(dtype, copy=False).reshape(n_tokens, n_layers, k)
    return RoutingTrace(
        ids=ids,
        n_expert=n_expert,
        prefill_tokens=int(meta.get("prefill_tokens", 0) or 0),  # type: ignore[call-overload]
        block_map=meta.get("block_map"),  # type: ignore[arg-type]
        model_fingerprint=meta.get("model_fingerprint"),  # type: ignore[arg-type]
        provenance={"source": "text"},
        path=path,
    )


def lost(trace: RoutingTrace, options: WriteOptions) -> list[str]:
    return lost_items(trace, CARRIES)


def header(trace: RoutingTrace) -> bytes:
    bm = ",".join(map(str, trace.block_map)) if trace.block_map is not None else "none"
    fp = trace.model_fingerprint or "none"
    return (
        f"# moepack routing trace, text form: <token> <layer> then {trace.k} expert ids; "
        f"{trace.tokens} tokens x {trace.layers} layers\n"
        f"# moepack: n_expert={trace.n_expert} prefill_tokens={trace.leading_prefill} "
        f"block_map={bm} model_fingerprint={fp}\n"
    ).encode()


def write(trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> None:
    fh.write(header(trace))
    n_layers, k = trace.layers, trace.k
    options.progress.start("writing text trace", trace.tokens, unit="tokens")
    try:
        for sl in token_chunks(trace.tokens, n_layers * (k + 2), 1 << 21):
            ids = np.asarray(trace.ids[sl]).reshape(-1, k)
            n = sl.stop - sl.start
            rows = np.empty((ids.shape[0], k + 2), dtype=np.int64)
            rows[:, 0] = np.repeat(np.arange(sl.start, sl.stop, dtype=np.int64), n_layers)
            rows[:, 1] = np.tile(np.arange(n_layers, dtype=np.int64), n)
            rows[:, 2:] = ids
            fh.write(format_rows(rows))
            options.progress.advance(n)
    finally:
        options.progress.finish()


PLUGIN = FormatModule(__name__)
