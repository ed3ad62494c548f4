"""Fixtures for the quant tests: a synthetic F32 model and llama.cpp's own quantisations of it
(any llama_ftype, not only the ones ``moepack synth`` offers), made in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from moefixtures import tiny_spec
from moepack.checkpoint.ggml_c import find_libggml_base
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.checkpoint.synth_plan import gguf_writer, plan_synth

# llama_ftype values (llama.h) and the ggml type each makes of the expert matrices.
FTYPES = {
    "F16": (1, "F16"),
    "Q4_0": (2, "Q4_0"),
    "Q4_1": (3, "Q4_1"),
    "Q8_0": (7, "Q8_0"),
    "Q5_0": (8, "Q5_0"),
    "Q5_1": (9, "Q5_1"),
    "Q2_K": (10, "Q2_K"),
    "Q3_K_M": (12, "Q3_K"),
    "Q4_K_M": (15, "Q4_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
    "IQ4_NL": (25, "IQ4_NL"),
    "IQ3_S": (26, "IQ3_S"),
    "IQ4_XS": (30, "IQ4_XS"),
    "BF16": (32, "BF16"),
    "TQ1_0": (36, "TQ1_0"),
    "TQ2_0": (37, "TQ2_0"),
    "MXFP4_MOE": (38, "MXFP4"),
}
# Refused by llama.cpp without an importance matrix ("this quantization requires an imatrix").
NEED_IMATRIX = {"IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24}

HAVE_GGML = find_libggml_base() is not None


def f32_model(folder: Path) -> Path:
    """A one-block qwen3moe model with rows of 256 values (what every K/IQ type needs)."""
    spec = tiny_spec(layers=1, experts=4, hidden=256, expert_ffn=256, head_dim=64, heads=4)
    return synth_model(folder / "f32.gguf", spec).paths[0]


def llama_quantise(src: Path, dst: Path, ftype: int) -> subprocess.CompletedProcess[str]:
    """``llama_model_quantize(src, dst, ftype)`` in a child process (llama.cpp may abort)."""
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3]); p.nthread = 1\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(0 if rc == 0 else 3)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(src), str(dst), str(ftype)],
        capture_output=True,
        text=True,
    )


def hollow_f32(spec: SynthSpec, path: Path) -> Path:
    """The F32 model of ``spec`` with its header written and its data a hole (a sparse file of
    the full size, no block of data on disk): what llama.cpp's dry run reads."""
    f32 = replace(spec, weight_type="F32")
    plan = plan_synth(f32)
    writer = gguf_writer(f32, path, [(t.plan, t.qtype) for t in plan.tensors])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.flush()
    assert writer.fout is not None
    os.ftruncate(writer.fout[0].fileno(), plan.file_bytes)
    writer.close()
    return path


_DRY_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- .*type =\s+(\w+),.*?(?:\((\w+)\))?$")
_DRY_TOTAL = re.compile(r"quant size\s+=\s+([\d.]+) MiB")


def llama_dry_run(src: Path, ftypes: list[int]) -> dict[int, tuple[dict[str, str], float]]:
    """llama.cpp's own choice of type for every tensor of ``src`` in a file of each of
    ``ftypes`` (``llama_model_quantize`` with ``dry_run``: nothing written, data never read),
    and the quantised size it reports in MiB; one child process for them all."""
    code = (
        "import sys, llama_cpp\n"
        "for ftype in sys.argv[3:]:\n"
        "    sys.stderr.write(f'=== ftype {ftype}\\n'); sys.stderr.flush()\n"
        "    p = llama_cpp.llama_model_quantize_default_params()\n"
        "    p.ftype = int(ftype); p.nthread = 1; p.dry_run = True\n"
        "    rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "    if rc != 0: sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src), str(src.with_suffix(".none")), *map(str, ftypes)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = {}
    for part in proc.stderr.split("=== ftype ")[1:]:
        ftype, _, log = part.partition("\n")
        types = {}
        for line in log.splitlines():
            m = _DRY_LINE.match(line.strip())
            if m:
                types[m.group(1)] = (m.group(3) or m.group(2)).upper()
        total = _DRY_TOTAL.search(log)
        assert total, log[-2000:]
        out[int(ftype)] = (types, float(total.group(1)))
    return out
