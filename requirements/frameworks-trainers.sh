#!/usr/bin/env bash
# Install the trainer frameworks that tests/test_adapters_trainers.py runs on CPU:
# speculators 0.9.0 and SpecForge 0.2.0, and only the dependencies their imported code needs.
#
#   PIP=/path/to/venv/bin/pip requirements/frameworks-trainers.sh
#
# Precondition: the venv already holds torch 2.13.0 (any build: the registry's, or a CPU one) and tracediff[test]
# (`pip install torch==2.13.0 && pip install -e .[test]`). Idempotent: a second run changes nothing.
#
# Why --no-deps for the frameworks: speculators pins torchvision/torchaudio, SpecForge pins
# torch==2.11.0 and sglang==0.5.14; resolving those pulls a multi-GB CUDA torch. What their code
# imports on the paths tracediff hooks (model classes, data readers, collate functions) is:
# transformers (speculators 0.9 wants <=5.19.0), openai and hs-connectors (speculators.train.data),
# datasets (speculators' ArrowDataset). Triton is optional: the tests use speculators' eager loss
# and replace SpecForge's Triton loss module with a torch one.
set -euo pipefail
# shellcheck source=pip-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/pip-install.sh"

PIP="${PIP:-pip}"
PYTHON="${PYTHON:-$(dirname "$(command -v "$PIP")")/python}"

torch_version="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
case "${torch_version%%+*}" in
  2.13.0) ;;
  *) echo "frameworks-trainers.sh: expected torch 2.13.0 (any build) in $PYTHON, found $torch_version" >&2; exit 1 ;;
esac

# The constraint names the installed distribution's version: a wheel's metadata may lack the local
# build tag that torch.__version__ carries (PyPI's 2.13.0 reports 2.13.0+cu130), and pip matches the former.
torch_dist="$("$PYTHON" -c 'from importlib.metadata import version; print(version("torch"))')"
# Keep the installed torch whatever a dependency asks for.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_dist" > "$constraints"

# 1. The frameworks and speculators' hidden-states transfer package, without their pinned deps.
pip_install "$PIP" --quiet --no-deps speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0

# 2. The dependencies their imported code needs (resolved, torch held where it is).
pip_install "$PIP" --quiet -c "$constraints" "transformers==5.19.0" "openai==2.8.0" "datasets>=4.0.0,<=5.1.0"

# 3. Check: torch untouched, the classes tracediff hooks import.
TORCH_COMPILE_DISABLE=1 "$PYTHON" - "$torch_version" <<'EOF'
import sys
import warnings

import torch

# specforge says on import that flash_attn (a CUDA package) is absent; on CPU that is expected.
warnings.filterwarnings("ignore", message="flash_attn is not found")
assert torch.__version__ == sys.argv[1], f"torch changed: {torch.__version__} != {sys.argv[1]}"
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
from speculators.train.data import ArrowDataset, CollateFn  # noqa: F401
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: F401
from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: F401

from importlib.metadata import version

print(f"frameworks-trainers.sh: speculators {version('speculators')}, specforge {version('specforge')}, "
      f"torch {torch.__version__}")
EOF
