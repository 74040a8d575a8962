"""compare names the right root cause on tiny models built like real ones.

Every trace here is recorded with the real recorder from a real transformers model (Llama, Qwen3,
Mistral, DeepSeek-V3: MLA attention and MoE) with random weights, non-unit norm weights and massive
activations (a few dimensions 100-1000x the median from an early layer on, so that raw cosines
between *different* layers are 0.98-0.999). The reference is an fp32 trainer; candidates are
engine-order runs (ragged prefill, KV-cache decode, interleaved requests) of the same model computed
in bf16 (or with FP8-rounded weights), each with one wiring bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tracediff
from tracediff.compare import compare_stores
from tracediff.testing.models import ARCHITECTURES, build_tiny_model, server_model
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, make_sequences

# Slow (-m "not slow" leaves it out; CI runs it): four architectures' recordings: 3-5 min of fixtures on two cores.
pytestmark = pytest.mark.slow

L = 8
REF = ["hs2", "hs4", "hs6"]  # HF hidden_states indices 2, 4, 6: outputs of layers 1, 3, 5


def _hf_ids(layers: list[str]) -> list[int]:
    return [L if n == "pre_norm" else int(n[2:]) for n in layers]


def _sglang_meta(layers: list[str]) -> dict:
    """What an SGLang server records: ids in its own numbering (output of layer j, -1 = embedding)."""
    return {"aux_layers": {"ids": [i - 1 for i in _hf_ids(layers)], "convention": "sglang", "framework": "sglang",
                           "field": "eagle_config.eagle_aux_hidden_state_layer_ids"},
            "num_hidden_layers": L}


def _trainer_meta(layers: list[str]) -> dict:
    return {"aux_layers": {"ids": _hf_ids(layers), "convention": "capture"}, "num_hidden_layers": L}


def _norm_each_segment(h: int):
    """A real RMSNorm with non-unit weights on every segment of the fc input (an fc_norm on one side)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.empty(h).uniform_(0.5, 2.0, generator=gen)

    def apply(x: torch.Tensor, states) -> torch.Tensor:
        parts = x.float().split(h, dim=-1)
        normed = [p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) * weight for p in parts]
        return torch.cat(normed, dim=-1).to(x.dtype)

    return apply


def _scale_segment(h: int, k: int, factor: float):
    def apply(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., k * h : (k + 1) * h] *= factor
        return x

    return apply


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_traces(request, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"traces-{arch}")
    trainer = build_tiny_model(arch, hidden_size=64, num_layers=L)
    bf16 = server_model(trainer, "bf16")
    h = trainer.hidden_size
    seqs = make_sequences(n_seqs=4, min_len=14, max_len=30, seed=3)
    out: dict[str, Path] = {"arch": Path(arch)}

    def record(name, runner, model, layers, meta, dtype=torch.bfloat16, **kw) -> None:
        draft = DraftHead(h, len(layers))
        path = root / f"{name}.zarr"
        with tracediff.record(path, role=name, meta=meta, on_full="block") as rec:
            rec.tap(draft.fc, "fc_in", segment_size=h)
            runner(model, draft, seqs, layers, dtype=dtype, on_batch=lambda lab: rec.labels(**lab), **kw)
        assert rec.error is None
        out[name] = path

    record("ref", run_trainer, trainer, REF, _trainer_meta(REF), dtype=torch.float32)
    record("ref_pre_norm", run_trainer, trainer, ["hs2", "hs4", "pre_norm"], _trainer_meta(["hs2", "hs4", "pre_norm"]),
           dtype=torch.float32)
    record("ref_seed", run_trainer, trainer, ["hs0", "hs3", "hs6"], _trainer_meta(["hs0", "hs3", "hs6"]),
           dtype=torch.float32)
    record("clean", run_engine, bf16, REF, _sglang_meta(REF), max_running=3)
    record("adjacent", run_engine, bf16, ["hs3", "hs5", "hs7"], _sglang_meta(["hs3", "hs5", "hs7"]), max_running=3)
    record("fp8", run_engine, server_model(trainer, "fp8"), REF, _sglang_meta(REF), max_running=3)
    record("post_norm", run_engine, bf16, ["hs2", "hs4", f"hs{L}"], {"num_hidden_layers": L}, max_running=3)
    record("scaled", run_engine, bf16, REF, _sglang_meta(REF), transform=_scale_segment(h, 1, 2.5), max_running=3)
    record("fc_norm", run_engine, bf16, REF, _sglang_meta(REF), transform=_norm_each_segment(h), max_running=3)
    record("seed", run_engine, bf16, ["hs3", "hs6", "pre_norm"], _sglang_meta(["hs3", "hs6", "pre_norm"]),
           max_running=3)
    return out


def kinds(report, severity: str | None = None) -> set[str]:
    return {f.kind for f in report.findings if severity is None or f.severity == severity}


def finding(report, kind: str):
    return next(f for f in report.findings if f.kind == kind)


def test_clean_bf16_engine_matches_the_fp32_trainer_with_no_warning(arch_traces):
    report = compare_stores(arch_traces["ref"], arch_traces["clean"])
    assert report.verdict == "match", [f.message for f in report.findings]
    assert kinds(report, "warning") == set(), [f.message for f in report.findings]
    assert [(m.candidate, m.reference, m.status, m.relation) for m in report.segment_map] == [
        (0, 0, "same", "same"), (1, 1, "same", "same"), (2, 2, "same", "same")]
    # The two sides record their ids in two numberings; the same physical layers are no warning.
    assert report.reference.aux_layers["physical"] == report.candidate.aux_layers["physical"] == [2, 4, 6]
    assert report.exit_code("warning") == 0


def test_massive_activations_make_raw_cosine_useless_and_are_not_what_decides(arch_traces):
    """The adjacent-layer bug: raw cosines look perfect, the standardised ones do not."""
    report = compare_stores(arch_traces["ref"], arch_traces["adjacent"])
    same_slot_raw = [report.matrix[i][i] for i in range(3)]
    same_slot_std = [report.matrix_standardised[i][i] for i in range(3)]
    assert min(same_slot_raw) > 0.97, same_slot_raw
    assert max(same_slot_std) < 0.99, same_slot_std


def test_adjacent_layers_are_other_data_never_a_normalisation(arch_traces):
    """aux ids off by one (the server reads hs3, hs5, hs7 where training read hs2, hs4, hs6)."""
    report = compare_stores(arch_traces["ref"], arch_traces["adjacent"])
    assert report.verdict == "mismatch"
    assert "segment_scale" not in kinds(report)
    assert kinds(report, "error") & {"segment_value", "segment_missing", "segment_extra"}
    values = [f for f in report.findings if f.kind == "segment_value"]
    for f in values:
        assert "neighbouring layer" in f.message
        assert all(fit["relative_error"] > f.evidence["numerics_budget"] for fit in f.evidence["fits"])
    # The fix, in SGLang's own numbering: training read HF hidden_states [2, 4, 6].
    fixes = [f.evidence["fix"] for f in report.findings if "fix" in f.evidence]
    assert len(fixes) == 1
    assert fixes[0]["value"] == [1, 3, 5] and fixes[0]["config_can_fix"]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in fixes[0]["field"]


def test_fp8_weights_on_the_server_are_a_precision_finding(arch_traces):
    report = compare_stores(arch_traces["ref"], arch_traces["fp8"])
    assert [(m.reference, m.status) for m in report.segment_map] == [(0, "same"), (1, "same"), (2, "same")]
    precision = [f for f in report.findings if f.kind == "precision"]
    assert precision, [f.message for f in report.findings]
    for f in precision:
        assert f.severity == "warning"
        assert f.evidence["std_rel_error"] > f.evidence["numerics_budget"]
    # Worth a look, not a wiring bug: the verdict stays a match, and only --fail-on warning fails on it.
    assert report.verdict == "match" and report.exit_code() == 0 and report.exit_code("warning") == 1
    assert not kinds(report) & {"segment_scale", "segment_value", "segment_missing", "segment_order"}


def test_final_norm_on_one_side_is_a_fitted_rmsnorm(arch_traces):
    """Training fed the last layer before the final norm, the server after it (real final RMSNorm)."""
    report = compare_stores(arch_traces["ref_pre_norm"], arch_traces["post_norm"])
    assert [(m.reference, m.status) for m in report.segment_map][:2] == [(0, "same"), (1, "same")]
    scale = finding(report, "segment_scale")
    assert scale.evidence["candidate_segment"] == 2
    transform = scale.evidence["transform"]
    assert transform["kind"] == "rmsnorm" and transform["side"] == "candidate"
    assert transform["relative_error"] <= scale.evidence["numerics_budget"]
    # The final norm's real weights are drawn in [0.5, 2.0]; the fit sees their spread.
    weight = transform["params"]["weight"]
    assert weight["max"] / weight["min"] > 1.5
    assert len([f for f in report.findings if f.kind == "segment_scale"]) == 1


def test_a_norm_on_every_segment_is_fitted_with_its_weights(arch_traces):
    report = compare_stores(arch_traces["ref"], arch_traces["fc_norm"])
    scales = [f for f in report.findings if f.kind == "segment_scale"]
    assert sorted(f.evidence["candidate_segment"] for f in scales) == [0, 1, 2]
    for f in scales:
        assert f.evidence["transform"]["kind"] in ("rmsnorm", "layernorm")
        assert not f.evidence["constant_scale"]
    assert not kinds(report) & {"segment_missing", "segment_extra", "segment_value"}


def test_a_constant_factor_is_a_constant_scale(arch_traces):
    report = compare_stores(arch_traces["ref"], arch_traces["scaled"])
    scales = [f for f in report.findings if f.kind == "segment_scale"]
    assert len(scales) == 1 and scales[0].evidence["candidate_segment"] == 1
    assert scales[0].evidence["transform"]["kind"] == "constant"
    assert scales[0].evidence["transform"]["params"]["factor"] == pytest.approx(2.5, rel=0.01)


def test_the_seed_wiring_with_a_deep_extra_layer_is_missing_plus_extra(arch_traces):
    """Training cat(hs0, hs3, hs6), server cat(hs3, hs6, last layer): the motivating bug."""
    report = compare_stores(arch_traces["ref_seed"], arch_traces["seed"])
    assert [(m.candidate, m.reference, m.status) for m in report.segment_map] == [
        (0, 1, "moved"), (1, 2, "moved"), (2, None, "extra")]
    assert {"segment_order", "segment_missing", "segment_extra"} <= kinds(report, "error")
    assert not kinds(report) & {"segment_duplicate", "segment_scale"}
    fix = finding(report, "segment_order").evidence["fix"]
    assert fix["target_layers"] == [0, 3, 6] and fix["value"] == [-1, 2, 5]
