"""The HTML report's charts: inline SVG drawn from the report's own numbers, no script.

The segment heatmap of the standardised cosines segment matching decided on, per-position line
charts (a matched pair's standardised error against its numerics budget, every wrong segment's and
subset group's profile), the norm-ratio histogram, the label-offset bars and a subset finding's
group bars. Hover details use SVG ``<title>``; every piece of user text goes through :func:`esc`.
Formats only: every threshold line is a number of the report (``SegmentMetrics.numerics_budget``,
``drift_limit``, ``SegmentProfile.same_tensor_cosine``). The page around them: :mod:`tracediff.report.html`.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from tracediff.compare.results import Finding, Report, SegmentMetrics, SegmentProfile
from tracediff.report.ticks import decade_label, nice_step, nice_ticks, tick_labels
from tracediff.report.wording import (
    candidate_labels,
    fmt_cos,
    fmt_num,
    matched_cells,
    pair_name,
    reference_labels,
    signed_text,
)

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


def esc(text: Any) -> str:
    """Any value as HTML text or an attribute value (quotes escaped too)."""
    return html.escape(str(text), quote=True)


# ------------------------------------------------------------------------------ SVG charts
def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}" style="{_FONT}">'
        + "".join(body)
        + "</svg>"
    )


def is_finite_number(x: Any) -> TypeGuard[float]:
    """A finite int or float (never a bool): a value a chart can place."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _cos_color(value: Any) -> str:
    if not is_finite_number(value):
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


def has_standardised_matrix(report: Report) -> bool:
    """Whether the report holds the standardised cosine matrix (older reports hold the raw one only)."""
    return bool(report.matrix_standardised) and len(report.matrix_standardised) == len(report.matrix)


def heatmap(report: Report) -> str:
    """The standardised cosine matrix (what matching decided on), the raw one on hover; the raw one
    alone for a report without a standardised matrix."""
    cand = candidate_labels(report)
    ref = reference_labels(report)
    chosen = matched_cells(report)
    standardised = has_standardised_matrix(report)
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
            f'<text x="{x:.1f}" y="34" text-anchor="middle" font-size="11" fill="#57606a">{esc(_short(ref[j], 12))}'
            f"<title>{esc(ref[j])}</title></text>"
        )
    for i, row in enumerate(shown):
        raw_row = report.matrix[i]
        y = top + ch * i
        body.append(
            f'<text x="{left - 8}" y="{y + ch / 2 + 4:.1f}" text-anchor="end" font-size="12">{esc(row_names[i])}'
            f"<title>{esc(cand[i] if i < len(cand) else i)}</title></text>"
        )
        for j in range(cols):
            value = row[j] if j < len(row) else None
            x = left + cw * j
            fill = _cos_color(value)
            dark = is_finite_number(value) and float(value) > 0.55
            raw = raw_row[j] if j < len(raw_row) else None
            tip = (f"candidate segment {i} vs reference segment {j}: standardised cosine {fmt_cos(value)} "
                   f"(decides), raw cosine {fmt_cos(raw)}" if standardised
                   else f"candidate segment {i} vs reference segment {j}: mean cosine {fmt_cos(value)}")
            body.append(
                f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" fill="{fill}" stroke="#fff" stroke-width="1">'
                f"<title>{esc(tip)}</title></rect>"
            )
            body.append(
                f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle" font-size="12" '
                f'fill="{"#fff" if dark else "#1f2328"}" pointer-events="none">{esc(fmt_cos(value))}</text>'
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
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" fill="#57606a">{esc(label)}</text>'
        )
    for x, label in x_ticks:
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#8c959f"/>')
        body.append(
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="10" fill="#57606a">{esc(label)}</text>'
        )


def _no_data(text: str, width: int = 460, height: int = 60) -> str:
    return _svg(width, height, [f'<text x="10" y="34" font-size="12" fill="#57606a">{esc(text)}</text>'], text)


def _finite_points(points: list[list[float]]) -> list[list[float]]:
    return [p for p in points if len(p) >= 2 and is_finite_number(p[0]) and is_finite_number(p[1])]


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
    marks = [float(r.y) for r in rules if is_finite_number(r.y)]
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
                       f"\u2264{decade_label(lo_e)}" if on_floor else decade_label(lo_e))

        def sy(v: float) -> float:
            e = math.log10(v) if v > floor_value else lo_e
            return bottom - (min(e, hi_e) - lo_e) / (hi_e - lo_e) * (bottom - top)

        every = 1 if hi_e - lo_e <= 6 else 2
        y_ticks = [(sy(10.0**e), floor_label if e == lo_e else decade_label(e)) for e in range(lo_e, hi_e + 1)
                   if (hi_e - e) % every == 0 or e == lo_e]
    else:
        lo, hi = min(ys + marks), max(ys + marks)
        top_value, bottom_value = hi, lo
        span = hi - lo if hi > lo else max(abs(hi) * 2e-3, 1e-9)
        lo, hi = lo - 0.06 * span, hi + 0.06 * span
        step = nice_step(hi - lo)
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
    for rule in sorted((r for r in rules if is_finite_number(r.y)), key=lambda r: sy(float(r.y))):
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
                    f'fill="{rule.color}">{esc(rule.label)}</text>')
        body.append(
            f'<g class="{esc(rule.css)}" data-value="{float(rule.y)!r}"><line x1="{left}" x2="{right}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="{rule.color}" stroke-width="1.3"{dash}/>{text}<title>{esc(rule.label)}</title></g>'
        )
    for line in drawn:
        # Break the line where the value is not finite, so a NaN bucket shows as a gap.
        runs: list[list[str]] = [[]]
        for p in line.points:
            if len(p) >= 2 and is_finite_number(p[0]) and is_finite_number(p[1]):
                runs[-1].append(f"{sx(float(p[0])):.1f},{sy(float(p[1])):.1f}")
            elif runs[-1]:
                runs.append([])
        body.append(f'<g class="series" data-label="{esc(line.label)}">')
        for run in runs:
            if len(run) > 1:
                body.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{line.color}" '
                            f'stroke-width="{line.width}"/>')
        if len(line.points) <= 200:
            for p in line.points:
                if len(p) < 2 or not is_finite_number(p[0]):
                    continue
                tip = line.tip(p)
                if not is_finite_number(p[1]):
                    body.append(f'<text x="{sx(float(p[0])):.1f}" y="{bottom - 4}" text-anchor="middle" font-size="10" '
                                f'fill="#c62828">\u00d7<title>{esc(tip)}</title></text>')
                    continue
                hollow = log and float(p[1]) <= floor_value
                fill = "#fff" if hollow else line.color
                if hollow:
                    tip += " (at or below the axis floor)"
                body.append(f'<circle cx="{sx(float(p[0])):.1f}" cy="{sy(float(p[1])):.1f}" r="2.6" fill="{fill}" '
                            f'stroke="{line.color}"><title>{esc(tip)}</title></circle>')
        body.append("</g>")
    if legend:
        x = left
        keys = [(line.color, "", line.label) for line in lines]
        keys += [(r.color, r.dash, r.label) for r in rules if r.in_legend and is_finite_number(r.y)]
        for color, dash, label in keys:
            pattern = f' stroke-dasharray="{dash}"' if dash else ""
            body.append(f'<line x1="{x:.1f}" x2="{x + 14:.1f}" y1="10" y2="10" stroke="{color}" stroke-width="3"{pattern}/>'
                        f'<text x="{x + 18:.1f}" y="13" font-size="10" fill="#1f2328">{esc(label)}</text>')
            x += 30 + 5.6 * len(label)
    body.append(f'<text x="{(left + right) / 2:.1f}" y="{height - 6}" text-anchor="middle" font-size="11">'
                "position</text>")
    body.append(f'<text transform="translate(12 {(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle" '
                f'font-size="11" fill="#57606a">{esc(y_label)}</text>')
    return _svg(width, height, body, aria)


def _bucket_tip(what: str, p: list[float], digits: int = 4) -> str:
    rows = fmt_num(int(p[2])) if len(p) > 2 and is_finite_number(p[2]) else "-"
    return f"positions from {fmt_num(p[0])}: {what} {fmt_num(p[1], digits)} over {rows} rows"


def _budget_rules(budget: Any, drift: Any, drift_text: str) -> list[_Rule]:
    rules = []
    if is_finite_number(budget):
        rules.append(_Rule(budget, f"numerics budget {fmt_num(budget, 3)}: beyond it, a precision warning", _RED,
                           _DASHED, css="threshold budget"))
    if is_finite_number(drift):
        rules.append(_Rule(drift, f"drift limit {fmt_num(drift, 3)}: {drift_text}", _GREY, _DOTTED,
                           css="threshold drift"))
    return rules


def error_chart(m: SegmentMetrics) -> str:
    """A matched pair's decision metric by position against the thresholds its findings use."""
    raw = {p[0]: p[1] for p in m.cos_by_position if len(p) >= 2}

    def tip(p: list[float]) -> str:
        return _bucket_tip("RMS standardised error", p, 3) + f"; raw cosine {fmt_cos(raw.get(p[0]))}"

    rules = _budget_rules(m.numerics_budget, m.drift_limit, "beyond it, other data")
    if is_finite_number(m.std_rel_error):
        rules.append(_Rule(m.std_rel_error, f"whole pair {fmt_num(m.std_rel_error, 3)}", "#6f42c1", "", "start",
                           css="pair-value", in_legend=True))
    return _xy_chart([_Line(m.std_error_by_position, _BLUE, "RMS standardised error", tip)], rules,
                     aria=f"standardised error by position, pair {pair_name(m)}", y_label="std. error (log)", log=True)


def cosine_chart(m: SegmentMetrics) -> str:
    """Raw cosine by position, for a report that has no per-position errors (no threshold applies)."""
    return _xy_chart([_Line(m.cos_by_position, _BLUE, "raw cosine", lambda p: _bucket_tip("mean cosine", p, 7))], [],
                     aria=f"cosine by position, pair {pair_name(m)}", y_label="raw cosine", cosine=True,
                     empty="no finite per-position cosine")


def profile_cosine_chart(p: SegmentProfile) -> str:
    raw = {q[0]: q[1] for q in p.cos_by_position if len(q) >= 2}

    def tip(q: list[float]) -> str:
        return _bucket_tip("standardised cosine", q) + f"; raw cosine {fmt_num(raw.get(q[0]), 4)}"

    rules = []
    if is_finite_number(p.same_tensor_cosine):
        rules.append(_Rule(p.same_tensor_cosine, f"same tensor at \u2265 {fmt_num(p.same_tensor_cosine, 5)} "
                           "(standardised)", _RED, _DASHED, css="threshold same-tensor"))
    lines = [_Line(p.std_cos_by_position, _BLUE, "standardised cosine (decides)", tip),
             _Line(p.cos_by_position, _ORANGE, "raw cosine", lambda q: _bucket_tip("raw cosine", q), 1.2)]
    return _xy_chart(lines, rules, aria=f"cosine by position, candidate segment {p.candidate} vs reference segment "
                     f"{p.reference}", y_label="cosine", cosine=True)


def _ratio_rule() -> _Rule:
    return _Rule(1.0, "ratio 1", _GREY, _DASHED, css="ratio-one")


def profile_ratio_chart(p: SegmentProfile) -> str:
    line = _Line(p.norm_ratio_by_position, _BLUE, "norm ratio", lambda q: _bucket_tip("mean norm ratio", q))
    return _xy_chart([line], [_ratio_rule()], aria=f"norm ratio by position, candidate segment {p.candidate} vs "
                     f"reference segment {p.reference}", y_label="|cand| / |ref|", nonnegative=True)


def subset_charts(group: SegmentProfile, rest: SegmentProfile | None) -> list[tuple[str, str]]:
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

# ------------------------------------------------------------------------------- bar charts
def group_chart(f: Finding) -> str:
    """Bars of the median standardised error per group of a subset finding, with the numerics budget."""
    groups = [g for g in f.evidence.get("groups", []) if isinstance(g, dict) and is_finite_number(g.get("median_std_error"))]
    if not groups:
        return _no_data("no finite errors to draw")
    top = max(float(g["median_std_error"]) for g in groups) or 1.0
    width, bar, left = 460, 18, 150
    body = []
    for k, g in enumerate(groups):
        y = 8 + k * (bar + 6)
        w = max(1.0, (width - left - 60) * float(g["median_std_error"]) / top)
        body.append(f'<text x="4" y="{y + 13}" font-size="11">{esc(_short(str(g.get("group", "")), 24))}</text>')
        body.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{"#cf222e" if k == 0 else "#2da44e"}"/>')
        body.append(f'<text x="{left + w + 4:.1f}" y="{y + 13}" font-size="11">{float(g["median_std_error"]):.3g}</text>')
    return _svg(width, 14 + len(groups) * (bar + 6), body, "median standardised error by group")


def norm_ratio_histogram(m: SegmentMetrics) -> str:
    edges = list(m.norm_ratio_hist.get("edges", []))
    counts = list(m.norm_ratio_hist.get("counts", []))
    if not counts or len(edges) != len(counts) + 1 or not all(is_finite_number(e) for e in edges):
        return _no_data("no norm-ratio histogram")
    width, height = 460, 228
    left, top, right, bottom = 56.0, 20.0, width - 24.0, height - 40.0
    e0, e1 = edges[0], edges[-1]
    if e1 <= e0:
        return _no_data("no norm-ratio histogram")
    peak = max((c for c in counts if is_finite_number(c)), default=0) or 1

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
        if not is_finite_number(count) or count <= 0:
            continue
        xa, xb = sx(edges[k]), sx(edges[k + 1])
        tip = f"norm ratio {fmt_num(2.0 ** edges[k], 5)} .. {fmt_num(2.0 ** edges[k + 1], 5)}: {fmt_num(count)} rows"
        body.append(
            f'<rect x="{xa + 0.5:.1f}" y="{sy(count):.1f}" width="{max(0.5, xb - xa - 1):.1f}" '
            f'height="{bottom - sy(count):.1f}" fill="#6baed6"><title>{esc(tip)}</title></rect>'
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


def offset_chart(scores: dict[str, float], chosen: int) -> str:
    items = sorted(scores.items(), key=lambda kv: _offset_sort(kv[0]))
    width, height = 40 + 64 * len(items) + 20, 190
    left, top, right, bottom = 40.0, 18.0, width - 20.0, height - 34.0
    values = [float(v) for _, v in items if is_finite_number(v)]
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
            f'font-weight="{"700" if is_chosen else "400"}">{esc(label)}</text>'
        )
        if not is_finite_number(value):
            body.append(
                f'<text x="{x + slot * 0.3:.1f}" y="{sy(0) - 4:.1f}" text-anchor="middle" font-size="10">nan</text>'
            )
            continue
        y0, y1 = sorted((sy(0.0), sy(float(value))))
        fill = "#e6550d" if is_chosen else "#9ecae1"
        body.append(
            f'<rect x="{x:.1f}" y="{y0:.1f}" width="{slot * 0.6:.1f}" height="{max(0.5, y1 - y0):.1f}" fill="{fill}">'
            f"<title>offset {esc(label)}: {esc(fmt_num(value))}</title></rect>"
        )
        body.append(
            f'<text x="{x + slot * 0.3:.1f}" y="{y0 - 4:.1f}" text-anchor="middle" font-size="10">{esc(fmt_num(value, 4))}</text>'
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
