"""`tracediff preflight` names the row model each engine builds for a draft: an MTP head (DeepSeek-V3's
``eh_proj``, inside its target's checkpoint) with the hidden state after the final norm in vLLM and
SGLang, vLLM zeroing the embedding slot at position 0; an EAGLE-3 draft with K hidden-state slots.

The MTP checkpoint is the one vLLM serves in ``tests/test_vllm_mtp_live.py`` (where the row model
vLLM really recorded is checked against this prediction); the trainer stores are recorded with
tracediff's recorder under each row model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracediff as td
from tracediff.preflight import render_text, run_preflight
from tracediff.store.row_model import mtp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tracediff.testing.deepseek_mtp import write_deepseek_mtp

    return write_deepseek_mtp(tmp_path_factory.mktemp("mtp") / "target")


def _trainer(path: Path, final_norm: bool) -> Path:
    with td.record(path, role="trainer") as rec:
        rec.declare("fc_in", segment_size=4, row_model=mtp(final_norm=final_norm))
        rec.capture("fc_in", torch.randn(3, 8), labels={"seq": np.zeros(3, dtype=np.int64), "position": np.arange(3),
                                                       "token_id": np.array([5, 6, 7]), "valid": True})
    return path


def test_an_mtp_checkpoint_gets_each_engines_mtp_row_model(checkpoint: Path) -> None:
    pf = run_preflight(checkpoint, None, ("sglang", "vllm"), versions={"sglang": "0.5.23", "vllm": "0.32.0"})
    assert pf.draft.mtp_layers == [4] and pf.draft.eh_proj_shape == [128, 256]
    models = {v.resolution.framework: v.row_model for v in pf.engines}
    for engine in ("sglang", "vllm"):
        assert models[engine]["name"] == "mtp"
        assert models[engine]["row_model"] == mtp(final_norm=True).to_json()
        assert models[engine]["hidden_final_norm"] == "after"
    assert models["vllm"]["zeroed_embedding_positions"] == [0]
    assert models["sglang"]["zeroed_embedding_positions"] == []
    assert pf.exit_code == 0
    text = render_text(pf)
    assert "with MTP layers [4]" in text
    assert "slot 1: the last layer's hidden state after the final norm (hnorm)" in text
    assert "vllm zeroes the embedding slot at positions [0]" in text


def test_a_trainer_that_fed_the_state_before_the_final_norm_is_an_error_per_engine(checkpoint: Path,
                                                                                  tmp_path: Path) -> None:
    pre = _trainer(tmp_path / "pre.zarr", final_norm=False)
    pf = run_preflight(checkpoint, None, ("sglang", "vllm"), trainer=str(pre))
    assert pf.exit_code == 1 and {v.verdict for v in pf.engines} == {"different"}
    errors = [c for c in pf.checks if c.kind == "row_model" and c.severity == "error"]
    assert sorted(c.evidence["engine"] for c in errors) == ["sglang", "vllm"]
    assert all("before model.norm" in c.message for c in errors)
    post = _trainer(tmp_path / "post.zarr", final_norm=True)
    same = run_preflight(checkpoint, None, ("sglang", "vllm"), trainer=str(post))
    assert same.exit_code == 0 and {v.verdict for v in same.engines} == {"same"}


def test_the_command_line_says_the_row_model_in_text_and_json(checkpoint: Path, tmp_path: Path) -> None:
    pre = _trainer(tmp_path / "pre.zarr", final_norm=False)
    out = subprocess.run([sys.executable, "-m", "tracediff", "preflight", str(checkpoint), "--engine", "vllm",
                          "--trainer", str(pre), "--json", str(tmp_path / "pf.json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "row model mtp:" in out.stdout and "hidden state after the final norm" in out.stdout
    doc = json.loads((tmp_path / "pf.json").read_text())
    (engine,) = doc["engines"]
    assert engine["row_model"]["hidden_final_norm"] == "after" and engine["verdict"] == "different"


def test_an_eagle3_draft_gets_k_hidden_state_slots(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from tracediff.testing.eagle3 import write_eagle3_draft

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    cfg.save_pretrained(tmp_path / "target")
    spec = write_eagle3_draft(tmp_path / "draft", cfg, [1, 3, 5, 6], where="top")
    pf = run_preflight(spec.path, tmp_path / "target", ("vllm",), versions={"vllm": "0.32.0"})
    (view,) = pf.engines
    assert view.row_model["name"] == "eagle3" and view.row_model["k"] == 4
    assert "row model eagle3: 4 hidden-state slots" in render_text(pf)


def test_speculators_is_no_trainer_of_a_deepseek_mtp_head(checkpoint: Path) -> None:
    """speculators 0.9 trains MTP heads of Qwen3-family models only (its mtp_model_classes): for a
    DeepSeek-V3 checkpoint preflight says so instead of guessing what it fed."""
    pf = run_preflight(checkpoint, None, ("sglang", "vllm"), trainer="speculators")
    assert "row_model" not in pf.trainer.detail and {v.verdict for v in pf.engines} == {"unknown"}
    (warning,) = [c for c in pf.checks if c.kind == "trainer" and c.severity == "warning"]
    assert "qwen3_next" in warning.message and "not this deepseek_v3 target" in warning.message


def test_speculators_mtp_rule_is_the_state_before_the_final_norm() -> None:
    """speculators 0.9's MTPDraftModel feeds its input_proj hidden_layernorm(verifier_last_hidden_states),
    the verifier's last state before its final norm (read from its source; the DeepSeek rules of vLLM
    and SGLang take it after: engine_rules.MTP_RULES)."""
    from tracediff.adapters.engine_rules import MTP_RULES, MTP_TRAINER_RULES

    assert MTP_TRAINER_RULES["speculators"].hidden_final_norm is False
    assert {r.hidden_final_norm for r in MTP_RULES.values()} == {True}
