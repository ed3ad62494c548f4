"""Trace file formats, one module per format, found by listing this package.

Every format module implements ``TraceFormat`` (``_api``: module-level ``NAME``,
``EXTENSIONS``, ``DESCRIPTION``, ``VERSIONS`` and the functions ``detect``, ``read``, ``lost``,
``write``) and ends with ``PLUGIN = FormatModule(__name__)``. Adding a format is adding a module
here; ``moepack.registry`` finds it on first use and refuses two formats with one name. Reading
detects the format by magic first, then by extension; saving picks it by name or extension.
Writes are atomic (``safeio``), and whatever a format cannot carry is reported in the result's
``dropped`` list, never lost silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ...errors import BadInput, MoepackError
from ...filekinds import TRACE, check_output_kind
from ...inputs import regular_file
from ...progress import NULL_PROGRESS, ProgressSink
from ...registry import Registry
from ...safeio import AtomicOutputs, check_destination, describe_os_error
from ..core import NEED_FORMAT, NEED_OUTPUT_FORMAT, RoutingTrace, TraceNeeds
from ._api import FormatModule, ReadOptions, SaveResult, TraceFormat, WriteOptions

if TYPE_CHECKING:
    from ...checkpoint.model import MoeModel

HEAD_BYTES = 64


REGISTRY: Registry[FormatModule] = Registry(
    "trace format", __name__, base=FormatModule, every_module=True
)


class _Formats(Mapping[str, ModuleType]):
    """The format modules by name, in listing order (loaded on first use)."""

    def __getitem__(self, name: str) -> ModuleType:
        plugin = REGISTRY.find(name)
        if plugin is None or plugin.name != name:
            raise KeyError(name)
        return plugin.module

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY.names())

    def __len__(self) -> int:
        return len(REGISTRY.names())


FORMATS: Mapping[str, ModuleType] = _Formats()


def format_names() -> list[str]:
    return REGISTRY.names()


def get_format(name: str) -> ModuleType:
    """The format module called ``name``; ``BadInput`` listing the known ones otherwise."""
    return REGISTRY.get(name).module


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
    by_extension = format_for_extension(p)
    if by_extension is not None:
        return by_extension
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
            written = mod.write(trace, fh, options)
            size = fh.tell()
    except OSError as e:
        raise describe_os_error(e, p) from None
    if written is not None:  # the version the file says, not only the one asked for
        version = written
    return SaveResult(path=p, format=mod.NAME, version=version, bytes=size, dropped=dropped)


__all__ = [
    "FORMATS",
    "REGISTRY",
    "FormatModule",
    "ReadOptions",
    "SaveResult",
    "TraceFormat",
    "WriteOptions",
    "detect_format",
    "format_names",
    "get_format",
    "load_trace",
    "output_format",
    "save_trace",
]
