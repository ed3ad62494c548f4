"""The corpus: created atomically, reused, removed; clear errors for bad folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage.corpus import CORPUS_NAME, MARK, ensure_corpus, is_corpus, remove_corpus
from moepack.storage.support import mode_support


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


def test_a_users_file_of_the_corpus_name_is_never_used_replaced_or_removed(
    tmp_path: Path, run_main
) -> None:
    """Only a file carrying the corpus mark is a corpus: a user's file of that name (or a
    link) is refused by name, for reuse, replacement and removal alike, and left as it was."""
    mine = tmp_path / CORPUS_NAME
    data = os.urandom(8 << 20)  # even the right size: the name proves nothing
    mine.write_bytes(data)
    for size in (8 << 20, 2 << 20):
        with pytest.raises(BadInput, match="not a moepack corpus") as e:
            ensure_corpus(tmp_path, size)
        assert e.value.path == str(mine)
    with pytest.raises(BadInput, match="lacks the corpus mark.*not removed"):
        remove_corpus(tmp_path)
    r = run_main("kio", str(tmp_path), "--corpus-size", "8M", "-q")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"moepack: error: {mine}: not a moepack corpus")
    r = run_main("kio", str(tmp_path), "--remove-corpus")
    assert r.returncode == 2 and f"{mine}: not a moepack corpus" in r.stderr
    assert mode_support(tmp_path).file == f"{tmp_path} (a temporary file)"  # not the user's
    assert mine.read_bytes() == data and os.listdir(tmp_path) == [CORPUS_NAME]
    mine.unlink()
    (tmp_path / "other").mkdir()
    real = ensure_corpus(tmp_path / "other", 1 << 20).path  # a corpus elsewhere, linked here
    mine.symlink_to(real)
    with pytest.raises(BadInput, match="not a moepack corpus"):
        remove_corpus(tmp_path)
    assert mine.is_symlink() and remove_corpus(real.parent) == real


def test_a_corpus_carries_the_mark_inside_its_whole_mib(tmp_path: Path) -> None:
    c = ensure_corpus(tmp_path, 1 << 20)
    head = c.path.read_bytes()[: 2 * len(MARK)]
    assert head.startswith(MARK) and len(set(head[len(MARK) :])) > 16
    assert c.path.stat().st_size == 1 << 20 and is_corpus(c.path)
    assert not ensure_corpus(tmp_path, 1 << 20).created
    assert remove_corpus(tmp_path) == c.path and not c.path.exists()
