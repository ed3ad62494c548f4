"""What a trace format is: the interface every format module implements, and the options and
result objects that pass through it. Kept apart from the package's ``__init__`` so format
modules import it without importing the registry (no import-order cycle)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Protocol

from ...progress import NULL_PROGRESS, ProgressSink
from ..core import RoutingTrace


@dataclass(frozen=True)
class ReadOptions:
    """What a reader may need besides the file: the expert count for formats without one.

    ``n_expert_source`` says where ``n_expert`` came from, for messages: "" when the caller
    gave it, else e.g. "the model m.gguf has" (read as "... has 8")."""

    n_expert: int | None = None
    n_expert_source: str = ""
    progress: ProgressSink = NULL_PROGRESS


@dataclass(frozen=True)
class WriteOptions:
    """``version``: the format version to write (None = the format's default); ``path``: the
    destination, for messages."""

    version: int | None = None
    path: Path | None = None
    progress: ProgressSink = NULL_PROGRESS


@dataclass
class SaveResult:
    """What ``save_trace`` wrote, and what the format could not carry."""

    path: Path
    format: str
    version: int
    bytes: int
    dropped: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "format": self.format,
            "version": self.version,
            "bytes": self.bytes,
            "dropped": list(self.dropped),
        }


class TraceFormat(Protocol):
    """The interface of a trace format module (the module itself is the implementation)."""

    NAME: str
    """What ``--format`` / ``--to`` accept."""
    EXTENSIONS: tuple[str, ...]
    """File name endings the format claims, for detection and saving."""
    DESCRIPTION: str
    VERSIONS: tuple[int, ...]
    """Versions it can write; the first is the default."""

    def detect(self, head: bytes) -> bool:
        """Whether the file's first bytes carry this format's magic."""
        ...

    def read(self, path: Path, options: ReadOptions) -> RoutingTrace:
        """The validated trace in ``path``; ``BadInput`` naming the file otherwise."""
        ...

    def lost(self, trace: RoutingTrace, options: WriteOptions) -> list[str]:
        """What writing ``trace`` in this format would drop (empty: nothing)."""
        ...

    def write(self, trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> int | None:
        """Write ``trace`` to the open (temporary) file ``fh``; returns the version written
        when it is not ``options.version`` (a format that picks it from the trace)."""
        ...


@dataclass(frozen=True)
class FormatModule:
    """A format module as a registry plug-in: ``PLUGIN = FormatModule(__name__)`` at its end."""

    module_name: str

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)

    @property
    def name(self) -> str:
        return str(self.module.NAME)
