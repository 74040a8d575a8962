"""HTML rendering of a compare report: one self-contained file to open, attach or archive.

No external resource, no script: the charts are inline SVG drawn from the report's own numbers
(segment heatmap of the standardised cosines segment matching decided on, per-position profiles of
every wrong segment and subset group, each matched pair's standardised error by position against the
numerics budget its findings use, norm-ratio histograms, offset scores), the styles are inline CSS,
and hover details use SVG ``<title>``. Every piece of user text (paths, labels, messages, evidence)
goes through :func:`html.escape`. Formats only: this module decides nothing about the data; every
threshold line is a number of the report (``SegmentMetrics.numerics_budget``, ``drift_limit``,
``SegmentProfile.same_tensor_cosine``).
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from tracediff.report.text import (
    CHANGE_EVIDENCE,
    EVIDENCE_CHARS,
    METRICS_ERROR_HEADERS,
    METRICS_SCALE_HEADERS,
    RECORD_NEXT_TITLE,
    RECORDED_CONFIG,
    SEVERITY_TITLES,
    TABLE_EVIDENCE,
    box_steps,
    candidate_labels,
    change_lines,
    config_diff_items,
    fix_assignment,
    fix_heading,
    fmt_cos,
    fmt_num,
    fmt_row,
    fmt_value,
    group_table,
    grouped_findings,
    matched_cells,
    metrics_cells_error,
    metrics_cells_scale,
    pair_name,
    plan_items,
    plural_counts,
    reference_labels,
    segment_map_sentences,
    segment_name,
    side_items,
    signed_text,
    verdict_sentence,
)
from tracediff.results import SEVERITIES, Finding, Report, SegmentMetrics, SegmentProfile

# A sequential blue ramp for cosines in [0, 1]; negative cosines clamp to the first stop.
_RAMP = (
    (0.0, (247, 251, 255)),
    (0.25, (198, 219, 239)),
    (0.5, (107, 174, 214)),
    (0.75, (33, 113, 181)),
    (1.0, (8, 48, 107)),
)
_MATCH_STROKE = "#e6550d"
_FONT = "font-family:ui-sans-serif,system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif"

_CSS = """
:root { --err:#c62828; --warn:#b26a00; --info:#1565c0; --ok:#2e7d32; --line:#d0d7de; --muted:#57606a; }
* { box-sizing: border-box; }
body { margin: 0; background: #f6f8fa; color: #1f2328;
  font: 14px/1.45 ui-sans-serif, system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 24px 40px; }
header.verdict { padding: 18px 24px; color: #fff; }
header.verdict.mismatch { background: var(--err); }
header.verdict.match { background: var(--ok); }
header.verdict h1 { margin: 0 0 4px; font-size: 26px; letter-spacing: .02em; }
header.verdict p { margin: 0; opacity: .95; }
header.verdict code { background: rgba(255,255,255,.18); color: #fff; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px;
  margin: 16px 0; }
h2 { font-size: 18px; margin: 0 0 10px; }
h3 { font-size: 15px; margin: 14px 0 6px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
  font-size: 12.5px; }
code { background: #f0f2f4; padding: 1px 4px; border-radius: 4px; overflow-wrap: anywhere; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.kv th { width: 150px; background: none; color: var(--muted); font-weight: 500; }
table.sides td { overflow-wrap: anywhere; }
tr.aux td { background: #fff8e1; font-weight: 600; }
ul.findings { list-style: none; margin: 0; padding: 0; }
ul.findings > li { border-left: 4px solid var(--line); padding: 6px 10px; margin: 6px 0; background: #fafbfc; }
ul.findings > li.error { border-color: var(--err); }
ul.findings > li.warning { border-color: var(--warn); }
ul.findings > li.info { border-color: var(--info); }
.sev { display: inline-block; min-width: 58px; font-size: 11px; font-weight: 700; text-transform: uppercase;
  color: #fff; border-radius: 3px; padding: 1px 6px; margin-right: 6px; text-align: center; }
.sev.error { background: var(--err); } .sev.warning { background: var(--warn); } .sev.info { background: var(--info); }
.kind { font-family: ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace; font-size: 12.5px;
  color: var(--muted); margin-right: 6px; }
table.evidence { margin: 4px 0 0 70px; font-size: 12.5px; }
table.evidence th { background: none; color: var(--muted); font-weight: 500; border: 0; padding: 1px 10px 1px 0; }
table.evidence td { border: 0; padding: 1px 0; overflow-wrap: anywhere; }
table.evidence summary { cursor: pointer; color: var(--muted); }
ul.map { margin: 0 0 8px; padding-left: 0; list-style: none; }
ul.map li { margin: 4px 0; display: flex; align-items: baseline; }
ul.map li .status { flex: none; }
svg { max-width: 100%; height: auto; }
.status { display: inline-block; min-width: 70px; font-size: 11px; font-weight: 700; text-transform: uppercase;
  border-radius: 3px; padding: 1px 6px; margin-right: 6px; text-align: center; border: 1px solid; }
.status.same { color: var(--ok); } .status.moved, .status.related { color: var(--warn); }
.status.missing, .status.extra, .status.duplicate { color: var(--err); }
.charts { display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start; }
.chart.heatmap { display: inline-block; max-width: 100%; }
.chart { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; background: #fff; }
.chart h3 { margin: 0 0 4px; font-size: 13px; }
.muted { color: var(--muted); }
.chart p.muted { margin: 0 0 6px; font-size: 12px; }
.scroll { overflow-x: auto; }
table.config td.path, table.config td.path code { white-space: nowrap; overflow-wrap: normal; word-break: keep-all; }
.profile { margin: 10px 0 18px; }
.profile h3 { margin: 6px 0 2px; }
.profile p.caption { margin: 0 0 8px; color: var(--muted); font-size: 12.5px; }
a.chart-link { margin-left: 8px; font-size: 12px; white-space: nowrap; }
footer { color: var(--muted); font-size: 12px; text-align: center; margin-top: 24px; }
header.verdict p.cause { margin-top: 6px; font-size: 16px; font-weight: 600; opacity: 1; }
section.box { border-width: 2px; border-left-width: 8px; }
section.box.fix { border-color: var(--ok); background: #f3faf4; }
section.box.record-next { border-color: var(--warn); background: #fff8e1; }
section.box h2 { margin-bottom: 6px; }
section.box p { margin: 6px 0; }
p.assignment { font-size: 17px; margin: 8px 0 10px; }
p.assignment code { font-size: 16px; padding: 3px 8px; background: #fff; border: 1px solid var(--line); }
pre.commands { background: #1f2328; color: #f6f8fa; padding: 8px 12px; border-radius: 6px; overflow-x: auto;
  font: 12.5px/1.5 ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; margin: 4px 0 8px; }
ul.findings > li.cause { border-left-width: 6px; }
div.follows { margin: 8px 0 2px 24px; }
div.follows h4 { margin: 6px 0 2px; font-size: 13px; color: var(--muted); font-weight: 600; }
ul.changes { margin: 4px 0 2px 70px; padding: 0; list-style: none; font-size: 12.5px; }
ul.changes li { margin: 1px 0; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _replay(report: Report) -> str:
    if not report.replay:
        return ""
    from tracediff.report.replay import html_table  # noqa: PLC0415

    return ("<section><h2>Replay: what the mismatch costs the draft</h2>"
            f"<p>{_e(report.replay.get('conclusion', ''))}</p>{html_table(report.replay, _e)}</section>")


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML document (inline CSS and SVG, no script)."""
    title = f"tracediff: {report.verdict} ({report.reference.path} vs {report.candidate.path})"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head><body>",
        _header(report),
        "<main>",
        _boxes(report),
        _summary(report),
        _findings(report),
        _what_differs(report),
        _segment_map(report),
        _metrics(report),
        _plan(report),
        _config_diff(report),
        _replay(report),
        f"<footer>tracediff {_e(report.tracediff_version)} &middot; report schema {report.schema_version}"
        " &middot; the JSON report (--json) holds every number</footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------- sections
def _header(report: Report) -> str:
    sentence = verdict_sentence(report)
    cause = f'<p class="cause">{_e(sentence)}</p>' if sentence else ""
    return (
        f'<header class="verdict {_e(report.verdict)}"><h1>tracediff compare: {_e(report.verdict.upper())}</h1>'
        f"<p>{_e(plural_counts(report.counts()))} &middot; exit code {report.exit_code()} &middot; "
        f"reference <code>{_e(report.reference.path)}</code> vs candidate <code>{_e(report.candidate.path)}</code></p>"
        f"{cause}</header>"
    )


def _commands(commands: list[str]) -> str:
    return f'<pre class="commands">{_e(chr(10).join(commands))}</pre>' if commands else ""


def _boxes(report: Report) -> str:
    """The Fix box and the "what to record next" box: first on the page, above the summary."""
    out = []
    if report.fix:
        fix = report.fix
        out.append(f'<section class="box fix" id="fix"><h2>{_e(fix_heading(fix))}</h2>')
        assignment = fix_assignment(fix)
        if assignment:
            out.append(f'<p class="assignment"><code>{_e(assignment)}</code></p>')
        for text, commands in box_steps(fix):
            out.append(f"<p>{_e(text)}</p>{_commands(commands)}")
        out.append("</section>")
    if report.record_next:
        box = report.record_next
        out.append(f'<section class="box record-next" id="record-next"><h2>{_e(RECORD_NEXT_TITLE)}</h2>')
        out += [f"<p>{_e(r)}</p>" for r in box.get("reasons") or []]
        for text, commands in box_steps(box):
            out.append(f"<p>{_e(text)}</p>{_commands(commands)}")
        out.append("</section>")
    return "\n".join(out)


def _summary(report: Report) -> str:
    out = ['<section id="summary"><h2>Summary</h2>']
    ref_items = dict(side_items(report.reference))
    cand_items = dict(side_items(report.candidate))
    order = ["path", "aux layers"] + [k for k in ref_items if k not in ("path", "aux layers")]
    out.append('<table class="sides"><tr><th></th><th>reference</th><th>candidate</th></tr>')
    for name in order:
        css = ' class="aux"' if name == "aux layers" else ""
        mono = name in ("path", "aux layers", "segments", "tap")
        ref, cand = (f"<code>{_e(v)}</code>" if mono else _e(v) for v in (ref_items[name], cand_items[name]))
        out.append(f"<tr{css}><th>{_e(name)}</th><td>{ref}</td><td>{cand}</td></tr>")
    out.append("</table></section>")
    return "\n".join(out)


def _finding_card(report: Report, f: Finding, extra_css: str = "", inner: str = "") -> str:
    anchor = _profile_anchor(report, f)
    link = f'<a class="chart-link" href="#{anchor}">per-position chart</a>' if anchor else ""
    out = [f'<li class="{f.severity}{extra_css}"><span class="sev {f.severity}">{_e(f.severity)}</span>'
           f'<span class="kind">{_e(f.kind)}</span>{_e(f.message)}{link}']
    table = group_table(f)
    if table is not None:
        out.append(_table(*table, numeric_last=False))
        out.append(_group_chart(f))
    changes = change_lines(f)
    if changes:
        out.append('<ul class="changes">' + "".join(f'<li class="mono">{_e(c)}</li>' for c in changes) + "</ul>")
    shown = [(k, v) for k, v in f.evidence.items() if k not in TABLE_EVIDENCE and not (changes and k in CHANGE_EVIDENCE)]
    if shown:
        out.append('<table class="evidence">')
        out += [f"<tr><th>{_e(k)}</th><td>{_evidence_value(v)}</td></tr>" for k, v in shown]
        out.append("</table>")
    out.append(inner)
    out.append("</li>")
    return "\n".join(out)


def _findings(report: Report) -> str:
    out = ['<section id="findings"><h2>Findings</h2>']
    if not report.findings:
        out.append('<p class="muted">None.</p>')
    grouped, rest = grouped_findings(report)
    if grouped:
        out.append(f"<h3>Root causes ({len(grouped)}), each with what follows from it</h3>")
        out.append('<ul class="findings causes">')
        for root, consequences, config in grouped:
            inner = []
            for heading, group in ((f"Follows from it ({len(consequences)})", consequences),
                                   (RECORDED_CONFIG[0].upper() + RECORDED_CONFIG[1:].rstrip(":"), config)):
                if group:
                    inner.append(f'<div class="follows"><h4>{_e(heading)}</h4><ul class="findings consequences">')
                    inner += [_finding_card(report, f) for f in group]
                    inner.append("</ul></div>")
            out.append(_finding_card(report, root, " cause", "\n".join(inner)))
        out.append("</ul>")
    for severity in SEVERITIES:
        group = [f for f in rest if f.severity == severity]
        if not group:
            continue
        out.append(f"<h3>{_e(SEVERITY_TITLES[severity])} ({len(group)})</h3>")
        out.append('<ul class="findings">')
        out += [_finding_card(report, f) for f in group]
        out.append("</ul>")
    out.append("</section>")
    return "\n".join(out)


def _group_chart(f: Finding) -> str:
    """Bars of the median standardised error per group of a subset finding, with the numerics budget."""
    groups = [g for g in f.evidence.get("groups", []) if isinstance(g, dict) and _finite(g.get("median_std_error"))]
    if not groups:
        return _no_data("no finite errors to draw")
    top = max(float(g["median_std_error"]) for g in groups) or 1.0
    width, bar, left = 460, 18, 150
    body = []
    for k, g in enumerate(groups):
        y = 8 + k * (bar + 6)
        w = max(1.0, (width - left - 60) * float(g["median_std_error"]) / top)
        body.append(f'<text x="4" y="{y + 13}" font-size="11">{_e(_short(str(g.get("group", "")), 24))}</text>')
        body.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{"#cf222e" if k == 0 else "#2da44e"}"/>')
        body.append(f'<text x="{left + w + 4:.1f}" y="{y + 13}" font-size="11">{float(g["median_std_error"]):.3g}</text>')
    return _svg(width, 14 + len(groups) * (bar + 6), body, "median standardised error by group")


def _evidence_value(value: Any) -> str:
    """Short values inline; long ones (a whole matrix) folded, so the findings stay readable."""
    text = fmt_value(value)
    if len(text) <= EVIDENCE_CHARS:
        return f'<span class="mono">{_e(text)}</span>'
    return (
        f'<details><summary class="mono">{_e(text[:80])} &hellip; ({len(text)} chars)</summary>'
        f'<div class="mono">{_e(text)}</div></details>'
    )


def _segment_map(report: Report) -> str:
    out = ['<section id="segments"><h2>Segment map</h2>']
    sentences = segment_map_sentences(report)
    if not sentences:
        out.append('<p class="muted">No segment map: compare stopped before matching segments.</p>')
    else:
        out.append('<ul class="map">')
        out += [f'<li><span class="status {_e(s)}">{_e(s)}</span>{_e(text)}</li>' for s, text in sentences]
        out.append("</ul>")
    if report.matrix:
        what = ("Standardised cosine (what segment matching decides on; hover a cell for the raw cosine)"
                if _has_standardised(report) else "Mean raw cosine (this report holds no standardised matrix)")
        out.append(
            f'<div class="chart heatmap scroll"><h3 class="heatmap-label">{what}</h3><p class="muted">Candidate '
            f"segment x reference segment, on the plan sample; outlined: matched.</p>{_heatmap(report)}</div>"
        )
    out.append("</section>")
    return "\n".join(out)


def _metrics(report: Report) -> str:
    out = ['<section id="metrics"><h2>Segment metrics</h2>']
    if not report.metrics:
        out.append('<p class="muted">No matched segment pairs: nothing to measure.</p></section>')
        return "\n".join(out)
    out.append('<div class="scroll">')
    out.append(_table(METRICS_SCALE_HEADERS, [metrics_cells_scale(m) for m in report.metrics]))
    rows = [[*metrics_cells_error(m), fmt_row(m.max_abs_diff_row)] for m in report.metrics]
    out.append(_table([*METRICS_ERROR_HEADERS, "max abs diff at"], rows, numeric_last=False))
    out.append("</div>")
    for m in report.metrics:
        out.append(
            f'<div class="pair" id="pair-c{m.candidate}-r{m.reference}">'
            f"<h3>Pair {_e(pair_name(m))}: candidate segment {m.candidate} vs reference segment {m.reference}</h3>"
        )
        out.append('<div class="charts">')
        if m.std_error_by_position:
            out.append('<div class="chart"><h3>Standardised error by position (the decision metric)</h3>'
                       f"{_error_chart(m)}</div>")
        else:
            out.append(f'<div class="chart"><h3>Raw cosine by position</h3>{_cosine_chart(m)}</div>')
        out.append(f'<div class="chart"><h3>Norm ratio |cand| / |ref|</h3>{_histogram(m)}</div>')
        out.append("</div>")
        if m.worst_rows:
            keys: list[str] = []
            for row in m.worst_rows:
                keys += [k for k in row if k not in keys]
            out.append(f"<details><summary>Worst rows ({len(m.worst_rows)})</summary>")
            out.append(
                _table(keys, [[fmt_value(row.get(k)) for k in keys] for row in m.worst_rows], numeric_last=False)
            )
            out.append("</details>")
        out.append("</div>")
    out.append("</section>")
    return "\n".join(out)


def _plan(report: Report) -> str:
    p = report.plan
    out = ['<section id="plan"><h2>Plan</h2><div class="charts"><div>', '<table class="kv">']
    out += [f"<tr><th>{_e(name)}</th><td>{_e(value)}</td></tr>" for name, value in plan_items(report)]
    out.append("</table>")
    if p.notes:
        out.append("<h3>Notes</h3><ul>" + "".join(f"<li>{_e(n)}</li>" for n in p.notes) + "</ul>")
    out.append("</div>")
    if p.offset_scores:
        out.append(f'<div class="chart"><h3>Similarity by label offset (chosen: {p.label_offset})</h3>')
        out.append(_offset_chart(p.offset_scores, p.label_offset) + "</div>")
    out.append("</div></section>")
    return "\n".join(out)


def _config_diff(report: Report) -> str:
    out = ['<section id="config"><h2>Config diff</h2>']
    items = config_diff_items(report)
    if not items:
        out.append('<p class="muted">No differences in the recorded meta.</p>')
    else:
        out.append('<div class="scroll"><table class="config"><tr><th>path</th><th>change</th><th>reference</th>'
                   "<th>candidate</th></tr>")
        out += [
            f'<tr><td class="path"><code>{_e(path)}</code></td><td>{_e(change)}</td>'
            f'<td class="mono">{_e(ref)}</td><td class="mono">{_e(cand)}</td></tr>'
            for path, change, ref, cand in items
        ]
        out.append("</table></div>")
    out.append("</section>")
    return "\n".join(out)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_last: bool = True) -> str:
    """A table whose first column is a name and the others numbers (the last one text unless numeric_last)."""

    def css(k: int) -> str:
        numeric = k > 0 and (numeric_last or k < len(headers) - 1)
        return ' class="num"' if numeric else ""

    out = ["<table><tr>" + "".join(f"<th{css(k)}>{_e(h)}</th>" for k, h in enumerate(headers)) + "</tr>"]
    out += ["<tr>" + "".join(f"<td{css(k)}>{_e(c)}</td>" for k, c in enumerate(r)) + "</tr>" for r in rows]
    out.append("</table>")
    return "\n".join(out)


# ------------------------------------------------------------------------------ SVG charts
def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{_e(label)}" style="{_FONT}">'
        + "".join(body)
        + "</svg>"
    )


def _finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _cos_color(value: Any) -> str:
    if not _finite(value):
        return "#d9d9d9"
    t = min(1.0, max(0.0, float(value)))
    for (t0, c0), (t1, c1) in itertools.pairwise(_RAMP):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            r, g, b = (round(a + (z - a) * f) for a, z in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    return "#08306b"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _has_standardised(report: Report) -> bool:
    return bool(report.matrix_standardised) and len(report.matrix_standardised) == len(report.matrix)


def _heatmap(report: Report) -> str:
    """The standardised cosine matrix (what matching decided on), the raw one on hover; the raw one
    alone for a report without a standardised matrix."""
    cand = candidate_labels(report)
    ref = reference_labels(report)
    chosen = matched_cells(report)
    standardised = _has_standardised(report)
    shown = report.matrix_standardised if standardised else report.matrix
    metric = "standardised cosine" if standardised else "cosine"
    rows = len(report.matrix)
    cols = len(ref)
    cw, ch = 92, 44
    row_names = [f"cand {i} \u00b7 {_short(cand[i], 14)}" if i < len(cand) else f"cand {i}" for i in range(rows)]
    left = 14 + 7 * max((len(n) for n in row_names), default=6)
    top = 46
    width = left + cw * cols + 20
    height = top + ch * rows + 56
    body = []
    for j in range(cols):
        x = left + cw * j + cw / 2
        body.append(f'<text x="{x:.1f}" y="18" text-anchor="middle" font-size="12" font-weight="600">ref {j}</text>')
        body.append(
            f'<text x="{x:.1f}" y="34" text-anchor="middle" font-size="11" fill="#57606a">{_e(_short(ref[j], 12))}'
            f"<title>{_e(ref[j])}</title></text>"
        )
    for i, row in enumerate(shown):
        raw_row = report.matrix[i]
        y = top + ch * i
        body.append(
            f'<text x="{left - 8}" y="{y + ch / 2 + 4:.1f}" text-anchor="end" font-size="12">{_e(row_names[i])}'
            f"<title>{_e(cand[i] if i < len(cand) else i)}</title></text>"
        )
        for j in range(cols):
            value = row[j] if j < len(row) else None
            x = left + cw * j
            fill = _cos_color(value)
            dark = _finite(value) and float(value) > 0.55
            raw = raw_row[j] if j < len(raw_row) else None
            tip = (f"candidate segment {i} vs reference segment {j}: standardised cosine {fmt_cos(value)} "
                   f"(decides), raw cosine {fmt_cos(raw)}" if standardised
                   else f"candidate segment {i} vs reference segment {j}: mean cosine {fmt_cos(value)}")
            body.append(
                f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" fill="{fill}" stroke="#fff" stroke-width="1">'
                f"<title>{_e(tip)}</title></rect>"
            )
            body.append(
                f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle" font-size="12" '
                f'fill="{"#fff" if dark else "#1f2328"}" pointer-events="none">{_e(fmt_cos(value))}</text>'
            )
    for i, j in sorted(chosen):
        if i < rows and j is not None and j < cols:
            body.append(
                f'<rect x="{left + cw * j + 2}" y="{top + ch * i + 2}" width="{cw - 4}" height="{ch - 4}" fill="none" '
                f'stroke="{_MATCH_STROKE}" stroke-width="3" rx="3"/>'
            )
    # Colour legend, 0 .. 1.
    ly = top + ch * rows + 18
    lw = min(240, cw * max(cols, 2))
    body.append(
        '<defs><linearGradient id="tracediff-cos-ramp" x1="0" x2="1" y1="0" y2="0">'
        + "".join(f'<stop offset="{t}" stop-color="{_cos_color(t)}"/>' for t, _ in _RAMP)
        + "</linearGradient></defs>"
    )
    body.append(
        f'<rect x="{left}" y="{ly}" width="{lw}" height="10" fill="url(#tracediff-cos-ramp)" stroke="#d0d7de"/>'
    )
    for t in (0.0, 0.5, 1.0):
        body.append(
            f'<text x="{left + lw * t:.1f}" y="{ly + 24}" text-anchor="middle" font-size="10" fill="#57606a">{t:g}</text>'
        )
    body.append(
        f'<text x="{left + lw + 10}" y="{ly + 9}" font-size="10" fill="#57606a">{metric} (\u2264 0 white, nan grey)</text>'
    )
    gap = 230 if standardised else 180
    body.append(
        f'<rect x="{left + lw + gap}" y="{ly - 1}" width="16" height="12" fill="none" stroke="{_MATCH_STROKE}" stroke-width="2"/>'
        f'<text x="{left + lw + gap + 20}" y="{ly + 9}" font-size="10" fill="#57606a">matched</text>'
    )
    width = max(width, left + lw + gap + 80)
    return _svg(width, height, body, f"segment {metric} heatmap")


# ------------------------------------------------------------------------------ ticks
def _nice_step(span: float, count: int = 5) -> float:
    """The 1, 2 or 5 x 10^k step that cuts ``span`` into about ``count - 1`` intervals."""
    raw = span / max(1, count - 1)
    if not math.isfinite(raw) or raw <= 0:
        return 1.0
    exp = math.floor(math.log10(raw))
    for mult in (1, 2, 5):
        if mult * 10.0**exp >= raw * (1 - 1e-9):
            return mult * 10.0**exp
    return 10.0 ** (exp + 1)


def _smaller_step(step: float) -> float:
    """The next smaller round step: 5 -> 2 -> 1 -> 0.5 (x 10^k)."""
    exp = math.floor(math.log10(step) + 1e-9)
    mult = round(step / 10.0**exp)
    return {5: 2, 2: 1}.get(mult, 0.5) * 10.0**exp


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values (multiples of a 1, 2 or 5 x 10^k step) from ``lo`` to ``hi``: about ``count``
    of them, and at least 3 (a finer step when the range falls between round values)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    step = _nice_step(hi - lo, count)
    for _ in range(4):
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first >= 2:
            break
        step = _smaller_step(step)
    return [k * step for k in range(first, last + 1)]


def _fewest_decimals(values: Sequence[float]) -> int:
    """The fewest decimals whose labels tell every value apart, each within 1% of the smallest gap."""
    ordered = sorted(values)
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
    tolerance = 0.01 * min(gaps) if gaps else 0.0
    for d in range(0, 13):
        labels = [f"{v:.{d}f}" for v in values]
        if len(set(labels)) == len(set(values)) and all(abs(float(t) - v) <= tolerance for t, v in
                                                           zip(labels, values, strict=True)):
            return d
    return 12


def _shortest(value: float, tolerance: float) -> str:
    """``value`` in the fewest significant digits within ``tolerance`` (``2e-6``, ``1.5e-5``)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if abs(float(text) - value) <= tolerance:
            return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), text)
    return f"{value:g}"


def tick_labels(values: Sequence[float]) -> list[str]:
    """Axis labels that are short and tell the ticks apart: the fewest decimals that do
    (``0.4 0.6 0.8 1.0``), and for ticks that need 6 or more, all within 0.001 below 1 (a cosine
    axis near 1), ``1 - x`` (``1 − 4e-6``, ``1 − 2e-6``, ``1``): never ``1.0000010``."""
    values = [float(v) for v in values]
    if not values:
        return []
    decimals = _fewest_decimals(values)
    if decimals >= 6 and len(values) > 1 and all(1 - 1e-3 <= v <= 1 + 1e-12 for v in values):
        ordered = sorted(values)
        gap = min((b - a for a, b in itertools.pairwise(ordered) if b > a), default=1e-6)
        out = []
        for v in values:
            below = 1.0 - v
            out.append("1" if abs(below) <= 0.01 * gap else f"1 \u2212 {_shortest(below, 0.01 * gap)}")
        return out
    if decimals > 6:  # tiny values: in scientific notation, each as short as it can be
        ordered = sorted(values)
        gap = min((b - a for a, b in itertools.pairwise(ordered) if b > a), default=abs(values[0]) or 1.0)
        return ["0" if v == 0 else _shortest(v, 0.01 * gap) for v in values]
    labels = [f"{v:.{decimals}f}" for v in values]
    return [re.sub(r"^-(0(\.0*)?)$", r"\1", t) for t in labels]  # never "-0.0"


def _decade_label(exp: int) -> str:
    return f"{10.0**exp:g}" if -3 <= exp <= 4 else f"1e{exp}"


# ------------------------------------------------------------------------------ line charts
_BLUE, _ORANGE, _RED, _GREEN, _GREY = "#1f77b4", "#e6550d", "#cf222e", "#2da44e", "#57606a"
_DASHED, _DOTTED = "5 3", "1.5 3"


@dataclass
class _Line:
    """One series of ``[[x, y, rows], ...]`` points, with its hover text per point."""

    points: list[list[float]]
    color: str
    label: str
    tip: Callable[[list[float]], str]
    width: float = 1.8


@dataclass
class _Rule:
    """A horizontal line at a value of the report (a threshold, ratio 1, the whole pair's value)."""

    y: float
    label: str
    color: str = _GREY
    dash: str = _DASHED
    anchor: str = "end"  # where its label sits: "end" (right) or "start" (left)
    css: str = "threshold"
    in_legend: bool = False  # named in the legend instead of beside the line (a value drawn over the data)


def _axes(
    body: list[str],
    box: tuple[float, float, float, float],
    y_ticks: list[tuple[float, str]],
    x_ticks: list[tuple[float, str]],
) -> None:
    left, top, right, bottom = box
    body.append(
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="#fbfcfd" stroke="#d0d7de"/>'
    )
    for y, label in y_ticks:
        body.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeef2"/>')
        body.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" fill="#57606a">{_e(label)}</text>'
        )
    for x, label in x_ticks:
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#8c959f"/>')
        body.append(
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="10" fill="#57606a">{_e(label)}</text>'
        )


def _no_data(text: str, width: int = 460, height: int = 60) -> str:
    return _svg(width, height, [f'<text x="10" y="34" font-size="12" fill="#57606a">{_e(text)}</text>'], text)


def _finite_points(points: list[list[float]]) -> list[list[float]]:
    return [p for p in points if len(p) >= 2 and _finite(p[0]) and _finite(p[1])]


def _xy_chart(lines: list[_Line], rules: list[_Rule], *, aria: str, y_label: str, log: bool = False,
              cosine: bool = False, nonnegative: bool = False, empty: str = "no finite values by position") -> str:
    """Series by position with horizontal reference lines, every line and tick in view.

    ``log``: a log10 y axis in whole decades (values at or below its floor, zeros included, sit on
    the floor, drawn hollow); ``cosine``: the axis never runs above 1 when no value does;
    ``nonnegative``: nor below 0 when no value does."""
    drawn = [line for line in lines if _finite_points(line.points)]
    if not drawn:
        return _no_data(empty)
    width, height = 460, 236
    legend = len(lines) > 1 or any(r.in_legend for r in rules)
    left, top, right, bottom = 66.0, 26.0 if legend else 14.0, width - 12.0, height - 40.0
    ys = [float(p[1]) for line in drawn for p in _finite_points(line.points)]
    marks = [float(r.y) for r in rules if _finite(r.y)]
    body: list[str] = []
    if log:
        positive = [v for v in ys + marks if v > 0]
        zeros = any(v <= 0 for v in ys)  # a decade below the smallest value, so zeros stand apart
        lo_e = math.floor(math.log10(min(positive))) - (1 if zeros else 0) if positive else -6
        hi_e = math.ceil(math.log10(max(positive)) + 1e-9) if positive else 0
        if hi_e <= lo_e:
            hi_e = lo_e + 1
        lo_e = max(lo_e, hi_e - 8)
        floor_value = 10.0**lo_e
        on_floor = [v for v in ys if v <= floor_value]
        floor_label = ("0" if on_floor and all(v <= 0 for v in on_floor) else
                       f"\u2264{_decade_label(lo_e)}" if on_floor else _decade_label(lo_e))

        def sy(v: float) -> float:
            e = math.log10(v) if v > floor_value else lo_e
            return bottom - (min(e, hi_e) - lo_e) / (hi_e - lo_e) * (bottom - top)

        every = 1 if hi_e - lo_e <= 6 else 2
        y_ticks = [(sy(10.0**e), floor_label if e == lo_e else _decade_label(e)) for e in range(lo_e, hi_e + 1)
                   if (hi_e - e) % every == 0 or e == lo_e]
    else:
        lo, hi = min(ys + marks), max(ys + marks)
        top_value, bottom_value = hi, lo
        span = hi - lo if hi > lo else max(abs(hi) * 2e-3, 1e-9)
        lo, hi = lo - 0.06 * span, hi + 0.06 * span
        step = _nice_step(hi - lo)
        lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step
        if cosine and top_value <= 1.0:
            hi = min(hi, 1.0)
        if nonnegative and bottom_value >= 0.0:
            lo = max(lo, 0.0)
        lo_, hi_ = lo, hi

        def sy(v: float) -> float:
            return bottom - (v - lo_) / (hi_ - lo_) * (bottom - top)

        values = nice_ticks(lo, hi)
        y_ticks = list(zip([sy(v) for v in values], tick_labels(values), strict=True))
    xs = [float(p[0]) for line in drawn for p in _finite_points(line.points)]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1

    def sx(v: float) -> float:
        return left + (v - x0) / (x1 - x0) * (right - left)

    x_values = [v for v in nice_ticks(x0, x1) if float(v).is_integer()] or [x0, x1]
    _axes(body, (left, top, right, bottom), y_ticks, [(sx(v), fmt_num(round(v))) for v in x_values])
    # Reference lines; a label that would overlap the previous one goes below its line.
    placed: list[float] = []
    for rule in sorted((r for r in rules if _finite(r.y)), key=lambda r: sy(float(r.y))):
        y = sy(float(rule.y))
        ty = y - 4
        if any(abs(ty - p) < 11 for p in placed) or ty < top + 9:
            ty = y + 11
        x = right - 4 if rule.anchor == "end" else left + 4
        dash = f' stroke-dasharray="{rule.dash}"' if rule.dash else ""
        text = ""
        if not rule.in_legend:
            placed.append(ty)
            text = (f'<text x="{x:.1f}" y="{ty:.1f}" text-anchor="{rule.anchor}" font-size="10" '
                    f'fill="{rule.color}">{_e(rule.label)}</text>')
        body.append(
            f'<g class="{_e(rule.css)}" data-value="{float(rule.y)!r}"><line x1="{left}" x2="{right}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="{rule.color}" stroke-width="1.3"{dash}/>{text}<title>{_e(rule.label)}</title></g>'
        )
    for line in drawn:
        # Break the line where the value is not finite, so a NaN bucket shows as a gap.
        runs: list[list[str]] = [[]]
        for p in line.points:
            if len(p) >= 2 and _finite(p[0]) and _finite(p[1]):
                runs[-1].append(f"{sx(float(p[0])):.1f},{sy(float(p[1])):.1f}")
            elif runs[-1]:
                runs.append([])
        body.append(f'<g class="series" data-label="{_e(line.label)}">')
        for run in runs:
            if len(run) > 1:
                body.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{line.color}" '
                            f'stroke-width="{line.width}"/>')
        if len(line.points) <= 200:
            for p in line.points:
                if len(p) < 2 or not _finite(p[0]):
                    continue
                tip = line.tip(p)
                if not _finite(p[1]):
                    body.append(f'<text x="{sx(float(p[0])):.1f}" y="{bottom - 4}" text-anchor="middle" font-size="10" '
                                f'fill="#c62828">\u00d7<title>{_e(tip)}</title></text>')
                    continue
                hollow = log and float(p[1]) <= floor_value
                fill = "#fff" if hollow else line.color
                if hollow:
                    tip += " (at or below the axis floor)"
                body.append(f'<circle cx="{sx(float(p[0])):.1f}" cy="{sy(float(p[1])):.1f}" r="2.6" fill="{fill}" '
                            f'stroke="{line.color}"><title>{_e(tip)}</title></circle>')
        body.append("</g>")
    if legend:
        x = left
        keys = [(line.color, "", line.label) for line in lines]
        keys += [(r.color, r.dash, r.label) for r in rules if r.in_legend and _finite(r.y)]
        for color, dash, label in keys:
            pattern = f' stroke-dasharray="{dash}"' if dash else ""
            body.append(f'<line x1="{x:.1f}" x2="{x + 14:.1f}" y1="10" y2="10" stroke="{color}" stroke-width="3"{pattern}/>'
                        f'<text x="{x + 18:.1f}" y="13" font-size="10" fill="#1f2328">{_e(label)}</text>')
            x += 30 + 5.6 * len(label)
    body.append(f'<text x="{(left + right) / 2:.1f}" y="{height - 6}" text-anchor="middle" font-size="11">'
                "position</text>")
    body.append(f'<text transform="translate(12 {(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle" '
                f'font-size="11" fill="#57606a">{_e(y_label)}</text>')
    return _svg(width, height, body, aria)


def _bucket_tip(what: str, p: list[float], digits: int = 4) -> str:
    rows = fmt_num(int(p[2])) if len(p) > 2 and _finite(p[2]) else "-"
    return f"positions from {fmt_num(p[0])}: {what} {fmt_num(p[1], digits)} over {rows} rows"


def _budget_rules(budget: Any, drift: Any, drift_text: str) -> list[_Rule]:
    rules = []
    if _finite(budget):
        rules.append(_Rule(budget, f"numerics budget {fmt_num(budget, 3)}: beyond it, a precision warning", _RED,
                           _DASHED, css="threshold budget"))
    if _finite(drift):
        rules.append(_Rule(drift, f"drift limit {fmt_num(drift, 3)}: {drift_text}", _GREY, _DOTTED,
                           css="threshold drift"))
    return rules


def _error_chart(m: SegmentMetrics) -> str:
    """A matched pair's decision metric by position against the thresholds its findings use."""
    raw = {p[0]: p[1] for p in m.cos_by_position if len(p) >= 2}

    def tip(p: list[float]) -> str:
        return _bucket_tip("RMS standardised error", p, 3) + f"; raw cosine {fmt_cos(raw.get(p[0]))}"

    rules = _budget_rules(m.numerics_budget, m.drift_limit, "beyond it, other data")
    if _finite(m.std_rel_error):
        rules.append(_Rule(m.std_rel_error, f"whole pair {fmt_num(m.std_rel_error, 3)}", "#6f42c1", "", "start",
                           css="pair-value", in_legend=True))
    return _xy_chart([_Line(m.std_error_by_position, _BLUE, "RMS standardised error", tip)], rules,
                     aria=f"standardised error by position, pair {pair_name(m)}", y_label="std. error (log)", log=True)


def _cosine_chart(m: SegmentMetrics) -> str:
    """Raw cosine by position, for a report that has no per-position errors (no threshold applies)."""
    return _xy_chart([_Line(m.cos_by_position, _BLUE, "raw cosine", lambda p: _bucket_tip("mean cosine", p, 7))], [],
                     aria=f"cosine by position, pair {pair_name(m)}", y_label="raw cosine", cosine=True,
                     empty="no finite per-position cosine")


def _profile_cos_chart(p: SegmentProfile) -> str:
    raw = {q[0]: q[1] for q in p.cos_by_position if len(q) >= 2}

    def tip(q: list[float]) -> str:
        return _bucket_tip("standardised cosine", q) + f"; raw cosine {fmt_num(raw.get(q[0]), 4)}"

    rules = []
    if _finite(p.same_tensor_cosine):
        rules.append(_Rule(p.same_tensor_cosine, f"same tensor at \u2265 {fmt_num(p.same_tensor_cosine, 5)} "
                           "(standardised)", _RED, _DASHED, css="threshold same-tensor"))
    lines = [_Line(p.std_cos_by_position, _BLUE, "standardised cosine (decides)", tip),
             _Line(p.cos_by_position, _ORANGE, "raw cosine", lambda q: _bucket_tip("raw cosine", q), 1.2)]
    return _xy_chart(lines, rules, aria=f"cosine by position, candidate segment {p.candidate} vs reference segment "
                     f"{p.reference}", y_label="cosine", cosine=True)


def _ratio_rule() -> _Rule:
    return _Rule(1.0, "ratio 1", _GREY, _DASHED, css="ratio-one")


def _profile_ratio_chart(p: SegmentProfile) -> str:
    line = _Line(p.norm_ratio_by_position, _BLUE, "norm ratio", lambda q: _bucket_tip("mean norm ratio", q))
    return _xy_chart([line], [_ratio_rule()], aria=f"norm ratio by position, candidate segment {p.candidate} vs "
                     f"reference segment {p.reference}", y_label="|cand| / |ref|", nonnegative=True)


def _subset_charts(group: SegmentProfile, rest: SegmentProfile | None) -> list[tuple[str, str]]:
    parts = [(group, _RED)] + ([(rest, _GREEN)] if rest is not None else [])
    errors = [_Line(p.std_error_by_position, color, _short(p.group or "", 40),
                    lambda q, p=p: f"{p.group}: " + _bucket_tip("RMS standardised error", q, 3)) for p, color in parts]
    ratios = [_Line(p.norm_ratio_by_position, color, _short(p.group or "", 40),
                    lambda q, p=p: f"{p.group}: " + _bucket_tip("mean norm ratio", q)) for p, color in parts]
    rules = _budget_rules(group.numerics_budget, group.drift_limit, "a row beyond it is off")
    aria = f"candidate segment {group.candidate} vs reference segment {group.reference} by row group"
    return [
        ("Standardised error by position, per row group",
         _xy_chart(errors, rules, aria=f"standardised error by position, {aria}", y_label="std. error (log)", log=True)),
        ("Norm ratio |cand| / |ref| by position, per row group",
         _xy_chart(ratios, [_ratio_rule()], aria=f"norm ratio by position, {aria}", y_label="|cand| / |ref|",
                   nonnegative=True)),
    ]


# ------------------------------------------------------------------------------ what differs
_PROFILE_KINDS = ("segment_missing", "segment_extra", "segment_duplicate")
#: Findings about a matched pair, whose per-position chart is the pair's own (segment metrics).
_VALUE_KINDS = ("segment_value", "segment_scale", "precision")


def _anchor(kind: str, candidate: Any, reference: Any) -> str:
    return f"profile-{kind.removeprefix('segment_')}-c{candidate}-r{reference}"


def _profile_anchor(report: Report, f: Finding) -> str | None:
    """The id of the per-position chart of the pair a finding names, when the report has one."""
    ev = f.evidence
    key: tuple[Any, Any] | None = None
    if f.kind == "segment_missing":
        key = (ev.get("closest_candidate"), ev.get("reference_segment"))
    elif f.kind == "segment_extra":
        key = (ev.get("candidate_segment"), ev.get("closest_reference"))
    elif f.kind == "segment_duplicate" and isinstance(ev.get("candidate_segments"), list) and ev["candidate_segments"]:
        key = (ev["candidate_segments"][-1], ev.get("reference_segment"))
    elif f.kind == "segment_subset":
        key = (ev.get("candidate_segment"), ev.get("reference_segment"))
    elif f.kind in _VALUE_KINDS:
        # A matched pair's numbers: its charts are in the segment metrics.
        pair = (ev.get("candidate_segment"), ev.get("reference_segment"))
        found = any((m.candidate, m.reference) == pair for m in report.metrics)
        return f"pair-c{pair[0]}-r{pair[1]}" if found else None
    if key is None:
        return None
    found = any(p.kind == f.kind and (p.candidate, p.reference) == key for p in report.position_profiles)
    return _anchor(f.kind, *key) if found else None


def _seg(report: Report, role: str, index: int) -> str:
    labels = report.candidate.segment_labels if role == "candidate" else report.reference.segment_labels
    return segment_name(index, labels[index] if 0 <= index < len(labels) else None, role)


def _profile_numbers(p: SegmentProfile) -> str:
    std = f"standardised cosine {fmt_num(p.std_cos_mean, 3)} (raw {fmt_num(p.cos_mean, 4)})" if _finite(
        p.std_cos_mean) else f"raw cosine {fmt_num(p.cos_mean, 4)}"
    return f"{std}, norm ratio {fmt_num(p.norm_ratio_mean, 3)}, standardised error {fmt_num(p.std_rel_error, 3)}"


def _profile_caption(p: SegmentProfile) -> str:
    return (f"Over {fmt_num(p.rows)} rows: {_profile_numbers(p)} (numerics budget {fmt_num(p.numerics_budget, 3)}, "
            f"drift limit {fmt_num(p.drift_limit, 3)}).")


def _what_differs(report: Report) -> str:
    """Per-position charts of every wrong segment against its closest counterpart, and of every
    subset finding's row groups: what differs, where a matched pair's charts would be flat."""
    profiles = report.position_profiles
    if not profiles:
        return ""
    out = ['<section id="differs"><h2>What differs, by position</h2>',
           '<p class="muted">Each segment the findings call wrong, measured on every aligned row against the '
           "segment it is closest to; each subset finding's row group against the pair's other rows.</p>"]
    for p in profiles:
        if p.kind not in _PROFILE_KINDS:
            continue
        cand, ref = _seg(report, "candidate", p.candidate), _seg(report, "reference", p.reference)
        title = {"segment_missing": f"{ref[0].upper() + ref[1:]} is missing: closest is {cand}",
                 "segment_extra": f"{cand[0].upper() + cand[1:]} has no counterpart: closest is {ref}",
                 "segment_duplicate": f"{cand[0].upper() + cand[1:]} repeats {ref}"}[p.kind]
        out.append(f'<div class="profile" id="{_anchor(p.kind, p.candidate, p.reference)}" data-kind="{_e(p.kind)}">'
                   f'<h3>{_e(title)}</h3><p class="caption">{_e(_profile_caption(p))}</p><div class="charts">')
        out.append(f'<div class="chart"><h3>Cosine by position, candidate {p.candidate} vs reference {p.reference}</h3>'
                   f"{_profile_cos_chart(p)}</div>")
        out.append(f'<div class="chart"><h3>Norm ratio |cand| / |ref| by position</h3>{_profile_ratio_chart(p)}</div>')
        out.append("</div></div>")
    groups: dict[tuple[int, int], list[SegmentProfile]] = {}
    for p in profiles:
        if p.kind == "segment_subset":
            groups.setdefault((p.candidate, p.reference), []).append(p)
    for (i, j), parts in sorted(groups.items()):
        group, rest = parts[0], (parts[1] if len(parts) > 1 else None)
        title = f"{_seg(report, 'candidate', i)} vs {_seg(report, 'reference', j)}: {group.group} vs the other rows"
        caption = ("; ".join(f"{p.group} ({fmt_num(p.rows)} rows): {_profile_numbers(p)}" for p in parts)
                   + f" (numerics budget {fmt_num(group.numerics_budget, 3)}, drift limit "
                     f"{fmt_num(group.drift_limit, 3)}).")
        out.append(f'<div class="profile" id="{_anchor("segment_subset", i, j)}" data-kind="segment_subset">'
                   f'<h3>{_e(title[0].upper() + title[1:])}</h3><p class="caption">{_e(caption)}</p>'
                   '<div class="charts">')
        out += [f'<div class="chart"><h3>{_e(name)}</h3>{svg}</div>' for name, svg in _subset_charts(group, rest)]
        out.append("</div></div>")
    out.append("</section>")
    return "\n".join(out)


def _histogram(m: SegmentMetrics) -> str:
    edges = list(m.norm_ratio_hist.get("edges", []))
    counts = list(m.norm_ratio_hist.get("counts", []))
    if not counts or len(edges) != len(counts) + 1 or not all(_finite(e) for e in edges):
        return _no_data("no norm-ratio histogram")
    width, height = 460, 228
    left, top, right, bottom = 56.0, 20.0, width - 24.0, height - 40.0
    e0, e1 = edges[0], edges[-1]
    if e1 <= e0:
        return _no_data("no norm-ratio histogram")
    peak = max((c for c in counts if _finite(c)), default=0) or 1

    def sx(v: float) -> float:
        return left + (v - e0) / (e1 - e0) * (right - left)

    def sy(v: float) -> float:
        return bottom - v / peak * (bottom - top)

    counts_at = [v for v in nice_ticks(0.0, float(peak)) if float(v).is_integer()] or [0.0, float(peak)]
    y_ticks = [(sy(v), fmt_num(round(v))) for v in counts_at]
    if e1 - e0 <= 2.0:
        # Within a factor of 4: round ratios, placed on the log2 axis.
        ratios = [r for r in nice_ticks(2.0**e0, 2.0**e1) if r > 0]
        x_ticks = [(sx(math.log2(r)), t) for r, t in zip(ratios, tick_labels(ratios), strict=True)]
    else:
        powers = list(range(math.ceil(e0), math.floor(e1) + 1))
        every = max(1, math.ceil(len(powers) / 6))
        x_ticks = [(sx(float(k)), fmt_num(2.0**k)) for k in powers[::every]]
    body: list[str] = []
    _axes(body, (left, top, right, bottom), y_ticks, x_ticks)
    for k, count in enumerate(counts):
        if not _finite(count) or count <= 0:
            continue
        xa, xb = sx(edges[k]), sx(edges[k + 1])
        tip = f"norm ratio {fmt_num(2.0 ** edges[k], 5)} .. {fmt_num(2.0 ** edges[k + 1], 5)}: {fmt_num(count)} rows"
        body.append(
            f'<rect x="{xa + 0.5:.1f}" y="{sy(count):.1f}" width="{max(0.5, xb - xa - 1):.1f}" '
            f'height="{bottom - sy(count):.1f}" fill="#6baed6"><title>{_e(tip)}</title></rect>'
        )
    if e0 < 0 < e1:
        x = sx(0.0)
        body.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" stroke="#e6550d" stroke-dasharray="4 3"/>'
        )
        body.append(
            f'<text x="{x:.1f}" y="{top - 6}" text-anchor="middle" font-size="10" fill="#e6550d">ratio 1</text>'
        )
    body.append(
        f'<text x="{(left + right) / 2:.1f}" y="{height - 6}" text-anchor="middle" font-size="11">'
        "norm ratio (log2 scale), rows per bin</text>"
    )
    return _svg(width, height, body, f"norm ratio histogram, pair {pair_name(m)}")


def _offset_chart(scores: dict[str, float], chosen: int) -> str:
    items = sorted(scores.items(), key=lambda kv: _offset_sort(kv[0]))
    width, height = 40 + 64 * len(items) + 20, 190
    left, top, right, bottom = 40.0, 18.0, width - 20.0, height - 34.0
    values = [float(v) for _, v in items if _finite(v)]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    if hi == lo:
        hi = lo + 1

    def sy(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    body = [f'<line x1="{left}" x2="{right}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" stroke="#8c959f"/>']
    slot = (right - left) / max(1, len(items))
    for k, (offset, value) in enumerate(items):
        x = left + slot * k + slot * 0.2
        is_chosen = _offset_key(offset) == chosen
        label = signed_text(offset)
        body.append(
            f'<text x="{x + slot * 0.3:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="11" '
            f'font-weight="{"700" if is_chosen else "400"}">{_e(label)}</text>'
        )
        if not _finite(value):
            body.append(
                f'<text x="{x + slot * 0.3:.1f}" y="{sy(0) - 4:.1f}" text-anchor="middle" font-size="10">nan</text>'
            )
            continue
        y0, y1 = sorted((sy(0.0), sy(float(value))))
        fill = "#e6550d" if is_chosen else "#9ecae1"
        body.append(
            f'<rect x="{x:.1f}" y="{y0:.1f}" width="{slot * 0.6:.1f}" height="{max(0.5, y1 - y0):.1f}" fill="{fill}">'
            f"<title>offset {_e(label)}: {_e(fmt_num(value))}</title></rect>"
        )
        body.append(
            f'<text x="{x + slot * 0.3:.1f}" y="{y0 - 4:.1f}" text-anchor="middle" font-size="10">{_e(fmt_num(value, 4))}</text>'
        )
    body.append(
        f'<text x="{(left + right) / 2:.1f}" y="{height - 4}" text-anchor="middle" font-size="11">label offset</text>'
    )
    return _svg(width, height, body, "similarity by label offset")


def _offset_sort(offset: str) -> tuple[int, int, str]:
    key = _offset_key(offset)
    return (0, key, "") if isinstance(key, int) else (1, 0, str(offset))


def _offset_key(offset: str) -> Any:
    try:
        return int(offset)
    except (TypeError, ValueError):
        return offset
