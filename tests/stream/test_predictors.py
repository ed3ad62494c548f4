"""Predictors of the next token's experts, scored on held-out prompts."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.stream.forecast import evaluate, holdout
from moepack.stream.predictor import PREDICTORS, resolve
from moepack.trace import synth_trace
from moepack.trace.core import PromptSegment, RoutingTrace


def structured(tokens: int = 800) -> RoutingTrace:
    """Layer 1 copies layer 0; every token repeats the previous one but every 4th, which
    draws fresh experts; 4 prompts."""
    rng = np.random.default_rng(0)
    rows = []
    cur = rng.choice(16, 2, replace=False)
    for t in range(tokens):
        if t % 4 == 0:
            cur = rng.choice(16, 2, replace=False)
        rows.append(cur)
    layer = np.stack(rows).astype(np.uint8)
    ids = np.stack([layer, layer], axis=1)
    q = tokens // 4
    return RoutingTrace(ids, 16, segments=[PromptSegment(i * q, 10, q - 10) for i in range(4)])


def test_sticky_and_cross_layer_find_the_planted_structure() -> None:
    r = evaluate(structured(), ["sticky", "cross-layer", "frequency", "sticky+markov"], [2, 4])
    assert r.split.by_prompts and r.split.eval_prompts == 1
    sticky = r.score("sticky", 2)
    # 3 of every 4 tokens repeat their predecessor, a fresh draw shares 1/8 by chance
    assert 0.74 < sticky.recall < 0.82 and sticky.precision == sticky.recall
    cross = r.score("cross-layer", 2)
    assert cross.recall > 0.45  # layer 1 is certain, layer 0 falls back to the hot list
    assert r.score("frequency", 2).recall < 0.3
    assert r.score("sticky", 4).precision == pytest.approx(r.score("sticky", 4).recall / 2)


def test_one_prompt_holds_out_its_last_quarter_and_says_so() -> None:
    t = synth_trace(tokens=400, layers=2, n_expert=16, top_k=2, seed=0)
    split = holdout(t)
    assert split.train_rows.size == 300 and split.eval_rows[0] == 300
    r = evaluate(t, ["markov"], [2])
    assert any("last quarter" in n for n in r.notes)


def test_unknown_predictor_and_bad_budget_are_bad_input() -> None:
    with pytest.raises(BadInput, match="unknown predictor 'oracle'"):
        resolve("sticky+oracle")
    with pytest.raises(BadInput, match="fetch budget"):
        evaluate(structured(), ["sticky"], [0])
    assert {"frequency", "sticky", "markov", "cross-layer"} <= set(PREDICTORS.names())


def test_sparse_transitions_and_windows_score_as_the_dense_table(monkeypatch) -> None:
    """Beyond ``DENSE_EXPERTS`` transitions are kept sparse and scores are made in windows of
    tokens: the same recall and precision as one dense table over all tokens."""
    from moepack.stream import forecast, predictor

    t = structured()
    names, budgets = ["markov", "cross-layer", "sticky+markov", "frequency"], [2, 5]
    dense = evaluate(t, names, budgets)
    monkeypatch.setattr(predictor, "DENSE_EXPERTS", 0)
    monkeypatch.setattr(predictor, "ROW_CELLS", 16 * 7)  # windows of 7 tokens
    monkeypatch.setattr(forecast, "ROW_CELLS", 16 * 7)
    sparse = evaluate(t, names, budgets)
    assert [s.to_json() for s in sparse.scores] == [s.to_json() for s in dense.scores]
    learned = predictor.PREDICTORS.get("markov").fit(t.ids, 16, 0)
    assert isinstance(learned, predictor.Transitions) and learned.dense is None


LIMITED = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29)); "
    "from moepack.cli.main import main; main(sys.argv[1:])"
)
"""The CLI in a child whose address space is capped at 1.5 GiB (the interpreter and numpy take
a few hundred MiB): a table sized n_expert² for 65,536 experts asks for 16-32 GiB."""


@pytest.fixture(scope="module")
def wide_traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An ~80 KiB trace declaring 65,536 experts (640 tokens, 4 layers, top-4), as MBLT and
    as text."""
    from moepack.trace import save_trace

    d = tmp_path_factory.mktemp("wide")
    rng = np.random.default_rng(0)
    n = 65536
    ids = np.stack([[rng.choice(n, 4, replace=False) for _ in range(4)] for _ in range(640)])
    trace = RoutingTrace(ids=ids.astype(np.uint32), n_expert=n)
    out: dict[str, object] = {}
    for ext in ("mblt", "txt"):
        save_trace(trace, d / f"t.{ext}")
        out[ext] = d / f"t.{ext}"
    return out


@pytest.mark.parametrize("ext", ["mblt", "txt"])
def test_predict_on_65536_declared_experts_runs_in_bounded_memory(wide_traces, ext) -> None:
    import json
    import subprocess
    import sys

    path = wide_traces[ext]
    assert 64 << 10 < path.stat().st_size < 96 << 10
    args = ["predict", str(path), "--json", "--predictors", "markov,cross-layer,sticky+markov"]
    r = subprocess.run(
        [sys.executable, "-c", LIMITED, *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert {s["predictor"] for s in doc["scores"]} == {"markov", "cross-layer", "sticky+markov"}
    r = subprocess.run(
        [sys.executable, "-c", LIMITED, "trace", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    warning = [ln for ln in r.stderr.splitlines() if ln.startswith("moepack: warning: ")]
    assert len(warning) == 1 and "declares 65,536 experts per layer" in warning[0], r.stderr


def test_lookahead_predictors_on_65536_experts_run_in_bounded_memory(wide_traces) -> None:
    """What ``run --lookahead markov+cross-layer --lookahead-trace`` fits in its worker, on a
    trace of 65,536 experts (the model's count: the run refuses a trace wider than its model)."""
    import subprocess
    import sys

    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))\n"
        "import numpy as np\n"
        "from moepack.llama.prefetcher.lookahead import StreamPredictors\n"
        "from moepack.stream.predictor import resolve\n"
        "from moepack.trace.formats import load_trace\n"
        "ids = np.asarray(load_trace(sys.argv[1]).ids, dtype=np.int64)\n"
        "sp = StreamPredictors(resolve('markov+cross-layer'), range(4), 65536, 4)\n"
        "sp.fit(ids)\n"
        "for layer in range(4):\n"
        "    sp.observe(layer, ids[-1, layer])\n"
        "s = sp.scores(2)\n"
        "assert s is not None and s.shape == (1, 65536), s\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(wide_traces["mblt"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_run_refuses_a_lookahead_trace_wider_than_its_model(capsys, wide_traces, tmp_path) -> None:
    """Checked before llama.cpp starts: one line naming the trace and both expert counts."""
    from moefixtures import run_cli, tiny_spec
    from moepack.checkpoint.synth import synth_model

    model = synth_model(tmp_path / "m.gguf", tiny_spec(layers=4)).paths[0]
    args = ["run", model, "-p", "hi", "--prefetch", "--lookahead", "markov"]
    code, _out, err = run_cli(capsys, *args, "--lookahead-trace", wide_traces["mblt"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "t.mblt" in lines[0] and "65,536 experts per layer for a model with 8" in lines[0]
