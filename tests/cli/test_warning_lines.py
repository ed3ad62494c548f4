"""Every warning and note is one line on stderr, ``moepack: warning: `` or ``moepack: note: ``
first, however long (rich's consoles wrap at 80 columns when not told otherwise, and the
messages name long paths); and every use of an input bound to the model by its shape alone
(a ``.pmxtrace``, a ``.pmxplan``, a route CSV: no fingerprint) says so, in the table and the
JSON runs alike."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.plan import save_plan
from moepack.trace import save_trace, synth_trace

SHAPE_ONLY = "records no model fingerprint, so it was checked against"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # a long folder name: every message naming a file is well past 80 columns
    d = tmp_path_factory.mktemp("a-folder-whose-name-is-long-enough-to-wrap-any-message-" * 2)
    s = {"gguf": synth_model(d / "m.gguf", tiny_spec()).paths[0]}
    with MoeModel(s["gguf"]) as m:
        trace = synth_trace(m, tokens=64, seed=1)
        plan = plan_from_trace(m, trace).plan
    for ext in ("moetrace", "pmxtrace", "csv"):
        s[ext] = save_trace(trace, d / f"t.{ext}").path
    s["pmxplan"] = d / "p.pmxplan"
    save_plan(plan, s["pmxplan"])
    return s


def _lines(err: str) -> list[str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    for ln in lines:
        assert ln.startswith(("moepack: warning: ", "moepack: note: ")), lines
    return lines


@pytest.mark.parametrize(
    "args, source",
    [
        (("analyse", "{gguf}", "{pmxtrace}"), "pmxtrace"),
        (("analyse", "{gguf}", "{moetrace}", "--plan", "{pmxplan}"), "pmxplan"),
        (("advise", "{gguf}", "{pmxtrace}"), "pmxtrace"),
        (("predict", "{pmxtrace}", "--model", "{gguf}"), "pmxtrace"),
        (("predict", "{csv}", "--model", "{gguf}"), "csv"),
        (("trace", "info", "{pmxtrace}", "--model", "{gguf}"), "pmxtrace"),
        (("trace", "stats", "{pmxtrace}", "--model", "{gguf}"), "pmxtrace"),
        (("replay", "{gguf}", "{pmxtrace}", "--slots", "4", "-q"), "pmxtrace"),
        (
            ("replay", "{gguf}", "{moetrace}", "--slots", "4", "--layout", "reorder", "--plan")
            + ("{pmxplan}", "-q"),
            "pmxplan",
        ),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_shape_only_inputs_are_said_in_one_line(capsys, inputs, args, source, as_json):
    argv = [a.format(**{k: str(v) for k, v in inputs.items()}) for a in args]
    code, out, err = run_cli(capsys, *argv, *(["--json"] if as_json else []))
    assert code == 0, err
    warned = [ln for ln in _lines(err) if SHAPE_ONLY in ln]
    what = "plan" if source == "pmxplan" else "trace"
    assert len(warned) == 1, err
    assert warned[0].startswith(f"moepack: warning: {inputs[source]}: this {what} {SHAPE_ONLY}")
    assert warned[0].endswith("(a different model of the same shape would pass too)"), err
    if as_json:
        listed = json.loads(out).get("warnings", [])
        assert warned[0].removeprefix("moepack: warning: ") in listed, listed


def test_inputs_with_a_fingerprint_give_no_such_warning(capsys, inputs):
    for argv in (
        ("analyse", inputs["gguf"], inputs["moetrace"]),
        ("predict", inputs["moetrace"], "--model", inputs["gguf"]),
        ("trace", "info", inputs["moetrace"], "--model", inputs["gguf"]),
        ("replay", inputs["gguf"], inputs["moetrace"], "--slots", "4", "-q"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0 and not any(SHAPE_ONLY in ln for ln in _lines(err)), err


def test_notes_are_one_line_each(capsys, inputs):
    """analyse's and advise's notes (no surface, a fused layout costed only), predict's on a
    one-prompt trace: long lines, never wrapped."""
    for argv, note in (
        (("analyse", inputs["gguf"], inputs["moetrace"]), "no surface: only requests and bytes"),
        (("analyse", inputs["gguf"], inputs["moetrace"]), "fused: costed only; llama.cpp's"),
        (("advise", inputs["gguf"], inputs["moetrace"]), "does not take a fused"),
        (("predict", inputs["moetrace"]), "the trace records one prompt: its last quarter"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        lines = _lines(err)
        assert any(ln.startswith("moepack: note: ") and note in ln for ln in lines), lines
        assert all(len(ln) > 0 for ln in lines) and max(map(len, lines)) > 80, lines


@pytest.fixture
def on_tmpfs() -> Iterator[Path]:
    """A scratch folder on tmpfs (no block device: O_DIRECT there reads RAM, which the probe
    and kio warn about)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or "tmpfs" not in _filesystem(shm):
        pytest.skip("no tmpfs at /dev/shm here")
    d = Path(tempfile.mkdtemp(prefix="moepack-warn-", dir=shm))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _filesystem(path: Path) -> str:
    best = ("", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best[0]):
            best = (parts[1], parts[2])
    return best[1]


def test_probe_and_kio_warn_with_the_prefix(capsys, on_tmpfs):
    f = on_tmpfs / "f.bin"
    f.write_bytes(bytes(4 << 20))
    cell = ("--depths", "1", "--cell-seconds", "0.01", "--repeats", "1", "-q")
    for argv in (
        ("probe", f, "--engine", "pread", "--mode", "direct", "--sizes", "64K", *cell),
        ("kio", on_tmpfs, "--sizes", "64K", "--engines", "pread", "--modes", "direct")
        + ("--corpus-size", "1M", *cell),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        lines = _lines(err)
        assert any("no block device" in ln for ln in lines), lines
