"""Terminal rendering of a compare report: fits 100 columns, readable without colour.

Formats a :class:`tracediff.compare.results.Report`; never computes a metric or a decision. The words it
shares with the Markdown and HTML renderers (numbers, names, sentences) are in
:mod:`tracediff.report.wording`; this module lays them out: the Fix boxes, the cause tree, the
findings with or without their evidence, the segment map and its matrix, the tables.
"""

from __future__ import annotations

import textwrap
from typing import Any

from tracediff.compare.results import SEVERITIES, Finding, Report, SegmentMetrics, Side
from tracediff.report.wording import (
    CHANGE_EVIDENCE,
    CHANGES_SHOWN,
    EVIDENCE_CHARS,
    METRICS_ERROR_HEADERS,
    METRICS_SCALE_HEADERS,
    RECORD_NEXT_TITLE,
    RECORDED_CONFIG,
    SEVERITY_TITLES,
    TABLE_EVIDENCE,
    WORST_ROWS_SHOWN,
    assumed_evidence,
    aux_config_text,
    box_steps,
    candidate_labels,
    chain_note,
    chain_rows,
    change_lines,
    clean,
    clip,
    config_diff_items,
    fix_assignment,
    fix_heading,
    fmt_cos,
    fmt_mapping,
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
    plural,
    plural_counts,
    reference_labels,
    row_model_text,
    segment_map_sentences,
    segments_text,
    verdict_sentence,
    verdict_title,
)

WIDTH = 100
#: The width of a box's text: the box draws ``  | `` before every line.
BOX_TEXT = WIDTH - 4

_SEVERITY_TAGS = {"error": "ERROR", "warning": "WARN", "info": "INFO"}

_ANSI = {
    "bold": "\x1b[1m",
    "dim": "\x1b[2m",
    "red": "\x1b[31m",
    "green": "\x1b[32m",
    "yellow": "\x1b[33m",
    "blue": "\x1b[34m",
    "reset": "\x1b[0m",
}

_SEVERITY_COLORS = {"error": "red", "warning": "yellow", "info": "blue"}


# ------------------------------------------------------------------------- the text renderer
class _Painter:
    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        return "".join(_ANSI[s] for s in styles) + text + _ANSI["reset"]


def render_text(report: Report, color: bool = False, *, verbose: bool = False) -> str:
    """The report for a terminal.

    By default what a person acts on, in about a screen: the verdict, the findings (root cause
    first, evidence left out), the fix, the segment map and matrix, one line per compared pair.
    ``verbose`` adds every finding's evidence, the full metrics with worst rows, the plan and the
    config diff (the JSON and HTML reports always hold everything).
    """
    paint = _Painter(color)
    lines: list[str] = []
    if verbose:
        lines += _summary(report, paint)
        lines += _findings(report, paint)
        lines += _segment_map(report, paint)
        lines += _metrics(report, paint)
        lines += _chain(report, paint)
        lines += _plan(report, paint)
        lines += _config_diff(report, paint)
        lines += _replay(report, paint)
        lines.append("")
        lines.append(
            paint(
                f"tracediff {clean(report.tracediff_version)}, report schema {report.schema_version}; "
                f"the full numbers are in the JSON report (--json).",
                "dim",
            )
        )
    else:
        lines += _summary(report, paint, brief=True)
        lines += _findings_brief(report, paint)
        lines += _segment_map(report, paint)
        lines += _pairs(report, paint)
        lines += _chain(report, paint)
        lines += _replay(report, paint)
        lines.append("")
        lines += [paint(t, "dim") for t in _wrap("More: --verbose (plan, metrics, worst rows, evidence, config diff); "
                                                 "every number: --json FILE or --html FILE.")]
    return "\n".join(lines) + "\n"


def render_verdict_line(report: Report) -> str:
    """The verdict on one line (``compare -q``): ``mismatch: 1 root cause, 2 consequences; 3 errors,
    1 warning, 1 info`` (a match: ``match: 0 errors, 0 warnings, 2 info``)."""
    causes = report.causes()
    if not causes:
        return f"{report.verdict}: {plural_counts(report.counts())}"
    consequences = sum(len(c.consequences) for c in causes)
    follows = f", {plural(consequences, 'consequence')}" if consequences else ""
    return f"{report.verdict}: {plural(len(causes), 'root cause')}{follows}; {plural_counts(report.counts())}"


def fix_lines(report: Report) -> list[str]:
    """The fix in sentences (the demo prints them): the config value to set, or why no config can."""
    fix = report.fix
    if not fix:
        return []
    assignment = fix_assignment(fix)
    if assignment is not None:
        engine = f" ({fix['engine']})" if fix.get("engine") else ""
        return [f"On the candidate{engine}: set {assignment} ({fix.get('convention')} numbering), then record it "
                f"again and rerun this compare."]
    return [text for text, _ in box_steps(fix)[:1]]


def _box(title: str, body: list[str], paint: _Painter, style: str) -> list[str]:
    title = clean(title)  # an engine's name comes from a store
    rule = "-" * max(3, WIDTH - 4 - len(title) - 3)
    lines = ["", "  " + paint(f".- {title} ", "bold", style) + paint(rule, style)]
    lines += ["  " + paint("|", style) + (" " + line if line else "") for line in body]
    lines.append("  " + paint("'" + "-" * (WIDTH - 4), style))
    return lines


def _wrap_command(command: str, indent: str, width: int) -> list[str]:
    """A shell command cut at spaces outside quotes, each cut ending in a backslash (still runs pasted)."""
    words, word, quoted = [], "", False
    for ch in command:
        if ch == "'":
            quoted = not quoted
        if ch == " " and not quoted:
            words.append(word)
            word = ""
        else:
            word += ch
    words.append(word)
    lines, line = [], indent
    for w in words:
        if line.strip() and len(line) + 1 + len(w) + 2 > width:
            lines.append(line + " \\")
            line = indent + "    " + w
        else:
            line = f"{line} {w}" if line.strip() else line + w
    return lines + [line]


def _box_body(box: dict[str, Any], first: str | None, reasons: list[str]) -> list[str]:
    inner = WIDTH - 5
    body: list[str] = []
    if first:
        body += [line for line in _wrap(clean(first), "    ", hang="        ", width=BOX_TEXT) if line.strip()]
    for reason in reasons:
        body += _wrap(clean(reason), "", hang="  ", width=BOX_TEXT)
    for text, commands in box_steps(box):
        if text:
            body += _wrap(clean(text), "", hang="  ", width=BOX_TEXT)
        for command in commands:
            body += _wrap_command(clean(command), "    ", inner)
    return body


def _fixes(report: Report, paint: _Painter) -> list[str]:
    """The Fix box and the "what to record next" box, at the top of the report."""
    lines: list[str] = []
    if report.fix:
        lines += _box(fix_heading(report.fix), _box_body(report.fix, fix_assignment(report.fix), []), paint, "green")
    if report.record_next:
        reasons = [str(r) for r in report.record_next.get("reasons") or []]
        lines += _box(RECORD_NEXT_TITLE, _box_body(report.record_next, None, reasons), paint, "yellow")
    return lines


def _findings_brief(report: Report, paint: _Painter) -> list[str]:
    """Each root cause with what follows from it under it, then the other findings by severity;
    messages without their evidence (config findings with their readable diff)."""
    if not report.findings:
        return []
    grouped, rest = grouped_findings(report)
    title = "Findings (each root cause, then what follows from it)" if grouped else "Findings"
    lines = _heading(title, paint)
    lines += _cause_tree(grouped, _brief_finding, paint, "  ")
    for f in rest:
        lines += _brief_finding(f, paint, "  ")
    return lines


def _brief_finding(f: Finding, paint: _Painter, indent: str, hang: str | None = None) -> list[str]:
    hang = hang if hang is not None else indent + "    "
    lines = _finding_line(f, paint, indent=indent, hang=hang)
    table = group_table(f)
    if table is not None:
        lines += _table(*table, indent=hang + "  ", text_last=True)
    # The diff of a warning or error; an info finding's message names its fields (--verbose has them all).
    changes = change_lines(f) if f.severity != "info" else []
    for change in changes[:CHANGES_SHOWN]:
        lines += _wrap(clean(change), hang + "  ", hang=hang + "      ")
    if len(changes) > CHANGES_SHOWN:
        lines.append(f"{hang}  ... {len(changes) - CHANGES_SHOWN} more (--verbose, or the JSON report)")
    return lines


def pair_line(m: SegmentMetrics, report: Report) -> str:
    """One compared pair on one line: what it is, on how many rows, how close."""
    ref_labels, cand_labels = reference_labels(report), candidate_labels(report)
    cl = cand_labels[m.candidate] if m.candidate < len(cand_labels) else str(m.candidate)
    rl = ref_labels[m.reference] if m.reference < len(ref_labels) else str(m.reference)
    names = f"{cl} = {rl}" if cl == rl else f"{cl} vs {rl}"
    nonfinite = ""
    if m.nonfinite_candidate or m.nonfinite_reference:
        nonfinite = f", non-finite {m.nonfinite_candidate}/{m.nonfinite_reference} rows"
    return (f"{pair_name(m)} ({names}): {m.rows} rows, cos mean {fmt_cos(m.cos_mean)} min {fmt_cos(m.cos_min)}, "
            f"norm ratio {fmt_num(m.norm_ratio_p50, 4)} (p1 {fmt_num(m.norm_ratio_p1, 4)}, p99 "
            f"{fmt_num(m.norm_ratio_p99, 4)}), rel L2 {fmt_num(m.rel_l2, 3)}{nonfinite}")


def _pairs(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Pairs (every aligned row)", paint)
    if not report.metrics:
        return lines + ["  no matched segment pairs: nothing to measure"]
    for m in report.metrics:
        lines += _wrap(clean(pair_line(m, report)), "  ", hang="      ")
    return lines


def _chain(report: Report, paint: _Painter) -> list[str]:
    """The draft chain (record --draft-chain on both sides): one row per tap in forward order."""
    if not report.chain:
        return []
    headers, rows = chain_rows(report.chain)
    lines = _heading("Draft chain (each tap of the draft's forward, in order)", paint)
    note = chain_note(report.chain)
    return lines + _table(headers, [[clean(c) for c in r] for r in rows]) + (_wrap(clean(note), "  ") if note else [])


def _replay(report: Report, paint: _Painter) -> list[str]:
    if not report.replay:
        return []
    from tracediff.report.replay import text_lines  # noqa: PLC0415

    lines = _heading("Replay (what the mismatch costs the draft)", paint)
    lines += _wrap(clean(report.replay.get("conclusion", "")), "  ")
    return lines + [clean(line) for line in text_lines(report.replay)]


def render_replay(report: Report, color: bool = False) -> str:
    """The replay part alone, with the verdict line and the errors (``tracediff replay``)."""
    paint = _Painter(color)
    lines = _summary(report, paint)[:1] + _replay(report, paint)
    problems = [f for f in report.findings if f.severity in ("error", "warning")]
    if problems:
        lines += _heading("Findings", paint)
        for f in problems:
            lines += _wrap(f"{f.severity.upper()} {f.kind}: {clean(f.message)}", "  ")
    return "\n".join(lines) + "\n"


def render_replay_chain(report: Report, color: bool = False) -> str:
    """``tracediff replay SERVER --against-chain``: the verdict, the conclusion, the per-step table,
    the chain table and the errors."""
    from tracediff.report.replay import CHAIN_TITLE, chain_steps  # noqa: PLC0415

    paint = _Painter(color)
    summary = report.replay_chain or {}
    lines = _summary(report, paint)[:1] + _heading(CHAIN_TITLE, paint)
    lines += _wrap(clean(summary.get("conclusion", "")), "  ")
    headers, rows = chain_steps(summary)
    lines += [""] + _table(headers, [[clean(c) for c in r] for r in rows], text_last=True) + _chain(report, paint)
    problems = [f for f in report.findings if f.severity in ("error", "warning")]
    if problems:
        lines += _heading("Findings", paint)
        for f in problems:
            lines += _wrap(f"{f.severity.upper()} {f.kind}: {clean(f.message)}", "  ")
    return "\n".join(lines) + "\n"


def render_summary(report: Report, color: bool = False) -> str:
    """The top of :func:`render_text` alone: the verdict, every error finding, both sides' aux layers."""
    return "\n".join(_summary(report, _Painter(color))).rstrip("\n") + "\n"


def _wrap(text: str, indent: str = "", hang: str | None = None, width: int = WIDTH) -> list[str]:
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent + "    " if hang is None else hang,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def _heading(title: str, paint: _Painter) -> list[str]:
    return ["", paint(title, "bold"), paint("-" * len(title), "dim")]


def _summary(report: Report, paint: _Painter, *, brief: bool = False) -> list[str]:
    """The verdict and both sides; in full (``brief`` false) with every error finding and each side's
    recorded aux-layer config, brief with the aux layers in one phrase (the findings follow)."""
    counts = report.counts()
    verdict = verdict_title(report)
    tally = plural_counts(counts)
    head = f"tracediff compare: {verdict}"
    lines = [
        paint(head, "bold", "green" if report.verdict == "match" else "yellow" if report.verdict == "cannot_tell" else "red")
        + f"  ({tally}; exit code {report.exit_code()})"
    ]
    sentence = verdict_sentence(report)
    if sentence:
        lines += _wrap(clean(sentence), "  ")
    for assumed in assumed_evidence(report):
        lines += [paint(t, "yellow") for t in _wrap(clean(assumed), "  ", hang="      ")]
    boxes = _fixes(report, paint)
    lines += boxes
    if not brief:
        if boxes:
            lines.append("")
        for f in report.findings:
            if f.severity == "error":
                lines += _finding_line(f, paint, indent="  ")
    lines.append("")
    for label, side in (("reference", report.reference), ("candidate", report.candidate)):
        first = (f"{label:<10} {clean(side.path)}: tap {clean(side.tap)}, {segments_text(side)}, {clean(side.dtype)}, "
                 f"{side.rows} rows")
        lines += _wrap(first, "  ", hang="  " + " " * 11)
        aux = aux_brief(side) if brief else aux_config_text(side)
        lines += _wrap(f"aux layers: {clean(aux)}", "  " + " " * 11, hang="  " + " " * 15)
        if side.row_model:
            lines += _wrap(f"row model: {clean(row_model_text(side.row_model))}", "  " + " " * 11,
                           hang="  " + " " * 15)
    return lines


def aux_brief(side: Side) -> str:
    """The aux layers a side feeds, in one short phrase (the recorded config is in --verbose)."""
    aux = side.aux_layers
    if not aux or aux.get("physical") is None:
        return "not recorded" if not side.aux_layer_config else f"recorded as {fmt_mapping(side.aux_layer_config)}"
    physical = "[" + ", ".join(str(p) for p in aux["physical"]) + "]"
    return (f"{physical} in HF hidden_states numbering (recorded as {aux.get('convention')} ids "
            f"{fmt_value(aux.get('recorded'))} in {aux.get('field')})")


def _finding_line(f: Finding, paint: _Painter, indent: str, hang: str | None = None) -> list[str]:
    tag = f"{_SEVERITY_TAGS[f.severity]} {f.kind}:"
    wrapped = _wrap(f"{tag} {clean(f.message)}", indent, hang=indent + "    " if hang is None else hang)
    # Colour only the tag, after wrapping, so the widths stay right.
    first = wrapped[0]
    wrapped[0] = first.replace(tag, paint(tag, "bold", _SEVERITY_COLORS[f.severity]), 1)
    return wrapped


def _findings(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Findings", paint)
    if not report.findings:
        return lines + ["  none"]
    grouped, rest = grouped_findings(report)
    if grouped:
        lines.append(paint(f"  Root causes ({len(grouped)}), each with what follows from it", "bold"))
        lines += _cause_tree(grouped, _full_finding, paint, "    ")
    for severity in SEVERITIES:
        group = [f for f in rest if f.severity == severity]
        if not group:
            continue
        lines.append(paint(f"  {SEVERITY_TITLES[severity]} ({len(group)})", "bold"))
        for f in group:
            lines += _full_finding(f, paint, "    ")
    return lines


def _full_finding(f: Finding, paint: _Painter, indent: str, hang: str | None = None) -> list[str]:
    """A finding with every piece of evidence (a config finding's diff one field a line, not its
    raw entries: the JSON report has those)."""
    hang = indent + "    " if hang is None else hang
    lines = _finding_line(f, paint, indent=indent, hang=hang)
    table = group_table(f)
    if table is not None:
        lines += _table(*table, indent=hang, text_last=True)
    changes = change_lines(f)
    for change in changes:
        lines += _wrap(clean(change), hang, hang=hang + "    ")
    for key, value in f.evidence.items():
        if key in TABLE_EVIDENCE or (changes and key in CHANGE_EVIDENCE):
            continue
        text = clip(fmt_value(value), EVIDENCE_CHARS)
        lines += _wrap(f"{clean(key)}: {clean(text)}", hang, hang=hang + "    ")
    return lines


def _segment_map(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Segment map (candidate -> reference, mean cosine on the plan sample)", paint)
    sentences = segment_map_sentences(report)
    if not sentences:
        lines.append("  no segment map: compare stopped before matching segments")
    for status, sentence in sentences:
        style = () if status == "same" else ("yellow",) if status in ("moved", "related") else ("red",)
        text = _wrap(clean(sentence), "  ", hang="      ")
        lines += [paint(t, *style) for t in text]
    if report.matrix:
        lines.append("")
        lines += _matrix(report, paint)
    return lines


def _matrix(report: Report, paint: _Painter) -> list[str]:
    cand = candidate_labels(report)
    ref = reference_labels(report)
    chosen = matched_cells(report)
    row_head = 20
    cell = 12
    per_block = max(1, (WIDTH - row_head) // cell)
    lines = [
        "  cosine matrix: rows = candidate segments, columns = reference segments, [x] = matched",
    ]
    for start in range(0, len(ref), per_block):
        cols = range(start, min(len(ref), start + per_block))
        lines.append(" " * row_head + "".join(f"{'ref ' + str(j):>{cell}}" for j in cols))
        lines.append(" " * row_head + "".join(f"{_fit(clean(ref[j]), cell - 2):>{cell}}" for j in cols))
        for i, row in enumerate(report.matrix):
            name = f"  cand {i} {_fit(clean(cand[i] if i < len(cand) else str(i)), row_head - 10)}"
            cells = []
            for j in cols:
                value = row[j] if j < len(row) else None
                text = fmt_cos(value)
                if (i, j) in chosen:
                    cells.append(paint(f"{'[' + text + ']':>{cell}}", "bold"))
                else:
                    cells.append(f"{text:>{cell - 1}} ")
            lines.append(f"{name:<{row_head}}" + "".join(cells))
    return lines


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 2)] + ".."


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ", *, text_last: bool = False) -> list[str]:
    """A name column, then numbers right-aligned; with ``text_last`` the last column is text:
    left-aligned and wrapped so that the table stays within :data:`WIDTH`."""
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(headers)]
    last = len(widths) - 1
    if text_last:
        room = WIDTH - len(indent) - sum(w + 2 for w in widths[:last])
        widths[last] = max(min(widths[last], room), len(headers[last]), 16)
    fmt = indent + "  ".join(f"{{:{'<' if k == 0 or (text_last and k == last) else '>'}{w}}}"
                             for k, w in enumerate(widths))
    out = [fmt.format(*headers).rstrip(), indent + "  ".join("-" * w for w in widths)]
    for r in rows:
        if not text_last:
            out.append(fmt.format(*r))
            continue
        parts = textwrap.wrap(r[last], widths[last], break_on_hyphens=False) or [""]
        out.append(fmt.format(*r[:last], parts[0]).rstrip())
        out += [indent + " " * sum(w + 2 for w in widths[:last]) + part for part in parts[1:]]
    return out


def _metrics(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Segment metrics (every aligned row)", paint)
    if not report.metrics:
        return lines + ["  no matched segment pairs: nothing to measure"]
    lines += _table(METRICS_SCALE_HEADERS, [metrics_cells_scale(m) for m in report.metrics])
    lines.append("")
    lines += _table(METRICS_ERROR_HEADERS, [metrics_cells_error(m) for m in report.metrics])
    lines.append("")
    for m in report.metrics:
        lines += _wrap(f"{pair_name(m)} max abs diff at {clean(fmt_row(m.max_abs_diff_row))}", "  ", hang="      ")
        for row in m.worst_rows[:WORST_ROWS_SHOWN]:
            lines += _wrap(f"worst row: {clean(fmt_mapping(row))}", "      ", hang="          ")
        if len(m.worst_rows) > WORST_ROWS_SHOWN:
            lines.append(f"      ... {len(m.worst_rows) - WORST_ROWS_SHOWN} more worst rows in the JSON report")
    return lines


def _plan(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Plan (what was compared, decided before the streaming pass)", paint)
    for name, value in plan_items(report):
        lines += _wrap(f"{name:<16} {clean(value)}", "  ", hang="  " + " " * 17)
    for note in report.plan.notes:
        lines += _wrap(f"note: {clean(note)}", "  ", hang="        ")
    return lines


def _config_diff(report: Report, paint: _Painter) -> list[str]:
    lines = _heading("Config diff (meta of reference -> candidate, one field a line)", paint)
    items = config_diff_items(report)
    if not items:
        return lines + ["  no differences"]
    for path, change, ref, cand in items:
        lines += _wrap(f"{clean(path)}: {clean(ref)} -> {clean(cand)}  ({clean(change)})", "  ", hang="      ")
    return lines


def _cause_tree(grouped: list, render: Any, paint: Any, indent: str) -> list[str]:
    """Each root cause at ``indent``, its consequences and the config findings that say the same
    under it (``-> ``), rendered by ``render`` (brief or full)."""
    lines: list[str] = []
    arrow, hang = f"{indent}  -> ", " " * (len(indent) + 8)
    for root, consequences, config in grouped:
        lines += render(root, paint, indent)
        for f in consequences:
            lines += render(f, paint, arrow, hang=hang)
        if config:
            lines.append(f"{indent}  {RECORDED_CONFIG}")
        for f in config:
            lines += render(f, paint, arrow, hang=hang)
    return lines
