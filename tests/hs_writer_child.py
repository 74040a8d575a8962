"""Write speculators' offline files with the real producers, in the vLLM venv (tests/lint_data.py runs it).

``python hs_writer_child.py INPUTS.safetensors PLAN.json OUT_DIR``: ``INPUTS`` holds ``<set>/hs_<i>`` (bf16
[T, n_layers, H]) and ``<set>/tok_<i>`` (int64 [T]); ``PLAN`` maps each set to ``bf16`` or ``fp8``. Each
sample is written by the producer's own ``_write_tensors`` (what its worker thread runs after the
device-to-host copy): vLLM's ``ExampleHiddenStatesConnector`` for bf16, hs_connectors'
``FP8HiddenStatesConnector`` for FP8, to ``OUT_DIR/<set>/hs_<i>.safetensors`` (the name speculators'
datagen moves each request's file to). The copy is synchronous here: the event only has to say so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class _CopyDone:
    """The CUDA event the writers wait on: a CPU copy is complete when it returns."""

    def synchronize(self) -> None:
        return None


def main() -> None:
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    inputs = load_file(sys.argv[1])
    plan = json.loads(Path(sys.argv[2]).read_text())
    out = Path(sys.argv[3])
    writers = {"bf16": ExampleHiddenStatesConnector, "fp8": FP8HiddenStatesConnector}
    for name, kind in plan.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for key in sorted(k for k in inputs if k.startswith(f"{name}/hs_")):
            index = key.rsplit("_", 1)[1]
            tensors = {"hidden_states": inputs[key], "token_ids": inputs[f"{name}/tok_{index}"]}
            writers[kind]._write_tensors(tensors, _CopyDone(), str(folder / f"hs_{index}.safetensors"), None)


if __name__ == "__main__":
    main()
