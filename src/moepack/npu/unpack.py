"""The packer's inverse: buffer files back to source tensors.

The manifest is validated first (types, ranges, file names; then against the profile and
geometry it names), so a damaged manifest is one clear error. Each layer is rebuilt in one
zeroed array (its tensors are contiguous in the output): every placed buffer byte is
scattered to its source position, then every buffer is compared again with the result, so
a source byte that two placements (in any buffers) disagree on is reported, not silently
overwritten. Bytes no placement keeps (trimmed tails, unread windows) stay zero and are
counted per tensor; tensors with nothing retained are left out.

Memory is one layer's tensors plus bounded windows: buffer files are read through maps whose
pages are released as they are consumed, and ``--check`` compares the rebuilt tensors with
the model in source order, in chunks, releasing the model's pages behind it. An unpacked
file that fails its check is not kept.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import BadInput, VerificationFailed
from ..filekinds import Q4NX, check_output_kind
from ..keys import GEOMETRY, RETAINED, UNPACKED_FROM
from ..pages import release_mapped
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import (
    AtomicOutputs,
    check_free_space,
    describe_os_error,
    os_error_text,
    settle_for_reading,
)
from . import manifest as mf
from .gather import count_mismatches, scatter
from .geometry import Geometry, TensorShape
from .names import bind, manifest_binding
from .plan import BufferPlan, TensorRef, compile_layer, retained_by_role
from .profile import LayoutProfile
from .profiles import get_profile
from .q4nx import Q4nxFile, TensorSpec, layout

STEP = 32 * 1024 * 1024  # hashing / release granularity of buffer files
CHECK_STEP = 4 * 1024 * 1024  # --check comparison chunk


@dataclass
class TensorRow:
    name: str
    nbytes: int
    retained: int

    @property
    def percent(self) -> float:
        return 100.0 * self.retained / self.nbytes if self.nbytes else 100.0


@dataclass(kw_only=True)
class UnpackResult:
    pack_dir: str
    out: str
    profile: str
    tensors: list[TensorRow]
    left_out: list[str]
    checked_against: str | None = None
    check_mismatches: dict[str, int] = field(default_factory=dict)  # tensor -> bytes differing
    written: bool = True  # False when the check found differences: nothing is left at ``out``
    other_model: str = ""  # why the check model is not the pack's own (allow_other_model)

    @property
    def retained(self) -> int:
        return sum(t.retained for t in self.tensors)

    @property
    def differing(self) -> int:
        return sum(self.check_mismatches.values())


class _CheckFailed(Exception):
    """Raised inside the output group so that a failed check leaves nothing behind."""


class _Mapped:
    """A buffer file mapped read-only; pages are released as the caller moves past them."""

    def __init__(self, path: Path, size: int) -> None:
        try:
            actual = path.stat().st_size
        except OSError as e:
            raise BadInput(os_error_text(e), path) from None
        if actual != size:
            raise BadInput(f"buffer file is {actual:,} bytes, the manifest says {size:,}", path)
        self.path, self.size, self._mm, self._done = path, size, None, 0
        if size == 0:
            self.array = np.zeros(0, np.uint8)
            return
        try:
            with open(path, "rb") as fh:
                self._mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise BadInput(os_error_text(e), path) from None
        self.array = np.frombuffer(self._mm, dtype=np.uint8)

    def release(self, _lo: int, hi: int) -> None:
        """Drop this process's pages below ``hi`` (callers go through a buffer in order)."""
        if hi > self._done:
            release_mapped(self._mm, self._done, hi)
            self._done = hi

    def rewind(self) -> None:
        self.release(0, self.size)
        self._done = 0

    def sha256(self) -> str:
        h = hashlib.sha256()
        for i in range(0, self.size, STEP):
            h.update(self.array[i : i + STEP].data)
            self.release(i, i + STEP)
        self.rewind()
        return h.hexdigest()

    def close(self) -> None:
        self.array = np.zeros(0, np.uint8)
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _validate(doc: dict, pack: Path) -> tuple[LayoutProfile, Geometry]:
    """The manifest against the profile and geometry it names: every layer lists exactly the
    profile's tensors (names, dtypes, shapes, retained bytes) and buffers (sizes)."""
    path = pack / mf.MANIFEST
    try:
        prof = get_profile(doc["profile"]["name"])
        geo = Geometry.named(doc["model"]["geometry"])
    except BadInput as e:
        raise BadInput(f"manifest: {e.message}", path) from None
    for layer_doc in doc["layers"]:
        layer = layer_doc["layer"]
        where = f"layer {layer}"
        if layer >= geo.n_layers:
            raise BadInput(f"manifest {where}: geometry {geo.name} has {geo.n_layers} layers", path)
        kind = geo.kind(layer)
        if layer_doc["kind"] != kind.value:
            raise BadInput(
                f"manifest {where} is listed as {layer_doc['kind']!r}, geometry {geo.name} says "
                f"{kind.value!r}",
                path,
            )
        lay = prof.layout(geo, kind)
        roles = lay.roles()
        listed = {t["role"]: t for t in layer_doc["tensors"]}
        missing = [r for r in roles if r not in listed]
        extra = [r for r in listed if r not in roles]
        if missing or extra or len(listed) != len(layer_doc["tensors"]):
            raise BadInput(
                f"manifest {where}: profile {prof.name} places the tensor roles "
                f"{', '.join(roles)}; the manifest lists "
                + (", ".join(t["role"] for t in layer_doc["tensors"]) or "none"),
                path,
            )
        kept = mf.retained_bytes(p for b in lay.buffers for p in b.placements)
        for role, t in listed.items():
            want = geo.shape(role)
            name = geo.name_of(role, layer)
            if t["name"] != name or t["dtype"] != want.dtype or tuple(t["shape"]) != want.shape:
                raise BadInput(
                    f"manifest {where}: tensor {t['name']!r} {t['dtype']}{t['shape']} is not "
                    f"{name!r} {want.text()} as profile {prof.name} and geometry {geo.name} need",
                    path,
                )
            if t["retained"] != kept.get(role, 0):
                raise BadInput(
                    f"manifest {where}: tensor {name!r} retains {t['retained']:,} bytes, profile "
                    f"{prof.name} keeps {kept.get(role, 0):,}",
                    path,
                )
        specs = {b.name: b for b in lay.buffers}
        listed_b = {b["name"]: b for b in layer_doc["buffers"]}
        if set(listed_b) != set(specs):
            raise BadInput(
                f"manifest {where}: profile {prof.name} has the buffers {', '.join(specs)}; the "
                f"manifest lists {', '.join(listed_b)}",
                path,
            )
        for name, b in listed_b.items():
            if b["size"] != specs[name].size:
                raise BadInput(
                    f"manifest {where} {name}: size {b['size']:,}, profile {prof.name} says "
                    f"{specs[name].size:,}",
                    path,
                )
    return prof, geo


def _fingerprint_difference(model_doc: dict, check: Q4nxFile) -> str:
    fp = mf.fingerprint(check)
    parts = []
    if fp["size"] != model_doc["size"]:
        parts.append(f"{fp['size']:,} bytes, the pack's model {model_doc['size']:,}")
    if fp["header_sha256"] != model_doc["header_sha256"]:
        parts.append("its header's sha256 differs")
    return "; ".join(parts)


def unpack(
    pack_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    check_model: str | os.PathLike[str] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    verify_hashes: bool = True,
    allow_other_model: bool = False,
) -> UnpackResult:
    """Rebuild a pack's source tensors as a ``.q4nx``; with ``check_model``, compare every
    retained byte with that model (refused up front if it is not the pack's model, unless
    ``allow_other_model``) and keep nothing if any byte differs."""
    check_output_kind(out_path, Q4NX)
    pack = Path(pack_dir)
    for folder in (pack.parent, pack):  # a half-switched pack (or buffers): finished or refused
        if folder.is_dir():
            settle_for_reading(folder)
    doc = mf.read_manifest(pack)
    prof, geo = _validate(doc, pack)
    specs, retained = [], {}
    for layer in doc["layers"]:
        for t in layer["tensors"]:
            if t["retained"] > 0:
                specs.append(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])))
                retained[t["name"]] = t["retained"]
    left_out = [t["name"] for layer in doc["layers"] for t in layer["tensors"] if not t["retained"]]
    meta = {
        GEOMETRY: geo.name,
        UNPACKED_FROM: prof.name,
        RETAINED: json.dumps(retained, separators=(",", ":")),
    }
    header, placed = layout(specs, meta)
    offsets = {s.name: len(header) + off for s, off in placed}
    total = len(header) + sum(s.nbytes for s, _ in placed)
    out = Path(out_path)
    inputs = [pack / mf.MANIFEST] + [
        pack / b["file"] for lay in doc["layers"] for b in lay["buffers"]
    ]
    other = ""
    check = None
    if check_model is not None:
        inputs.append(Path(check_model))
        binding = manifest_binding(doc["model"], Path(pack_dir) / mf.MANIFEST)
        check = Q4nxFile(check_model)
        if binding is not None:  # packed through a names file: the same tensors by its names
            try:
                bind(check, binding)
            except BadInput:
                check.close()
                raise
        other = _fingerprint_difference(doc["model"], check)
        if other and not allow_other_model:
            check.close()
            raise BadInput(
                f"not the model this pack was made from ({other}); pass `allow_other_model` "
                "to compare anyway",
                check_model,
            )
    parent = out.parent if str(out.parent) else Path(".")
    if parent.is_dir():
        check_free_space(parent, total, "the unpacked model")
    mismatches: dict[str, int] = {}
    written = True
    progress.start(f"unpacking {len(doc['layers'])} layer(s)", total)
    try:
        with AtomicOutputs(inputs=inputs) as outs:
            fh = outs.open(out)
            fh.write(header)
            progress.advance(len(header))
            for layer_doc in sorted(doc["layers"], key=lambda d: _first_offset(d, offsets)):
                n = _unpack_layer(
                    layer_doc, pack, prof, geo, offsets, fh, verify_hashes, check, mismatches
                )
                progress.advance(n)
            if any(mismatches.values()):
                raise _CheckFailed
    except _CheckFailed:
        written = False
    except OSError as e:
        raise describe_os_error(e, out) from None
    finally:
        progress.finish()
        if check is not None:
            check.close()
    rows = [TensorRow(s.name, s.nbytes, retained[s.name]) for s, _ in placed]
    return UnpackResult(
        pack_dir=str(pack),
        out=str(out),
        profile=prof.name,
        tensors=rows,
        left_out=left_out,
        checked_against=str(check_model) if check_model else None,
        check_mismatches=mismatches,
        written=written,
        other_model=other,
    )


def _first_offset(layer_doc: dict, offsets: dict[str, int]) -> int:
    return min(
        (offsets[t["name"]] for t in layer_doc["tensors"] if t["name"] in offsets), default=0
    )


def _unpack_layer(
    layer_doc: dict[str, Any],
    pack: Path,
    prof: LayoutProfile,
    geo: Geometry,
    offsets: dict[str, int],
    fh: BinaryIO,
    verify_hashes: bool,
    check: Q4nxFile | None,
    mismatches: dict[str, int],
) -> int:
    layer = layer_doc["layer"]
    kept = [t for t in layer_doc["tensors"] if t["name"] in offsets]
    if not kept:
        return 0
    lo = min(offsets[t["name"]] for t in kept)
    hi = max(offsets[t["name"]] + t["nbytes"] for t in kept)
    refs = {}
    for t in layer_doc["tensors"]:
        shape = TensorShape(t["dtype"], tuple(t["shape"]))
        at = offsets[t["name"]] - lo if t["name"] in offsets else 0
        size = t["nbytes"] if t["name"] in offsets else 0
        refs[t["role"]] = TensorRef(t["role"], t["name"], at, size, shape)
    plan = compile_layer(prof, geo, layer, refs, hi - lo)
    span = np.zeros(hi - lo, dtype=np.uint8)
    by_name = {b["name"]: b for b in layer_doc["buffers"]}
    maps: list[tuple[BufferPlan, _Mapped]] = []
    try:
        for bp in plan.buffers:  # hash, then scatter every placed byte to its source position
            b = by_name[bp.name]
            if b["layout_sha256"] != plan.layout.digest(bp.name):
                raise BadInput(
                    f"layer {layer} {bp.name}: the pack was made by a different definition of "
                    f"profile {prof.name} (layout digest differs)",
                    pack,
                )
            m = _Mapped(mf.member(pack, b["file"]), bp.size)
            maps.append((bp, m))
            if verify_hashes and b["sha256"] and m.sha256() != b["sha256"]:
                raise BadInput("sha256 differs from the manifest: the buffer file changed", m.path)
            scatter(m.array, bp, span, m.release)
            m.rewind()
        for bp, m in maps:  # then every copy of a source byte must agree with the result
            bad = count_mismatches(m.array, bp, span, m.release)
            if bad:
                raise VerificationFailed(
                    f"{bad:,} placed bytes disagree with another copy of the same source bytes",
                    m.path,
                )
    finally:
        for _bp, m in maps:
            m.close()
    if check is not None:
        keep = retained_by_role(p for bp in plan.buffers for p in bp.placements)
        for t in kept:
            rel = offsets[t["name"]] - lo
            mismatches[t["name"]] = _check_tensor(
                span[rel : rel + t["nbytes"]], check, t["name"], keep[t["role"]]
            )
    fh.write(span.data)
    return hi - lo


def _check_tensor(rebuilt: np.ndarray, check: Q4nxFile, name: str, keep: np.ndarray) -> int:
    """Retained bytes (``keep``: sorted disjoint ranges) of a rebuilt tensor that differ from
    the check model's, compared in ``CHECK_STEP`` chunks, releasing the model's pages."""
    e = check.entries.get(name)
    if e is None or e.nbytes != rebuilt.size:
        got = "is missing" if e is None else f"is {e.spec()}"
        raise BadInput(f"tensor {name!r} {got}: cannot compare it", check.path)
    src = check.raw(name)
    base = check.data_start + e.begin
    starts, ends = keep[:, 0], keep[:, 1]
    bad = 0
    for c0 in range(0, rebuilt.size, CHECK_STEP):
        c1 = min(rebuilt.size, c0 + CHECK_STEP)
        i0 = int(np.searchsorted(ends, c0, side="right"))
        i1 = int(np.searchsorted(starts, c1, side="left"))
        if i1 > i0:
            s = np.clip(starts[i0:i1], c0, c1) - c0
            t = np.clip(ends[i0:i1], c0, c1) - c0
            ne = rebuilt[c0:c1] != src[c0:c1]
            if len(s) == 1 and s[0] == 0 and t[0] == c1 - c0:
                bad += int(np.count_nonzero(ne))
            else:
                cs = np.concatenate([[0], np.cumsum(ne, dtype=np.int32)])
                bad += int((cs[t] - cs[s]).sum())
        check.drop_pages(base + c0, base + c1)
    return bad
