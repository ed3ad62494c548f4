"""Every metadata key moepack writes into a model file (GGUF or ``.q4nx``), defined once.

A key spelled in two modules can drift apart in one of them and silently stop matching what
the other writes; every reader and writer names the key from here instead.
"""

from __future__ import annotations

# --- a repack's provenance (``moepack.checkpoint.provenance`` describes each key)
REPACK_PREFIX = "moepack.repack."
"""Every provenance key starts so; they are no part of the model's identity."""
REPACK_VERSION = REPACK_PREFIX + "version"
REPACK_ORIGINAL = REPACK_PREFIX + "original_fingerprint"
REPACK_BLOCKS = REPACK_PREFIX + "blocks"
REPACK_PERM = REPACK_PREFIX + "perm.blk."
"""Followed by the block number: that block's permutation."""
REPACK_FUSED = REPACK_PREFIX + "fused"
REPACK_ALIGNMENT = REPACK_PREFIX + "alignment"
REPACK_ORDER = REPACK_PREFIX + "order"
REPACK_SHARDS = REPACK_PREFIX + "shards"

# --- a synthetic GGUF model
SYNTH_SPEC = "moepack.synth.spec"
"""The ``SynthSpec`` the model was written from, as a Python literal."""
SYNTH_ROUTING = "moepack.synth.routing"
"""The routing planted in its weights (``moepack.checkpoint.routing``)."""

# --- a .q4nx model moepack wrote (``npu synth`` or ``npu unpack``)
GEOMETRY = "moepack.geometry"
"""The model geometry's name (believed only when the tensors agree)."""
GENERATOR = "moepack.generator"
SEED = "moepack.seed"
UNPACKED_FROM = "moepack.unpacked_from"
"""The layout profile a ``.q4nx`` was unpacked from."""
RETAINED = "moepack.retained"
"""Per tensor, the rows the pack retained (JSON)."""
