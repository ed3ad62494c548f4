"""The corpus: created atomically, reused, removed; clear errors for bad folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage.corpus import CORPUS_NAME, ensure_corpus, remove_corpus


def test_create_reuse_resize_remove(tmp_path: Path) -> None:
    c = ensure_corpus(tmp_path, 2 << 20)
    assert c.created and c.size == 2 << 20 and c.path.stat().st_size == 2 << 20
    data = c.path.read_bytes()
    assert len(set(data[:4096])) > 200  # random, not zeros
    ino = c.path.stat().st_ino
    again = ensure_corpus(tmp_path, 2 << 20)
    assert not again.created and again.path.stat().st_ino == ino
    bigger = ensure_corpus(tmp_path, 3 << 20)
    assert bigger.created and bigger.path.stat().st_size == 3 << 20
    odd = ensure_corpus(tmp_path, (3 << 20) + 1)
    assert odd.size == 4 << 20  # rounded up to whole MiB
    assert remove_corpus(tmp_path) == tmp_path / CORPUS_NAME
    assert remove_corpus(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_missing_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="directory does not exist"):
        ensure_corpus(tmp_path / "nope", 1 << 20)
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(BadInput, match="not a directory"):
        ensure_corpus(f, 1 << 20)
    with pytest.raises(BadInput, match="at least 1 MiB"):
        ensure_corpus(tmp_path, 1000)


def test_read_only_filesystem(mounted) -> None:
    d = mounted("tmpfs", "ro,size=4m")
    with pytest.raises(BadInput, match="read-only filesystem") as e:
        ensure_corpus(d, 1 << 20)
    assert e.value.path == str(d)


def test_corpus_larger_than_free_space(mounted) -> None:
    d = mounted("tmpfs", "size=8m")
    with pytest.raises(BadInput, match="not enough free space"):
        ensure_corpus(d, 64 << 20)
    assert list(d.iterdir()) == []


class _InterruptAfter:
    """A progress sink that presses Ctrl-C after some bytes, like a user would."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.seen = 0

    def start(self, description: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, amount: int) -> None:
        self.seen += amount
        if self.seen >= self.after:
            raise KeyboardInterrupt

    def finish(self) -> None:
        pass


def test_interrupted_creation_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        ensure_corpus(tmp_path, 64 << 20, progress=_InterruptAfter(16 << 20))
    assert list(tmp_path.iterdir()) == []
    os.sync()
