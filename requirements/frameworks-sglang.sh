#!/usr/bin/env bash
# Installs SGLang 0.5.23 for tracediff's sglang adapter tests, on CPU, into the venv whose pip is $PIP.
#
# Usage:  PIP=/path/to/venv/bin/pip bash requirements/frameworks-sglang.sh
#
# Preconditions: the venv already has torch 2.13.0 (any build: the registry's, or a CPU one) and tracediff[test]
# (`pip install torch==2.13.0 && pip install -e '.[test]'`). Idempotent: re-running it installs nothing new.
#
# Why it looks like this:
# - sglang's own requirements pin torch 2.14.1, torchvision, torchaudio, flashinfer, sgl-kernel and other
#   CUDA-only wheels (multi-GB CUDA torch). So sglang, triton and compressed-tensors go in with --no-deps and
#   the small pure-Python dependencies it really imports on CPU are listed here by hand.
# - Never add torchvision, torchaudio, vllm, sgl-kernel / sglang-kernel or flashinfer: the tests and the live
#   server stub `torchvision` and `vllm` (tests/sglang_stubs/).
# - transformers is pinned to 5.19.0: sglang 0.5.23 pins it, and tracediff[test] accepts it.
set -euo pipefail
# shellcheck source=pip-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/pip-install.sh"
: "${PIP:?set PIP to the pip of the venv, e.g. PIP=.venv/bin/pip}"
PY="$(dirname "$(command -v "$PIP")")/python"

torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
case "${torch_version%%+*}" in
  2.13.0) ;;
  *) echo "frameworks-sglang.sh: expected torch 2.13.0 (any build) in $PY, found $torch_version" >&2; exit 1 ;;
esac
# The constraint names the installed distribution's version: a wheel's metadata may lack the local
# build tag that torch.__version__ carries (PyPI's 2.13.0 reports 2.13.0+cu130), and pip matches the former.
torch_dist="$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')"
# Keep the installed torch whatever a dependency asks for.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_dist" > "$constraints"

# 1. The frameworks themselves, without their (CUDA) dependency trees. pip then reports sglang's
#    unmet pins (torch 2.14.1, torchvision, flashinfer...) as "dependency conflicts": expected.
pip_install "$PIP" -q --no-deps sglang==0.5.23 triton==3.9.0 compressed-tensors==0.18.0

# 2. What sglang imports to build models in-process on CPU (tests/test_sglang_adapter.py).
pip_install "$PIP" -q -c "$constraints" \
    transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0 'datasets<=5.1.0' hs-connectors==0.9.0 \
    pydantic pydantic-settings loguru orjson psutil pybase64 requests pillow starlette msgspec pyzmq IPython \
    aiohttp dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf partial-json-parser

# 3. What `python -m sglang.launch_server --device cpu` needs on top (tests/test_sglang_live.py).
pip_install "$PIP" -q -c "$constraints" \
    uvicorn uvloop fastapi setproctitle einops jsonschema xgrammar==0.2.7 soundfile==0.13.1 python-multipart

# Nothing above may have replaced the chosen torch build (with a CUDA one, or another version).
"$PY" - "$torch_version" <<'PY'
import sys

import sglang
import torch

assert torch.__version__ == sys.argv[1], f"torch was replaced: {torch.__version__} != {sys.argv[1]}"
assert sglang.__version__ == "0.5.23", sglang.__version__
print(f"frameworks-sglang: sglang {sglang.__version__}, torch {torch.__version__}")
PY
