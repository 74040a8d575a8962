"""Training data for tests/test_lint.py, made by the real producers from a real model's forward passes.

The target is a tiny transformers Llama with massive activations (:func:`build_tiny_model`), saved with
``save_pretrained`` (config.json + model.safetensors: what ``--target`` reads). Its hidden states of a
few token sequences become:

- speculators' offline files, written by vLLM's ``ExampleHiddenStatesConnector`` (bf16) and
  hs_connectors' ``FP8HiddenStatesConnector`` (FP8 + per-token scales) in the vLLM venv
  (tests/hs_writer_child.py): ``hidden_states [T, 4, H]`` = aux layers hs2, hs4, hs6, then the last
  layer before the final norm;
- SpecForge's offline cache, written by its ``LocalFeatureStore`` dump (``<sample>.ckpt``);
- a bank of every hidden state, recorded with tracediff's hf adapter.

Defects are injected into the tensors the producers are handed, as a broken extraction hands them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
H, L = 64, 8
AUX_IDS = [2, 4, 6]  # vLLM ids = HF hidden_states indices
SPECULATORS_SLOTS = ("hs2", "hs4", "hs6", "pre_norm")


@dataclass
class TargetData:
    folder: Path  # the saved target
    seqs: list[list[int]]
    states: list[dict[str, torch.Tensor]]  # per sequence: hs0..hs{L}, pre_norm -> [T, H] float32
    tm: object

    def stack(self, names: tuple[str, ...] = SPECULATORS_SLOTS) -> list[torch.Tensor]:
        """Per sequence [T, len(names), H] bf16, as vLLM hands the connector its hidden states."""
        return [torch.stack([s[n] for n in names], dim=1).to(torch.bfloat16) for s in self.states]

    def tokens(self) -> list[torch.Tensor]:
        return [torch.tensor(s, dtype=torch.int64) for s in self.seqs]


def build_target(folder: Path, n_seqs: int = 8, seed: int = 0) -> TargetData:
    from tracediff.testing.models import build_tiny_model
    from tracediff.testing.tiny_llama import layer_states, make_sequences

    tm = build_tiny_model("llama", hidden_size=H, num_layers=L, seed=seed)
    tm.model.save_pretrained(folder)
    seqs = make_sequences(n_seqs=n_seqs, min_len=12, max_len=40, vocab_size=512, seed=seed + 1)
    states = []
    with torch.no_grad():
        for seq in seqs:
            got, _ = layer_states(tm, torch.tensor(seq))
            states.append({k: v[0].float() for k, v in got.items()})
    return TargetData(folder, seqs, states, tm)


def vllm_python() -> Path:
    python = Path(os.environ.get("TRACEDIFF_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not python.exists():
        pytest.skip(f"no vLLM venv at {python} (requirements/test-env.sh makes .venv-vllm): vLLM's and hs_connectors' "
                    f"writers need it")
    return python


def write_speculators(sets: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], str]], out: Path) -> dict[str, Path]:
    """Each set (hidden states, token ids, "bf16" or "fp8") written by the real connector to out/<set>/."""
    from safetensors.torch import save_file

    spec = importlib.util.find_spec("hs_connectors")
    assert spec is not None and spec.submodule_search_locations, "hs_connectors is installed in the test venv"
    shim = out / ".hs_connectors_path"
    shim.mkdir(parents=True, exist_ok=True)
    if not (shim / "hs_connectors").exists():
        # The very package installed in this venv from PyPI, on the vLLM venv's path (only it).
        (shim / "hs_connectors").symlink_to(list(spec.submodule_search_locations)[0])
    inputs = {}
    for name, (states, tokens, _kind) in sets.items():
        for i, (hs, tok) in enumerate(zip(states, tokens, strict=True)):
            inputs[f"{name}/hs_{i}"] = hs.clone().contiguous()
            inputs[f"{name}/tok_{i}"] = tok.clone().contiguous()
    save_file(inputs, str(out / "inputs.safetensors"))
    (out / "plan.json").write_text(json.dumps({name: kind for name, (_s, _t, kind) in sets.items()}))
    env = {**os.environ, "PYTHONPATH": str(shim), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(vllm_python()), str(ROOT / "tests" / "hs_writer_child.py"), str(out / "inputs.safetensors"),
                           str(out / "plan.json"), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: out / name for name in sets}


def write_specforge(data: TargetData, folder: Path, aux: tuple[str, ...] = ("hs2", "hs4", "hs6"),
                    edit: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
    """SpecForge's offline cache as its LocalFeatureStore dumps it: one ``<sample>.ckpt`` per sample."""
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    store = LocalFeatureStore("lint", dump_dir=str(folder))
    for i, (s, tok) in enumerate(zip(data.states, data.tokens(), strict=True)):
        tensors = {"input_ids": tok, "loss_mask": torch.ones_like(tok),
                   "hidden_state": s[f"hs{L}"].to(torch.bfloat16)[None],
                   "aux_hidden_state": torch.cat([s[n] for n in aux], dim=-1).to(torch.bfloat16)[None]}
        tensors.update((edit or {}).get(i, {}))
        store.put(tensors, sample_id=f"data_{i}", metadata={"num_tokens": len(tok)})
    return folder


def record_bank(data: TargetData, path: Path) -> Path:
    """Every hidden state of the target for the same sequences (tracediff's hf adapter)."""
    import tracediff
    from tracediff.adapters import hf
    from tracediff.testing.tiny_llama import layer_states

    with tracediff.record(path, role="bank", handle_sigterm=False) as rec, torch.no_grad():
        assert hf.attach(rec, data.tm.model)
        for seq in data.seqs:
            layer_states(data.tm, torch.tensor(seq))
    return path
