"""Evidence gates: what each kind of conclusion of a compare needs, whether this compare has it,
and what to record when it does not.

A conclusion about wiring ("segment 0 is missing", "the segments are shifted by one slot") holds
only if the rows compared are rows of the same inputs, and only if each row was cut into the right
segments. When the evidence for either is missing (rows without token ids, paired by sequence key
and position; a segment size nobody recorded), compare must not name a root cause: the conclusions
that depend on it become one "cannot tell: record X" finding, said in the first lines of every
report (docs/report-schema.md, "What each conclusion needs").

It decides on metadata and small samples of rows (the plan's scales, a sample of the pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from tracediff.compare.results import Finding, Precondition, Report

#: Finding kinds that say what the rows *are* (which layer, which token, what numerics): they need
#: rows of the same inputs, cut into the right segments.
ROW_CONCLUSIONS: tuple[str, ...] = (
    "segment_order", "segment_missing", "segment_extra", "segment_duplicate", "segment_scale", "segment_value",
    "segment_undecided", "segment_subset", "token_offset", "precision",
)
#: ... and, for the segment sizes, the segment count.
SIZE_CONCLUSIONS: tuple[str, ...] = ("shape", *ROW_CONCLUSIONS)

#: The false-alarm rate of the pairing test over all segment pairs together: the threshold on the
#: best pair's z score is this rate split over the pairs tested (a Bonferroni bound), so the test
#: asks for more evidence the more pairs it looks at.
PAIRING_FALSE_ALARM = 1e-3


@dataclass
class PairingEvidence:
    """Whether the paired rows hold the same inputs, from the values alone: each segment pair's
    per-row standardised cosine on the paired rows against the same rows paired with another
    sequence's row at the same position (same depth, same position, other content)."""

    rows: int
    z: list[list[float]]  # [candidate segment][reference segment]: paired minus shuffled, in standard errors
    paired: list[list[float]]  # mean standardised cosine on the paired rows
    shuffled: list[list[float]]  # ... on the same rows re-paired within their position
    threshold: float  # the z the best pair needs
    best: tuple[int, int] | None
    sequences: SequencePairing | None = None  # where the pairing holds overall: sequence by sequence

    @property
    def holds(self) -> bool:
        if self.best is None:
            return False
        i, j = self.best
        return self.z[i][j] >= self.threshold

    @property
    def holds_for_every_sequence(self) -> bool:
        return self.holds and (self.sequences is None or not self.sequences.mispaired)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "z": self.z, "paired_cosine": self.paired, "shuffled_cosine": self.shuffled,
                "threshold": self.threshold, "best": list(self.best) if self.best else None, "holds": self.holds,
                "sequences": self.sequences.to_dict() if self.sequences is not None else None}


@dataclass
class SequencePairing:
    """The pairing check sequence by sequence, on the best segment pair: a sequence whose paired rows
    look like rows of other inputs (their closeness no higher than other sequences' rows at the same
    positions, and far below that of the sequences whose pairing holds) was paired with another
    sequence: the two runs processed some sequences in another order. Sequences with too few sampled
    rows to tell either way are counted as undecided."""

    checked: int  # sequences with at least two sampled rows
    paired_right: list[Any]  # sequence keys (the candidate's) whose rows agree with the pairing
    mispaired: list[Any]  # ... whose rows were paired with another input's
    undecided: int
    threshold: float  # the z each of the two tests needs (Bonferroni over the sequences checked)

    def to_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "paired_right": len(self.paired_right), "mispaired": self.mispaired,
                "undecided": self.undecided, "threshold": self.threshold}


def sequence_pairing(diff: np.ndarray, seqs: np.ndarray) -> SequencePairing:
    """``diff``: per sampled row, the best segment pair's standardised cosine on its own paired row
    minus that on another sequence's row at the same position; ``seqs``: each row's sequence key.
    A sequence is mispaired when its mean difference is both not above zero (what rows of other
    inputs give) and below the mean of the rows whose pairing holds, each by the Bonferroni z; the
    spread of a sequence's mean is its own rows' spread, never less than the spread pooled over all
    sequences (rows paired with other inputs scatter more than rows paired right), so a sequence
    needs enough sampled rows for either call."""
    keys, inverse, counts = np.unique(seqs, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=diff, minlength=keys.size)
    means = sums / np.maximum(counts, 1)
    resid = diff - means[inverse]
    many = counts >= 2
    dof = int(counts[many].sum() - many.sum())
    if dof < 2 or not many.any():
        return SequencePairing(0, [], [], int(keys.size), math.inf)
    pooled = math.sqrt(float(np.sum(resid[many[inverse]] ** 2)) / dof)
    own = np.sqrt(np.bincount(inverse, weights=resid**2, minlength=keys.size) / np.maximum(counts - 1, 1))
    threshold = NormalDist().inv_cdf(1.0 - PAIRING_FALSE_ALARM / int(many.sum()))
    se = np.maximum(own, pooled) / np.sqrt(np.maximum(counts, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        above_zero = np.where(se > 0, means / se, np.inf * np.sign(means))
    right = many & (above_zero >= threshold)
    if not right.any():
        return SequencePairing(int(many.sum()), [], [], int(many.sum()), threshold)
    typical = float(diff[right[inverse]].mean())  # what a rightly paired row gives
    with np.errstate(invalid="ignore", divide="ignore"):
        below_typical = np.where(se > 0, (typical - means) / se, np.inf * np.sign(typical - means))
    wrong = many & ~right & (above_zero < threshold) & (below_typical >= threshold)
    as_keys = lambda mask: [k.item() if hasattr(k, "item") else k for k in keys[mask]]  # noqa: E731
    return SequencePairing(int(many.sum()), as_keys(right), as_keys(wrong), int((many & ~right & ~wrong).sum()),
                           threshold)


def pairing_evidence(cand: np.ndarray, ref: np.ndarray, positions: np.ndarray, size: int,
                     cand_scales: Any, ref_scales: Any, seqs: np.ndarray | None = None) -> PairingEvidence:
    """Do the paired rows ([n, Wc], [n, Wr] float32, paired row by row, at ``positions``) hold the
    same inputs? Each row is also paired with the reference row of another pair at the same position
    (rows at one position differ only in their content: the first position of every sequence, alike
    across sequences in a trained model, then counts for nothing); a pairing that is right makes at
    least one segment pair far closer on its own rows than on those. With ``seqs`` (each pair's
    sequence key), a pairing that holds overall is also checked sequence by sequence
    (:func:`sequence_pairing`)."""
    n = cand.shape[0]
    kc, kr = cand.shape[1] // size, ref.shape[1] // size
    shuffle = _same_position_derangement(positions)
    keep = np.flatnonzero(shuffle >= 0)
    if keep.size < 8:  # too few rows share a position: any other row will do
        keep = np.arange(n)
        shuffle = np.roll(keep, n // 2) if n > 1 else keep
    zc = _unit_rows(cand[keep], size, cand_scales)
    zr = _unit_rows(ref, size, ref_scales)
    zr_own, zr_other = zr[keep], zr[shuffle[keep]]
    z = np.full((kc, kr), np.nan)
    paired = np.full((kc, kr), np.nan)
    shuffled = np.full((kc, kr), np.nan)
    diffs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for i in range(kc):
        for j in range(kr):
            a = np.einsum("nd,nd->n", zc[:, i], zr_own[:, j])
            s = np.einsum("nd,nd->n", zc[:, i], zr_other[:, j])
            ok = np.isfinite(a) & np.isfinite(s)
            if ok.sum() < 2:
                continue
            diff = a[ok] - s[ok]
            diffs[i, j] = diff, ok
            sd = float(diff.std(ddof=1))
            paired[i, j], shuffled[i, j] = float(a[ok].mean()), float(s[ok].mean())
            z[i, j] = float(diff.mean()) / (sd / math.sqrt(diff.size)) if sd > 0 else (
                math.inf if diff.mean() > 0 else 0.0)
    threshold = NormalDist().inv_cdf(1.0 - PAIRING_FALSE_ALARM / max(kc * kr, 1))
    best = None
    if np.isfinite(z).any() or np.isinf(z).any():
        flat = np.where(np.isnan(z), -np.inf, z)
        i, j = np.unravel_index(int(np.argmax(flat)), flat.shape)
        best = (int(i), int(j))
    as_list = lambda m: [[float(x) for x in row] for row in m]  # noqa: E731
    evidence = PairingEvidence(int(keep.size), as_list(z), as_list(paired), as_list(shuffled), threshold, best)
    if seqs is not None and evidence.holds and best in diffs:
        diff, ok = diffs[best]
        evidence.sequences = sequence_pairing(diff, np.asarray(seqs)[keep][ok])
    return evidence


def _same_position_derangement(positions: np.ndarray) -> np.ndarray:
    """For each row, another row at the same position (-1 where none is): each position's rows
    rotated by one."""
    out = np.full(positions.size, -1, dtype=np.int64)
    order = np.argsort(positions, kind="stable")
    sorted_pos = positions[order]
    starts = np.flatnonzero(np.r_[True, sorted_pos[1:] != sorted_pos[:-1]])
    ends = np.r_[starts[1:], sorted_pos.size]
    for s, e in zip(starts, ends, strict=True):
        if e - s >= 2:
            rows = order[s:e]
            out[rows] = np.roll(rows, 1)
    return out


def _unit_rows(rows: np.ndarray, size: int, scales: Any) -> np.ndarray:
    """[n, K, size]: each segment standardised by its scales, then scaled to unit length per row."""
    x = (rows.reshape(rows.shape[0], -1, size) - scales.mean) / scales.scale
    norm = np.linalg.norm(x, axis=2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x / norm).astype(np.float32)


def gather_evidence(ref_index: Any, cand_index: Any, rl: Any, cl: Any, sizes: Any,
                    sample: Any) -> Evidence:
    """What the conclusions of this compare rest on (tracediff.compare.findings.evidence): token ids, and how
    each side's segment size was known; for a side that took the other's size, the size its own
    values repeat at."""
    recorded = {"reference": rl.segment_size is not None, "candidate": cl.segment_size is not None}
    ev = Evidence(tokens={"reference": ref_index.has_tokens, "candidate": cand_index.has_tokens},
                  size_source=sizes.source, size_recorded=recorded,
                  sizes={"reference": sizes.reference, "candidate": sizes.candidate},
                  widths={"reference": rl.width, "candidate": cl.width})
    if sizes.source == "mixed":
        from tracediff.compare.plan.segments import infer_segment_size  # noqa: PLC0415

        r_rows, c_rows = sample()
        for side, rows in (("reference", r_rows), ("candidate", c_rows)):
            if not recorded[side]:
                own, how = infer_segment_size(rows.shape[1], rows.shape[1], rows, rows)
                if "autocorrelation" in how:  # a repeating profile, not a fallback
                    ev.own_size[side], ev.own_size_how[side] = own, how
    return ev


def pairing_of_rows(pairs: Any, ref_index: Any, cand_index: Any, segplan: Any, rows: int,
                    seed: int) -> PairingEvidence:
    """Rows paired without token ids: do the values say they hold the same inputs?"""
    from tracediff.compare.plan.decide import read_rows, sample_pairs  # noqa: PLC0415
    from tracediff.compare.rows.gather import in_parallel  # noqa: PLC0415

    pick = sample_pairs(pairs, rows, seed)
    c_rows, r_rows = in_parallel(lambda: read_rows(cand_index, pairs.candidate[pick]),
                                 lambda: read_rows(ref_index, pairs.reference[pick]))
    positions = np.asarray(cand_index.position[pairs.candidate[pick]], dtype=np.int64)
    groups = np.asarray(cand_index.group[pairs.candidate[pick]], dtype=np.int64)
    evidence = pairing_evidence(c_rows, r_rows, positions, segplan.size, segplan.cand_scales, segplan.ref_scales,
                                groups)
    if evidence.sequences is not None:  # dense group ids -> the sequence keys a user can look up
        named = cand_index.group_keys
        evidence.sequences.paired_right = [named[g] for g in evidence.sequences.paired_right]
        evidence.sequences.mispaired = [named[g] for g in evidence.sequences.mispaired]
    return evidence


# ------------------------------------------------------------------------------------ preconditions
@dataclass
class Evidence:
    """What run.py hands over: per side, whether its rows carry token ids and whether its segment
    size was recorded; the pairing evidence where one was needed."""

    tokens: dict[str, bool]  # side -> its rows carry token ids
    size_source: str  # option | meta | mixed | inferred (SegmentSizes.source)
    size_recorded: dict[str, bool]  # side -> it recorded its segment size
    sizes: dict[str, int]
    widths: dict[str, int]
    own_size: dict[str, int | None] = field(default_factory=dict)  # side -> the size its own data repeat at
    own_size_how: dict[str, str] = field(default_factory=dict)
    pairing: PairingEvidence | None = None


def preconditions(ev: Evidence, report: Report) -> list[Precondition]:
    """Each precondition of this compare's conclusions, met or not, in the order they gate."""
    out = [_token_ids(ev), _segment_sizes(ev, report)]
    return [p for p in out if p is not None]


def _token_ids(ev: Evidence) -> Precondition:
    missing = [side for side in ("reference", "candidate") if not ev.tokens[side]]
    needs = list(ROW_CONCLUSIONS)
    if not missing:
        return Precondition("token_ids", "met", "both sides' rows carry token ids: rows are paired by their content",
                            "", needs)
    who = " and ".join(missing)
    record = _record_tokens_hint(missing)
    p = ev.pairing
    evidence: dict[str, Any] = {"sides_without_token_ids": missing}
    if p is not None:
        evidence["pairing"] = p.to_dict()
    if p is not None and p.holds and not p.holds_for_every_sequence:
        return _some_sequences_mispaired(who, record, needs, evidence, p)
    if p is not None and p.holds:
        i, j = p.best  # type: ignore[misc]
        return Precondition(
            "token_ids", "supported",
            f"the {who} rows carry no token ids: rows were paired by sequence key and position, and the values "
            f"agree with that pairing (candidate segment {i} vs reference segment {j}: standardised cosine "
            f"{p.paired[i][j]:.3f} on the paired rows, {p.shuffled[i][j]:.3f} on other sequences' rows at the same "
            f"positions)",
            record, needs, evidence)
    why = ("no segment pair is closer on the paired rows than on other sequences' rows at the same positions"
           if p is not None else "no rows could be checked")
    return Precondition(
        "token_ids", "unmet",
        f"the {who} rows carry no token ids, so rows were paired by sequence key and position, and the values say "
        f"that pairing is wrong ({why}): the two runs did not process the same sequences in the same order, and "
        f"which layers each side feeds cannot be decided from these pairs",
        record, needs, evidence, f"the {who} rows carry no token ids and were paired with other inputs' rows")


def _some_sequences_mispaired(who: str, record: str, needs: list[str], evidence: dict[str, Any],
                              p: PairingEvidence) -> Precondition:
    seq = p.sequences
    assert seq is not None
    shown = ", ".join(str(k) for k in seq.mispaired[:8]) + (", ..." if len(seq.mispaired) > 8 else "")
    return Precondition(
        "token_ids", "unmet",
        f"the {who} rows carry no token ids, so rows were paired by sequence key and position; the values agree "
        f"with that pairing for {len(seq.paired_right)} of {seq.checked} sequences checked, but the rows of "
        f"{len(seq.mispaired)} (candidate sequence keys {shown}) look like other inputs' rows: the two runs did not "
        f"process every sequence in the same order, and a difference found on those rows would be a pairing "
        f"artefact, not a wiring bug",
        record, needs, evidence,
        f"the {who} rows carry no token ids and {len(seq.mispaired)} sequences were paired with other inputs' rows")


def _record_tokens_hint(missing: list[str]) -> str:
    if missing == ["candidate"]:
        return ("record the candidate with its token ids (tracediff record labels rows from the module whose forward "
                "gets input_ids; where none does, pass --labels-from CLASS or call tracediff.labels(...) in the script)")
    if missing == ["reference"]:
        return ("record the reference with its token ids (tracediff record --labels-from CLASS, rec.labels(...) in "
                "the training script, or the trainer's adapter)")
    return ("record both sides with their token ids (tracediff record --labels-from CLASS, or "
            "tracediff.labels(...))")


def _segment_sizes(ev: Evidence, report: Report) -> Precondition | None:
    if ev.size_source in ("option", "meta"):
        how = "given with --segment-size" if ev.size_source == "option" else "recorded by both sides"
        return Precondition("segment_sizes", "met", f"segment sizes {how}", "", list(SIZE_CONCLUSIONS))
    missing = [side for side in ("reference", "candidate") if not ev.size_recorded[side]]
    record = " and ".join(f"the {side}" for side in missing)
    record = (f"record {record} with --segment-size H (the target model's hidden size), or pass --segment-size H "
              f"to compare")
    evidence = {"source": ev.size_source, "sizes": ev.sizes, "widths": ev.widths, "not_recorded": missing,
                "own_size": ev.own_size}
    said = "; ".join(f"the {side} recorded none and was cut into segments of {ev.sizes[side]}" for side in missing)
    # A side whose own values repeat at a period that does not divide the size it was cut into.
    own = [f"the {side}'s own values repeat every {ev.own_size[side]} channels"
           for side in missing if ev.own_size.get(side) and ev.sizes[side] % int(ev.own_size[side] or 1)]
    if not own and _data_agrees(report):
        return Precondition(
            "segment_sizes", "supported",
            f"segment size not recorded ({said}); segments cut at that size match the other side's",
            record, list(SIZE_CONCLUSIONS), evidence)
    disagree = f" ({'; '.join(own)})" if own else ""
    return Precondition(
        "segment_sizes", "unmet",
        f"{said}{disagree}; how many hidden states each side concatenates, and which, cannot be decided from a "
        f"guessed size",
        record, list(SIZE_CONCLUSIONS), evidence,
        f"the segment size of the {' and '.join(missing)} was guessed ({', '.join(str(ev.sizes[s]) for s in missing)})")


def _data_agrees(report: Report) -> bool:
    """Does the data confirm the cut? A candidate segment that is the same tensor as a reference
    segment (in its slot or another, up to a fitted transform) can only come from segment boundaries
    in the right places: a wrong size cuts every segment across two hidden states."""
    ref, cand = report.reference, report.candidate
    if ref.segment_size != cand.segment_size or not report.segment_map:
        return False
    return any(m.status in ("same", "moved") and m.relation in (None, "same", "transformed", "drift")
               for m in report.segment_map)


# -------------------------------------------------------------------------------------------- gating
def apply_preconditions(report: Report, found: list[Precondition]) -> None:
    """Put the preconditions on the report; where one is unmet, the conclusions that need it are
    taken out of the findings (and their segments out of the map) and one ``cannot_tell`` finding
    says what to record: the report never names a root cause it has no evidence for."""
    report.preconditions = found
    unmet = [p for p in found if p.status == "unmet"]
    for p in (p for p in found if p.status == "supported"):
        report.findings.insert(0, Finding("cannot_tell", "warning", _sentence(f"{p.message}; {p.record}"), {
            "precondition": p.name, "record": p.record, **p.evidence},
            f"{p.name.replace('_', ' ')} assumed, not recorded"))
    if not unmet:
        return
    gated = {kind for p in unmet for kind in p.needed_by}
    kept = [f for f in report.findings if f.kind not in gated]
    taken = [f.kind for f in report.findings if f.kind in gated]
    first = [Finding("cannot_tell", "error", _sentence(f"Cannot tell: {p.message}; {p.record}, then compare again"),
                     {"precondition": p.name, "record": p.record, "withheld": sorted(set(taken)), **p.evidence},
                     f"cannot tell: {p.short}") for p in unmet]
    report.findings = first + kept
    for m in report.segment_map:
        m.status = "undecided"
        m.reference, m.reference_label, m.relation, m.transform = None, None, None, None
    report.metrics = []
    report.position_profiles = []
    report.fix = None
    report.record_next = {
        "reasons": [_sentence(p.message) for p in unmet],  # (the steps say what to record)
        "steps": [{"text": _sentence(p.record[:1].upper() + p.record[1:] + ", then compare again"), "commands": []}
                  for p in unmet],
    }


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:]).rstrip(".") + "."
