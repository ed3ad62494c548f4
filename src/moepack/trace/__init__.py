"""Routing traces: which experts the router chose, per token and MoE layer.

Central type ``RoutingTrace`` (``core``); file formats in a registry (``formats``: the peer's
``.pmxtrace`` v1/v2, the text form, the native ``.moetrace``, BigMoeOnEdge's route CSV);
synthetic traces with planted structure (``synth``); statistics (``stats``).

Typical use::

    from moepack.trace import load_trace, save_trace, synth_trace
    trace = load_trace("run.pmxtrace", model=model)      # validated and checked against model
    result = save_trace(trace, "run.moetrace")            # result.dropped: what was lost
    blocks = trace.check_against(model)                   # BadInput if it does not fit
"""

from .core import RoutingTrace, TraceNeeds, default_block_map
from .formats import FORMATS, SaveResult, detect_format, load_trace, save_trace
from .stats import coactivation, expert_counts, overlap, summarize
from .synth import SynthTruth, TraceStructure, default_clusters, synth_trace, synth_truth

__all__ = [
    "FORMATS",
    "RoutingTrace",
    "SaveResult",
    "SynthTruth",
    "TraceNeeds",
    "TraceStructure",
    "coactivation",
    "default_block_map",
    "default_clusters",
    "detect_format",
    "expert_counts",
    "load_trace",
    "overlap",
    "save_trace",
    "summarize",
    "synth_trace",
    "synth_truth",
]
