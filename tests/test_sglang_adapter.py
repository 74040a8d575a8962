"""The sglang adapter on real SGLang 0.5.23 models run in this process (CPU, world-1 gloo group).

What it must get right, row by row: the draft's fc input in draft-extend forwards, labelled with the
token whose target state the row holds (x_p) and the draft's own (rotated) input token (x_{p+1});
the junk rows of DRAFT_EXTEND_V2 past num_accept_tokens marked invalid; the raw concatenation kept
beside the fc input when norm_before_fc changes it; the target's packed aux states equal to HF's
hidden_states at the indices SGLang's layer ids mean. And it must never break the server: internals
that moved are a logged skip, with the model's output unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import skip_unless_installed

skip_unless_installed("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")

import sglang_harness as h  # noqa: E402
import torch  # noqa: E402

from tracediff.adapters import sglang as adapter  # noqa: E402
from tracediff.adapters.sglang_labels import request_keys, wrap_init_new_for_rids  # noqa: E402
from tracediff.record.inject import recording_problems  # noqa: E402
from tracediff.record.recorder import Recorder  # noqa: E402
from tracediff.store import open_store  # noqa: E402

LAYER_IDS = [1, 3, 4]  # SGLang Llama config ids -> capture indices 2, 4, 5 = HF hidden_states[2], [4], [5]
HF_INDICES = [2, 4, 5]
H = 32


@pytest.fixture(scope="module", autouse=True)
def _sglang() -> None:
    h.init_sglang()


@pytest.fixture(autouse=True)
def _fresh_adapter_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a fresh server process as far as the adapter's per-process state goes."""
    monkeypatch.setattr(adapter, "_state", adapter._Process())


@pytest.fixture(scope="module")
def models():
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import LlamaForCausalLM as HFLlama

    config = h.llama_config(6, hidden=H)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = HFLlama(config).eval()
    target = LlamaForCausalLM(config)
    target.load_weights(hf.state_dict().items())
    target.set_eagle3_layers_to_capture(LAYER_IDS)
    return hf, target


def make_draft(seed: int = 1, eagle: dict | None = None, **top_level: object):
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    config = h.llama_config(1, hidden=H, draft_vocab_size=None,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": LAYER_IDS, **(eagle or {})}, **top_level)
    draft = LlamaForCausalLMEagle3(config)
    h.init_params(draft, seed)
    return draft


def draft_extend_input(hidden: torch.Tensor, **kw: object):
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    return EagleDraftExtendInput(hidden_states=hidden, num_tokens_for_logprob_per_req=1, **kw)


def read(store: Path, tap: str):
    with open_store(store) as st:
        (stream,) = st.tap_streams(tap)
        names = stream.seq_names
        labels = stream.labels()
        seq = [names.get(int(s), str(int(s))) for s in labels["seq"]]
        return stream.read_float32(), labels, seq, stream.attrs


SEQS = [[40, 92, 59, 37, 125, 58, 23], [120, 7, 82, 78, 17]]


def prefill(target, rids=("r0", "r1")):
    ids = torch.tensor([t for s in SEQS for t in s])
    batch = h.forward_batch("EXTEND", ids, [len(s) for s in SEQS], list(rids))
    return batch, h.run_model(target, batch)


# ------------------------------------------------------------------------------------------ target
def test_target_aux_states_equal_hf_hidden_states_at_the_capture_indices(tmp_path: Path, models) -> None:
    hf, target = models
    store = tmp_path / "server.zarr"
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target)
        _, out = prefill(target)
    values, labels, seq, attrs = read(store, "aux_hidden")

    assert values.shape == (12, 3 * H)
    assert torch.equal(torch.from_numpy(values), out.hidden_states)  # what the server hands the draft
    start = 0
    for s in SEQS:
        with torch.no_grad():
            hs = hf(torch.tensor([s]), output_hidden_states=True).hidden_states
        expected = torch.cat([hs[i][0] for i in HF_INDICES], -1)
        torch.testing.assert_close(torch.from_numpy(values[start:start + len(s)]), expected, rtol=0, atol=1e-5)
        start += len(s)
    assert seq == ["r0"] * 7 + ["r1"] * 5
    assert labels["position"].tolist() == list(range(7)) + list(range(5))
    assert labels["token_id"].tolist() == SEQS[0] + SEQS[1]
    assert labels["next_token_id"].tolist() == SEQS[0][1:] + [-1] + SEQS[1][1:] + [-1]
    assert labels["valid"].all()
    assert attrs["segment_labels"] == ["hs2", "hs4", "hs5"] and attrs["segment_size"] == H
    meta = attrs["meta"]["sglang"]
    assert meta["sglang_version"] == "0.5.23"
    assert meta["target"]["layers_to_capture"] == [2, 4, 5]
    assert meta["layers_to_capture"] == [2, 4, 5]
    assert attrs["source"]["framework"] == "sglang"


def test_logits_processor_attached_while_its_model_is_built_finds_its_model(tmp_path: Path) -> None:
    """What `tracediff record` does: the LogitsProcessor is watched; its model is the one building it."""
    from sglang.srt.models.llama import LlamaForCausalLM

    class Built(LlamaForCausalLM):
        def __init__(self, config, rec):
            super().__init__(config)
            self.attached = adapter.attach(rec, self.logits_processor)

    store = tmp_path / "server.zarr"
    with Recorder(store, role="server") as rec:
        model = Built(h.llama_config(6, hidden=H), rec)
        h.init_params(model, 3)
        model.set_eagle3_layers_to_capture([0, 2])
        assert model.attached
        prefill(model)
    _, _, _, attrs = read(store, "aux_hidden")
    assert attrs["meta"]["sglang"]["target"]["layers_to_capture"] == [1, 3]
    assert attrs["segment_labels"] == ["hs1", "hs3"]


# ------------------------------------------------------------------------------------------- draft
def test_draft_fc_input_after_prefill_is_labelled_with_its_own_token_and_the_rotated_input(
        tmp_path: Path, models) -> None:
    _, target = models
    draft = make_draft()
    store = tmp_path / "server.zarr"
    sampled = [11, 22]
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        batch, out = prefill(target)
        # SGLang's _draft_extend_for_prefill: input_ids rotated left by one, the sampled token last.
        rotated = torch.tensor(SEQS[0][1:] + sampled[:1] + SEQS[1][1:] + sampled[1:])
        dbatch = h.forward_batch("EXTEND", rotated, [7, 5], ["r0", "r1"],
                                 spec_info=draft_extend_input(out.hidden_states, num_tokens_per_req=1), capture="LAST")
        h.run_model(draft, dbatch)
    values, labels, seq, attrs = read(store, "fc_in")

    assert torch.equal(torch.from_numpy(values), out.hidden_states)  # no norm before fc: fc sees the raw rows
    assert labels["token_id"].tolist() == SEQS[0] + SEQS[1]  # x_p: the hidden state's own token
    assert labels["next_token_id"].tolist() == rotated.tolist()  # x_{p+1}: the draft's input token
    assert labels["position"].tolist() == list(range(7)) + list(range(5))
    assert seq == ["r0"] * 7 + ["r1"] * 5
    assert labels["valid"].all()
    assert attrs["in_features"] == 3 * H and attrs["segment_labels"] == ["hs2", "hs4", "hs5"]
    draft_meta = attrs["meta"]["sglang"]["draft"]
    assert draft_meta["aux_layer_ids"] == LAYER_IDS
    assert draft_meta["aux_layer_ids_source"] == "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    with open_store(store) as st:
        assert "fc_in_raw" not in st.taps  # nothing differs from the fc input


def test_draft_extend_v2_rows_past_num_accept_tokens_are_marked_invalid(tmp_path: Path, models) -> None:
    _, target = models
    draft = make_draft()
    store = tmp_path / "server.zarr"
    nd = 3  # num_draft_tokens: every request has nd rows, only num_accept_tokens of them are real
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        # TARGET_VERIFY of two chains: root token (the last bonus) then the draft's proposals.
        verify_ids = torch.tensor([5, 6, 7, 8, 9, 10])
        vbatch = h.forward_batch("TARGET_VERIFY", verify_ids, [nd, nd], ["r0", "r1"], start_positions=[10, 4])
        out = h.run_model(target, vbatch)
        accept = torch.tensor([2, 1])  # r0 accepted token 6, r1 none
        predict = torch.tensor([6, 7, 99, 9, 98, 97])  # target's next token after each row; junk past accept
        dbatch = h.forward_batch(
            "DRAFT_EXTEND_V2", predict, [nd, nd], ["r0", "r1"], start_positions=[10, 4],
            spec_info=draft_extend_input(out.hidden_states, num_accept_tokens=accept, num_correct_drafts=accept - 1,
                                         num_tokens_per_req=nd))
        h.run_model(draft, dbatch)
    values, labels, seq, _ = read(store, "fc_in")
    assert labels["valid"].tolist() == [True, True, False, True, False, False]
    ok = labels["valid"]
    assert labels["position"][ok].tolist() == [10, 11, 4]
    assert labels["token_id"][ok].tolist() == [5, 6, 8]
    assert labels["next_token_id"][ok].tolist() == [6, 7, 9]
    assert [s for s, v in zip(seq, ok, strict=True) if v] == ["r0", "r0", "r1"]
    assert PHASE(labels) == {"draft_extend"}
    _, vlabels, _, _ = read(store, "aux_hidden")
    # Verify rows past each request's root are proposals whose acceptance is not known yet.
    assert vlabels["valid"].tolist() == [True, False, False, True, False, False]
    assert torch.equal(torch.from_numpy(values), out.hidden_states)


def PHASE(labels) -> set[str]:  # noqa: N802
    from tracediff.store import PHASES

    return {PHASES[int(c)] for c in labels["phase"]}


@pytest.mark.parametrize("norm", ["norm_before_fc", "fc_norm"])
def test_a_norm_before_fc_keeps_both_the_raw_concatenation_and_the_fc_input(tmp_path: Path, models, norm: str) -> None:
    _, target = models
    draft = make_draft(eagle={"norm_before_fc": True}) if norm == "norm_before_fc" else make_draft(fc_norm=True)
    store = tmp_path / "server.zarr"
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        _, out = prefill(target)
        rotated = torch.tensor(SEQS[0][1:] + [1] + SEQS[1][1:] + [2])
        dbatch = h.forward_batch("EXTEND", rotated, [7, 5], ["r0", "r1"],
                                 spec_info=draft_extend_input(out.hidden_states, num_tokens_per_req=1), capture="LAST")
        h.run_model(draft, dbatch)
    fc, fc_labels, _, attrs = read(store, "fc_in")
    raw, raw_labels, _, _ = read(store, "fc_in_raw")
    assert torch.equal(torch.from_numpy(raw), out.hidden_states)
    with torch.no_grad():
        if norm == "norm_before_fc":
            expected = draft.model.input_norm(out.hidden_states)
        else:
            chunks = out.hidden_states.chunk(3, dim=-1)
            expected = torch.cat([n(c) for n, c in zip(draft.model.fc_norm, chunks, strict=True)], -1)
    torch.testing.assert_close(torch.from_numpy(fc), expected)
    assert not np.allclose(fc, raw)
    assert fc_labels["token_id"].tolist() == raw_labels["token_id"].tolist() == SEQS[0] + SEQS[1]
    assert attrs["meta"]["sglang"]["draft"][norm] is True


def test_sglang_loads_the_plugin_entry_point_gated_by_its_variable(tmp_path: Path) -> None:
    """Servers launched by other tooling: SGLang's plugin loader activates tracediff in each process."""
    import subprocess
    import sys

    store = tmp_path / "server.zarr"
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from tracediff.record.inject import current_config; print(current_config()['adapters'])")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRACEDIFF_CONFIG"}
    env.update(TRACEDIFF_SGLANG_STORE=str(store), SGLANG_PLUGINS="tracediff")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['sglang']"
    assert (store / "zarr.json").is_file()


def test_draft_decode_forwards_are_not_recorded(tmp_path: Path, models) -> None:
    """Draft decode rows are the draft's own hidden states (width H): fc is not applied to them."""
    draft = make_draft()
    store = tmp_path / "server.zarr"
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, draft)
        batch = h.forward_batch("EXTEND", torch.tensor([3, 4]), [1, 1], ["r0", "r1"],
                                spec_info=draft_extend_input(torch.randn(2, H), num_tokens_per_req=1), capture="LAST")
        h.run_model(draft, batch)
    assert adapter.capture_summary()["fc_in"]["calls"] == 0
    with open_store(store) as st:
        assert st.taps == []


# ------------------------------------------------------------------------------ never break the server
def test_internals_that_moved_are_a_logged_skip_and_the_output_is_unchanged(
        tmp_path: Path, models, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _, target = models
    _, expected = prefill(target)

    def moved(*args: object, **kwargs: object) -> None:
        raise AttributeError("'ForwardBatch' object has no attribute 'extend_seq_lens_cpu'")

    monkeypatch.setattr(adapter, "rows_per_request", moved)
    store = tmp_path / "server.zarr"
    with caplog.at_level(logging.WARNING, logger="tracediff"), Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target)
        _, out = prefill(target)
        _, again = prefill(target)
        assert rec.enabled and rec.error is None  # the recorder itself goes on
    assert torch.equal(out.hidden_states, expected.hidden_states)
    assert torch.equal(again.next_token_logits, expected.next_token_logits)
    messages = [r.getMessage() for r in caplog.records if "aux_hidden not recorded" in r.getMessage()]
    assert len(messages) == 1 and "extend_seq_lens_cpu" in messages[0]
    assert adapter.capture_summary()["aux_hidden"]["skipped"]
    # The rows SGLang computed and the adapter could not record are lost and counted: what the recorder
    # tells `tracediff record`, which then ends non-zero (not 0 with an empty tap).
    _assert_counted_lost(rec, "aux_hidden", recorded=0, lost=2 * sum(len(s) for s in SEQS),
                         why="not recorded after an error: AttributeError")


def _assert_counted_lost(rec: Recorder, tap: str, recorded: int, lost: int, why: str) -> None:
    outcome = rec.outcome()["taps"][tap]
    assert (outcome["rows"], outcome["dropped_rows"]) == (recorded, lost), outcome
    assert why in outcome["drop_reason"], outcome
    problems = recording_problems([{"kind": "recorder", "pid": 1, **rec.outcome()}])
    assert any(tap in p and str(lost) in p for p in problems), problems


def test_aux_states_in_a_container_the_adapter_cannot_read_are_counted_lost(
        tmp_path: Path, models, monkeypatch: pytest.MonkeyPatch) -> None:
    _, target = models
    _, expected = prefill(target)
    with Recorder(tmp_path / "server.zarr", role="server") as rec:
        assert adapter.attach(rec, target)
        prefill(target)  # recorded
        monkeypatch.setattr(adapter, "pack_aux", lambda aux: None)  # an SGLang whose aux container is new
        _, out = prefill(target)
    assert torch.equal(out.next_token_logits, expected.next_token_logits)  # the server is untouched
    tokens = sum(len(s) for s in SEQS)
    _assert_counted_lost(rec, "aux_hidden", recorded=tokens, lost=tokens,
                         why=f"aux_hidden_states held not a tensor or a list of tensors for {tokens} tokens")


def test_a_logits_processor_without_aux_hidden_states_is_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class LogitsProcessor(torch.nn.Module):  # an SGLang whose processor no longer takes aux states
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata):
            return hidden_states

    LogitsProcessor.__module__ = "sglang.srt.layers.logits_processor"
    with caplog.at_level(logging.WARNING, logger="tracediff"), Recorder(tmp_path / "s.zarr") as rec:
        assert adapter.attach(rec, LogitsProcessor()) is False
    assert any("has no aux_hidden_states argument" in r.getMessage() for r in caplog.records)


def test_other_attention_tp_ranks_are_not_recorded_unless_all_ranks(
        tmp_path: Path, models, monkeypatch: pytest.MonkeyPatch) -> None:
    _, target = models
    monkeypatch.setattr(adapter, "_attention_tp_rank", lambda: (1, 2))
    with Recorder(tmp_path / "a.zarr") as rec:
        assert adapter.attach(rec, target) is False
    monkeypatch.setenv(adapter.ENV_ALL_RANKS, "1")
    with Recorder(tmp_path / "b.zarr") as rec:
        assert adapter.attach(rec, make_draft())
        assert rec.rank == 1 and rec.world_size == 2
        assert rec.writer_name.startswith("attn-tp1-")


def test_versions_without_forward_batch_rids_take_request_ids_from_the_schedule_batch() -> None:
    class Req:
        def __init__(self, rid: str) -> None:
            self.rid = rid

    class ScheduleBatch:
        reqs = [Req("a"), Req("b")]

    class OldForwardBatch:
        @classmethod
        def init_new(cls, batch, model_runner):
            return cls()

    assert wrap_init_new_for_rids(OldForwardBatch)
    made = OldForwardBatch.init_new(ScheduleBatch(), None)
    assert made._tracediff_rids == ["a", "b"]
    assert request_keys(made) == ["a", "b"]


@pytest.mark.parametrize(("map_kind", "expected"), [("offsets", "offsets"), ("absolute", "absolute ids")])
def test_the_drafts_d2t_as_sglang_loaded_it_is_in_the_provenance(tmp_path: Path, models, map_kind: str,
                                                                  expected: str) -> None:
    _, target = models
    draft = make_draft()
    kept = torch.tensor([0, 1, 2, 5, 6, 9, 40, 41, 99, 127])  # the target ids a 10-token draft vocabulary keeps
    d2t = kept - torch.arange(kept.numel()) if map_kind == "offsets" else kept
    draft.load_weights([("d2t", d2t)])  # SGLang's own loader: hot_token_id = d2t + arange
    store = tmp_path / "server.zarr"
    with Recorder(store, role="server") as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        _, out = prefill(target)
        rotated = torch.tensor(SEQS[0][1:] + [11] + SEQS[1][1:] + [22])
        dbatch = h.forward_batch("EXTEND", rotated, [7, 5], ["r0", "r1"],
                                 spec_info=draft_extend_input(out.hidden_states, num_tokens_per_req=1), capture="LAST")
        h.run_model(draft, dbatch)
    _, _, _, attrs = read(store, "fc_in")
    facts = attrs["meta"]["sglang"]["draft"]["d2t"]
    assert facts["present"] and facts["size"] == 10 and facts["kind"] == expected
    # compare reads it from the recorded provenance, with no draft to replay.
    from tracediff.compare import compare_stores

    report = compare_stores(store, store)
    vocab = [f for f in report.findings if f.kind == "draft_vocabulary"]
    if map_kind == "absolute":
        assert vocab and all(f.severity == "error" and "d2t is absolute ids" in f.message for f in vocab)
    else:
        assert not vocab
