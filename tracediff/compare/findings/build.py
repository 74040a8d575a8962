"""Findings: turn the plan, the segment decisions and the streamed numbers into sentences a person
can act on, each with the evidence behind it. Ordered root cause first (layout, sequences, labels,
segment wiring), consequences after (values, precision, coverage, config)."""

from __future__ import annotations

from typing import Any

from tracediff.adapters.conventions import AuxLayers, format_layers
from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.align.sequences import Alignment
from tracediff.compare.findings.segments import seg_name, segment_findings
from tracediff.compare.plan.decide import SegmentPlan
from tracediff.compare.plan.metadata import PHYSICAL_FIELD, is_aux_key, readable_changes
from tracediff.compare.results import Finding, Report
from tracediff.compare.stream.metrics import StreamResult, row_ref


def build_findings(
    report: Report,
    alignment: Alignment,
    pairs: RowPairs,
    segplan: SegmentPlan | None,
    stream: StreamResult,
    ref_aux: AuxLayers | None = None,
    cand_aux: AuxLayers | None = None,
    bank: Any = None,
    subsets: dict | None = None,
) -> list[Finding]:
    """Every finding of a compare, root causes first: layout, sequences, insertions inside them,
    labels, the segments (wiring and values), non-finite values, coverage, config. ``segplan`` is None
    when the segments could not be compared at all (two hidden sizes): then only layout, sequence and
    config findings are made."""
    out = _layout_findings(report, segplan)
    out += _sequence_findings(report, alignment, pairs)
    out += _insertion_findings(alignment, pairs)
    out += _label_findings(report)
    if segplan is not None:
        out += segment_findings(report, segplan, stream, ref_aux, cand_aux, bank,
                                # (diverged generations are cut from the pairs: they explain no value)
                                next((f for f in out if f.kind in ("sequence_prefix", "sequence_insertion")
                                      and f.evidence.get("kind") != "generation"), None),
                                subsets or {})
    out += _nonfinite_findings(report, alignment, pairs, stream)
    out += _coverage_findings(report, pairs)
    out += _config_findings(report, ref_aux, cand_aux, out)
    return out


def _layout_findings(report: Report, segplan: SegmentPlan | None) -> list[Finding]:
    """Rows of another width (another hidden size, or another number of hidden states) or dtype."""
    ref, cand, plan = report.reference, report.candidate, report.plan
    out: list[Finding] = []
    aux = {"reference": ref.aux_layer_config, "candidate": cand.aux_layer_config}
    if segplan is None:
        out.append(Finding(
            "shape", "error",
            f"The two sides have different hidden sizes: reference segments are {ref.segment_size} wide "
            f"({ref.width} = {ref.segments} x {ref.segment_size}), candidate segments {cand.segment_size} "
            f"({cand.width} = {cand.segments} x {cand.segment_size}): another target model, or a truncated transfer; "
            f"no segment was compared. Record both sides with the same target model.",
            {"reference_segment_size": ref.segment_size, "candidate_segment_size": cand.segment_size,
             "reference_width": ref.width, "candidate_width": cand.width,
             "reference_segments": ref.segments, "candidate_segments": cand.segments},
            f"the two sides have different hidden sizes ({ref.segment_size} vs {cand.segment_size})",
        ))
    elif ref.width != cand.width:
        out.append(Finding(
            "shape", "error",
            f"Candidate rows are {cand.width} wide ({cand.segments} segments of {plan.segment_size}) but reference rows "
            f"are {ref.width} ({ref.segments} segments): the server concatenates a different number of hidden states "
            f"than the draft was trained on.",
            {"reference_width": ref.width, "candidate_width": cand.width, "segment_size": plan.segment_size,
             "reference_segments": ref.segments, "candidate_segments": cand.segments, "aux_layer_config": aux},
            f"the candidate concatenates {cand.segments} hidden states, the reference {ref.segments}",
        ))
    if ref.dtype != cand.dtype:
        out.append(Finding(
            "dtype", "info",
            f"Reference rows are {ref.dtype} and candidate rows {cand.dtype}; values are compared in float32 and "
            f"numerics up to a standardised relative error of {plan.numerics_budget:.2g} ({_budget_basis(plan)}) are "
            f"allowed for.",
            {"reference": ref.dtype, "candidate": cand.dtype, "noise_floor": plan.noise_floor,
             "numerics_budget": plan.numerics_budget},
        ))
    return out


def _sequence_findings(report: Report, alignment: Alignment, pairs: RowPairs) -> list[Finding]:
    """Candidate sequences that share no tokens with the reference, a prefix on either side, or a
    constant position offset."""
    plan = report.plan
    out: list[Finding] = []
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
            "the candidate's sequences start with tokens the reference does not have",
        ))
    else:
        # A sequence with tokens inserted or deleted inside it is reported as such, not as a prefix.
        inserted = {i["group"] for i in pairs.insertions}
        neg = {g: d for g, d in eff.items() if d < 0 and g not in inserted}
        ref_prefix = _reference_prefix(alignment, neg)
        if ref_prefix:
            out.append(Finding(
                "sequence_prefix", "error",
                f"Reference sequences start with {ref_prefix['length']} token(s) the candidate lacks "
                f"(e.g. {ref_prefix['tokens']}): the trainer saw a prefix (chat template, BOS) the server does not "
                f"get, so hidden states are computed in a different context.",
                ref_prefix,
                "the reference's sequences start with tokens the candidate does not get",
            ))
        shifted = {d for g, d in eff.items() if d != 0 and g not in inserted}
        if shifted and not ref_prefix:
            common = max(shifted, key=lambda d: sum(1 for v in eff.values() if v == d))
            out.append(Finding(
                "position_offset", "info",
                f"Candidate positions are the reference's {'+' if common > 0 else ''}{common} for the same tokens "
                f"and values; a constant position offset in the labels (e.g. speculators trains at p+1) is benign.",
                {"delta": common, "sequences": sum(1 for v in eff.values() if v == common)},
            ))
    return out


def _label_findings(report: Report) -> list[Finding]:
    """Rows labelled with another token: a label offset the plan chose, or the draft's input tokens
    (next_token_id) paired differently."""
    plan = report.plan
    out: list[Finding] = []
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
            f"the candidate's rows are labelled {abs(o)} token{'s' if abs(o) > 1 else ''} {'late' if late else 'early'}",
        ))

    pairing = plan.token_pairing
    if pairing.get("mismatched") and plan.label_offset == 0:
        ex = pairing["examples"][0]
        where = pairing.get("pattern") or "no single label pattern explains them"
        out.append(Finding(
            "token_pairing", "error",
            f"{pairing['mismatched']} of {pairing['compared']} aligned rows feed the draft another input token than the "
            f"reference (next_token_id), e.g. sequence {ex['seq']} position {ex['position']}: reference "
            f"{ex['reference_next_token_id']}, candidate {ex['candidate_next_token_id']}; the rows: {where}. The hidden "
            f"state is paired with the wrong token: fix how the server builds the draft's input ids.",
            {"rows": pairing["mismatched"], "compared": pairing["compared"], "unknown": pairing["unknown"],
             "examples": pairing["examples"], "pattern": pairing.get("pattern_evidence") or None},
            "the candidate feeds the draft another input token on some rows",
        ))
    return out


def _nonfinite_findings(report: Report, alignment: Alignment, pairs: RowPairs, stream: StreamResult) -> list[Finding]:
    """Per side and segment, the aligned rows holding NaN or Inf (left out of the statistics)."""
    ref, cand = report.reference, report.candidate
    out: list[Finding] = []
    for side_name, side, nonfinite, index, rows in (
        ("candidate", cand, stream.nonfinite_candidate, alignment.candidate, pairs.candidate),
        ("reference", ref, stream.nonfinite_reference, alignment.reference, pairs.reference),
    ):
        for seg, (count, first) in sorted(nonfinite.items()):
            where = row_ref(index, rows[first]).__dict__ if first is not None else None
            out.append(Finding(
                "nonfinite", "error",
                f"{side_name.capitalize()} segment {seg_name(side.segment_labels[seg], seg)} has NaN or Inf in {count} of "
                f"{len(pairs)} aligned rows (first at sequence {where['seq']}, position {where['position']}); "
                f"those rows are left out of the cosine statistics.",
                {"side": side_name, "segment": seg, "rows": count, "first_row": where},
                f"{side_name} segment {seg_name(side.segment_labels[seg], seg)} holds NaN or Inf",
            ))
    return out


def _coverage_findings(report: Report, pairs: RowPairs) -> list[Finding]:
    """How many rows were compared, and why the others were not."""
    ref, plan = report.reference, report.plan
    out: list[Finding] = []
    split = plan.sequences_split
    if (plan.reference_rows_uncovered > 0 or plan.candidate_rows_unaligned > 0 or plan.candidate_rows_invalid
            or any(split.values())):
        covered = pairs.reference_rows / max(1, ref.valid_rows)
        severity = "warning" if covered < 0.5 else "info"
        trailing = plan.candidate_rows_trailing
        packed = [f"{n} {side} sequence{'s' if n != 1 else ''}" for side, n in split.items() if n]
        out.append(Finding(
            "coverage", severity,
            f"{len(pairs)} row pairs compared: {covered:.0%} of the reference's valid rows; "
            f"{plan.candidate_rows_unaligned} candidate rows had no counterpart (generated tokens, rejected drafts, "
            f"another context"
            + (f"; {trailing} of them past the end of the reference's sequence: extra trailing rows" if trailing else "")
            + f"), {plan.candidate_rows_duplicate} were duplicates and {plan.candidate_rows_invalid} were marked "
              f"invalid."
            + (f" Positions restart inside {' and '.join(packed)} (packed samples): each was split into its samples."
               if packed else ""),
            {"pairs": len(pairs), "reference_valid_rows": ref.valid_rows,
             "reference_rows_uncovered": plan.reference_rows_uncovered,
             "candidate_rows_unaligned": plan.candidate_rows_unaligned,
             "candidate_rows_duplicate": plan.candidate_rows_duplicate,
             "candidate_rows_invalid": plan.candidate_rows_invalid,
             "candidate_rows_trailing": trailing, "sequences_split": dict(split)},
        ))
    return out


def _insertion_findings(alignment: Alignment, pairs: RowPairs) -> list[Finding]:
    """Tokens inserted into (or deleted from) the middle of candidate sequences, one finding per kind."""
    out: list[Finding] = []
    generated = [i for i in pairs.insertions if i.get("generated")]
    if generated:
        positions = sorted({i["position"] for i in generated})
        seqs = sorted({alignment.candidate.group_keys[i["group"]] for i in generated})
        out.append(Finding(
            "sequence_insertion", "warning",
            f"{len(seqs)} candidate sequence(s) generate other tokens than the reference from position "
            f"{positions[0] if len(positions) == 1 else positions[:8]} on, in rows the engine generated (its own "
            f"choice, not the prompt: another draft, or numerics flipping a near tie): the rows from there on see "
            f"another context and are left out of the compare. The prompt rows decide; to compare more rows, "
            f"record both sides on the same token ids (tracediff send a trainer store to each).",
            {"kind": "generation", "sequences": len(seqs), "example_sequences": seqs[:5], "positions": positions[:32],
             "length": 0, "tokens": [], "occurrences": len(generated)},
            f"the generations of {len(seqs)} candidate sequence{'s' if len(seqs) != 1 else ''} diverge"))
    for kind in ("insertion", "deletion"):
        found = [i for i in pairs.insertions if i["kind"] == kind and not i.get("generated")]
        if not found:
            continue
        shapes: dict[tuple, list[dict]] = {}
        for i in found:
            shapes.setdefault((i["length"], tuple(i["tokens"])), []).append(i)
        (length, tokens), common = max(shapes.items(), key=lambda kv: len(kv[1]))
        positions = sorted({i["position"] for i in found})
        seqs = sorted({alignment.candidate.group_keys[i["group"]] for i in found})
        what = (f"{length} token(s) {list(tokens)} inserted" if kind == "insertion" else
                f"{length} token(s) of the reference missing")
        out.append(Finding(
            "sequence_insertion", "error",
            f"{len(seqs)} candidate sequence(s) have {what} inside the sequence (at candidate position "
            f"{positions[0] if len(positions) == 1 else positions[:8]}; {len(common)} of {len(found)} alike), e.g. "
            f"a chat-template difference such as an empty think block: rows before it are compared as aligned, "
            f"rows after it see another context, so their hidden states differ; feed the server the exact "
            f"training token ids.",
            {"kind": kind, "sequences": len(seqs), "example_sequences": seqs[:5], "positions": positions[:32],
             "length": length, "tokens": list(tokens), "occurrences": len(found)},
            f"tokens are {'inserted into' if kind == 'insertion' else 'missing from'} the middle of "
            f"{len(seqs)} candidate sequence{'s' if len(seqs) != 1 else ''}",
        ))
    return out


def _config_findings(report: Report, ref_aux: AuxLayers | None, cand_aux: AuxLayers | None,
                     found: list[Finding]) -> list[Finding]:
    """What the recorded configs say, as a readable diff (physical layers first, one field a line).

    An aux-layer difference that a wiring finding's config fix changes back is that root cause as
    the configs record it, not a second problem: it says so with ``explained_by``."""
    out: list[Finding] = []
    aux_diffs = [d for d in report.config_diff if is_aux_key(d["path"])]
    other = [d for d in report.config_diff if not is_aux_key(d["path"])]
    layers = {"reference": ref_aux.to_dict() if ref_aux else None, "candidate": cand_aux.to_dict() if cand_aux else None}
    ref_phys = ref_aux.physical if ref_aux else None
    cand_phys = cand_aux.physical if cand_aux else None
    if aux_diffs and ref_aux is not None and cand_aux is not None and all(d.get("equivalent") for d in aux_diffs):
        out.append(Finding(
            "config", "info",
            f"The aux-layer settings are recorded in different numberings ({_numbering(ref_aux)} vs "
            f"{_numbering(cand_aux)}) but name the same physical layers {format_layers(ref_aux.physical)} "
            f"(HF hidden_states numbering, L = last layer before the final norm).",
            {"differences": aux_diffs, "aux_layers": layers, "changes": readable_changes(aux_diffs)},
        ))
    elif aux_diffs:
        changes = readable_changes(aux_diffs, ref_phys, cand_phys)
        fields = len(changes) - (1 if changes and changes[0]["field"] == PHYSICAL_FIELD else 0)
        evidence: dict[str, Any] = {"differences": aux_diffs, "aux_layers": layers, "changes": changes}
        cause = next((f for f in found if f.severity == "error" and not f.evidence.get("explained_by")
                      and isinstance(f.evidence.get("fix"), dict) and f.evidence["fix"].get("config_can_fix")), None)
        tail = ""
        if cause is not None:
            evidence["explained_by"] = cause.kind
            tail = f" The fix of {cause.kind} changes this setting."
        out.append(Finding(
            "config", "warning",
            f"The recorded aux-layer configuration differs between the two sides: physical layers "
            f"{format_layers(ref_phys)} -> {format_layers(cand_phys)} (HF hidden_states numbering, reference -> "
            f"candidate); {fields} recorded field{'s' if fields != 1 else ''} differ{'s' if fields == 1 else ''}."
            + tail,
            evidence,
            "the recorded aux-layer configuration differs",
        ))
    if other:
        out.append(Finding(
            "config", "info",
            f"{len(other)} other metadata field(s) differ, e.g. {', '.join(d['path'] for d in other[:5])}.",
            {"differences": other, "changes": readable_changes(other)},
        ))
    return out


def _numbering(aux: AuxLayers) -> str:
    return f"{aux.field} = {aux.recorded} ({aux.convention or 'unknown'} numbering)"


def _reference_prefix(alignment: Alignment, neg: dict[int, int]) -> dict[str, Any] | None:
    """A negative delta with reference rows before the aligned region: the reference has a prefix."""
    lengths, example = [], None
    for seq in alignment.sequences:
        d = neg.get(seq.candidate_group)
        if d is None or seq.best is None:
            continue
        rg = alignment.ref_groups[seq.best[0]]
        # Reference positions before where the candidate starts (after the shift).
        before = rg.positions < alignment.first_position(seq.candidate_group) - d
        if before.any():
            lengths.append(int(before.sum()))
            if example is None:
                example = [int(t) for t in rg.tokens[before][:16]]
    if not lengths:
        return None
    return {"length": lengths[0] if len(set(lengths)) == 1 else sorted(set(lengths)), "tokens": example,
            "sequences": len(lengths)}


def _budget_basis(plan: Any) -> str:
    """What the largest numerics budget rests on, in a few words: calibration rows or an assumption."""
    sources = {n.get("source") for n in (plan.noise or []) if isinstance(n, dict)}
    if sources == {"calibrated"}:
        return f"measured on calibration rows computed in {plan.compute_dtype}"
    if "calibrated" in sources:
        return f"measured on calibration rows where they cover a segment, else assumed for {plan.compute_dtype} compute"
    return f"assumed for {plan.compute_dtype} compute"
