#!/usr/bin/env bash
# A throwaway venv with Open WebUI for tests/serve/test_open_webui.py:
#   scripts/open_webui_venv.sh [DIR]     (default /tmp/open-webui-venv; prints the executable)
# `pip install open-webui` pulls torch and NVIDIA's CUDA wheels (several GB) for its local
# embedding and speech models. The chat and model list moepack is checked with need none of
# them, so its wheel is installed without dependencies and its other pinned requirements after
# (its local RAG and speech models then fail to load; nothing here uses them). From PyPI alone.
set -euo pipefail
DIR=${1:-/tmp/open-webui-venv}
VERSION=${OPEN_WEBUI_VERSION:-0.12.4}
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q --upgrade pip
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$DIR/bin/pip" download -q --no-deps -d "$tmp" "open-webui==$VERSION"
wheel=$(ls "$tmp"/open_webui-*.whl)
"$DIR/bin/pip" install -q --no-deps "$wheel"
"$DIR/bin/python" - "$wheel" > "$tmp/requirements.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist: ") and "extra ==" not in line:
            req = line.removeprefix("Requires-Dist: ")
            name = re.split(r"[=<>!~\[; ]", req, maxsplit=1)[0].lower()
            if name not in {"accelerate", "sentence-transformers", "transformers",
                            "faster-whisper", "einops", "colbert-ai"}:
                print(req)
PY
"$DIR/bin/pip" install -q -r "$tmp/requirements.txt"
echo "$DIR/bin/open-webui"
