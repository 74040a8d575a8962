"""compare at real depth: the noise model tells numerics from a neighbouring layer on 32-61 layer models.

Real EAGLE-3 targets have 32-80 layers and the draft reads layers near the top (SGLang's default
capture [2, L//2, L-3]). There, bf16 drift grows far slower than linearly with depth while
neighbouring layers stay far apart (docs/noise-model.md): a budget linear in depth called a wrong
layer "same". Every trace here is recorded with the real recorder from a real transformers model of
each architecture (random weights, massive activations) at a real target's depth; the reference is
an fp32 trainer, candidates are engine-order bf16 runs (ragged prefill, KV-cache decode), each
with one fault or none.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import tracediff
from tracediff.compare import compare_stores
from tracediff.testing.models import ARCHITECTURES, DEEP_LAYERS, build_deep_model, server_model, sglang_default_layers
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, make_sequences

# Deep models (32-61 layers, four architectures): minutes on 2 cores; CI runs them.
pytestmark = pytest.mark.slow


def _ids(layers: list[str], num_layers: int) -> list[int]:
    return [num_layers if n == "pre_norm" else int(n[2:]) for n in layers]


def _server_meta(layers: list[str], num_layers: int, dtype: str = "bfloat16") -> dict:
    """What an SGLang server records: its ids (output of layer j, -1 = embedding) and its server args."""
    return {"aux_layers": {"ids": [i - 1 for i in _ids(layers, num_layers)], "convention": "sglang",
                           "framework": "sglang", "field": "eagle_config.eagle_aux_hidden_state_layer_ids"},
            "num_hidden_layers": num_layers, "server_args": {"dtype": dtype}}


def _trainer_meta(layers: list[str], num_layers: int) -> dict:
    return {"aux_layers": {"ids": _ids(layers, num_layers), "convention": "capture"}, "num_hidden_layers": num_layers,
            "compute_dtype": "float32"}


def _shift(layers: list[str], slots: set[int], by: int = -1) -> list[str]:
    return [f"hs{int(n[2:]) + by}" if k in slots else n for k, n in enumerate(layers)]


def _recorder(stack: contextlib.ExitStack, path: Path, model, layers: list[str], meta: dict):
    """A recorder of ``path`` (open until ``stack`` closes) tapping a fresh draft's fc: the draft, the
    labels callback a runner takes, the recorder."""
    draft = DraftHead(model.hidden_size, len(layers))
    rec = stack.enter_context(tracediff.record(path, role=path.stem, meta=meta, on_full="block"))
    rec.tap(draft.fc, "fc_in", segment_size=model.hidden_size)
    return draft, lambda lab: rec.labels(**lab), rec


def _record(path: Path, runner, model, layers: list[str], meta: dict, seqs, dtype, **kw) -> Path:
    with contextlib.ExitStack() as stack:
        draft, on_batch, rec = _recorder(stack, path, model, layers, meta)
        runner(model, draft, seqs, layers, dtype=dtype, on_batch=on_batch, **kw)
    assert rec.error is None
    return path


@pytest.fixture(scope="module", params=ARCHITECTURES)
def deep(request, tmp_path_factory: pytest.TempPathFactory) -> dict:
    arch = request.param
    num_layers = DEEP_LAYERS[arch]
    root = tmp_path_factory.mktemp(f"deep-{arch}")
    trainer = build_deep_model(arch)
    bf16 = server_model(trainer, "bf16")
    seqs = make_sequences(n_seqs=4, min_len=14, max_len=30, seed=3)
    ref_layers = sglang_default_layers(num_layers)
    out: dict = {"arch": arch, "L": num_layers, "layers": ref_layers, "trainer": trainer}

    def engines(model, named: dict[str, list[str]], dtype=torch.bfloat16, meta_dtype="bfloat16") -> None:
        """One engine run of ``model`` recording a store per entry of ``named`` (its capture layers)."""
        with contextlib.ExitStack() as stack:
            readers = []
            for name, layers in named.items():
                out[name] = root / f"{name}.zarr"
                draft, on_batch, rec = _recorder(stack, out[name], model, layers, _server_meta(layers, num_layers, meta_dtype))
                readers.append((draft, layers, on_batch, rec))
            (draft, layers, on_batch, _rec), *rest = readers
            run_engine(model, draft, seqs, layers, dtype=dtype, on_batch=on_batch, max_running=3,
                       also=[(d, lay, cb) for d, lay, cb, _rec in rest])
        assert all(rec.error is None for *_, rec in readers)

    out["ref"] = _record(root / "ref.zarr", run_trainer, trainer, ref_layers, _trainer_meta(ref_layers, num_layers),
                         seqs, torch.float32)
    engines(bf16, {"clean": ref_layers, "deep_off": _shift(ref_layers, {2}), "mid_off": _shift(ref_layers, {1}),
                   "all_off": _shift(ref_layers, {0, 1, 2})})
    engines(server_model(trainer, "fp8"), {"fp8": ref_layers})
    engines(bf16, {"bf16_as_fp32": ref_layers}, dtype=torch.float32)
    return out


def kinds(report, severity: str | None = None) -> set[str]:
    return {f.kind for f in report.findings if severity is None or f.severity == severity}


def messages(report) -> list[str]:
    return [f"{f.severity} {f.kind}: {f.message}" for f in report.findings]


def statuses(report) -> list[tuple[int, int | None, str, str | None]]:
    return [(m.candidate, m.reference, m.status, m.relation) for m in report.segment_map]


def wrong_slots(report) -> set[int]:
    """Candidate slots some error names as not the reference's (other data, missing, extra)."""
    out = set()
    for f in report.findings:
        if f.severity != "error":
            continue
        if f.kind == "segment_value" or f.kind == "segment_extra":
            out.add(f.evidence["candidate_segment"])
        elif f.kind == "segment_missing":
            out.add(f.evidence["reference_segment"])
    return out


def test_clean_bf16_engine_at_depth_is_a_match_with_no_warning(deep):
    report = compare_stores(deep["ref"], deep["clean"])
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)
    assert [s[2:] for s in statuses(report)] == [("same", "same")] * 3
    # The compute dtype comes from what the sides recorded, the budget from it, and the report says so.
    assert report.plan.compute["dtype"] == "bfloat16" and report.plan.compute["source"] == "recorded"
    assert [n["source"] for n in report.plan.noise] == ["assumed"] * 3
    assert all(m.std_rel_error <= m.numerics_budget < m.drift_limit for m in report.metrics)


@pytest.mark.parametrize("slot", [2, 1], ids=["deepest", "middle"])
def test_one_slot_off_by_one_layer_is_named_and_the_others_spared(deep, slot):
    report = compare_stores(deep["ref"], deep["deep_off" if slot == 2 else "mid_off"])
    assert report.verdict == "mismatch", messages(report)
    assert wrong_slots(report) == {slot}, messages(report)
    spared = [s for s in statuses(report) if s[0] != slot]
    assert [s[2:] for s in spared] == [("same", "same")] * 2, statuses(report)
    # The fix, in the server's own numbering: the trainer read SGLang's default layers.
    fixes = [f.evidence["fix"] for f in report.findings if "fix" in f.evidence]
    assert len(fixes) == 1 and fixes[0]["value"] == [2, deep["L"] // 2, deep["L"] - 3], fixes


def test_every_slot_off_by_one_layer_is_named_in_every_slot(deep):
    report = compare_stores(deep["ref"], deep["all_off"])
    assert report.verdict == "mismatch"
    assert wrong_slots(report) == {0, 1, 2}, messages(report)
    assert not any(s[3] in ("same", "drift") for s in statuses(report)), statuses(report)


def test_fp8_weights_at_depth_are_a_precision_finding_not_a_wrong_layer(deep):
    report = compare_stores(deep["ref"], deep["fp8"])
    assert report.verdict == "match", messages(report)
    assert "precision" in kinds(report, "warning"), messages(report)
    assert [s[:2] for s in statuses(report)] == [(0, 0), (1, 1), (2, 2)]


def test_bf16_compute_stored_as_fp32_is_judged_by_its_compute_dtype(deep):
    report = compare_stores(deep["ref"], deep["bf16_as_fp32"])
    assert report.candidate.dtype == "float32"
    assert report.plan.compute["dtype"] == "bfloat16"  # from server_args.dtype, not from the stored rows
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)


def test_calibration_rows_measure_the_drift_and_keep_the_verdicts(deep, tmp_path):
    """The double benchmark: the trainer's own target recomputed in bf16 on a few of its sequences."""
    import shutil

    ref = tmp_path / "ref.zarr"
    shutil.copytree(deep["ref"], ref)
    tracediff.calibrate(ref, deep["trainer"].model, dtype="bfloat16", sequences=2)
    for name, verdict in (("clean", "match"), ("deep_off", "mismatch"), ("fp8", "match")):
        without = compare_stores(deep["ref"], deep[name])
        report = compare_stores(ref, deep[name])
        assert report.verdict == verdict == without.verdict, messages(report)
        assert wrong_slots(report) == wrong_slots(without)
        assert [n["source"] for n in report.plan.noise] == ["calibrated"] * 3
        assert report.plan.calibration is not None and report.plan.calibration["sequences"] == 2
        for n, drift in zip(report.plan.noise, report.plan.calibration["drift"], strict=True):
            assert n["drift"] == drift and drift > 0
    clean = compare_stores(ref, deep["clean"])
    assert kinds(clean, "warning") == set(), messages(clean)
    # The measured drift of a correct bf16 run is what the clean engine shows, within 2x.
    for m in clean.metrics:
        assert m.noise_source == "calibrated" and m.std_rel_error <= 2 * m.expected_drift


def test_the_seed_shape_with_each_non_embedding_slot_one_layer_early(tmp_path):
    """Kimi-K2.5's shape (61-layer DeepSeek-V3, MLA + MoE): the trainer reads hs0, hs3, hs31 (SGLang
    ids [-1, 2, 30]); a server that takes the ids raw instead of +1 feeds hs0, hs2, hs30."""
    num_layers = DEEP_LAYERS["deepseek_v3"]
    trainer = build_deep_model("deepseek_v3")
    seqs = make_sequences(n_seqs=4, min_len=14, max_len=30, seed=3)
    trained, raw = ["hs0", "hs3", "hs31"], ["hs0", "hs2", "hs30"]
    ref = _record(tmp_path / "ref.zarr", run_trainer, trainer, trained, _trainer_meta(trained, num_layers), seqs,
                  torch.float32)
    cand = _record(tmp_path / "cand.zarr", run_engine, server_model(trainer, "bf16"), raw,
                   _server_meta(raw, num_layers), seqs, torch.bfloat16, max_running=3)
    report = compare_stores(ref, cand)
    assert report.verdict == "mismatch"
    assert wrong_slots(report) == {1, 2}, messages(report)
    assert statuses(report)[0][2:] == ("same", "same")


def test_a_clean_shallow_bf16_engine_is_not_fooled_by_massive_dimensions(tmp_path):
    """10-layer Qwen3, bf16 engine, fp32 trainer, same layers: a massive activation's bf16 rounding
    is larger than its spread over tokens and must not decide the segment's identity."""
    from tracediff.testing.models import build_tiny_model

    trainer = build_tiny_model("qwen3", hidden_size=64, num_layers=10)
    seqs = make_sequences(n_seqs=4, min_len=14, max_len=30, seed=3)
    layers = ["hs2", "hs5", "hs8"]
    ref = _record(tmp_path / "ref.zarr", run_trainer, trainer, layers, _trainer_meta(layers, 10), seqs, torch.float32)
    cand = _record(tmp_path / "cand.zarr", run_engine, server_model(trainer, "bf16"), layers, _server_meta(layers, 10),
                   seqs, torch.bfloat16, max_running=3)
    report = compare_stores(ref, cand)
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)
    assert all(x > 0.99 for x in (report.matrix_standardised[i][i] for i in range(3)))


# ------------------------------------------------------------------ the rest of issue 22's cases, on Qwen3 36
@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 36-layer Qwen3 at SGLang's default layers; every sequence starts with the same BOS token, so
    position 0 holds the same hidden state on every sequence, on both sides."""
    num_layers = DEEP_LAYERS["qwen3"]
    root = tmp_path_factory.mktemp("deep-qwen3-cases")
    trainer = build_deep_model("qwen3")
    bf16, fp8 = server_model(trainer, "bf16"), server_model(trainer, "fp8")
    seqs = [[1] + s[1:] for s in make_sequences(n_seqs=4, min_len=14, max_len=30, seed=3)]
    layers = sglang_default_layers(num_layers)
    h = trainer.hidden_size
    neighbour = f"hs{int(layers[2][2:]) - 1}"

    def neighbour_on_small_batches(x: torch.Tensor, states) -> torch.Tensor:
        """The CUDA-graph path: decode batches of <= 2 rows read the neighbouring layer in the deepest slot."""
        if x.shape[1] > 2:
            return x
        x = x.clone()
        x[..., 2 * h:] = states[neighbour].to(x.dtype)
        return x

    def another_layer_at_position_0(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[:, 0, :h] = states["hs2"][:, 0].to(x.dtype)
        return x

    out: dict = {"L": num_layers, "layers": layers, "trainer": trainer, "fp8_model": fp8}
    out["ref"] = _record(root / "ref.zarr", run_trainer, trainer, layers, _trainer_meta(layers, num_layers), seqs,
                         torch.float32)
    meta = _server_meta(layers, num_layers)
    out["small_batches"] = _record(root / "small.zarr", run_engine, bf16, layers, meta, seqs, torch.bfloat16,
                                   max_running=3, prefill_len=lambda i, seq: 8, transform=neighbour_on_small_batches)
    # Feeds the trained layers but records its deepest id one lower (an adapter reading the wrong field).
    out["mislabelled"] = _record(root / "mislabelled.zarr", run_engine, bf16, layers,
                                 _server_meta(_shift(layers, {2}), num_layers), seqs, torch.bfloat16, max_running=3)
    out["fp8"] = _record(root / "fp8.zarr", run_engine, fp8, layers, meta, seqs, torch.bfloat16, max_running=3)
    out["position_0"] = _record(root / "position_0.zarr", run_trainer, bf16, layers, meta, seqs, torch.bfloat16,
                                transform=another_layer_at_position_0)
    return out


def test_small_decode_batches_reading_a_neighbouring_layer_at_depth_are_a_subset_of_rows(qwen):
    report = compare_stores(qwen["ref"], qwen["small_batches"])
    found = [f for f in report.findings if f.kind == "segment_subset"]
    assert [f.evidence["candidate_segment"] for f in found] == [2], messages(report)
    assert found[0].severity == "error" and found[0].evidence["subset"]["description"].startswith("decode rows")
    assert wrong_slots(report) == set(), messages(report)  # the prefill rows of slot 2 are right


def test_sides_configured_for_other_layers_are_never_a_silent_match(qwen):
    """The data cannot tell layer 33 from 34 when the server really feeds 34 but records 33: a config
    error says the sides are configured differently and what would decide."""
    report = compare_stores(qwen["ref"], qwen["mislabelled"])
    assert report.verdict == "mismatch", messages(report)
    config = [f for f in report.findings if f.kind == "config" and f.severity == "error"]
    assert len(config) == 1, messages(report)
    ev = config[0].evidence
    assert (ev["candidate_segment"], ev["reference_layer"], ev["candidate_layer"]) == (2, 34, 33)
    assert "tracediff calibrate" in config[0].message and "--bank" in config[0].message
    assert [s[2:] for s in statuses(report)] == [("same", "same")] * 3
    # The report cannot decide: its "what to record next" box gives both commands (issue #25).
    commands = [c for step in report.record_next["steps"] for c in step["commands"]]
    assert any(c.startswith("tracediff calibrate ") for c in commands)
    assert any(c.endswith(" --bank bank.zarr") for c in commands)


def test_drift_as_large_as_a_neighbouring_layer_is_cannot_tell_not_same(qwen, tmp_path):
    """Calibration rows from FP8 weights measure a drift that reaches past a quarter of the distance
    to a neighbouring layer at depth: the data cannot separate numerics from a wrong layer there."""
    import shutil

    ref = tmp_path / "ref.zarr"
    shutil.copytree(qwen["ref"], ref)
    tracediff.calibrate(ref, qwen["fp8_model"].model, dtype="bfloat16", sequences=2)
    report = compare_stores(ref, qwen["fp8"])
    undecided = [f for f in report.findings if f.kind == "segment_undecided"]
    assert undecided and all(f.severity == "warning" for f in undecided), messages(report)
    assert {s[3] for s in statuses(report) if s[0] in {f.evidence["candidate_segment"] for f in undecided}} == {"undecided"}
    for f in undecided:
        # Calibration is already there: the way to decide is a bank, not more calibration.
        assert "--bank" in f.message and "tracediff calibrate" not in f.message
    commands = [c for step in report.record_next["steps"] for c in step["commands"]]
    assert any(c.endswith(" --bank bank.zarr") for c in commands)
    assert not any(c.startswith("tracediff calibrate") for c in commands)
    dtype = next(f for f in report.findings if f.kind == "dtype")
    assert "calibration rows" in dtype.message


def test_identical_rows_are_not_a_stale_buffer_when_the_reference_rows_are_identical_too(qwen):
    """Position 0 holds the same token with no context on every sequence: identical rows on both
    sides. A server that feeds another layer there is named, never "a stale or default buffer"."""
    report = compare_stores(qwen["ref"], qwen["position_0"])
    found = [f for f in report.findings if f.kind == "segment_subset"]
    assert [f.evidence["candidate_segment"] for f in found] == [0], messages(report)
    assert "positions <= 0" in found[0].evidence["subset"]["description"]
    assert found[0].evidence["content"] != "constant" and "stale" not in found[0].message
