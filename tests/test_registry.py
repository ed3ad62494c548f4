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


def test_every_module_must_define_a_plugin_when_asked(family) -> None:
    pkg = family(
        {"_helper": PLUG, "one": "from ._helper import P\nPLUGIN = P('a')\n", "old": "X = 1\n"}
    )
    assert Registry("widget", pkg).names() == ["a"]
    with pytest.raises(RegistryError, match="widget module old defines neither PLUGIN nor"):
        Registry("widget", pkg, every_module=True).names()


def test_base_class_is_enforced(family) -> None:
    pkg = family({"_helper": PLUG, "one": "PLUGIN = 'just a string'\n"})
    with pytest.raises(RegistryError, match="not a int"):
        Registry("widget", pkg, base=int).names()


# -- the real families ---------------------------------------------------------------------


@pytest.fixture
def extend_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Add one module to a real plug-in package (through its ``__path__``), for one test."""
    added: list[str] = []

    def extend(package: str, module: str, body: str) -> None:
        import importlib

        pkg = importlib.import_module(package)
        folder = tmp_path / package.replace(".", "_")
        folder.mkdir(exist_ok=True)
        (folder / f"{module}.py").write_text(textwrap.dedent(body))
        monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(folder)])
        added.append(f"{package}.{module}")

    yield extend
    for mod in added:
        sys.modules.pop(mod, None)


def test_real_families_list_in_their_order() -> None:
    from moepack.npu.profiles import PROFILES
    from moepack.storage.engine import READ_ENGINES
    from moepack.trace.formats import REGISTRY

    assert READ_ENGINES.names() == ["pread", "threads", "uring", "uring-batch", "mmap"]
    assert PROFILES.names()[0] == "flm-0.9.46"
    assert REGISTRY.names() == ["moetrace", "pmxtrace", "routecsv", "text", "mblt"]


def test_duplicate_engine_name_fails(extend_family) -> None:
    from moepack.storage.engine import ReadEngine

    extend_family(
        "moepack.storage.engines",
        "zz_second_pread",
        """
        from moepack.storage.engines.pread import PreadEngine
        PLUGIN = PreadEngine()
        """,
    )
    with pytest.raises(RegistryError, match="engine name 'pread' .*zz_second_pread.* taken"):
        Registry("engine", "moepack.storage.engines", base=ReadEngine).names()


def test_duplicate_profile_alias_fails(extend_family) -> None:
    from moepack.npu.profile import LayoutProfile

    extend_family(
        "moepack.npu.profiles",
        "zz_clash",
        """
        from dataclasses import replace
        from moepack.npu.profiles.seed_2026_09 import PLUGIN as SEED
        PLUGIN = replace(SEED, name="flm-new", aliases=("flm-1.0.x",))
        """,
    )
    with pytest.raises(RegistryError, match="profile name 'flm-1.0.x' .*zz_clash"):
        Registry("profile", "moepack.npu.profiles", base=LayoutProfile).names()


def test_a_format_module_written_for_the_old_interface_fails_loudly(extend_family) -> None:
    from moepack.trace.formats import FormatModule

    extend_family(
        "moepack.trace.formats",
        "zz_no_plugin",
        """
        NAME = "zz"
        EXTENSIONS = (".zz",)
        """,
    )
    with pytest.raises(RegistryError, match="trace format module zz_no_plugin defines neither"):
        Registry("trace format", "moepack.trace.formats", FormatModule, every_module=True).names()


def test_duplicate_trace_format_name_fails(extend_family) -> None:
    from moepack.trace.formats import FormatModule

    extend_family(
        "moepack.trace.formats",
        "zz_text_again",
        """
        from moepack.trace.formats._api import FormatModule
        from moepack.trace.formats.text import EXTENSIONS, VERSIONS, detect, lost, read, write
        NAME = "text"
        DESCRIPTION = "a second text format"
        PLUGIN = FormatModule(__name__)
        """,
    )
    with pytest.raises(RegistryError, match="trace format name 'text' .*zz_text_again"):
        Registry("trace format", "moepack.trace.formats", base=FormatModule).names()


def test_unknown_names_have_one_wording() -> None:
    from moepack.npu.profiles import get_profile
    from moepack.storage.engine import get_engine
    from moepack.trace.formats import get_format

    with pytest.raises(BadInput, match=r"unknown engine 'x'; known: pread, threads, uring, "):
        get_engine("x")
    with pytest.raises(BadInput, match=r"unknown profile 'x'; known: flm-0.9.46, "):
        get_profile("x")
    with pytest.raises(BadInput, match=r"unknown trace format 'x'; known: moetrace, "):
        get_format("x")
