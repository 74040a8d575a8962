"""Slot relations the per-dimension fits cannot see (issue #52): decided on the plan sample, with
each side's row model (:mod:`tracediff.store.row_model`), after :func:`tracediff.compare.plan.decide.plan_segments`.

* a slot paired with no reference slot may still be the reference's slot **rotated** (a QuaRot
  target: every hidden state ``h Q``; norms equal, cosine ~0): an orthogonal Procrustes map fitted
  on half the sample and scored on the other half, held to the pair's numerics budget;
* an **embedding slot** paired with no reference slot may hold the embedding of another token than
  the reference's (``x_p`` where the draft learned ``x_{p+1}``): the reference's own rows give the
  embedding of each token they hold, and the candidate's rows are scored against the embedding of
  their row's token and of the next one;
* a matched pair that none of the usual transforms explains may be a **per-dimension scale**.

A relation found here turns the decision into a matched pair whose relation is ``transformed`` by
that fit (the segment map shows it, the findings name it); anything else is left as it was, so a
pair it does not explain reads exactly as before. Pure numpy on the sample; no I/O but the token
labels the caller hands in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracediff.compare.plan.decide import Relation, SegmentPlan
from tracediff.compare.plan.segments import relative_error, split
from tracediff.compare.plan.transforms import TransformFit, fit_slot_transform, norm_explains, scaled_diagonal_error
from tracediff.store.row_model import RowModel, Slot

#: Rows of the sample whose token the reference's embedding table must know, at the least, before
#: a token pairing is scored (and at least this fraction of the rows).
MIN_TOKEN_ROWS = 16
MIN_TOKEN_FRACTION = 0.25


@dataclass
class SampleTokens:
    """The token labels of the plan sample's pairs (one entry per sampled pair, -1 unknown)."""

    ref_token: np.ndarray
    ref_next: np.ndarray
    cand_token: np.ndarray
    cand_next: np.ndarray


def side_row_model(streams: list[Any]) -> RowModel | None:
    """The row model a side's writer groups stored (the first that stored one), None if none did."""
    for s in streams:
        model = s.row_model
        if model is not None:
            return model
    return None


def row_model_json(model: RowModel | None) -> dict[str, Any] | None:
    """A side's row model as the report shows it: the stored JSON plus one line per slot."""
    if model is None:
        return None
    return {**model.to_json(), "slots_text": model.describe()}


def embedding_offset(slot: Slot | None) -> int | None:
    """For a slot holding a token's embedding (an ``embedding`` slot, or hidden state 0 before any
    layer), the offset of its token from the row's; None for any other slot."""
    if slot is None:
        return None
    if slot.kind == "embedding":
        return slot.token_offset
    if slot.kind == "hidden" and slot.layer == 0 and not slot.final_norm:
        return slot.token_offset
    return None


def refine_relations(segplan: SegmentPlan, cand: np.ndarray, ref: np.ndarray, ref_model: RowModel | None,
                     cand_model: RowModel | None, tokens: Callable[[], SampleTokens | None],
                     final_norm: tuple[np.ndarray, str] | None = None) -> list[str]:
    """Decide the relations of :mod:`this module <tracediff.compare.plan.slots>` in place on
    ``segplan``; returns notes for the plan (e.g. a sample too small to fit a rotation).
    ``final_norm``: the target's final norm weight and where it came from (``compare --target``): a
    pair one side of which that very norm makes out of the other is named the final norm."""
    notes: list[str] = []
    size = segplan.size
    c3, r3 = split(cand, size), split(ref, size)
    kr = r3.shape[1]
    matched = {d.reference for d in segplan.decisions if d.reference is not None}
    cs, rs = segplan.cand_scales, segplan.ref_scales
    held: SampleTokens | None = None
    asked = False
    for d in segplan.decisions:
        i = d.candidate
        rel = segplan.relations.get(i)
        if rel is not None and final_norm is not None and rel.relation == "transformed" and rel.transform is not None \
                and rel.transform.kind == "rmsnorm" and d.reference is not None:
            _name_final_norm(rel.transform, c3[:, i], r3[:, d.reference], segplan, i, d.reference, final_norm)
        normed = rel is not None and rel.relation == "transformed" and rel.transform is not None and \
            rel.transform.kind in ("rmsnorm", "layernorm")
        if rel is not None and d.reference is not None and (normed or rel.relation in ("other", "drift")):
            # A per-dimension scale on rows whose rms hardly varies (massive dimensions dominate it) fits
            # a norm too: the norm is named only when it explains clearly more than the scale does.
            j = d.reference
            fit = fit_slot_transform("diagonal", c3[:, i], r3[:, j], cs.mean[i], cs.scale[i])
            if not _within(fit, segplan.budgets[j], rel.error):
                continue
            if normed:
                assert rel.transform is not None
                # ... and when a factor per row (a norm's division) explains little more than the scale.
                per_row = scaled_diagonal_error(c3[:, i], r3[:, j], cs.mean[i], cs.scale[i])
                floor = segplan.floor.errors[j] if j < len(segplan.floor.errors) else segplan.floor.error
                if fit.error > 0.25 * rel.transform.error or (
                        math.isfinite(per_row) and fit.error > 4 * floor and per_row <= 0.25 * fit.error):
                    continue
            rel.relation, rel.transform = "transformed", fit
            continue
        if d.reference is not None or d.duplicate_of is not None or i >= kr or i in matched:
            continue
        if i in segplan.dead_candidate or i in segplan.dead_reference:
            continue
        j = i  # the same slot on both sides, each unpaired
        identity = relative_error(c3[:, i], r3[:, j], rs.mean[j], rs.scale[j])
        found: TransformFit | None = None
        offset = embedding_offset(_slot(ref_model, j, kr))
        if offset is not None:
            if not asked:
                held, asked = tokens(), True
            if held is not None:
                found = _token_pairing(c3[:, i], r3[:, j], offset, held, cs.mean[i], cs.scale[i], segplan.budgets[j])
        if found is None:
            fit = fit_slot_transform("rotation", c3[:, i], r3[:, j], cs.mean[i], cs.scale[i])
            if fit.params.get("too_few_rows"):
                notes.append(
                    f"slot {i}: paired with no reference slot; too few sample rows ({fit.params['rows']}) to test "
                    f"whether it is the reference's slot rotated (an orthogonal {size}x{size} map needs "
                    f"{fit.params['needed']}): compare with --sample-rows {fit.params['needed']} or more to decide")
            elif _within(fit, segplan.budgets[j], identity):
                found = fit
        if found is not None:
            d.reference, d.tier = j, "related"
            segplan.relations[i] = Relation(i, j, "transformed", identity, found, [TransformFit(
                "identity", None, identity), found])
            matched.add(j)
    return notes


def _name_final_norm(fit: TransformFit, c: np.ndarray, r: np.ndarray, segplan: SegmentPlan, i: int, j: int,
                     final_norm: tuple[np.ndarray, str]) -> None:
    """Mark an RMSNorm fit as the target's final norm (``params.final_norm``) when the target's own
    weight, unfitted, makes the normalised side out of the other within the pair's budget."""
    weight, where = final_norm
    src, tgt, side = (r, c, segplan.cand_scales) if fit.side == "candidate" else (c, r, segplan.ref_scales)
    k = i if fit.side == "candidate" else j
    err = norm_explains(src, tgt, np.asarray(weight), side.mean[k], side.scale[k])
    fit.params["final_norm"] = {"weight_from": where, "error": err,
                                "matches": bool(math.isfinite(err) and err <= segplan.budgets[j])}


def _slot(model: RowModel | None, k: int, count: int) -> Slot | None:
    if model is None or len(model.slots) != count:
        return None
    return model.slots[k]


def _within(fit: TransformFit, budget: float, identity: float) -> bool:
    """The fit explains the pair within numerics, and far better than the identity does."""
    return (math.isfinite(fit.error) and fit.error <= budget
            and (not math.isfinite(identity) or fit.error <= 0.25 * identity))


def _token_pairing(c: np.ndarray, r: np.ndarray, ref_offset: int, held: SampleTokens, mean: np.ndarray,
                   scale: np.ndarray, budget: float) -> TransformFit | None:
    """The candidate's embedding slot scored against the reference's embedding of the row's token
    (offset 0) and of the next token (offset 1), the table built from the reference's own rows.
    Returns the token-offset fit that explains the slot within ``budget``, relative to the
    reference's offset, or None."""
    ref_label = {0: held.ref_token, 1: held.ref_next}.get(ref_offset)
    if ref_label is None:
        return None
    keep = (ref_label >= 0) & np.isfinite(r).all(axis=1)
    if not keep.any():
        return None
    table_tokens, first = np.unique(ref_label[keep], return_index=True)
    table = r[keep][first]
    best: TransformFit | None = None
    for offset, label in ((0, held.cand_token), (1, held.cand_next)):
        if offset == ref_offset:
            continue
        at = np.searchsorted(table_tokens, label)
        at = np.clip(at, 0, max(table_tokens.size - 1, 0))
        known = (label >= 0) & (table_tokens[at] == label) & np.isfinite(c).all(axis=1)
        n = int(known.sum())
        if n < MIN_TOKEN_ROWS or n < MIN_TOKEN_FRACTION * c.shape[0]:
            continue
        err = relative_error(table[at[known]], c[known], mean, scale)
        if math.isfinite(err) and err <= budget and (best is None or err < best.error):
            best = TransformFit("token_offset", "candidate", err, {
                "offset": offset - ref_offset, "candidate_token_offset": offset, "reference_token_offset": ref_offset,
                "rows": n})
    return best


__all__ = ["SampleTokens", "embedding_offset", "refine_relations", "row_model_json", "side_row_model"]
