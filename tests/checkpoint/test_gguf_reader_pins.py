"""moepack's reader overrides three private methods of gguf-py's ``GGUFReader``
(``checkpoint/gguf_file.py``). Private methods change without notice: if gguf-py renames one,
changes its parameters or stops calling it, the override would be skipped silently, and with it
the range checks and fast paths. These tests make such an upgrade fail loudly instead."""

from __future__ import annotations

import inspect
import re

import gguf
import pytest
from gguf import GGUFReader

from moepack.checkpoint.gguf_file import _CheckedReader

# The upstream signatures moepack's overrides were written against (gguf 0.19.0).
EXPECTED = {
    "_get": (
        "(self, offset: 'int', dtype: 'npt.DTypeLike', count: 'int' = 1, "
        "override_order: \"None | Literal['I', 'S', '<']\" = None) -> 'npt.NDArray[Any]'"
    ),
    "_get_field_parts": (
        "(self, orig_offs: 'int', raw_type: 'int') -> "
        "'tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]'"
    ),
    "_build_tensors": "(self, start_offs: 'int', fields: 'list[ReaderField]') -> 'None'",
}


def test_the_pinned_gguf_version_is_installed() -> None:
    from importlib.metadata import version

    assert version("gguf") == "0.19.0", "re-check the overrides below against the new gguf-py"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_private_signature_is_unchanged(name: str) -> None:
    assert str(inspect.signature(getattr(GGUFReader, name))) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_override_takes_the_same_parameters(name: str) -> None:
    ours = inspect.signature(getattr(_CheckedReader, name)).parameters
    theirs = inspect.signature(getattr(GGUFReader, name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
    assert getattr(_CheckedReader, name) is not getattr(GGUFReader, name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_upstream_still_calls_the_overridden_method(name: str) -> None:
    source = inspect.getsource(GGUFReader)
    assert re.search(rf"self\.{name}\(", source), f"GGUFReader no longer calls {name}"


def test_upstream_attributes_the_overrides_read() -> None:
    assert isinstance(GGUFReader.gguf_scalar_to_np, dict)
    assert GGUFReader.gguf_scalar_to_np[gguf.GGUFValueType.UINT32].__name__ == "uint32"
    assert "byte_order" in inspect.getsource(GGUFReader.__init__)
