"""No two classes in the package share a name: a name says what a class is, and an import of
the wrong one of two ``VerifyResult`` classes type-checks until it fails at run time."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import moepack

PACKAGE = Path(moepack.__file__).parent


def test_every_class_name_is_unique_across_the_package() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert shared == {}
