"""One trace from many stores: ``compare REF CAND CAND...`` reads several stores of a side as one.

The stores are the shipped samples (real tiny-model recordings) split over several stores with the
real writer, as one record process per node would leave them; and copies of a store standing for
replicated ranks, one of which captured another layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_parts import split_store

from tracediff.cli import main as cli_main
from tracediff.compare import compare_stores
from tracediff.errors import CompareError
from tracediff.testing.stores import write_small_store

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
TRAIN, BROKEN, FIXED = SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", SAMPLES / "server_fixed.zarr"


def _summary(report) -> dict:
    return {
        "verdict": report.verdict,
        "findings": sorted((f.kind, f.severity) for f in report.findings),
        "segment_map": [(m.candidate, m.reference, m.status) for m in report.segment_map],
        "pairs": report.plan.pairs,
        "label_offset": report.plan.label_offset,
    }


def _cli(*args: str):
    return CliRunner().invoke(cli_main, ["compare", *args, "--no-progress"], catch_exceptions=False)


def test_a_trace_split_over_three_stores_compares_like_the_one_store(tmp_path):
    parts = split_store(BROKEN, [tmp_path / f"server-node{i}.zarr" for i in range(3)])
    one = compare_stores(TRAIN, BROKEN)
    many = compare_stores(TRAIN, parts)
    assert _summary(many) == _summary(one)
    assert _summary(many)["verdict"] == "mismatch"
    for a, b in zip(many.metrics, one.metrics, strict=True):
        assert (a.candidate, a.reference, a.rows) == (b.candidate, b.reference, b.rows)
        for name in ("cos_mean", "cos_min", "norm_ratio_mean", "rel_l2", "std_rel_error", "max_abs_diff"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-6, abs=1e-9), name
    # Every writer group of every store is one trace; rows name the store they live in.
    assert many.candidate.writers == [f"server-node{i}.zarr/rank0" for i in range(3)]
    assert many.candidate.rows == one.candidate.rows
    assert many.candidate.meta["stores"] == [str(p) for p in parts]
    worst = many.metrics[0].worst_rows[0]["candidate"]["seq"]
    assert worst.split("/")[0] in {p.name for p in parts}
    assert any("3 stores read as one trace" in n for n in many.plan.notes)
    assert many.plan.candidate_rows_replica == 0


def test_both_sides_split_over_stores_by_glob_and_repeated_reference(tmp_path):
    split_store(TRAIN, [tmp_path / f"train-rank{i}.zarr" for i in range(2)])
    split_store(BROKEN, [tmp_path / f"server-node{i}.zarr" for i in range(3)])
    single = tmp_path / "single.json"
    assert _cli(str(TRAIN), str(BROKEN), "--json", str(single), "-q").exit_code == 1
    for args in (
        ["--reference", str(tmp_path / "train-rank*.zarr"), str(tmp_path / "server-node*.zarr")],
        ["--reference", str(tmp_path / "train-rank0.zarr"), "--reference", str(tmp_path / "train-rank1.zarr"),
         str(tmp_path / "server-node0.zarr"), "--candidate", str(tmp_path / "server-node[12].zarr")],
    ):
        out = tmp_path / "many.json"
        result = _cli(*args, "--json", str(out), "-q")
        assert result.exit_code == 1, result.output
        many, one = json.loads(out.read_text()), json.loads(single.read_text())
        assert many["verdict"] == one["verdict"] == "mismatch"
        assert sorted(f["kind"] for f in many["findings"]) == sorted(f["kind"] for f in one["findings"])
        assert many["plan"]["pairs"] == one["plan"]["pairs"]
        assert len(many["reference"]["writers"]) == 2 and len(many["candidate"]["writers"]) == 3
        assert many["reference"]["path"] == " + ".join(str(tmp_path / f"train-rank{i}.zarr") for i in range(2))


def test_replicated_rows_across_stores_that_agree_match(tmp_path):
    a, b = tmp_path / "server-a.zarr", tmp_path / "server-b.zarr"
    shutil.copytree(FIXED, a)
    shutil.copytree(FIXED, b)
    report = compare_stores(TRAIN, [a, b])
    assert report.verdict == "match", [f.message for f in report.findings]
    assert report.plan.candidate_rows_replica == report.plan.pairs // 2 > 0
    assert any("server-a.zarr/rank0, server-b.zarr/rank0" in n for n in report.plan.notes)


def test_replicated_rows_across_stores_that_disagree_are_flagged_naming_the_store(tmp_path):
    """Replica b captured hs6 in its middle slot: its rows, and only its, are the bug."""
    a = split_store(FIXED, [tmp_path / "server-a.zarr"])[0]

    def middle_slot_reads_hs6(_part: int, rows: np.ndarray) -> np.ndarray:
        rows[:, 64:128] = rows[:, 128:192]
        return rows

    b = split_store(FIXED, [tmp_path / "server-b.zarr"], transform=middle_slot_reads_hs6)[0]
    report = compare_stores(TRAIN, [a, b])
    assert report.verdict == "mismatch"
    subset = next(f for f in report.findings if f.severity == "error")
    assert subset.kind == "segment_subset"
    assert "writer server-b.zarr/rank0" in subset.message
    assert "server-a.zarr" not in subset.message


def test_reference_replicas_across_stores_are_compared_once_and_said_so(tmp_path):
    copy = tmp_path / "train-copy.zarr"
    shutil.copytree(TRAIN, copy)
    report = compare_stores([TRAIN, copy], FIXED)
    assert report.verdict == "match"
    assert report.plan.pairs == report.candidate.valid_rows
    note = next(n for n in report.plan.notes if "held whole by more than one reference writer group" in n)
    assert "train.zarr/rank0" in note and "train-copy.zarr/rank0" in note


def test_stores_of_one_side_with_different_layouts_are_one_error_naming_both(tmp_path):
    other = write_small_store(tmp_path / "other.zarr")  # width 48 float32, the samples 192 bf16
    with pytest.raises(CompareError) as err:
        compare_stores(TRAIN, [FIXED, other])
    message = str(err.value)
    assert str(other) in message and str(FIXED) in message and "\n" not in message
    result = _cli(str(TRAIN), str(FIXED), str(other))
    assert result.exit_code == 2
    assert "must hold the same layout" in result.output


def test_a_glob_matching_no_store_and_a_missing_side_are_usage_errors(tmp_path):
    result = _cli(str(TRAIN), str(tmp_path / "nothing-*.zarr"))
    assert result.exit_code == 2 and "no store matches this pattern" in result.output
    result = _cli(str(TRAIN))
    assert result.exit_code == 2 and "missing argument 'CANDIDATE'" in result.output
    result = _cli("--candidate", str(FIXED))
    assert result.exit_code == 2 and "missing argument 'REFERENCE'" in result.output


def test_bank_and_draft_need_one_store_per_side(tmp_path):
    parts = split_store(FIXED, [tmp_path / f"server-node{i}.zarr" for i in range(2)])
    result = _cli(str(TRAIN), *map(str, parts), "--bank", str(SAMPLES / "bank.zarr"))
    assert result.exit_code == 2 and "--bank names the layers of one store per side" in result.output
