"""The one registry helper: discovery, order, aliases, duplicates, unknown names."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.registry import Registry, RegistryError


@pytest.fixture
def family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a throwaway plug-in package; return a function that adds modules to it."""
    counter = {"n": 0}

    def make(modules: dict[str, str]) -> str:
        counter["n"] += 1
        pkg = f"moepack_test_family_{counter['n']}"
        root = tmp_path / pkg
        root.mkdir()
        (root / "__init__.py").write_text("")
        for name, body in modules.items():
            (root / f"{name}.py").write_text(textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))
        return pkg

    yield make
    for mod in [m for m in sys.modules if m.startswith("moepack_test_family_")]:
        del sys.modules[mod]


PLUG = """
class P:
    def __init__(self, name, aliases=()):
        self.name, self.aliases = name, aliases
"""


def test_discovers_in_stable_order_with_aliases(family) -> None:
    pkg = family(
        {
            "_helper": PLUG,
            "zeta": "from ._helper import P\nORDER = 1\nPLUGIN = P('zeta')\n",
            "alpha": "from ._helper import P\nPLUGINS = (P('b', ('bee',)), P('a'))\n",
            "plain": "X = 1\n",
        }
    )
    reg: Registry = Registry("widget", pkg)
    assert reg.names() == ["zeta", "b", "a"]
    assert reg.get("bee").name == "b"
    assert "bee" in reg and "b" in reg and "nope" not in reg
    assert reg.find("nope") is None
    with pytest.raises(BadInput, match=r"unknown widget 'nope'; known: zeta, b, a"):
        reg.get("nope")


@pytest.mark.parametrize(
    "second",
    ["PLUGIN = P('a')\n", "PLUGIN = P('c', ('a',))\n", "PLUGINS = (P('d', ('x',)), P('x'))\n"],
)
def test_duplicate_name_or_alias_is_an_error(family, second: str) -> None:
    pkg = family(
        {
            "_helper": PLUG,
            "one": "from ._helper import P\nPLUGIN = P('a')\n",
            "two": "from ._helper import P\n" + second,
        }
    )
    with pytest.raises(RegistryError, match="already taken"):
        Registry("widget", pkg).names()


def test_base_class_is_enforced(family) -> None:
    pkg = family({"_helper": PLUG, "one": "PLUGIN = 'just a string'\n"})
    with pytest.raises(RegistryError, match="not a int"):
        Registry("widget", pkg, base=int).names()
