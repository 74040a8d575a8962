"""compare, specified on traces recorded with the real recorder from a tiny real transformers Llama.

The reference is the trainer (one full-sequence forward per sample); candidates are engine-like runs
(ragged prefill, KV-cache decode one token per step, requests interleaved) with one bug each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tracediff
from tracediff.cli import main
from tracediff.compare import CompareOptions, compare_stores
from tracediff.errors import CompareError, NotATraceStoreError, StoreNotFoundError
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

REF = ["hs0", "hs3", "hs6"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Record every trace once per module: name -> store path."""
    root = tmp_path_factory.mktemp("traces")
    tl = build_tiny_llama(hidden_size=64, num_layers=8)
    seqs = make_sequences(n_seqs=4, min_len=12, max_len=30, seed=1)
    h, n_layers = tl.hidden_size, tl.num_layers
    out: dict[str, Path] = {}

    def record(name: str, runner, layers, dtype=torch.bfloat16, **kw) -> None:
        draft = DraftHead(h, len(layers))
        path = root / f"{name}.zarr"
        with tracediff.record(path, role=name, meta={"aux_layer_ids": list(layers)}) as rec:
            rec.tap(draft.fc, "fc_in", segment_size=h, segment_labels=layers)
            runner(tl, draft, seqs, layers, dtype=dtype, on_batch=lambda lab: rec.labels(**lab), **kw)
        out[name] = path

    def scale_middle(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., h : 2 * h] *= 2
        return x

    def nan_rows(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., :2, 2 * h + 5] = float("nan")
        return x

    def nan_segment(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., 2 * h :] = float("nan")
        return x

    record("ref", run_trainer, REF)
    record("ref_fp32", run_trainer, REF, dtype=torch.float32)
    record("seed", run_engine, ["hs3", "hs6", "pre_norm"])
    record("clean_fp32", run_engine, REF, dtype=torch.float32)
    record("clean_fp16", run_engine, REF, dtype=torch.float16)
    record("clean_bf16_chunked", run_engine, REF, chunk_size=7, max_running=4)
    record("perm", run_engine, ["hs6", "hs0", "hs3"])
    record("late", run_engine, REF, label_shift=1)
    record("prefix", run_engine, REF, prefix_tokens=[7, 8, 9, 10, 11])
    record("scaled", run_engine, REF, transform=scale_middle)
    record("ref_pre_norm", run_trainer, ["hs0", "hs3", "pre_norm"])
    record("post_norm", run_engine, ["hs0", "hs3", f"hs{n_layers}"])
    record("nan", run_engine, REF, transform=nan_rows)
    record("nan_segment", run_engine, REF, transform=nan_segment)
    record("two", run_engine, ["hs3", "hs6"])
    record("dup", run_engine, ["hs0", "hs3", "hs3"])
    return out


def kinds(report, severity: str | None = None) -> set[str]:
    return {f.kind for f in report.findings if severity is None or f.severity == severity}


def seg_map(report) -> list[tuple[int, int | None, str]]:
    return [(m.candidate, m.reference, m.status) for m in report.segment_map]


@pytest.mark.parametrize("candidate", ["clean_fp32", "clean_fp16", "clean_bf16_chunked"])
def test_clean_engine_run_matches_trainer(traces, candidate):
    report = compare_stores(traces["ref"], traces[candidate])
    assert report.verdict == "match", [f.message for f in report.findings]
    assert kinds(report, "error") == set()
    assert seg_map(report) == [(0, 0, "same"), (1, 1, "same"), (2, 2, "same")]
    assert report.plan.label_offset == 0
    assert report.plan.pairs == report.reference.valid_rows  # every training row found its server row
    assert all(m.cos_min > 0.999 for m in report.metrics)
    assert report.exit_code() == 0


@pytest.mark.parametrize("candidate", ["clean_fp16", "clean_bf16_chunked"])
def test_fp32_reference_against_a_half_precision_candidate_matches_with_a_dtype_note(traces, candidate):
    report = compare_stores(traces["ref_fp32"], traces[candidate])
    assert report.reference.dtype == "float32"
    assert report.candidate.dtype == {"clean_fp16": "float16", "clean_bf16_chunked": "bfloat16"}[candidate]
    assert report.verdict == "match", [f.message for f in report.findings]
    assert "dtype" in kinds(report, "info")


def test_reports_the_seed_wiring_bug(traces):
    """Trainer cat(hs0, hs3, hs6), server cat(hs3, hs6, last layer): the motivating case."""
    report = compare_stores(traces["ref"], traces["seed"])
    assert report.verdict == "mismatch"
    assert seg_map(report) == [(0, 1, "moved"), (1, 2, "moved"), (2, None, "extra")]
    assert {"segment_order", "segment_missing", "segment_extra"} <= kinds(report, "error")
    order = next(f for f in report.findings if f.kind == "segment_order")
    assert order.evidence["pattern"] == "shift" and order.evidence["shift"] == 1
    assert "one slot later" in order.message
    missing = next(f for f in report.findings if f.kind == "segment_missing")
    assert missing.evidence["reference_segment"] == 0 and "hs0" in missing.message
    extra = next(f for f in report.findings if f.kind == "segment_extra")
    assert extra.evidence["candidate_segment"] == 2
    # The aux-layer configuration of both sides is shown next to it.
    assert report.reference.aux_layer_config["store.aux_layer_ids"] == REF
    assert report.candidate.aux_layer_config["store.aux_layer_ids"] == ["hs3", "hs6", "pre_norm"]
    assert any(d["path"] == "store.aux_layer_ids" for d in report.config_diff)


def test_reports_a_permutation(traces):
    report = compare_stores(traces["ref"], traces["perm"])
    assert seg_map(report) == [(0, 2, "moved"), (1, 0, "moved"), (2, 1, "moved")]
    order = next(f for f in report.findings if f.kind == "segment_order")
    assert order.evidence["pattern"] == "permutation"
    assert "segment_missing" not in kinds(report) and "segment_extra" not in kinds(report)


def test_reports_rows_labelled_one_token_late(traces):
    report = compare_stores(traces["ref"], traces["late"])
    assert report.plan.label_offset == -1
    assert "token_offset" in kinds(report, "error")
    # Once re-paired at the right offset, the values themselves agree.
    assert seg_map(report) == [(0, 0, "same"), (1, 1, "same"), (2, 2, "same")]
    assert all(m.cos_mean > 0.999 for m in report.metrics)
    assert "sequence_prefix" not in kinds(report) and "position_offset" not in kinds(report)


def test_reports_a_chat_template_prefix_on_the_candidate(traces):
    report = compare_stores(traces["ref"], traces["prefix"])
    prefix = next(f for f in report.findings if f.kind == "sequence_prefix")
    assert prefix.severity == "error"
    assert prefix.evidence["prefix_lengths"] == [5]
    assert prefix.evidence["example_tokens"] == [7, 8, 9, 10, 11]
    assert report.plan.sequence_deltas == {"5": 4}
    # The embedding does not depend on context and still matches exactly.
    assert seg_map(report)[0] == (0, 0, "same")
    # Consequences are reported as such, not as wiring errors.
    assert not {"segment_missing", "segment_extra", "segment_order"} & kinds(report)


def test_reports_one_segment_scaled_by_two(traces):
    report = compare_stores(traces["ref"], traces["scaled"])
    scale = [f for f in report.findings if f.kind == "segment_scale"]
    assert len(scale) == 1 and scale[0].severity == "error"
    assert scale[0].evidence["candidate_segment"] == 1 and scale[0].evidence["constant_scale"]
    assert scale[0].evidence["norm_ratio_p50"] == pytest.approx(2.0, rel=1e-2)
    assert seg_map(report) == [(0, 0, "same"), (1, 1, "same"), (2, 2, "same")]


def test_reports_final_layer_before_versus_after_the_norm(traces):
    report = compare_stores(traces["ref_pre_norm"], traces["post_norm"])
    assert seg_map(report)[:2] == [(0, 0, "same"), (1, 1, "same")]
    assert seg_map(report)[2][:2] == (2, 2)
    scale = next(f for f in report.findings if f.kind == "segment_scale")
    assert scale.evidence["candidate_segment"] == 2 and not scale.evidence["constant_scale"]
    assert "norm" in scale.message


def test_reports_nan_rows_and_keeps_comparing_the_rest(traces):
    report = compare_stores(traces["ref"], traces["nan"])
    nonfinite = [f for f in report.findings if f.kind == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0].evidence["side"] == "candidate"
    assert nonfinite[0].evidence["segment"] == 2 and nonfinite[0].evidence["rows"] > 0
    seg2 = next(m for m in report.metrics if m.candidate == 2)
    assert seg2.nonfinite_candidate == nonfinite[0].evidence["rows"]
    assert seg2.cos_min > 0.999  # the finite rows still agree
    assert report.verdict == "mismatch"


def test_reports_a_two_segment_candidate_as_a_width_mismatch(traces):
    report = compare_stores(traces["ref"], traces["two"])
    assert "shape" in kinds(report, "error")
    assert seg_map(report) == [(0, 1, "moved"), (1, 2, "moved")]
    missing = next(f for f in report.findings if f.kind == "segment_missing")
    assert missing.evidence["reference_segment"] == 0


def test_reports_a_duplicated_segment(traces):
    report = compare_stores(traces["ref"], traces["dup"])
    assert seg_map(report) == [(0, 0, "same"), (1, 1, "same"), (2, 1, "duplicate")]
    assert {"segment_duplicate", "segment_missing"} <= kinds(report, "error")


def test_reference_and_candidate_roles_are_symmetric_for_a_permutation(traces):
    forward = compare_stores(traces["ref"], traces["perm"])
    backward = compare_stores(traces["perm"], traces["ref"])
    fwd = {(m.candidate, m.reference) for m in forward.segment_map}
    bwd = {(m.reference, m.candidate) for m in backward.segment_map}
    assert fwd == bwd


def test_json_report_is_versioned_and_gates_ci(traces, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tracediff", "compare", str(traces["ref"]), str(traces["seed"]), "--json", str(out),
         "--quiet"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("mismatch")
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["verdict"] == "mismatch"
    assert [m["reference"] for m in doc["segment_map"]] == [1, 2, None]
    assert {f["kind"] for f in doc["findings"]} >= {"segment_order", "segment_missing", "segment_extra"}
    assert len(doc["matrix"]) == 3 and len(doc["matrix"][0]) == 3


def test_cli_exit_codes_for_match_and_strict_warnings(traces, tmp_path):
    match = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(traces["ref"]),
                            str(traces["clean_fp32"]), "--html", str(tmp_path / "r.html"),
                            "--markdown", str(tmp_path / "r.md")],
                           capture_output=True, text=True, timeout=120)
    assert match.returncode == 0, match.stdout + match.stderr
    assert "match" in match.stdout
    assert (tmp_path / "r.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert "segment" in (tmp_path / "r.md").read_text().lower()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "no such trace store"),
        ("not_a_store", "not a zarr v3 store"),
        ("no_common_tap", "no common tap"),
        ("zero_aligned", "zero aligned rows"),
        ("bad_segment_size", "does not divide"),
    ],
)
def test_bad_input_is_one_line_exit_2(traces, tmp_path, case, expected):
    ref, cand = traces["ref"], traces["clean_fp32"]
    extra: list[str] = []
    if case == "missing":
        cand = tmp_path / "nope.zarr"
    elif case == "not_a_store":
        cand = tmp_path / "plain"
        cand.mkdir()
        (cand / "data.txt").write_text("hello")
    elif case == "no_common_tap":
        cand = tmp_path / "other.zarr"
        with tracediff.record(cand) as rec:
            rec.capture("other_tap", torch.ones(4, 192))
    elif case == "zero_aligned":
        cand = tmp_path / "unrelated.zarr"
        with tracediff.record(cand) as rec:
            rec.labels(seq=0, position=np.arange(20), token_id=np.arange(1000, 1020))
            rec.capture("fc_in", torch.randn(20, 192))
    elif case == "bad_segment_size":
        extra = ["--segment-size", "50"]
    # The real CLI entry point, in-process (click's runner) to keep the suite fast; one case goes
    # through a real `python -m tracediff` subprocess.
    if case == "missing":
        proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(ref), str(cand), *extra],
                              capture_output=True, text=True, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        result = CliRunner().invoke(main, ["compare", str(ref), str(cand), *extra])
        code, stderr = result.exit_code, result.stderr
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error:"), stderr
    assert expected in lines[0]
    assert "Traceback" not in stderr


def test_library_errors_subclass_builtins(traces, tmp_path):
    with pytest.raises(StoreNotFoundError):
        compare_stores(traces["ref"], tmp_path / "missing.zarr")
    with pytest.raises(FileNotFoundError):
        compare_stores(traces["ref"], tmp_path / "missing.zarr")
    (tmp_path / "x").mkdir()
    with pytest.raises(NotATraceStoreError):
        compare_stores(traces["ref"], tmp_path / "x")
    with pytest.raises(CompareError):
        compare_stores(traces["ref"], traces["clean_fp32"], CompareOptions(segment_size=7))


def test_compare_reads_a_packed_zip_store(traces, tmp_path):
    from tracediff.store import pack_store

    zipped = pack_store(traces["seed"], tmp_path / "seed.zarr.zip")
    report = compare_stores(traces["ref"], zipped)
    assert seg_map(report) == [(0, 1, "moved"), (1, 2, "moved"), (2, None, "extra")]


def test_fc_input_under_another_tap_name_is_paired_when_no_tap_is_common(tmp_path):
    """A server in capture-only mode records the target's packed aux states (aux_hidden) only."""
    rows = torch.randn(40, 96)
    for name, tap in (("train", "fc_in"), ("server", "aux_hidden")):
        with tracediff.record(tmp_path / f"{name}.zarr") as rec:
            rec.declare(tap, segment_size=32)
            rec.labels(seq=0, position=np.arange(40), token_id=np.arange(40) + 5)
            rec.capture(tap, rows)
    report = compare_stores(tmp_path / "train.zarr", tmp_path / "server.zarr")
    assert (report.plan.tap_reference, report.plan.tap_candidate) == ("fc_in", "aux_hidden")
    assert report.verdict == "match"
    assert any("no common tap" in note for note in report.plan.notes)


def test_two_hidden_sizes_are_one_shape_error_not_more_segments(traces, tmp_path):
    """3 x 64 against 3 x 32: another target model, never 6 segments of 32 with 6 missing."""
    small = build_tiny_llama(hidden_size=32, num_layers=8)
    seqs = make_sequences(n_seqs=4, min_len=12, max_len=30, seed=1)
    draft = DraftHead(32, 3)
    path = tmp_path / "h32.zarr"
    with tracediff.record(path) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=32)
        run_engine(small, draft, seqs, REF, dtype=torch.bfloat16, on_batch=lambda lab: rec.labels(**lab))
    report = compare_stores(traces["ref"], path)
    errors = [f for f in report.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["shape"]
    assert errors[0].evidence["reference_segment_size"] == 64 and errors[0].evidence["candidate_segment_size"] == 32
    assert "64" in errors[0].message and "32" in errors[0].message
    assert report.segment_map == [] and report.metrics == []
    assert report.exit_code() == 1


def test_a_side_without_a_segment_size_takes_the_other_sides_and_says_so(traces, tmp_path):
    rows = torch.randn(30, 192)
    for name, size in (("with", 64), ("without", None)):
        with tracediff.record(tmp_path / f"{name}.zarr") as rec:
            if size:
                rec.declare("fc_in", segment_size=size)
            rec.labels(seq=0, position=np.arange(30), token_id=np.arange(30) + 3)
            rec.capture("fc_in", rows)
    report = compare_stores(tmp_path / "with.zarr", tmp_path / "without.zarr")
    assert report.plan.segment_size == 64 and report.plan.segment_size_source == "mixed"
    assert any("candidate recorded no segment size" in n for n in report.plan.notes)


SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def test_the_shipped_fixed_pair_is_a_match_with_no_warning():
    """Trainer ids in HF numbering [0, 3, 6], server ids in SGLang's [-1, 2, 5]: the same layers."""
    report = compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr")
    assert report.verdict == "match"
    assert [f for f in report.findings if f.severity != "info"] == []
    config = [f for f in report.findings if f.kind == "config" and "numberings" in f.message]
    assert config and config[0].evidence["aux_layers"]["candidate"]["physical"] == [0, 3, 6]
    result = CliRunner().invoke(main, ["compare", str(SAMPLES / "train.zarr"), str(SAMPLES / "server_fixed.zarr"),
                                       "--fail-on", "warning", "--quiet"])
    assert result.exit_code == 0, result.output


def test_the_shipped_broken_pair_names_the_fix_in_sglang_numbering():
    report = compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr")
    order = next(f for f in report.findings if f.kind == "segment_order")
    fix = order.evidence["fix"]
    assert fix["engine"] == "sglang" and fix["value"] == [-1, 2, 5] and fix["config_can_fix"]
    assert fix["candidate_layers"] == [3, 6, 8]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in order.message and "[-1, 2, 5]" in order.message


def _record_engine(path: Path, layers: list[str], meta: dict) -> Path:
    tl = build_tiny_llama(hidden_size=64, num_layers=8)
    seqs = make_sequences(n_seqs=4, min_len=12, max_len=30, seed=1)
    draft = DraftHead(64, len(layers))
    with tracediff.record(path, meta=meta) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=64)
        run_engine(tl, draft, seqs, layers, dtype=torch.bfloat16, on_batch=lambda lab: rec.labels(**lab))
    return path


def test_same_config_in_another_order_is_a_code_path_not_a_config_fix(traces, tmp_path):
    """The server is configured for the trainer's layers but concatenates them in another order."""
    ref = _record_engine(tmp_path / "ref.zarr", REF, {"aux_layers": {"ids": [0, 3, 6], "convention": "hf"}})
    cand = _record_engine(tmp_path / "cand.zarr", ["hs3", "hs0", "hs6"],
                          {"aux_layers": {"ids": [-1, 2, 5], "convention": "sglang", "framework": "sglang"}})
    report = compare_stores(ref, cand)
    order = next(f for f in report.findings if f.kind == "segment_order")
    assert order.evidence["fix"]["config_can_fix"] is False
    assert "no config value can fix it" in order.message and "code" in order.message


def test_an_unknown_numbering_says_what_to_record(traces, tmp_path):
    cand = _record_engine(tmp_path / "cand.zarr", ["hs3", "hs6", "pre_norm"], {"aux_layer_ids": [2, 5, 7]})
    report = compare_stores(traces["ref"], cand)
    assert any("has no convention" in n for n in report.plan.notes)
    order = next(f for f in report.findings if f.kind == "segment_order")
    # The reference's labels give its layers; the candidate's engine is unknown: both engines' words.
    assert "sglang" in order.message and "vllm" in order.message


def test_a_segment_nan_on_every_row_is_reported_and_the_others_are_compared(traces):
    """Per-segment non-finite: segment 2 is NaN on every candidate row; 0 and 1 are still compared."""
    report = compare_stores(traces["ref"], traces["nan_segment"])
    nonfinite = [f for f in report.findings if f.kind == "nonfinite"]
    assert [(f.evidence["side"], f.evidence["segment"]) for f in nonfinite] == [("candidate", 2)]
    assert nonfinite[0].evidence["rows"] == report.plan.pairs
    assert seg_map(report)[:2] == [(0, 0, "same"), (1, 1, "same")]
    assert all(m.cos_min > 0.999 for m in report.metrics if m.candidate < 2)
    # The dead slot is a non-finite finding, not wiring: nothing is "missing" or "extra".
    assert not {"segment_missing", "segment_extra", "segment_order"} & kinds(report)
    assert report.verdict == "mismatch"


def test_the_offset_search_scores_a_few_sequences_but_pairs_every_row_at_the_winner(traces):
    # With a sample smaller than the trace, offsets other than 0 are scored on a few whole sequences;
    # the winning offset's pairs must still cover every row, as when every row was scored.
    whole = compare_stores(traces["ref"], traces["late"])
    few = compare_stores(traces["ref"], traces["late"], CompareOptions(offset_sample_rows=16))
    assert whole.plan.pairs > 4 * 16  # the sequences scored are a subset
    assert few.plan.label_offset == whole.plan.label_offset == -1
    assert few.plan.pairs == whole.plan.pairs
    assert seg_map(few) == seg_map(whole)
    assert [m.rows for m in few.metrics] == [m.rows for m in whole.metrics]
