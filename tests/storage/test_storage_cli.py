"""The commands as a user runs them: outputs, --json, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAST = ["--cell-seconds", "0.01", "--corpus-size", "4M", "-q"]


def assert_one_line_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moepack: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def assert_one_line_interrupt(r: subprocess.CompletedProcess[str]) -> None:
    """Ctrl-C: exit 130 and one line saying what was written (here: nothing)."""
    assert r.returncode == 130, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["moepack: interrupted; no output was written"], r.stderr


def test_probe_writes_surface_and_heatmap(run_cli, tmp_path: Path) -> None:
    out, png = tmp_path / "surface.json", tmp_path / "surface.png"
    r = run_cli(
        "probe", str(tmp_path), "--sizes", "4K,64K", "--depths", "1,4", *FAST,
        "-o", str(out), "--png", str(png),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and f"wrote {out}" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "moepack-surface" and len(doc["cells"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    peer = tmp_path / "peer.json"
    r = run_cli("surface", "convert", str(out), str(peer), "--to", "potatomaxx")
    assert r.returncode == 0, r.stderr
    pdoc = json.loads(peer.read_text())
    assert set(pdoc) == {"note", "cache_bypassed", "cells"} and pdoc["cache_bypassed"] is True
    assert {c["blob_bytes"] for c in pdoc["cells"]} == {4096, 65536}

    r = run_cli("surface", "show", str(peer), "--at", "16K@2", "--json")
    assert r.returncode == 0, r.stderr
    (pred,) = json.loads(r.stdout)["predictions"]
    assert pred["request_bytes"] == 16384 and pred["bytes_per_sec"] > 0


def test_kio_json_and_corpus_removal(run_cli, tmp_path: Path) -> None:
    r = run_cli(
        "kio", str(tmp_path), "--sizes", "64K", "--depths", "1,2", "--engines", "pread,uring",
        "--modes", "direct,buffered", *FAST, "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {(row["engine"], row["mode"]) for row in doc["rows"]} == {
        ("pread", "direct"), ("uring", "direct"), ("pread", "buffered"), ("uring", "buffered"),
    }  # fmt: skip
    assert doc["recommendations"][0]["request_bytes"] == 65536
    assert (tmp_path / "moepack-corpus.bin").exists()
    r = run_cli("kio", str(tmp_path), "--remove-corpus")
    assert r.returncode == 0 and "removed" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_kio_table_says_what_it_skipped(run_cli, mounted) -> None:
    d = mounted("ramfs")
    r = run_cli("kio", str(d), "--sizes", "64K", "--depths", "1", "--engines", "pread", *FAST)
    assert r.returncode == 0, r.stderr
    assert "skipped mode direct: ramfs does not support O_DIRECT" in r.stdout
    assert "skipped mode dontcache: ramfs does not support RWF_DONTCACHE" in r.stdout
    assert "recommend for 64K reads: pread buffered" in r.stdout


def test_bad_input_is_one_line_exit_2(run_main, tmp_path: Path, mounted) -> None:
    assert_one_line_error(run_main("kio", str(tmp_path / "nope"), *FAST), "does not exist")
    ro = mounted("tmpfs", "ro,size=4m")
    assert_one_line_error(run_main("kio", str(ro), *FAST), "read-only filesystem")
    small = mounted("tmpfs", "size=8m")
    assert_one_line_error(
        run_main(
            "probe", str(small), "--sizes", "64K", "--depths", "1", "--corpus-size", "1G", "-q"
        ),
        "not enough free space",
    )
    assert list(small.iterdir()) == []
    ram = mounted("ramfs")
    assert_one_line_error(
        run_main("probe", str(ram), "--sizes", "4K", "--depths", "1", *FAST),
        "ramfs does not support O_DIRECT",
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"cells": [{"blob_bytes": 4096, "queue_depth": 0, "bytes_per_sec": 1}]}')
    assert_one_line_error(run_main("surface", "show", str(bad)), "cells[0].queue_depth")
    r = run_main(
        "probe", str(tmp_path), "--engine", "pread", "--sizes", "64K", "--depths", "1,8", *FAST
    )
    assert_one_line_error(r, "queue depth 1 only")
    r = run_main("probe", str(tmp_path), "--sizes", "64Q")
    assert r.returncode == 2 and "not a size" in r.stderr and "Traceback" not in r.stderr


def _interrupt(args: list[str], ready) -> subprocess.CompletedProcess[str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "moepack.cli.main", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready(p.pid) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_ctrl_c_while_creating_the_corpus_leaves_nothing(run_cli, tmp_path: Path) -> None:
    def temp_exists(pid: int) -> bool:
        return any(p.name.endswith(".moepack-tmp") and p.stat().st_size > (8 << 20)
                   for p in tmp_path.iterdir())  # fmt: skip

    r = _interrupt(["kio", str(tmp_path), "--corpus-size", "2G", "-q"], temp_exists)
    assert_one_line_interrupt(r)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_measuring_writes_no_surface(run_cli, tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    r = run_cli("probe", str(tmp_path / "c"), "--sizes", "4K", "--depths", "1", *FAST)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "s.json"
    corpus = tmp_path / "c" / "moepack-corpus.bin"
    measuring_since: list[float] = []

    def measuring(pid: int) -> bool:
        """The corpus is open in the child (it is measuring), for a little while already."""
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            return False
        if str(corpus) in fds and not measuring_since:
            measuring_since.append(time.monotonic())
        return bool(measuring_since) and time.monotonic() - measuring_since[0] > 0.5

    r = _interrupt(
        ["probe", str(tmp_path / "c"), "--sizes", "4K,64K", "--depths", "1,2,4,8,16",
         "--engine", "uring", "--cell-seconds", "1", "--corpus-size", "4M", "-q",
         "-o", str(out)],
        measuring,
    )  # fmt: skip
    assert_one_line_interrupt(r)
    assert not out.exists()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["moepack-corpus.bin"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".moepack-tmp")]
    assert os.path.getsize(tmp_path / "c" / "moepack-corpus.bin") == 4 << 20


def test_probe_never_writes_over_the_file_it_probes(run_main, data_file, tmp_path: Path) -> None:
    """``probe FILE -o FILE`` (or ``--png FILE``) is refused before anything is measured;
    so is an output onto the corpus of a probed folder, and --out and --png on one file."""
    path, data = data_file
    for flag in ("-o", "--png"):
        r = run_main("probe", str(path), flag, str(path), *FAST)
        assert_one_line_error(r, "would overwrite the input", str(path))
        assert path.read_bytes() == data
    (tmp_path / "c").mkdir()
    corpus = tmp_path / "c" / "moepack-corpus.bin"
    r = run_main("probe", str(tmp_path / "c"), "--sizes", "4K", "--depths", "1", *FAST)
    assert r.returncode == 0, r.stderr
    before = corpus.read_bytes()
    r = run_main("probe", str(tmp_path / "c"), "-o", str(corpus), *FAST)
    assert_one_line_error(r, "would overwrite the input")
    assert corpus.read_bytes() == before
    same = tmp_path / "s.out"
    r = run_main("probe", str(path), "-o", str(same), "--png", str(same), *FAST)
    assert_one_line_error(r, "--out and --png name the same file")
    src = tmp_path / "s.json"
    r = run_main("probe", str(path), "--sizes", "64K", "--depths", "1", *FAST, "-o", str(src))
    assert r.returncode == 0, r.stderr
    text = src.read_text()
    assert_one_line_error(
        run_main("surface", "convert", str(src), str(src), "--to", "potatomaxx"),
        "would overwrite the input",
    )
    assert_one_line_error(run_main("surface", "plot", str(src), str(src)), "overwrite the input")
    assert src.read_text() == text


def test_bad_numbers_and_targets_are_one_line_errors(run_main, tmp_path: Path) -> None:
    """Each of these was a traceback, a bare errno, 20,000 threads or a wrong reason."""
    d = str(tmp_path)
    for secs in ("inf", "nan", "-1", "1e9"):
        assert_one_line_error(run_main("probe", d, "--cell-seconds", secs, "-q"), "cell time")
        assert_one_line_error(run_main("kio", d, "--cell-seconds", secs, "-q"), "cell time")
    for args in (["--depths", "40000"], ["--engine", "threads", "--depths", "20000"]):
        assert_one_line_error(run_main("probe", d, *args, "-q"), "limit of 1024", "thread")
    assert_one_line_error(run_main("kio", d, "--depths", "1,2000", "-q"), "limit of 1024")
    assert_one_line_error(run_main("kio", d, "--sizes", "1", "--modes", "direct", "-q"),
                          "request size 1 is below 512 B")  # fmt: skip
    assert_one_line_error(run_main("probe", d, "--sizes", "4K,100", "-q"), "100 is below 512")
    assert list(tmp_path.iterdir()) == []  # all refused before a corpus was made
    r = run_main("kio", d, "--sizes", "1000", "--modes", "direct", *FAST)
    assert_one_line_error(
        r, "nothing to measure", "mode direct", "1,000 is not a multiple of the O_DIRECT alignment"
    )
    assert_one_line_error(run_main("probe", "/dev/null", *FAST), "/dev/null: a character device")
    assert_one_line_error(run_main("probe", d + "/missing", *FAST), "missing: does not exist")


def test_probe_outputs_on_a_full_disk_leave_neither(run_main, data_file, mounted) -> None:
    """-o and --png appear together or not at all: the surface fits, the heatmap does not,
    so the error says nothing was written and nothing was."""
    path, _ = data_file
    small = mounted("tmpfs", "size=1m")
    filler = small / "filler"
    filler.write_bytes(b"\1" * ((1 << 20) - (12 << 10)))  # 12 KiB left: a surface, no PNG
    out, png = small / "s.json", small / "s.png"
    r = run_main("probe", str(path), "--sizes", "64K", "--depths", "1", *FAST,
                 "-o", str(out), "--png", str(png))  # fmt: skip
    assert_one_line_error(r, "no space left on device (nothing was written)")
    assert sorted(p.name for p in small.iterdir()) == ["filler"]


def test_surface_convert_and_plot_take_json(run_main, tmp_path: Path) -> None:
    src = tmp_path / "s.json"
    src.write_text('{"cells": [{"blob_bytes": 4096, "queue_depth": 1, "bytes_per_sec": 1e9}]}')
    dest, png = tmp_path / "m.json", tmp_path / "s.png"
    r = run_main("surface", "convert", str(src), str(dest), "--to", "moepack-surface", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"written": str(dest), "format": "moepack-surface", "cells": 1}
    r = run_main("surface", "plot", str(dest), str(png), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["written"] == str(png) and doc["bytes"] == png.stat().st_size
    r = run_main("surface", "plot", str(dest), str(tmp_path / "t.png"))
    assert r.returncode == 0 and r.stdout == f"wrote {tmp_path / 't.png'}\n"


def test_surface_show_names_what_is_wrong(run_main, tmp_path: Path) -> None:
    folder = tmp_path / "adir"
    folder.mkdir()
    assert_one_line_error(run_main("surface", "show", str(folder)),
                          f"{folder}: is a folder, not a surface file")  # fmt: skip
    binary = tmp_path / "rand.bin"
    binary.write_bytes(b"\xc7\x00\xbf\xa7" * 100)
    r = run_main("surface", "show", str(binary))
    assert_one_line_error(r, f"{binary}: not a surface file: not text")
    assert "codec" not in r.stderr and "Errno" not in r.stderr
    src = tmp_path / "s.json"
    src.write_text('{"cells": [{"blob_bytes": 4096, "queue_depth": 1, "bytes_per_sec": 1e9}]}')
    for at in ("0@1", "4K@0", "4K"):
        assert_one_line_error(run_main("surface", "show", str(src), "--at", at), "'--at'", at)


def test_kio_shows_the_corpus_size_in_binary_units(run_main, tmp_path: Path) -> None:
    r = run_main("kio", str(tmp_path), "--sizes", "64K", "--depths", "1", "--engines", "pread",
                 "--modes", "buffered", "--repeats", "1", "--cell-seconds", "0.01",
                 "--corpus-size", "8M", "-q")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "(8.0 MiB, created)" in r.stdout and "GiB" not in r.stdout
