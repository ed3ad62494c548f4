"""The bandwidth surface: request size x queue depth -> bytes/s, and a model that interpolates.

``Surface.bandwidth(request_bytes, queue_depth)`` is the public question the layout planner
asks. Each request size's cells are first made non-decreasing in queue depth (isotonic
regression in log space: a dip at a deeper queue is noise; ``raw=True`` skips this and the
measured cells are kept as they are). It then interpolates in log-log space (log bandwidth over log size and log depth), row by row:
first along request size within each measured depth, then across depths. That is bilinear on a
full grid and still well defined on a ragged one. Outside the measured range it extrapolates
the physically sensible way: below the smallest size at that size's IOPS (bandwidth
proportional to size), above the largest size and depth at the last value (a device saturates).

Files: our own versioned ``moepack-surface`` JSON (device identity, engine, mode, timestamp,
cells with latency and CPU), and the peer tool potatomaxx's probe JSON, read and written.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..filekinds import SURFACE, check_output_kind
from ..inputs import load_json, read_capped
from ..safeio import write_bytes_atomic

FORMAT_NAME = "moepack-surface"
FORMAT_VERSION = 1
PEER_FORMAT = "potatomaxx"


@dataclass(frozen=True)
class SurfaceCell:
    """One measured point; only ``bytes_per_sec`` is required (the peer's files have no more)."""

    request_bytes: int
    queue_depth: int
    bytes_per_sec: float
    iops: float | None = None
    lat_p50_us: float | None = None
    lat_p99_us: float | None = None
    cpu_sec_per_gb: float | None = None
    requests: int | None = None
    seconds: float | None = None
    bytes_per_sec_low: float | None = None  # slowest of the cell's runs
    bytes_per_sec_high: float | None = None  # fastest
    repeats: int | None = None  # runs behind bytes_per_sec (their median)


@dataclass
class Surface:
    """A device's measured read bandwidth and the metadata saying where it came from."""

    cells: list[SurfaceCell]
    engine: str | None = None
    mode: str | None = None
    device: dict[str, Any] | None = None
    created: str | None = None
    cell_seconds: float | None = None
    corpus_bytes: int | None = None
    note: str = ""
    cache_bypassed: bool | None = None
    source_format: str = FORMAT_NAME
    _rows: dict[int, tuple[list[float], list[float]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    _raw_rows: dict[int, tuple[list[float], list[float]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.cells:
            raise BadInput("a surface needs at least one cell")
        seen: set[tuple[int, int]] = set()
        for c in self.cells:
            key = (c.request_bytes, c.queue_depth)
            if key in seen:
                raise BadInput(
                    f"two cells for request size {c.request_bytes} at queue depth {c.queue_depth}"
                )
            seen.add(key)
        self._rows = _rows(self.cells, self.monotone_in_depth())
        self._raw_rows = _rows(self.cells, {})

    # -- the model -------------------------------------------------------------------------

    @property
    def request_sizes(self) -> list[int]:
        return sorted({c.request_bytes for c in self.cells})

    @property
    def queue_depths(self) -> list[int]:
        return sorted({c.queue_depth for c in self.cells})

    def cell(self, request_bytes: int, queue_depth: int) -> SurfaceCell | None:
        """The measured cell at exactly this point, if there is one."""
        for c in self.cells:
            if c.request_bytes == request_bytes and c.queue_depth == queue_depth:
                return c
        return None

    def monotone_in_depth(self) -> dict[tuple[int, int], float]:
        """Each request size's bandwidths made non-decreasing in queue depth (isotonic
        regression of log bandwidth over depth, weighted by runs): more reads in flight do
        not make a device slower, so a dip is noise. Keyed by (size, depth); raw cells stay
        in ``cells``."""
        by_size: dict[int, list[SurfaceCell]] = {}
        for c in self.cells:
            by_size.setdefault(c.request_bytes, []).append(c)
        out: dict[tuple[int, int], float] = {}
        for size, row in by_size.items():
            row.sort(key=lambda c: c.queue_depth)
            fitted = _isotonic(
                [math.log(c.bytes_per_sec) for c in row], [float(c.repeats or 1) for c in row]
            )
            for c, v in zip(row, fitted, strict=True):
                out[(size, c.queue_depth)] = math.exp(v)
        return out

    def bandwidth(self, request_bytes: float, queue_depth: float, raw: bool = False) -> float:
        """Predicted bytes/s for reads of ``request_bytes`` at ``queue_depth`` (log-log),
        from the cells made monotone in depth (``raw=True``: from the cells as measured)."""
        if not request_bytes > 0 or not queue_depth > 0:
            raise BadInput(
                f"request size and queue depth must be positive (got {request_bytes}, "
                f"{queue_depth})"
            )
        rows = self._raw_rows if raw else self._rows
        ls = math.log(request_bytes)
        depths = sorted(rows)
        lq = [math.log(d) for d in depths]
        vals = [_along_size(*rows[d], ls) for d in depths]
        return math.exp(_interp(lq, vals, math.log(queue_depth)))

    def iops(self, request_bytes: float, queue_depth: float) -> float:
        """Predicted requests per second (bandwidth / request size)."""
        return self.bandwidth(request_bytes, queue_depth) / request_bytes

    # -- files -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Our own format: versioned, self-describing."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": self.created,
            "device": self.device,
            "engine": self.engine,
            "mode": self.mode,
            "cache_bypassed": self.cache_bypassed,
            "cell_seconds": self.cell_seconds,
            "corpus_bytes": self.corpus_bytes,
            "note": self.note,
            "cells": [asdict(c) for c in self.cells],
        }

    def to_peer_json(self) -> dict[str, Any]:
        """potatomaxx's probe JSON (it keeps only size, depth and bandwidth)."""
        where = ""
        if self.device:
            where = f" on {self.device.get('block_device') or self.device.get('source')}"
            where += f" ({self.device.get('filesystem')})"
        note = self.note or f"moepack probe: {self.engine} {self.mode}{where}, {self.created}"
        bypassed = self.cache_bypassed
        if bypassed is None:
            bypassed = self.mode == "direct"
        return {
            "note": note,
            "cache_bypassed": bool(bypassed),
            "cells": [
                {
                    "blob_bytes": c.request_bytes,
                    "queue_depth": c.queue_depth,
                    "bytes_per_sec": c.bytes_per_sec,
                }
                for c in self.cells
            ],
        }

    def save(
        self,
        path: str | os.PathLike[str],
        fmt: str = FORMAT_NAME,
        inputs: Sequence[str | os.PathLike[str]] = (),
    ) -> Path:
        """Write atomically in our format or (``fmt="potatomaxx"``) the peer's; refuse to
        overwrite any of ``inputs`` (the file that was probed, the file converted)."""
        return write_bytes_atomic(check_output_kind(path, SURFACE), self.encode(fmt), inputs)

    def encode(self, fmt: str = FORMAT_NAME) -> bytes:
        """The file's bytes in our format or (``fmt="potatomaxx"``) the peer's."""
        if fmt not in (FORMAT_NAME, PEER_FORMAT):
            raise BadInput(f"unknown surface format {fmt!r}; use {FORMAT_NAME} or {PEER_FORMAT}")
        doc = self.to_json() if fmt == FORMAT_NAME else self.to_peer_json()
        return (json.dumps(doc, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, doc: Any, origin: str = "surface") -> Surface:
        """Parse either format (detected from its fields), with errors that name the field."""
        if not isinstance(doc, dict):
            raise BadInput("a surface file holds a JSON object", origin)
        raw = doc.get("cells")
        if not isinstance(raw, list):
            raise BadInput("'cells' must be a list", origin)
        if doc.get("format") == FORMAT_NAME:
            version = doc.get("version")
            if not isinstance(version, int) or version < 1:
                raise BadInput(f"'version' must be a positive integer, got {version!r}", origin)
            if version > FORMAT_VERSION:
                raise BadInput(
                    f"surface version {version} is newer than this moepack reads "
                    f"({FORMAT_VERSION}); upgrade moepack",
                    origin,
                )
            cells = [_cell(c, i, origin, "request_bytes") for i, c in enumerate(raw)]
            return cls(
                cells=cells,
                engine=_field(doc, "engine", str, origin),
                mode=_field(doc, "mode", str, origin),
                device=_device(doc, origin),
                created=_field(doc, "created", str, origin),
                cell_seconds=_number(doc, "cell_seconds", origin),
                corpus_bytes=_field(doc, "corpus_bytes", int, origin),
                note=_field(doc, "note", str, origin) or "",
                cache_bypassed=_field(doc, "cache_bypassed", bool, origin),
                source_format=FORMAT_NAME,
            )
        if "format" in doc:
            raise BadInput(f"unknown surface format {_shown(doc['format'])}", origin)
        cells = [_cell(c, i, origin, "blob_bytes") for i, c in enumerate(raw)]
        bypassed = _field(doc, "cache_bypassed", bool, origin)
        return cls(
            cells=cells,
            note=_field(doc, "note", str, origin) or "",
            cache_bypassed=bypassed,
            mode="direct" if bypassed else None,
            source_format=PEER_FORMAT,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Surface:
        """Read a surface file in our format or the peer's."""
        p = Path(path)
        raw = read_capped(p, "surface file", MAX_SURFACE_BYTES)
        if b"\0" in raw[:8192]:
            raise BadInput("not a surface file: not text (a binary file?)", p)
        doc = load_json(raw, p, "surface file", allow_nan=True)
        try:
            return cls.from_json(doc, str(p))
        except BadInput as e:
            if e.path is None:
                raise BadInput(e.message, p) from None
            raise


MAX_SURFACE_BYTES = 16 << 20  # a surface has tens to thousands of cells: well under 1 MiB
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _field(doc: dict[str, Any], key: str, kind: type, origin: str) -> Any:
    """``doc[key]`` when it is null/absent or of ``kind`` (bools are not integers), else a
    one-line error naming the field and what it should be."""
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, kind) and (kind is bool or not isinstance(v, bool)):
        return v
    raise BadInput(f"'{key}' must be {_TYPE_NAMES[kind]} or null, got {_shown(v)}", origin)


def _number(doc: dict[str, Any], key: str, origin: str) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"'{key}' must be a number or null, got {_shown(v)}", origin)
    return float(v)


def _device(doc: dict[str, Any], origin: str) -> dict[str, Any] | None:
    """The device record: an object of plain values (strings, numbers, booleans, null)."""
    v = doc.get("device")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadInput(f"'device' must be an object or null, got {_shown(v)}", origin)
    for key, item in v.items():
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise BadInput(
                f"'device.{key}' must be a string, number, boolean or null, got {_shown(item)}",
                origin,
            )
    return dict(v)


def _cell(c: Any, i: int, origin: str, size_key: str) -> SurfaceCell:
    if not isinstance(c, dict):
        raise BadInput(f"cells[{i}] must be an object", origin)

    def need_int(key: str) -> int:
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadInput(f"cells[{i}].{key}: expected a positive integer, got {v!r}", origin)
        return v

    def opt_num(key: str) -> float | None:
        v = c.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadInput(f"cells[{i}].{key}: expected a number, got {v!r}", origin)
        return float(v)

    bw = c.get("bytes_per_sec")
    if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
        raise BadInput(f"cells[{i}].bytes_per_sec: expected a positive number, got {bw!r}", origin)
    req = c.get("requests")
    reps = c.get("repeats")
    return SurfaceCell(
        request_bytes=need_int(size_key),
        queue_depth=need_int("queue_depth"),
        bytes_per_sec=float(bw),
        iops=opt_num("iops"),
        lat_p50_us=opt_num("lat_p50_us"),
        lat_p99_us=opt_num("lat_p99_us"),
        cpu_sec_per_gb=opt_num("cpu_sec_per_gb"),
        requests=req if isinstance(req, int) and not isinstance(req, bool) else None,
        seconds=opt_num("seconds"),
        bytes_per_sec_low=opt_num("bytes_per_sec_low"),
        bytes_per_sec_high=opt_num("bytes_per_sec_high"),
        repeats=reps if isinstance(reps, int) and not isinstance(reps, bool) and reps > 0 else None,
    )


def _rows(
    cells: list[SurfaceCell], values: dict[tuple[int, int], float]
) -> dict[int, tuple[list[float], list[float]]]:
    """Per depth: (log sizes, log bandwidths), sorted by size; ``values`` override cells."""
    rows: dict[int, list[tuple[int, float]]] = {}
    for c in cells:
        bw = values.get((c.request_bytes, c.queue_depth), c.bytes_per_sec)
        rows.setdefault(c.queue_depth, []).append((c.request_bytes, bw))
    out = {}
    for qd, pts in rows.items():
        pts.sort()
        out[qd] = ([math.log(s) for s, _ in pts], [math.log(b) for _, b in pts])
    return out


def _isotonic(ys: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in weighted least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for y, w in zip(ys, weights, strict=True):
        blocks.append([y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for m, _w, n in blocks:
        out += [m] * int(n)
    return out


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)``, held flat outside ``xs`` (xs sorted, non-empty)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect_left(xs, x)
    if xs[j] == x:
        return ys[j]
    t = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return ys[j - 1] + t * (ys[j] - ys[j - 1])


def _along_size(log_sizes: list[float], log_bw: list[float], ls: float) -> float:
    """Log bandwidth at log size ``ls`` within one depth's row."""
    if ls < log_sizes[0]:
        return log_bw[0] + (ls - log_sizes[0])  # same IOPS as the smallest measured size
    return _interp(log_sizes, log_bw, ls)
