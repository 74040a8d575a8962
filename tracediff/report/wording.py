"""How every renderer of a compare report says things: numbers, names, sentences, table cells.

The terminal, Markdown and HTML renderers all read these, so that the three say exactly the same
thing (a segment's name, the segment map's sentences, the plan's lines, the aux-layer config, the
verdict's sentence, the Fix box's steps). Formats only: never computes a metric or a decision.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from tracediff.compare.results import SEVERITIES, Finding, Report, SegmentMatch, SegmentMetrics, Side

WORST_ROWS_SHOWN = 5

# Evidence values longer than this are cut in the text and Markdown reports (about two lines).
EVIDENCE_CHARS = 180

SEVERITY_TITLES = {"error": "Errors", "warning": "Warnings", "info": "Info"}

# Statuses whose reference segment really is present in the candidate (``related`` is a best
# guess only: the reference segment it points at is still reported as having no exact counterpart).
_PRESENT_STATUSES = ("same", "moved", "duplicate")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# ---------------------------------------------------------------------------- numbers, names
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
    if any(m.status == "undecided" for m in report.segment_map):
        return out  # (which reference segments are carried is not known either)
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
    if m.status == "undecided":
        return f"{cand}: cannot tell which reference segment it carries (see the first lines){bank}"
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
    stored = "".join(f"; the {s}'s rows were stored as {fmt} (its rounding is storage noise, in the noise floor)"
                     for s, fmt in (c.get("storage") or {}).items())
    return f"{c.get('dtype')} ({how}: {side('reference')}, {side('candidate')}); never the storage dtype{stored}"


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
    stored = next((n.get("storage_dtype") for n in p.noise if n.get("storage_dtype")), None)
    if stored:
        parts.append(f"storage rounding of {stored} (per-token scales) simulated in each budget")
    cal = p.calibration
    head = (f"calibrated on {cal['rows']} rows of {cal['sequences']} sequences ({cal['tap']}, "
            f"{cal.get('compute_dtype') or 'dtype not recorded'}); " if cal else "")
    return head + "; ".join(parts) + " (standardised relative errors)"


def config_diff_items(report: Report) -> list[tuple[str, str, str, str]]:
    """Config differences as (field, change, reference value, candidate value), one field a row: the
    physical layers first (when a side knows them and they differ), then each entry walked down to
    the fields that differ (:func:`tracediff.compare.plan.metadata.readable_changes`), never a whole dict.

    Entries are read leniently (``path``/``key``, ``change``/``kind``/``type``,
    ``reference``/``old``, ``candidate``/``new``); keys beyond those are appended to the change.
    """
    from tracediff.compare.plan.metadata import PHYSICAL_FIELD, readable_changes  # noqa: PLC0415

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
        *([("row model", row_model_text(side.row_model))] if side.row_model else []),
    ]


def row_model_text(row_model: dict[str, Any]) -> str:
    """A side's row model (the report's ``row_model``): its name and what each slot holds."""
    return f"{row_model.get('name')}: " + "; ".join(str(t) for t in row_model.get("slots_text") or [])


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


# -------------------------------------------------------------- the verdict, causes and boxes
def verdict_title(report: Report) -> str:
    """``MATCH``, ``MISMATCH``, ``CANNOT TELL``."""
    return report.verdict.upper().replace("_", " ")


def assumed_evidence(report: Report) -> list[str]:
    """One sentence per precondition the compare assumed rather than had (the data agreed with the
    assumption): said in the first lines of every report, under the verdict."""
    return [f"Assumed, not recorded: {p.message}; {p.record}." for p in report.preconditions if p.status == "supported"]


def verdict_sentence(report: Report) -> str | None:
    """The sentence under a verdict that needs one (every renderer says it the same way)."""
    if any(f.kind == "same_recording" for f in report.findings):
        return "Both sides are one recording: the rows match because they are the same rows."
    if report.verdict == "cannot_tell":
        return " ".join(f"Cannot tell which layers the candidate feeds: {p.short}; {p.record}, then compare again."
                        for p in report.preconditions if p.status == "unmet")
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


def plural(n: int, noun: str, many: str | None = None) -> str:
    return f"{n} {noun if n == 1 else (many or noun + 's')}"


def root_cause_sentence(report: Report) -> str | None:
    """``1 root cause: the candidate's segments are shifted by one slot; 2 consequences.``: what a
    mismatch comes down to, from :meth:`Report.causes` (None when no error is a root cause)."""
    causes = report.causes()
    if not causes:
        return None
    consequences = sum(len(c.consequences) for c in causes)
    shown = [c.summary for c in causes[:3]]
    head = plural(len(causes), "root cause") + (", the first 3" if len(causes) > 3 else "")
    tail = f"; {plural(consequences, 'consequence')}" if consequences else ""
    return f"{head}: {'; '.join(shown)}{tail}."


def fix_heading(fix: dict[str, Any]) -> str:
    """The Fix box's title: where the change goes."""
    if fix.get("how") == "engine":
        return "Fix: the aux-layer ids in the candidate engine's numbering"
    if fix.get("how") == "draft":
        return "Fix: in the candidate's draft (its checkpoint, config or code), not its inputs"
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


def chain_rows(chain: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The draft chain's table (Report.chain, tracediff/compare/chain.py): one row per tap."""

    def num(metrics: dict[str, Any], key: str, spec: str) -> str:
        value = metrics.get(key)
        return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    headers = ["tap", "step", "status", "cos mean", "rel L2", "norm ratio", "top-1"]
    rows = [[str(x["tap_candidate"] or x["tap_reference"]), str(x["step"]), str(x["status"]),
             num(x["metrics"], "cos_mean", ".6f"), num(x["metrics"], "rel_l2", ".3g"),
             num(x["metrics"], "norm_ratio_p50", ".4g"), num(x["metrics"], "target_top1_agreement", ".3f")]
            for x in chain]
    return headers, rows


def chain_note(chain: list[dict[str, Any]]) -> str | None:
    """Why the chain's not_comparable taps were not judged (one line: the first such tap's reason),
    None when every tap was."""
    reasons = [x["found"][0] for x in chain if x.get("status") == "not_comparable" and x.get("found")]
    return f"not_comparable: {reasons[0]}" if reasons else None
