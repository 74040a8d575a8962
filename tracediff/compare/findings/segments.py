"""Findings about the segments: wiring (order, missing, extra, duplicate) and values (scale, value,
precision), each resting on the plan's structural decisions, plus the fix in the candidate's words.

A segment pair's relation comes from fitted transforms (:mod:`tracediff.compare.plan.transforms`), never from a
norm ratio alone: a neighbouring layer differs in norm too, and calling it a normalisation would
send an engineer to the wrong place. Every number a decision used is in the evidence.
"""

from __future__ import annotations

import math
from typing import Any

from tracediff.adapters.conventions import AuxLayers, engine_of, format_layers
from tracediff.compare.findings.remedy import Fix, propose_fix
from tracediff.compare.findings.slots import one_rotation_cause, relation_finding, row_model_findings
from tracediff.compare.plan.decide import Relation, SegmentPlan
from tracediff.compare.plan.metadata import is_aux_key, num_layers
from tracediff.compare.plan.noise import ASSUMED_LIMIT_FACTOR, CONSISTENT_FACTOR, OUTLIER_FACTOR
from tracediff.compare.plan.segments import SegmentDecision
from tracediff.compare.results import Finding, Report, SegmentMetrics
from tracediff.compare.stream.metrics import StreamResult


def seg_name(label: str | None, index: int | None) -> str:
    if index is None:
        return "none"
    return f"{index} ({label})" if label and label != f"seg{index}" else str(index)


def _slots(n: int) -> str:
    return "one slot" if abs(n) == 1 else f"{abs(n)} slots"


def segment_findings(report: Report, segplan: SegmentPlan, stream: StreamResult, ref_aux: AuxLayers | None,
                     cand_aux: AuxLayers | None, bank: Any, context: Finding | None,
                     subsets: dict | None = None) -> list[Finding]:
    """Wiring first (root causes), then subsets of rows, then the values of matched pairs."""
    subsets = subsets or {}
    decisions = segplan.decisions
    # A pair explained by a subset is reported once, as that subset (not as missing, extra or value).
    explained_c = {i for i, _ in subsets}
    explained_r = {j for _, j in subsets}
    wiring = [f for f in _wiring_findings(report, segplan)
              if not (f.kind == "segment_missing" and f.evidence["reference_segment"] in explained_r)
              and not (f.kind == "segment_extra" and f.evidence["candidate_segment"] in explained_c)]
    _mark_shift_consequences(wiring, report.reference.segments, report.candidate.segments)
    subset_findings = [_subset_finding(report, i, j, s, c) for (i, j), (s, c) in sorted(subsets.items())]
    if context is not None:
        # Rows after a changed context differ by construction: a consequence, not a root cause.
        subset_findings = [Finding("segment_subset", "warning", f.message + f" Expected while the sequences differ "
                                   f"(see {context.kind}): fix that first and compare again.",
                                   {**f.evidence, "explained_by": context.kind}, f.summary) for f in subset_findings]
    values = [f for f in _value_findings(report, segplan, stream, context)
              if (f.evidence.get("candidate_segment"), f.evidence.get("reference_segment")) not in subsets]
    wrong_layer = [f for f in values if f.kind == "segment_value" and f.evidence.get("explained_by") is None]
    if wiring or wrong_layer:
        engine = engine_of(report.candidate.meta.get("store") or {}, None) or engine_of(
            report.candidate.meta.get("writer") or {}, None)
        layers = num_layers(report.reference.meta) or num_layers(report.candidate.meta)
        from tracediff.adapters.engine_rules import recorded_rule  # noqa: PLC0415

        fix = propose_fix(decisions, report.reference.segments, ref_aux, cand_aux, engine, bank, layers,
                          engine_rule=recorded_rule(report.candidate.meta, engine))
        _attach_fix((wiring or wrong_layer)[0], fix)
    one_rotation_cause(values)
    return (row_model_findings(report) + wiring + subset_findings + values
            + _layer_config_findings(report, segplan, ref_aux, cand_aux, subsets, wiring + values))


def _subset_finding(report: Report, i: int, j: int, subset: Any, content: Any) -> Finding:
    cand = seg_name(report.candidate.segment_labels[i], i)
    ref = seg_name(report.reference.segment_labels[j], j)
    rest = subset.pair_rows - subset.rows
    table = [
        {"group": subset.description, "rows": subset.rows, "off_rows": subset.off_rows,
         "median_std_error": subset.median_error, "decision": content.text},
        {"group": "the other rows", "rows": rest, "off_rows": subset.off_total - subset.off_rows,
         "median_std_error": subset.median_error_rest, "decision": f"reference segment {ref}"},
    ]
    return Finding(
        "segment_subset", "error",
        f"Candidate segment {cand} is reference segment {ref} on {rest} of the {subset.pair_rows} aligned rows, but on "
        f"the {subset.rows} {subset.description} it holds {content.text} (median standardised error "
        f"{subset.median_error:.3g} there vs {subset.median_error_rest:.3g} elsewhere; {subset.off_rows} of the "
        f"{subset.off_total} rows beyond numerics are in this group). Look at the code path those rows take.",
        {"candidate_segment": i, "reference_segment": j, "subset": subset.to_dict(), "content": content.kind,
         "content_evidence": content.evidence, "groups": table},
        f"candidate segment {cand} holds {_CONTENT_WORDS.get(content.kind, 'other data')} on the {subset.description}",
    )


#: What a subset's rows hold, in a few words (the summary; the message has the whole sentence).
_CONTENT_WORDS = {"zeros": "zeros", "constant": "one constant row", "other_request": "another request's rows",
                  "neighbour_position": "a neighbouring position's rows", "reference_segment": "another segment",
                  "unknown": "other data"}


def _mark_shift_consequences(wiring: list[Finding], ref_segments: int, cand_segments: int) -> None:
    """A shift by s slots empties s reference slots at one end and fills s candidate slots at the
    other: those segment_missing and segment_extra findings follow from the shift (one
    misconfiguration, not three), and say so with ``explained_by``. Others stay root causes."""
    order = next((f for f in wiring if f.kind == "segment_order" and f.evidence.get("pattern") == "shift"), None)
    if order is None:
        return
    s = int(order.evidence["shift"])
    # Candidate slot i carries reference slot i + s.
    vacated = set(range(s)) if s > 0 else set(range(ref_segments + s, ref_segments))
    filled = set(range(cand_segments - s, cand_segments)) if s > 0 else set(range(-s))
    for f in wiring:
        if ((f.kind == "segment_missing" and f.evidence["reference_segment"] in vacated)
                or (f.kind == "segment_extra" and f.evidence["candidate_segment"] in filled)):
            f.evidence["explained_by"] = "segment_order"
            f.message = f.message.rstrip() + " It follows from the shift (see segment_order)."


def _attach_fix(finding: Finding, fix: Fix) -> None:
    finding.evidence["fix"] = fix.to_dict()
    finding.message = finding.message.rstrip() + " " + fix.sentence()


def _wiring_findings(report: Report, segplan: SegmentPlan) -> list[Finding]:
    ref, cand = report.reference, report.candidate
    decisions = segplan.decisions
    rlab, clab = ref.segment_labels, cand.segment_labels
    out: list[Finding] = []
    matched = [d for d in decisions if d.reference is not None and d.duplicate_of is None]
    moved = [d for d in matched if d.reference != d.candidate]
    if moved:
        shifts = {d.reference - d.candidate for d in matched}
        pairs_text = ", ".join(
            f"candidate segment {seg_name(clab[d.candidate], d.candidate)} = reference segment "
            f"{seg_name(rlab[d.reference], d.reference)}" for d in matched
        )
        if len(shifts) == 1:
            s = next(iter(shifts))
            how = (f"the candidate's segments are the reference's shifted by {_slots(s)} (the candidate starts "
                   f"{_slots(s)} {'later' if s > 0 else 'earlier'})")
            detail: dict[str, Any] = {"pattern": "shift", "shift": s}
        else:
            how = "the candidate concatenates the same hidden states in a different order"
            detail = {"pattern": "permutation"}
        summary = (f"the candidate's segments are shifted by {_slots(detail['shift'])}" if "shift" in detail
                   else "the candidate concatenates the same hidden states in another order")
        out.append(Finding(
            "segment_order", "error",
            f"Segments are wired differently: {pairs_text}; {how}.",
            {**detail, "pairs": [{"candidate": d.candidate, "reference": d.reference} for d in matched]},
            summary,
        ))
    taken = {d.reference for d in matched}
    std = segplan.standardised
    for j in range(ref.segments):
        # A reference slot whose candidate counterpart is all NaN (or that is all NaN itself) is a
        # nonfinite finding, not a wiring one: nothing says what that slot would hold.
        if j in taken or j in segplan.dead_reference or (j in segplan.dead_candidate and j < cand.segments):
            continue
        col = std[:, j]
        finite = [(float(col[i]), i) for i in range(col.size) if math.isfinite(col[i])]
        best = max(finite)[1] if finite else None
        text = (f" (closest: candidate segment {seg_name(clab[best], best)}, standardised cosine {col[best]:.3f}, "
                f"raw {segplan.raw[best, j]:.4f}: alike, but no transform makes it this segment)"
                if best is not None else "")
        out.append(Finding(
            "segment_missing", "error",
            f"Reference segment {seg_name(rlab[j], j)} is missing from the candidate{text}; the draft was trained with "
            f"this hidden state and the server does not feed it.",
            {"reference_segment": j, "closest_candidate": best,
             "closest_standardised_cosine": float(col[best]) if best is not None else None,
             "closest_cosine": float(segplan.raw[best, j]) if best is not None else None},
            f"reference segment {seg_name(rlab[j], j)} is missing from the candidate",
        ))
    for d in decisions:
        if d.duplicate_of is not None:
            out.append(Finding(
                "segment_duplicate", "error",
                f"Candidate segments {d.duplicate_of} and {d.candidate} both carry reference segment "
                f"{seg_name(rlab[d.reference], d.reference)}: the server feeds the same hidden state twice.",
                {"candidate_segments": [d.duplicate_of, d.candidate], "reference_segment": d.reference},
                f"candidate segments {d.duplicate_of} and {d.candidate} carry the same reference segment",
            ))
        elif d.reference is None and d.candidate in segplan.dead_candidate:
            continue
        elif d.reference is None:
            closest = d.runner_up
            near = (f"closest: reference segment {seg_name(rlab[closest], closest)}, standardised cosine "
                    f"{std[d.candidate, closest]:.3f}, raw {segplan.raw[d.candidate, closest]:.4f}"
                    if closest is not None else "no reference segment is close")
            out.append(Finding(
                "segment_extra", "error",
                f"Candidate segment {seg_name(clab[d.candidate], d.candidate)} has no counterpart in the reference "
                f"({near}; not the same tensor under any transform): the server feeds a hidden state the draft "
                f"never saw in training; use --bank to name its layer.",
                {"candidate_segment": d.candidate, "closest_reference": closest,
                 "closest_standardised_cosine": float(std[d.candidate, closest]) if closest is not None else None,
                 "closest_cosine": float(segplan.raw[d.candidate, closest]) if closest is not None else None},
                f"candidate segment {seg_name(clab[d.candidate], d.candidate)} is a hidden state the reference "
                f"never had",
            ))
    return out


def _value_findings(report: Report, segplan: SegmentPlan, stream: StreamResult,
                    context: Finding | None) -> list[Finding]:
    out: list[Finding] = []
    by_pair = {(m.candidate, m.reference): m for m in stream.metrics}
    for d in segplan.decisions:
        rel = segplan.relations.get(d.candidate)
        if d.reference is None or d.duplicate_of is not None or rel is None:
            continue
        m = by_pair.get((d.candidate, d.reference))
        if m is None or m.rows == 0:
            continue
        found = _pair_findings(report, segplan, d, rel, m)
        if context is not None and found:
            # A different context changes every hidden state after it: report the consequence as such,
            # not as a second root cause.
            f = found[0]
            found = [Finding(
                "segment_value", "warning",
                f"Candidate segment {_cand(report, d)} differs from reference segment {_ref(report, d)} (standardised "
                f"relative error {m.std_rel_error:.3g}, cosine {m.cos_mean:.4f}); expected while the sequences differ "
                f"(see {context.kind}): fix that first and compare again.",
                {**f.evidence, "explained_by": context.kind},
                f"candidate segment {_cand(report, d)} differs from reference segment {_ref(report, d)}",
            )]
        out += found
    return out


def _cand(report: Report, d: SegmentDecision) -> str:
    return seg_name(report.candidate.segment_labels[d.candidate], d.candidate)


def _ref(report: Report, d: SegmentDecision) -> str:
    assert d.reference is not None
    return seg_name(report.reference.segment_labels[d.reference], d.reference)


def _noise_text(segplan: SegmentPlan, j: int) -> str:
    """Where segment ``j``'s budget came from, in a few words."""
    n = segplan.noise[j]
    if n.source == "calibrated":
        return f"measured on {n.calibration_rows} calibration rows"
    return f"assumed for {segplan.compute_dtype} compute at depth {segplan.depths[j]}"


def _limit_text(segplan: SegmentPlan, j: int) -> str:
    n = segplan.noise[j]
    if n.limit_source == "neighbour":
        return (f"half the distance to a neighbouring layer, {n.neighbour:.3g}, estimated from the reference's own "
                f"layers")
    if n.limit_source == "consistency":
        return f"{OUTLIER_FACTOR:g}x the drift the other segments show at this depth ({n.consistent:.3g})"
    if n.limit_source == "others":
        return (f"{CONSISTENT_FACTOR:g}x the drift the segments within their limits show, carried to this depth "
                f"({n.consistent:.3g}): drift on every layer, not one wrong layer")
    return f"{ASSUMED_LIMIT_FACTOR:g}x the budget (assumed: no other layer to measure against)"


def _pair_findings(report: Report, segplan: SegmentPlan, d: SegmentDecision, rel: Relation,
                   m: SegmentMetrics) -> list[Finding]:
    assert d.reference is not None
    budget = math.sqrt(segplan.budgets[d.reference])
    limit = math.sqrt(segplan.limits[d.reference])
    noise = segplan.noise[d.reference]
    label, rlabel = f"candidate segment {_cand(report, d)}", f"reference segment {_ref(report, d)}"
    evidence: dict[str, Any] = {
        "candidate_segment": d.candidate, "reference_segment": d.reference, "relation": rel.relation,
        "std_rel_error": m.std_rel_error, "std_row_error_p99": m.std_row_error_p99,
        "std_row_error_max": m.std_row_error_max, "numerics_budget": budget,
        "budget_depth": segplan.depths[d.reference],
        "plan_std_rel_error": rel.relative_error,
        "fits": [f.to_dict() for f in rel.fits],
        "cos_mean": m.cos_mean, "cos_p1": m.cos_p1, "cos_min": m.cos_min, "norm_ratio_p1": m.norm_ratio_p1,
        "norm_ratio_p50": m.norm_ratio_p50, "norm_ratio_p99": m.norm_ratio_p99, "rel_l2": m.rel_l2,
        "worst_rows": m.worst_rows[:3], "standardised_distance": d.distance,
        "runner_up_distance": d.runner_up_distance, "drift_limit": limit, "noise": noise.to_dict(),
    }
    if rel.relation == "transformed" and rel.transform is not None:
        named = relation_finding(report, rel, m, evidence, label, rlabel, budget)
        if named is not None:
            return [named]
        t = rel.transform
        evidence["transform"] = t.to_dict()
        evidence["constant_scale"] = t.kind == "constant"
        what = {"constant": "a scale factor is applied on one side only (a multiplier, a cast with scaling)",
                "rmsnorm": "one side feeds normalised states: pre-norm vs post-norm hidden states (the final norm, "
                           "norm_before_fc or fc_norm on one side only)",
                "layernorm": "one side feeds LayerNorm-ed states (a norm on one side only)"}[t.kind]
        return [Finding(
            "segment_scale", "error",
            f"{label} is {rlabel} {t.describe()}, within numerics (held-out standardised error "
            f"{t.relative_error:.2g} vs budget {budget:.2g}; norm ratio median {m.norm_ratio_p50:.4g}): {what}.",
            evidence,
            f"{label} is {rlabel} "
            + {"constant": "times a constant", "rmsnorm": "normalised on one side only (RMSNorm)",
               "layernorm": "normalised on one side only (LayerNorm)"}[t.kind],
        )]
    if rel.relation == "other" and d.reference == d.candidate:
        fits = ", ".join(f"{f.kind}{'' if f.side in (None, 'candidate') else ' (reference side)'} "
                         f"{f.relative_error:.2g}" for f in rel.fits)
        return [Finding(
            "segment_value", "error",
            f"{label} resembles {rlabel} but is other data (standardised relative error {m.std_rel_error:.3g}, "
            f"{m.std_rel_error / budget:.0f}x what numerics explain ({budget:.2g}, {_noise_text(segplan, d.reference)}) "
            f"and beyond {limit:.2g}, {_limit_text(segplan, d.reference)}; raw cosine {m.cos_mean:.4f}); no transform "
            f"fits (held-out errors: {fits}): probably a neighbouring layer, or another context.",
            evidence,
            f"{label} holds other data than {rlabel} (probably a neighbouring layer)",
        )]
    err = m.std_rel_error if math.isfinite(m.std_rel_error) else rel.relative_error
    if rel.relation == "undecided" and noise.neighbour is not None:
        return [Finding(
            "segment_undecided", "warning",
            f"{label} matches {rlabel} within numerics (standardised relative error {err:.3g}, budget {budget:.2g}, "
            f"{_noise_text(segplan, d.reference)}), but a neighbouring layer may be as close as {noise.neighbour:.3g} "
            f"here (estimated from the reference's own layers): the data cannot tell this layer from its neighbour. "
            + ("The calibration rows drift this far themselves: compare with --bank (every layer of the target) to "
               "decide." if noise.source == "calibrated" else
               "Record calibration rows on the reference (tracediff calibrate REFERENCE --model TARGET_DIR) or compare "
               "with --bank to decide."),
            evidence,
        )]
    if math.isfinite(err) and err > budget:
        return [Finding(
            "precision", "warning",
            f"{label} is {rlabel} (it matches no other segment nearly as well), but differs by a standardised relative "
            f"error of {err:.3g}, {err / budget:.1f}x what numerics explain ({budget:.2g}, "
            f"{_noise_text(segplan, d.reference)}; other data beyond {limit:.2g}; "
            f"raw cosine {m.cos_mean:.5f}): other kernels, quantised weights (FP8/INT8) or another compute dtype on "
            f"one side. Worst row: {_worst(m)}.",
            evidence,
        )]
    return []


def _worst(m: SegmentMetrics) -> str:
    if not m.worst_rows:
        return "none"
    w = m.worst_rows[0]
    c = w["candidate"]
    return (f"sequence {c['seq']} position {c['position']} token {c['token_id']} (standardised error "
            f"{w.get('std_error', float('nan')):.3g}, cosine {w['cosine']:.4f})")


def _layer_config_findings(report: Report, segplan: SegmentPlan, ref_aux: AuxLayers | None,
                           cand_aux: AuxLayers | None, subsets: dict, found: list[Finding]) -> list[Finding]:
    """Both sides record their aux layers and a matched pair's slots name different physical layers,
    yet the data called the pair the same tensor (or drift of it): never a silent match. Bit-exact
    data says the labels are wrong; anything less says the data could not tell the layers apart."""
    if ref_aux is None or cand_aux is None or ref_aux.physical is None or cand_aux.physical is None:
        return []
    rp, cp = list(ref_aux.physical), list(cand_aux.physical)
    if len(rp) != report.reference.segments or len(cp) != report.candidate.segments:
        return []
    reported = {(f.evidence.get("candidate_segment"), f.evidence.get("reference_segment")) for f in found}
    out = []
    for d in segplan.decisions:
        rel = segplan.relations.get(d.candidate)
        if d.reference is None or d.duplicate_of is not None or rel is None or rel.relation == "other":
            continue
        i, j = d.candidate, d.reference
        # Moved segments are wiring (segment_order says so); a slot is checked against its own config.
        if i != j or rp[j] == cp[i] or (i, j) in subsets:
            continue
        noise = segplan.noise[j]
        rtext, ctext = format_layers([rp[j]])[1:-1], format_layers([cp[i]])[1:-1]
        evidence = {"differences": [x for x in report.config_diff if is_aux_key(x["path"])],
                    "candidate_segment": i, "reference_segment": j, "reference_layer": rp[j], "candidate_layer": cp[i],
                    "relation": rel.relation, "tier": d.tier, "plan_std_rel_error": rel.relative_error,
                    "numerics_budget": noise.budget, "neighbour_distance": noise.neighbour,
                    "noise_source": noise.source}
        if d.tier == "exact":
            out.append(Finding(
                "config", "warning",
                f"Candidate segment {_cand(report, d)} is recorded as layer {ctext} and reference segment "
                f"{_ref(report, d)} as layer {rtext}, but their values are identical up to storage rounding: one side "
                f"records its aux layers wrongly (check the numbering convention of {cand_aux.field} and "
                f"{ref_aux.field}).", evidence))
            continue
        already = (i, j) in reported
        out.append(Finding(
            "config", "error",
            f"The two sides are configured for different layers in this slot: reference segment {_ref(report, d)} is "
            f"layer {rtext} ({ref_aux.field}), candidate segment {_cand(report, d)} layer {ctext} ({cand_aux.field}); "
            f"the data {'does not separate them clearly' if already else 'could not tell them apart'} at this depth "
            f"(standardised relative error {rel.relative_error:.3g}, numerics budget {noise.budget:.2g}"
            + (f", neighbour distance ~{noise.neighbour:.2g}" if noise.neighbour is not None else "")
            + "). Feed the trained layers, or record calibration rows (tracediff calibrate) or a bank (--bank) to "
              "decide from the data.", evidence,
            f"slot {j} is configured for layer {rtext} on the reference and {ctext} on the candidate"))
    return out


def name_bank_layers(report: Report, bank: Any, bank_path: Any) -> None:
    """With a bank: say which layer each segment is, inside the segment map and the findings."""
    ref_id, cand_id = bank

    def name(ident: Any, i: int) -> str:
        seg = ident.segments[i]
        return seg.best.text if seg.best is not None and seg.verdict in ("match", "scaled") else "no layer of the bank"

    for m in report.segment_map:
        m.bank_layer = name(cand_id, m.candidate)
    for f in report.findings:
        if f.kind == "segment_extra":
            i = f.evidence["candidate_segment"]
            f.message = f.message.replace("; use --bank to name its layer.", ".")
            f.message += f" Candidate segment {i} is {name(cand_id, i)}; the reference never used it."
            f.evidence["bank_layer"] = name(cand_id, i)
        elif f.kind == "segment_missing":
            j = f.evidence["reference_segment"]
            f.message += f" Reference segment {j} is {name(ref_id, j)}."
            f.evidence["bank_layer"] = name(ref_id, j)
        elif f.kind == "segment_value" and f.evidence.get("relation") == "other" and not f.evidence.get("explained_by"):
            _name_wrong_layer(f, name(cand_id, f.evidence["candidate_segment"]), name(ref_id, f.evidence["reference_segment"]))
    for side, ident in (("reference", ref_id), ("candidate", cand_id)):
        layers = ", ".join(name(ident, i) for i in range(len(ident.segments)))
        report.plan.notes.append(f"bank {bank_path}: {side} segments are {layers}")
        if ident.suggestions:
            shown = "; ".join(f"{k} = {v}" for k, v in ident.suggestions.items())
            report.plan.notes.append(f"{side} in config terms: {shown}")


def _name_wrong_layer(f: Finding, fed: str, trained: str) -> None:
    """A slot the bank names on both sides, differently: that is the root cause, in its words."""
    f.evidence["bank_layer"], f.evidence["reference_bank_layer"] = fed, trained
    unnamed = "no layer of the bank"
    if fed == trained or unnamed in (fed, trained):
        return
    who = f.summary.split(" holds other data")[0] if " holds other data" in f.summary else "the candidate"
    f.summary = f"{who} is {fed}, where the draft was trained on {trained}"
    f.message = f.message.replace(
        "probably a neighbouring layer, or another context.",
        f"the bank names both: the server feeds {fed} where the draft was trained on {trained}.")
