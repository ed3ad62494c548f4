"""``RoutingTrace``: which experts the router chose, per token and MoE layer.

A trace is an integer array ``ids[tokens, layers, k]`` (token-major, then layer, then the
router's k choices), optional router weights of the same shape, the expert count, the prompt
segments (each prompt's tokens are contiguous, prefill first, then decode), the map from trace
layer to GGUF block, the fingerprint of the model it was recorded on, and free-form provenance.

Segments: a trace of one prompt needs only the prefix split (tokens ``[0, prefill_tokens)``
are prefill, the rest decode), which is what every format has always carried; a capture of
several prompts has one ``PromptSegment(start, prefill, decode)`` per prompt, covering the tokens in
order. Everything that asks about phases goes through the accessors (``phase_mask``,
``phase_rows``, ``phase_runs``, ``phase_tokens``, ``token_prompts``, ``prompt_split``), so
decode statistics never take another prompt's prefill for decode.

Every trace is validated when it is built, whatever it came from: a ``RoutingTrace`` that
exists has ids in range, no expert twice in one (token, layer) row, and a consistent shape.
Validation walks the ids in bounded chunks, so a trace backed by a memory map of a large file
is checked without loading it whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..blocklist import format_index_list
from ..errors import BadInput

if TYPE_CHECKING:
    from ..checkpoint.model import MoeModel

# What a ``TraceNeeds`` error says is missing (front ends map these to their own options).
NEED_FORMAT = "format"  # the format of an input trace could not be detected
NEED_OUTPUT_FORMAT = "output_format"  # the format to write could not be told from the name
NEED_BLOCK_MAP = "block_map"  # which GGUF blocks the trace layers are is unknown
NEED_N_EXPERT = "n_expert"  # the trace does not record its expert count


class TraceNeeds(BadInput):
    """``BadInput`` for a fact the trace lacks that the caller could supply.

    The message says what is missing, never which command-line option supplies it (the
    library is called from commands with different options, and from Python). ``need`` is one
    of the ``NEED_*`` names, for a front end to add its own hint: ``moepack trace`` does.
    """

    def __init__(
        self, message: str, path: str | os.PathLike[str] | None = None, *, need: str
    ) -> None:
        super().__init__(message, path)
        self.need = need

    def with_hint(self, hint: str) -> TraceNeeds:
        """The same error with ``hint`` (e.g. the option that supplies the fact) appended."""
        return TraceNeeds(f"{self.message}; {hint}", self.path, need=self.need)


# Rows (one token, all layers) examined per validation / statistics chunk: bounded memory.
CHUNK_CELLS = 1 << 20
# Sane limits on what a trace may declare. Statistics allocate [layers, n_expert] counts, so a
# flipped bit in a count must be refused, not allocated. Real MoE models have at most a few
# hundred experts and about a hundred layers; the limits leave orders of magnitude of room
# while keeping every [layers, n_expert] array of int64 within 32 MiB.
MAX_EXPERTS = 1 << 17
MAX_LAYERS = 1 << 12
MAX_LAYER_EXPERTS = 1 << 22  # layers × n_expert


def check_trace_shape(
    n_expert: int, layers: int, k: int, path: str | os.PathLike[str] | None, source: str
) -> None:
    """``BadInput`` unless a declared shape is within the limits above (and k ≤ n_expert);
    called by readers before they map or allocate anything. ``source`` says where the numbers
    come from, e.g. "the pmxtrace header"."""
    if not 1 <= n_expert <= MAX_EXPERTS:
        raise BadInput(
            f"{source} declares {n_expert:,} experts per layer; moepack accepts 1 to "
            f"{MAX_EXPERTS:,}",
            path,
        )
    if not 1 <= layers <= MAX_LAYERS:
        raise BadInput(
            f"{source} declares {layers:,} layers; moepack accepts 1 to {MAX_LAYERS:,}", path
        )
    if layers * n_expert > MAX_LAYER_EXPERTS:
        raise BadInput(
            f"{source} declares {layers:,} layers × {n_expert:,} experts; moepack accepts at "
            f"most {MAX_LAYER_EXPERTS:,} (layer, expert) pairs",
            path,
        )
    if not 1 <= k <= n_expert:
        raise BadInput(
            f"{source} declares top-{k:,} routing of {n_expert:,} experts (must be 1 to "
            f"{n_expert:,})",
            path,
        )


PHASES = ("all", "prefill", "decode")


class PromptSegment(NamedTuple):
    """One prompt's tokens: ``[start, start + prefill)`` prefill, then ``decode`` decoded."""

    start: int
    prefill: int
    decode: int

    @property
    def stop(self) -> int:
        return self.start + self.prefill + self.decode

    def run(self, phase: str) -> slice:
        """This prompt's tokens of ``phase`` (``all``, ``prefill`` or ``decode``)."""
        if phase == "all":
            return slice(self.start, self.stop)
        if phase == "prefill":
            return slice(self.start, self.start + self.prefill)
        if phase == "decode":
            return slice(self.start + self.prefill, self.stop)
        raise BadInput(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")


@dataclass(frozen=True)
class PromptRows:
    """Whole prompts for fitting and whole prompts held out (token rows of each)."""

    train_prompts: list[int]
    held_out_prompts: list[int]
    train_rows: np.ndarray
    held_out_rows: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {
            "train_prompts": self.train_prompts,
            "held_out_prompts": self.held_out_prompts,
            "train_tokens": int(self.train_rows.size),
            "held_out_tokens": int(self.held_out_rows.size),
        }


def token_chunks(n_tokens: int, row_cells: int, cells: int = CHUNK_CELLS) -> Iterator[slice]:
    """Slices of ``[0, n_tokens)`` holding about ``cells`` values of ``row_cells`` each."""
    step = max(1, cells // max(1, row_cells))
    for a in range(0, n_tokens, step):
        yield slice(a, min(n_tokens, a + step))


def id_dtype_for(n_expert: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``n_expert``."""
    if n_expert <= 1 << 8:
        return np.dtype(np.uint8)
    if n_expert <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def _first_duplicate(rows: np.ndarray) -> int | None:
    """Index of the first row of ``rows[n, k]`` that holds some value twice, or None."""
    k = rows.shape[1]
    if k < 2:
        return None
    if k <= 24:
        # k(k-1)/2 column comparisons beat sorting every short row by an order of magnitude
        cols = np.ascontiguousarray(rows.T)
        dup = np.zeros(rows.shape[0], dtype=bool)
        for i in range(k - 1):
            for j in range(i + 1, k):
                np.logical_or(dup, cols[i] == cols[j], out=dup)
    else:
        s = np.sort(rows, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
    hit = np.flatnonzero(dup)
    return int(hit[0]) if hit.size else None


@dataclass(eq=False)
class RoutingTrace:
    """Expert choices ``ids[tokens, layers, k]`` and everything needed to interpret them.

    ``block_map`` maps trace layer ``i`` to GGUF block ``block_map[i]``; ``None`` means the
    trace does not say, and trace layer ``i`` is then taken as the model's ``i``-th MoE block
    only when the model has exactly as many MoE blocks as the trace has layers.
    ``path`` is where the trace was read from (used in messages; not stored in files).

    ``segments``: one ``(start, prefill, decode)`` per prompt, covering the tokens in order;
    ``None`` (or a single segment) is the one-prompt trace whose split is ``prefill_tokens``.
    With segments, ``prefill_tokens`` is the total prefill of all prompts (pass 0 or that
    total); ``leading_prefill`` is the first prompt's, for formats that store one prefix.
    """

    ids: np.ndarray
    n_expert: int
    weights: np.ndarray | None = None
    prefill_tokens: int = 0
    segments: list[PromptSegment] | None = None
    block_map: list[int] | None = None
    model_fingerprint: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    _layer_max: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = Path(self.path)
        self._validate()

    # ----------------------------------------------------------------- validation
    def _fail(self, message: str) -> BadInput:
        return BadInput(message, self.path)

    def _validate(self) -> None:
        ids = self.ids
        if not isinstance(ids, np.ndarray):
            raise self._fail("trace ids must be a numpy array")
        if ids.ndim != 3:
            raise self._fail(f"trace ids must have shape [tokens, layers, k], got {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise self._fail(f"trace ids must be integers, got {ids.dtype}")
        tokens, layers, k = ids.shape
        if tokens < 1:
            raise self._fail("trace holds no tokens")
        if layers < 1 or k < 1:
            raise self._fail(f"trace shape {ids.shape} has no layers or no experts per token")
        try:
            self.n_expert = int(self.n_expert)
        except (TypeError, ValueError):
            raise self._fail(f"expert count {self.n_expert!r} is not an integer") from None
        if self.n_expert < 1:
            raise self._fail(f"expert count must be >= 1, got {self.n_expert}")
        check_trace_shape(self.n_expert, layers, min(k, self.n_expert), self.path, "the trace")
        if k > self.n_expert:
            raise self._fail(
                f"trace routes {k} experts per token but there are only {self.n_expert} experts"
            )
        self._validate_segments(tokens)
        self.prefill_tokens = int(self.prefill_tokens)
        if not 0 <= self.prefill_tokens <= tokens:
            raise self._fail(
                f"prefill of {self.prefill_tokens} tokens does not fit a trace of {tokens} tokens"
            )
        if self.block_map is not None:
            bm = [int(b) for b in self.block_map]
            if len(bm) != layers:
                raise self._fail(
                    f"block map has {len(bm)} entries but the trace has {layers} layers"
                )
            if any(b < 0 for b in bm):
                raise self._fail(f"block map holds a negative block: {bm}")
            if len(set(bm)) != len(bm):
                raise self._fail(f"block map names a block twice: {bm}")
            self.block_map = bm
        if self.model_fingerprint is not None:
            fp = str(self.model_fingerprint)
            if not fp or not all(c in "0123456789abcdef" for c in fp):
                raise self._fail(f"model fingerprint {fp!r} is not a hex string")
            self.model_fingerprint = fp
        if not isinstance(self.provenance, dict):
            raise self._fail("provenance must be a dict")
        if self.weights is not None:
            w = self.weights
            if not isinstance(w, np.ndarray) or w.shape != ids.shape:
                got = getattr(w, "shape", type(w).__name__)
                raise self._fail(f"router weights have shape {got}, the ids {ids.shape}")
            if w.dtype != np.float32:
                self.weights = w.astype(np.float32)
        self._check_values()

    def _validate_segments(self, tokens: int) -> None:
        """Segments cover ``[0, tokens)`` in order; one segment folds into ``prefill_tokens``."""
        if self.segments is None:
            return
        segs: list[PromptSegment] = []
        pos = 0
        for i, s in enumerate(self.segments):
            try:
                start, prefill, decode = (int(v) for v in s)
            except (TypeError, ValueError):
                raise self._fail(
                    f"prompt segment {i} is not (start, prefill, decode): {s!r}"
                ) from None
            if prefill < 0 or decode < 0 or prefill + decode < 1:
                raise self._fail(
                    f"prompt segment {i} has {prefill} prefill and {decode} decode tokens "
                    "(each must be >= 0, together >= 1)"
                )
            if start != pos:
                raise self._fail(
                    f"prompt segment {i} starts at token {start}, but the segments before it "
                    f"end at {pos} (segments cover the tokens in order, without gaps)"
                )
            segs.append(PromptSegment(start, prefill, decode))
            pos = start + prefill + decode
        if not segs or pos != tokens:
            raise self._fail(f"prompt segments cover {pos} tokens, the trace has {tokens}")
        total = sum(s.prefill for s in segs)
        if len(segs) == 1:
            if self.prefill_tokens not in (0, total):
                raise self._fail(
                    f"prefill of {self.prefill_tokens} tokens disagrees with the one prompt "
                    f"segment's {total}"
                )
            self.prefill_tokens = total
            self.segments = None
            return
        if int(self.prefill_tokens) not in (0, total):
            raise self._fail(
                f"prefill of {self.prefill_tokens} tokens disagrees with the prompt segments, "
                f"which hold {total} prefill tokens"
            )
        self.prefill_tokens = total
        self.segments = segs

    def _check_values(self) -> None:
        tokens, layers, k = self.ids.shape
        layer_max = np.zeros(layers, dtype=np.int64)
        signed = np.issubdtype(self.ids.dtype, np.signedinteger)
        for sl in token_chunks(tokens, layers * k):
            block = np.asarray(self.ids[sl])
            if signed and block.size and block.min() < 0:
                t, l_, j = np.argwhere(block < 0)[0]
                raise self._fail(
                    f"token {sl.start + t} layer {l_} slot {j}: negative expert id "
                    f"{int(block[t, l_, j])}"
                )
            np.maximum(layer_max, block.max(axis=(0, 2)), out=layer_max)
            if int(layer_max.max()) >= self.n_expert:
                t, l_, j = np.argwhere(block >= self.n_expert)[0]
                raise self._fail(
                    f"token {sl.start + t} layer {l_}: expert id {int(block[t, l_, j])} is out "
                    f"of range for {self.n_expert} experts"
                )
            dup = _first_duplicate(block.reshape(-1, k))
            if dup is not None:
                t, l_ = divmod(dup, layers)
                row = block[t, l_].tolist()
                raise self._fail(
                    f"token {sl.start + t} layer {l_}: expert chosen twice in one row {row}"
                )
            if self.weights is not None:
                w = np.asarray(self.weights[sl])
                bad = ~np.isfinite(w)
                if bad.any():
                    t, l_, j = np.argwhere(bad)[0]
                    raise self._fail(
                        f"token {sl.start + t} layer {l_} slot {j}: router weight is not finite"
                    )
        self._layer_max = layer_max

    # ----------------------------------------------------------------- shape
    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def decode_tokens(self) -> int:
        """Decoded tokens of every prompt."""
        return self.tokens - self.prefill_tokens

    @property
    def prompt_segments(self) -> list[PromptSegment]:
        """One segment per prompt, at least one (the prefix split of a one-prompt trace)."""
        if self.segments is not None:
            return list(self.segments)
        return [PromptSegment(0, self.prefill_tokens, self.tokens - self.prefill_tokens)]

    @property
    def prompts(self) -> int:
        return len(self.segments) if self.segments is not None else 1

    @property
    def leading_prefill(self) -> int:
        """The first prompt's prefill: the split a format with one prefix can store."""
        return self.prompt_segments[0].prefill

    @property
    def has_weights(self) -> bool:
        return self.weights is not None

    @property
    def layer_max(self) -> np.ndarray:
        """The largest expert id of each trace layer."""
        assert self._layer_max is not None
        return self._layer_max

    def phase_runs(self, phase: str = "all") -> list[slice]:
        """The non-empty token runs of ``phase``, one per prompt at most, in order: pairs of
        tokens within one run are neighbours in one prompt's stream of that phase."""
        return [r for r in (s.run(phase) for s in self.prompt_segments) if r.stop > r.start]

    def phase_rows(self, phase: str = "all") -> slice | np.ndarray:
        """The token rows of ``phase``: a slice when they are contiguous (every one-prompt
        trace), else an index array."""
        runs = self.phase_runs(phase)
        if not runs:
            return slice(0, 0)
        if all(a.stop == b.start for a, b in zip(runs, runs[1:], strict=False)):
            return slice(runs[0].start, runs[-1].stop)
        return np.concatenate([np.arange(r.start, r.stop, dtype=np.int64) for r in runs])

    def phase_tokens(self, phase: str = "all") -> int:
        """How many tokens ``phase`` has."""
        return sum(r.stop - r.start for r in self.phase_runs(phase))

    def phase_mask(self, phase: str = "decode") -> np.ndarray:
        """``[tokens]`` bool: which tokens belong to ``phase``."""
        out = np.zeros(self.tokens, dtype=bool)
        for r in self.phase_runs(phase):
            out[r] = True
        return out

    def token_prompts(self) -> np.ndarray:
        """``[tokens]`` int32: the prompt index of every token."""
        out = np.empty(self.tokens, dtype=np.int32)
        for i, s in enumerate(self.prompt_segments):
            out[s.start : s.stop] = i
        return out

    def phase_range(self, phase: str = "all") -> slice:
        """Token range of ``phase`` when it is contiguous (``BadInput`` otherwise: a caller
        that can take several prompts uses ``phase_rows`` or ``phase_runs``)."""
        rows = self.phase_rows(phase)
        if isinstance(rows, slice):
            return rows
        raise BadInput(
            f"the {phase} tokens of this trace's {self.prompts} prompts are not contiguous",
            self.path,
        )

    def prompt_split(self, held_out: list[int]) -> PromptRows:
        """Split by whole prompts: the rows of the prompts ``held_out`` and of all the others,
        so that held-out evaluation never sees a token of a prompt it fitted on."""
        n = self.prompts
        out = sorted({int(i) for i in held_out})
        bad = [i for i in out if not 0 <= i < n]
        if bad:
            raise BadInput(f"held-out prompt(s) {bad} do not exist (0..{n - 1})", self.path)
        train = [i for i in range(n) if i not in set(out)]
        if not train or not out:
            raise BadInput(
                f"a held-out split needs prompts on both sides; the trace has {n} prompt(s)",
                self.path,
            )
        segs = self.prompt_segments

        def rows(which: list[int]) -> np.ndarray:
            return np.concatenate(
                [np.arange(segs[i].start, segs[i].stop, dtype=np.int64) for i in which]
            )

        return PromptRows(train, out, rows(train), rows(out))

    def prompt_slice(self, first: int, stop: int) -> RoutingTrace:
        """The trace of prompts ``first .. stop - 1`` (whole prompts, contiguous rows: the
        arrays are slices of this trace's, a memory map stays one), segments rebased."""
        n = self.prompts
        if not 0 <= first < stop <= n:
            raise BadInput(f"prompts {first}..{stop - 1} are not within 0..{n - 1}", self.path)
        segs = self.prompt_segments[first:stop]
        a, b = segs[0].start, segs[-1].stop
        return self.replace(
            ids=self.ids[a:b],
            weights=None if self.weights is None else self.weights[a:b],
            prefill_tokens=0,
            segments=[PromptSegment(s.start - a, s.prefill, s.decode) for s in segs],
        )

    def label(self) -> str:
        return str(self.path) if self.path is not None else "trace"

    # ----------------------------------------------------------------- binding
    def resolved_block_map(self, model: MoeModel) -> list[int]:
        """The GGUF block of each trace layer on ``model`` (explicit map or the default)."""
        if self.block_map is not None:
            return list(self.block_map)
        return default_block_map(model, self.layers, self.path)

    def check_against(self, model: MoeModel) -> list[int]:
        """Raise ``BadInput`` unless this trace fits ``model``; return the resolved block map.

        Checks, in order: fingerprint (when both are known), block map (every entry a MoE
        block of the model; without a map, as many layers as the model has MoE blocks), expert
        counts and ids per block, and k against the model's top-k.
        """
        mfp = model.fingerprint
        if self.model_fingerprint is not None and self.model_fingerprint != mfp:
            raise self._fail(
                f"trace belongs to the model with fingerprint {self.model_fingerprint}, but "
                f"{model.path} has fingerprint {mfp} (another model, or a repacked copy)"
            )
        moe = model.moe_block_indices
        if not moe:
            raise self._fail(f"{model.path} has no MoE blocks to route to")
        blocks = self.resolved_block_map(model)
        by_index = {b.index: b for b in model.blocks}
        uniform = model.n_expert > 0
        for layer, b in enumerate(blocks):
            blk = by_index.get(b)
            if blk is None:
                raise self._fail(
                    f"block map sends trace layer {layer} to block {b}, which is not a MoE "
                    f"block of {model.path} (MoE blocks: {format_index_list(moe, ', ')})"
                )
            if uniform and self.n_expert != blk.n_expert:
                raise self._fail(
                    f"trace has {self.n_expert} experts per layer but block {b} of "
                    f"{model.path} has {blk.n_expert}"
                )
            top = int(self.layer_max[layer])
            if top >= blk.n_expert:
                raise self._fail(
                    f"trace layer {layer} uses expert {top}, but block {b} of {model.path} "
                    f"has only {blk.n_expert} experts"
                )
            if blk.top_k and self.k != blk.top_k:
                raise self._fail(
                    f"trace routes {self.k} experts per token but block {b} of {model.path} "
                    f"uses top-{blk.top_k}"
                )
        return blocks

    def bound_to(self, model: MoeModel) -> RoutingTrace:
        """A copy checked against ``model`` and stamped with its fingerprint and block map;
        its provenance ``binding`` says whether the check rested on a fingerprint the trace
        carried or on the shape alone (``moepack.binding``)."""
        from ..binding import basis

        blocks = self.check_against(model)
        provenance = dict(self.provenance)
        provenance.setdefault("binding", basis(self.model_fingerprint))
        return self.replace(
            block_map=blocks, model_fingerprint=model.fingerprint, provenance=provenance
        )

    def replace(self, **changes: Any) -> RoutingTrace:
        """A new trace with some fields changed (validated again; arrays are shared)."""
        fields: dict[str, Any] = {
            "ids": self.ids,
            "n_expert": self.n_expert,
            "weights": self.weights,
            "prefill_tokens": self.prefill_tokens,
            "segments": self.segments,
            "block_map": self.block_map,
            "model_fingerprint": self.model_fingerprint,
            "provenance": dict(self.provenance),
            "path": self.path,
        }
        if "prefill_tokens" in changes and "segments" not in changes:
            fields["segments"] = None  # a new prefix split replaces the prompt segments
        fields.update(changes)
        return RoutingTrace(**fields)

    def summary(self) -> dict[str, Any]:
        """The header facts, for JSON output (segments only for several prompts)."""
        out: dict[str, Any] = {
            "path": str(self.path) if self.path else None,
            "tokens": self.tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prompts": self.prompts,
            "layers": self.layers,
            "k": self.k,
            "n_expert": self.n_expert,
            "weights": self.has_weights,
            "block_map": self.block_map,
            "model_fingerprint": self.model_fingerprint,
            "provenance": _brief(self.provenance),
        }
        if self.segments is not None:
            out["segments"] = [list(s) for s in self.segments]
        return out


def _brief(provenance: dict[str, Any]) -> dict[str, Any]:
    """Provenance for display: the synthetic ground truth is summarised, not listed."""
    out = dict(provenance)
    synth = out.get("synth")
    if isinstance(synth, dict) and isinstance(synth.get("cluster_of"), list):
        rows = synth["cluster_of"]
        synth = dict(synth)
        width = len(rows[0]) if rows and isinstance(rows[0], list) else 0
        synth["cluster_of"] = f"[{len(rows)} layers x {width} experts]"
        out["synth"] = synth
    return out


def default_block_map(
    model: MoeModel, layers: int, path: str | os.PathLike[str] | None = None
) -> list[int]:
    """Trace layer ``i`` -> the model's ``i``-th MoE block, only when the counts agree exactly
    (with the MoE blocks, or with the ones llama.cpp runs when the model has
    multi-token-prediction blocks it never runs: what a llama.cpp capture records).

    Unlike the peer tool, which maps a short trace onto the first N MoE blocks and silently
    ignores the rest, a count mismatch is an error (``TraceNeeds``, ``NEED_BLOCK_MAP``): the
    trace needs an explicit block map to say which blocks it covers.
    """
    moe = model.moe_block_indices
    if layers == len(model.run_block_indices):
        return model.run_block_indices
    if layers != len(moe):
        raise TraceNeeds(
            f"the trace has no block map, and {model.path} has {len(moe)} MoE blocks "
            f"({format_index_list(moe, ', ')}) vs {layers} trace layers, so which blocks the trace "
            "covers is unknown",
            path,
            need=NEED_BLOCK_MAP,
        )
    return list(moe)
