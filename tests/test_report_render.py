"""The report renderers only format: every fact of a Report shows up in text, Markdown and HTML.

Reports are built by hand (no compare runs here), for the seed bug (the server taps one layer too
late: its segments are the trainer's segments 1 and 2 plus one the trainer never had, the embedding
segment 0 is missing), a clean match, and a degenerate report with NaN metrics and no metrics at all.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from tracediff.report import ReportWriteError, render_html, render_markdown, render_text, write_report
from tracediff.results import (
    REPORT_SCHEMA_VERSION,
    Finding,
    Plan,
    Report,
    RowRef,
    SegmentMatch,
    SegmentMetrics,
    SegmentProfile,
    Side,
)

MALICIOUS = '<script>alert("x")</script>'


# ----------------------------------------------------------------------------------- builders
def _side(role: str, path: str, labels: list[str], aux: dict, hidden: int = 4096) -> Side:
    return Side(
        path=path,
        tap="fc_in",
        role=role,
        rows=2048,
        valid_rows=2040 if role == "candidate" else 2048,
        writers=["rank0"] if role == "candidate" else ["pid4242"],
        width=hidden * len(labels),
        dtype="bfloat16",
        segment_size=hidden,
        segments=len(labels),
        segment_labels=labels,
        sequences=16,
        meta={"model": "meta-llama/Llama-3.1-8B-Instruct"},
        aux_layer_config=aux,
    )


def _plan(**overrides) -> Plan:
    fields = dict(
        tap_reference="fc_in",
        tap_candidate="fc_in",
        segment_size=4096,
        segment_size_source="meta",
        sequences_reference=16,
        sequences_candidate=16,
        sequences_aligned=16,
        sequence_deltas={"0": 15, "12": 1},
        label_offset=0,
        offset_scores={"-2": 0.41, "-1": 0.52, "0": 0.9991, "1": 0.55, "2": 0.43},
        pairs=2040,
        candidate_rows_unaligned=0,
        candidate_rows_duplicate=0,
        candidate_rows_invalid=8,
        reference_rows_uncovered=8,
        sample_rows=512,
        noise_floor=3.1e-6,
        notes=["candidate sequence 'req-3' starts 12 positions later (chat-template preamble)"],
    )
    fields.update(overrides)
    return Plan(**fields)


def _metrics(cand: int, ref: int, cos: float = 0.99998, nan: bool = False) -> SegmentMetrics:
    value = math.nan if nan else cos
    return SegmentMetrics(
        candidate=cand,
        reference=ref,
        rows=2040,
        cos_mean=value,
        cos_p1=math.nan if nan else cos - 2e-5,
        cos_min=math.nan if nan else cos - 9e-5,
        norm_ratio_mean=math.nan if nan else 1.0002,
        norm_ratio_p1=0.9991,
        norm_ratio_p50=1.0001,
        norm_ratio_p99=1.0013,
        rel_l2=math.inf if nan else 0.0061,
        rel_diff_mean=1.9e-5,
        rel_diff_max=8.8e-5,
        max_abs_diff=0.0625,
        max_abs_diff_row=RowRef(seq="req-7", position=311, token_id=128009),
        nonfinite_candidate=3 if nan else 0,
        nonfinite_reference=0,
        worst_rows=[
            {
                "cosine": cos - 1e-4 * k,
                "norm_ratio": 1.0 + 1e-4 * k,
                "candidate": {"seq": f"req-{k}", "position": 40 + k, "token_id": 1000 + k},
                "reference": {"seq": f"{k}", "position": 40 + k, "token_id": 1000 + k},
            }
            for k in range(7)
        ],
        cos_by_position=[
            [float(p), (math.nan if nan and p == 64 else cos - 1e-6 * (p / 64)), 128.0] for p in range(0, 1024, 64)
        ],
        norm_ratio_hist={"edges": [-0.02 + 0.005 * k for k in range(9)], "counts": [1, 4, 60, 900, 950, 110, 12, 3]},
        std_rel_error=math.nan if nan else 0.004,
        std_error_by_position=[[float(p), 0.003 + 1e-3 * (p % 128) / 64, 128.0] for p in range(0, 1024, 64)],
        numerics_budget=0.0352,
        drift_limit=0.1056,
    )


def _profile(kind: str, cand: int, ref: int, std_cos: float, group: str | None = None,
             error: float = 0.9) -> SegmentProfile:
    """A wrong segment against its closest counterpart (or a subset's row group), per position."""
    positions = range(0, 1024, 64)
    return SegmentProfile(
        kind=kind, candidate=cand, reference=ref, group=group, rows=2040, cos_mean=std_cos - 0.07,
        std_cos_mean=math.nan if kind == "segment_subset" else std_cos, norm_ratio_mean=1.9,
        std_rel_error=error, numerics_budget=0.0352, drift_limit=0.1056, same_tensor_cosine=0.99936,
        cos_by_position=[[float(p), std_cos - 0.07 + p / 1e4, 128.0] for p in positions],
        std_cos_by_position=[] if kind == "segment_subset" else [[float(p), std_cos + p / 1e4, 128.0] for p in positions],
        norm_ratio_by_position=[[float(p), 1.9 - p / 2048, 128.0] for p in positions],
        std_error_by_position=[[float(p), error, 128.0] for p in positions],
    )


SEED_CAND_AUX = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "source": "sglang server args"}
SEED_REF_AUX = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "source": "draft config.json"}


def seed_bug_report() -> Report:
    """The seed bug: candidate segment 0 = reference segment 1, candidate segment 1 = reference
    segment 2, reference segment 0 (embedding) missing, candidate segment 2 has no counterpart."""
    reference = _side("reference", "train.zarr", ["hs0", "hs15", "hs28"], SEED_REF_AUX)
    candidate = _side("candidate", "server.zarr", ["aux0", "aux1", "aux2"], SEED_CAND_AUX)
    segment_map = [
        SegmentMatch(0, 1, "moved", 0.99998, 2, 0.8123, "aux0", "hs15"),
        SegmentMatch(1, 2, "moved", 0.99997, 1, 0.7912, "aux1", "hs28"),
        SegmentMatch(2, None, "extra", None, 2, 0.6120, "aux2", None),
    ]
    matrix = [
        [0.0312, 0.99998, 0.8123],
        [0.0287, 0.7912, 0.99997],
        [0.0190, 0.5401, 0.6120],
    ]
    findings = [
        Finding(
            "segment_order",
            "error",
            "candidate segment 0 = reference segment 1, candidate segment 1 = reference segment 2 "
            "(the candidate starts one slot later): check the aux layer ids the server passes to the draft",
            {"shift": 1, "pairs": [[0, 1], [1, 2]]},
        ),
        Finding(
            "segment_missing",
            "error",
            "reference segment 0 (embedding) is missing from the candidate",
            {"reference": 0, "best_candidate_cosine": 0.0312},
        ),
        Finding(
            "segment_extra",
            "error",
            "candidate segment 2 has no counterpart in the reference",
            {"candidate": 2, "best_reference": 2, "best_cosine": 0.612},
        ),
        Finding(
            "config",
            "warning",
            "aux layer ids differ: reference [1, 15, 28], candidate [2, 16, 29]",
            {"path": "eagle_aux_hidden_state_layer_ids"},
        ),
        Finding("precision", "info", "both sides store bfloat16: noise floor 1 - cos = 3.1e-06", {}),
    ]
    return Report(
        reference=reference,
        candidate=candidate,
        plan=_plan(),
        segment_map=segment_map,
        matrix=matrix,
        metrics=[_metrics(0, 1), _metrics(1, 2, 0.99997)],
        findings=findings,
        config_diff=[
            {
                "path": "eagle_aux_hidden_state_layer_ids",
                "change": "values_changed",
                "reference": [1, 15, 28],
                "candidate": [2, 16, 29],
            },
            {"path": "server_args.cuda_graph_max_bs", "change": "added", "candidate": 8},
        ],
        tracediff_version="0.1.0",
    )


def seed_bug_report_with_profiles() -> Report:
    """The seed bug as compare now reports it: the standardised matrix the decisions used, the
    findings' closest counterparts in their evidence, and a per-position profile of each wrong segment."""
    report = seed_bug_report()
    report.matrix_standardised = [
        [0.6162, 0.999995, 0.6735],
        [0.4367, 0.6735, 0.999993],
        [0.3337, 0.5282, 0.7699],
    ]
    for f in report.findings:
        if f.kind == "segment_missing":
            f.evidence = {"reference_segment": 0, "closest_candidate": 0, "closest_standardised_cosine": 0.6162,
                          "closest_cosine": 0.0312}
        elif f.kind == "segment_extra":
            f.evidence = {"candidate_segment": 2, "closest_reference": 2, "closest_standardised_cosine": 0.7699,
                          "closest_cosine": 0.6120}
    report.position_profiles = [_profile("segment_missing", 0, 0, 0.6162), _profile("segment_extra", 2, 2, 0.7699)]
    return report


def clean_match_report() -> Report:
    aux = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    labels = ["hs0", "hs15", "hs28"]
    return Report(
        reference=_side("reference", "train.zarr", labels, aux),
        candidate=_side("candidate", "server.zarr", labels, aux),
        plan=_plan(notes=[]),
        segment_map=[SegmentMatch(k, k, "same", 0.99999, (k + 1) % 3, 0.8, lab, lab) for k, lab in enumerate(labels)],
        matrix=[[0.99999 if i == j else 0.8 for j in range(3)] for i in range(3)],
        metrics=[_metrics(k, k, 0.99999) for k in range(3)],
        findings=[Finding("precision", "info", "both sides store bfloat16: noise floor 1 - cos = 3.1e-06")],
        config_diff=[],
        tracediff_version="0.1.0",
    )


def nan_report(with_metrics: bool) -> Report:
    labels = ["hs0", MALICIOUS]
    aux: dict = {}
    return Report(
        reference=_side("reference", "train.zarr", labels, aux, hidden=8),
        candidate=_side("candidate", f"server-{MALICIOUS}.zarr", labels, aux, hidden=8),
        plan=_plan(noise_floor=math.nan, offset_scores={}, sequence_deltas={}, notes=[MALICIOUS]),
        segment_map=[
            SegmentMatch(0, 0, "same", math.nan, None, None, "hs0", "hs0"),
            SegmentMatch(1, 1, "related", 0.51, None, None, MALICIOUS, MALICIOUS),
        ],
        matrix=[[math.nan, 0.1], [0.2, 0.51]],
        metrics=[_metrics(0, 0, nan=True)] if with_metrics else [],
        findings=[
            Finding("nonfinite", "error", f"candidate has 3 NaN values in segment {MALICIOUS}", {"label": MALICIOUS}),
        ],
        config_diff=[{"path": MALICIOUS, "change": "values_changed", "reference": 1, "candidate": math.nan}],
        tracediff_version="0.1.0",
    )


ALL_REPORTS = {
    "seed_bug": seed_bug_report,
    "clean_match": clean_match_report,
    "nan_metrics": lambda: nan_report(with_metrics=True),
    "no_metrics": lambda: nan_report(with_metrics=False),
}


# ------------------------------------------------------------------------------ the seed bug
SEED_MAP_LINES = [
    "candidate segment 0 (aux0) = reference segment 1 (hs15)",
    "candidate segment 1 (aux1) = reference segment 2 (hs28)",
    "candidate segment 2 (aux2) has no counterpart in the reference",
    "reference segment 0 (hs0) is missing from the candidate",
]


def _one_line(text: str) -> str:
    """Undo terminal wrapping so sentences can be searched whole."""
    return re.sub(r"\s+", " ", text)


def test_verbose_text_report_of_seed_bug_says_how_the_segments_moved():
    report = seed_bug_report()
    text = render_text(report, verbose=True)
    flat = _one_line(text)
    assert text.startswith("tracediff compare: MISMATCH")
    for line in SEED_MAP_LINES:
        assert line in flat
    for finding in report.findings:
        assert _one_line(finding.message) in flat
    assert "eagle_aux_hidden_state_layer_ids=[1, 15, 28], source=draft config.json" in flat
    assert "eagle_aux_hidden_state_layer_ids=[2, 16, 29], source=sglang server args" in flat
    # Matched cells of the matrix are bracketed; the metrics and plan numbers are there.
    assert "[0.999980]" in text and "[0.999970]" in text
    assert "c0->r1" in text and "0.999960" in text
    assert "seq 'req-7' position 311 token 128009" in flat
    assert "candidate=seq 'req-1' position 41 token 1001, reference=seq '1' position 41 token 1001" in flat
    assert "2 more worst rows" in text
    assert "label offset 0 (similarity by offset: -2: 0.41 -1: 0.52 0: 0.9991 +1: 0.55 +2: 0.43)" in flat
    assert "+12: 1 seq" in text and "8 invalid" in text and "3.1e-06" in text
    assert "chat-template preamble" in flat
    # The config diff reads as a diff: one field a line, reference -> candidate, then how it changed.
    assert "eagle_aux_hidden_state_layer_ids: [1, 15, 28] -> [2, 16, 29]  (values_changed)" in text
    assert "server_args.cuda_graph_max_bs: (none) -> 8  (added)" in text


def test_verbose_text_report_puts_the_summary_first_then_sections_in_order():
    text = render_text(seed_bug_report(), verbose=True)
    summary = text.split("\nFindings\n")[0]
    assert "ERROR segment_order" in summary and "ERROR segment_missing" in summary and "WARN" not in summary
    assert "aux layers: eagle_aux_hidden_state_layer_ids=[1, 15, 28]" in summary
    heads = ["Findings", "Segment map", "Segment metrics", "Plan", "Config diff"]
    positions = [text.index(f"\n{h}") for h in heads]
    assert positions == sorted(positions)


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("name", list(ALL_REPORTS))
def test_text_report_fits_100_columns_and_has_no_colour_by_default(name, verbose):
    text = render_text(ALL_REPORTS[name](), verbose=verbose)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "\x1b[" not in text


@pytest.mark.parametrize("verbose", [False, True])
def test_text_report_colours_only_when_asked_and_stays_the_same_text(verbose):
    report = seed_bug_report()
    coloured = render_text(report, color=True, verbose=verbose)
    assert "\x1b[31m" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == render_text(report, verbose=verbose)


def test_default_text_report_is_the_news_only_findings_fix_map_and_one_line_per_pair():
    report = seed_bug_report()
    text = render_text(report)
    flat = _one_line(text)
    assert text.startswith("tracediff compare: MISMATCH")
    # Every finding's message once, errors before warnings before info, without its evidence.
    for finding in report.findings:
        assert flat.count(_one_line(finding.message)) == 1
    tags = [m.group(1) for m in re.finditer(r"^  (ERROR|WARN|INFO) ", text, re.M)]
    assert tags == sorted(tags, key=["ERROR", "WARN", "INFO"].index)
    for line in SEED_MAP_LINES:
        assert line in flat
    assert "[0.999980]" in text and "cosine matrix" in text
    assert len(re.findall(r"^  c\d+->r\d+ \(", text, re.M)) == len(report.metrics)
    for verbose_only in ("\nPlan", "\nConfig diff", "worst row:", "Segment metrics", "label offset"):
        assert verbose_only not in text
    assert "--verbose" in text
    assert len(text.splitlines()) < len(render_text(report, verbose=True).splitlines()) / 1.5


def test_default_text_report_gives_the_fix_value_on_its_own():
    from tracediff.remedy import attach_next_steps

    report = seed_bug_report()
    order = next(f for f in report.findings if f.kind == "segment_order")
    order.evidence["fix"] = {"value": [-1, 14, 27], "field": "eagle_config.eagle_aux_hidden_state_layer_ids",
                             "engine": "sglang", "convention": "sglang", "config_can_fix": True, "reasons": [],
                             "target_layers": [0, 15, 28], "target_from": "reference's recorded aux layers"}
    attach_next_steps(report)
    text = render_text(report)
    box = text[text.index(".- Fix"):text.index("\nFindings")]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [-1, 14, 27]" in box
    assert "tracediff compare train.zarr server.zarr" in box
    order.evidence["fix"].update(value=None, config_can_fix=False, reasons=["The order is set in code."])
    attach_next_steps(report)
    assert "No config value fixes this. The order is set in code." in _one_line(render_text(report))


def test_default_text_report_says_segments_of_a_size_not_a_shape():
    text = render_text(seed_bug_report())
    assert re.search(r"tap fc_in, 3 segments of \d+, ", text)
    assert " x 4096" not in text


def test_quiet_verdict_line_uses_correct_plurals():
    from tracediff.report.text import render_verdict_line

    report = clean_match_report()
    assert render_verdict_line(report) == "match: 0 errors, 0 warnings, 1 info"
    report.findings = [Finding("config", "warning", "one"), Finding("shape", "error", "two"),
                       Finding("shape", "error", "three")]
    # A mismatch counts its root causes first (issue #25), then every finding by severity.
    assert render_verdict_line(report) == f"{report.verdict}: 2 root causes; 2 errors, 1 warning, 0 info"


def test_text_report_neutralises_terminal_escapes_in_labels():
    report = clean_match_report()
    report.candidate.path = "server\x1b[2J.zarr"
    text = render_text(report)
    assert "\x1b" not in text
    assert "server\\x1b[2J.zarr" in text


def test_markdown_report_of_seed_bug_has_the_same_facts_as_tables():
    report = seed_bug_report()
    md = render_markdown(report)
    assert md.startswith("## tracediff compare: **MISMATCH**")
    for line in SEED_MAP_LINES:
        assert line in md
    for finding in report.findings:
        assert f"`{finding.kind}`" in md
    assert "candidate segment 0 = reference segment 1, candidate segment 1 = reference segment 2" in md
    assert (
        "| aux layers | `eagle_aux_hidden_state_layer_ids=[1, 15, 28], source=draft config.json` "
        "| `eagle_aux_hidden_state_layer_ids=[2, 16, 29], source=sglang server args` |"
    ) in md
    assert "| cand 0 `aux0` | 0.031200 | **0.999980** | 0.812300 |" in md
    assert "| c0->r1 | 2040 | 0.999980 | 0.999960 | 0.999890 |" in md
    assert "| `eagle_aux_hidden_state_layer_ids` | values\\_changed | `[1, 15, 28]` | `[2, 16, 29]` |" in md


def test_markdown_report_escapes_user_text():
    md = render_markdown(nan_report(with_metrics=True))
    # Inside code spans the label is literal (and inert); everywhere else it is backslash-escaped.
    outside_code = re.sub(r"`[^`]*`", "", md)
    assert "<script>" not in outside_code
    assert "\\<script\\>" in outside_code


def test_markdown_table_cells_cannot_be_split_by_a_pipe_in_a_label():
    report = clean_match_report()
    report.candidate.segment_labels = ["a|b", "hs15", "hs28"]
    md = render_markdown(report)
    assert "`hs0, hs15, hs28` | `a\\|b, hs15, hs28` |" in md


def test_html_report_of_seed_bug_is_self_contained_and_has_every_fact():
    report = seed_bug_report()
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>")
    assert "tracediff compare: MISMATCH" in page
    assert page.count("<svg") >= 1 + 2 * len(report.metrics) + 1  # heatmap, 2 per pair, offsets
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    for line in SEED_MAP_LINES:
        assert line in page
    for finding in report.findings:
        assert finding.message in page
    assert "eagle_aux_hidden_state_layer_ids=[1, 15, 28], source=draft config.json" in page
    assert "eagle_aux_hidden_state_layer_ids=[2, 16, 29], source=sglang server args" in page
    # Heatmap cells are annotated and the two matched cells are outlined.
    assert ">0.999980</text>" in page and ">0.540100</text>" in page
    assert page.count('fill="none" stroke="#e6550d" stroke-width="3"') == 2


def test_html_report_escapes_a_malicious_label():
    page = render_html(nan_report(with_metrics=True))
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page


@pytest.mark.parametrize("name", list(ALL_REPORTS))
def test_every_renderer_accepts_nan_and_empty_parts(name):
    report = ALL_REPORTS[name]()
    for text in (render_text(report), render_markdown(report), render_html(report)):
        assert report.verdict.upper() in text
        assert report.candidate.path.split("-")[0] in text


def test_report_with_nan_metrics_shows_nan_not_zero():
    report = nan_report(with_metrics=True)
    text = render_text(report, verbose=True)
    assert "c0->r0  2040       nan" in text
    assert "cos mean nan min nan" in _one_line(render_text(report))
    assert "inf" in text and "3/0" in text
    assert "no finite per-position cosine" not in render_html(report)  # one NaN bucket is a gap, not no data


def test_report_without_metrics_says_there_is_nothing_to_measure():
    report = nan_report(with_metrics=False)
    assert "no matched segment pairs" in render_text(report)
    assert "No matched segment pairs" in render_markdown(report)
    assert "No matched segment pairs" in render_html(report)


def test_report_stopped_before_segment_matching_renders():
    report = clean_match_report()
    report.segment_map, report.matrix, report.metrics = [], [], []
    report.findings = [Finding("shape", "error", "candidate rows are 8192 wide, reference rows 12288")]
    for text in (render_text(report), render_markdown(report), render_html(report)):
        assert "8192 wide" in text
        assert "no segment map" in text.lower()


def test_clean_match_says_match_and_lists_no_error():
    report = clean_match_report()
    text = render_text(report)
    assert text.startswith("tracediff compare: MATCH  (0 errors, 0 warnings, 1 info; exit code 0)")
    assert "candidate segment 1 (hs15) = reference segment 1 (hs15) (cos 0.999990, same slot" in _one_line(text)
    assert "missing" not in text and "ERROR" not in text
    assert "**MATCH**" in render_markdown(report)
    assert 'class="verdict match"' in render_html(report)


# ----------------------------------------------------------------------------- JSON and files
@pytest.mark.parametrize("name", list(ALL_REPORTS))
def test_json_round_trips_with_schema_version_and_nan_as_null(name):
    report = ALL_REPORTS[name]()
    data = json.loads(report.to_json())
    assert data["schema_version"] == REPORT_SCHEMA_VERSION
    assert data["verdict"] == report.verdict
    assert data["counts"] == report.counts()
    assert [m["status"] for m in data["segment_map"]] == [m.status for m in report.segment_map]
    if name == "nan_metrics":
        assert data["metrics"][0]["cos_mean"] is None
        assert data["metrics"][0]["rel_l2"] is None
        assert data["matrix"][0][0] is None


def test_write_report_writes_each_requested_file(tmp_path):
    report = seed_bug_report()
    written = write_report(
        report,
        json_path=tmp_path / "r.json",
        markdown_path=tmp_path / "r.md",
        html_path=str(tmp_path / "r.html"),
    )
    assert written == [tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.html"]
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "mismatch"
    assert (tmp_path / "r.md").read_text() == render_markdown(report)
    assert (tmp_path / "r.html").read_text() == render_html(report)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.json", "r.md"]


def test_write_report_writes_only_what_is_asked(tmp_path):
    assert write_report(clean_match_report(), html_path=tmp_path / "only.html") == [tmp_path / "only.html"]
    assert [p.name for p in tmp_path.iterdir()] == ["only.html"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_write_report_leaves_no_file_in_an_unwritable_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ReportWriteError, match="r.json"):
            write_report(seed_bug_report(), json_path=folder / "r.json")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_write_report_leaves_no_file_when_the_folder_refuses_new_files(tmp_path, monkeypatch):
    # The same as a read-only folder, also when the tests run as root (who may write anywhere).
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(path).parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ReportWriteError, match="Permission denied"):
        write_report(seed_bug_report(), json_path=tmp_path / "r.json", html_path=tmp_path / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_write_report_leaves_no_partial_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "r.html"
    target.write_text("old report")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ReportWriteError, match="No space left on device") as caught:
        write_report(seed_bug_report(), html_path=target)
    assert isinstance(caught.value, OSError)
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]
    assert target.read_text() == "old report"


def test_write_report_refuses_a_missing_folder_before_writing_anything(tmp_path):
    with pytest.raises(ReportWriteError, match="does not exist"):
        write_report(seed_bug_report(), json_path=tmp_path / "r.json", html_path=tmp_path / "nope" / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_write_report_refuses_the_same_path_twice(tmp_path):
    from tracediff.errors import UsageError

    with pytest.raises(UsageError, match="twice"):
        write_report(seed_bug_report(), json_path=tmp_path / "r", markdown_path=tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_schema_doc_names_every_field_and_finding_kind():
    from tracediff.results import FINDING_KINDS, SEVERITIES

    doc = (Path(__file__).parents[1] / "docs" / "report-schema.md").read_text()
    data = seed_bug_report().to_dict()
    names = set(data) | set(data["reference"]) | set(data["plan"]) | set(data["segment_map"][0])
    names |= set(data["metrics"][0]) | set(data["findings"][0])
    for name in sorted(names):
        assert f"`{name}`" in doc, name
    for kind in (*FINDING_KINDS, *SEVERITIES):
        assert f"`{kind}`" in doc, kind


def test_text_report_of_many_segments_and_long_names_still_fits_100_columns():
    labels = [f"model.layers.{k}.hidden_states_after_norm" for k in range(12)]
    report = clean_match_report()
    report.reference.segment_labels = report.candidate.segment_labels = labels
    report.reference.segments = report.candidate.segments = 12
    report.candidate.path = "/very/long/path/" + "to/" * 40 + "server.zarr"
    report.segment_map = [SegmentMatch(k, k, "same", 0.99999, None, None, lab, lab) for k, lab in enumerate(labels)]
    report.matrix = [[0.99999 if i == j else 0.7 for j in range(12)] for i in range(12)]
    text = render_text(report)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "ref 11" in text and "cand 11" in text
    assert render_html(report).count("<rect") > 144


# ------------------------------------------------------------------- HTML charts (issue 14)
def _svg_of(page: str, marker: str) -> str:
    """The first <svg> after ``marker`` in the page."""
    start = page.index("<svg", page.index(marker))
    return page[start : page.index("</svg>", start)]


def _line_y(svg: str, css: str) -> tuple[float, float]:
    """(value, drawn y) of the horizontal reference line with class ``css``."""
    m = re.search(rf'<g class="{css}" data-value="([^"]+)"><line [^>]*y1="([-\d.]+)"', svg)
    assert m, css
    return float(m.group(1)), float(m.group(2))


def _point_ys(svg: str, label: str) -> list[float]:
    group = svg[svg.index(f'data-label="{label}"') :]
    group = group[: group.index("</g>")]
    return [float(y) for y in re.findall(r'<circle cx="[-\d.]+" cy="([-\d.]+)"', group)]


def test_html_draws_a_per_position_chart_for_each_wrong_segment():
    report = seed_bug_report_with_profiles()
    page = render_html(report)
    differs = page[page.index('<section id="differs">') : page.index("</section>", page.index('id="differs"'))]
    assert "Reference segment 0 (hs0) is missing: closest is candidate segment 0 (aux0)" in differs
    assert "Candidate segment 2 (aux2) has no counterpart: closest is reference segment 2 (hs28)" in differs
    for anchor, profile in (("profile-missing-c0-r0", report.position_profiles[0]),
                            ("profile-extra-c2-r2", report.position_profiles[1])):
        block = differs[differs.index(f'id="{anchor}"') :]
        cosine, ratio = _svg_of(block, "Cosine by position"), _svg_of(block, "Norm ratio")
        # One point per bucket, its numbers on hover: the decision's standardised cosine, the raw one.
        assert len(_point_ys(cosine, "standardised cosine (decides)")) == len(profile.std_cos_by_position)
        assert len(_point_ys(cosine, "raw cosine")) == len(profile.cos_by_position)
        first = profile.std_cos_by_position[0]
        assert f"standardised cosine {first[1]:.4g} over 128 rows; raw cosine {profile.cos_by_position[0][1]:.4g}" in cosine
        assert _line_y(cosine, "threshold same-tensor")[0] == profile.same_tensor_cosine
        assert len(_point_ys(ratio, "norm ratio")) == len(profile.norm_ratio_by_position)
        assert _line_y(ratio, "ratio-one")[0] == 1.0
        # The finding links to its chart.
        assert f'href="#{anchor}"' in page
    # Points below the same-tensor line (larger y) are the wrong segment's: every one of them here.
    cosine = _svg_of(differs, "Cosine by position")
    _, line = _line_y(cosine, "threshold same-tensor")
    assert all(y > line for y in _point_ys(cosine, "standardised cosine (decides)"))


def test_html_draws_each_subset_group_by_position_with_the_off_row_limit():
    report = seed_bug_report_with_profiles()
    report.position_profiles = [_profile("segment_subset", 1, 1, 0.5, group="decode rows of steps with <= 2 rows",
                                         error=8.7),
                                _profile("segment_subset", 1, 1, 0.99, group="the other rows", error=0.02)]
    report.findings.append(Finding("segment_subset", "error", "Candidate segment 1 is reference segment 1 on most rows",
                                   {"candidate_segment": 1, "reference_segment": 1}))
    page = render_html(report)
    assert 'href="#profile-subset-c1-r1"' in page
    block = page[page.index('id="profile-subset-c1-r1"') :]
    errors = _svg_of(block, "Standardised error by position, per row group")
    budget, budget_y = _line_y(errors, "threshold budget")
    drift, drift_y = _line_y(errors, "threshold drift")
    assert (budget, drift) == (0.0352, 0.1056)
    assert "a row beyond it is off" in errors
    off, rest = _point_ys(errors, "decode rows of steps with &lt;= 2 rows"), _point_ys(errors, "the other rows")
    assert off and rest
    assert all(y < drift_y for y in off) and all(y > budget_y for y in rest)


def test_matched_pair_chart_draws_the_threshold_the_verdict_uses():
    report = clean_match_report()
    report.metrics[1].std_error_by_position[3][1] = 0.2  # one bucket of rows beyond the budget
    page = render_html(report)
    assert "1 - noise floor" not in page  # the storage floor of another metric is no threshold
    for m in report.metrics:
        svg = _svg_of(page, f"Pair c{m.candidate}-&gt;r{m.reference}:")
        value, line = _line_y(svg, "threshold budget")
        assert value == m.numerics_budget == 0.0352
        assert _line_y(svg, "threshold drift")[0] == m.drift_limit
        assert _line_y(svg, "pair-value")[0] == m.std_rel_error
        ys = _point_ys(svg, "RMS standardised error")
        assert len(ys) == len(m.std_error_by_position)
        # Above the dashed line (smaller y) exactly the buckets whose error is beyond the budget.
        beyond = [p[1] > m.numerics_budget for p in m.std_error_by_position]
        assert [y < line for y in ys] == beyond
        assert any(beyond) == (m.candidate == 1)


def test_a_value_finding_links_to_its_pairs_charts():
    report = clean_match_report()
    report.findings.append(Finding("precision", "warning", "candidate segment 1 is reference segment 1 but differs",
                                   {"candidate_segment": 1, "reference_segment": 1}))
    page = render_html(report)
    assert 'href="#pair-c1-r1"' in page and '<div class="pair" id="pair-c1-r1">' in page


def test_a_report_without_per_position_errors_draws_cosines_without_a_made_up_threshold():
    report = clean_match_report()
    for m in report.metrics:
        m.std_error_by_position = []
    page = render_html(report)
    assert "Raw cosine by position" in page and "threshold" not in _svg_of(page, "Raw cosine by position")


def test_heatmap_shows_the_standardised_cosine_decisions_use_with_the_raw_one_on_hover():
    page = render_html(seed_bug_report_with_profiles())
    assert "Standardised cosine (what segment matching decides on; hover a cell for the raw cosine)" in page
    heatmap = _svg_of(page, 'class="heatmap-label"')
    assert ">0.616200</text>" in heatmap and ">0.031200</text>" not in heatmap
    assert ("candidate segment 0 vs reference segment 0: standardised cosine 0.616200 (decides), raw cosine "
            "0.031200") in heatmap
    assert "standardised cosine (\u2264 0 white, nan grey)" in heatmap
    # A report that holds no standardised matrix says its cells are raw cosines.
    page = render_html(seed_bug_report())
    assert "Mean raw cosine (this report holds no standardised matrix)" in page


@pytest.mark.parametrize(("ticks", "labels"), [
    ([0.999998, 0.999999, 1.0], ["1 \u2212 2e-6", "1 \u2212 1e-6", "1"]),
    ([0.9999990, 0.9999995, 1.0], ["1 \u2212 1e-6", "1 \u2212 5e-7", "1"]),
    ([0.2, 0.4, 0.6, 0.8, 1.0], ["0.2", "0.4", "0.6", "0.8", "1.0"]),
    ([0.996, 0.998, 1.0, 1.002], ["0.996", "0.998", "1.000", "1.002"]),
    ([0.9994, 0.9996, 0.9998, 1.0], ["0.9994", "0.9996", "0.9998", "1.0000"]),
    ([-0.5, 0.0, 0.5], ["-0.5", "0.0", "0.5"]),
    ([0, 50, 100, 150], ["0", "50", "100", "150"]),
])
def test_tick_labels_use_the_fewest_decimals_that_tell_ticks_apart(ticks, labels):
    from tracediff.report.ticks import tick_labels

    assert tick_labels(ticks) == labels


@pytest.mark.parametrize(("lo", "hi"), [(0.9999981, 1.0), (0.3, 0.99936), (0.99585, 1.00429), (0.0, 187.0),
                                         (1e-9, 3e-9), (-0.2, 0.0)])
def test_nice_ticks_are_round_and_at_least_three(lo, hi):
    from tracediff.report.ticks import nice_ticks, tick_labels

    ticks = nice_ticks(lo, hi)
    assert 3 <= len(ticks) <= 11
    assert all(lo - 1e-12 <= t <= hi + 1e-12 for t in ticks)
    labels = tick_labels(ticks)
    assert len(set(labels)) == len(labels) and max(len(t) for t in labels) <= 10


def test_no_axis_label_of_a_page_runs_past_1_or_carries_noise_digits():
    report = clean_match_report()
    for m in report.metrics:  # flat at 1 - 1e-6, as identical tensors in bf16 look
        m.cos_by_position = [[float(p), 1 - 1e-6 * (1 + p % 3), 128.0] for p in range(0, 1024, 64)]
        m.std_error_by_position = []
    page = render_html(report)
    labels = re.findall(r'text-anchor="end" font-size="10" fill="#57606a">([^<]*)</text>', page)
    assert labels and "1" in labels
    assert not [t for t in labels if re.fullmatch(r"1\.0*[1-9]\d*", t) or re.search(r"\d\.\d{7,}", t)], labels


def test_config_diff_paths_never_wrap_inside_a_path():
    report = seed_bug_report()
    report.config_diff.append({"path": "store.aux_layers", "change": "values_changed", "reference": {"ids": [0, 3, 6]},
                               "candidate": {"ids": [2, 5, 7]}})
    page = render_html(report)
    config = page[page.index('<section id="config">') :]
    assert '<div class="scroll"><table class="config">' in config
    # One field a row (issue #25): the aux-layer block reads as its changed ids, never as two dicts.
    assert '<td class="path"><code>store.aux_layers.ids</code></td>' in config
    assert '<td class="mono">[0, 3, 6]</td><td class="mono">[2, 5, 7]</td>' in config
    rule = re.search(r"table\.config td\.path, table\.config td\.path code \{([^}]*)\}", page)
    assert rule and "white-space: nowrap" in rule.group(1) and "overflow-wrap: normal" in rule.group(1)


def test_match_summary_names_the_numerics_budget_not_the_noise_floor():
    for text in (render_html(clean_match_report()), render_text(clean_match_report()),
                 render_markdown(clean_match_report())):
        assert "within its numerics budget" in _one_line(text) and "within the noise floor" not in text
    report = clean_match_report()
    report.findings.append(Finding("precision", "warning", "candidate segment 1 is reference segment 1 but differs"))
    for text in (render_html(report), render_text(report), render_markdown(report)):
        assert "1 pair differs beyond what numerics explain" in _one_line(text)


def test_json_holds_the_profiles_and_the_pair_thresholds():
    data = json.loads(seed_bug_report_with_profiles().to_json())
    kinds = [(p["kind"], p["candidate"], p["reference"]) for p in data["position_profiles"]]
    assert kinds == [("segment_missing", 0, 0), ("segment_extra", 2, 2)]
    profile = data["position_profiles"][0]
    assert profile["std_cos_by_position"][0] == [0.0, 0.6162, 128.0]
    assert profile["same_tensor_cosine"] == 0.99936 and profile["group"] is None
    metrics = data["metrics"][0]
    assert (metrics["numerics_budget"], metrics["drift_limit"]) == (0.0352, 0.1056)
    assert metrics["std_error_by_position"][0] == [0.0, 0.003, 128.0]
    # A report without profiles (older compare) still has the key, empty.
    assert json.loads(seed_bug_report().to_json())["position_profiles"] == []
