"""The headline table of benchmarks/README.md and the results files it is generated from."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "headline.py"


def _headline(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def readme(tmp_path: Path) -> Path:
    path = tmp_path / "README.md"
    path.write_text(f"# Benchmarks\n\n{headline.START}\n{headline.END}\n\n## The log\n\nkept\n")
    path.chmod(0o640)
    return path


def _record(results: Path, readme: Path | None, **changes: object) -> Path:
    fields: dict = dict(
        title="Repack (reorder), cold",
        what="repack, time",
        ratio=1.23456,
        yardstick="coreutils `cp` + fsync of the file",
        yardstick_value=2.5,
        unit="s",
        figures={"repack s": 3.0864, "rounds": 3},
        model="synthetic qwen3moe, 2.34 GiB",
        target="≤ 1.1× `cp` + fsync (issue 8)",
        met=False,
    )
    fields.update(changes)
    return headline.record("repack", results=results, readme=readme, **fields)


def test_the_committed_table_is_what_the_results_files_give() -> None:
    """Regenerating the README's table from benchmarks/results/ changes nothing."""
    text = headline.README.read_text(encoding="utf-8")
    docs = headline.load_results(headline.RESULTS)
    assert headline.with_table(text, headline.render_table(docs), headline.README) == text
    assert _headline("--check").returncode == 0


def test_every_committed_results_file_has_the_required_fields() -> None:
    paths = sorted(headline.RESULTS.glob("*.json"))
    assert paths, "benchmarks/results/ holds the table's files"
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert headline.problem(doc, path) == "", path
        assert set(headline.FIELDS) <= set(doc)
        assert set(headline.MACHINE_FIELDS) <= set(doc["machine"])
        assert doc["command"].strip() and doc["date"][:4].isdigit()
        # the command runs anywhere: no absolute path of the machine it was measured on
        assert not any(headline.machine_path(w) for w in shlex.split(doc["command"])), path


def test_a_recorded_command_names_no_folder_of_this_machine() -> None:
    script = str(headline.HERE / "bench_build.py")
    argv = [script, "--types", "Q4_0", "--dir", "/work/x", "--out=/srv/y", "--rounds", "2"]
    assert headline.portable_command(argv) == "benchmarks/bench_build.py --types Q4_0 --rounds 2"
    scratch = [script, "--dir", "/tmp/b", "--out=/tmp/c"]
    assert (
        headline.portable_command(scratch) == "benchmarks/bench_build.py --dir /tmp/b --out=/tmp/c"
    )


def test_record_writes_the_capability_file_and_the_table_shows_it(
    tmp_path: Path, readme: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["benchmarks/bench_repack.py", "--sizes", "1", "--dir", "/tmp/with space"]
    monkeypatch.setattr(sys, "argv", argv)
    results = tmp_path / "results"
    path = _record(results, readme)
    assert path == results / "repack.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["command"] == shlex.join(argv)
    assert shlex.split(doc["command"]) == argv
    assert doc["benchmark"] == "bench_repack.py"
    assert doc["ratio"] == 1.23 and doc["figures"] == {"repack s": 3.086, "rounds": 3}
    assert doc["yardstick"] == {
        "name": "coreutils `cp` + fsync of the file",
        "value": 2.5,
        "unit": "s",
    }
    assert doc["machine"]["cores"] == os.cpu_count()
    assert doc["machine"]["kernel"] == os.uname().release
    assert doc["machine"]["ram_gib"] > 0
    assert doc["date"].endswith("Z") and doc["source"] == headline.MEASURED
    text = readme.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| Repack"))
    assert "**1.23×** coreutils `cp` + fsync of the file (2.50 s)" in row
    assert "≤ 1.1× `cp` + fsync (issue 8): **not met**" in row
    assert f"`{shlex.join(argv)}`" in row
    assert text.endswith("## The log\n\nkept\n")
    assert readme.stat().st_mode & 0o777 == 0o640  # the README keeps its mode
    assert _headline("--check", "--results", results, "--readme", readme).returncode == 0


def test_a_later_run_replaces_the_capability_s_file_and_row(tmp_path: Path, readme: Path) -> None:
    results = tmp_path / "results"
    _record(results, readme)
    _record(results, readme, ratio=1.05, met=True)
    assert [p.name for p in results.iterdir()] == ["repack.json"]
    rows = [line for line in readme.read_text().splitlines() if line.startswith("| Repack")]
    assert len(rows) == 1 and "**1.05×**" in rows[0] and "(issue 8): met" in rows[0]


def test_regenerating_twice_changes_nothing(tmp_path: Path, readme: Path) -> None:
    results = tmp_path / "results"
    _record(results, None)
    first = _headline("--results", results, "--readme", readme)
    assert first.returncode == 0 and "regenerated" in first.stdout
    text = readme.read_text(encoding="utf-8")
    second = _headline("--write", "--results", results, "--readme", readme)
    assert second.returncode == 0 and "up to date" in second.stdout
    assert readme.read_text(encoding="utf-8") == text


def test_check_fails_when_the_table_is_not_what_the_files_give(
    tmp_path: Path, readme: Path
) -> None:
    results = tmp_path / "results"
    _record(results, readme)
    doc = json.loads((results / "repack.json").read_text())
    doc["ratio"] = 0.5
    (results / "repack.json").write_text(json.dumps(doc))
    before = readme.read_text()
    r = _headline("--check", "--results", results, "--readme", readme)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"headline: error: {readme}: the table is not what {results} gives; "
        "run python benchmarks/headline.py"
    ]
    assert readme.read_text() == before


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.pop("target"), "missing field 'target'"),
        (lambda d: d["machine"].pop("kernel"), "missing field 'machine.kernel'"),
        (lambda d: d["yardstick"].update(value="fast"), "field 'yardstick.value' is str"),
        (lambda d: d.update(met="yes"), "field 'met' is str, not bool or null"),
        (lambda d: d.update(figures={}), "field 'figures' is empty"),
        (lambda d: d.update(capability="verify"), "capability 'verify' is not the file's name"),
        (lambda d: d.update(date="1 December"), "field 'date' is '1 December'"),
        (lambda d: d.update(ratio=[1.0]), "field 'ratio' is a list but not [low, high]"),
        (lambda d: d.update(ratio=float("nan")), "field 'ratio' is nan, not a finite number"),
        (lambda d: d.update(target=None), "field 'met' is set without a target"),
        (lambda d: d.update(typo=1), "unknown field 'typo'"),
    ],
)
def test_a_results_file_without_what_the_table_needs_is_one_line_error(
    tmp_path: Path, readme: Path, change, problem: str
) -> None:
    results = tmp_path / "results"
    path = _record(results, readme)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    before = readme.read_text()
    r = _headline("--results", results, "--readme", readme)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"headline: error: {path}: {problem}")
    assert readme.read_text() == before


def test_a_readme_without_the_markers_is_refused_and_left_alone(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _record(results, None)
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    r = _headline("--results", results, "--readme", readme)
    assert r.returncode == 2
    assert r.stderr.startswith(f"headline: error: {readme}: needs one '{headline.START}' line")
    assert readme.read_text() == "# Benchmarks\n"


def test_seeded_rows_say_they_come_from_the_log(tmp_path: Path, readme: Path) -> None:
    results = tmp_path / "results"
    path = _record(results, None)
    doc = json.loads(path.read_text())
    doc.update(date="2026-12-01", source="benchmarks/README.md, 1 December 2026", ratio=[1.7, 2.8])
    doc["machine"].update(cpu=None, kernel=None)
    path.write_text(json.dumps(doc))
    assert _headline("--results", results, "--readme", readme).returncode == 0
    row = next(line for line in readme.read_text().splitlines() if line.startswith("| Repack"))
    assert "| 2026-12-01 (log) |" in row and "**1.70–2.80×**" in row
    assert f"| {doc['machine']['cores']} cores, {doc['machine']['ram_gib']:g} GiB |" in row
