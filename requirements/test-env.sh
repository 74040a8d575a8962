#!/usr/bin/env bash
# Sets up .venv with everything the test suite needs: torch 2.13.0 (the registry's build; set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the smaller CPU one),
# tracediff with its test extras, and the frameworks the adapter tests run for real on CPU
# (speculators, SpecForge, SGLang; installed without their CUDA dependency trees, see each script),
# vLLM (CPU build) in a venv of its own, .venv-vllm (its pins conflict with SGLang's), and Debian's
# Chromium for the HTML report's browser test (where it cannot be installed, its test is skipped).
# Idempotent: a second run installs nothing new.
set -euo pipefail
# shellcheck source=pip-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/pip-install.sh"
cd "$(dirname "$0")/.."
started=$(date +%s)
[ -x .venv/bin/python ] || python3 -m venv .venv
pip_install .venv/bin/pip -q torch==2.13.0 ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
pip_install .venv/bin/pip -q -e '.[test]'
PIP=.venv/bin/pip bash requirements/frameworks-trainers.sh
PIP=.venv/bin/pip bash requirements/frameworks-sglang.sh
bash requirements/frameworks-vllm.sh
bash requirements/browser.sh
# How long this took, for README's cost table (tests/ci_record.py reads it when .ci/run's pytest ends).
finished=$(date +%s)
printf '{"seconds": %d, "finished": %d}\n' "$((finished - started))" "$finished" > .venv/tracediff-setup.json
