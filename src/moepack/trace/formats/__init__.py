"""Trace file formats, one module per format, found by listing this package.

Every format module has the same small interface::

    NAME: str                      # what --format / --to accept
    EXTENSIONS: tuple[str, ...]    # file name endings it claims, for detection and saving
    DESCRIPTION: str
    VERSIONS: tuple[int, ...]      # versions it can write; the first is the default
    def detect(head: bytes) -> bool            # the file's first bytes carry its magic
    def read(path: Path, options: ReadOptions) -> RoutingTrace
    def lost(trace, options: WriteOptions) -> list[str]   # what writing would drop
    def write(trace, fh: BinaryIO, options: WriteOptions) -> None

Adding a format is adding a module here. Reading detects the format by magic first, then by
extension; saving picks it by name or extension. Writes are atomic (``safeio``), and whatever a
format cannot carry is reported in the result's ``dropped`` list, never lost silently.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ...errors import BadInput, MoepackError
from ...filekinds import TRACE, check_output_kind
from ...inputs import regular_file
from ...progress import NULL_PROGRESS, ProgressSink
from ...safeio import AtomicOutputs, check_destination, describe_os_error
from ..core import NEED_FORMAT, NEED_OUTPUT_FORMAT, RoutingTrace, TraceNeeds

if TYPE_CHECKING:
    from ...checkpoint.model import MoeModel

HEAD_BYTES = 64


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


def _discover() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        name = getattr(mod, "NAME", None)
        if name is None:
            continue
        if name in found:
            raise RuntimeError(f"two trace formats are called {name!r}")
        found[name] = mod
    return found


FORMATS: dict[str, ModuleType] = _discover()


def format_names() -> list[str]:
    return list(FORMATS)


def get_format(name: str) -> ModuleType:
    try:
        return FORMATS[name]
    except KeyError:
        raise BadInput(
            f"unknown trace format {name!r}; known formats: {', '.join(FORMATS)}"
        ) from None


def format_for_extension(path: Path) -> ModuleType | None:
    name = path.name.lower()
    best: tuple[int, ModuleType] | None = None
    for mod in FORMATS.values():
        for ext in mod.EXTENSIONS:
            if name.endswith(ext) and (best is None or len(ext) > best[0]):
                best = (len(ext), mod)
    return best[1] if best else None


def detect_format(path: str | os.PathLike[str]) -> ModuleType:
    """The format of an existing file: by magic, then by extension."""
    p = Path(path)
    regular_file(p, "trace file")  # a FIFO would block the read below forever
    try:
        with open(p, "rb") as fh:
            head = fh.read(HEAD_BYTES)
    except FileNotFoundError:
        raise BadInput("no such trace file", p) from None
    except IsADirectoryError:
        raise BadInput("is a directory, not a trace file", p) from None
    except OSError as e:
        raise describe_os_error(e, p) from None
    for mod in FORMATS.values():
        if mod.detect(head):
            return mod
    mod = format_for_extension(p)
    if mod is not None:
        return mod
    raise TraceNeeds(
        f"the trace format could not be detected: no known magic, and the extension "
        f"{p.suffix or 'none'!r} is no trace format's (formats: {', '.join(FORMATS)})",
        p,
        need=NEED_FORMAT,
    )


def output_format(path: str | os.PathLike[str], format: str | None = None) -> ModuleType:
    """The format ``save_trace`` writes ``path`` in: ``format`` if named, else by extension."""
    if format:
        return get_format(format)
    p = Path(path)
    found = format_for_extension(p)
    if found is None:
        raise TraceNeeds(
            f"the output trace format could not be told from the extension "
            f"{p.suffix or 'none'!r} (formats: {', '.join(FORMATS)})",
            p,
            need=NEED_OUTPUT_FORMAT,
        )
    return found


def load_trace(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    n_expert: int | None = None,
    model: MoeModel | None = None,
    check: bool = True,
    progress: ProgressSink = NULL_PROGRESS,
) -> RoutingTrace:
    """Read and validate a trace file.

    ``format`` names the format (default: detected by magic, then extension). ``n_expert`` is
    the expert count for formats that do not record one (the text form); ``model`` supplies it
    too, and unless ``check`` is False the trace is also checked against the model
    (``RoutingTrace.check_against``).
    """
    p = Path(path)
    mod = get_format(format) if format else detect_format(p)
    if n_expert is not None and int(n_expert) < 1:
        raise BadInput(f"n_expert must be >= 1, got {n_expert}")
    hint, source = n_expert, ""
    if model is not None and hint is None:
        n = model.n_expert
        if n == -1:
            n = max(b.n_expert for b in model.blocks)
        hint = n if n > 0 else None
        source = f"the model {model.path} has"
    options = ReadOptions(n_expert=hint, n_expert_source=source, progress=progress)
    try:
        trace = mod.read(p, options)
    except FileNotFoundError:
        raise BadInput("no such trace file", p) from None
    except MoepackError:
        raise
    except OSError as e:
        raise describe_os_error(e, p) from None
    if n_expert is not None and trace.n_expert != n_expert:
        raise BadInput(
            f"the file records {trace.n_expert} experts per layer, but n_expert={n_expert} was "
            "given",
            p,
        )
    if model is not None and check:
        trace.check_against(model)
    return trace


def save_trace(
    trace: RoutingTrace,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    version: int | None = None,
    inputs: tuple[str | os.PathLike[str], ...] = (),
    strict: bool = False,
    progress: ProgressSink = NULL_PROGRESS,
) -> SaveResult:
    """Write ``trace`` atomically to ``path``.

    ``format`` names the format (default: from the extension). ``version`` picks the format
    version (e.g. pmxtrace 1 or 2; default the newest). ``inputs`` are files that must not be
    overwritten (the trace's own source is always one). With ``strict``, refuse to write when
    the format would drop anything; otherwise the result lists what was dropped.
    """
    p = Path(path)
    all_inputs = list(inputs) + ([trace.path] if trace.path is not None else [])
    check_destination(p, all_inputs)  # "would overwrite the input" first: the likelier slip
    check_output_kind(p, TRACE)
    mod = output_format(p, format)
    if version is None:
        version = mod.VERSIONS[0]
    if version not in mod.VERSIONS:
        raise BadInput(
            f"{mod.NAME} can be written as version {', '.join(map(str, mod.VERSIONS))}, "
            f"not {version}"
        )
    options = WriteOptions(version=version, path=p, progress=progress)
    dropped = list(mod.lost(trace, options))
    if strict and dropped:
        raise BadInput(f"{mod.NAME} v{version} cannot carry: {'; '.join(dropped)}", p)
    try:
        with AtomicOutputs(all_inputs) as out:
            fh = out.open(p)
            mod.write(trace, fh, options)
            size = fh.tell()
    except OSError as e:
        raise describe_os_error(e, p) from None
    return SaveResult(path=p, format=mod.NAME, version=version, bytes=size, dropped=dropped)


__all__ = [
    "FORMATS",
    "ReadOptions",
    "SaveResult",
    "WriteOptions",
    "detect_format",
    "format_names",
    "get_format",
    "load_trace",
    "output_format",
    "save_trace",
]
