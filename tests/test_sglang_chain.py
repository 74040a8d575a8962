"""The SGLang draft chain (``record --draft-chain`` with ``--adapter sglang``) on SGLang 0.5.23's real
EAGLE-3 draft ``LlamaForCausalLMEagle3``, run in this process on CPU.

Why in process: SGLang's server cannot run an EAGLE-3 draft on CPU. Its draft workers build their
attention backends from a map (``speculative/draft_utils.py``: ``create_decode_backend`` and
``create_draft_extend_backend``) that has no ``torch_native`` entry ("EAGLE is not supported in decode
attention backend torch_native"), and the CPU backend ``intel_amx`` needs ``sgl_kernel``, which has no
CPU build here. So the real model classes run as SGLang's layer tests run them (tests/sglang_harness.py):
the target ``LlamaForCausalLM`` prefills, the draft runs its draft-extend forward on the target's aux
states (the rotated input ids, as ``_draft_extend_for_prefill`` builds them), then draft decode forwards
the way ``EAGLEWorkerV2.draft_forward`` runs them: SGLang's own ``select_top_k_tokens`` picks each step's
input tokens and recycled hidden states from the previous forward's ``next_token_logits`` (through the
draft's ``hot_token_id``) and ``hidden_states``. The harness's attention has no KV cache: a decode row
attends to itself only (both sides of every pair here run the same harness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import skip_unless_installed

skip_unless_installed("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")

import sglang_harness as h  # noqa: E402
import torch  # noqa: E402

from tracediff.adapters import sglang as adapter  # noqa: E402
from tracediff.adapters._chain import POINTS  # noqa: E402
from tracediff.record.recorder import Recorder  # noqa: E402
from tracediff.store import open_store  # noqa: E402

LAYER_IDS = [1, 3, 4]
H, VOCAB, DRAFT_VOCAB = 32, 128, 64
STEPS = 3  # speculative_num_steps: the draft extend (step 0) and two draft decode forwards
#: Eight requests: a step >= 1 has one row per request, and compare's segment matching needs a few rows.
SEQS = [torch.randint(0, VOCAB, (5 + i % 4,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        for i in range(8)]
RIDS = [f"r{i}" for i in range(len(SEQS))]
#: SGLang's hot_token_id: draft id i -> target id HOT[i] (the draft's vocabulary: 64 of the target's 128)
HOT = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
SAMPLED = [11 * (i + 1) for i in range(len(SEQS))]  # the target's sampled token after each prompt


@pytest.fixture(scope="module", autouse=True)
def _sglang() -> None:
    h.init_sglang()


@pytest.fixture(autouse=True)
def _fresh_adapter_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each recording is a fresh server process as far as the adapter's per-process state goes."""
    monkeypatch.setattr(adapter, "_state", adapter._Process())


@pytest.fixture(scope="module")
def models():
    """The target as transformers runs it (the trainer's side) and as SGLang runs it (the server's)."""
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import LlamaForCausalLM as HFLlama

    config = h.llama_config(6, hidden=H, vocab=VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = HFLlama(config).eval()
    model = LlamaForCausalLM(config)
    model.load_weights(hf.state_dict().items())
    model.set_eagle3_layers_to_capture(LAYER_IDS)
    return hf, model


@pytest.fixture(scope="module")
def target(models):
    return models[1]


def make_draft(**change: object):
    """An EAGLE-3 draft with a 64-token draft vocabulary, its d2t loaded by SGLang's own load_weights;
    ``change``: ``norm_weight`` (the final norm's weight scaled) or config fields (``rope_theta``)."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    norm_scale = change.pop("norm_weight", None)
    theta = change.pop("rope_theta", None)
    config = h.llama_config(1, hidden=H, vocab=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": LAYER_IDS}, **change)
    if theta is not None:  # SGLang reads rope_parameters first (transformers 5 configs hold it)
        config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), "rope_type": "default",
                                  "rope_theta": float(theta)}
    draft = LlamaForCausalLMEagle3(config)
    h.init_params(draft, seed=1)
    hot = HOT
    draft.load_weights([("d2t", hot - torch.arange(DRAFT_VOCAB))])
    if norm_scale is not None:
        with torch.no_grad():
            draft.model.norm.weight.mul_(float(norm_scale))
    return draft


def serve_round(target, draft, topk: int = 1) -> torch.Tensor:
    """One prefill, its draft extend and the draft decode forwards of one speculative round."""
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    ids = torch.tensor([t for s in SEQS for t in s])
    lens = [len(s) for s in SEQS]
    out = h.run_model(target, h.forward_batch("EXTEND", ids, lens, RIDS))
    rotated = torch.tensor([t for s, x in zip(SEQS, SAMPLED, strict=True) for t in [*s[1:], x]])
    extend = h.forward_batch("EXTEND", rotated, lens, RIDS, capture="LAST",
                             spec_info=EagleDraftExtendInput(hidden_states=out.hidden_states, num_tokens_per_req=1,
                                                             num_tokens_for_logprob_per_req=1))
    logits = h.run_model(draft, extend)
    hidden, scores = logits.hidden_states, None
    topk_p, topk_index = torch.topk(torch.softmax(logits.next_token_logits, -1), topk, dim=-1)
    topk_index = draft.hot_token_id[topk_index]
    for i in range(STEPS):
        tokens, hidden, scores, _ = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        if i == STEPS - 1:
            break
        rows = tokens.numel()
        starts = [n + i for n in lens for _ in range(rows // len(lens))]  # each row at its own RoPE position
        batch = h.forward_batch("DECODE", tokens, [1] * rows, None, start_positions=starts, capture="LAST",
                                spec_info=EagleDraftInput(hidden_states=hidden))
        batch.batch_size, batch.rids = len(RIDS), list(RIDS)  # bs requests, topk tree nodes each
        logits = h.run_model(draft, batch)
        topk_p, topk_index = torch.topk(torch.softmax(logits.next_token_logits, -1), topk, dim=-1)
        topk_index = draft.hot_token_id[topk_index]
        hidden = logits.hidden_states
    return logits.next_token_logits


def record_server(path: Path, target, draft, topk: int = 1) -> Path:
    with Recorder(path, role="server", draft_chain=True) as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        serve_round(target, draft, topk)
    return path


def chain_tap(point: str, step: int) -> str:
    return "fc_in" if point == "fc_in" else f"draft_{point}" + (f"_s{step}" if step else "")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, target) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_chain")
    adapter._state = adapter._Process()
    out = {"a": record_server(root / "a.zarr", target, make_draft())}
    adapter._state = adapter._Process()
    out["a_again"] = record_server(root / "a_again.zarr", target, make_draft())
    adapter._state = adapter._Process()
    out["norm"] = record_server(root / "norm.zarr", target, make_draft(norm_weight=1.5))
    adapter._state = adapter._Process()
    out["rope"] = record_server(root / "rope.zarr", target, make_draft(rope_theta=1e6))
    return out


def test_every_chain_tap_is_recorded_with_the_fc_rows_labels_and_each_step_its_own(stores) -> None:
    with open_store(stores["a"]) as st:
        expected = {chain_tap(p, k) for k in range(STEPS) for p in POINTS if k == 0 or p not in ("fc_in", "fc_out")}
        assert expected <= set(st.taps), st.taps
        (fc,) = st.tap_streams("fc_in")
        fc_labels = fc.labels()
        for point in POINTS[1:]:
            (stream,) = st.tap_streams(chain_tap(point, 0))
            labels = stream.labels()
            for key in ("seq", "position", "token_id", "next_token_id", "valid", "phase"):
                assert labels[key].tolist() == fc_labels[key].tolist(), (point, key)
            assert stream.attrs["chain"] == {"name": "draft", "point": point, "order": POINTS.index(point),
                                             "step": 0, "step_inputs": "proposed"}
            assert "graph" in stream.attrs["graph_replay"]
        (step1,) = st.tap_streams("draft_layer_in_s1")
        labels = step1.labels()
        names = step1.seq_names
        assert [names[int(s)] for s in labels["seq"]] == RIDS
        assert labels["position"].tolist() == [len(s) for s in SEQS]
        assert step1.attrs["rows_per_request"] == 1 and step1.attrs["chain"]["step"] == 1
        assert step1.read_float32().shape == (len(SEQS), 2 * H)
        (top,) = st.tap_streams("draft_logits_topk_s1")
        row = top.read_float32()
        assert row.shape == (len(SEQS), 24)
        assert (row[:, 16:] == HOT[row[:, 8:16].astype(int)].numpy()).all()  # through SGLang's hot_token_id
        # step 2's input tokens are step 1's top-1 target ids
        (step2,) = st.tap_streams("draft_layer_in_s2")
        assert step2.labels()["token_id"].tolist() == row[:, 16].astype(int).tolist()
        # the final norm's two outputs: norm_out = RMSNorm(layer_out) with the draft's norm weight
        draft = make_draft()
        (out,), (normed,) = st.tap_streams("draft_layer_out"), st.tap_streams("draft_norm_out")
        with torch.no_grad():
            expect = draft.model.norm.forward_native(torch.from_numpy(out.read_float32()))
        assert torch.allclose(torch.from_numpy(normed.read_float32()), expect, atol=1e-5)


def test_a_tree_draft_records_one_row_per_request_and_tree_node(tmp_path: Path, target) -> None:
    store = record_server(tmp_path / "tree.zarr", target, make_draft(), topk=2)
    with open_store(store) as st:
        for step in (1, 2):
            (stream,) = st.tap_streams(f"draft_layer_in_s{step}")
            labels, names = stream.labels(), stream.seq_names
            assert [names[int(s)] for s in labels["seq"]] == [r for r in RIDS for _ in range(2)]
            assert labels["position"].tolist() == [len(s) + step - 1 for s in SEQS for _ in range(2)]
            assert stream.attrs["rows_per_request"] == 2 and stream.attrs["topk"] is None  # no server args here
            assert len(set(zip(labels["seq"].tolist(), labels["token_id"].tolist(), strict=True))) == 2 * len(SEQS)


def _compare(ref: Path, cand: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = cand.with_suffix(".json")
    env = dict(os.environ)
    env.pop("TRACEDIFF_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(ref), str(cand), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert out.is_file(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


@pytest.mark.slow
def test_the_same_draft_recorded_twice_matches_at_every_tap(stores) -> None:
    done, report = _compare(stores["a"], stores["a_again"])
    assert done.returncode == 0, done.stdout + done.stderr
    status = {(x["tap_candidate"], x["step"]): x["status"] for x in report["chain"]}
    assert {(chain_tap(p, k), k) for k in range(STEPS) for p in POINTS if k == 0 or p not in ("fc_in", "fc_out")} \
        <= set(status)
    assert set(status.values()) == {"match"}, status
    assert all(x["rows"] > 0 for x in report["chain"])


@pytest.mark.slow
def test_a_final_norm_weight_changed_in_the_draft_is_named_at_the_final_norm(stores) -> None:
    done, report = _compare(stores["a"], stores["norm"])
    assert done.returncode == 1, done.stdout + done.stderr
    roots = [f for f in report["findings"] if f["kind"] == "draft_chain" and not f["evidence"].get("explained_by")]
    assert len(roots) == 1, [f["message"] for f in report["findings"]]
    assert (roots[0]["evidence"]["tap_candidate"], roots[0]["evidence"]["step"]) == ("draft_norm_out", 0)
    assert roots[0]["evidence"]["matched_before"] == ["fc_in", "draft_fc_out", "draft_layer_in", "draft_layer_out"]
    status = {(x["tap_candidate"], x["step"]): x["status"] for x in report["chain"]}
    # The weight is scaled as a whole: the top-1 proposals agree, so each later step reads the same
    # tokens and the recycled pre-norm state, and matches up to its own final norm.
    assert status == {**{(chain_tap(p, k), k): "match" for k in range(STEPS) for p in POINTS
                         if k == 0 or p not in ("fc_in", "fc_out")},
                      **{(chain_tap("norm_out", k), k): "diverged" for k in range(STEPS)}}


@pytest.mark.slow
def test_a_rope_theta_changed_in_the_draft_is_named_at_the_decoder_layer(stores) -> None:
    done, report = _compare(stores["a"], stores["rope"])
    assert done.returncode == 1, done.stdout + done.stderr
    roots = [f for f in report["findings"] if f["kind"] == "draft_chain" and not f["evidence"].get("explained_by")]
    assert len(roots) == 1, [f["message"] for f in report["findings"]]
    assert (roots[0]["evidence"]["tap_candidate"], roots[0]["evidence"]["step"]) == ("draft_layer_out", 0)
    assert roots[0]["evidence"]["matched_before"] == ["fc_in", "draft_fc_out", "draft_layer_in"]


def test_record_accepts_the_sglang_adapter_with_draft_chain_and_names_the_graph_replay_limit(stores) -> None:
    done = subprocess.run([sys.executable, "-m", "tracediff", "record", "--adapter", "sglang", "--draft-chain", "-o",
                           str(stores["a"].parent / "cli.zarr"), "--", sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRACEDIFF_CONFIG"})
    assert "--draft-chain taps the draft of" not in done.stderr  # no usage error: it ran the command
    with open_store(stores["a"]) as st:
        taps = {tap: {"rows": 1, "writers": []} for tap in st.taps}
    server = ["python", "-m", "sglang.launch_server", "--speculative-algorithm", "EAGLE3",
              "--speculative-draft-model-path", "d", "--disable-radix-cache"]
    (warning,) = adapter.record_warnings(server, {"taps": taps})  # CUDA graphs on (a GPU, no flag)
    assert "draft decode forwards (steps >= 1)" in warning and "--disable-cuda-graph" in warning
    assert adapter.record_warnings([*server, "--disable-cuda-graph"], {"taps": taps}) == []
    no_chain = {tap: info for tap, info in taps.items() if not tap.startswith("draft_")}
    assert adapter.record_warnings(server, {"taps": no_chain}) == []


# ------------------------------------------------------------------------------- trainer vs server
def _checkpoint_drafts(root: Path, hf: Any) -> tuple[Any, Any]:
    """One EAGLE-3 checkpoint (tracediff.testing.eagle3) loaded by SGLang's ``load_weights`` and by
    speculators' ``Eagle3DraftModel``, both with the target's embedding (as SGLang's worker sets it)."""
    from safetensors.torch import load_file
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    from tracediff.testing.eagle3 import write_eagle3_draft

    spec = write_eagle3_draft(root / "draft", hf.config, LAYER_IDS, where="eagle_config", draft_vocab_size=DRAFT_VOCAB,
                              naming="layers.0", seed=5)
    weights = load_file(str(spec.path / "model.safetensors"))
    embed = hf.model.embed_tokens.weight.detach().clone()
    served = LlamaForCausalLMEagle3(LlamaConfig(**spec.config))
    served.load_weights(weights.items())
    with torch.no_grad():
        served.model.embed_tokens.weight.copy_(embed)
    cfg = spec.config
    layer = LlamaConfig(**{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                               "max_position_embeddings")},
                        num_hidden_layers=1, rope_theta=cfg["rope_theta"])
    layer._attn_implementation = "sdpa"
    trainer = Eagle3DraftModel(Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=LAYER_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))))
    missing, unexpected = trainer.load_state_dict({**weights, "embed_tokens.weight": embed}, strict=False)
    assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, (missing, unexpected)
    return served, trainer.eval()


@pytest.mark.slow
def test_the_trainers_chain_of_the_same_checkpoint_matches_sglangs_at_step_0_only(tmp_path: Path, models) -> None:
    skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")
    from tracediff.adapters import speculators as speculators_adapter

    hf, target = models
    served, trainer = _checkpoint_drafts(tmp_path, hf)
    server = record_server(tmp_path / "server.zarr", target, served)
    train = tmp_path / "train.zarr"
    with Recorder(train, draft_chain=True, role="trainer") as rec, torch.no_grad():
        assert speculators_adapter.attach(rec, trainer)
        for seq, sampled in zip(SEQS, SAMPLED, strict=True):
            ids = torch.tensor([*seq, sampled])  # the draft-extend rows: x_p at p, input x_{p+1}, the last sampled
            states = hf(ids[None], output_hidden_states=True).hidden_states
            aux = torch.cat([states[i + 1] for i in LAYER_IDS], -1)  # SGLang id i = HF hidden_states[i + 1]
            n = ids.numel()
            trainer(hidden_states=aux[:, :-1], input_ids=ids[None, 1:], document_ids=torch.zeros(1, n - 1, dtype=torch.long),
                    position_ids=torch.arange(1, n)[None], ttt_steps=2)
    done, report = _compare(train, server)
    step0 = {x["tap_candidate"]: x for x in report["chain"] if x["step"] == 0}
    assert {tap: x["status"] for tap, x in step0.items()} == {chain_tap(p, 0): "match" for p in POINTS}, \
        [(x["tap_candidate"], x["status"], x["found"]) for x in step0.values()]
    # every row but each sequence's first: speculators' trainer never sees x_0 (its input is ids[1:])
    assert {x["rows"] for x in step0.values()} == {sum(len(s) for s in SEQS) - len(SEQS)}
    later = [x for x in report["chain"] if x["step"] >= 1 and x["tap_reference"] and x["tap_candidate"]]
    assert later and {x["status"] for x in later} == {"not_comparable"}  # teacher forced against proposals
    assert not [f for f in report["findings"] if f["kind"] == "draft_chain"]
    assert done.returncode == 0, done.stdout + done.stderr


def test_draft_decode_rows_that_cannot_be_labelled_are_counted_lost_and_serving_goes_on(
        tmp_path: Path, target, monkeypatch: pytest.MonkeyPatch) -> None:
    from tracediff.adapters import sglang_chain

    expected = serve_round(target, make_draft())

    def moved(batch: object) -> None:
        raise AttributeError("'ForwardBatch' object has no attribute 'rids'")

    monkeypatch.setattr(sglang_chain, "request_keys", moved)  # SGLang internals moved (draft decode labels)
    with Recorder(tmp_path / "server.zarr", role="server", draft_chain=True) as rec:
        draft = make_draft()
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        got = serve_round(target, draft)
        assert rec.enabled and rec.error is None
    assert torch.equal(got, expected)
    taps = rec.outcome()["taps"]
    assert taps["draft_norm_out"]["rows"] == sum(len(s) for s in SEQS)  # step 0 labels come from the fc rows
    for step in (1, 2):
        for point in ("layer_in", "layer_out", "norm_out", "logits_topk"):
            outcome = taps[chain_tap(point, step)]
            assert (outcome["rows"], outcome["dropped_rows"]) == (0, len(SEQS)), (point, step, outcome)
            assert "not labelled after an error: AttributeError" in outcome["drop_reason"]
