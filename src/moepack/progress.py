"""Progress reporting without printing: the library calls a sink, the CLI draws it.

Long operations take an optional ``ProgressSink``; the CLI passes one backed by a rich
progress bar, tests and library users pass nothing (``NULL_PROGRESS``).
"""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def start(self, description: str, total: int, unit: str = "B") -> None:
        """Begin a task of ``total`` units (bytes unless ``unit`` says otherwise)."""

    def advance(self, amount: int) -> None:
        """``amount`` more units are done."""

    def finish(self) -> None:
        """The current task is over (successfully or not)."""


class NullProgress:
    """A sink that ignores everything."""

    def start(self, description: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass


NULL_PROGRESS: ProgressSink = NullProgress()
