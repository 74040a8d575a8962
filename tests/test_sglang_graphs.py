"""The sglang adapter's graph-replay path: rows of forwards SGLang replays from a CUDA graph, read from
the tensors its graph runners receive and return (tracediff.adapters.sglang_graphs).

No graph path runs on CPU in SGLang 0.5.23 (``CPUGraphRunner`` asserts ``spec_algorithm.is_none()`` and
needs the CPU kernel package), so a replay is stood in for here: SGLang's real runner classes
(``DecodeCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``) get, in place of their CUDA
``execute``, a function that runs the real model with every Python forward hook suppressed (what a graph
replay does: the kernels run, no hook fires), pads rows to a graph size where SGLang does, and returns
what SGLang's ``execute`` returns. The adapter wraps that ``execute`` as it wraps the real one. Rows go to
real zarr stores and are compared with a run whose forwards all ran eagerly under the module hooks.
What needs a GPU (real capture and replay, the async copy) is benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import invoke_tracediff, skip_unless_installed

skip_unless_installed("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")

import sglang_harness as h  # noqa: E402
import torch  # noqa: E402

from tracediff.adapters import sglang as adapter  # noqa: E402
from tracediff.adapters import sglang_graphs  # noqa: E402
from tracediff.record.recorder import Recorder  # noqa: E402
from tracediff.store import PHASES, open_store  # noqa: E402

LAYER_IDS = [1, 3, 4]
H = 32
SEQS = [[40, 92, 59, 37, 125, 58, 23], [120, 7, 82, 78, 17]]
ND = 3  # draft tokens per request in a verify


@pytest.fixture(scope="module", autouse=True)
def _sglang() -> None:
    h.init_sglang()


@pytest.fixture(autouse=True)
def _fresh_adapter_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_state", adapter._Process())


@pytest.fixture(scope="module")
def target():
    from sglang.srt.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(h.llama_config(6, hidden=H))
    h.init_params(model, 0)
    model.set_eagle3_layers_to_capture(LAYER_IDS)
    return model


def make_draft(**eagle: object):
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    config = h.llama_config(1, hidden=H, draft_vocab_size=None,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": LAYER_IDS, **eagle})
    draft = LlamaForCausalLMEagle3(config)
    h.init_params(draft, 1)
    return draft


def extend_input(hidden: torch.Tensor, **kw: object):
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    return EagleDraftExtendInput(hidden_states=hidden, num_tokens_for_logprob_per_req=1, **kw)


# ------------------------------------------------------------------ a graph replay, stood in for on CPU
def run_without_hooks(model: torch.nn.Module, batch) -> object:
    """The model's kernels with no Python forward hook: what a CUDA-graph replay runs."""
    saved = {m: m._forward_pre_hooks for m in model.modules()}
    for m in saved:
        m._forward_pre_hooks = OrderedDict()
    try:
        return h.run_model(model, batch)
    finally:
        for m, hooks in saved.items():
            m._forward_pre_hooks = hooks


def target_replay(runner, forward_batch, pp_proxy_tensors=None, *, pad_to: int = 0, hooks: bool = False):
    """DecodeCudaGraphRunner.execute: the replay's outputs cut to the batch's rows (``pad_to`` > 0: the
    cut left out, as a runner that hands back a padded graph's rows would)."""
    run = h.run_model if hooks else run_without_hooks
    out = run(runner.model_runner.model, forward_batch)
    if pad_to:
        junk = torch.full((pad_to - out.hidden_states.shape[0], out.hidden_states.shape[1]), 7.0)
        out = dataclasses.replace(out, hidden_states=torch.cat([out.hidden_states, junk]))
    return out


def draft_extend_replay(runner, forward_batch, select_index):
    """EAGLEDraftExtendCudaGraphRunner.execute: replays, then (graph bs > raw bs) rebinds spec_info's
    accept counts to its padded buffers, as SGLang does."""
    out = run_without_hooks(runner.model_runner.model, forward_batch)
    forward_batch.spec_info.num_accept_tokens = torch.full((4,), ND)
    return out


@pytest.fixture
def runners(monkeypatch: pytest.MonkeyPatch, target):
    """SGLang's real runner classes, their CUDA replay stood in for by the functions above."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    monkeypatch.setattr(DecodeCudaGraphRunner, "execute", target_replay)
    monkeypatch.setattr(EAGLEDraftExtendCudaGraphRunner, "execute", draft_extend_replay)

    def make(draft):
        verify = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
        verify.model_runner = SimpleNamespace(is_draft_worker=False, model=target)
        extend = EAGLEDraftExtendCudaGraphRunner.__new__(EAGLEDraftExtendCudaGraphRunner)
        extend.model_runner = SimpleNamespace(is_draft_worker=True, model=draft)
        return verify, extend

    return make


def serve(target, draft, verify_runner=None, extend_runner=None, **replay_kw) -> None:
    """One request round of an EAGLE-3 server: prefill, its draft extend, a verify, its draft extend
    (DRAFT_EXTEND_V2), and a plain decode; verify / draft extend / decode replayed when runners are given."""
    ids = torch.tensor([t for s in SEQS for t in s])
    batch = h.forward_batch("EXTEND", ids, [len(s) for s in SEQS], ["r0", "r1"])
    out = h.run_model(target, batch)
    rotated = torch.tensor(SEQS[0][1:] + [11] + SEQS[1][1:] + [22])
    h.run_model(draft, h.forward_batch("EXTEND", rotated, [7, 5], ["r0", "r1"], capture="LAST",
                                       spec_info=extend_input(out.hidden_states, num_tokens_per_req=1)))
    vbatch = h.forward_batch("TARGET_VERIFY", torch.tensor([11, 6, 7, 22, 9, 10]), [ND, ND], ["r0", "r1"],
                             start_positions=[7, 5])
    vout = verify_runner.execute(vbatch, **replay_kw) if verify_runner else h.run_model(target, vbatch)
    accept = torch.tensor([2, 1])
    dbatch = h.forward_batch("DRAFT_EXTEND_V2", torch.tensor([6, 7, 99, 9, 98, 97]), [ND, ND], ["r0", "r1"],
                             start_positions=[7, 5],
                             spec_info=extend_input(vout.hidden_states[:2 * ND], num_accept_tokens=accept,
                                                    num_correct_drafts=accept - 1, num_tokens_per_req=ND))
    if extend_runner:
        extend_runner.execute(dbatch, torch.arange(2))
    else:
        h.run_model(draft, dbatch)
    decode = h.forward_batch("DECODE", torch.tensor([7, 9]), [1, 1], ["r0", "r1"], start_positions=[9, 6])
    if verify_runner:
        verify_runner.execute(decode, **replay_kw)
    else:
        h.run_model(target, decode)


def read(store: Path, tap: str):
    with open_store(store) as st:
        (stream,) = st.tap_streams(tap)
        labels = stream.labels()
        seq = [stream.seq_names.get(int(s), str(int(s))) for s in labels["seq"]]
        return stream.read_float32(), labels, seq, stream.attrs


def phases(labels) -> set[str]:
    return {PHASES[int(c)] for c in labels["phase"]}


def record(path: Path, target, draft, *replay, **replay_kw) -> Recorder:
    """One server process's recording (fresh adapter state; the fixture restores the original)."""
    adapter._state = adapter._Process()
    with Recorder(path, role="server") as rec:
        assert adapter.attach(rec, target) and adapter.attach(rec, draft)
        serve(target, draft, *replay, **replay_kw)
    return rec


# ------------------------------------------------------------------------------------------- tests
def test_replayed_verify_decode_and_draft_extend_rows_equal_a_run_with_graphs_off(
        tmp_path: Path, target, runners) -> None:
    draft = make_draft()
    eager, graphs = tmp_path / "eager.zarr", tmp_path / "graphs.zarr"
    record(eager, target, draft)
    record(graphs, target, draft, *runners(draft))

    for tap, expected in (("aux_hidden", {"prefill", "verify", "decode"}), ("fc_in", {"draft_extend"})):
        e_values, e_labels, e_seq, _ = read(eager, tap)
        g_values, g_labels, g_seq, attrs = read(graphs, tap)
        assert phases(g_labels) == expected
        assert (g_values == e_values).all() and g_seq == e_seq
        for name in ("token_id", "next_token_id", "position", "valid", "phase", "step"):
            assert g_labels[name].tolist() == e_labels[name].tolist(), name
        assert set(attrs["capture_path"]) >= {"module_hook", "graph_replay"}
    # DRAFT_EXTEND_V2's invalid rows were read before the runner rebound num_accept_tokens to its buffers.
    _, labels, _, _ = read(graphs, "fc_in")
    assert labels["valid"].tolist()[-6:] == [True, True, False, True, False, False]
    summary = adapter.capture_summary()
    assert summary["aux_hidden"]["graph_replay_rows"] == 2 * ND + 2  # verify + decode, not the prefill
    assert summary["fc_in"]["graph_replay_rows"] == 2 * ND
    result = invoke_tracediff("compare", str(eager), str(graphs), "--tap", "fc_in")
    assert result.returncode == 0, result.stdout + result.stderr


def test_padded_replay_rows_past_the_batch_are_not_recorded(tmp_path: Path, target, runners) -> None:
    draft = make_draft()
    verify, extend = runners(draft)
    record(tmp_path / "graphs.zarr", target, draft, verify, extend)
    record(tmp_path / "p.zarr", target, draft, verify, extend, pad_to=8)  # graph batch: 8 rows for 6 / 2
    values, labels, _, _ = read(tmp_path / "p.zarr", "aux_hidden")
    reference, _, _, _ = read(tmp_path / "graphs.zarr", "aux_hidden")
    assert values.shape == reference.shape and (values == reference).all()
    assert not (values == 7.0).all(axis=1).any()


def test_a_forward_whose_hooks_fired_inside_the_runner_is_recorded_once(tmp_path: Path, target, runners) -> None:
    draft = make_draft()
    verify, extend = runners(draft)
    record(tmp_path / "eager.zarr", target, draft)
    # e.g. a piecewise graph that runs the logits processor eagerly: the hooks record, the replay path not
    record(tmp_path / "both.zarr", target, draft, verify, extend, hooks=True)
    values, labels, _, _ = read(tmp_path / "both.zarr", "aux_hidden")
    expected, e_labels, _, _ = read(tmp_path / "eager.zarr", "aux_hidden")
    assert values.shape == expected.shape and (values == expected).all()
    assert labels["step"].tolist() == e_labels["step"].tolist()
    assert adapter.capture_summary()["aux_hidden"].get("graph_replay_rows", 0) == 0


def test_a_replay_that_returns_no_aux_states_counts_its_rows_lost_and_names_the_flag(
        tmp_path: Path, target, runners, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    draft = make_draft()
    verify, extend = runners(draft)

    def no_aux(runner, forward_batch, pp_proxy_tensors=None):
        out = target_replay(runner, forward_batch)
        if forward_batch.forward_mode.name != "DECODE":
            return out
        return dataclasses.replace(out, hidden_states=None)  # a decode replay whose capture mode was NULL

    monkeypatch.setattr(DecodeCudaGraphRunner, "execute", no_aux)
    rec = record(tmp_path / "s.zarr", target, draft, verify, extend)
    outcome = rec.outcome()["taps"]["aux_hidden"]
    assert outcome["rows"] == 12 + 2 * ND and outcome["dropped_rows"] == 2
    assert "inside a graph replay" in outcome["drop_reason"]
    desc = {"taps": {"aux_hidden": {"rows": outcome["rows"], "writers": [outcome]},
                     "fc_in": {"rows": 18, "writers": []}}}
    command = ["python", "-m", "sglang.launch_server", "--speculative-algorithm", "EAGLE3",
               "--speculative-draft-model-path", "d", "--disable-radix-cache"]
    (warning,) = adapter.record_warnings(command, desc)
    assert "2 rows of aux_hidden" in warning and "--disable-cuda-graph" in warning


def test_norm_before_fc_inside_a_replay_keeps_the_raw_rows_and_counts_the_fc_input_lost(
        tmp_path: Path, target, runners) -> None:
    draft = make_draft(norm_before_fc=True)
    rec = record(tmp_path / "s.zarr", target, draft, *runners(draft))
    values, labels, _, _ = read(tmp_path / "s.zarr", "fc_in_raw")
    assert phases(labels) == {"draft_extend"} and values.shape[0] == 12 + 2 * ND
    outcome = rec.outcome()["taps"]["fc_in"]
    assert outcome["rows"] == 12 and outcome["dropped_rows"] == 2 * ND  # the prefill's draft extend ran eagerly
    assert "inside a graph replay" in outcome["drop_reason"] and "fc_in_raw" in outcome["drop_reason"]


def test_a_failing_replay_path_never_raises_into_sglang_and_counts_the_rows_lost(
        tmp_path: Path, target, runners, monkeypatch: pytest.MonkeyPatch) -> None:
    draft = make_draft()

    def moved(*args: object, **kwargs: object):
        raise RuntimeError("spec_info moved")

    monkeypatch.setattr(sglang_graphs, "draft_labels", moved)
    verify, extend = runners(draft)
    rec = record(tmp_path / "s.zarr", target, draft, verify, extend)  # no exception reaches the caller
    outcome = rec.outcome()["taps"]["fc_in"]
    assert outcome["rows"] == 12 and outcome["dropped_rows"] == 2 * ND
    assert "spec_info moved" in outcome["drop_reason"]
    assert adapter.capture_summary()["fc_in"]["skipped"] == "RuntimeError: spec_info moved"


def test_sglangs_graph_runner_classes_are_wrapped_once() -> None:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    before = sglang_graphs.install_replay_wrappers(lambda: None)
    first = DecodeCudaGraphRunner.execute
    assert sglang_graphs.install_replay_wrappers(lambda: None) == before >= 3
    assert DecodeCudaGraphRunner.execute is first and getattr(first, "_tracediff_graph_replay", False)
    assert getattr(EAGLEDraftExtendCudaGraphRunner.execute, "_tracediff_graph_replay", False)
