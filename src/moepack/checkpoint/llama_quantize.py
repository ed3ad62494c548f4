"""llama.cpp's own ``llama_model_quantize`` on a whole file, in a subprocess (llama.cpp aborts
on errors): the yardstick the synthetic writer's K-quant files are checked against, and a
reference quantisation for comparisons."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..errors import BadInput, MoepackError
from .ftypes import LLAMA_FTYPES


def llama_cpp_available() -> bool:
    """True when llama-cpp-python is importable."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def llama_quantize(src: Path, dst: Path, type_name: str, threads: int = 2) -> None:
    """Quantise the F32 model ``src`` to ``dst`` as llama.cpp's file type ``type_name``."""
    if type_name not in LLAMA_FTYPES:
        raise BadInput(f"llama.cpp quantisation type must be one of {', '.join(LLAMA_FTYPES)}")
    if not llama_cpp_available():
        raise MoepackError(
            f"{type_name} needs llama.cpp: install llama-cpp-python (pip install 'moepack[llama]')"
        )
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3]); p.nthread = int(sys.argv[4])\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(0 if rc == 0 else 3)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(src),
            str(dst),
            str(LLAMA_FTYPES[type_name]),
            str(threads),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise MoepackError(f"llama.cpp quantisation to {type_name} failed: {tail[0]}", src)
