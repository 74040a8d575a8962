"""The report renderers only format: every fact of a Report shows up in text, Markdown and HTML.

Every report here comes from a real compare of real stores: the shipped samples (the seed bug: the
server feeds the trainer's segments 1 and 2 one slot early plus a state the trainer never had, the
embedding segment 0 is missing; and its fix, a match) and stores recorded here from a tiny real
Llama with one fault each (NaN rows, a hostile segment label and folder name, random rows, labels
one token late on top of the shift, a concatenation order no config fixes, another hidden size,
noise within and beyond the numerics, zeros on an engine's decode rows, twelve long-named segments,
a terminal escape in a folder name; an fp32 trainer against a bf16 one). tests/conftest.py checks
each of them against the JSON schema; a test that turns a report into what an older tracediff
wrote (no per-position errors, no standardised matrix) checks its copy too.
"""

from __future__ import annotations

import copy
import html
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import schema_problems

import tracediff
from tracediff.compare import compare_stores
from tracediff.compare.results import REPORT_SCHEMA_VERSION, Report
from tracediff.demo import default_samples_dir
from tracediff.report import ReportWriteError, render_html, render_markdown, render_text, write_report
from tracediff.report.wording import WORST_ROWS_SHOWN, fmt_cos, fmt_num, fmt_row, signed_text
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

SAMPLES = default_samples_dir()
MALICIOUS = '<script>alert("x")</script>'
#: A folder name cannot hold the slash of MALICIOUS: this one is as hostile without it.
HOSTILE_STORE = 'server-<img src=x onerror="alert(1)">.zarr'
ESCAPE_STORE = "server\x1b[2J.zarr"
H = 32
LAYERS = ["hs0", "hs3", "hs6"]
AUX = {"aux_layers": {"ids": [0, 3, 6], "convention": "hf", "source": "trainer config"}}
LONG_LABELS = [f"model.layers.{k}.hidden_states_after_norm" for k in range(12)]


# ----------------------------------------------------------------------------------- the stores
def _noise(level: float):
    """Gaussian noise of ``level`` x the segment's spread on segment 1 (seeded by the batch)."""

    def transform(x: torch.Tensor, states) -> torch.Tensor:
        g = torch.Generator().manual_seed(x.shape[1])
        x = x.clone()
        seg = x[..., H:2 * H].float()
        x[..., H:2 * H] = (seg + level * seg.std() * torch.randn(seg.shape, generator=g)).to(x.dtype)
        return x

    return transform


def _nan_in_segment_1(last: int | None):
    """NaN in segment 1 on every row, or on the last ``last`` positions of each sequence."""

    def transform(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., -(last or x.shape[1]):, H:2 * H] = float("nan")
        return x

    return transform


def _zeros_on_decode(x: torch.Tensor, states) -> torch.Tensor:
    """Segments 1 and 2 zero on the engine's decode rows (its prefill batches hold more rows)."""
    if x.shape[1] > 3:
        return x
    x = x.clone()
    x[..., H:] = 0
    return x


def _random_rows(x: torch.Tensor, states) -> torch.Tensor:
    g = torch.Generator().manual_seed(x.shape[1])
    return torch.randn(x.shape, generator=g).to(x.dtype)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Report]:
    """name -> the Report of a real compare. The candidates are trainer runs with one fault each,
    except where the fault needs an engine's schedule (decode rows, labels one token late)."""
    root = tmp_path_factory.mktemp("render")
    tl = build_tiny_llama(hidden_size=H, num_layers=6, seed=0)
    seqs = make_sequences(n_seqs=4, min_len=12, max_len=24, seed=1)

    def record(path: Path, runner, layers: list[str], labels: list[str] | None = None, meta: dict | None = None,
               segment_size: int = H, model=tl, dtype: torch.dtype = torch.bfloat16, **kw) -> Path:
        draft = DraftHead(model.hidden_size, len(layers))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tracediff.record(path, role=path.stem, meta=meta or {}) as rec:
            rec.tap(draft.fc, "fc_in", segment_size=segment_size, segment_labels=labels or layers)
            runner(model, draft, seqs, layers, dtype=dtype, on_batch=lambda lab: rec.labels(**lab), **kw)
        assert rec.error is None
        return path

    ref = record(root / "train.zarr", run_trainer, LAYERS)
    hostile = ["hs0", MALICIOUS, "hs6"]
    candidates = {
        # segment 1 NaN on every row, a hostile label, folder name and meta key
        "nan": record(root / HOSTILE_STORE, run_trainer, LAYERS, hostile, {MALICIOUS: 1},
                      transform=_nan_in_segment_1(None)),
        "nan_rows": record(root / "nan_rows.zarr", run_trainer, LAYERS, hostile, transform=_nan_in_segment_1(6)),
        "no_metrics": record(root / "random.zarr", run_trainer, LAYERS, transform=_random_rows),
        # the seed bug's shift with labels one token late: two root causes
        "two_causes": record(root / "late.zarr", run_engine, ["hs3", "hs6", "pre_norm"], label_shift=1,
                             prefill_len=lambda i, seq: len(seq) - 2),
        "stopped": record(root / "halved.zarr", run_trainer, LAYERS, [f"s{k}" for k in range(6)],
                          segment_size=H // 2),
        "precision": record(root / "noisy.zarr", run_trainer, LAYERS, ["hs0", "a|b", "hs6"], transform=_noise(0.1)),
        "value": record(root / "noisier.zarr", run_trainer, LAYERS, transform=_noise(0.3)),
        "escape": record(root / ESCAPE_STORE, run_trainer, LAYERS),
        "subset": record(root / "decode_zeros.zarr", run_engine, LAYERS, transform=_zeros_on_decode,
                         prefill_len=lambda i, seq: 8),
    }
    out = {name: compare_stores(ref, path) for name, path in candidates.items()}
    # an fp32 trainer against the bf16 one: errors, within the numerics budget
    out["bf16"] = compare_stores(record(root / "train_fp32.zarr", run_trainer, LAYERS, dtype=torch.float32), ref)
    # the same layers recorded on both sides, concatenated in another order: no config value fixes it
    out["in_code"] = compare_stores(record(root / "train_aux.zarr", run_trainer, LAYERS, meta=AUX),
                                    record(root / "permuted.zarr", run_trainer, ["hs3", "hs0", "hs6"], LAYERS, meta=AUX))
    deep = build_tiny_llama(hidden_size=16, num_layers=11, seed=0)
    twelve = [f"hs{k}" for k in range(12)]
    long_path = root.joinpath("very", "long", "path", *["to"] * 40, "server.zarr")
    out["many"] = compare_stores(record(root / "train12.zarr", run_trainer, twelve, LONG_LABELS, segment_size=16,
                                        model=deep),
                                 record(long_path, run_trainer, twelve, LONG_LABELS, segment_size=16, model=deep))
    out["seed"] = compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr")
    out["clean"] = compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr")
    return out


ALL_REPORTS = ["seed", "clean", "nan", "nan_rows", "no_metrics", "two_causes", "in_code", "stopped", "precision",
               "value", "escape", "many", "bf16", "subset"]


def older(report: Report, **fields) -> Report:
    """A copy of ``report`` with ``fields`` as an older tracediff wrote them, checked against the schema."""
    out = copy.deepcopy(report)
    for name, value in fields.items():
        setattr(out, name, value)
    problems = schema_problems(json.loads(out.to_json()), "compare")
    assert not problems, problems
    return out


def _box(text: str, title: str) -> str:
    """The text of the box titled ``title`` on one line: its frame and the commands' line breaks taken out."""
    lines = text[text.index(f".- {title}"):].splitlines()
    body = [line.removeprefix("  |") for line in lines[1:lines.index(next(x for x in lines if x.startswith("  '")))]]
    return _one_line("\n".join(body)).strip()


def _one_line(text: str) -> str:
    """Undo terminal wrapping (and a command's continuation backslashes) so sentences can be searched whole."""
    return re.sub(r"\s+", " ", re.sub(r" \\\n", " ", text))


# ------------------------------------------------------------------------------ the seed bug
SEED_MAP_LINES = [
    "candidate segment 0 (hs3) = reference segment 1 (hs3)",
    "candidate segment 1 (hs6) = reference segment 2 (hs6)",
    "candidate segment 2 (hs8_pre_norm) has no counterpart in the reference",
    "reference segment 0 (hs0) is missing from the candidate",
]
SEED_AUX = ["physical [0, 3, 6] (HF hidden_states numbering; from store.aux_layers, hf numbering [0, 3, 6])",
            "physical [3, 6, 8] (HF hidden_states numbering; from store.aux_layers, sglang numbering [2, 5, 7])"]


def test_verbose_text_report_of_seed_bug_says_how_the_segments_moved(reports):
    report = reports["seed"]
    text = render_text(report, verbose=True)
    flat = _one_line(text)
    assert text.startswith("tracediff compare: MISMATCH")
    for line in SEED_MAP_LINES + SEED_AUX:
        assert line in flat
    for finding in report.findings:
        assert _one_line(finding.message) in flat
    # Matched cells of the matrix are bracketed, the others not; the metrics and plan numbers are there.
    chosen = {(m.candidate, m.reference) for m in report.segment_map if m.reference is not None}
    assert chosen == {(0, 1), (1, 2)}
    for i, row in enumerate(report.matrix):
        for j, value in enumerate(row):
            assert (f"[{fmt_cos(value)}]" if (i, j) in chosen else f" {fmt_cos(value)} ") in text
    for m in report.metrics:
        assert f"c{m.candidate}->r{m.reference}" in text and fmt_cos(m.cos_p1) in text
        assert f"max abs diff at {fmt_row(m.max_abs_diff_row)}" in flat
        shown = [f"worst row: cosine={fmt_num(row['cosine'], 6)}" for row in m.worst_rows[:WORST_ROWS_SHOWN]]
        assert all(line in flat for line in shown)
        more = len(m.worst_rows) - WORST_ROWS_SHOWN
        assert (f"{more} more worst rows" in text) if more > 0 else ("more worst rows" not in text)
    plan = report.plan
    scores = "  ".join(f"{signed_text(k)}: {fmt_num(v)}" for k, v in plan.offset_scores.items())
    assert _one_line(f"label offset {signed_text(plan.label_offset)} (similarity by offset: {scores})") in flat
    assert f"{plan.pairs} aligned rows" in text and f"{plan.candidate_rows_invalid} invalid" in text
    for note in plan.notes:
        assert _one_line(note) in flat
    # The config diff reads as a diff: one field a line, reference -> candidate, then how it changed.
    assert "store.aux_layers.ids: [0, 3, 6] -> [2, 5, 7]  (values_changed)" in text
    assert "store.server_args.dtype: (none) -> bfloat16  (dictionary_item_added)" in text


def test_verbose_text_report_puts_the_summary_first_then_sections_in_order(reports):
    text = render_text(reports["seed"], verbose=True)
    summary = _one_line(text.split("\nFindings\n")[0])
    assert "ERROR segment_order" in summary and "ERROR segment_missing" in summary and "WARN" not in summary
    assert f"aux layers: {SEED_AUX[0]}" in summary
    heads = ["Findings", "Segment map", "Segment metrics", "Plan", "Config diff"]
    positions = [text.index(f"\n{h}") for h in heads]
    assert positions == sorted(positions)


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("name", ALL_REPORTS)
def test_text_report_fits_100_columns_and_has_no_colour_by_default(reports, name, verbose):
    text = render_text(reports[name], verbose=verbose)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "\x1b[" not in text


@pytest.mark.parametrize("verbose", [False, True])
def test_text_report_colours_only_when_asked_and_stays_the_same_text(reports, verbose):
    report = reports["seed"]
    coloured = render_text(report, color=True, verbose=verbose)
    assert "\x1b[31m" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == render_text(report, verbose=verbose)


def test_default_text_report_is_the_news_only_findings_fix_map_and_one_line_per_pair(reports):
    report = reports["seed"]
    text = render_text(report)
    flat = _one_line(text)
    assert text.startswith("tracediff compare: MISMATCH")
    # Every finding's message once, each root cause before what follows from it, without its evidence.
    for finding in report.findings:
        assert flat.count(_one_line(finding.message)) == 1
    order = [flat.index(_one_line(f.message)) for f in report.findings]
    kinds = [f.kind for _, f in sorted(zip(order, report.findings, strict=True), key=lambda p: p[0])]
    assert kinds == ["segment_order", "segment_missing", "segment_extra", "config", "config"]
    for line in SEED_MAP_LINES:
        assert line in flat
    assert f"[{fmt_cos(report.matrix[0][1])}]" in text and "cosine matrix" in text
    assert len(re.findall(r"^  c\d+->r\d+ \(", text, re.M)) == len(report.metrics) == 2
    for verbose_only in ("\nPlan", "\nConfig diff", "worst row:", "Segment metrics", "label offset"):
        assert verbose_only not in text
    assert "--verbose" in text
    assert len(text.splitlines()) < len(render_text(report, verbose=True).splitlines()) / 1.5


def test_default_text_report_gives_the_fix_value_on_its_own(reports):
    report = reports["seed"]
    text = render_text(report)
    box = _box(text, "Fix")
    assert box.startswith("eagle_config.eagle_aux_hidden_state_layer_ids = [-1, 2, 5] ")
    assert f"tracediff compare {report.reference.path} {report.candidate.path}" in box
    # The same layers recorded on both sides, concatenated in another order: the box says it is code.
    in_code = render_text(reports["in_code"])
    assert ".- Fix: in code, not a config value" in in_code
    box = _box(in_code, "Fix")
    assert box.startswith("No config value fixes this. Both sides are configured for the same physical layers [0, 3, 6]")
    assert " = [" not in box


def test_default_text_report_says_segments_of_a_size_not_a_shape(reports):
    text = render_text(reports["seed"])
    assert "tap fc_in, 3 segments of 64, " in text
    assert " x 64" not in text and "192 x" not in text


def test_quiet_verdict_line_uses_correct_plurals(reports):
    from tracediff.report.text import render_verdict_line

    assert render_verdict_line(reports["clean"]) == "match: 0 errors, 0 warnings, 2 info"
    # A mismatch counts its root causes first (issue #25), then every finding by severity.
    assert render_verdict_line(reports["seed"]) == "mismatch: 1 root cause, 2 consequences; 3 errors, 1 warning, 1 info"
    two = reports["two_causes"]
    assert [f.kind for f in two.findings if f.severity == "error" and "explained_by" not in f.evidence] == [
        "token_offset", "segment_order"]
    assert render_verdict_line(two).startswith("mismatch: 2 root causes, 2 consequences; 4 errors, 1 warning, ")


def test_text_report_neutralises_terminal_escapes_in_paths(reports):
    report = reports["escape"]
    assert "\x1b[2J" in report.candidate.path
    text = render_text(report, verbose=True)
    assert "\x1b" not in text
    assert "server\\x1b[2J.zarr" in text


def test_markdown_report_of_seed_bug_has_the_same_facts_as_tables(reports):
    report = reports["seed"]
    md = render_markdown(report)
    assert md.startswith("## tracediff compare: **MISMATCH**")
    for line in SEED_MAP_LINES:
        assert line.replace("_", "\\_") in md  # Markdown escapes the underscore of a label
    for finding in report.findings:
        assert f"`{finding.kind}`" in md
    assert "candidate segment 0 (hs3) = reference segment 1 (hs3), candidate segment 1 (hs6) = reference" in md
    assert f"| aux layers | `{SEED_AUX[0]}" in md and f"` | `{SEED_AUX[1]}" in md
    row = report.matrix[0]
    assert f"| cand 0 `hs3` | {fmt_cos(row[0])} | **{fmt_cos(row[1])}** | {fmt_cos(row[2])} |" in md
    m = report.metrics[0]
    assert f"| c0->r1 | 192 | {fmt_cos(m.cos_mean)} | {fmt_cos(m.cos_p1)} | {fmt_cos(m.cos_min)} |" in md
    assert "| `store.aux_layers.ids` | values\\_changed | `[0, 3, 6]` | `[2, 5, 7]` |" in md


def test_markdown_report_escapes_user_text(reports):
    md = render_markdown(reports["nan"])
    assert any(MALICIOUS in f.message for f in reports["nan"].findings)
    # Inside code spans the label is literal (and inert); everywhere else it is backslash-escaped.
    outside_code = re.sub(r"`[^`]*`", "", md)
    assert "<script>" not in outside_code and '<img src=x onerror="alert(1)">' not in outside_code
    assert "\\<script\\>" in outside_code


def test_markdown_table_cells_cannot_be_split_by_a_pipe_in_a_label(reports):
    md = render_markdown(reports["precision"])
    assert "`hs0, hs3, hs6` | `hs0, a\\|b, hs6` |" in md


def test_html_report_of_seed_bug_is_self_contained_and_has_every_fact(reports):
    report = reports["seed"]
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>")
    assert "tracediff compare: MISMATCH" in page
    # heatmap, 2 per pair, 2 per wrong segment's profile, offsets
    assert page.count("<svg") >= 1 + 2 * len(report.metrics) + 2 * len(report.position_profiles) + 1
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    for line in SEED_MAP_LINES + SEED_AUX:
        assert line in page
    for finding in report.findings:
        assert html.escape(finding.message) in page
    # Heatmap cells are annotated with the matrix the decisions used and the two matched cells outlined.
    for row in report.matrix_standardised:
        for value in row:
            assert f">{fmt_cos(value)}</text>" in page
    assert page.count('fill="none" stroke="#e6550d" stroke-width="3"') == 2


def test_html_report_escapes_a_malicious_label_and_folder_name(reports):
    report = reports["nan"]
    assert HOSTILE_STORE in report.candidate.path and MALICIOUS in report.candidate.segment_labels
    page = render_html(report)
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert html.escape(HOSTILE_STORE) in page


@pytest.mark.parametrize("name", ALL_REPORTS)
def test_every_renderer_renders_every_report(reports, name):
    report = reports[name]
    for text in (render_text(report), render_text(report, verbose=True), render_markdown(report),
                 render_html(report)):
        assert report.verdict.upper() in text
        assert report.reference.tap in text


def test_report_with_nan_values_shows_nan_not_zero(reports):
    report = reports["nan"]  # candidate segment 1 is NaN on every row: its cosines are NaN
    assert all(math.isnan(v) for v in report.matrix[1])
    text = render_text(report, verbose=True)
    matrix_row = next(line for line in text.splitlines() if line.startswith("  cand 1 "))
    assert matrix_row.split()[-3:] == ["nan", "nan", "nan"]
    assert "| cand 1 " in render_markdown(report) and "| nan | nan | nan |" in render_markdown(report)
    assert "candidate segment 1 vs reference segment 1: standardised cosine nan" in render_html(report)
    rows = reports["nan_rows"]  # NaN on decode rows only: those rows are left out of the pair and counted
    pair = next(m for m in rows.metrics if m.candidate == 1)
    assert pair.nonfinite_candidate > 0
    assert f"{pair.nonfinite_candidate}/{pair.nonfinite_reference}" in render_text(rows, verbose=True)
    assert f"non-finite {pair.nonfinite_candidate}/{pair.nonfinite_reference} rows" in _one_line(render_text(rows))
    assert "no finite per-position cosine" not in render_html(rows)


def test_report_without_metrics_says_there_is_nothing_to_measure(reports):
    report = reports["no_metrics"]  # random rows: no candidate segment is any reference segment
    assert report.metrics == [] and report.segment_map
    assert "no matched segment pairs" in render_text(report)
    assert "No matched segment pairs" in render_markdown(report)
    assert "No matched segment pairs" in render_html(report)


def test_report_stopped_before_segment_matching_renders(reports):
    report = reports["stopped"]  # another hidden size: nothing is compared
    assert (report.segment_map, report.matrix, report.metrics) == ([], [], [])
    shape = next(f for f in report.findings if f.kind == "shape")
    for text in (render_text(report), render_markdown(report), render_html(report)):
        assert "reference segments are 32 wide" in _one_line(text) and "candidate segments 16" in _one_line(text)
        assert "no segment map" in text.lower()
    assert html.escape(shape.message) in render_html(report)


def test_clean_match_says_match_and_lists_no_error(reports):
    report = reports["clean"]
    text = render_text(report)
    assert text.startswith("tracediff compare: MATCH  (0 errors, 0 warnings, 2 info; exit code 0)")
    pair = next(m for m in report.segment_map if m.candidate == 1)
    assert f"candidate segment 1 (hs3) = reference segment 1 (hs3) (cos {fmt_cos(pair.cosine)}," in _one_line(text)
    assert "same slot" in _one_line(text) and "missing" not in text and "ERROR" not in text
    assert "**MATCH**" in render_markdown(report)
    assert 'class="verdict match"' in render_html(report)


# ----------------------------------------------------------------------------- JSON and files
@pytest.mark.parametrize("name", ALL_REPORTS)
def test_json_round_trips_with_schema_version_and_nan_as_null(reports, name):
    report = reports[name]
    data = json.loads(report.to_json())
    assert data["schema_version"] == REPORT_SCHEMA_VERSION
    assert data["verdict"] == report.verdict
    assert data["counts"] == report.counts()
    assert [m["status"] for m in data["segment_map"]] == [m.status for m in report.segment_map]
    if name == "nan":
        assert data["matrix"][1] == [None, None, None]
        assert data["segment_map"][1]["cosine"] is None


def test_write_report_writes_each_requested_file(reports, tmp_path):
    report = reports["seed"]
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


def test_write_report_writes_only_what_is_asked(reports, tmp_path):
    assert write_report(reports["clean"], html_path=tmp_path / "only.html") == [tmp_path / "only.html"]
    assert [p.name for p in tmp_path.iterdir()] == ["only.html"]


def test_write_report_leaves_no_file_in_an_unwritable_folder(reports):
    """As a user that file permissions apply to: as root the write runs as nobody (root writes anywhere)."""
    from test_hostile_inputs import _unprivileged  # noqa: PLC0415

    shared = Path(tempfile.mkdtemp(prefix="tracediff-perm-", dir="/tmp"))  # a folder other users may enter
    try:
        shared.chmod(0o755)
        folder = shared / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        with _unprivileged(), pytest.raises(ReportWriteError, match="r.json"):
            write_report(reports["seed"], json_path=folder / "r.json")
        assert list(folder.iterdir()) == []
    finally:
        shutil.rmtree(shared)


def test_write_report_leaves_no_file_when_the_folder_refuses_new_files(reports, tmp_path, monkeypatch):
    # The same as a read-only folder, also when the tests run as root (who may write anywhere).
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(path).parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ReportWriteError, match="Permission denied"):
        write_report(reports["seed"], json_path=tmp_path / "r.json", html_path=tmp_path / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_write_report_leaves_no_partial_file_when_the_write_fails(reports, tmp_path, monkeypatch):
    target = tmp_path / "r.html"
    target.write_text("old report")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ReportWriteError, match="No space left on device") as caught:
        write_report(reports["seed"], html_path=target)
    assert isinstance(caught.value, OSError)
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]
    assert target.read_text() == "old report"


def test_write_report_refuses_a_missing_folder_before_writing_anything(reports, tmp_path):
    with pytest.raises(ReportWriteError, match="does not exist"):
        write_report(reports["seed"], json_path=tmp_path / "r.json", html_path=tmp_path / "nope" / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_write_report_refuses_the_same_path_twice(reports, tmp_path):
    from tracediff.errors import UsageError

    with pytest.raises(UsageError, match="twice"):
        write_report(reports["seed"], json_path=tmp_path / "r", markdown_path=tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


def test_schema_doc_names_every_field_and_finding_kind(reports):
    from tracediff.compare.results import FINDING_KINDS, SEVERITIES

    doc = (Path(__file__).parents[1] / "docs" / "report-schema.md").read_text()
    data = reports["seed"].to_dict()
    names = set(data) | set(data["reference"]) | set(data["plan"]) | set(data["segment_map"][0])
    names |= set(data["metrics"][0]) | set(data["findings"][0])
    for name in sorted(names):
        assert f"`{name}`" in doc, name
    for kind in (*FINDING_KINDS, *SEVERITIES):
        assert f"`{kind}`" in doc, kind


def test_text_report_of_many_segments_and_long_names_still_fits_100_columns(reports):
    report = reports["many"]
    assert report.candidate.segment_labels == LONG_LABELS and len(report.candidate.path) > 160
    assert report.verdict == "match" and len(report.metrics) == 12
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


def test_html_draws_a_per_position_chart_for_each_wrong_segment(reports):
    report = reports["seed"]
    assert [(p.kind, p.candidate, p.reference) for p in report.position_profiles] == [
        ("segment_missing", 0, 0), ("segment_extra", 2, 2)]
    page = render_html(report)
    differs = page[page.index('<section id="differs">') : page.index("</section>", page.index('id="differs"'))]
    assert "Reference segment 0 (hs0) is missing: closest is candidate segment 0 (hs3)" in differs
    assert "Candidate segment 2 (hs8_pre_norm) has no counterpart: closest is reference segment 2 (hs6)" in differs
    for anchor, profile in (("profile-missing-c0-r0", report.position_profiles[0]),
                            ("profile-extra-c2-r2", report.position_profiles[1])):
        block = differs[differs.index(f'id="{anchor}"') :]
        cosine, ratio = _svg_of(block, "Cosine by position"), _svg_of(block, "Norm ratio")
        # One point per bucket, its numbers on hover: the decision's standardised cosine, the raw one.
        assert len(_point_ys(cosine, "standardised cosine (decides)")) == len(profile.std_cos_by_position)
        assert len(_point_ys(cosine, "raw cosine")) == len(profile.cos_by_position)
        first, raw = profile.std_cos_by_position[0], profile.cos_by_position[0]
        assert (f"standardised cosine {fmt_num(first[1], 4)} over {fmt_num(int(first[2]))} rows; raw cosine "
                f"{fmt_num(raw[1], 4)}") in cosine
        assert _line_y(cosine, "threshold same-tensor")[0] == profile.same_tensor_cosine
        assert len(_point_ys(ratio, "norm ratio")) == len(profile.norm_ratio_by_position)
        assert _line_y(ratio, "ratio-one")[0] == 1.0
        # The finding links to its chart.
        assert f'href="#{anchor}"' in page
    # Points below the same-tensor line (larger y) are the wrong segment's: every one of them here.
    cosine = _svg_of(differs, "Cosine by position")
    _, line = _line_y(cosine, "threshold same-tensor")
    assert all(y > line for y in _point_ys(cosine, "standardised cosine (decides)"))


def test_html_draws_each_subset_group_by_position_with_the_off_row_limit(reports):
    report = reports["subset"]  # zeros in segments 1 and 2 on decode rows
    group, rest = (p for p in report.position_profiles if (p.kind, p.candidate) == ("segment_subset", 1))
    page = render_html(report)
    assert 'href="#profile-subset-c1-r1"' in page
    block = page[page.index('id="profile-subset-c1-r1"') :]
    errors = _svg_of(block, "Standardised error by position, per row group")
    budget, budget_y = _line_y(errors, "threshold budget")
    drift, drift_y = _line_y(errors, "threshold drift")
    assert (budget, drift) == (group.numerics_budget, group.drift_limit)
    assert "a row beyond it is off" in errors
    label = group.group if len(group.group) <= 40 else group.group[:39] + "\u2026"  # legends are cut at 40
    off, healthy = _point_ys(errors, html.escape(label)), _point_ys(errors, html.escape(rest.group))
    assert len(off) == len(group.std_error_by_position) and len(healthy) == len(rest.std_error_by_position)
    assert all(y < drift_y for y in off) and all(y > budget_y for y in healthy)


def test_matched_pair_chart_draws_the_threshold_the_verdict_uses(reports):
    report = reports["bf16"]  # a bf16 engine against an fp32 trainer: errors, within the budget
    page = render_html(report)
    assert "1 - noise floor" not in page  # the storage floor of another metric is no threshold
    for m in report.metrics:
        svg = _svg_of(page, f"Pair c{m.candidate}-&gt;r{m.reference}:")
        value, line = _line_y(svg, "threshold budget")
        assert value == m.numerics_budget
        assert _line_y(svg, "threshold drift")[0] == m.drift_limit
        assert _line_y(svg, "pair-value")[0] == m.std_rel_error
        ys = _point_ys(svg, "RMS standardised error")
        assert len(ys) == len(m.std_error_by_position)
        # Above the dashed line (smaller y) exactly the buckets whose error is beyond the budget.
        assert [y < line for y in ys] == [p[1] > m.numerics_budget for p in m.std_error_by_position]


def test_a_value_finding_links_to_its_pairs_charts(reports):
    for name, kind in (("precision", "precision"), ("value", "segment_value")):
        report = reports[name]
        finding = next(f for f in report.findings if f.kind == kind)
        assert (finding.evidence["candidate_segment"], finding.evidence["reference_segment"]) == (1, 1)
        page = render_html(report)
        assert 'href="#pair-c1-r1"' in page and '<div class="pair" id="pair-c1-r1">' in page


def test_a_report_without_per_position_errors_draws_cosines_without_a_made_up_threshold(reports):
    report = reports["bf16"]
    metrics = copy.deepcopy(report.metrics)
    for m in metrics:
        m.std_error_by_position = []
    page = render_html(older(report, metrics=metrics))
    assert "Raw cosine by position" in page and "threshold" not in _svg_of(page, "Raw cosine by position")


def test_heatmap_shows_the_standardised_cosine_decisions_use_with_the_raw_one_on_hover(reports):
    report = reports["seed"]
    std, raw = report.matrix_standardised[0][0], report.matrix[0][0]
    assert fmt_cos(std) != fmt_cos(raw)
    page = render_html(report)
    assert "Standardised cosine (what segment matching decides on; hover a cell for the raw cosine)" in page
    heatmap = _svg_of(page, 'class="heatmap-label"')
    assert f">{fmt_cos(std)}</text>" in heatmap and f">{fmt_cos(raw)}</text>" not in heatmap
    assert (f"candidate segment 0 vs reference segment 0: standardised cosine {fmt_cos(std)} (decides), raw cosine "
            f"{fmt_cos(raw)}") in heatmap
    assert "standardised cosine (\u2264 0 white, nan grey)" in heatmap
    # A report that holds no standardised matrix says its cells are raw cosines.
    page = render_html(older(report, matrix_standardised=[]))
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


def test_no_axis_label_of_a_page_runs_past_1_or_carries_noise_digits(reports):
    # A bf16 engine's raw cosines sit just below 1, where axis labels like 1.0000010 would creep in.
    report = reports["bf16"]
    metrics = copy.deepcopy(report.metrics)
    for m in metrics:
        m.std_error_by_position = []  # so that the raw cosine is what each pair's chart draws
    assert all(0.999 < p[1] < 1 for m in metrics for p in m.cos_by_position)
    page = render_html(older(report, metrics=metrics))
    labels = re.findall(r'text-anchor="end" font-size="10" fill="#57606a">([^<]*)</text>', page)
    assert labels and any(t == "1" or t.startswith("1 \u2212") for t in labels)
    assert not [t for t in labels if re.fullmatch(r"1\.0*[1-9]\d*", t) or re.search(r"\d\.\d{7,}", t)], labels


def test_config_diff_paths_never_wrap_inside_a_path(reports):
    page = render_html(reports["seed"])
    config = page[page.index('<section id="config">') :]
    assert '<div class="scroll"><table class="config">' in config
    # One field a row (issue #25): the aux-layer block reads as its changed ids, never as two dicts.
    assert '<td class="path"><code>store.aux_layers.ids</code></td>' in config
    assert '<td class="mono">[0, 3, 6]</td><td class="mono">[2, 5, 7]</td>' in config
    rule = re.search(r"table\.config td\.path, table\.config td\.path code \{([^}]*)\}", page)
    assert rule and "white-space: nowrap" in rule.group(1) and "overflow-wrap: normal" in rule.group(1)


def test_match_summary_names_the_numerics_budget_not_the_noise_floor(reports):
    clean = reports["clean"]
    for text in (render_html(clean), render_text(clean), render_markdown(clean)):
        assert "within its numerics budget" in _one_line(text) and "within the noise floor" not in text
    report = reports["precision"]  # noise beyond the numerics budget, within the drift limit: a warning
    assert report.verdict == "match" and "precision" in [f.kind for f in report.findings if f.severity == "warning"]
    for text in (render_html(report), render_text(report), render_markdown(report)):
        assert "1 pair differs beyond what numerics explain" in _one_line(text)


def test_json_holds_the_profiles_and_the_pair_thresholds(reports):
    report = reports["seed"]
    data = json.loads(report.to_json())
    kinds = [(p["kind"], p["candidate"], p["reference"]) for p in data["position_profiles"]]
    assert kinds == [("segment_missing", 0, 0), ("segment_extra", 2, 2)]
    profile, missing = data["position_profiles"][0], report.position_profiles[0]
    assert profile["std_cos_by_position"] == missing.std_cos_by_position
    assert profile["same_tensor_cosine"] == missing.same_tensor_cosine and profile["group"] is None
    metrics, pair = data["metrics"][0], report.metrics[0]
    assert (metrics["numerics_budget"], metrics["drift_limit"]) == (pair.numerics_budget, pair.drift_limit)
    assert metrics["std_error_by_position"] == pair.std_error_by_position
    assert 0 < pair.numerics_budget < pair.drift_limit
    # A report without wrong segments has the key, empty.
    assert json.loads(reports["clean"].to_json())["position_profiles"] == []
