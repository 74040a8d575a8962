"""How a candidate segment relates to the reference segment it comes from: fitted transforms.

Segment matching (:mod:`tracediff.compare.plan.segments`) says which reference tensor a candidate segment comes
from, invariant to per-dimension scale. This module says *how* the two relate, by fitting what real
pipelines do and testing each fit on rows it was not fitted on (two-fold cross-validation), in units
of the target's robust per-dimension scale (:class:`tracediff.compare.plan.segments.SegmentScales`):

* ``identity``: the same data (up to numerics);
* ``constant``: ``cand = c * ref`` (a multiplier, a scaled cast);
* ``rmsnorm``: ``cand = w * ref / rms(ref)`` with a per-dimension weight ``w``, or the other way
  round (the norm is on the reference's side): the final norm, ``norm_before_fc``, ``fc_norm``;
* ``layernorm``: ``cand = w * (ref - mean) / std + b``, either side;

and, tried only where none of those fits (:mod:`tracediff.compare.plan.slots`, issue #52):

* ``diagonal``: ``cand = w * ref``, a per-dimension scale without a norm;
* ``rotation``: ``cand = ref @ Q`` with ``Q`` orthogonal (a rotated target, QuaRot): norms equal,
  directions unrelated. ``Q`` has ``H (H - 1) / 2`` degrees of freedom, so it is fitted only when
  each half of the sample holds at least :data:`ROTATION_ROWS_PER_DIM` ``x H`` rows; with fewer the
  fit says so (``params.too_few_rows``) instead of guessing.

A norm ratio that is not 1 proves nothing: the residual stream grows with depth, so a neighbouring
layer differs in norm too. Only a fit whose held-out error is within the numerics budget names a
transform; a pair that fits none is another computation (a different layer, another context).

Pure numpy on the plan sample; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Simplest first: the first fit within the budget is the one reported.
KINDS = ("identity", "constant", "rmsnorm", "layernorm")
#: Rows of the plan sample the fits use.
FIT_ROWS = 1024
#: Tried after KINDS, only for a pair none of those explains (never listed for other pairs).
SLOT_KINDS = ("diagonal", "rotation", "token_offset")
#: Rows per hidden dimension each half of the sample needs before an H x H rotation is fitted: with
#: fewer, a rotation fitted on one half can bend onto unrelated rows (H^2 / 2 parameters).
ROTATION_ROWS_PER_DIM = 2


@dataclass
class TransformFit:
    """One fitted relation: ``kind`` applied on ``side`` (``candidate``: cand = T(ref); ``reference``:
    ref = T(cand)), its held-out squared relative error, and its parameters."""

    kind: str
    side: str | None
    error: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.error) if math.isfinite(self.error) and self.error >= 0 else float("nan")

    def describe(self) -> str:
        if self.kind == "identity":
            return "the same data"
        if self.kind == "constant":
            return f"times a constant {self.params['factor']:.4g}"
        if self.kind == "diagonal":
            w = self.params.get("weight", {})
            return (f"times a per-dimension scale (fitted mean {w.get('mean', float('nan')):.3g}, range "
                    f"{w.get('min', float('nan')):.3g}..{w.get('max', float('nan')):.3g})")
        if self.kind == "rotation":
            return "rotated by an orthogonal matrix Q (norms kept, directions changed)"
        if self.kind == "token_offset":
            return f"the same values paired {self.params.get('offset', 0):+d} token(s) away"
        w = self.params.get("weight", {})
        norm = "an RMSNorm" if self.kind == "rmsnorm" else "a LayerNorm"
        on = "the candidate" if self.side == "candidate" else "the reference"
        return (f"{norm} applied on {on}'s side only (fitted weight mean {w.get('mean', float('nan')):.3g}, "
                f"range {w.get('min', float('nan')):.3g}..{w.get('max', float('nan')):.3g})")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["relative_error"] = self.relative_error
        return out


def _halves(n: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(n)
    return idx[0::2], idx[1::2]


def _error(target: np.ndarray, pred: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> float:
    with np.errstate(over="ignore", invalid="ignore"):
        num = np.square((target - pred) / scale).sum(dtype=np.float64)
        den = np.square((target - mean) / scale).sum(dtype=np.float64)
    return float(num / den) if float(den) > 0 else float("nan")


def _rms(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # (an overflowing row's rms is inf, without a warning)
        return np.maximum(np.sqrt(np.mean(np.square(x), axis=1, keepdims=True, dtype=np.float32)), np.float32(1e-30))


def _rms_unit(x: np.ndarray) -> np.ndarray:
    return x / _rms(x)


def _ln_unit(x: np.ndarray) -> np.ndarray:
    c = x - np.mean(x, axis=1, keepdims=True, dtype=np.float32)
    return c / _rms(c)


def _weight_summary(w: np.ndarray) -> dict[str, Any]:
    w64 = w.astype(np.float64)
    return {"mean": float(w64.mean()), "std": float(w64.std(ddof=1)) if w64.size > 1 else 0.0,
            "min": float(w64.min()), "max": float(w64.max()),
            "first": [round(float(v), 6) for v in w64[:8]]}


def _cross_validated(source: np.ndarray, target: np.ndarray, mean: np.ndarray, scale: np.ndarray,
                     fit: Any) -> tuple[float, dict[str, Any]]:
    """Fit on one half of the rows and score on the other, both ways; parameters from all rows."""
    a, b = _halves(source.shape[0])
    errs = []
    for train, test in ((a, b), (b, a)):
        if train.size == 0 or test.size == 0:
            continue
        predict, _ = fit(source[train], target[train])
        errs.append(_error(target[test], predict(source[test]), mean, scale))
    _, params = fit(source, target)
    finite = [e for e in errs if math.isfinite(e)]
    return (sum(finite) / len(finite) if finite else float("nan")), params


def _fit_constant(scale: np.ndarray) -> Any:
    def fit(src: np.ndarray, tgt: np.ndarray) -> tuple[Any, dict[str, Any]]:
        s, t = src / scale, tgt / scale
        den = float((s * s).sum(dtype=np.float64))
        c = float((s * t).sum(dtype=np.float64)) / den if den > 0 else 1.0
        return (lambda x: np.float32(c) * x), {"factor": c}
    return fit


def _fit_norm(unit: Any) -> Any:
    centred = unit is _ln_unit

    def fit(src: np.ndarray, tgt: np.ndarray) -> tuple[Any, dict[str, Any]]:
        u = unit(src)
        if centred:  # per-dimension least squares with an intercept
            um, tm = np.mean(u, axis=0, dtype=np.float32), np.mean(tgt, axis=0, dtype=np.float32)
            du, dt = u - um, tgt - tm
            w = ((du * dt).sum(axis=0, dtype=np.float64)
                 / np.maximum((du * du).sum(axis=0, dtype=np.float64), 1e-30)).astype(np.float32)
            b = tm - w * um
        else:
            w = ((u * tgt).sum(axis=0, dtype=np.float64)
                 / np.maximum((u * u).sum(axis=0, dtype=np.float64), 1e-30)).astype(np.float32)
            b = np.zeros_like(w)
        params: dict[str, Any] = {"weight": _weight_summary(w)}
        if centred:
            params["bias"] = _weight_summary(b)
        return (lambda x: unit(x) * w + b), params
    return fit


def _fit_diagonal(src: np.ndarray, tgt: np.ndarray) -> tuple[Any, dict[str, Any]]:
    w = ((src * tgt).sum(axis=0, dtype=np.float64)
         / np.maximum((src * src).sum(axis=0, dtype=np.float64), 1e-30)).astype(np.float32)
    return (lambda x: x * w), {"weight": _weight_summary(w)}


def _row_factors(x: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    den = np.maximum(np.square(x).sum(axis=1, keepdims=True, dtype=np.float64), 1e-30)
    return ((x * tgt).sum(axis=1, keepdims=True, dtype=np.float64) / den).astype(np.float32)


def _fit_scaled_diagonal(src: np.ndarray, tgt: np.ndarray) -> tuple[Any, dict[str, Any]]:
    """``tgt = lambda_row * w * src``: a per-dimension weight and a factor per row (a norm that
    divides each row by a magnitude the data do not say, e.g. after a draft's own norm). Alternating
    least squares; a row's factor is taken from that row's target (one number of H)."""
    w = _fit_diagonal(src, tgt)[0](np.ones((1, src.shape[1]), dtype=np.float32))[0]
    for _ in range(6):
        lam = _row_factors(src * w, tgt)
        ls = lam * src
        w = ((ls * tgt).sum(axis=0, dtype=np.float64)
             / np.maximum((ls * ls).sum(axis=0, dtype=np.float64), 1e-30)).astype(np.float32)
    return (lambda x, w=w: x * w), {"weight": _weight_summary(w)}


def scaled_diagonal_error(cand: np.ndarray, ref: np.ndarray, cand_mean: np.ndarray, cand_scale: np.ndarray) -> float:
    """Held-out error of ``cand = lambda_row * w * ref`` (weights fitted on one half, each test row
    given its best factor): what a per-dimension scale leaves once rows may differ in magnitude. A
    norm on one side leaves little; a plain per-dimension scale leaves what the diagonal fit does."""
    with np.errstate(over="ignore", invalid="ignore"):  # (rows float32 cannot square score inf: not decided)
        return _scaled_diagonal_error(cand, ref, cand_mean, cand_scale)


def _scaled_diagonal_error(cand: np.ndarray, ref: np.ndarray, cand_mean: np.ndarray, cand_scale: np.ndarray) -> float:
    keep = np.isfinite(cand).all(axis=1) & np.isfinite(ref).all(axis=1)
    c, r = cand[keep][:FIT_ROWS].astype(np.float32), ref[keep][:FIT_ROWS].astype(np.float32)
    if c.shape[0] < 4:
        return float("nan")
    a, b = _halves(c.shape[0])
    errs = []
    for train, test in ((a, b), (b, a)):
        predict, _ = _fit_scaled_diagonal(r[train], c[train])
        pred = predict(r[test])
        errs.append(_error(c[test], _row_factors(pred, c[test]) * pred, np.asarray(cand_mean, dtype=np.float32),
                           np.asarray(cand_scale, dtype=np.float32)))
    finite = [e for e in errs if math.isfinite(e)]
    return sum(finite) / len(finite) if finite else float("nan")


def _fit_rotation(src: np.ndarray, tgt: np.ndarray) -> tuple[Any, dict[str, Any]]:
    """Orthogonal Procrustes: the ``Q`` minimising ``|src Q - tgt|``, ``U V^T`` of ``src^T tgt``."""
    m = src.astype(np.float64).T @ tgt.astype(np.float64)
    if not np.isfinite(m).all():  # rows float64 cannot multiply out: no map to fit (scored as nan)
        return (lambda x: np.full_like(x, np.nan)), {"hidden": int(m.shape[0]), "non_finite": True}
    u, _, vt = np.linalg.svd(m)
    q = u @ vt
    h = q.shape[0]
    params = {"hidden": h, "det": float(np.sign(np.linalg.det(q))),
              "distance_from_identity": float(np.linalg.norm(q - np.eye(h)) / math.sqrt(h))}
    q32 = q.astype(np.float32)
    return (lambda x: x @ q32), params


def norm_explains(src: np.ndarray, tgt: np.ndarray, weight: np.ndarray, tgt_mean: np.ndarray,
                  tgt_scale: np.ndarray) -> float:
    """Squared standardised error of ``tgt`` against ``weight * src / rms(src)`` (a given RMSNorm weight,
    nothing fitted): does this norm make ``tgt`` out of ``src``?"""
    keep = np.isfinite(src).all(axis=1) & np.isfinite(tgt).all(axis=1)
    s, t = src[keep][:FIT_ROWS].astype(np.float32), tgt[keep][:FIT_ROWS].astype(np.float32)
    if s.shape[0] < 4 or weight.shape != (s.shape[1],):
        return float("nan")
    return _error(t, _rms_unit(s) * weight.astype(np.float32), np.asarray(tgt_mean, dtype=np.float32),
                  np.asarray(tgt_scale, dtype=np.float32))


def fit_slot_transform(kind: str, cand: np.ndarray, ref: np.ndarray, cand_mean: np.ndarray,
                       cand_scale: np.ndarray) -> TransformFit:
    """One transform of :data:`SLOT_KINDS` (``diagonal`` or ``rotation``) predicting the candidate from
    the reference, cross-validated as :func:`fit_transforms` does, in the candidate's scale."""
    with np.errstate(over="ignore", invalid="ignore"):  # (rows float32 cannot square score inf: not decided)
        return _fit_slot_transform(kind, cand, ref, cand_mean, cand_scale)


def _fit_slot_transform(kind: str, cand: np.ndarray, ref: np.ndarray, cand_mean: np.ndarray,
                        cand_scale: np.ndarray) -> TransformFit:
    keep = np.isfinite(cand).all(axis=1) & np.isfinite(ref).all(axis=1)
    c, r = cand[keep][:FIT_ROWS].astype(np.float32), ref[keep][:FIT_ROWS].astype(np.float32)
    cm, cs = np.asarray(cand_mean, dtype=np.float32), np.asarray(cand_scale, dtype=np.float32)
    if kind == "rotation":
        h, half = c.shape[1], c.shape[0] // 2
        if half < ROTATION_ROWS_PER_DIM * h:
            return TransformFit("rotation", "candidate", float("nan"), {
                "too_few_rows": True, "rows": int(c.shape[0]), "needed": int(2 * ROTATION_ROWS_PER_DIM * h),
                "hidden": int(h)})
        err, params = _cross_validated(r, c, cm, cs, _fit_rotation)
        params["rows"] = int(c.shape[0])
        return TransformFit("rotation", "candidate", err, params)
    if kind == "diagonal":
        if c.shape[0] < 4:
            return TransformFit("diagonal", "candidate", float("nan"))
        err, params = _cross_validated(r, c, cm, cs, _fit_diagonal)
        return TransformFit("diagonal", "candidate", err, params)
    raise ValueError(f"no slot transform {kind!r}")


def fit_transforms(cand: np.ndarray, ref: np.ndarray, cand_mean: np.ndarray, cand_scale: np.ndarray,
                   ref_mean: np.ndarray, ref_scale: np.ndarray, *,
                   identity_budget: float | None = None) -> list[TransformFit]:
    """Every transform of :data:`KINDS` fitted to one segment pair ([n, H] rows each, finite rows
    only), simplest first. The identity is scored in the reference's scale (as the noise floor is);
    a transform that predicts the candidate in the candidate's, one that predicts the reference in
    the reference's.

    With ``identity_budget``, an identity within it is the answer (the simplest fit wins): the
    other transforms are not fitted, and the list holds the identity alone.
    """
    keep = np.isfinite(cand).all(axis=1) & np.isfinite(ref).all(axis=1)
    # float32 with float64 sums, on at most FIT_ROWS rows: one parameter per dimension is fitted from
    # hundreds of rows, and fresh float64 temporaries of a 2048 x 8192 segment would cost more than
    # the whole streaming pass.
    if keep.all():  # (nearly always: the first rows themselves, no copy of every row)
        c, r = cand[:FIT_ROWS].astype(np.float32, copy=False), ref[:FIT_ROWS].astype(np.float32, copy=False)
    else:
        c, r = cand[keep][:FIT_ROWS].astype(np.float32), ref[keep][:FIT_ROWS].astype(np.float32)
    cm, cs, rm, rs = (np.asarray(a, dtype=np.float32) for a in (cand_mean, cand_scale, ref_mean, ref_scale))
    if c.shape[0] < 4:
        return [TransformFit("identity", None, float("nan"))]
    fits = [TransformFit("identity", None, _error(c, r, rm, rs))]
    if identity_budget is not None and fits[0].error <= identity_budget:
        return fits
    err, params = _cross_validated(r, c, cm, cs, _fit_constant(cs))
    fits.append(TransformFit("constant", "candidate", err, params))
    for kind, unit in (("rmsnorm", _rms_unit), ("layernorm", _ln_unit)):
        for side, (src, tgt, mean, scale) in (("candidate", (r, c, cm, cs)), ("reference", (c, r, rm, rs))):
            err, params = _cross_validated(src, tgt, mean, scale, _fit_norm(unit))
            fits.append(TransformFit(kind, side, err, params))
    return fits


def best_transform(fits: list[TransformFit], budget: float) -> TransformFit | None:
    """The simplest kind of fit within ``budget`` (squared relative error), the better side of it
    when both sides fit, or None when none fits.

    A transform other than the identity must also explain clearly more than the identity does
    (a quarter of its error at most): a norm fitted to two copies of the same data is no finding.
    """
    identity = fits[0]
    for kind in KINDS:
        ok = [f for f in fits if f.kind == kind and math.isfinite(f.error) and f.error <= budget
              and (kind == "identity" or not math.isfinite(identity.error) or f.error <= 0.25 * identity.error)]
        if ok:
            return min(ok, key=lambda f: f.error)
    return None


__all__ = ["KINDS", "ROTATION_ROWS_PER_DIM", "SLOT_KINDS", "TransformFit", "best_transform", "fit_slot_transform",
           "fit_transforms", "norm_explains", "scaled_diagonal_error"]
