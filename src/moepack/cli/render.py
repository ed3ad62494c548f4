"""Rendering result objects: rich tables for people, JSON for programs, progress on stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ..jsonable import to_jsonable
from .flags import reword


class _Console(Console):
    """rich's console, but a reader that leaves (``moepack ... | head``) ends the program the
    way it ends any Unix tool (128 + SIGPIPE), not with exit code 1, which moepack reserves
    for a failed verification."""

    def on_broken_pipe(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141)


# When piped, rich would squeeze tables into 80 columns; give them room instead.
stdout = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
stderr = Console(stderr=True, highlight=False)


def warn(messages: list[str]) -> None:
    """Each warning as one line on stderr (with ``--json`` too: stdout stays the result)."""
    for message in messages:
        stderr.print(
            f"moepack: warning: {reword(message)}", markup=False, highlight=False, soft_wrap=True
        )


def emit(result: Any, as_json: bool, render: Callable[[Console, Any], None]) -> None:
    """Print ``result`` as JSON (``--json``) or through ``render`` as tables."""
    if as_json:
        json.dump(to_jsonable(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        render(stdout, result)


def table(
    title: str | None, columns: list[str], rows: list[list[Any]], right: set[int] | None = None
) -> Table:
    """A plain rich table; columns whose index is in ``right`` are right-aligned (numbers)."""
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, col in enumerate(columns):
        t.add_column(col, justify="right" if right and i in right else "left")
    for row in rows:
        t.add_row(*[str(c) for c in row])
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
    """A ``ProgressSink`` drawn as a rich progress bar on stderr (hidden with ``--quiet``)."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled and stderr.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None

    def start(self, description: str, total: int, unit: str = "B") -> None:
        self.finish()
        if not self._enabled:
            return
        if unit == "B":
            cols = [
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
            ]
        else:
            cols = [
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit),
                TimeRemainingColumn(),
            ]
        self._progress = Progress(*cols, console=stderr, transient=True)
        self._progress.start()
        self._task = self._progress.add_task(description, total=max(total, 1))

    def advance(self, amount: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, amount)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
