"""Names that come from inputs are printed as they are: a tensor, an architecture, a store's
model or a trace's source called ``[/x]`` (what rich would read as a closing tag) or
``[bold]`` is shown literally, never parsed, in tables, titles, lines and warnings alike.
(Paths through a folder named ``[`` are the fuzz harness's, ``tests/fuzz/commands.py``.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, write_gguf
from moepack.checkpoint.gguf_file import GgufFile
from moepack.npu.geometry import Geometry
from moepack.npu.profiles import get_profile
from moepack.npu.q4nx import TensorSpec, write_q4nx
from moepack.npu.synth import produce
from moepack.store.build import build_store
from moepack.store.format import HEADER
from moepack.trace import RoutingTrace, save_trace

MARKUP = "[/x]"
STYLE = "[bold red]"  # a name that would otherwise be shown styled, not as written
N, F, E = 32, 32, 4
NPU_PROFILE = "seed-2026-09"


def _model(path: Path, extra: dict[str, tuple[int, ...]] | None = None) -> Path:
    tensors = {
        "token_embd.weight": (32, N),
        "blk.0.attn_norm.weight": (N,),
        "blk.0.ffn_gate_inp.weight": (E, N),
        "blk.0.ffn_gate_exps.weight": (E, F, N),
        "blk.0.ffn_up_exps.weight": (E, F, N),
        "blk.0.ffn_down_exps.weight": (E, N, F),
        f"{STYLE}{MARKUP}.weight": (N,),
        **(extra or {}),
    }
    kv = {
        "general.name": MARKUP,
        "qwen3moe.expert_count": E,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.block_count": 1,
    }
    return write_gguf(path, "qwen3moe", tensors, kv)


def _store_named(model: Path, out: Path) -> Path:
    """A store of ``model`` whose index names its model and architecture with markup (the
    index resealed: its length and sha256 in the header made right again)."""
    build_store(model, out)
    data = out.read_bytes()
    magic, version, reserved, align, d0, d1, i0, ilen, _sha = HEADER.unpack_from(data)
    doc = json.loads(data[i0 : i0 + ilen])
    doc["model"]["name"] = f"{STYLE}{MARKUP}"
    doc["model"]["architecture"] = MARKUP
    index = json.dumps(doc).encode()
    head = HEADER.pack(
        magic, version, reserved, align, d0, d1, i0, len(index), hashlib.sha256(index).digest()
    )
    out.write_bytes(head + data[HEADER.size : i0] + index)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("markup")
    s = {"gguf": _model(d / "m.gguf", {f"blk.0.{MARKUP}_exps.weight": (E, F, N)})}
    s["store"] = _store_named(_model(d / "plain.gguf"), d / "s.moestore")
    s["config"] = d / "config.json"
    s["config"].write_text(
        json.dumps(
            {
                "architectures": [MARKUP],
                "model_type": STYLE,
                "hidden_size": 64,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
            }
        )
    )
    ids = np.random.default_rng(0).integers(0, 8, size=(16, 2, 2)).astype(np.int16)
    ids.sort(axis=2)
    ids[:, :, 1] = np.where(ids[:, :, 1] == ids[:, :, 0], (ids[:, :, 0] + 1) % 8, ids[:, :, 1])
    trace = RoutingTrace(
        ids=ids, n_expert=8, provenance={"source": MARKUP, "model": STYLE, "notes": [MARKUP]}
    )
    s["trace"] = save_trace(trace, d / "t.moetrace").path
    s["q4nx"] = d / "m.q4nx"
    geo = Geometry.scaled(1)
    roles = get_profile(NPU_PROFILE).layout(geo, geo.kind(3)).roles()
    specs = [TensorSpec(geo.name_of(r, 3), geo.shape(r).dtype, geo.shape(r).shape) for r in roles]
    specs.append(TensorSpec(f"model.layer.3.{MARKUP}", specs[0].dtype, specs[0].shape))
    with open(s["q4nx"], "wb") as fh:
        write_q4nx(fh, specs, lambda x: produce(x, 1), {"moepack.geometry": geo.name})
    return s


@pytest.mark.parametrize(
    "args, shown",
    [
        (("inspect", "{gguf}"), [f"blk.0.{MARKUP}_exps.weight"]),
        (("inspect", "{gguf}", "--json"), [MARKUP]),
        (("survey", "{config}"), [MARKUP]),
        (("store", "info", "{store}"), [f"{STYLE}{MARKUP}", f"({MARKUP})"]),
        (("trace", "info", "{trace}"), [MARKUP, STYLE]),
        (("npu", "inspect", "{q4nx}", "--profile", NPU_PROFILE), [f"model.layer.3.{MARKUP}"]),
    ],
)
def test_names_from_inputs_are_printed_as_they_are(capsys, files, args, shown):
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    text = out + err
    for name in shown:
        assert name in text, text


def test_a_markup_name_in_a_verify_difference_and_an_error(capsys, files, tmp_path):
    """Library messages that quote a name (the tensor verify found different, the file an
    error is about) show it as it is too."""
    plain = files["store"].parent / "plain.gguf"
    other = tmp_path / "o.gguf"
    data = bytearray(plain.read_bytes())
    t = GgufFile(plain).tensors
    entry = next(e for e in t if e.name == f"{STYLE}{MARKUP}.weight")
    data[entry.offset] ^= 0xFF
    other.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", plain, other, "-q")
    assert code == 1, err
    assert f"VERIFICATION FAILED — {other}: tensor '{STYLE}{MARKUP}.weight' differs" in out, out
    named = tmp_path / f"{STYLE}x[a].gguf"
    named.write_bytes(b"not a model")
    code, _, err = run_cli(capsys, "inspect", named)
    assert code == 2 and err.startswith(f"moepack: error: {named}: "), err
    assert len(err.splitlines()) == 1, err
