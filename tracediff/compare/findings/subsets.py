"""Subsets: when only some rows of a segment pair differ, find the label group that explains them
and say what those rows hold instead.

Real serving bugs hit a subset: decode steps small enough for the CUDA-graph path, one phase, one
tensor-parallel rank, rows past a chunk size. From the streaming pass's per-row standardised errors
(``StreamResult.row_errors``) a row is *off* when it is beyond what drift of the same tensor allows
(the noise model's limit of the pair, :mod:`tracediff.compare.plan.noise`). A subset is reported only
when one value range of one label (phase, rows per step, writer, position, sequence) holds nearly
all the off rows and few others: a handful of scattered rows is noise, a label group is a finding.
What the off rows hold is then decided on a sample of them with the same rules as the whole:
another reference segment, no reference segment, zeros or a constant, another request's row of the
same step, or the right layer at a neighbouring position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.plan.decide import SegmentPlan, read_rows
from tracediff.compare.plan.segments import SegmentScales, relative_error, split
from tracediff.compare.rows.index import RowIndex, stream_names
from tracediff.compare.stream.metrics import StreamResult
from tracediff.store import PHASES

#: A label group must hold this share of the off rows, and this share of it must be off.
RECALL, PRECISION = 0.8, 0.8
#: At least this many off rows (and this share of the pairs) before a subset is looked for.
MIN_ROWS, MIN_SHARE = 3, 0.005
#: Rows of a subset read to say what they hold.
DESCRIBE_ROWS = 256


@dataclass
class Subset:
    """A label group whose rows differ from the rest of a segment pair."""

    dimension: str  # phase | rows_per_step | writer | position | sequence
    description: str  # "decode rows of steps with <= 2 rows"
    rows: int  # aligned rows in the group
    off_rows: int  # off rows in the group
    off_total: int  # off rows of the pair
    pair_rows: int
    precision: float
    recall: float
    median_error: float  # median per-row standardised error in the group
    median_error_rest: float  # and on the pair's other rows
    members: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int64))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("members")
        return out


def _phase_name(code: int) -> str:
    return PHASES[code] if 0 <= code < len(PHASES) else str(code)


def _rows_per_step(index: RowIndex) -> np.ndarray:
    """Per row of ``index``: how many rows its (writer, step) has (the batch size of that forward)."""
    if len(index) == 0:
        return np.zeros(0, dtype=np.int64)
    keys = np.stack([index.stream.astype(np.int64), index.column("step")], axis=1)
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    return counts[inverse.reshape(-1)]


def _best_split(values: np.ndarray, off: np.ndarray) -> tuple[float, float, float, str, Any] | None:
    """The threshold split (x <= t or x >= t) of an ordered label with the best F1 for ``off``."""
    uniq, inverse = np.unique(values, return_inverse=True)
    if uniq.size < 2:
        return None
    n = np.bincount(inverse, minlength=uniq.size)
    b = np.bincount(inverse, weights=off.astype(np.float64), minlength=uniq.size)
    total = float(off.sum())
    best = None
    for direction, (cn, cb) in (("le", (np.cumsum(n), np.cumsum(b))), ("ge", (np.cumsum(n[::-1])[::-1],
                                                                              np.cumsum(b[::-1])[::-1]))):
        for k in range(uniq.size):
            size = cn[k]
            if size >= values.size or size == 0:
                continue
            prec, rec = cb[k] / size, cb[k] / total
            f1 = 2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0
            if best is None or f1 > best[0]:
                best = (f1, prec, rec, direction, uniq[k])
    return best


def _best_groups(values: np.ndarray, off: np.ndarray) -> tuple[float, float, float, set[int]] | None:
    """The set of categories most of whose rows are off, with its F1 for ``off``."""
    uniq, inverse = np.unique(values, return_inverse=True)
    if uniq.size < 2:
        return None
    n = np.bincount(inverse, minlength=uniq.size)
    b = np.bincount(inverse, weights=off.astype(np.float64), minlength=uniq.size)
    chosen = b / np.maximum(n, 1) >= 0.5
    if not chosen.any() or chosen.all():
        return None
    size, tp = float(n[chosen].sum()), float(b[chosen].sum())
    prec, rec = tp / size, tp / float(off.sum())
    f1 = 2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0
    return f1, prec, rec, {int(v) for v in uniq[chosen]}


Dimension = tuple[str, np.ndarray, bool]  # (name, value per aligned row, ordered?)


def subset_labels(pairs: RowPairs, candidate: RowIndex) -> list[Dimension]:
    """The labels a subset may be defined by, per aligned row (computed once per compare)."""
    rows = pairs.candidate
    dims: list[Dimension] = [
        ("phase", candidate.phase[rows].astype(np.int64), False),
        ("rows_per_step", _rows_per_step(candidate)[rows], True),
    ]
    if len(candidate.streams) > 1:
        dims.append(("writer", candidate.stream_of(rows).astype(np.int64), False))
    dims.append(("position", candidate.position[rows], True))
    if len(np.unique(candidate.group[rows])) >= 3:
        dims.append(("sequence", candidate.group[rows], False))
    return dims


def _off_rows(row_errors: np.ndarray, threshold: float) -> np.ndarray:
    return np.isfinite(row_errors) & (row_errors > threshold)


def might_hold_subset(row_errors: np.ndarray, threshold: float) -> bool:
    """Enough off rows to look for a label group (cheap: the labels are built only then)."""
    total = int(_off_rows(row_errors, threshold).sum())
    return total >= MIN_ROWS and total >= MIN_SHARE * row_errors.size


def find_subset(dims: list[Dimension], candidate: RowIndex, row_errors: np.ndarray, threshold: float) -> Subset | None:
    """The label group (of ``dims``, from :func:`subset_labels`) that explains the pair's off rows
    (error above ``threshold``), or None."""
    off = _off_rows(row_errors, threshold)
    total, n = int(off.sum()), int(off.size)
    if not might_hold_subset(row_errors, threshold):
        return None
    phase = dims[0][1]
    best: tuple[float, str, np.ndarray, float, float, str] | None = None
    for name, values, ordered in dims:
        if ordered:
            found = _best_split(values, off)
            if found is None:
                continue
            f1, prec, rec, direction, t = found
            members = values <= t if direction == "le" else values >= t
            text = _ordered_text(name, direction, int(t))
        else:
            grouped = _best_groups(values, off)
            if grouped is None:
                continue
            f1, prec, rec, chosen = grouped
            members = np.isin(values, list(chosen))
            text = _group_text(name, chosen, candidate)
        rest = ~members
        # The rows outside the group must be the pair's healthy rows: mostly not off, and enough of them.
        rest_ok = int(rest.sum()) >= MIN_ROWS and float(off[rest].mean()) <= 1 - PRECISION
        if prec >= PRECISION and rec >= RECALL and rest_ok and (best is None or f1 > best[0] + 1e-9):
            best = (f1, name, members, prec, rec, text)
    if best is None:
        return None
    f1, name, members, prec, rec, text = best
    phases = {int(p) for p in phase[members].tolist()}
    if name != "phase" and len(phases) == 1:
        text = f"{_phase_name(next(iter(phases)))} rows {text}"
    elif name != "phase":
        text = f"rows {text}"
    idx = np.flatnonzero(members)
    inside, outside = row_errors[members], row_errors[~members]
    return Subset(name, text, int(idx.size), int(off[idx].sum()), total, n, float(prec), float(rec),
                  float(np.nanmedian(inside)), float(np.nanmedian(outside)), idx)


def _ordered_text(name: str, direction: str, t: int) -> str:
    op = "<=" if direction == "le" else ">="
    if name == "rows_per_step":
        return f"of steps with {op} {t} rows"
    return f"at positions {op} {t}"


def _group_text(name: str, chosen: set[int], candidate: RowIndex) -> str:
    if name == "phase":
        return " and ".join(sorted(_phase_name(c) for c in chosen)) + " rows"
    if name == "writer":
        names = stream_names(candidate.streams)  # with several stores, the store too
        return "of writer " + ", ".join(names[c] for c in sorted(chosen))
    keys = sorted(candidate.group_keys[c] for c in chosen)
    return f"of sequence{'s' if len(keys) > 1 else ''} {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"


# --------------------------------------------------------------------------------- what the rows hold
@dataclass
class SubsetContent:
    """What a subset's candidate segment holds, decided on a sample of its rows."""

    kind: str  # reference_segment | zeros | constant | other_request | neighbour_position | unknown
    text: str
    evidence: dict[str, Any] = field(default_factory=dict)


def agreeing_rows_tell_nothing(ref_seg: int, members: np.ndarray, pairs: RowPairs, reference: RowIndex,
                               ref_scales: SegmentScales, limits: list[float], size: int) -> dict[str, Any] | None:
    """Are the rows *outside* a subset (where the pair agrees) rows on which agreement proves
    nothing? Rows that are alike in every layer (the first position of each sequence: the same
    token, no context, an attention sink) agree with any layer: a candidate feeding the wrong layer
    everywhere then looks right on them, and "wrong on the rows at positions >= 1" would be a subset
    claim with no evidence. Such a group is degenerate when, on a sample of its rows, another
    reference segment is within the pair's limit of this one (or, with one segment, its rows are
    alike across sequences). Returns the evidence when degenerate, None otherwise."""
    rest = np.setdiff1d(np.arange(pairs.candidate.size), members, assume_unique=True)
    if rest.size == 0:
        return None
    pick = rest[:: max(1, rest.size // DESCRIBE_ROWS)][:DESCRIBE_ROWS]
    r_all = split(read_rows(reference, pairs.reference[pick]), size)
    mean, scale, limit = ref_scales.mean[ref_seg], ref_scales.scale[ref_seg], limits[ref_seg]
    others = {k: relative_error(r_all[:, k], r_all[:, ref_seg], mean, scale)
              for k in range(r_all.shape[1]) if k != ref_seg}
    alike = {k: e for k, e in others.items() if np.isfinite(e) and e <= limit}
    if alike:
        k = min(alike, key=alike.__getitem__)
        return {"rows": int(rest.size), "rows_read": int(pick.size), "why": "alike_in_every_layer",
                "reference_segment": k, "std_rel_error": float(alike[k] ** 0.5)}
    if r_all.shape[1] == 1 and pick.size > 1:
        centre = np.mean(r_all[:, ref_seg], axis=0, dtype=np.float32)[None, :]
        spread = relative_error(np.broadcast_to(centre, r_all[:, ref_seg].shape), r_all[:, ref_seg], mean, scale)
        if np.isfinite(spread) and spread <= limit:
            return {"rows": int(rest.size), "rows_read": int(pick.size), "why": "alike_in_every_sequence",
                    "std_rel_error": float(spread ** 0.5)}
    return None


def describe_subset(cand_seg: int, ref_seg: int, members: np.ndarray, pairs: RowPairs, reference: RowIndex,
                    candidate: RowIndex, ref_scales: SegmentScales, limits: list[float], size: int,
                    ref_labels: list[str]) -> SubsetContent:
    """Read a sample of the subset's rows and say what candidate segment ``cand_seg`` holds there."""
    pick = members[:: max(1, members.size // DESCRIBE_ROWS)][:DESCRIBE_ROWS]
    c = split(read_rows(candidate, pairs.candidate[pick]), size)[:, cand_seg]
    r_all = split(read_rows(reference, pairs.reference[pick]), size)
    norms = np.linalg.norm(c, axis=1)
    if bool((norms == 0).all()):
        return SubsetContent("zeros", "zeros on every one of these rows (a truncated or skipped transfer)",
                             {"rows_read": int(pick.size)})
    spread = _relative_spread(c)
    # Rows alike on the candidate are a stale buffer only where the reference's are not: the same
    # token with the same context (position 0 of every sequence, a shared system prompt) gives the
    # same hidden state on both sides.
    if float(spread) < 1e-4 and float(_relative_spread(r_all[:, ref_seg])) >= 1e-3:
        return SubsetContent("constant", "the same values on every one of these rows (a stale or default buffer)",
                             {"rows_read": int(pick.size), "relative_spread": float(spread)})
    errors = [relative_error(c, r_all[:, j], ref_scales.mean[j], ref_scales.scale[j]) for j in range(r_all.shape[1])]
    best = int(np.nanargmin(errors)) if np.isfinite(errors).any() else None
    if best is not None and errors[best] <= limits[best]:
        if best == ref_seg:
            return SubsetContent("unknown", f"reference segment {ref_seg} up to drift", {"errors": errors})
        return SubsetContent("reference_segment", f"reference segment {best} ({ref_labels[best]})",
                             {"reference_segment": best, "std_rel_error": float(errors[best] ** 0.5)})
    other = _other_rows(pick, pairs, reference, candidate, c, ref_seg, ref_scales, limits, size)
    if other is not None:
        return other
    closest = best if best is not None else ref_seg
    return SubsetContent("unknown", f"no reference segment (closest: reference segment {closest} "
                                    f"({ref_labels[closest]}), standardised error {errors[closest] ** 0.5:.2f})",
                         {"closest_reference": closest, "std_rel_errors": [float(e) ** 0.5 for e in errors]})


def _relative_spread(rows: np.ndarray) -> float:
    """Mean distance of rows ([n, H]) from their mean row, relative to their mean norm."""
    spread = np.linalg.norm(rows - np.mean(rows, axis=0, dtype=np.float32), axis=1).mean()
    return float(spread / max(float(np.linalg.norm(rows, axis=1).mean()), 1e-30))


def _other_rows(pick: np.ndarray, pairs: RowPairs, reference: RowIndex, candidate: RowIndex, c: np.ndarray,
                ref_seg: int, scales: SegmentScales, limits: list[float], size: int) -> SubsetContent | None:
    """Do the rows hold the right layer of another request's row in the same step, or of a
    neighbouring position of the same sequence?"""
    mean, scale, limit = scales.mean[ref_seg], scales.scale[ref_seg], limits[ref_seg]
    cand_rows = pairs.candidate[pick]
    # Reference rows by (reference sequence group, position), for neighbours.
    ref_key = {(int(g), int(p)): i for i, (g, p) in enumerate(zip(reference.group[pairs.reference].tolist(),
                                                                  reference.position[pairs.reference].tolist(),
                                                                  strict=True))}
    steps = candidate.column("step")
    step_of = steps[pairs.candidate]
    group_of = candidate.group[pairs.candidate]
    stream_of = candidate.stream_of(pairs.candidate)
    hits = {"other_request": 0, "neighbour_position": 0}
    checked = 0
    for at, (k, row) in enumerate(zip(pick[:32].tolist(), cand_rows[:32].tolist(), strict=True)):
        checked += 1
        # Other requests' rows of the same forward (rows of the same sequence are neighbours, below).
        same_step = np.flatnonzero((step_of == steps[row]) & (stream_of == candidate.stream_of(row))
                                   & (group_of != candidate.group[row]))
        g, p = int(reference.group[pairs.reference[k]]), int(reference.position[pairs.reference[k]])
        neighbours = [ref_key[(g, p + d)] for d in (-1, 1) if (g, p + d) in ref_key]
        ci = c[at][None]
        for kind, others in (("other_request", same_step[:16]), ("neighbour_position", np.array(neighbours))):
            if others.size == 0:
                continue
            r = split(read_rows(reference, pairs.reference[others]), size)[:, ref_seg]
            errs = [relative_error(ci, r[m][None], mean, scale) for m in range(r.shape[0])]
            if any(e <= limit for e in errs):
                hits[kind] += 1
                break
    for kind, text in (("other_request", "another request's row of the same step (rows mixed up within the batch)"),
                       ("neighbour_position", "the right layer at a neighbouring position (an off-by-one in the row "
                                              "index)")):
        if checked and hits[kind] >= 0.8 * checked:
            return SubsetContent(kind, text, {"rows_checked": checked, "rows_explained": hits[kind]})
    return None


__all__ = ["Dimension", "Subset", "SubsetContent", "describe_subset", "find_subset", "might_hold_subset",
           "subset_labels"]


def localise_subsets(pass_pairs: list[tuple[int, int]], pairs: Any, ref_index: RowIndex, cand_index: RowIndex,
                     stream: StreamResult, segplan: SegmentPlan, rlabels: list[str]) -> dict:
    """Per segment pair whose off rows form a label group: (Subset, SubsetContent)."""
    out: dict = {}
    dims = None
    for i, j in pass_pairs:
        errors = stream.row_errors.get((i, j))
        if errors is None:
            continue
        threshold = math.sqrt(segplan.limits[j])
        if not might_hold_subset(errors, threshold):
            continue
        if dims is None:  # labels per aligned row, only for a pair with off rows to explain
            dims = subset_labels(pairs, cand_index)
        subset = find_subset(dims, cand_index, errors, threshold)
        if subset is None:
            continue
        if agreeing_rows_tell_nothing(j, subset.members, pairs, ref_index, segplan.ref_scales, segplan.limits,
                                      segplan.size) is not None:
            continue  # the pair agrees only where every layer does: the whole slot is the finding
        content = describe_subset(i, j, subset.members, pairs, ref_index, cand_index, segplan.ref_scales,
                                  segplan.limits, segplan.size, rlabels)
        out[(i, j)] = (subset, content)
    return out
