"""The packer's inverse: buffer files back to source tensors.

Each layer is rebuilt in one zeroed array (its tensors are contiguous in the output), every
placed buffer byte is scattered to its source position, and the buffer is then re-gathered
from the result and compared: a source byte that two placements disagree on is reported, not
silently overwritten. Bytes no placement keeps (trimmed tails, unread windows) stay zero and
are counted per tensor; tensors with nothing retained are left out.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BadInput, VerificationFailed
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import AtomicOutputs, check_free_space, describe_os_error
from . import manifest as mf
from .gather import count_mismatches, scatter
from .geometry import Geometry, TensorShape, check_tensors
from .plan import TensorRef, compile_layer, model_refs
from .profiles import get_profile
from .q4nx import Q4nxFile, TensorSpec, layout


@dataclass
class TensorRow:
    name: str
    nbytes: int
    retained: int

    @property
    def percent(self) -> float:
        return 100.0 * self.retained / self.nbytes if self.nbytes else 100.0


@dataclass
class UnpackResult:
    pack_dir: str
    out: str
    profile: str
    tensors: list[TensorRow]
    left_out: list[str]
    checked_against: str | None = None
    check_mismatches: dict[str, int] = field(default_factory=dict)

    @property
    def retained(self) -> int:
        return sum(t.retained for t in self.tensors)


def _map(path: Path, size: int) -> tuple[np.ndarray, mmap.mmap | None]:
    try:
        actual = path.stat().st_size
    except OSError as e:
        raise BadInput(e.strerror or str(e), path) from None
    if actual != size:
        raise BadInput(f"buffer file is {actual:,} bytes, the manifest says {size:,}", path)
    if size == 0:
        return np.zeros(0, np.uint8), None
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=np.uint8), mm


def unpack(
    pack_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    check_model: str | os.PathLike[str] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    verify_hashes: bool = True,
) -> UnpackResult:
    pack = Path(pack_dir)
    doc = mf.read_manifest(pack)
    prof = get_profile(doc["profile"]["name"])
    geo = Geometry.named(doc["model"]["geometry"])
    specs, retained, roles = [], {}, {}
    for layer in doc["layers"]:
        for t in layer["tensors"]:
            if int(t["retained"]) > 0:
                specs.append(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])))
                retained[t["name"]] = int(t["retained"])
                roles[t["name"]] = (int(layer["layer"]), t["role"])
    left_out = [
        t["name"] for layer in doc["layers"] for t in layer["tensors"] if int(t["retained"]) == 0
    ]
    meta = {
        "moepack.geometry": geo.name,
        "moepack.unpacked_from": prof.name,
        "moepack.retained": json.dumps(retained, separators=(",", ":")),
    }
    header, placed = layout(specs, meta)
    offsets = {s.name: len(header) + off for s, off in placed}
    total = len(header) + sum(s.nbytes for s, _ in placed)
    out = Path(out_path)
    inputs = [pack / mf.MANIFEST] + [
        pack / b["file"] for lay in doc["layers"] for b in lay["buffers"]
    ]
    if check_model is not None:
        inputs.append(Path(check_model))
    parent = out.parent if str(out.parent) else Path(".")
    if parent.is_dir():
        check_free_space(parent, total, "the unpacked model")
    mismatches: dict[str, int] = {}
    check = Q4nxFile(check_model) if check_model is not None else None
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
    except OSError as e:
        raise describe_os_error(e, out) from None
    finally:
        progress.finish()
        if check is not None:
            check.close()
    rows = [TensorRow(s.name, s.nbytes, retained[s.name]) for s, _ in placed]
    result = UnpackResult(str(pack), str(out), prof.name, rows, left_out,
                          str(check_model) if check_model else None, mismatches)  # fmt: skip
    return result


def _first_offset(layer_doc: dict, offsets: dict[str, int]) -> int:
    return min(
        (offsets[t["name"]] for t in layer_doc["tensors"] if t["name"] in offsets), default=0
    )


def _unpack_layer(layer_doc, pack, prof, geo, offsets, fh, verify_hashes, check, mismatches) -> int:
    layer = int(layer_doc["layer"])
    if geo.kind(layer).value != layer_doc["kind"]:
        raise BadInput(
            f"layer {layer} is listed as {layer_doc['kind']!r}, geometry says otherwise", pack
        )
    kept = [t for t in layer_doc["tensors"] if t["name"] in offsets]
    if not kept:
        return 0
    lo = min(offsets[t["name"]] for t in kept)
    hi = max(offsets[t["name"]] + int(t["nbytes"]) for t in kept)
    refs = {}
    for t in kept:
        shape = TensorShape(t["dtype"], tuple(t["shape"]))
        refs[t["role"]] = TensorRef(
            t["role"], t["name"], offsets[t["name"]] - lo, int(t["nbytes"]), shape
        )
    missing = [r for r in prof.layout(geo, geo.kind(layer)).roles() if r not in refs]
    if missing:
        raise BadInput(f"layer {layer}: the manifest lists no tensor for role(s) {missing}", pack)
    plan = compile_layer(prof, geo, layer, refs, hi - lo)
    span = np.zeros(hi - lo, dtype=np.uint8)
    by_name = {b["name"]: b for b in layer_doc["buffers"]}
    model_plan = None
    if check is not None:
        roles = plan.layout.roles()
        check_tensors(check, geo, layer, roles)
        model_plan = compile_layer(
            prof, geo, layer, model_refs(check, geo, layer, roles), check.size
        )
    for bp in plan.buffers:
        b = by_name.get(bp.name)
        if b is None:
            raise BadInput(f"layer {layer}: the manifest lists no {bp.name!r} buffer", pack)
        if b.get("layout_sha256") != plan.layout.digest(bp.name):
            raise BadInput(
                f"layer {layer} {bp.name}: the pack was made by a different definition of "
                f"profile {prof.name} (layout digest differs)", pack,
            )  # fmt: skip
        path = pack / b["file"]
        buf, mm = _map(path, bp.size)
        try:
            if verify_hashes and b.get("sha256"):
                got = hashlib.sha256(memoryview(mm) if mm is not None else b"").hexdigest()
                if got != b["sha256"]:
                    raise BadInput(
                        "sha256 differs from the manifest: the buffer file changed", path
                    )
            scatter(buf, bp, span)
            bad = count_mismatches(buf, bp, span)
            if bad:
                raise VerificationFailed(
                    f"{bad:,} placed bytes disagree with another copy of the same source bytes",
                    path,
                )
            if model_plan is not None:
                mbp = model_plan.buffer(bp.name)
                mismatches[f"layer {layer} {bp.name}"] = count_mismatches(buf, mbp, check.u8)
        finally:
            del buf
            if mm is not None:
                mm.close()
    if check is not None:
        refs_m = [r for r in model_plan.tensors.values()]
        check.drop_pages(min(r.start for r in refs_m), max(r.start + r.nbytes for r in refs_m))
    fh.write(memoryview(span))
    return hi - lo
