"""Bind profile roles to a ``.q4nx`` file's own tensor names.

moepack's tensor-name suffixes for the 35B are a reading of the reference (``unverified``);
a real file may spell them otherwise (HF-style ``model.layers.N.mlp.experts.up_proj``,
FLM-style abbreviations). A *names file* maps roles to name templates with ``{L}`` for the
layer number; binding it makes the file's tensors answer to moepack's canonical names, so the
packer, plans and checks work unchanged. ``inspect`` proposes a binding by shape and dtype
(every role of a layer kind has a known shape) and says which roles it cannot decide.

Names file: ``{"format": "moepack.npu.names", "version": 1, "roles": {role: template},
"unresolved": {role: [candidate templates]}}``; ``pack`` refuses one with unresolved roles.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadInput
from ..filekinds import NAMES, check_output_kind
from ..inputs import load_json, read_capped
from ..safeio import write_bytes_atomic
from .geometry import ROLE_NAMES, Geometry, LayerKind
from .profile import LayoutProfile
from .q4nx import Q4nxFile, Q4nxTensor

FORMAT = "moepack.npu.names"
VERSION = 1
NUMBER = re.compile(r"(?<![0-9])([0-9]+)(?![0-9])")
# the I8 expert tensors imply the expert count n: [16n, 8, 5120] (up/gate), [64n, 2, 5120]
EXPERT_PATTERNS = (((8, 5120), 16), ((2, 5120), 64))
# A names file binds a few dozen roles: 1 MiB is far beyond any real one.
MAX_NAMES_BYTES = 1 << 20


@dataclass
class Binding:
    """Role -> template (``{L}`` = layer); roles not listed keep moepack's own names."""

    roles: dict[str, str]
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "roles": dict(self.roles)}


def _fail(path: str | os.PathLike[str], what: str) -> BadInput:
    return BadInput(f"names file: {what}", path)


def _no_duplicates(path: str | os.PathLike[str]) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise _fail(path, f"role {k!r} is bound twice")
            out[k] = v
        return out

    return hook


def load_names(path: str | os.PathLike[str]) -> Binding:
    """A names file, checked: known roles, one ``{L}`` template each, no role bound twice,
    no template shared by two roles, nothing left unresolved. Read like every input: a
    regular file, capped, JSON bounded in depth and integers."""
    raw = read_capped(path, "names file", MAX_NAMES_BYTES)
    try:
        doc = load_json(raw, path, "names file", pairs_hook=_no_duplicates(path))
    except BadInput as e:  # this reader's own wording: "names file: is not JSON, ..."
        if e.message.startswith("names file: "):  # the duplicate check's own error
            raise
        shown = e.message.removeprefix("names file ").replace("is not valid JSON", "is not JSON")
        raise _fail(path, shown) from None
    if not isinstance(doc, dict):
        raise _fail(path, f"is a JSON {type(doc).__name__}, expected an object")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise _fail(path, f"format/version is not {FORMAT!r} / {VERSION}")
    roles = doc.get("roles")
    if not isinstance(roles, dict):
        raise _fail(path, "'roles' is not an object of role -> name template")
    unresolved = doc.get("unresolved", {})
    if not isinstance(unresolved, dict):
        raise _fail(path, "'unresolved' is not an object")
    if unresolved:
        raise _fail(
            path,
            f"roles left unresolved: {', '.join(sorted(unresolved))} (several tensors fit; "
            "choose one name for each and move it to 'roles')",
        )
    problem = roles_problem(roles)
    if problem:
        raise _fail(path, problem)
    return Binding(dict(roles), os.fspath(path))


def roles_problem(roles: dict[Any, Any], field: str = "roles") -> str | None:
    """Why a role -> template object is not a binding, or None: known roles, string
    templates with exactly one ``{L}``, no template shared by two roles."""
    seen: dict[str, str] = {}
    for role, template in roles.items():
        if role not in ROLE_NAMES:
            return f"unknown role {role!r} (roles: see 'moepack npu map')"
        if not isinstance(template, str):
            return f"{field}.{role} is {json.dumps(template)}, expected a string"
        if template.count("{L}") != 1 or re.sub(r"\{L\}", "", template).count("{") > 0:
            return f"{field}.{role} {template!r} needs exactly one '{{L}}' (the layer)"
        if template in seen:
            return f"{field} {seen[template]!r} and {role!r} are bound to one tensor"
        seen[template] = role
    return None


def manifest_binding(model_doc: dict[str, Any], where: str | os.PathLike[str]) -> Binding | None:
    """The binding a pack's manifest records (``model.tensor_binding``), checked like a
    names file: a manifest is user-editable input."""
    doc = model_doc.get("tensor_binding")
    if doc is None:
        return None
    roles = doc.get("roles") if isinstance(doc, dict) else None
    if not isinstance(roles, dict):
        raise BadInput("manifest: model.tensor_binding.roles is not an object", where)
    problem = roles_problem(roles, "model.tensor_binding.roles")
    if problem:
        raise BadInput(f"manifest: {problem}", where)
    source = doc.get("source")
    return Binding(dict(roles), source if isinstance(source, str) else "the manifest")


def _template_re(template: str) -> re.Pattern[str]:
    head, tail = template.split("{L}")
    return re.compile(f"^{re.escape(head)}([0-9]+){re.escape(tail)}$")


def bind(model: Q4nxFile, binding: Binding) -> None:
    """Make ``model`` answer to canonical names for the bound tensors (in place). Every
    template must name tensors in the file; a canonical name that already exists beside a
    bound one would be two tensors for one role, and is refused."""
    moved: dict[str, Q4nxTensor] = {}
    claimed: dict[str, str] = {}  # file name -> the role that took it
    for role, template in binding.roles.items():
        pattern = _template_re(template)
        hits = [(n, int(m.group(1))) for n in model.entries if (m := pattern.match(n))]
        if not hits:
            raise BadInput(
                f"names file {binding.source}: roles.{role} {template!r} names no tensor "
                "in the file",
                model.path,
            )
        for name, layer in hits:
            canonical = Geometry.name_of(role, layer)
            if canonical != name and canonical in model.entries:
                raise BadInput(
                    f"role {role} of layer {layer} is both {canonical!r} and {name!r} "
                    f"(bound by {binding.source})",
                    model.path,
                )
            if name in claimed:
                raise BadInput(
                    f"tensor {name!r} is bound to two roles, {claimed[name]} and {role} "
                    f"(by {binding.source})",
                    model.path,
                )
            claimed[name] = role
            moved[canonical] = model.entries[name]
    for template in binding.roles.values():
        for name in [n for n in model.entries if _template_re(template).match(n)]:
            del model.entries[name]
    model.entries.update(moved)


# -- proposing a binding: inspect ---------------------------------------------------------


@dataclass
class BoundTensor:
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    layer: int | None
    role: str | None  # the role it fills, if decided
    how: str  # "name" | "shape" | "ambiguous" | "-"


@dataclass
class NamesInspection:
    path: str
    geometry: str
    profile: str
    tensors: list[BoundTensor]
    roles: dict[str, str]  # role -> template, decided for every layer alike
    ambiguous: dict[str, list[str]]  # role -> candidate templates
    missing: dict[str, list[int]]  # role -> layers with no tensor of its shape
    names_file: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "geometry": self.geometry,
            "profile": self.profile,
            "tensors": [vars(t) for t in self.tensors],
            "roles": self.roles,
            "ambiguous": self.ambiguous,
            "missing": self.missing,
            "names_file": self.names_file,
            "notes": self.notes,
        }

    def names_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.path,
            "roles": self.roles,
            "unresolved": self.ambiguous,
        }


def guess_geometry(model: Q4nxFile) -> Geometry:
    """The geometry from the expert tensors' shapes alone (names unknown): the commonest
    expert count any I8 ``[16n, 8, 5120]`` / ``[64n, 2, 5120]`` tensor implies."""
    votes: dict[int, int] = {}
    for e in model.entries.values():
        for tail, factor in EXPERT_PATTERNS:
            if e.dtype == "I8" and tuple(e.shape[1:]) == tail and e.shape[0] % factor == 0:
                n = e.shape[0] // factor
                votes[n] = votes.get(n, 0) + 1
    if not votes:
        raise BadInput("no expert tensor (I8 [16n, 8, 5120] or [64n, 2, 5120]) found", model.path)
    n = max(votes, key=lambda k: (votes[k], k))
    return Geometry.full() if n == 256 else Geometry.scaled(n)


def layer_of(name: str) -> int | None:
    """The layer number in a tensor name: the first whole number in it (``model.layers.12``,
    ``blk.12``), or None (embeddings, final norm)."""
    m = NUMBER.search(name)
    return int(m.group(1)) if m else None


def _template(name: str, layer: int) -> str:
    return NUMBER.sub(lambda m: "{L}" if int(m.group(1)) == layer else m.group(1), name, count=1)


def inspect(model: Q4nxFile, profile: LayoutProfile) -> NamesInspection:
    """Every tensor and the role it fills: by moepack's own name when present, else by a
    unique dtype and shape among the layer's tensors; roles several tensors fit are
    ambiguous, roles none fits are missing."""
    geo = guess_geometry(model)
    roles_of = {}
    for kind in LayerKind:
        try:
            roles_of[kind] = list(profile.layout(geo, kind).roles())
        except BadInput:  # this profile cannot lay out this kind here: the geometry's roles
            roles_of[kind] = list(geo.roles(kind))
    by_layer: dict[int, list[Q4nxTensor]] = {}
    for e in model.entries.values():
        layer = layer_of(e.name)
        if layer is not None and layer < geo.n_layers:
            by_layer.setdefault(layer, []).append(e)
    filled: dict[str, tuple[str, str]] = {}  # tensor name -> (role, how)
    decided: dict[str, set[str]] = {}  # role -> templates seen
    ambiguous: dict[str, set[str]] = {}
    missing: dict[str, list[int]] = {}
    for layer, tensors in sorted(by_layer.items()):
        roles = roles_of[geo.kind(layer)]
        names = {t.name for t in tensors}
        canon = {Geometry.name_of(r, layer) for r in ROLE_NAMES}
        free = [t for t in tensors if t.name not in canon]
        for role in roles:
            want = geo.shape(role)
            canonical = Geometry.name_of(role, layer)
            if canonical in names:
                filled[canonical] = (role, "name")
                decided.setdefault(role, set()).add(_template(canonical, layer))
                continue
            fits = [t for t in free if t.dtype == want.dtype and tuple(t.shape) == want.shape]
            if len(fits) == 1:
                filled[fits[0].name] = (role, "shape")
                decided.setdefault(role, set()).add(_template(fits[0].name, layer))
            elif fits:
                ambiguous.setdefault(role, set()).update(_template(t.name, layer) for t in fits)
                for t in fits:
                    filled.setdefault(t.name, (role, "ambiguous"))
            else:
                missing.setdefault(role, []).append(layer)
    notes = []
    roles_out: dict[str, str] = {}
    for role, templates in sorted(decided.items()):
        if role in ambiguous or len(templates) > 1:
            ambiguous.setdefault(role, set()).update(templates)
        else:
            (only,) = templates
            if only != "model.layer.{L}." + ROLE_NAMES[role]:
                roles_out[role] = only
    taken: dict[str, str] = {}
    for role, template in list(roles_out.items()):
        if template in taken:  # one template fits two roles in different layers: undecided
            ambiguous.setdefault(role, set()).add(template)
            ambiguous.setdefault(taken[template], set()).add(template)
        taken[template] = role
    for role in ambiguous:
        roles_out.pop(role, None)
    rows = []
    for e in sorted(model.entries.values(), key=lambda e: e.name):
        filled_role, how = filled.get(e.name, ("", "-"))
        rows.append(
            BoundTensor(
                e.name,
                e.dtype,
                list(e.shape),
                e.end - e.begin,
                layer_of(e.name),
                filled_role if how in ("name", "shape") else None,
                how,
            )
        )
    if not roles_out and not ambiguous and not missing:
        notes.append("every role has moepack's own name: no binding needed")
    return NamesInspection(
        os.fspath(model.path),
        geo.name,
        profile.name,
        rows,
        roles_out,
        {r: sorted(t) for r, t in sorted(ambiguous.items())},
        dict(sorted(missing.items())),
        notes=notes,
    )


def inspect_file(
    path: str | os.PathLike[str],
    profile: str | None = None,
    write_names: str | os.PathLike[str] | None = None,
) -> NamesInspection:
    """``inspect`` on a file; with ``write_names``, also write the proposed binding there
    (a starting names file: decided roles under 'roles', the undecided under 'unresolved')."""
    from .profiles import get_profile

    prof = get_profile(profile)
    if write_names is not None:
        check_output_kind(write_names, NAMES)
    with Q4nxFile(path) as model:
        res = inspect(model, prof)
    if write_names is not None:
        doc = json.dumps(res.names_json(), indent=1) + "\n"
        write_bytes_atomic(write_names, doc.encode(), inputs=[path])
        res.names_file = os.fspath(write_names)
    return res
