"""``fit``'s remote reader against a real range-serving HTTP server on 127.0.0.1: the header
and tensor index of every shard and nothing else, redirects followed, and one clear error
for each way a server or a file can be wrong."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.fit.header import NeedMore, NotGguf, scan_header
from moepack.fit.remote import fetch_index, shard_urls
from rangeserver import DRIP_CAP, MISBEHAVIOURS, serving


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a single model, a 3-shard split set, a model whose header is longer
    than the first read, a truncated copy and a file that is no GGUF."""
    d = tmp_path_factory.mktemp("served")
    synth_model(d / "one.gguf", tiny_spec(layers=3, experts=8, weight_type="Q8_0"))
    synth_model(d / "split.gguf", tiny_spec(layers=3), split_max_size=340_000)  # 3 shards
    # a 60k-token vocabulary: the header (~1.3 MB) takes reads grown several times
    synth_model(
        d / "bigvocab.gguf", tiny_spec(layers=1, experts=4, vocab=60_000, weight_type="Q8_0")
    )
    whole = (d / "one.gguf").read_bytes()
    (d / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    (d / "headless.gguf").write_bytes(whole[:200])
    (d / "page.gguf").write_bytes(b"<!DOCTYPE html><html>not a model</html>" * 40)
    return d


def _same_index(a: MoeModel, b: MoeModel) -> None:
    assert a.architecture == b.architecture
    assert {n: (t.offset, t.n_bytes, t.ne) for n, t in a.tensors.items()} == {
        n: (t.offset, t.n_bytes, t.ne) for n, t in b.tensors.items()
    }
    assert [s.size for s in a.shards] == [s.size for s in b.shards]


def test_split_set_every_shard_header_only(served: Path, tmp_path: Path) -> None:
    shards = sorted(served.glob("split-*-of-*.gguf"))
    assert len(shards) == 3
    with serving(served) as srv:
        index = fetch_index(f"{srv.url}/{shards[1].name}", tmp_path)  # any shard finds the set
    assert [s.name for s in index.shards] == [p.name for p in shards]
    assert {p for p, _ in srv.requests} == {f"/{p.name}" for p in shards}
    assert all(r is not None and r.startswith("bytes=0-") for _, r in srv.requests)
    assert index.total_bytes == sum(p.stat().st_size for p in shards)
    assert srv.bytes_sent == index.bytes_read
    for s, p in zip(index.shards, shards, strict=True):
        # only the header: the mirror is sparse, the size the server gave
        assert s.local.stat().st_size == p.stat().st_size
        assert s.local.stat().st_blocks * 512 < p.stat().st_size // 2
        assert s.extent.index_end <= s.bytes_read
    with MoeModel(index.local) as remote, MoeModel(shards[0]) as local:
        _same_index(remote, local)


def test_header_longer_than_first_read_grows(served: Path, tmp_path: Path) -> None:
    path = served / "bigvocab.gguf"
    with serving(served) as srv:
        index = fetch_index(f"{srv.url}/bigvocab.gguf", tmp_path)
    header = index.shards[0].extent.index_end
    assert header > 1 << 20
    assert index.requests >= 2 and len(srv.requests) == index.requests
    assert header <= index.bytes_read < path.stat().st_size
    with MoeModel(index.local) as remote, MoeModel(path) as local:
        _same_index(remote, local)


def test_redirect_followed(served: Path, tmp_path: Path) -> None:
    with serving(served, "redirect") as srv:
        index = fetch_index(f"{srv.url}/one.gguf", tmp_path)
    assert any(p == "/real/one.gguf" for p, _ in srv.requests)
    with MoeModel(index.local) as remote, MoeModel(served / "one.gguf") as local:
        _same_index(remote, local)


@pytest.mark.parametrize(
    ("mode", "name", "problem"),
    [
        ("norange", "one.gguf", "does not answer Range requests"),
        ("short", "one.gguf", "truncated answer"),
        ("range", "headless.gguf", "inside its own header"),
        ("range", "page.gguf", "not a GGUF file"),
        ("range", "missing.gguf", "HTTP 404"),
    ],
)
def test_server_and_file_errors(
    served: Path, tmp_path: Path, mode: str, name: str, problem: str
) -> None:
    with serving(served, mode) as srv, pytest.raises(BadInput) as e:
        fetch_index(f"{srv.url}/{name}", tmp_path)
    assert problem in str(e.value) and str(e.value).startswith(f"{srv.url}/{name}: ")


@pytest.mark.parametrize("mode", sorted(m for m in MISBEHAVIOURS if not m.startswith("drip")))
def test_misbehaving_server_is_one_bad_input(served: Path, tmp_path: Path, mode: str) -> None:
    """A Content-Range total of 10^30, a 200 KB header line, 150 headers, a broken chunked
    body, a status line that is none: each is one ``BadInput`` naming the URL."""
    with serving(served, mode) as srv, pytest.raises(BadInput) as e:
        fetch_index(f"{srv.url}/one.gguf", tmp_path, timeout=10)
    assert str(e.value).startswith(f"{srv.url}/one.gguf: ")
    assert MISBEHAVIOURS[mode] in str(e.value) and "\n" not in str(e.value)
    assert len(str(e.value)) < 400  # the server's junk is quoted short, if at all


@pytest.mark.parametrize("mode", ["drip-head", "drip-body"])
def test_a_dripping_server_is_cut_at_the_timeout(served: Path, tmp_path: Path, mode: str) -> None:
    """A server sending a byte every 50 ms for as long as anyone listens: the timeout bounds
    the whole request, not each read. The bound asserted is loose (a busy machine), and far
    below how long the server would drip."""
    with serving(served, mode) as srv:
        t0 = time.monotonic()
        with pytest.raises(BadInput, match="no answer within 1 s"):
            fetch_index(f"{srv.url}/one.gguf", tmp_path, timeout=1)
        took = time.monotonic() - t0
    assert took < DRIP_CAP / 3, took


def test_the_timeout_bounds_the_whole_fetch(served: Path, tmp_path: Path) -> None:
    """Every request of the fetch shares one deadline: a fetch given no time left makes no
    request that could wait."""
    with serving(served) as srv, pytest.raises(BadInput, match="no answer within 0 s"):
        fetch_index(f"{srv.url}/one.gguf", tmp_path, timeout=0)
    assert srv.requests == []


def test_timeout(served: Path, tmp_path: Path) -> None:
    with serving(served, "hang") as srv, pytest.raises(BadInput, match="no answer within 0.3 s"):
        fetch_index(f"{srv.url}/one.gguf", tmp_path, timeout=0.3)


def test_refused_connection(tmp_path: Path) -> None:
    with serving(tmp_path) as srv:
        url = f"{srv.url}/one.gguf"
    with pytest.raises(BadInput, match="cannot connect"):
        fetch_index(url, tmp_path, timeout=2)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("cut.gguf", "past the end of the file"),
        ("page.gguf", "not a GGUF file"),
        ("headless.gguf", "truncated"),
    ],
)
def test_cli_one_line_exit_2(
    served: Path, capsys: pytest.CaptureFixture[str], name: str, problem: str
) -> None:
    """Each bad answer is one line naming the URL, exit 2, nothing on stdout (before any
    measuring or calibration starts)."""
    with serving(served) as srv:
        code, out, err = run_cli(capsys, "fit", f"{srv.url}/{name}", "-q")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moepack: error: {srv.url}/{name}: ")
    assert problem in lines[0]


@pytest.mark.parametrize("mode", sorted(MISBEHAVIOURS))
def test_cli_misbehaving_server_one_line_exit_2(
    served: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    with serving(served, mode) as srv:
        code, out, err = run_cli(capsys, "fit", f"{srv.url}/one.gguf", "--timeout", "1", "-q")
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moepack: error: {srv.url}/one.gguf: ")
    assert MISBEHAVIOURS[mode] in lines[0]


def test_cli_no_range_server(served: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serving(served, "norange") as srv:
        code, out, err = run_cli(capsys, "fit", f"{srv.url}/one.gguf", "--json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "Range" in err


def test_shard_names() -> None:
    urls = shard_urls("https://h/x/M%20Q4-00002-of-00003.gguf?download=1")
    assert [n for _, n in urls] == [f"M Q4-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert urls[0][0] == "https://h/x/M%20Q4-00001-of-00003.gguf?download=1"
    assert shard_urls("http://h/a.gguf") == [("http://h/a.gguf", "a.gguf")]
    with pytest.raises(BadInput, match="names no file"):
        shard_urls("http://h/")


def test_scan_header_asks_for_more(served: Path) -> None:
    whole = (served / "one.gguf").read_bytes()
    end = scan_header(whole).index_end
    for cut in (3, 24, end // 2, end - 1):
        with pytest.raises(NeedMore) as more:
            scan_header(whole[:cut])
        assert cut < more.value.size <= end
    with pytest.raises(NotGguf, match="version 7"):
        scan_header(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(NotGguf, match="absurd"):
        scan_header(
            b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little") + bytes(8)
        )


def test_a_file_larger_than_memory_is_served_by_its_ranges(served: Path, tmp_path: Path) -> None:
    """The range server reads only what is asked (a real-sized model is tens of GB): a
    model padded sparse to 32 GiB has its header read over HTTP for a few KB."""
    big = tmp_path / "big.gguf"
    big.write_bytes((served / "one.gguf").read_bytes())
    with open(big, "r+b") as fh:
        fh.truncate(32 << 30)  # sparse: no disk, no memory
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    with serving(tmp_path) as srv:
        index = fetch_index(f"{srv.url}/big.gguf", mirror)
        assert index.bytes_read < 1 << 20 and len(srv.requests) == index.requests
    assert index.total_bytes == 32 << 30 and index.share_read < 1e-4
    with MoeModel(index.local) as remote, MoeModel(served / "one.gguf") as local:
        assert remote.tensors.keys() == local.tensors.keys()
        assert remote.file_bytes == 32 << 30
