"""The pack manifest: what each buffer file holds and where every fact came from.

Versioned and self-describing: buffer sizes and sha256, every placement with its provenance,
the source tensors (dtype, shape, retained bytes) and the model's fingerprint, so ``unpack``
can rebuild the source tensors and refuse a pack made by a different profile definition.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import BadInput
from .plan import BufferPlan, LayerPlan, retained_intervals, union_length
from .profile import LayoutProfile, Placement
from .q4nx import Q4nxFile

FORMAT = "moepack.npu.pack"
VERSION = 1
MANIFEST = "manifest.json"


BUFFER_FILE_RE = re.compile(r"layer-\d{2,}\.[a-z][a-z0-9_]*\.bin")


def buffer_file(layer: int, buffer: str) -> str:
    return f"layer-{layer:02d}.{buffer}.bin"


def is_buffer_file(name: object) -> bool:
    """A name the packer itself would write (``layer-LL.<buffer>.bin``), nothing else."""
    return isinstance(name, str) and BUFFER_FILE_RE.fullmatch(name) is not None


def member(folder: str | os.PathLike[str], name: str) -> Path:
    """``folder / name``, refused unless it is a buffer-file name that resolves inside
    ``folder`` (no absolute paths, no ``..``, no symlink pointing elsewhere)."""
    base = Path(folder)
    if not is_buffer_file(name):
        raise BadInput(f"{name!r} is not a pack buffer-file name (layer-LL.<buffer>.bin)", base)
    path = base / name
    try:
        inside = path.resolve().parent == base.resolve()
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise BadInput(f"{name!r} resolves outside the pack folder", base)
    return path


def fingerprint(model: Q4nxFile) -> dict[str, Any]:
    """Binds a pack to its model without hashing 21 GB: size + header hash."""
    with open(model.path, "rb") as fh:
        head = fh.read(model.data_start)
    return {
        "path": os.fspath(model.path),
        "size": model.size,
        "header_sha256": hashlib.sha256(head).hexdigest(),
    }


def placement_json(p: Placement, name: str) -> dict[str, Any]:
    return {
        "region": p.region,
        "offset": p.offset,
        "extent": p.extent,
        "bytes": p.nbytes,
        "tensor": name,
        "role": p.role,
        "unit": p.unit,
        "unit_size": p.unit_size,
        "count": p.count,
        "src_pitch": p.src_pitch,
        "src_origin": p.src_origin,
        "run": p.run,
        "gap": p.gap,
        "length": p.length,
        "rule": p.rule,
        "scheme": p.scheme,
        "status": p.status.value,
        "source": p.provenance.source,
        "note": p.provenance.note,
    }


def buffer_json(bp: BufferPlan, layer: int, sha256: str | None, layout_sha: str) -> dict[str, Any]:
    spec = bp.spec
    return {
        "name": spec.name,
        "arg": spec.arg,
        "file": buffer_file(layer, spec.name),
        "size": spec.size,
        "sha256": sha256,
        "layout_sha256": layout_sha,
        "size_status": spec.size_provenance.status.value,
        "size_source": spec.size_provenance.source,
        "description": spec.description,
        "placements": [
            placement_json(p, r.name) for p, r in zip(spec.placements, bp.refs, strict=True)
        ],
        "zero": [
            {
                "offset": z.offset,
                "size": z.size,
                "what": z.what,
                "status": z.provenance.status.value,
                "source": z.provenance.source,
            }
            for z in spec.zero
        ],  # fmt: skip
        "gaps": [list(g) for g in bp.gaps()],
    }


def retained_by_role(plan: LayerPlan) -> dict[str, int]:
    """Bytes of each source tensor that some buffer keeps (duplicates counted once)."""
    import numpy as np

    per: dict[str, list] = {}
    for bp in plan.buffers:
        for p in bp.placements:
            per.setdefault(p.role, []).append(retained_intervals(p))
    return {role: union_length(np.concatenate(ivs)) for role, ivs in per.items()}


def layer_json(plan: LayerPlan, model: Q4nxFile, buffers: list[dict[str, Any]]) -> dict[str, Any]:
    kept = retained_by_role(plan)
    tensors = []
    for role, ref in plan.tensors.items():
        e = model.entry(ref.name)
        tensors.append(
            {"name": ref.name, "role": role, "dtype": e.dtype, "shape": list(e.shape),
             "nbytes": e.nbytes, "retained": kept.get(role, 0)}
        )  # fmt: skip
    return {
        "layer": plan.layer,
        "kind": plan.kind.value,
        "buffers": buffers,
        "tensors": tensors,
        "unplaced": {plan_name(plan, r): why for r, why in plan.layout.unplaced.items()},
    }


def plan_name(plan: LayerPlan, role: str) -> str:
    from .geometry import Geometry

    return Geometry.name_of(role, plan.layer)


def manifest_json(
    profile: LayoutProfile, model: Q4nxFile, geometry: str, layers: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "moepack": __version__,
        "profile": {
            "name": profile.name,
            "runtime": profile.runtime,
            "summary": profile.summary,
            "status": profile.provenance.status.value,
            "source": profile.provenance.source,
        },
        "model": fingerprint(model) | {"geometry": geometry},
        "layers": layers,
    }


def read_manifest(pack_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(pack_dir) / MANIFEST
    if not Path(pack_dir).is_dir():
        raise BadInput("not a folder (expected a pack folder with manifest.json)", pack_dir)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput("no manifest.json: not a moepack npu pack folder", pack_dir) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"manifest is unreadable ({e})", path) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadInput(f"not a {FORMAT} manifest", path)
    if doc.get("version") != VERSION:
        raise BadInput(
            f"manifest version {doc.get('version')!r}; this moepack reads {VERSION}", path
        )
    try:
        for layer in doc["layers"]:
            int(layer["layer"])
            for b in layer["buffers"]:
                str(b["name"]), str(b["file"]), int(b["size"])
            for t in layer["tensors"]:
                str(t["name"]), str(t["dtype"]), list(t["shape"])
        str(doc["profile"]["name"]), str(doc["model"]["geometry"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"manifest is missing or mistypes a field ({e})", path) from None
    return doc
