"""The buffer map: every placement and zero stretch of a layer's buffers, as table rows.

This is the seed's "weight BO" table, generated from a profile, with each row's provenance.
It needs no model: tensors are laid out virtually from the geometry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from .geometry import Geometry
from .plan import BufferPlan, TensorRef, compile_layer
from .profile import TENSOR_NAMES, LayoutProfile, Status


@dataclass(kw_only=True)
class MapRow:
    region: str
    offset: int
    size: int
    tensor: str
    units: str
    rule: str
    scheme: str
    status: str
    source: str
    note: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass
class BufferMap:
    name: str
    arg: int | None
    size: int
    size_status: str
    size_source: str
    description: str
    rows: list[MapRow]


@dataclass(kw_only=True)
class MapResult:
    profile: str
    runtime: str
    summary: str
    geometry: str
    layer: int
    kind: str
    buffers: list[BufferMap]
    unplaced: dict[str, str] = field(default_factory=dict)
    names_status: str = TENSOR_NAMES.status.value  # the tensor names themselves
    names_source: str = TENSOR_NAMES.source
    names_note: str = TENSOR_NAMES.note

    def statuses(self) -> list[str]:
        seen = {r.status for b in self.buffers for r in b.rows}
        return [s.value for s in Status if s.value in seen]


def virtual_refs(geo: Geometry, layer: int, roles: list[str]) -> tuple[dict[str, TensorRef], int]:
    refs, at = {}, 0
    for role in roles:
        shape = geo.shape(role)
        refs[role] = TensorRef(role, geo.name_of(role, layer), at, shape.nbytes, shape)
        at += shape.nbytes
    return refs, at


def _rows(bp: BufferPlan, prefix: str) -> list[MapRow]:
    rows = []
    for p, ref in zip(bp.placements, bp.refs, strict=True):
        name = ref.name.removeprefix(prefix)
        units = p.describe_units()
        if p.gap:
            units += f" (runs of {p.run}, pitch {p.run_pitch:,})"
        rows.append(
            MapRow(
                region=p.region,
                offset=p.offset,
                size=p.nbytes,
                tensor=name.removesuffix(".weight"),
                units=units,
                rule=p.rule,
                scheme="pairs of 512-B chunks" if p.scheme == "pair512" else "-",
                status=p.status.value,
                source=p.provenance.source,
                note=p.provenance.note,
            )
        )
    documented = {(z.offset, z.offset + z.size): z for z in bp.spec.zero}
    for s, e in bp.gaps():
        z = documented.get((s, e))
        if z is None:
            z = next((d for (a, b), d in documented.items() if a <= s and e <= b), None)
        said = (
            {
                "units": z.what,
                "status": z.provenance.status.value,
                "source": z.provenance.source,
                "note": z.provenance.note,
            }
            if z is not None
            else {"units": "not placed", "status": "-", "source": ""}
        )
        rows.append(
            MapRow(region="", offset=s, size=e - s, tensor="(zero)", rule="-", scheme="-", **said)
        )
    # interleaved placements (up / gate runs) share a span; order rows by first byte
    rows.sort(key=lambda r: (r.offset, r.tensor == "(zero)"))
    return rows


def build_map(profile: LayoutProfile, geo: Geometry, layer: int) -> MapResult:
    kind = geo.kind(layer)
    lay = profile.layout(geo, kind)
    refs, total = virtual_refs(geo, layer, lay.roles())
    plan = compile_layer(profile, geo, layer, refs, total)
    prefix = f"model.layer.{layer}."
    buffers = [
        BufferMap(
            bp.name,
            bp.spec.arg,
            bp.size,
            bp.spec.size_provenance.status.value,
            bp.spec.size_provenance.source,
            bp.spec.description,
            _rows(bp, prefix),
        )
        for bp in plan.buffers
    ]
    unplaced = {geo.name_of(r, layer).removeprefix(prefix): why for r, why in lay.unplaced.items()}
    return MapResult(
        profile=profile.name,
        runtime=profile.runtime,
        summary=profile.summary,
        geometry=geo.name,
        layer=layer,
        kind=kind.value,
        buffers=buffers,
        unplaced=unplaced,
    )


def map_layer(
    profile: str | None, layer: int, model: Path | None = None, geometry: str = "full"
) -> MapResult:
    """``npu map``: the buffer map of ``layer`` under ``profile`` (default profile when
    ``None``), with the geometry taken from ``model`` when given, else the named one."""
    from .geometry import detect
    from .profiles import get_profile
    from .q4nx import Q4nxFile

    prof = get_profile(profile)
    if model is not None:
        with Q4nxFile(model) as m:
            geo = detect(m)
    else:
        geo = Geometry.named(geometry)
    if not 0 <= layer < geo.n_layers:
        raise BadInput(f"layer {layer} is out of range (0-{geo.n_layers - 1})")
    return build_map(prof, geo, layer)
