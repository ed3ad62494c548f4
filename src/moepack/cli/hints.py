"""What each command adds to a library error about a fact the input lacks: the option that
supplies it there. The library's messages name no options, since commands have different ones;
one helper appends the command's own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..trace.core import NEED_BLOCK_MAP, NEED_FORMAT, NEED_N_EXPERT, NEED_OUTPUT_FORMAT, TraceNeeds

_BLOCK_MAP_HINT = "give --block-map LIST to say which MoE blocks its layers are"
_N_EXPERT_HINT = "pass --n-expert N or --model MODEL"
INFO_HINTS = {
    NEED_FORMAT: "name it with --format",
    NEED_N_EXPERT: _N_EXPERT_HINT,
    NEED_BLOCK_MAP: _BLOCK_MAP_HINT,
}
CONVERT_HINTS = {
    NEED_FORMAT: "name it with --from",
    NEED_OUTPUT_FORMAT: "name it with --to",
    NEED_N_EXPERT: _N_EXPERT_HINT,
    NEED_BLOCK_MAP: _BLOCK_MAP_HINT,
}
SYNTH_HINTS = {
    NEED_OUTPUT_FORMAT: "name it with --to",
    NEED_BLOCK_MAP: "give --model, or --block-map LIST to say which blocks its layers are",
}
STATS_HINTS = {
    NEED_FORMAT: "name it with --format",
    NEED_N_EXPERT: _N_EXPERT_HINT,
}
PLAN_HINTS = {  # plan's model is given: the expert count can come only from --n-expert
    NEED_N_EXPERT: "pass --n-expert N",
    NEED_BLOCK_MAP: _BLOCK_MAP_HINT,
}


@contextmanager
def hints(table: dict[str, str]) -> Iterator[None]:
    """Append this command's option for what a ``TraceNeeds`` error says is missing."""
    try:
        yield
    except TraceNeeds as e:
        hint = table.get(e.need)
        if hint is None:
            raise
        raise e.with_hint(hint) from None
