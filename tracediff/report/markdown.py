"""Markdown rendering of a compare report, to paste into a pull request or an issue.

Same content as the terminal report, as GitHub-flavoured Markdown tables; the long parts (plan,
config diff, worst rows) fold into ``<details>`` so the summary fits one screen. Formats only:
every number comes from the :class:`tracediff.compare.results.Report`. User text (paths, labels, messages)
is escaped so it can neither break a table nor inject HTML.
"""

from __future__ import annotations

import html
import re
from typing import Any

from tracediff.compare.results import SEVERITIES, Finding, Report
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
    box_steps,
    candidate_labels,
    chain_note,
    chain_rows,
    change_lines,
    clip,
    config_diff_items,
    fix_assignment,
    fix_heading,
    fmt_cos,
    fmt_mapping,
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
    side_items,
    verdict_sentence,
    verdict_title,
)

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the ones that can start
# emphasis, links, code, HTML or a table cell.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&#!])")
_NEWLINES = re.compile(r"[\r\n]+")


def _md(text: Any) -> str:
    """User text as literal Markdown on one line."""
    return _MD_SPECIAL.sub(r"\\\1", _NEWLINES.sub(" ", str(text)))


def _code(text: Any) -> str:
    """User text as an inline code span (pipes still escaped: GFM splits cells before code spans)."""
    body = _NEWLINES.sub(" ", str(text)).replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if body.startswith("`") or body.endswith("`") or not body.strip() else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def _table(headers: list[str], rows: list[list[str]], right: bool = True) -> list[str]:
    align = ["---"] + [("---:" if right else "---") for _ in headers[1:]]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_markdown(report: Report) -> str:
    """The whole report as GitHub-flavoured Markdown."""
    lines: list[str] = []
    lines += _summary(report)
    lines += _findings(report)
    lines += _segment_map(report)
    lines += _metrics(report)
    if report.replay_chain:
        from tracediff.report.replay import CHAIN_TITLE, chain_steps  # noqa: PLC0415

        headers, rows = chain_steps(report.replay_chain)
        lines += ["", f"### {CHAIN_TITLE}", "", _md(report.replay_chain.get("conclusion", "")), ""]
        lines += _table(headers, [[_md(c) for c in r] for r in rows])
    if report.chain:
        headers, rows = chain_rows(report.chain)
        lines += ["", "### Draft chain: each tap of the draft's forward, in order", ""]
        lines += _table(headers, [[_md(c) for c in r] for r in rows])
        note = chain_note(report.chain)
        lines += ["", _md(note)] if note else []
    lines += _plan(report)
    lines += _config_diff(report)
    if report.replay:
        from tracediff.report.replay import markdown_lines  # noqa: PLC0415

        lines += ["", "### Replay: what the mismatch costs the draft", "", _md(report.replay.get("conclusion", "")), ""]
        lines += markdown_lines(report.replay, lambda c: _md(str(c)))
    lines += [
        "",
        f"<sub>tracediff {html.escape(report.tracediff_version)}, report schema {report.schema_version}</sub>",
    ]
    return "\n".join(lines) + "\n"


def _summary(report: Report) -> list[str]:
    verdict = verdict_title(report)
    lines = [
        f"## tracediff compare: **{verdict}**",
        "",
        f"{plural_counts(report.counts())}; exit code {report.exit_code()}.",
        "",
    ]
    sentence = verdict_sentence(report)
    if sentence:
        lines += [_md(sentence), ""]
    for assumed in assumed_evidence(report):
        lines += [f"> **{_md(assumed)}**", ""]
    lines += _boxes(report)
    ref_items = dict(side_items(report.reference))
    cand_items = dict(side_items(report.candidate))
    # The aux-layer config right under the paths: a wrong one is the usual cause of a segment mismatch.
    order = ["path", "aux layers"] + [name for name in {**ref_items, **cand_items} if name not in ("path", "aux layers")]
    rows = []
    for name in order:
        ref, cand = ref_items.get(name, "-"), cand_items.get(name, "-")
        if name in ("path", "aux layers", "segments", "tap"):
            rows.append([name, _code(ref), _code(cand)])
        else:
            rows.append([name, _md(ref), _md(cand)])
    lines += _table(["", "reference", "candidate"], rows, right=False)
    return lines


def _fence(commands: list[str]) -> list[str]:
    """Shell commands as a fenced block whose fence no backtick run inside can close."""
    body = [_NEWLINES.sub(" ", c) for c in commands]
    longest = max((len(run) for c in body for run in re.findall(r"`+", c)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}sh", *body, fence]


def _boxes(report: Report) -> list[str]:
    """The Fix box and the "what to record next" box as GitHub alerts (a plain quote elsewhere)."""
    out: list[str] = []
    for kind, box in (("fix", report.fix), ("record", report.record_next)):
        if not box:
            continue
        body: list[str] = []
        if kind == "fix":
            body += [f"**{_md(fix_heading(box))}**", ""]
            assignment = fix_assignment(box)
            if assignment:
                body += [_code(assignment), ""]
        else:
            body += [f"**{_md(RECORD_NEXT_TITLE)}**", ""]
            body += [item for r in box.get("reasons") or [] for item in (_md(r), "")]
        for text, commands in box_steps(box):
            if text:
                body += [_md(text), ""]
            if commands:
                body += [*_fence(commands), ""]
        while body and not body[-1]:
            body.pop()
        out += ["> [!IMPORTANT]" if kind == "fix" else "> [!NOTE]"]
        out += [f"> {line}" if line else ">" for line in body]
        out.append("")
    return out


def _finding_items(f: Finding, indent: str = "") -> list[str]:
    lines = [f"{indent}- **{f.severity}** `{f.kind}`: {_md(f.message)}"]
    table = group_table(f)
    if table is not None:
        headers, rows = table
        lines += ["", *[indent + "  " + line for line in _table(headers, [[_md(c) for c in r] for r in rows],
                                                                right=False)], ""]
    changes = change_lines(f)
    lines += [f"{indent}  - {_code(c)}" for c in changes[:CHANGES_SHOWN]]
    if len(changes) > CHANGES_SHOWN:
        lines.append(f"{indent}  - ... {len(changes) - CHANGES_SHOWN} more in the Config diff below")
    for key, value in f.evidence.items():
        if key in TABLE_EVIDENCE or (changes and key in CHANGE_EVIDENCE):
            continue
        lines.append(f"{indent}  - {_md(key)}: {_code(clip(fmt_value(value), EVIDENCE_CHARS))}")
    return lines


def _findings(report: Report) -> list[str]:
    lines = ["", "### Findings", ""]
    if not report.findings:
        return lines + ["None."]
    grouped, rest = grouped_findings(report)
    for k, (root, consequences, config) in enumerate(grouped, 1):
        title = root.summary or root.kind
        lines += [f"#### Root cause {k}: {_md(title)}", ""]
        lines += _finding_items(root)
        for heading, group in ((f"Follows from it ({len(consequences)}):", consequences),
                               (RECORDED_CONFIG[0].upper() + RECORDED_CONFIG[1:], config)):
            if group:
                lines += ["", heading, ""]
                for f in group:
                    lines += _finding_items(f)
        lines.append("")
    for severity in SEVERITIES:
        group = [f for f in rest if f.severity == severity]
        if not group:
            continue
        lines += [f"#### {SEVERITY_TITLES[severity]} ({len(group)})", ""]
        for f in group:
            lines += _finding_items(f)
        lines.append("")
    return lines


def _segment_map(report: Report) -> list[str]:
    lines = ["### Segment map", "", "Candidate segment -> reference segment, mean cosine on the plan sample.", ""]
    sentences = segment_map_sentences(report)
    if not sentences:
        lines += ["No segment map: compare stopped before matching segments.", ""]
    for status, sentence in sentences:
        mark = "" if status == "same" else f"**{status}**: "
        lines.append(f"- {mark}{_md(sentence)}")
    if not report.matrix:
        return lines
    chosen = matched_cells(report)
    cand = candidate_labels(report)
    ref = reference_labels(report)
    headers = ["cand \\ ref"] + [f"ref {j} {_code(label)}" for j, label in enumerate(ref)]
    rows = []
    for i, row in enumerate(report.matrix):
        cells = []
        for j in range(len(ref)):
            text = fmt_cos(row[j]) if j < len(row) else "-"
            cells.append(f"**{text}**" if (i, j) in chosen else text)
        rows.append([f"cand {i} {_code(cand[i] if i < len(cand) else i)}", *cells])
    lines += ["", "Cosine matrix (bold: matched):", ""]
    lines += _table(headers, rows)
    return lines


def _metrics(report: Report) -> list[str]:
    lines = ["", "### Segment metrics", ""]
    if not report.metrics:
        return lines + ["No matched segment pairs: nothing to measure."]
    lines += _table(METRICS_SCALE_HEADERS, [metrics_cells_scale(m) for m in report.metrics])
    lines.append("")
    headers = [*METRICS_ERROR_HEADERS, "max abs diff at"]
    rows = [[*metrics_cells_error(m), _md(fmt_row(m.max_abs_diff_row))] for m in report.metrics]
    lines += _table(headers, rows)
    worst = [m for m in report.metrics if m.worst_rows]
    if worst:
        lines += ["", "<details><summary>Worst rows</summary>", ""]
        for m in worst:
            lines.append(f"- {pair_name(m)}:")
            for row in m.worst_rows[:WORST_ROWS_SHOWN]:
                lines.append(f"  - {_md(fmt_mapping(row))}")
            if len(m.worst_rows) > WORST_ROWS_SHOWN:
                lines.append(f"  - ... {len(m.worst_rows) - WORST_ROWS_SHOWN} more in the JSON report")
        lines += ["", "</details>"]
    return lines


def _plan(report: Report) -> list[str]:
    p = report.plan
    summary = (
        f"Plan: {p.pairs} aligned rows, {p.sequences_aligned}/{p.sequences_reference} sequences, "
        f"label offset {p.label_offset}"
    )
    lines = ["", "### Plan", "", f"<details><summary>{html.escape(summary)}</summary>", ""]
    lines += _table(["", "value"], [[name, _md(value)] for name, value in plan_items(report)], right=False)
    if p.notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {_md(note)}" for note in p.notes]
    lines += ["", "</details>"]
    return lines


def _config_diff(report: Report) -> list[str]:
    lines = ["", "### Config diff", ""]
    items = config_diff_items(report)
    if not items:
        return lines + ["No differences in the recorded meta."]
    lines += [f"<details open><summary>{len(items)} difference(s)</summary>", ""]
    rows = [[_code(path), _md(change), _code(ref), _code(cand)] for path, change, ref, cand in items]
    lines += _table(["path", "change", "reference", "candidate"], rows, right=False)
    lines += ["", "</details>"]
    return lines
