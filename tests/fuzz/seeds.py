"""The fuzz harness's valid inputs: one of every kind a moepack command reads, all small,
built once per harness run into one folder (``build_seeds``)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

PROFILE, NPU_LAYER = "seed-2026-09", 3


def _cli(*args: object) -> None:
    """``moepack ARGS`` in process, quietly; a seed that cannot be made is a harness bug."""
    from moepack.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"seed command failed: {args}: {err.getvalue()}") from None


def build_seeds(folder: Path) -> dict[str, Path]:
    """Write one valid input of every kind into ``folder``; returns them by kind."""
    import numpy as np

    from moepack.checkpoint import MoeModel
    from moepack.checkpoint.synth import synth_model
    from moepack.layout.coactivation_plan import plan_from_trace
    from moepack.layout.plan import save_plan
    from moepack.npu.geometry import Geometry, detect
    from moepack.npu.packer import layer_plan, pack_buffer, pack_model
    from moepack.npu.profiles import get_profile
    from moepack.npu.q4nx import Q4nxFile, TensorSpec, write_q4nx
    from moepack.npu.synth import produce
    from moepack.npu.txn import build_stream, op_bd, op_patch, op_write
    from moepack.rewrite.repack import repack
    from moepack.storage.surface import PEER_FORMAT, Surface, SurfaceCell
    from moepack.store.build import build_store
    from moepack.trace import save_trace, synth_trace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moefixtures import tiny_spec

    folder.mkdir(parents=True, exist_ok=True)
    s: dict[str, Path] = {}
    s["gguf"] = synth_model(folder / "m.gguf", tiny_spec()).paths[0]
    with MoeModel(s["gguf"]) as m:
        trace = synth_trace(m, tokens=64, seed=1)
        plan = plan_from_trace(m, trace).plan
    for ext in ("moetrace", "pmxtrace", "txt", "csv", "mblt"):
        s[ext] = folder / f"t.{ext}"
        save_trace(trace, s[ext])
    s["moeplan"], s["pmxplan"] = folder / "p.moeplan", folder / "p.pmxplan"
    save_plan(plan, s["moeplan"])
    save_plan(plan, s["pmxplan"])
    s["repacked"] = folder / "r.gguf"
    repack(s["gguf"], plan, s["repacked"])
    s["store"] = folder / "s.moestore"
    build_store(s["gguf"], s["store"], plan=plan)
    s["moeprec"] = folder / "q.moeprec"
    _cli("store", "precision", s["gguf"], "--trace", s["moetrace"], "--budget", "60%",
         "--types", "Q8_0,Q4_0", "--out", s["moeprec"])  # fmt: skip

    cells = [SurfaceCell(z, q, 1e8 * q + z) for z in (4096, 65536, 1 << 20) for q in (1, 4, 16)]
    surface = Surface(cells, engine="pread", mode="direct", device={"source": "/dev/x"})
    s["surface"] = surface.save(folder / "s.json")
    s["peer"] = surface.save(folder / "peer.json", PEER_FORMAT)

    geo = Geometry.scaled(1)
    roles = get_profile(PROFILE).layout(geo, geo.kind(NPU_LAYER)).roles()
    s["q4nx"] = folder / "tiny.q4nx"
    specs = [
        TensorSpec(geo.name_of(r, NPU_LAYER), geo.shape(r).dtype, geo.shape(r).shape) for r in roles
    ]
    with open(s["q4nx"], "wb") as fh:
        write_q4nx(fh, specs, lambda x: produce(x, 1), {"moepack.geometry": geo.name})
    with Q4nxFile(s["q4nx"]) as qm:
        buf = pack_buffer(
            qm, layer_plan(qm, get_profile(PROFILE), detect(qm), NPU_LAYER).buffer("weights")
        )
    s["dump"] = folder / "dump.bin"
    np.asarray(buf).tofile(s["dump"])
    s["pack"] = folder / "pack"
    pack_model(s["q4nx"], s["pack"], PROFILE)
    s["names"] = folder / "names.json"
    s["names"].write_text(json.dumps({"format": "moepack.npu.names", "version": 1, "roles": {}}))
    stream = build_stream([op_write(0x1000, 7), op_bd(0x2000, 16, 64), op_patch(0x2004, 1, 64)])
    s["txn"] = folder / "x.txn"
    s["txn"].write_bytes(stream)

    s["prompts"] = folder / "prompts.jsonl"  # what llama.cpp runs (the model has no template)
    s["prompts"].write_text('{"prompt": "the quick brown fox"}\n{"prompt": "the lazy dog"}\n')
    s["chat-prompts"] = folder / "chat-prompts.jsonl"  # what the prompt reader is fuzzed with
    s["chat-prompts"].write_text(
        '{"prompt": "the quick brown fox"}\n'
        '{"messages": [{"role": "user", "content": "jumps over"}], "n": 3}\n'
        '{"prompt": "the lazy dog"}\n'
    )
    s["text"] = folder / "text.txt"
    s["text"].write_text("The quick brown fox jumps over the lazy dog. " * 8)
    s["config"] = folder / "config.json"
    s["config"].write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
        "text_config": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                        "num_experts_per_tok": 8, "num_hidden_layers": 48}}))  # fmt: skip
    s["notgguf"] = folder / "not-a-model.gguf"  # for readers checked before llama.cpp starts
    s["notgguf"].write_bytes(b"not a model\n")
    return s
