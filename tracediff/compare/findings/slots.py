"""Findings of the row-model relations (issue #52, docs/row-models.md): a matched slot pair whose
relation the plan fitted (:mod:`tracediff.compare.plan.transforms`, :mod:`tracediff.compare.plan.slots`) named by
what the slot holds, with its root cause and its fix; and two sides whose stores record different row
models.

* ``final_norm``: a hidden-state slot normalised on one side only (an RMSNorm with a learned weight),
  where a row model says the slot is a target hidden state: pre- vs post-final-norm;
* ``rotation``: the slot is the reference's rotated by an orthogonal ``Q`` (fold ``Q^T`` into fc);
* ``embedding_scale``: an embedding slot times a constant (decided by the norm ratio and the fitted
  factor: the cosine of a scaled vector is 1);
* ``slot_token_offset``: an embedding slot holding the embedding of another token than the reference's;
* ``dimension_scale``: a per-dimension scale on one side only.

The fix lines are the adapters' (:func:`tracediff.adapters.engine_rules.row_model_fix`).
"""

from __future__ import annotations

import math
from typing import Any

from tracediff.adapters.conventions import engine_of
from tracediff.adapters.engine_rules import row_model_fix
from tracediff.compare.plan.decide import Relation
from tracediff.compare.plan.slots import embedding_offset
from tracediff.compare.results import Finding, Report, SegmentMetrics
from tracediff.store.row_model import Slot
from tracediff.store.row_model import from_json as row_model_from_json


def side_slot(report: Report, side: str, k: int) -> Slot | None:
    """Slot ``k`` of ``side``'s stored row model (None: none stored, or not one slot per segment)."""
    stored = getattr(report, side).row_model
    if not stored:
        return None
    model = row_model_from_json({"name": stored["name"], "slots": stored["slots"]})
    return model.slots[k] if k < len(model.slots) and len(model.slots) == getattr(report, side).segments else None


def _embedding_slot(report: Report, j: int) -> bool:
    slot = side_slot(report, "reference", j)
    if slot is not None:
        return embedding_offset(slot) is not None
    physical = (report.reference.aux_layers or {}).get("physical")
    return isinstance(physical, list) and len(physical) == report.reference.segments and physical[j] == 0


def relation_finding(report: Report, rel: Relation, m: SegmentMetrics, evidence: dict[str, Any], label: str,
                     rlabel: str, budget: float) -> Finding | None:
    """The finding of a ``transformed`` pair when its transform is a row-model relation; None when it
    is not (the caller's ``segment_scale`` then)."""
    t = rel.transform
    if t is None:
        return None
    i, j = rel.candidate, rel.reference
    rslot, cslot = side_slot(report, "reference", j), side_slot(report, "candidate", i)
    engine = engine_of(report.candidate.meta.get("store") or {}, None) or engine_of(
        report.candidate.meta.get("writer") or {}, None)
    mtp = any(s is not None and s.draft_norm is not None for s in (rslot, cslot))
    what = f" (slot {j}: {rslot.describe()})" if rslot is not None else ""
    held = (f"held-out standardised error {t.relative_error:.2g} vs budget {budget:.2g}; norm ratio median "
            f"{m.norm_ratio_p50:.4g}, raw cosine {m.cos_mean:.4f}")
    target_norm = t.params.get("final_norm") or {}
    if t.kind == "rmsnorm" and (target_norm.get("matches") or any(s is not None and s.kind == "hidden"
                                                                  for s in (rslot, cslot))):
        normed = t.side  # the side whose rows are the other's through an RMSNorm
        params = {"reference_final_norm": normed == "reference", "mtp": mtp}
        kind, summary = "final_norm", (f"{label} is {rlabel} taken {'after' if normed == 'candidate' else 'before'} "
                                       f"the final norm")
        norm = (f"the target's final norm (its weight, {target_norm['weight_from']}, makes one side out of the other "
                f"with standardised error {target_norm['error']:.2g})" if target_norm.get("matches")
                else "an RMSNorm with a learned weight (the final norm?)")
        cause = (f"{label} is {rlabel}{what} passed through {norm} on the {normed}'s side only ({held}): one side feeds "
                 f"the hidden state before the final norm, the other after it"
                 f"{' (the head' + chr(39) + 's own hnorm then hides the difference in magnitude)' if mtp else ''}")
    elif t.kind == "rotation":
        params = dict(t.params)
        kind, summary = "rotation", f"{label} is {rlabel} rotated (a rotated target)"
        cause = (f"{label} is {rlabel}{what} rotated by an orthogonal matrix Q: norms equal (median ratio "
                 f"{m.norm_ratio_p50:.4g}), directions unrelated (raw cosine {m.cos_mean:.4f}); an orthogonal "
                 f"Procrustes map fitted on half the sample predicts the other half within numerics (held-out "
                 f"standardised error {t.relative_error:.2g} vs budget {budget:.2g}, {t.params.get('rows')} rows): the "
                 f"target's hidden states are rotated on the candidate (QuaRot-style), the draft was trained unrotated")
    elif t.kind == "token_offset":
        params = {**t.params, "mtp": mtp}
        off = int(t.params.get("offset", 0))
        kind, summary = "slot_token_offset", f"{label} holds the embedding of the wrong token ({off:+d})"
        cause = (f"{label} holds the embedding of another token than {rlabel}{what}: it equals the reference's "
                 f"embedding of the token {abs(off)} position(s) {'earlier' if off < 0 else 'later'} (standardised "
                 f"error {t.relative_error:.2g} vs budget {budget:.2g} on {t.params.get('rows')} rows), while the "
                 f"hidden-state slots pair as they should")
    elif t.kind == "constant" and _embedding_slot(report, j):
        factor = float(t.params.get("factor", float("nan")))
        params = {"factor": factor, "hidden_size": report.reference.segment_size}
        root = math.sqrt(report.reference.segment_size)
        ratio = abs(factor)
        gemma = (f"sqrt(hidden_size) = {root:.4g}" if abs(ratio - root) <= 0.02 * root
                 else f"1/sqrt(hidden_size) = {1 / root:.4g}" if ratio > 0 and abs(1 / ratio - root) <= 0.02 * root
                 else None)
        kind, summary = "embedding_scale", f"{label} is the embedding {rlabel} times {factor:.4g}"
        cause = (f"{label} is the embedding slot {rlabel}{what} times {factor:.4g} (norm ratio median "
                 f"{m.norm_ratio_p50:.4g}; the cosine, {m.cos_mean:.6f}, cannot see a scale: {held})"
                 + (f": {gemma}, the embedding normaliser of Gemma-style models, applied on one side only" if gemma
                    else ": an embedding scale applied on one side only"))
    elif t.kind == "diagonal":
        params = dict(t.params)
        kind, summary = "dimension_scale", f"{label} is {rlabel} times a per-dimension scale"
        cause = f"{label} is {rlabel}{what} {t.describe()} ({held}): one side applies per-dimension weights"
    else:
        return None
    fix = row_model_fix(kind, engine, params)
    return Finding(kind, "error", f"{cause}. Fix: {fix}.", {**evidence, "transform": t.to_dict(), "fix_line": fix}, summary)


def one_rotation_cause(findings: list[Finding]) -> None:
    """A rotated target rotates every hidden state it hands over: one root cause (the first slot's
    rotation, its fix folds Q^T into the fc), the other slots' rotations follow from it."""
    rotations = [f for f in findings if f.kind == "rotation"]
    for f in rotations[1:]:
        f.evidence["explained_by"] = "rotation"


def row_model_findings(report: Report) -> list[Finding]:
    """Both stores record a row model and the slots differ: one finding naming both (the metadata),
    whatever the data say (they are reported on their own)."""
    r, c = report.reference.row_model, report.candidate.row_model
    if not r or not c or r["slots"] == c["slots"]:
        return []
    rs, cs, rt, ct = r["slots"], c["slots"], r["slots_text"], c["slots_text"]
    differ = [k for k in range(max(len(rs), len(cs))) if k >= min(len(rs), len(cs)) or rs[k] != cs[k]]
    shown = "; ".join(f"reference {rt[k] if k < len(rt) else f'slot {k}: none'}, candidate "
                      f"{ct[k] if k < len(ct) else f'slot {k}: none'}" for k in differ[:3])
    count = (f"{len(r['slots'])} slots vs {len(c['slots'])}" if len(r["slots"]) != len(c["slots"]) else
             f"slot(s) {', '.join(map(str, differ))} differ")
    return [Finding(
        "row_model", "warning",
        f"The stores record different row models: reference {r['name']}, candidate {c['name']} ({count}: {shown}). "
        f"The data decide what each slot holds (findings below); fix the side whose recorded model is wrong.",
        {"reference": {k: r[k] for k in ("name", "slots")}, "candidate": {k: c[k] for k in ("name", "slots")},
         "slots": differ},
        f"the stores record different row models ({r['name']} vs {c['name']})")]


__all__ = ["one_rotation_cause", "relation_finding", "row_model_findings", "side_slot"]
