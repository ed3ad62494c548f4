"""The drafting flags, shared by ``run`` and ``serve``: ``--draft`` and ``--draft-model``,
folded into one ``draft: DraftOptions`` before the command runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..llama.runtime.draft import parse_draft
from .options import input_path


def draft_options(f: Callable[..., None]) -> Callable[..., None]:
    """``--draft prompt-lookup[:N]|mtp|off`` and ``--draft-model DRAFT.gguf``: the command
    takes them as one ``draft`` (``DraftOptions``)."""

    @functools.wraps(f)
    def folded(*args: Any, **kwargs: Any) -> None:
        model: Path | None = kwargs.pop("draft_model")
        kwargs["draft"] = parse_draft(kwargs["draft"], model)
        f(*args, **kwargs)

    folded = click.option(
        "--draft-model",
        type=input_path,
        default=None,
        help="A small GGUF with the model's vocabulary that drafts greedily ahead "
        "(--draft then only sets the length: model:N).",
    )(folded)
    folded = click.option(
        "--draft",
        default="off",
        show_default=True,
        metavar="prompt-lookup[:N]|mtp|off",
        help="Draft up to N tokens (default 10) and verify them in one pass: prompt-lookup "
        "copies what followed the last words earlier in the context; the length follows "
        "the measured acceptance and cost, down to none. Greedy output is unchanged.",
    )(folded)
    return folded
