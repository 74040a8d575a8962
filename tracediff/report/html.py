"""HTML rendering of a compare report: one self-contained file to open, attach or archive.

No external resource, no script: the styles are inline CSS and the charts inline SVG
(:mod:`tracediff.report.charts`). This module lays out the page: the verdict, the Fix boxes, the
findings as a cause tree with their evidence, what differs by position, the segment map, the
metrics, the plan and the config diff. Every piece of user text (paths, labels, messages,
evidence) goes through :func:`html.escape` (:func:`tracediff.report.charts.esc`). Formats only:
this module decides nothing about the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracediff.compare.results import SEVERITIES, Finding, Report, SegmentProfile
from tracediff.report.charts import (
    cosine_chart,
    error_chart,
    esc,
    group_chart,
    has_standardised_matrix,
    heatmap,
    is_finite_number,
    norm_ratio_histogram,
    offset_chart,
    profile_cosine_chart,
    profile_ratio_chart,
    subset_charts,
)
from tracediff.report.wording import (
    CHANGE_EVIDENCE,
    EVIDENCE_CHARS,
    METRICS_ERROR_HEADERS,
    METRICS_SCALE_HEADERS,
    RECORD_NEXT_TITLE,
    RECORDED_CONFIG,
    SEVERITY_TITLES,
    TABLE_EVIDENCE,
    assumed_evidence,
    box_steps,
    chain_note,
    chain_rows,
    change_lines,
    config_diff_items,
    fix_assignment,
    fix_heading,
    fmt_num,
    fmt_row,
    fmt_value,
    group_table,
    grouped_findings,
    metrics_cells_error,
    metrics_cells_scale,
    pair_name,
    plan_items,
    plural_counts,
    segment_map_sentences,
    segment_name,
    side_items,
    verdict_sentence,
    verdict_title,
)

_CSS = """
:root { --err:#c62828; --warn:#b26a00; --info:#1565c0; --ok:#2e7d32; --line:#d0d7de; --muted:#57606a; }
* { box-sizing: border-box; }
body { margin: 0; background: #f6f8fa; color: #1f2328;
  font: 14px/1.45 ui-sans-serif, system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 24px 40px; }
header.verdict { padding: 18px 24px; color: #fff; }
header.verdict.mismatch { background: var(--err); }
header.verdict.match { background: var(--ok); }
header.verdict.cannot_tell { background: #8a5a00; }
header.verdict p.assumed { margin-top: 6px; font-weight: 600; }
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


def _replay(report: Report) -> str:
    if not report.replay:
        return ""
    from tracediff.report.replay import html_table  # noqa: PLC0415

    return ("<section><h2>Replay: what the mismatch costs the draft</h2>"
            f"<p>{esc(report.replay.get('conclusion', ''))}</p>{html_table(report.replay, esc)}</section>")


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML document (inline CSS and SVG, no script)."""
    title = f"tracediff: {report.verdict} ({report.reference.path} vs {report.candidate.path})"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
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
        *([_replay_chain(report)] if report.replay_chain else []),
        *([_chain(report)] if report.chain else []),  # (no line at all without one: reports unchanged)
        _plan(report),
        _config_diff(report),
        _replay(report),
        f"<footer>tracediff {esc(report.tracediff_version)} &middot; report schema {report.schema_version}"
        " &middot; the JSON report (--json) holds every number</footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------- sections
def _header(report: Report) -> str:
    sentence = verdict_sentence(report)
    cause = f'<p class="cause">{esc(sentence)}</p>' if sentence else ""
    assumed = "".join(f'<p class="assumed">{esc(a)}</p>' for a in assumed_evidence(report))
    return (
        f'<header class="verdict {esc(report.verdict)}"><h1>tracediff compare: {esc(verdict_title(report))}</h1>'
        f"<p>{esc(plural_counts(report.counts()))} &middot; exit code {report.exit_code()} &middot; "
        f"reference <code>{esc(report.reference.path)}</code> vs candidate <code>{esc(report.candidate.path)}</code></p>"
        f"{cause}{assumed}</header>"
    )


def _commands(commands: list[str]) -> str:
    return f'<pre class="commands">{esc(chr(10).join(commands))}</pre>' if commands else ""


def _boxes(report: Report) -> str:
    """The Fix box and the "what to record next" box: first on the page, above the summary."""
    out = []
    if report.fix:
        fix = report.fix
        out.append(f'<section class="box fix" id="fix"><h2>{esc(fix_heading(fix))}</h2>')
        assignment = fix_assignment(fix)
        if assignment:
            out.append(f'<p class="assignment"><code>{esc(assignment)}</code></p>')
        for text, commands in box_steps(fix):
            out.append(f"<p>{esc(text)}</p>{_commands(commands)}")
        out.append("</section>")
    if report.record_next:
        box = report.record_next
        out.append(f'<section class="box record-next" id="record-next"><h2>{esc(RECORD_NEXT_TITLE)}</h2>')
        out += [f"<p>{esc(r)}</p>" for r in box.get("reasons") or []]
        for text, commands in box_steps(box):
            out.append(f"<p>{esc(text)}</p>{_commands(commands)}")
        out.append("</section>")
    return "\n".join(out)


def _summary(report: Report) -> str:
    out = ['<section id="summary"><h2>Summary</h2>']
    ref_items = dict(side_items(report.reference))
    cand_items = dict(side_items(report.candidate))
    order = ["path", "aux layers"] + [k for k in {**ref_items, **cand_items} if k not in ("path", "aux layers")]
    out.append('<table class="sides"><tr><th></th><th>reference</th><th>candidate</th></tr>')
    for name in order:
        css = ' class="aux"' if name == "aux layers" else ""
        mono = name in ("path", "aux layers", "segments", "tap")
        ref, cand = (f"<code>{esc(v)}</code>" if mono else esc(v) for v in (ref_items.get(name, "-"), cand_items.get(name, "-")))
        out.append(f"<tr{css}><th>{esc(name)}</th><td>{ref}</td><td>{cand}</td></tr>")
    out.append("</table></section>")
    return "\n".join(out)


def _finding_card(report: Report, f: Finding, extra_css: str = "", inner: str = "") -> str:
    anchor = _profile_anchor(report, f)
    link = f'<a class="chart-link" href="#{anchor}">per-position chart</a>' if anchor else ""
    out = [f'<li class="{f.severity}{extra_css}"><span class="sev {f.severity}">{esc(f.severity)}</span>'
           f'<span class="kind">{esc(f.kind)}</span>{esc(f.message)}{link}']
    table = group_table(f)
    if table is not None:
        out.append(_table(*table, numeric_last=False))
        out.append(group_chart(f))
    changes = change_lines(f)
    if changes:
        out.append('<ul class="changes">' + "".join(f'<li class="mono">{esc(c)}</li>' for c in changes) + "</ul>")
    shown = [(k, v) for k, v in f.evidence.items() if k not in TABLE_EVIDENCE and not (changes and k in CHANGE_EVIDENCE)]
    if shown:
        out.append('<table class="evidence">')
        out += [f"<tr><th>{esc(k)}</th><td>{_evidence_value(v)}</td></tr>" for k, v in shown]
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
                    inner.append(f'<div class="follows"><h4>{esc(heading)}</h4><ul class="findings consequences">')
                    inner += [_finding_card(report, f) for f in group]
                    inner.append("</ul></div>")
            out.append(_finding_card(report, root, " cause", "\n".join(inner)))
        out.append("</ul>")
    for severity in SEVERITIES:
        group = [f for f in rest if f.severity == severity]
        if not group:
            continue
        out.append(f"<h3>{esc(SEVERITY_TITLES[severity])} ({len(group)})</h3>")
        out.append('<ul class="findings">')
        out += [_finding_card(report, f) for f in group]
        out.append("</ul>")
    out.append("</section>")
    return "\n".join(out)


def _evidence_value(value: Any) -> str:
    """Short values inline; long ones (a whole matrix) folded, so the findings stay readable."""
    text = fmt_value(value)
    if len(text) <= EVIDENCE_CHARS:
        return f'<span class="mono">{esc(text)}</span>'
    return (
        f'<details><summary class="mono">{esc(text[:80])} &hellip; ({len(text)} chars)</summary>'
        f'<div class="mono">{esc(text)}</div></details>'
    )


def _segment_map(report: Report) -> str:
    out = ['<section id="segments"><h2>Segment map</h2>']
    sentences = segment_map_sentences(report)
    if not sentences:
        out.append('<p class="muted">No segment map: compare stopped before matching segments.</p>')
    else:
        out.append('<ul class="map">')
        out += [f'<li><span class="status {esc(s)}">{esc(s)}</span>{esc(text)}</li>' for s, text in sentences]
        out.append("</ul>")
    if report.matrix:
        what = ("Standardised cosine (what segment matching decides on; hover a cell for the raw cosine)"
                if has_standardised_matrix(report) else "Mean raw cosine (this report holds no standardised matrix)")
        out.append(
            f'<div class="chart heatmap scroll"><h3 class="heatmap-label">{what}</h3><p class="muted">Candidate '
            f"segment x reference segment, on the plan sample; outlined: matched.</p>{heatmap(report)}</div>"
        )
    out.append("</section>")
    return "\n".join(out)


def _replay_chain(report: Report) -> str:
    """replay --against-chain: the checkpoint on the server's inputs against the served draft, per step."""
    from tracediff.report.replay import CHAIN_TITLE, chain_steps  # noqa: PLC0415

    summary = report.replay_chain or {}
    headers, rows = chain_steps(summary)
    return (f'<section id="replay-chain"><h2>{esc(CHAIN_TITLE)}</h2><p>{esc(summary.get("conclusion", ""))}</p>'
            f'<div class="scroll">{_table(headers, rows, numeric_last=False)}</div></section>')


def _chain(report: Report) -> str:
    """The draft chain (record --draft-chain on both sides): one row per tap in forward order."""
    if not report.chain:
        return ""
    headers, rows = chain_rows(report.chain)
    note = chain_note(report.chain)
    return ('<section id="chain"><h2>Draft chain: each tap of the draft&#x27;s forward, in order</h2>'
            f'<div class="scroll">{_table(headers, rows)}</div>'
            + (f'<p class="muted">{esc(note)}</p>' if note else "") + '</section>')


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
            f"<h3>Pair {esc(pair_name(m))}: candidate segment {m.candidate} vs reference segment {m.reference}</h3>"
        )
        out.append('<div class="charts">')
        if m.std_error_by_position:
            out.append('<div class="chart"><h3>Standardised error by position (the decision metric)</h3>'
                       f"{error_chart(m)}</div>")
        else:
            out.append(f'<div class="chart"><h3>Raw cosine by position</h3>{cosine_chart(m)}</div>')
        out.append(f'<div class="chart"><h3>Norm ratio |cand| / |ref|</h3>{norm_ratio_histogram(m)}</div>')
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
    out += [f"<tr><th>{esc(name)}</th><td>{esc(value)}</td></tr>" for name, value in plan_items(report)]
    out.append("</table>")
    if p.notes:
        out.append("<h3>Notes</h3><ul>" + "".join(f"<li>{esc(n)}</li>" for n in p.notes) + "</ul>")
    out.append("</div>")
    if p.offset_scores:
        out.append(f'<div class="chart"><h3>Similarity by label offset (chosen: {p.label_offset})</h3>')
        out.append(offset_chart(p.offset_scores, p.label_offset) + "</div>")
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
            f'<tr><td class="path"><code>{esc(path)}</code></td><td>{esc(change)}</td>'
            f'<td class="mono">{esc(ref)}</td><td class="mono">{esc(cand)}</td></tr>'
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

    out = ["<table><tr>" + "".join(f"<th{css(k)}>{esc(h)}</th>" for k, h in enumerate(headers)) + "</tr>"]
    out += ["<tr>" + "".join(f"<td{css(k)}>{esc(c)}</td>" for k, c in enumerate(r)) + "</tr>" for r in rows]
    out.append("</table>")
    return "\n".join(out)


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
    std = f"standardised cosine {fmt_num(p.std_cos_mean, 3)} (raw {fmt_num(p.cos_mean, 4)})" if is_finite_number(
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
        out.append(f'<div class="profile" id="{_anchor(p.kind, p.candidate, p.reference)}" data-kind="{esc(p.kind)}">'
                   f'<h3>{esc(title)}</h3><p class="caption">{esc(_profile_caption(p))}</p><div class="charts">')
        out.append(f'<div class="chart"><h3>Cosine by position, candidate {p.candidate} vs reference {p.reference}</h3>'
                   f"{profile_cosine_chart(p)}</div>")
        out.append(f'<div class="chart"><h3>Norm ratio |cand| / |ref| by position</h3>{profile_ratio_chart(p)}</div>')
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
                   f'<h3>{esc(title[0].upper() + title[1:])}</h3><p class="caption">{esc(caption)}</p>'
                   '<div class="charts">')
        out += [f'<div class="chart"><h3>{esc(name)}</h3>{svg}</div>' for name, svg in subset_charts(group, rest)]
        out.append("</div></div>")
    out.append("</section>")
    return "\n".join(out)
