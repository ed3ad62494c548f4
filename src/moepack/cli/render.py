"""Rendering result objects: rich tables for people, JSON for programs, progress on stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import one_line
from ..jsonable import to_jsonable
from .flags import reword

if TYPE_CHECKING:  # imported when a bar is drawn (RichProgress._bar)
    from rich.progress import Progress


class _Console(Console):
    """rich's console, but a reader that leaves (``moepack ... | head``) ends the program the
    way it ends any Unix tool (128 + SIGPIPE), not with exit code 1, which moepack reserves
    for a failed verification."""

    def on_broken_pipe(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141)


# Every console prints text as it is: no markup, no emoji codes, no highlighting. What moepack
# prints is full of names from its inputs (paths, tensor names, architectures, a store's model
# name), and "[/x]" in one of them would be a markup error, "run:fire:1.gguf" an emoji; styles
# are given as ``styled`` parts instead (rich's markup and emoji tables are never consulted).
# When piped, rich would squeeze tables into 80 columns; give them room instead.
stdout = _Console(
    soft_wrap=True,
    width=None if sys.stdout.isatty() else 160,
    markup=False,
    emoji=False,
    highlight=False,
)
stderr = Console(stderr=True, soft_wrap=True, markup=False, emoji=False, highlight=False)


def styled(text: object, style: str) -> Text:
    """``text`` shown in ``style`` (``"bold"``, ``"red"``...), never read as markup."""
    return Text(str(text), style=style)


def line(*parts: str | Text) -> Text:
    """One line of plain strings and ``styled`` parts, each printed as it is."""
    return Text.assemble(*parts)


def put(console: Console, *parts: str | Text) -> None:
    """Print one line of plain strings and ``styled`` parts on ``console``."""
    console.print(Text.assemble(*parts))


def say(kind: str, text: str) -> None:
    """One message line on stderr, ``moepack: KIND: TEXT``: the one way every error, warning
    and note reaches the terminal. Control characters in ``text`` (a name holding a newline)
    are shown escaped and nothing wraps it, so the message stays one line at any width."""
    stderr.print(f"moepack: {kind}: {one_line(text)}", soft_wrap=True)


def warn(messages: list[str]) -> None:
    """Each warning (a library text: parameters named are shown as their flags) as one line
    on stderr, with ``--json`` too: stdout stays the result."""
    for message in messages:
        say("warning", reword(message))


def notes(messages: list[str]) -> None:
    """Each note (something the reader should know, nothing wrong) as one line on stderr."""
    for message in messages:
        say("note", reword(message))


def emit(result: Any, as_json: bool, render: Callable[[Console, Any], None]) -> None:
    """Print ``result`` as JSON (``--json``) or through ``render`` as tables."""
    if as_json:
        json.dump(to_jsonable(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        render(stdout, result)


def print_wide(console: Console, t: Any) -> None:
    """Print a table; when piped (no terminal), wide enough that no number is cut."""
    if console.is_terminal:
        console.print(t)
    else:
        wide = Console(
            file=console.file,
            width=max(console.width, 150),
            markup=False,
            emoji=False,
            highlight=False,
        )
        wide.print(t)


def table(
    title: str | Text | None,
    columns: list[str],
    rows: list[list[Any]],
    right: set[int] | None = None,
) -> Table:
    """A plain rich table; columns whose index is in ``right`` are right-aligned (numbers).
    Cells are shown as they are (``styled`` ones in their style)."""
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, col in enumerate(columns):
        t.add_column(col, justify="right" if right and i in right else "left")
    for row in rows:
        t.add_row(*[c if isinstance(c, Text) else str(c) for c in row])
    return t


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v = float(n)
    for u in units:
        if abs(v) < 1024 or u == units[-1]:
            return f"{v:.0f} {u}" if u == "B" else f"{v:.1f} {u}"
        v /= 1024
    return f"{v:.1f} TiB"


class RichProgress:
    """A ``ProgressSink`` drawn as a rich progress bar on stderr (hidden with ``--quiet``).

    rich's progress module is imported when a bar is first drawn: a command whose output is
    not a terminal, or that is quiet, never pays for it."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled and stderr.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None

    def start(self, description: str, total: int, unit: str = "B") -> None:
        self.finish()
        if not self._enabled:
            return
        self._progress = self._bar(unit)
        self._progress.start()
        self._task = self._progress.add_task(description, total=max(total, 1), **self._fields())

    def _bar(self, unit: str) -> Progress:
        """The bar's columns for ``unit``: bytes with speed, else a count."""
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        label, bar = TextColumn("{task.description}", markup=False), BarColumn()
        if unit == "B":
            return Progress(
                label,
                bar,
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=stderr,
                transient=True,
            )
        return Progress(
            label,
            bar,
            MofNCompleteColumn(),
            TextColumn(unit),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
        )

    def _fields(self) -> dict[str, Any]:
        """Extra task fields the bar's columns read."""
        return {}

    def advance(self, amount: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, amount)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class TokenProgress(RichProgress):
    """The progress bar with a tokens/s column for token counts (bytes as usual)."""

    def _bar(self, unit: str) -> Progress:
        if unit != "tok":
            return super()._bar(unit)
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        return Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
        )

    def _fields(self) -> dict[str, Any]:
        return {"rate": ""}

    def advance(self, amount: int) -> None:
        if self._progress is None:
            return
        self._progress.advance(self._task, amount)
        speed = self._progress.tasks[0].speed
        if speed:
            self._progress.update(self._task, rate=f"{speed:.1f} tok/s")
