"""`tracediff replay SERVER --against-chain` on a live vLLM 0.32 server's draft chain (issue #53, item 3).

``tracediff record --adapter vllm --draft-chain -- python -m vllm.entrypoints.openai.api_server ...``
serves the tiny target of tests/vllm_harness.py with a one-layer EAGLE-3 draft (3 draft tokens a
step: draft steps 0, 1, 2); ``tracediff send`` sends the trainer's sequences; the server is stopped
through the pid of the ``tracediff record`` process we started. Replay then runs the draft's
checkpoint on the server's recorded fc rows and input tokens: the checkpoint the server loaded
matches at every tap of every step; a checkpoint whose final norm weight is another's is named at
draft_norm_out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm_harness as h

pytestmark = pytest.mark.slow

K = 3  # draft tokens a step: draft steps 0 .. K-1


def tracediff(*args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=h.vllm_env())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("replay_vllm_chain")
    tl = h.build_target(root)
    seqs = make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=h.VOCAB, seed=1)
    h.record_trainer(root / "train.zarr", tl, ["hs2", "hs4", "hs5"], seqs)
    draft = h.build_draft(root, "draft", tl, [2, 4, 5], "top")
    store = h.record_served(python, root, "server", draft, root / "train.zarr", "--draft-chain", k=K)["store"]
    return {"root": root, "store": store, "draft": draft, "other": h.with_norm_weight(draft, root / "draft_other", seed=99)}


def _replay(served: dict[str, Any], draft: Path, name: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = served["root"] / f"{name}.json"
    done = tracediff("replay", served["store"], "--draft", draft, "--target", served["root"] / "target",
                     "--against-chain", "--json", out)
    assert out.is_file(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def test_the_checkpoint_the_server_loaded_computes_what_the_served_draft_computed(served) -> None:
    done, report = _replay(served, served["draft"], "same")
    summary = report["replay_chain"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s["step"] for s in summary["steps"]] == list(range(K))
    assert {s["status"] for s in summary["steps"]} == {"match"}, summary["steps"]
    assert all(s["rows"] > 0 and s["top1_agreement"] == 1.0 for s in summary["steps"]), summary["steps"]
    assert {x["status"] for x in report["chain"]} == {"match"}
    assert "The served draft computes what the checkpoint computes." in done.stdout


def test_a_checkpoint_with_another_final_norm_weight_is_named_at_the_final_norm(served) -> None:
    done, report = _replay(served, served["other"], "other_norm")
    summary = report["replay_chain"]
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary["first_diverging"] == "draft_norm_out"
    assert summary["steps"][0]["status"] == "diverged"
    assert "The draft's inputs are the same, its outputs are not: look at draft_norm_out" in done.stdout
