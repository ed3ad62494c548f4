"""The CLI parses and renders; every file is written by the library. A command module that
opened or wrote a file itself would bypass the library's all-or-nothing writes."""

from __future__ import annotations

import ast
from pathlib import Path

import moepack.cli

WRITERS = {
    "open",
    "AtomicOutputs",
    "write_bytes_atomic",
    "write_together",
    "write_bytes",
    "write_text",
    "replace",
    "rename",
    "mkstemp",
    "fdopen",
}


# safeio's wording of errors and of what was written, and the one rule --force sets (whether
# an output may replace a file), not its writers
SAFEIO_WORDING = {
    "describe_os_error",
    "os_error_text",
    "set_notice",
    "written_outputs",
    "replacing",
}


def _is_devnull(call: ast.Call) -> bool:
    """``os.open(os.devnull, ...)``: where a closed pipe's output goes, not a file written."""
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Attribute) and first.attr == "devnull"


def _called_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not _is_devnull(node):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return names


def test_no_command_module_writes_files():
    folder = Path(moepack.cli.__file__).parent
    modules = sorted(folder.glob("*.py"))
    assert len(modules) >= 8
    for module in modules:
        tree = ast.parse(module.read_text(), str(module))
        from_safeio = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("safeio")
            for alias in node.names
        }
        assert from_safeio <= SAFEIO_WORDING, (module.name, from_safeio)
        assert not (_called_names(tree) & WRITERS), (module.name, _called_names(tree) & WRITERS)
