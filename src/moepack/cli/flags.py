"""The one place that maps library parameter names to the flags a user types.

A library message names a parameter in backticks (`` `measure_tokens` must be at least 1``,
see ``moepack.errors``): that is what a caller of the library passes. On the command line the
same input is a flag, so every library text the CLI shows (errors, warnings, notes) goes
through ``reword``: `` `measure_tokens` `` becomes ``--measure-tokens``, the parameter's name
with dashes, unless ``FLAGS`` says the command line calls it otherwise.
"""

from __future__ import annotations

import re

FLAGS = {
    # parameter: flag, where the flag is not the parameter's name with dashes
    "token_range": "--tokens",
    "holdout_prompts": "--holdout",
    "plan_path": "--plan",
    "map_path": "--map",
    "alignment": "--align",
    "folder": "--dir",
    "bytes": "--cache",
}

_PARAMETER = re.compile(r"`([a-z][a-z0-9_]*)`")


def flag(parameter: str) -> str:
    """The flag that sets ``parameter`` on the command line."""
    return FLAGS.get(parameter, "--" + "-".join(parameter.split("_")))


def reword(text: str) -> str:
    """``text`` (a library message) with every parameter it names shown as its flag."""
    return _PARAMETER.sub(lambda m: flag(m.group(1)), text)
