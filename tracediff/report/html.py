"""HTML rendering of a compare report: one self-contained file to open, attach or archive.

No external resource, no script: the charts are inline SVG drawn from the report's own numbers
(segment heatmap, cosine per position, norm-ratio histogram, offset scores), the styles are inline
CSS, and hover details use SVG ``<title>``. Every piece of user text (paths, labels, messages,
evidence) goes through :func:`html.escape`. Formats only: this module decides nothing about the data.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

from tracediff.report.text import (
    EVIDENCE_CHARS,
    METRICS_ERROR_HEADERS,
    METRICS_SCALE_HEADERS,
    SEVERITY_TITLES,
    TABLE_EVIDENCE,
    candidate_labels,
    config_diff_items,
    fmt_cos,
    fmt_num,
    fmt_row,
    fmt_value,
    group_table,
    matched_cells,
    metrics_cells_error,
    metrics_cells_scale,
    pair_name,
    plan_items,
    plural_counts,
    reference_labels,
    segment_map_sentences,
    side_items,
    signed_text,
)
from tracediff.results import SEVERITIES, Finding, Report, SegmentMetrics

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
.scroll { overflow-x: auto; }
footer { color: var(--muted); font-size: 12px; text-align: center; margin-top: 24px; }
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
        _summary(report),
        _findings(report),
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
    return (
        f'<header class="verdict {_e(report.verdict)}"><h1>tracediff compare: {_e(report.verdict.upper())}</h1>'
        f"<p>{_e(plural_counts(report.counts()))} &middot; exit code {report.exit_code()} &middot; "
        f"reference <code>{_e(report.reference.path)}</code> vs candidate <code>{_e(report.candidate.path)}</code></p>"
        "</header>"
    )


def _summary(report: Report) -> str:
    out = ['<section id="summary"><h2>Summary</h2>']
    errors = [f for f in report.findings if f.severity == "error"]
    if report.verdict == "match":
        out.append("<p>The candidate feeds the draft's fc the same rows as the reference, within the noise floor.</p>")
    if errors:
        out.append('<ul class="findings">')
        out += [
            f'<li class="error"><span class="sev error">error</span><span class="kind">{_e(f.kind)}</span>{_e(f.message)}</li>'
            for f in errors
        ]
        out.append("</ul>")
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


def _findings(report: Report) -> str:
    out = ['<section id="findings"><h2>Findings</h2>']
    if not report.findings:
        out.append('<p class="muted">None.</p>')
    for severity in SEVERITIES:
        group = [f for f in report.findings if f.severity == severity]
        if not group:
            continue
        out.append(f"<h3>{_e(SEVERITY_TITLES[severity])} ({len(group)})</h3>")
        out.append('<ul class="findings">')
        for f in group:
            out.append(
                f'<li class="{severity}"><span class="sev {severity}">{_e(severity)}</span>'
                f'<span class="kind">{_e(f.kind)}</span>{_e(f.message)}'
            )
            table = group_table(f)
            if table is not None:
                out.append(_table(*table, numeric_last=False))
                out.append(_group_chart(f))
            if f.evidence:
                out.append('<table class="evidence">')
                out += [f"<tr><th>{_e(k)}</th><td>{_evidence_value(v)}</td></tr>" for k, v in f.evidence.items()
                        if k not in TABLE_EVIDENCE]
                out.append("</table>")
            out.append("</li>")
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
        out.append(
            '<div class="chart heatmap scroll"><h3>Mean cosine, candidate segment x reference segment '
            f"(plan sample; outlined: matched)</h3>{_heatmap(report)}</div>"
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
            f"<h3>Pair {_e(pair_name(m))}: candidate segment {m.candidate} vs reference segment {m.reference}</h3>"
        )
        out.append('<div class="charts">')
        out.append(f'<div class="chart"><h3>Cosine by position</h3>{_position_chart(m, report.plan.noise_floor)}</div>')
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
        out.append("<table><tr><th>path</th><th>change</th><th>reference</th><th>candidate</th></tr>")
        out += [
            f"<tr><td><code>{_e(path)}</code></td><td>{_e(change)}</td>"
            f'<td class="mono">{_e(ref)}</td><td class="mono">{_e(cand)}</td></tr>'
            for path, change, ref, cand in items
        ]
        out.append("</table>")
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


def _heatmap(report: Report) -> str:
    cand = candidate_labels(report)
    ref = reference_labels(report)
    chosen = matched_cells(report)
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
    for i, row in enumerate(report.matrix):
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
            tip = f"candidate segment {i} vs reference segment {j}: mean cosine {fmt_cos(value)}"
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
        f'<text x="{left + lw + 10}" y="{ly + 9}" font-size="10" fill="#57606a">cosine (\u2264 0 white, nan grey)</text>'
    )
    body.append(
        f'<rect x="{left + lw + 180}" y="{ly - 1}" width="16" height="12" fill="none" stroke="{_MATCH_STROKE}" stroke-width="2"/>'
        f'<text x="{left + lw + 200}" y="{ly + 9}" font-size="10" fill="#57606a">matched</text>'
    )
    width = max(width, left + lw + 260)
    return _svg(width, height, body, "segment cosine heatmap")


def _tick_decimals(span: float) -> int:
    if span <= 0 or not math.isfinite(span):
        return 4
    return int(min(7, max(0, math.ceil(-math.log10(span / 4)) + 1)))


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


def _position_chart(m: SegmentMetrics, noise_floor: float) -> str:
    points = [p for p in m.cos_by_position if len(p) >= 2 and _finite(p[0])]
    finite = [p for p in points if _finite(p[1])]
    if not finite:
        return _no_data("no finite per-position cosine")
    width, height = 460, 220
    left, top, right, bottom = 76.0, 12.0, width - 12.0, height - 40.0
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in finite]
    ceiling = 1.0 - noise_floor if _finite(noise_floor) else None
    # The dashed "1 - noise floor" line is always in view: it says how close to 1 is close enough.
    bounds = ys + ([ceiling] if ceiling is not None else [])
    lo, hi = min(bounds), max(bounds)
    span = max(hi - lo, 1e-5)
    lo, hi = lo - 0.08 * span, hi + 0.08 * span
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1

    def sx(v: float) -> float:
        return left + (v - x0) / (x1 - x0) * (right - left)

    def sy(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    digits = _tick_decimals(hi - lo)
    y_ticks = [(sy(lo + (hi - lo) * k / 4), f"{lo + (hi - lo) * k / 4:.{digits}f}") for k in range(5)]
    x_ticks = [(sx(x0 + (x1 - x0) * k / 4), fmt_num(round(x0 + (x1 - x0) * k / 4))) for k in range(5)]
    body: list[str] = []
    _axes(body, (left, top, right, bottom), y_ticks, x_ticks)
    if ceiling is not None:
        y = sy(ceiling)
        body.append(
            f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#8c959f" stroke-dasharray="4 3"/>'
        )
        body.append(
            f'<text x="{right - 4}" y="{y - 4:.1f}" text-anchor="end" font-size="10" fill="#57606a">1 - noise floor</text>'
        )
    # Break the line where the cosine is not finite, so a NaN bucket shows as a gap.
    runs: list[list[str]] = [[]]
    for p in points:
        if _finite(p[1]):
            runs[-1].append(f"{sx(float(p[0])):.1f},{sy(float(p[1])):.1f}")
        elif runs[-1]:
            runs.append([])
    for run in runs:
        if len(run) > 1:
            body.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="#1f77b4" stroke-width="1.8"/>')
    if len(points) <= 200:
        for p in points:
            rows = fmt_num(p[2]) if len(p) > 2 else "-"
            tip = f"position {fmt_num(p[0])}: mean cos {fmt_cos(p[1])} over {rows} rows"
            if _finite(p[1]):
                body.append(
                    f'<circle cx="{sx(float(p[0])):.1f}" cy="{sy(float(p[1])):.1f}" r="2.6" fill="#1f77b4">'
                    f"<title>{_e(tip)}</title></circle>"
                )
            else:
                body.append(
                    f'<text x="{sx(float(p[0])):.1f}" y="{bottom - 4}" text-anchor="middle" font-size="10" '
                    f'fill="#c62828">\u00d7<title>{_e(tip)}</title></text>'
                )
    body.append(
        f'<text x="{(left + right) / 2:.1f}" y="{height - 6}" text-anchor="middle" font-size="11">position</text>'
    )
    return _svg(width, height, body, f"cosine by position, pair {pair_name(m)}")


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

    y_ticks = [(sy(peak * k / 4), fmt_num(round(peak * k / 4) if peak >= 4 else peak * k / 4, 3)) for k in range(5)]
    step = max(1, len(edges) // 5)
    marks = edges[::step] if (len(edges) - 1) % step == 0 else [*edges[::step], edges[-1]]
    x_ticks = [(sx(e), fmt_num(2.0**e, 4)) for e in marks]
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
