"""The draft chain inside a live vLLM 0.32 server on CPU (issue #53; docs/draft-chain.md, docs/vllm.md).

``tracediff record --adapter vllm --draft-chain -- python -m vllm.entrypoints.openai.api_server ...``
serves the tiny target of tests/vllm_harness.py with a one-layer EAGLE-3 draft (3 draft tokens a
step: draft steps 0, 1, 2), ``tracediff send`` replays the trainer's sequences, the server is
stopped through the pid of the ``tracediff record`` process we started. Four servers, each once:
the draft ``a``, the same draft ``a`` again, ``b``: ``a`` with its final norm weight rescaled, and
``c``: ``a`` with the final norm weight of another checkpoint (other proposals). The trainer side is speculators' own ``Eagle3DraftModel`` holding draft ``a``'s weights
(the target's embedding, as vLLM shares it), run teacher forced over the same sequences with the
target's aux hidden states, recorded by the speculators adapter with ``--draft-chain``.
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

LAYERS = ["hs2", "hs4", "hs5"]
NEW_TOKENS = 12
K = 3  # draft tokens a step: draft steps 0 .. K-1
POINTS = ("fc_out", "layer_in", "layer_out", "norm_out", "logits_topk")


def tracediff(*args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=h.vllm_env())


def _chain_tap(point: str, step: int) -> str:
    return f"draft_{point}" + (f"_s{step}" if step else "")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm_chain")
    tl = h.build_target(root)
    seqs = make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=h.VOCAB, seed=1)
    h.record_trainer(root / "train.zarr", tl, LAYERS, seqs)
    draft_a = h.build_draft(root, "draft_a", tl, [2, 4, 5], "top")
    return {"root": root, "python": python, "tl": tl, "seqs": seqs, "train": root / "train.zarr", "draft_a": draft_a,
            "draft_b": h.with_norm_weight(draft_a, root / "draft_b", scale=1.5),
            "draft_c": h.with_norm_weight(draft_a, root / "draft_c")}


def _serve(models: dict[str, Any], name: str, draft: Path) -> dict[str, Any]:
    return h.record_served(models["python"], models["root"], name, draft, models["train"], "--draft-chain", k=K,
                           new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def served(models: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each server variant recorded once: the draft a, a again, b (a's final norm weight rescaled)."""
    return {name: _serve(models, name, models[draft]) for name, draft in
            (("a", "draft_a"), ("a_again", "draft_a"), ("b", "draft_b"), ("c", "draft_c"))}


def _compare(models: dict[str, Any], ref: Path, cand: Path, name: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = models["root"] / f"{name}.json"
    done = tracediff("compare", ref, cand, "--json", out, timeout=600)
    assert out.is_file(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def _keys(store: Path, tap: str, token: str = "token_id") -> set[tuple[str, int, int, int]]:
    """(client request id, drafter call, position, token) of every row of ``tap``."""
    from tracediff.store import open_store

    (stream,) = open_store(store).tap_streams(tap)
    lab, names = stream.labels(), dict(stream.seq_names)
    return {(names[int(s)], int(c), int(p), int(t)) for s, c, p, t in
            zip(lab["seq"], lab["step"], lab["position"], lab[token], strict=True)}


def test_the_server_records_every_chain_tap_labelled_like_its_drafter_rows(served) -> None:
    from tracediff.store import open_store

    store = served["a"]["store"]
    s = open_store(store)
    for step in range(K):
        for point in POINTS if step == 0 else POINTS[1:]:
            tap = _chain_tap(point, step)
            assert s.rows(tap), (tap, sorted(s.taps))
            (stream,) = s.tap_streams(tap)
            chain = stream.attrs["chain"]
            assert (chain["point"], chain["step"], chain["step_inputs"]) == (point, step, "proposed"), chain
            assert stream.attrs["compute_dtype"] == "float32"
    (fc,) = s.tap_streams("fc_in")
    assert fc.attrs["chain"]["point"] == "fc_in"
    fc_rows = _keys(store, "fc_in")
    # Step 0 runs on every row of a drafter call: the fc rows, with their labels.
    for point in ("fc_out", "layer_in", "layer_out", "norm_out"):
        assert _keys(store, _chain_tap(point, 0)) == fc_rows, point
    assert s.rows("draft_layer_in") == s.rows("fc_in")
    (layer_in,) = s.tap_streams("draft_layer_in")
    assert layer_in.segment_labels == ["embedding", "hidden_state"] and layer_in.attrs["segment_size"] == h.HIDDEN
    # Step 0's logits at every row too (vLLM samples the last valid row of each request: draft_steps' step 0
    # rows, whose token is the draft's input, the fc row's next token); step k >= 1 one row per request,
    # labelled as draft_steps labels that step: position p + k, token_id the step's input token.
    assert _keys(store, "draft_logits_topk") == fc_rows
    steps = _keys(store, "draft_steps")
    first = {(q, c, p, t) for q, c, p, t in steps if (q, c, p, t) in _keys(store, "draft_logits_topk", "next_token_id")}
    later = set().union(*(_keys(store, _chain_tap("logits_topk", k)) for k in range(1, K)))
    assert first | later == steps and first and later
    for k in range(1, K):
        assert _keys(store, _chain_tap("layer_in", k)) == _keys(store, _chain_tap("logits_topk", k)), k
    assert "draft chain (" not in served["a"]["log"]  # no hook of the chain failed


def test_a_rescaled_final_norm_weight_is_named_at_the_final_norm(models, served) -> None:
    done, report = _compare(models, served["a"]["store"], served["b"]["store"], "a_b")
    assert done.returncode == 1, done.stdout + done.stderr
    roots = [f for f in report["findings"] if f["kind"] == "draft_chain" and not f["evidence"].get("explained_by")]
    assert len(roots) == 1, [f["message"] for f in report["findings"]]
    assert (roots[0]["evidence"]["tap_candidate"], roots[0]["evidence"]["step"]) == ("draft_norm_out", 0)
    assert roots[0]["evidence"]["matched_before"] == ["fc_in", "draft_fc_out", "draft_layer_in", "draft_layer_out"]
    status = {(x["tap_candidate"], x["step"]): x["status"] for x in report["chain"]}
    assert status[("draft_norm_out", 0)] == "diverged"
    # The next step reads the state before the norm and the same proposals: it matches up to its own norm.
    assert (status[("draft_layer_in_s1", 1)], status[("draft_norm_out_s1", 1)]) == ("match", "diverged")
    assert "not_comparable" not in status.values()  # two servers: every step pairs


def test_a_final_norm_of_another_checkpoint_is_named_even_when_the_generations_part(models, served) -> None:
    """Other proposals, so other verified drafts: where the two servers' generated tokens part, the
    rows from there on are left out (a warning), never a tokens-missing root cause that hides the
    draft (it did: sequence_insertion, 'a chat-template difference', for this pair)."""
    done, report = _compare(models, served["a"]["store"], served["c"]["store"], "a_c")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [f for f in report["findings"] if f["severity"] == "error" and not f["evidence"].get("explained_by")]
    assert [(f["kind"], f["evidence"].get("tap_candidate")) for f in errors] == [("draft_chain", "draft_norm_out")], \
        [f["message"] for f in report["findings"]]
    assert all(f["severity"] == "warning" and f["evidence"]["kind"] == "generation"
               for f in report["findings"] if f["kind"] == "sequence_insertion")
    assert report["fix"]["how"] == "draft" and report["record_next"] is None


def test_the_same_draft_served_twice_matches_at_every_tap(models, served) -> None:
    done, report = _compare(models, served["a"]["store"], served["a_again"]["store"], "a_a")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["verdict"] == "match"
    taps = {(x["tap_candidate"], x["step"]): x["status"] for x in report["chain"]}
    assert {(_chain_tap(p, k), k) for k in range(K) for p in POINTS if k == 0 or p != "fc_out"} <= set(taps)
    assert set(taps.values()) == {"match"}, taps
    assert all(x["rows"] > 0 for x in report["chain"])


# ------------------------------------------------------------------------------- trainer vs server
def _speculators_draft(tl: Any, draft: Path) -> Any:
    """speculators' Eagle3DraftModel holding the vLLM draft's weights (its embedding the target's)."""
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    cfg = json.loads((draft / "config.json").read_text())
    layer = LlamaConfig(**{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                               "max_position_embeddings")},
                        num_hidden_layers=1, rope_theta=cfg["rope_theta"])
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg["draft_vocab_size"],
        eagle_aux_hidden_state_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config)
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(draft / "model.safetensors")).items()}
    weights["embed_tokens.weight"] = tl.model.model.embed_tokens.weight.detach().clone()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, (missing, unexpected)
    return model.eval()


@pytest.fixture(scope="module")
def trainer_chain(models: dict[str, Any]) -> Path:
    """The trainer's chain: speculators' draft with draft a's weights, two teacher-forced TTT steps over
    the served sequences (hidden states: the target's hs2, hs4, hs5 at p, input token x_{p+1})."""
    from conftest import skip_unless_installed

    skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")
    import torch

    from tracediff.adapters import speculators as speculators_adapter
    from tracediff.record.recorder import Recorder
    from tracediff.testing.tiny_llama import layer_states

    model = _speculators_draft(models["tl"], models["draft_a"])
    path = models["root"] / "trainer_chain.zarr"
    with Recorder(path, draft_chain=True, role="trainer") as rec, torch.no_grad():
        assert speculators_adapter.attach(rec, model)
        for seq in models["seqs"]:
            ids = torch.tensor(list(seq))
            states, _ = layer_states(models["tl"], ids)
            aux = torch.cat([states[name][0] for name in LAYERS], -1).float()
            n = ids.numel()
            model(hidden_states=aux[None, :-1], input_ids=ids[None, 1:], document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                  position_ids=torch.arange(1, n)[None], ttt_steps=2)
    return path


def test_a_trainer_chain_pairs_with_the_server_at_step_0_only(models, served, trainer_chain) -> None:
    done, report = _compare(models, trainer_chain, served["a"]["store"], "trainer_a")
    links = {(x["tap_reference"] or x["tap_candidate"], x["step"]): x for x in report["chain"]}
    step0 = [x for x in report["chain"] if x["step"] == 0]
    later = [x for x in report["chain"] if x["step"] >= 1 and x["tap_reference"] and x["tap_candidate"]]
    assert {x["tap_candidate"] for x in step0} >= {_chain_tap(p, 0) for p in POINTS}, links
    # Step 0: the same draft fed the same rows, judged (and, the weights being the same, matching).
    assert {x["tap_candidate"]: x["status"] for x in step0 if x["tap_candidate"] != "fc_in"} == {
        _chain_tap(p, 0): "match" for p in POINTS}, [(x["tap_candidate"], x["status"], x["found"]) for x in step0]
    assert all(x["rows"] > 0 for x in step0)
    # Step 1: the trainer reads the data's tokens, the server its own proposals: never judged.
    assert later and {x["status"] for x in later} == {"not_comparable"}
    assert {x["found"][0] for x in later} == {"step 1 of the candidate reads its own proposals, of the reference the "
                                              "data's tokens: only step 0 pairs"}
    assert not [f for f in report["findings"] if f["kind"] == "draft_chain"]
    assert "not_comparable: step 1 of the candidate reads its own proposals" in \
        tracediff("compare", trainer_chain, served["a"]["store"]).stdout.replace("\n  ", " ")
    assert done.returncode == 0, done.stdout + done.stderr
