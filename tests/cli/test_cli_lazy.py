"""The command table and the commands agree, and the command line imports only what the
command being run needs: ``moepack --help`` lists every command from the table alone, and
running one command imports its own module, not the others (nor numpy for ``engines``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import click
import pytest

import moepack.cli
from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.cli.lazy import CommandGroup, Entry, LazyCommand, LazyGroup
from moepack.cli.registry import COMMANDS

CLI_FOLDER = Path(moepack.cli.__file__).parent
# Modules of the command line that define no command: the group, the table, shared pieces.
NOT_COMMAND_MODULES = {
    "__init__",
    "main",
    "lazy",
    "registry",
    "options",
    "render",
    "hints",
    "flags",
    "prefetch",
    "draft",
}
HEAVY = ("numpy", "gguf", "matplotlib", "llama_cpp", "moepack.demo")


def walk(
    table: Mapping[str, Entry], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Entry]]:
    """Every entry of the table, with the words that name it (``("npu", "txn", "decode")``)."""
    for name, entry in table.items():
        yield (*path, name), entry
        if isinstance(entry, CommandGroup):
            yield from walk(entry.commands, (*path, name))


COMMAND_ENTRIES = [(p, e) for p, e in walk(COMMANDS) if isinstance(e, LazyCommand)]
GROUP_PATHS = [()] + [p for p, e in walk(COMMANDS) if isinstance(e, CommandGroup)]


def first_paragraph(text: str) -> str:
    return " ".join(text.split("\n\n")[0].split())


@pytest.mark.parametrize(
    "path, entry", COMMAND_ENTRIES, ids=[" ".join(p) for p, _ in COMMAND_ENTRIES]
)
def test_each_line_of_the_table_is_its_command(path: tuple[str, ...], entry: LazyCommand) -> None:
    real = entry.load(path[-1])
    assert real.name == path[-1]
    assert real.help is not None
    assert entry.summary == first_paragraph(real.help), (
        f"cli/registry.py: the summary of {' '.join(path)!r} must be the first paragraph of its "
        f"help: {first_paragraph(real.help)!r}"
    )
    stand_in = entry.listed(path[-1])
    assert not real.hidden and not real.deprecated
    for limit in (20, 45, 60, 80, 94, 200):
        assert stand_in.get_short_help_str(limit) == real.get_short_help_str(limit), limit


def eager(name: str, entry: CommandGroup | None) -> click.Group:
    """The same group built the plain way: every command imported and added."""
    table = COMMANDS if entry is None else entry.commands
    group = click.Group(name, help=None if entry is None else entry.help)
    for sub, e in table.items():
        group.add_command(eager(sub, e) if isinstance(e, CommandGroup) else e.load(sub), sub)
    return group


def listing(group: click.Group, width: int) -> str:
    ctx = click.Context(group, info_name=group.name, max_content_width=width, terminal_width=width)
    formatter = ctx.make_formatter()
    group.format_commands(ctx, formatter)
    return formatter.getvalue()


@pytest.mark.parametrize("path", GROUP_PATHS, ids=[" ".join(p) or "moepack" for p in GROUP_PATHS])
def test_the_lazy_listing_is_the_listing_of_the_real_commands(path: tuple[str, ...]) -> None:
    entry: CommandGroup | None = None
    table: Mapping[str, Entry] = COMMANDS
    for name in path:
        found = table[name]
        assert isinstance(found, CommandGroup)
        entry, table = found, found.commands
    name = path[-1] if path else "moepack"
    for width in (80, 100, 160):
        lazy = LazyGroup(name, lazy=table)  # fresh: nothing loaded yet
        text = listing(lazy, width)
        assert lazy.commands == {}  # the listing loaded nothing
        assert text == listing(eager(name, entry), width), width
        assert sorted(table) == [ln.split()[0] for ln in text.splitlines()[1:] if ln.strip()]


def command_decorators(node: ast.FunctionDef) -> list[str]:
    """The decorators of ``node`` that make it a click command or group, as written."""
    return [
        ast.unparse(d.func)
        for d in node.decorator_list
        if isinstance(d, ast.Call)
        and isinstance(d.func, ast.Attribute)
        and d.func.attr in ("command", "group")
    ]


def test_every_command_module_registers_one_way_and_every_command_is_in_the_table() -> None:
    """Module-level ``@click.command`` functions, named by the table; no group is built in a
    command module, no command is made inside a function, no module has a register()."""
    listed = {(e.module, e.attribute) for _, e in COMMAND_ENTRIES}
    defined = set()
    for module in sorted(CLI_FOLDER.glob("*.py")):
        tree = ast.parse(module.read_text(), str(module))
        top = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        nested = [
            n.name
            for f in top
            for n in ast.walk(f)
            if isinstance(n, ast.FunctionDef) and n is not f and command_decorators(n)
        ]
        assert not nested, (module.name, "commands made inside a function", nested)
        assert not [f.name for f in top if f.name.startswith("register")], module.name
        if module.stem in NOT_COMMAND_MODULES:
            continue
        commands = {f.name: command_decorators(f) for f in top if command_decorators(f)}
        assert commands, f"{module.name} defines no command"
        assert {d for ds in commands.values() for d in ds} == {"click.command"}, module.name
        defined |= {(module.stem, name) for name in commands}
    assert defined == listed


CHILD = """
import json, sys
from moepack.cli.main import main
out = sys.argv[1]
try:
    main(sys.argv[2:])
except SystemExit as e:
    code = e.code
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def imported_by(tmp_path: Path, *args: object) -> set[str]:
    """The modules a run of ``moepack ARGS`` imported, in a fresh interpreter."""
    report = tmp_path / "modules.json"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(report), *map(str, args)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(report.read_text())
    assert doc["code"] in (0, None), r.stderr
    return set(doc["modules"])


def command_modules(modules: set[str]) -> set[str]:
    return {
        m.rsplit(".", 1)[1]
        for m in modules
        if m.startswith("moepack.cli.") and m.rsplit(".", 1)[1] not in NOT_COMMAND_MODULES
    }


@pytest.mark.parametrize(
    "args",
    [("--help",), ("trace", "--help"), ("npu", "txn", "--help"), ("store", "--help")],
    ids=" ".join,
)
def test_help_imports_no_library(tmp_path: Path, args: tuple[str, ...]) -> None:
    modules = imported_by(tmp_path, *args)
    assert not [m for m in HEAVY if m in modules]
    assert "rich" not in modules and command_modules(modules) == set()
    if args == ("--help",):
        assert {m for m in modules if m.startswith("moepack.")} <= {
            "moepack.cli",
            "moepack.cli.main",
            "moepack.cli.lazy",
            "moepack.cli.registry",
            "moepack.cli.flags",
            "moepack.errors",
            "moepack.interrupts",
        }


def test_engines_imports_no_numpy_and_no_other_command(tmp_path: Path) -> None:
    modules = imported_by(tmp_path, "engines", "--json")
    assert not [m for m in HEAVY if m in modules]
    assert command_modules(modules) == {"engines"}


def test_inspect_imports_what_it_needs(tmp_path: Path) -> None:
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    modules = imported_by(tmp_path, "inspect", model)
    assert {"numpy", "gguf"} <= modules
    assert not [
        m for m in ("matplotlib", "llama_cpp", "moepack.demo", "rich.progress") if m in modules
    ]
    assert command_modules(modules) == {"inspect"}
    assert not [m for m in modules if m.startswith(("moepack.trace", "moepack.layout"))]


def test_a_command_imports_only_its_own_module(tmp_path: Path) -> None:
    assert command_modules(imported_by(tmp_path, "trace", "formats")) == {"trace"}
    assert command_modules(imported_by(tmp_path, "npu", "profiles")) == {"npu"}
