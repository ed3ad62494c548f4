"""The pack manifest: what each buffer file holds and where every fact came from.

Versioned and self-describing: buffer sizes and sha256, every placement with its provenance,
the source tensors (dtype, shape, retained bytes) and the model's fingerprint, so ``unpack``
can rebuild the source tensors and refuse a pack made by a different profile definition.
"""

from __future__ import annotations

import builtins
import hashlib
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..errors import BadInput
from ..inputs import load_json, read_capped
from .plan import BufferPlan, LayerPackPlan, retained_by_role
from .profile import TENSOR_NAMES, LayoutProfile, Placement
from .q4nx import Q4nxFile

FORMAT = "moepack.npu.pack"
VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a pack of 40 layers lists a few hundred buffers: ~100 KiB


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
        ],
        "gaps": [list(g) for g in bp.gaps()],
    }


def retained_bytes(placements: Iterable[Placement]) -> dict[str, int]:
    """Bytes of each source tensor that some placement keeps (duplicates counted once)."""
    return {
        role: int((iv[:, 1] - iv[:, 0]).sum()) for role, iv in retained_by_role(placements).items()
    }


def layer_json(
    plan: LayerPackPlan, model: Q4nxFile, buffers: list[dict[str, Any]]
) -> dict[str, Any]:
    kept = retained_bytes(p for bp in plan.buffers for p in bp.placements)
    tensors = []
    for role, ref in plan.tensors.items():
        e = model.entry(ref.name)
        tensors.append(
            {
                "name": ref.name,
                "role": role,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "nbytes": e.nbytes,
                "retained": kept.get(role, 0),
            }
        )
    return {
        "layer": plan.layer,
        "kind": plan.kind.value,
        "buffers": buffers,
        "tensors": tensors,
        "unplaced": {plan_name(plan, r): why for r, why in plan.layout.unplaced.items()},
    }


def plan_name(plan: LayerPackPlan, role: str) -> str:
    from .geometry import Geometry

    return Geometry.name_of(role, plan.layer)


def names_json() -> dict[str, str]:
    """How sure the tensor names are (the pack found its tensors by these names)."""
    return {
        "status": TENSOR_NAMES.status.value,
        "source": TENSOR_NAMES.source,
        "note": TENSOR_NAMES.note,
    }


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
        "model": fingerprint(model) | {"geometry": geometry, "tensor_names": names_json()},
        "layers": layers,
    }


def read_manifest(pack_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a pack folder, with every field ``unpack`` uses checked for type and
    range (and every buffer-file name for being the packer's own, inside the folder).

    A manifest is user-editable input: anything malformed is one ``BadInput`` naming the
    field, never a KeyError or a file opened outside the pack. Whether the manifest agrees
    with its profile and geometry is checked by ``unpack`` (it needs both).
    """
    path = Path(pack_dir) / MANIFEST
    if not Path(pack_dir).exists():
        raise BadInput("pack folder does not exist", pack_dir)
    if not Path(pack_dir).is_dir():
        raise BadInput("not a folder (expected a pack folder with manifest.json)", pack_dir)
    if not path.exists():
        raise BadInput("no manifest.json: not a moepack npu pack folder", pack_dir)
    doc = load_json(read_capped(path, "manifest", MAX_MANIFEST_BYTES), path, "manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadInput(f"not a {FORMAT} manifest", path)
    if doc.get("version") != VERSION:
        raise BadInput(
            f"manifest version {_show(doc.get('version'))}; this moepack reads {VERSION}", path
        )
    _Schema(path).manifest(doc, Path(pack_dir))
    return doc


_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z][a-z0-9_]*")
MAX_LAYER = 999


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class _Schema:
    """Type and range checks with messages that name the field: ``layers[0].tensors[3].shape``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> NoReturn:
        raise BadInput(f"manifest field {where} {problem}", self.path)

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            self.fail(f"{where}.{key}".lstrip("."), "is missing")
        return obj[key]

    def obj(self, v: object, where: str) -> dict:
        if not isinstance(v, dict):
            self.fail(where, f"is {_show(v)}, expected an object")
        return v

    # The checkers below are named after the types they check; inside the class those names
    # are the methods, so annotations spell the types as ``builtins.*``.
    def list(self, v: object, where: str, nonempty: bool = False) -> builtins.list:
        if not isinstance(v, builtins.list):
            self.fail(where, f"is {_show(v)}, expected a list")
        if nonempty and not v:
            self.fail(where, "is empty")
        return v

    def str(
        self,
        v: object,
        where: builtins.str,
        pattern: re.Pattern | None = None,
        what: builtins.str = "",
    ) -> builtins.str:
        if not isinstance(v, builtins.str) or (pattern is not None and not pattern.fullmatch(v)):
            self.fail(where, f"is {_show(v)}, expected {what or 'a string'}")
        return v

    def int(
        self, v: object, where: builtins.str, lo: builtins.int = 0, hi: builtins.int | None = None
    ) -> builtins.int:
        if (
            not isinstance(v, builtins.int)
            or isinstance(v, bool)
            or v < lo
            or (hi is not None and v > hi)
        ):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            self.fail(where, f"is {_show(v)}, expected an integer {rng}")
        return v

    def manifest(self, doc: dict, folder: Path) -> None:
        from .geometry import ROLE_NAMES
        from .q4nx import DTYPE_SIZES

        prof = self.obj(self.get(doc, "profile", ""), "profile")
        self.str(self.get(prof, "name", "profile"), "profile.name")
        model = self.obj(self.get(doc, "model", ""), "model")
        self.str(self.get(model, "geometry", "model"), "model.geometry")
        self.int(self.get(model, "size", "model"), "model.size")
        self.str(
            self.get(model, "header_sha256", "model"),
            "model.header_sha256",
            _HEX64,
            "64 hex digits",
        )
        seen_layers: set[int] = set()
        for i, layer in enumerate(self.list(self.get(doc, "layers", ""), "layers", True)):
            w = f"layers[{i}]"
            layer = self.obj(layer, w)
            n = self.int(self.get(layer, "layer", w), f"{w}.layer", 0, MAX_LAYER)
            if n in seen_layers:
                self.fail(f"{w}.layer", f"repeats layer {n}")
            seen_layers.add(n)
            kind = self.get(layer, "kind", w)
            if kind not in ("linear", "full"):
                self.fail(f"{w}.kind", f"is {_show(kind)}, expected 'linear' or 'full'")
            names: set[str] = set()
            for j, b in enumerate(self.list(self.get(layer, "buffers", w), f"{w}.buffers", True)):
                wb = f"{w}.buffers[{j}]"
                b = self.obj(b, wb)
                name = self.str(self.get(b, "name", wb), f"{wb}.name", _NAME, "a buffer name")
                if name in names:
                    self.fail(f"{wb}.name", f"repeats buffer {name!r}")
                names.add(name)
                want = buffer_file(n, name)
                if self.get(b, "file", wb) != want:
                    self.fail(f"{wb}.file", f"is {_show(b['file'])}, expected {want!r}")
                member(folder, want)
                self.int(self.get(b, "size", wb), f"{wb}.size")
                sha = self.get(b, "sha256", wb)
                if sha is not None:
                    self.str(sha, f"{wb}.sha256", _HEX64, "64 hex digits or null")
                self.str(
                    self.get(b, "layout_sha256", wb), f"{wb}.layout_sha256", _HEX64, "64 hex digits"
                )
            tnames: set[str] = set()
            for j, t in enumerate(self.list(self.get(layer, "tensors", w), f"{w}.tensors")):
                wt = f"{w}.tensors[{j}]"
                t = self.obj(t, wt)
                tname = self.str(self.get(t, "name", wt), f"{wt}.name")
                if tname in tnames:
                    self.fail(f"{wt}.name", f"repeats tensor {tname!r}")
                tnames.add(tname)
                role = self.get(t, "role", wt)
                if not isinstance(role, str) or role not in ROLE_NAMES:
                    self.fail(f"{wt}.role", f"is {_show(role)}, expected a tensor role")
                dtype = self.get(t, "dtype", wt)
                if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
                    self.fail(f"{wt}.dtype", f"is {_show(dtype)}, expected a .q4nx dtype")
                shape = self.list(self.get(t, "shape", wt), f"{wt}.shape")
                if len(shape) > 8:
                    self.fail(f"{wt}.shape", f"has {len(shape)} dimensions")
                for k, d in enumerate(shape):
                    self.int(d, f"{wt}.shape[{k}]")
                need = math.prod(shape) * DTYPE_SIZES[dtype]
                nbytes = self.int(self.get(t, "nbytes", wt), f"{wt}.nbytes")
                if nbytes != need:
                    self.fail(f"{wt}.nbytes", f"is {nbytes:,}; {dtype}{shape} is {need:,} bytes")
                self.int(self.get(t, "retained", wt), f"{wt}.retained", 0, nbytes)
            unplaced = layer.get("unplaced", {})
            if not isinstance(unplaced, dict):
                self.fail(f"{w}.unplaced", f"is {_show(unplaced)}, expected an object")
