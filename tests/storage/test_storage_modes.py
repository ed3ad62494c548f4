"""Filesystems without O_DIRECT or DONTCACHE are named in a clear error; the rest goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moepack.storage import Mode, ModeUnsupported, open_file, read_ranges
from moepack.storage.support import mode_support


def test_ramfs_has_neither_direct_nor_dontcache(mounted) -> None:
    d = mounted("ramfs")
    p = d / "f.bin"
    p.write_bytes(os.urandom(100_000))
    with pytest.raises(ModeUnsupported, match="ramfs does not support O_DIRECT"):
        open_file(p, Mode.DIRECT)
    with pytest.raises(ModeUnsupported, match="ramfs does not support RWF_DONTCACHE"):
        open_file(p, Mode.DONTCACHE)
    assert read_ranges(p, [(5, 10)]).data == [p.read_bytes()[5:15]]
    support = mode_support(d)
    assert support.unsupported["buffered"] is None
    assert "O_DIRECT" in (support.unsupported["direct"] or "")
    assert list(d.iterdir()) == [p]  # the temporary test file is gone


def test_tmpfs_has_no_dontcache(mounted) -> None:
    d = mounted("tmpfs", "size=8m")
    support = mode_support(d)
    assert "tmpfs does not support RWF_DONTCACHE" in (support.unsupported["dontcache"] or "")
    assert support.unsupported["buffered"] is None
    assert list(d.iterdir()) == []


def test_disk_serves_every_mode(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    support = mode_support(path)
    assert support.unsupported["buffered"] is None
    assert support.unsupported["direct"] is None  # ext4/xfs/btrfs all do O_DIRECT
    assert support.dio_align is not None


def test_read_only_folder_lists_the_engines_with_the_modes_untested(mounted, run_main) -> None:
    """``engines`` makes no corpus: on a read-only folder it lists the engines and says the
    modes are untested, instead of failing with "cannot create the corpus"."""
    d = mounted("tmpfs", "ro,size=1m")
    support = mode_support(d)
    assert support.unsupported == {} and "read-only filesystem" in (support.untested or "")
    r = run_main("engines", str(d), "--no-bindings")
    assert r.returncode == 0, r.stderr
    assert "pread" in r.stdout and "uring" in r.stdout
    assert f"modes on {d}: untested (directory is on a read-only filesystem" in r.stdout
    r = run_main("engines", str(d), "--no-bindings", "--json")
    assert r.returncode == 0 and "read-only" in json.loads(r.stdout)["modes"]["untested"]
