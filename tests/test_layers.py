"""Imports point down the layer order that docs/architecture.md writes down (its one place):
a module that imported a higher layer (at module level, inside a function, or only for typing)
would tie a low package to one built on it, as checkpoint and trace once tied each other."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import moepack

PACKAGE = Path(moepack.__file__).parent
DOC = PACKAGE.parents[1] / "docs" / "architecture.md"


def read_layers(text: str) -> dict[str, int]:
    """``name -> layer number`` from the numbered list of the doc's ``## Layers`` section."""
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/architecture.md has no '## Layers' section"
    layers: dict[str, int] = {}
    for line in section.group(1).splitlines():
        item = re.match(r"(\d+)\. ", line)
        if not item:
            continue
        for name in re.findall(r"`([^`]+)`", line):
            assert name not in layers, f"{name} is placed in two layers"
            layers[name] = int(item.group(1))
    return layers


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted
    line: int


def _module_name(path: Path) -> tuple[str, str]:
    """The dotted name of ``path`` and the package its relative imports start from."""
    parts = ("moepack", *path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _submodule(package: str, name: str) -> str:
    """``package.name`` when that is a module or package, else ``package`` (a name in it)."""
    where = PACKAGE.joinpath(*package.split(".")[1:], name)
    is_module = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
    return f"{package}.{name}" if is_module else package


def imports_in(source: str, path: Path) -> list[Import]:
    """Every import of a moepack module in ``source`` (the text of ``path`` in the package),
    wherever it stands: ``import``, ``from`` (relative too) and
    ``importlib.import_module("moepack...")`` with a literal name."""
    module, package = _module_name(path)
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                start = ".".join(base)
                if node.module:
                    targets = [f"{start}.{node.module}"]
                else:  # from . import x: x is a module, or a name the package defines
                    targets = [_submodule(start, a.name) for a in node.names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            first = node.args[0] if node.args else None
            if name == "import_module" and isinstance(first, ast.Constant):
                targets = [str(first.value)]
        found += [
            Import(module, t, getattr(node, "lineno", 0))
            for t in targets
            if t.split(".")[0] == "moepack"
        ]
    return found


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(), path)


def layer_of(dotted: str, layers: dict[str, int]) -> int | None:
    """The layer of a dotted moepack module: its sub-package's where the doc places that
    (``llama.runtime``), else its package's, or its own when top-level."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return layers.get("__init__")
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in layers:
        return layers[f"{parts[1]}.{parts[2]}"]
    return layers.get(parts[1])


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


LAYERS = read_layers(DOC.read_text())


def test_the_doc_lists_the_layers_in_order() -> None:
    numbers = sorted(set(LAYERS.values()))
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    assert LAYERS["errors"] == 1 and LAYERS["entry"] == max(numbers)
    assert LAYERS["checkpoint"] < LAYERS["trace"] < LAYERS["planted"] < LAYERS["layout"]
    assert LAYERS["storage"] == LAYERS["npu"] == LAYERS["checkpoint"]


def test_every_package_and_top_level_module_has_a_layer() -> None:
    names = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in PACKAGE.glob("*.py")}
    assert len(names) > 20
    assert names - set(LAYERS) == set(), "add them to docs/architecture.md's '## Layers'"


def test_a_package_split_into_layers_places_every_part() -> None:
    """A package whose sub-packages the doc places (``llama``) keeps nothing beside them but
    its ``__init__``: a module there would take the package's layer and slip past the order."""
    split = {name.split(".")[0] for name in LAYERS if "." in name}
    assert "llama" in split
    for package in split:
        root = PACKAGE / package
        parts = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
        parts |= {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
        placed = {name.split(".", 1)[1] for name in LAYERS if name.startswith(f"{package}.")}
        assert parts == placed, f"{package}/: place {sorted(parts - placed)} in the doc"
    assert LAYERS["llama.protocol"] < LAYERS["llama.prefetcher"] < LAYERS["llama.runtime"]
    assert LAYERS["llama.runtime"] < LAYERS["llama.judge"] < LAYERS["serve"]


def test_no_import_runs_up_the_layers() -> None:
    checked = 0
    upward = []
    for path in modules():
        for imp in imports_of(path):
            here, there = layer_of(imp.module, LAYERS), layer_of(imp.target, LAYERS)
            assert here is not None and there is not None, imp
            checked += 1
            if there > here:
                upward.append(f"{imp.module}:{imp.line} imports {imp.target}")
    assert checked > 800
    assert upward == []


@pytest.mark.parametrize(
    ("source", "where", "upward"),
    [
        ("from ..layout.coactivation_plan import greedy_chain\n", "trace/x.py", True),
        ("def f():\n    from ..planted import routing_trace\n", "checkpoint/x.py", True),
        ("import moepack.cli.main\n", "errors.py", True),
        ("if True:\n    from moepack.stream import policy\n", "store/x.py", True),
        (
            "import importlib\nimportlib.import_module('moepack.llama.runtime.run')\n",
            "layout/x.py",
            True,
        ),
        ("from . import x\nfrom .. import keys\n", "trace/x.py", False),
        ("from ..checkpoint.model import MoeModel\n", "trace/x.py", False),
        ("from ..judge.dropin import check_dropin\n", "llama/runtime/x.py", True),
        ("from ..runtime.session import open_session\n", "llama/prefetcher/x.py", True),
        ("from ..prefetcher.lookahead import x\n", "llama/protocol/x.py", True),
        ("from ..prefetcher.evalcb import EvalCallback\n", "llama/runtime/x.py", False),
    ],
)
def test_the_check_sees_every_kind_of_import(source: str, where: str, upward: bool) -> None:
    """The scan on planted sources: a check that saw no import could never fail."""
    path = PACKAGE / where
    found = imports_in(source, path)
    assert found
    here = layer_of(_module_name(path)[0], LAYERS)
    assert here is not None
    ups = [i for i in found if (layer_of(i.target, LAYERS) or 0) > here]
    assert bool(ups) is upward, found
