"""Findings: turn the plan, the segment decisions and the streamed numbers into sentences a person
can act on, each with the evidence behind it. Ordered root cause first (layout, sequences, labels,
segment wiring), consequences after (values, precision, coverage, config)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tracediff.align import Alignment, RowPairs
from tracediff.diagnose import StreamResult, row_ref
from tracediff.results import Finding, Report, SegmentMetrics
from tracediff.segments import EXACT_FACTOR, SegmentDecision, scale_tolerance


def _seg(label: str | None, index: int | None) -> str:
    if index is None:
        return "none"
    return f"{index} ({label})" if label and label != f"seg{index}" else str(index)


def _ordinal_slots(n: int) -> str:
    return "one slot" if abs(n) == 1 else f"{abs(n)} slots"


def build_findings(
    report: Report,
    alignment: Alignment,
    pairs: RowPairs,
    decisions: list[SegmentDecision],
    stream: StreamResult,
    centred: np.ndarray,
    baseline: np.ndarray,
) -> list[Finding]:
    ref, cand, plan = report.reference, report.candidate, report.plan
    out: list[Finding] = []
    aux = {"reference": ref.aux_layer_config, "candidate": cand.aux_layer_config}

    # -- layout
    if ref.width != cand.width:
        out.append(Finding(
            "shape", "error",
            f"Candidate rows are {cand.width} wide ({cand.segments} segments of {plan.segment_size}) but reference rows "
            f"are {ref.width} ({ref.segments} segments): the server concatenates a different number of hidden states "
            f"than the draft was trained on.",
            {"reference_width": ref.width, "candidate_width": cand.width, "segment_size": plan.segment_size,
             "reference_segments": ref.segments, "candidate_segments": cand.segments, "aux_layer_config": aux},
        ))
    if ref.dtype != cand.dtype:
        out.append(Finding(
            "dtype", "info",
            f"Reference rows are {ref.dtype} and candidate rows {cand.dtype}; values are compared in float32 and "
            f"the storage noise floor (1 - cos = {plan.noise_floor:.1e}) is allowed for.",
            {"reference": ref.dtype, "candidate": cand.dtype, "noise_floor": plan.noise_floor},
        ))

    # -- sequences
    unaligned_seqs = plan.sequences_candidate - plan.sequences_aligned
    if unaligned_seqs:
        out.append(Finding(
            "sequence_mismatch", "warning",
            f"{unaligned_seqs} of {plan.sequences_candidate} candidate sequences share no tokens with any reference "
            f"sequence and were left out; replay the reference's token ids to the server (tracediff send) so both "
            f"record the same inputs.",
            {"candidate_sequences": plan.sequences_candidate, "aligned": plan.sequences_aligned},
        ))
    eff = pairs.effective_delta
    prefix_groups = {g: rows for g, rows in pairs.prefix_rows.items() if rows.size}
    if prefix_groups:
        lengths = sorted({int(rows.size) for rows in prefix_groups.values()})
        example_group, example_rows = next(iter(prefix_groups.items()))
        tokens = [int(t) for t in alignment.candidate.token_id[example_rows][:16]]
        out.append(Finding(
            "sequence_prefix", "error",
            f"Candidate sequences start with {lengths[0] if len(lengths) == 1 else lengths} extra token(s) the "
            f"reference does not have (e.g. {tokens}): the server adds a prefix (chat template, BOS, system prompt), "
            f"so every later hidden state sees a different context; feed the server the exact training token ids.",
            {"sequences": len(prefix_groups), "prefix_lengths": lengths, "example_tokens": tokens,
             "example_sequence": alignment.candidate.group_keys[example_group]},
        ))
    else:
        neg = {g: d for g, d in eff.items() if d < 0}
        ref_prefix = _reference_prefix(alignment, neg)
        if ref_prefix:
            out.append(Finding(
                "sequence_prefix", "error",
                f"Reference sequences start with {ref_prefix['length']} token(s) the candidate lacks "
                f"(e.g. {ref_prefix['tokens']}): the trainer saw a prefix (chat template, BOS) the server does not "
                f"get, so hidden states are computed in a different context.",
                ref_prefix,
            ))
        shifted = {d for d in eff.values() if d != 0}
        if shifted and not ref_prefix:
            common = max(shifted, key=lambda d: sum(1 for v in eff.values() if v == d))
            out.append(Finding(
                "position_offset", "info",
                f"Candidate positions are the reference's {'+' if common > 0 else ''}{common} for the same tokens "
                f"and values; a constant position offset in the labels (e.g. speculators trains at p+1) is benign.",
                {"delta": common, "sequences": sum(1 for v in eff.values() if v == common)},
            ))

    # -- label offset
    if plan.label_offset != 0:
        o = plan.label_offset
        late = o < 0
        out.append(Finding(
            "token_offset", "error",
            f"Candidate rows are labelled {abs(o)} token{'s' if abs(o) > 1 else ''} {'late' if late else 'early'}: the "
            f"row labelled with token x[p{'+' if late else '-'}{abs(o)}] holds the hidden state computed for x[p] "
            f"(best value match at label offset {o}, "
            f"similarity {plan.offset_scores.get(str(o), float('nan')):.4f} vs "
            f"{plan.offset_scores.get('0', float('nan')):.4f} at 0); the server pairs hidden states with the wrong "
            f"tokens, or the trainer shifts them.",
            {"offset": o, "scores": plan.offset_scores},
        ))

    # -- segment wiring
    out += _segment_findings(report, decisions, centred, baseline, aux)

    # -- values of matched segments
    context = next((f for f in out if f.kind == "sequence_prefix"), None)
    by_pair = {(m.candidate, m.reference): m for m in stream.metrics}
    for d in decisions:
        if d.reference is None or d.duplicate_of is not None:
            continue
        m = by_pair.get((d.candidate, d.reference))
        if m is None or m.rows == 0:
            continue
        found = _value_findings(report, d, m)
        if context is not None and found:
            # A different context changes every hidden state after it: report the consequence as such,
            # not as a second root cause.
            f = found[0]
            found = [Finding(
                "segment_value", "warning",
                f"Candidate segment {_seg(cand.segment_labels[d.candidate], d.candidate)} differs from reference "
                f"segment {_seg(ref.segment_labels[d.reference], d.reference)} (cosine {m.cos_mean:.4f}, norm ratio "
                f"median {m.norm_ratio_p50:.3g}); expected while the sequences differ (see sequence_prefix): fix "
                f"that first and compare again.",
                {**f.evidence, "explained_by": "sequence_prefix"},
            )]
        out += found

    # -- non-finite values
    for side_name, side, nonfinite, index, rows in (
        ("candidate", cand, stream.nonfinite_candidate, alignment.candidate, pairs.candidate),
        ("reference", ref, stream.nonfinite_reference, alignment.reference, pairs.reference),
    ):
        for seg, (count, first) in sorted(nonfinite.items()):
            where = row_ref(index, rows[first]).__dict__ if first is not None else None
            out.append(Finding(
                "nonfinite", "error",
                f"{side_name.capitalize()} segment {_seg(side.segment_labels[seg], seg)} has NaN or Inf in {count} of "
                f"{len(pairs)} aligned rows (first at sequence {where['seq']}, position {where['position']}); "
                f"those rows are left out of the cosine statistics.",
                {"side": side_name, "segment": seg, "rows": count, "first_row": where},
            ))

    # -- coverage
    if plan.reference_rows_uncovered > 0 or plan.candidate_rows_unaligned > 0 or plan.candidate_rows_invalid:
        covered = len(pairs) / max(1, ref.valid_rows)
        severity = "warning" if covered < 0.5 else "info"
        out.append(Finding(
            "coverage", severity,
            f"{len(pairs)} row pairs compared: {covered:.0%} of the reference's valid rows; "
            f"{plan.candidate_rows_unaligned} candidate rows had no counterpart (generated tokens, rejected drafts, "
            f"another context), {plan.candidate_rows_duplicate} were duplicates and {plan.candidate_rows_invalid} "
            f"were marked invalid.",
            {"pairs": len(pairs), "reference_valid_rows": ref.valid_rows,
             "reference_rows_uncovered": plan.reference_rows_uncovered,
             "candidate_rows_unaligned": plan.candidate_rows_unaligned,
             "candidate_rows_duplicate": plan.candidate_rows_duplicate,
             "candidate_rows_invalid": plan.candidate_rows_invalid},
        ))

    # -- config
    aux_diffs = [d for d in report.config_diff if _is_aux(d["path"])]
    other = [d for d in report.config_diff if not _is_aux(d["path"])]
    if aux_diffs:
        shown = "; ".join(f"{d['path']}: {d['reference']} -> {d['candidate']}" for d in aux_diffs[:4])
        out.append(Finding(
            "config", "warning",
            f"The recorded aux-layer configuration differs between the two sides ({shown}).",
            {"differences": aux_diffs},
        ))
    if other:
        out.append(Finding(
            "config", "info",
            f"{len(other)} other metadata field(s) differ, e.g. {', '.join(d['path'] for d in other[:5])}.",
            {"differences": other},
        ))
    return out


def _is_aux(path: str) -> bool:
    from tracediff.compare import AUX_KEYS  # noqa: PLC0415

    return bool(AUX_KEYS.search(path))


def _reference_prefix(alignment: Alignment, neg: dict[int, int]) -> dict[str, Any] | None:
    """A negative delta with reference rows before the aligned region: the reference has a prefix."""
    lengths, example = [], None
    for seq in alignment.sequences:
        d = neg.get(seq.candidate_group)
        if d is None or seq.best is None:
            continue
        rg = alignment._ref_groups[seq.best[0]]
        cg = alignment._cand_groups[seq.candidate_group]
        # Reference positions before where the candidate starts (after the shift).
        before = rg.positions < cg.positions.min() - d
        if before.any():
            lengths.append(int(before.sum()))
            if example is None:
                example = [int(t) for t in rg.tokens[before][:16]]
    if not lengths:
        return None
    return {"length": lengths[0] if len(set(lengths)) == 1 else sorted(set(lengths)), "tokens": example,
            "sequences": len(lengths)}


def _segment_findings(report: Report, decisions: list[SegmentDecision], centred: np.ndarray,
                      baseline: np.ndarray, aux: dict[str, Any]) -> list[Finding]:
    ref, cand = report.reference, report.candidate
    out: list[Finding] = []
    matched = [d for d in decisions if d.reference is not None and d.duplicate_of is None]
    moved = [d for d in matched if d.reference != d.candidate]
    rlab, clab = ref.segment_labels, cand.segment_labels
    # The segment map, matrix and aux-layer config are in the report itself; evidence keeps what is
    # specific to each finding (the segment_order finding repeats the config: it is the fix).
    evidence_base: dict[str, Any] = {}
    if moved:
        shifts = {d.reference - d.candidate for d in matched}
        pairs_text = ", ".join(
            f"candidate segment {_seg(clab[d.candidate], d.candidate)} = reference segment "
            f"{_seg(rlab[d.reference], d.reference)}" for d in matched
        )
        if len(shifts) == 1:
            s = next(iter(shifts))
            how = (f"the candidate's segments are the reference's shifted by {_ordinal_slots(s)} (the candidate "
                   f"starts {_ordinal_slots(s)} {'later' if s > 0 else 'earlier'})")
            kind_detail = {"pattern": "shift", "shift": s}
        else:
            how = "the candidate concatenates the same hidden states in a different order"
            kind_detail = {"pattern": "permutation"}
        out.append(Finding(
            "segment_order", "error",
            f"Segments are wired differently: {pairs_text}; {how}. Fix the aux layer ids (or their order) on the "
            f"server to match training (reference {_fmt_aux(aux['reference'])}, candidate {_fmt_aux(aux['candidate'])}).",
            {"aux_layer_config": aux, **kind_detail,
             "pairs": [{"candidate": d.candidate, "reference": d.reference} for d in matched]},
        ))
    taken = {d.reference for d in matched}
    for j in range(ref.segments):
        if j in taken:
            continue
        col = centred[:, j] if centred.size else np.array([])
        best = int(np.nanargmax(col)) if col.size and np.isfinite(col).any() else None
        out.append(Finding(
            "segment_missing", "error",
            f"Reference segment {_seg(rlab[j], j)} is missing from the candidate: no candidate segment carries it "
            f"(closest: candidate segment {best}, centred cosine {col[best]:.3f}); the draft was trained with this "
            f"hidden state and the server does not feed it."
            if best is not None else
            f"Reference segment {_seg(rlab[j], j)} is missing from the candidate.",
            {**evidence_base, "reference_segment": j, "closest_candidate": best,
             "closest_centred_cosine": float(col[best]) if best is not None else None},
        ))
    for d in decisions:
        if d.duplicate_of is not None:
            out.append(Finding(
                "segment_duplicate", "error",
                f"Candidate segments {d.duplicate_of} and {d.candidate} both carry reference segment "
                f"{_seg(rlab[d.reference], d.reference)}: the server feeds the same hidden state twice.",
                {**evidence_base, "candidate_segments": [d.duplicate_of, d.candidate], "reference_segment": d.reference},
            ))
        elif d.reference is None:
            closest = d.runner_up
            out.append(Finding(
                "segment_extra", "error",
                f"Candidate segment {_seg(clab[d.candidate], d.candidate)} has no counterpart in the reference "
                f"(closest: reference segment {_seg(rlab[closest], closest) if closest is not None else 'none'}, "
                f"centred cosine {1 - d.distance:.3f}, not clearly above the other segments): the server feeds a "
                f"hidden state the draft never saw in training; use --bank to name its layer.",
                {**evidence_base, "candidate_segment": d.candidate, "closest_reference": closest,
                 "closest_centred_cosine": 1 - d.distance},
            ))
    return out


def _fmt_aux(cfg: dict[str, Any]) -> str:
    if not cfg:
        return "not recorded"
    key, value = next(iter(cfg.items()))
    return f"{key}={value}"


def _value_findings(report: Report, d: SegmentDecision, m: SegmentMetrics) -> list[Finding]:
    ref, cand, plan = report.reference, report.candidate, report.plan
    label = f"candidate segment {_seg(cand.segment_labels[d.candidate], d.candidate)}"
    rlabel = f"reference segment {_seg(ref.segment_labels[d.reference], d.reference)}"
    floor = plan.noise_floor
    ratio_tol = scale_tolerance(floor)
    p50, p1, p99 = m.norm_ratio_p50, m.norm_ratio_p1, m.norm_ratio_p99
    scaled = math.isfinite(p50) and abs(math.log(max(p50, 1e-30))) > ratio_tol
    evidence = {"candidate_segment": d.candidate, "reference_segment": d.reference, "cos_mean": m.cos_mean,
                "cos_p1": m.cos_p1, "cos_min": m.cos_min, "norm_ratio_p1": p1, "norm_ratio_p50": p50,
                "norm_ratio_p99": p99, "rel_l2": m.rel_l2, "worst_rows": m.worst_rows[:3],
                "centred_distance": d.distance, "runner_up_distance": d.runner_up_distance}
    out: list[Finding] = []
    spread = (p99 / p1) if (math.isfinite(p1) and p1 > 0 and math.isfinite(p99)) else float("inf")
    constant = spread < 1 + 2 * ratio_tol
    if scaled:
        if constant:
            msg = (f"{label} is {rlabel} times a constant {p50:.4g} (norm ratio p1 {p1:.4g}, p99 {p99:.4g}, cosine "
                   f"{m.cos_mean:.4f}): a scale factor is applied on one side only (a multiplier, a normaliser's "
                   f"weight, a dtype cast with scaling).")
        else:
            msg = (f"{label} matches {rlabel} in direction (cosine {m.cos_mean:.4f}) but not in size: the norm ratio "
                   f"varies per row (p1 {p1:.4g}, median {p50:.4g}, p99 {p99:.4g}), the signature of a normalisation "
                   f"(e.g. the final RMSNorm) applied on one side only: pre-norm vs post-norm hidden states.")
        out.append(Finding("segment_scale", "error", msg, {**evidence, "constant_scale": constant}))
        return out
    exact_d = floor * EXACT_FACTOR
    one_minus = 1 - m.cos_mean if math.isfinite(m.cos_mean) else float("nan")
    if d.tier == "related":
        out.append(Finding(
            "segment_value", "error",
            f"{label} resembles {rlabel} but its values differ beyond numerics (cosine mean {m.cos_mean:.4f}, p1 "
            f"{m.cos_p1:.4f}, relative L2 {m.rel_l2:.3g}); it is computed differently: another layer close to it, "
            f"another context, or a transformation on one side. Worst row: {_worst(m)}.",
            evidence,
        ))
    elif math.isfinite(one_minus) and one_minus > max(exact_d, 1e-7) and (d.tier == "near" or m.cos_p1 < 1 - 100 * max(exact_d, 1e-6)):
        out.append(Finding(
            "precision", "warning",
            f"{label} is {rlabel} up to numerics, but further apart than storage rounding explains (1 - cos "
            f"{one_minus:.2e} vs floor {floor:.1e}; p1 cosine {m.cos_p1:.5f}): different kernels or compute dtype "
            f"on the two sides. Worst row: {_worst(m)}.",
            evidence,
        ))
    return out


def _worst(m: SegmentMetrics) -> str:
    if not m.worst_rows:
        return "none"
    w = m.worst_rows[0]
    c = w["candidate"]
    return f"sequence {c['seq']} position {c['position']} token {c['token_id']} (cosine {w['cosine']:.4f})"
