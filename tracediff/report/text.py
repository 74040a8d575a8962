"""Terminal rendering of a compare report: fits 100 columns, readable without colour.

Formats a :class:`tracediff.results.Report`; never computes a metric or a decision. The few
helpers that name things the same way in every format (numbers, segment-map sentences, the
aux-layer config) live here and are reused by the Markdown and HTML renderers, so that all three
say exactly the same thing.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Sequence
from typing import Any

from tracediff.results import SEVERITIES, Finding, Report, SegmentMatch, SegmentMetrics, Side

WIDTH = 100
WORST_ROWS_SHOWN = 5
# Evidence values longer than this are cut in the text and Markdown reports (about two lines).
EVIDENCE_CHARS = 180

SEVERITY_TITLES = {"error": "Errors", "warning": "Warnings", "info": "Info"}
_SEVERITY_TAGS = {"error": "ERROR", "warning": "WARN", "info": "INFO"}

# Statuses whose reference segment really is present in the candidate (``related`` is a best
# guess only: the reference segment it points at is still reported as having no exact counterpart).
_PRESENT_STATUSES = ("same", "moved", "duplicate")

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
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# ------------------------------------------------------------------- shared by every renderer
def fmt_num(x: Any, digits: int = 4) -> str:
    """A number as a person reads it: ``-`` for missing, ``nan``/``inf`` spelt out, 4 significant digits."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)


def fmt_cos(x: float | None, decimals: int = 6) -> str:
    """A cosine with enough decimals to tell 0.999 (an adjacent layer) from 0.999999 (the same one)."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return fmt_num(x)
    return f"{x:.{decimals}f}"


def fmt_value(value: Any) -> str:
    """Any evidence or config value on one line: a row as :func:`fmt_row` writes it, other
    structures as compact JSON with floats to 6 significant digits, strings as they are."""
    if isinstance(value, str):
        return value
    if _is_row(value):
        return fmt_row(value)
    return _compact_json(value)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out (the JSON has it all)."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40].rstrip()} ... ({len(text)} chars; see the JSON report)"


def _is_row(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"seq", "position", "token_id"}


def _compact_json(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float):
        return fmt_num(value, 6)
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_compact_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_compact_json(v) for v in value) + "]"
    if hasattr(value, "__dataclass_fields__"):
        return _compact_json({k: getattr(value, k) for k in value.__dataclass_fields__})
    return json.dumps(str(value))


def fmt_row(row: Any) -> str:
    """A RowRef (or its dict form) as ``seq 'r7' position 42 token 1234``."""
    if row is None:
        return "-"
    get = row.get if isinstance(row, dict) else lambda k, d=None: getattr(row, k, d)
    return f"seq {get('seq')!r} position {get('position')} token {get('token_id')}"


def fmt_mapping(mapping: dict[str, Any] | None, empty: str = "-") -> str:
    """``k=v, k=v`` with values as :func:`fmt_value` writes them."""
    if not mapping:
        return empty
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in mapping.items())


def aux_config_text(side: Side) -> str:
    """The aux layers a side feeds in the physical numbering, then the config as recorded."""
    recorded = fmt_mapping(side.aux_layer_config, empty="not recorded")
    aux = side.aux_layers
    if not aux or aux.get("physical") is None:
        return recorded
    physical = "[" + ", ".join(str(p) for p in aux["physical"]) + "]"
    return (f"physical {physical} (HF hidden_states numbering; from {aux.get('field')}, "
            f"{aux.get('convention')} numbering {fmt_value(aux.get('recorded'))}); {recorded}")


def segment_name(index: int | None, label: str | None, role: str) -> str:
    """``candidate segment 0 (hs3)``; the label is left out when it adds nothing."""
    if index is None:
        return f"no {role} segment"
    name = f"{role} segment {index}"
    if label and label != str(index):
        name += f" ({label})"
    return name


def reference_labels(report: Report) -> list[str]:
    count = reference_segment_count(report)
    labels = list(report.reference.segment_labels)
    return [labels[j] if j < len(labels) else str(j) for j in range(count)]


def candidate_labels(report: Report) -> list[str]:
    count = max(len(report.matrix), report.candidate.segments, len(report.segment_map))
    labels = list(report.candidate.segment_labels)
    return [labels[i] if i < len(labels) else str(i) for i in range(count)]


def reference_segment_count(report: Report) -> int:
    width = max((len(row) for row in report.matrix), default=0)
    return max(report.reference.segments, width)


def matched_cells(report: Report) -> set[tuple[int, int]]:
    """(candidate, reference) cells of the matrix that the segment map chose."""
    return {(m.candidate, m.reference) for m in report.segment_map if m.reference is not None}


def segment_map_sentences(report: Report) -> list[tuple[str, str]]:
    """The segment map as (status, sentence) pairs: one per candidate segment, then one per
    reference segment that no candidate segment carries."""
    ref_labels = reference_labels(report)
    out: list[tuple[str, str]] = []
    for m in report.segment_map:
        out.append((m.status, _match_sentence(m)))
    carried = {m.reference for m in report.segment_map if m.status in _PRESENT_STATUSES}
    related = {m.reference: m for m in report.segment_map if m.status == "related"}
    if report.segment_map:
        for j, label in enumerate(ref_labels):
            if j in carried:
                continue
            ref = segment_name(j, label, "reference")
            if j in related:
                c = related[j]
                cand = segment_name(c.candidate, c.candidate_label, "candidate")
                out.append(("missing", f"{ref} has no exact counterpart (closest: {cand}, cos {fmt_cos(c.cosine)})"))
            else:
                out.append(("missing", f"{ref} is missing from the candidate"))
    return out


def _match_sentence(m: SegmentMatch) -> str:
    cand = segment_name(m.candidate, m.candidate_label, "candidate")
    ref = segment_name(m.reference, m.reference_label, "reference")
    runner = ""
    if m.runner_up is not None:
        which = "closest" if m.reference is None else "runner-up"
        runner = f"; {which}: reference segment {m.runner_up}, cos {fmt_cos(m.runner_up_cosine, 4)}"
    bank = f"; bank: {m.bank_layer}" if m.bank_layer else ""
    if m.status == "extra" or m.reference is None:
        return f"{cand} has no counterpart in the reference (extra{runner}{bank})"
    what = {
        "same": "same slot",
        "moved": "moved",
        "duplicate": "duplicate: another candidate segment also carries it",
        "related": "related only, not the same data",
    }.get(m.status, m.status)
    sign = "~" if m.status == "related" else "="
    how = ""
    if m.relation == "transformed" and m.transform:
        how = f", {m.transform.get('kind')} on the {m.transform.get('side') or 'candidate'} side"
    elif m.relation in ("drift", "other"):
        how = f", {m.relation}: standardised error {fmt_num(m.relative_error, 3)}"
    std = f", standardised {fmt_cos(m.standardised_cosine, 4)}" if m.standardised_cosine is not None else ""
    return f"{cand} {sign} {ref} (cos {fmt_cos(m.cosine)}{std}, {what}{how}{runner}{bank})"


#: Evidence keys rendered as their own table (not inline).
TABLE_EVIDENCE = ("groups",)
#: Evidence keys a config finding's readable diff (``changes``) stands for: the raw entries are in the JSON.
CHANGE_EVIDENCE = ("changes", "differences")


def group_table(f: Finding) -> tuple[list[str], list[list[str]]] | None:
    """A ``segment_subset`` finding's group table as (headers, rows), or None."""
    groups = f.evidence.get("groups")
    if not isinstance(groups, list) or not groups:
        return None
    headers = ["group", "rows", "off rows", "median std error", "decision"]
    rows = [[clean(g.get("group", "")), str(g.get("rows", "")), str(g.get("off_rows", "")),
             fmt_num(g.get("median_std_error"), 3), clean(g.get("decision", ""))] for g in groups if isinstance(g, dict)]
    return headers, rows


def plan_items(report: Report) -> list[tuple[str, str]]:
    """The plan as (name, value) lines, in the order a person checks them."""
    p = report.plan
    deltas = ", ".join(f"{signed_text(k)}: {v} seq" for k, v in p.sequence_deltas.items())
    scores = "  ".join(f"{signed_text(k)}: {fmt_num(v)}" for k, v in p.offset_scores.items())
    taps = p.tap_reference
    if p.tap_candidate != p.tap_reference:
        taps = f"{p.tap_reference} (reference) -> {p.tap_candidate} (candidate)"
    return [
        ("tap", taps),
        ("segment size", f"{p.segment_size} ({SEGMENT_SIZE_SOURCES.get(p.segment_size_source, p.segment_size_source)})"),
        (
            "sequences",
            f"{p.sequences_aligned} aligned of {p.sequences_reference} reference / {p.sequences_candidate} candidate",
        ),
        ("position deltas", f"{deltas} (candidate - reference)" if deltas else "none recorded"),
        (
            "label offset",
            f"{signed_text(p.label_offset)} (similarity by offset: {scores})"
            if scores
            else f"{signed_text(p.label_offset)} (no offset search)",
        ),
        ("pairs", f"{p.pairs} aligned rows (plan sample {p.sample_rows} rows)"),
        (
            "candidate rows",
            f"{p.candidate_rows_unaligned} unaligned, {p.candidate_rows_duplicate} duplicate, "
            f"{p.candidate_rows_invalid} invalid",
        ),
        ("reference rows", f"{p.reference_rows_uncovered} not covered by the candidate"),
        ("noise floor", f"standardised 1 - cos = {fmt_num(p.noise_floor)}, relative error "
                        f"{fmt_num(p.noise_floor_error, 3)} expected from storage precision alone"),
        ("compute dtype", _compute_text(p)),
        ("noise model", _noise_text(p)),
    ]


def _compute_text(p: Any) -> str:
    c = p.compute or {}
    if not c:
        return p.compute_dtype or "not decided"
    fields = c.get("fields") or {}

    def side(name: str) -> str:
        value = c.get(name)
        return f"{name} {value} ({fields.get(name, '')})" if value else f"{name} not recorded (counts as bfloat16)"
    how = "recorded" if c.get("source") == "recorded" else "assumed"
    return f"{c.get('dtype')} ({how}: {side('reference')}, {side('candidate')}); never the storage dtype"


def _noise_text(p: Any) -> str:
    """Per reference segment: expected drift and where it came from, the budget, the limit and what set it."""
    if not p.noise:
        return "not computed"
    parts = []
    for n in p.noise:
        depth = "depth ?" if n.get("depth") is None else f"depth {n['depth']}"
        limit = {"neighbour": "half the neighbour distance", "consistency": "the other segments' drift x4",
                 "others": "the healthy segments' drift x1.5",
                 "assumed": "assumed"}.get(n.get("limit_source", ""), n.get("limit_source", ""))
        nb = f", neighbour ~{fmt_num(n['neighbour'], 3)}" if n.get("neighbour") is not None else ""
        parts.append(f"segment {n['reference']} ({depth}): drift {fmt_num(n['drift'], 3)} ({n['source']}), budget "
                     f"{fmt_num(n['budget'], 3)}, other data beyond {fmt_num(n['limit'], 3)} ({limit}{nb})"
                     + ("" if n.get("separable", True) else "; cannot separate numerics from a neighbouring layer"))
    cal = p.calibration
    head = (f"calibrated on {cal['rows']} rows of {cal['sequences']} sequences ({cal['tap']}, "
            f"{cal.get('compute_dtype') or 'dtype not recorded'}); " if cal else "")
    return head + "; ".join(parts) + " (standardised relative errors)"


def config_diff_items(report: Report) -> list[tuple[str, str, str, str]]:
    """Config differences as (field, change, reference value, candidate value), one field a row: the
    physical layers first (when a side knows them and they differ), then each entry walked down to
    the fields that differ (:func:`tracediff.metadata.readable_changes`), never a whole dict.

    Entries are read leniently (``path``/``key``, ``change``/``kind``/``type``,
    ``reference``/``old``, ``candidate``/``new``); keys beyond those are appended to the change.
    """
    from tracediff.metadata import PHYSICAL_FIELD, readable_changes  # noqa: PLC0415

    out = []
    if report.config_diff:
        ref_aux, cand_aux = report.reference.aux_layers or {}, report.candidate.aux_layers or {}
        for c in readable_changes([], ref_aux.get("physical"), cand_aux.get("physical")):
            out.append((PHYSICAL_FIELD, "translated from the recorded ids", _side_value(c["reference"]),
                        _side_value(c["candidate"])))
    for entry in report.config_diff:
        d = dict(entry)
        path = _pop_first(d, ("path", "key", "field"))
        change = _pop_first(d, ("change", "kind", "type"))
        ref = _pop_first(d, ("reference", "old", "ref", "left"))
        cand = _pop_first(d, ("candidate", "new", "cand", "right"))
        rest = fmt_mapping(d, empty="")
        change_text = fmt_value(change) if change is not _MISSING else ""
        if rest:
            change_text = f"{change_text} ({rest})" if change_text else rest
        leaves = readable_changes([{"path": fmt_value(path) if path is not _MISSING else "-",
                                    "reference": None if ref is _MISSING else ref,
                                    "candidate": None if cand is _MISSING else cand}])
        for leaf in leaves or [{"field": fmt_value(path) if path is not _MISSING else "-", "reference": ref,
                                "candidate": cand}]:
            out.append((
                str(leaf["field"]),
                change_text or "changed",
                "-" if leaf["reference"] is _MISSING else _side_value(leaf["reference"]),
                "-" if leaf["candidate"] is _MISSING else _side_value(leaf["candidate"]),
            ))
    return out


def metrics_cells_scale(m: SegmentMetrics) -> list[str]:
    return [
        pair_name(m),
        str(m.rows),
        fmt_cos(m.cos_mean),
        fmt_cos(m.cos_p1),
        fmt_cos(m.cos_min),
        fmt_num(m.norm_ratio_mean, 5),
        fmt_num(m.norm_ratio_p1, 5),
        fmt_num(m.norm_ratio_p50, 5),
        fmt_num(m.norm_ratio_p99, 5),
    ]


METRICS_SCALE_HEADERS = [
    "pair",
    "rows",
    "cos mean",
    "cos p1",
    "cos min",
    "norm mean",
    "norm p1",
    "norm p50",
    "norm p99",
]
METRICS_ERROR_HEADERS = ["pair", "rel L2", "rel_diff mean", "rel_diff max", "max abs diff", "nonfinite c/r"]


def metrics_cells_error(m: SegmentMetrics) -> list[str]:
    return [
        pair_name(m),
        fmt_num(m.rel_l2),
        fmt_num(m.rel_diff_mean),
        fmt_num(m.rel_diff_max),
        fmt_num(m.max_abs_diff),
        f"{m.nonfinite_candidate}/{m.nonfinite_reference}",
    ]


def plural_counts(counts: dict[str, int]) -> str:
    """``2 errors, 1 warning, 0 info``."""
    return ", ".join(f"{counts.get(s, 0)} {s if counts.get(s, 0) == 1 or s == 'info' else s + 's'}" for s in SEVERITIES)


def segments_text(side: Side) -> str:
    """``3 segments of 64`` (how the fc input is cut; not a tensor shape)."""
    noun = "segment" if side.segments == 1 else "segments"
    return f"{side.segments} {noun} of {side.segment_size}"


#: How the plan's segment size was decided, as a person says it.
SEGMENT_SIZE_SOURCES = {"meta": "recorded in the stores", "option": "from --segment-size",
                        "inferred": "inferred from the data"}


def pair_name(m: SegmentMetrics) -> str:
    return f"c{m.candidate}->r{m.reference}"


def side_items(side: Side) -> list[tuple[str, str]]:
    """One side of the compare as (name, value) lines."""
    labels = ", ".join(side.segment_labels) if side.segment_labels else "-"
    return [
        ("path", side.path),
        ("role", side.role or "-"),
        ("tap", side.tap),
        (
            "rows",
            f"{side.rows} ({side.valid_rows} valid) from {len(side.writers)} writer(s): {', '.join(side.writers) or '-'}",
        ),
        ("width", f"{side.width} {side.dtype} = {segments_text(side)}"),
        ("segments", labels),
        ("sequences", str(side.sequences)),
        ("aux layers", aux_config_text(side)),
    ]


def clean(text: Any) -> str:
    """User text on one terminal line: control characters (ANSI escapes, newlines) made visible."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def signed_text(value: Any) -> str:
    """An offset or delta with its sign: ``-1``, ``0``, ``+2``."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return str(value)
    return f"+{number}" if number > 0 else str(number)


_MISSING = object()


def _pop_first(d: dict[str, Any], keys: Sequence[str]) -> Any:
    for k in keys:
        if k in d:
            return d.pop(k)
    return _MISSING


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
        lines += _replay(report, paint)
        lines.append("")
        lines += [paint(t, "dim") for t in _wrap("More: --verbose (plan, metrics, worst rows, evidence, config diff); "
                                                 "every number: --json FILE or --html FILE.")]
    return "\n".join(lines) + "\n"


def verdict_sentence(report: Report) -> str | None:
    """The sentence under a verdict that needs one (every renderer says it the same way)."""
    if any(f.kind == "same_recording" for f in report.findings):
        return "Both sides are one recording: the rows match because they are the same rows."
    if report.verdict != "match":
        return root_cause_sentence(report)
    undecided = [f for f in report.findings if f.kind == "segment_undecided"]
    if undecided:
        return (f"No error, but for {len(undecided)} segment pair{'s' if len(undecided) > 1 else ''} the data cannot tell "
                f"numerics from a neighbouring layer: record calibration rows (tracediff calibrate) to decide.")
    beyond = [f for f in report.findings if f.kind == "precision" and f.severity != "info"]
    if beyond:
        return (f"No error: every candidate segment is the reference's, but {len(beyond)} "
                f"{'pair differs' if len(beyond) == 1 else 'pairs differ'} beyond what numerics explain (see the warnings).")
    sources = {n.get("source") for n in report.plan.noise}
    how = ("measured on calibration rows" if sources == {"calibrated"} else
           "assumed for the compute dtype" if sources == {"assumed"} else "calibrated or assumed")
    return ("The candidate feeds the draft's fc the same rows as the reference: every segment pair within its "
            f"numerics budget (standardised relative error; budget {how}).")


def _plural(n: int, noun: str, many: str | None = None) -> str:
    return f"{n} {noun if n == 1 else (many or noun + 's')}"


def root_cause_sentence(report: Report) -> str | None:
    """``1 root cause: the candidate's segments are shifted by one slot; 2 consequences.``: what a
    mismatch comes down to, from :meth:`Report.causes` (None when no error is a root cause)."""
    causes = report.causes()
    if not causes:
        return None
    consequences = sum(len(c.consequences) for c in causes)
    shown = [c.summary for c in causes[:3]]
    head = _plural(len(causes), "root cause") + (", the first 3" if len(causes) > 3 else "")
    tail = f"; {_plural(consequences, 'consequence')}" if consequences else ""
    return f"{head}: {'; '.join(shown)}{tail}."


def render_verdict_line(report: Report) -> str:
    """The verdict on one line (``compare -q``): ``mismatch: 1 root cause, 2 consequences; 3 errors,
    1 warning, 1 info`` (a match: ``match: 0 errors, 0 warnings, 2 info``)."""
    causes = report.causes()
    if not causes:
        return f"{report.verdict}: {plural_counts(report.counts())}"
    consequences = sum(len(c.consequences) for c in causes)
    follows = f", {_plural(consequences, 'consequence')}" if consequences else ""
    return f"{report.verdict}: {_plural(len(causes), 'root cause')}{follows}; {plural_counts(report.counts())}"


def fix_heading(fix: dict[str, Any]) -> str:
    """The Fix box's title: where the change goes."""
    if fix.get("how") == "engine":
        return "Fix: the aux-layer ids in the candidate engine's numbering"
    if not (fix.get("config_can_fix") and fix.get("value") is not None):
        return "Fix: in code, not a config value"
    where = f"on the candidate ({fix['engine']})" if fix.get("engine") else "on the candidate"
    location = f", {fix['field_location']}" if fix.get("field_location") else ""
    return f"Fix {where}{location}"


def fix_assignment(fix: dict[str, Any]) -> str | None:
    """``FIELD = VALUE`` in the candidate engine's numbering, when a config value fixes it."""
    if fix.get("config_can_fix") and fix.get("value") is not None and fix.get("field"):
        return f"{fix['field']} = {fmt_value(fix['value'])}"
    return None


RECORD_NEXT_TITLE = "What to record next: this report cannot decide"


def box_steps(box: dict[str, Any] | None) -> list[tuple[str, list[str]]]:
    """A box's steps as (sentence, commands) pairs."""
    steps = (box or {}).get("steps") or []
    return [(str(s.get("text", "")), [str(c) for c in s.get("commands") or []]) for s in steps if isinstance(s, dict)]


def change_lines(f: Finding) -> list[str]:
    """A config finding's readable diff, one ``field: reference -> candidate`` a line (physical layers
    first, as the finding lists them); [] for other findings."""
    changes = f.evidence.get("changes")
    if not isinstance(changes, list):
        return []
    return [f"{c.get('field')}: {_side_value(c.get('reference'))} -> {_side_value(c.get('candidate'))}"
            for c in changes if isinstance(c, dict)]


def _side_value(value: Any) -> str:
    return "(none)" if value is None else fmt_value(value)


#: Readable-diff lines shown under a config finding in the default report (the rest: --verbose, JSON).
CHANGES_SHOWN = 8


#: Said before the config findings that record a root cause (they are no consequence of it).
RECORDED_CONFIG = "the recorded config says the same:"


def grouped_findings(report: Report) -> tuple[list[tuple[Finding, list[Finding], list[Finding]]], list[Finding]]:
    """The findings as a person reads them: each root cause with its consequences and the config
    findings that record it (:meth:`Report.causes`), then every other finding in severity order."""
    causes = report.causes()
    grouped = [(report.findings[c.finding], [report.findings[i] for i in c.consequences],
                [report.findings[i] for i in c.config]) for c in causes]
    placed = {i for c in causes for i in (c.finding, *c.consequences, *c.config)}
    rest = [f for s in SEVERITIES for i, f in enumerate(report.findings) if f.severity == s and i not in placed]
    return grouped, rest


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
        body += [("    " + line) for line in _wrap(clean(first), "", hang="    ") if line]
    for reason in reasons:
        body += _wrap(clean(reason), "", hang="  ")
    for text, commands in box_steps(box):
        if text:
            body += _wrap(clean(text), "", hang="  ")
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
        lines += _table(*table, indent=hang + "  ")
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


def render_summary(report: Report, color: bool = False) -> str:
    """The top of :func:`render_text` alone: the verdict, every error finding, both sides' aux layers."""
    return "\n".join(_summary(report, _Painter(color))).rstrip("\n") + "\n"


def _wrap(text: str, indent: str = "", hang: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        width=WIDTH,
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
    verdict = report.verdict.upper()
    tally = plural_counts(counts)
    head = f"tracediff compare: {verdict}"
    lines = [
        paint(head, "bold", "green" if report.verdict == "match" else "red")
        + f"  ({tally}; exit code {report.exit_code()})"
    ]
    sentence = verdict_sentence(report)
    if sentence:
        lines += _wrap(clean(sentence), "  ")
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
        lines += _table(*table, indent=hang)
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


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(headers)]
    fmt = indent + "  ".join(f"{{:{'<' if k == 0 else '>'}{w}}}" for k, w in enumerate(widths))
    out = [fmt.format(*headers), indent + "  ".join("-" * w for w in widths)]
    out += [fmt.format(*r) for r in rows]
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
