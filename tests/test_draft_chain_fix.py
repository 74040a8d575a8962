"""What a draft-chain root cause asks of the user (issue #53): its own Fix box (no fc wiring value
fixes a draft that differs inside), and each chain tap's numerics prior at the depth its rows carry.

Real parts as in tests/test_draft_chain.py: speculators' own ``Eagle3DraftModel`` recorded twice
through tracediff's recorder and the speculators adapter, the real compare and report writers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import skip_unless_installed

skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")

import test_draft_chain as dc  # noqa: E402

from tracediff.compare import compare_stores  # noqa: E402
from tracediff.report.markdown import render_markdown  # noqa: E402
from tracediff.report.text import render_text  # noqa: E402


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("speculators_data")
    dc.tr.write_speculators_data(folder)
    return [{k: v for k, v in b.items() if k != "verifier_last_hidden_states"} for b in dc.tr.speculators_batches(folder)]


@pytest.mark.parametrize(("change", "point", "words"), [
    (dc._scale_norm_weight, "norm_out", "norm.weight and rms_norm_eps"),
    (dc._rope_theta_times_ten, "layer_out", "rope_theta"),
])
def test_a_chain_root_cause_gets_a_fix_box_saying_where_in_the_draft(tmp_path: Path, batches: list[dict[str, Any]],
                                                                     change: Any, point: str, words: str) -> None:
    report = compare_stores(dc.record_draft(tmp_path / "a.zarr", batches),
                            dc.record_draft(tmp_path / "b.zarr", batches, change))
    fix = report.fix
    assert fix is not None and fix["how"] == "draft" and fix["finding"] == "draft_chain"
    assert f"draft_{point}" in fix["target_from"]
    assert words in fix["steps"][0]["text"]
    assert fix["config_can_fix"] is False and fix["value"] is None
    assert report.record_next is None  # the fix box says where to look: nothing about aux-layer ids to record
    text = render_text(report)
    assert "Fix: in the candidate's draft (its checkpoint, config or code), not its inputs" in text
    assert words in text
    assert "Fix: in the candidate" in render_markdown(report)


def test_a_clean_pair_has_no_fix_box(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    report = compare_stores(dc.record_draft(tmp_path / "a.zarr", batches), dc.record_draft(tmp_path / "b.zarr", batches))
    assert report.verdict == "match" and report.fix is None
    # Two recordings by one process within a second are two recordings, not copies of one (each
    # store's source carries its own recording id: this pair was taken for a copy before).
    assert not [f for f in report.findings if f.kind == "same_recording"] and report.record_next is None


def test_each_chain_tap_assumes_the_depth_its_rows_carry(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    """A chain tap's rows carry the fc input's drift (its deepest slot) plus one layer per draft step
    whose decoder layer they are past: that is the depth of its numerics prior, not the model's."""
    report = compare_stores(dc.record_draft(tmp_path / "a.zarr", batches), dc.record_draft(tmp_path / "b.zarr", batches))
    fc_depth = max(d for d in report.plan.budget_depths if d is not None)
    depth = {link["tap_candidate"]: link["metrics"].get("budget_depth") for link in report.chain}
    assert depth["draft_fc_out"] == depth["draft_layer_in"] == fc_depth
    assert depth["draft_layer_out"] == depth["draft_norm_out"] == fc_depth + 1
    assert depth["draft_layer_in_s1"] == fc_depth + 1
    assert depth["draft_layer_out_s1"] == fc_depth + 2
