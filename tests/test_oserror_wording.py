"""One wording of OS errors across moepack (``safeio.os_error_text``), real errors included."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moepack.errors import BadInput, MoepackError
from moepack.safeio import describe_os_error, os_error_text
from moepack.storage.surface import Surface


def _real_error(path: Path) -> OSError:
    try:
        os.open(path, os.O_RDONLY)
    except OSError as e:
        return e
    raise AssertionError("expected the open to fail")


def test_file_problems_are_worded_once_and_are_bad_input(tmp_path: Path):
    missing = _real_error(tmp_path / "gone")
    assert os_error_text(missing) == "no such file"
    err = describe_os_error(missing, tmp_path / "gone")
    assert isinstance(err, BadInput) and str(err) == f"{tmp_path / 'gone'}: no such file"
    (tmp_path / "f").write_bytes(b"x")
    under_a_file = _real_error(tmp_path / "f" / "g")
    assert os_error_text(under_a_file) == "no such file (a part of the path is not a folder)"


def test_write_problems_say_nothing_was_written():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    err = describe_os_error(full, "out.gguf")
    assert type(err) is MoepackError
    assert str(err) == "out.gguf: no space left on device (nothing was written)"


def test_other_errors_keep_the_system_words_lower_cased():
    assert os_error_text(OSError(errno.EIO, os.strerror(errno.EIO))) == "input/output error"


def test_readers_use_the_one_wording(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"{}")
    with pytest.raises(BadInput, match=r"cannot read the surface file: no such file \(a part"):
        Surface.load(tmp_path / "f" / "s.json")
