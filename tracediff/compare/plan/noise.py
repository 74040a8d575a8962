"""The noise model: how far a correct run in the candidate's compute dtype strays from the reference,
per segment, and how far a neighbouring layer would be; measured where the data allows it.

Step 5 of the plan (DESIGN.md §5). A decision rule linear in depth fails on real depths: bf16 drift
grows far slower than linearly (about as the square root of the depth, docs/noise-model.md) while
neighbouring layers stay about as far apart at layer 60 as at layer 20. So every segment gets

* an **expected drift** ``drift``: what a correct run deviates, from the best source there is:
  ``calibrated`` (calibration rows: the trainer's own target recomputed in the server's compute
  dtype, recorded as tap ``calibration``: the exact drift of that segment), else ``assumed`` (a
  prior in units of the compute dtype's rounding, growing as sqrt(depth), the dtype read from what
  the engines recorded, never from how the rows are stored);
* a **budget** (``SAME_FACTOR`` times the drift, at least the storage floor): within it, the same
  tensor;
* a **limit**, beyond which the pair is other data (a wrong layer, another context), from the data:
  half the estimated distance to a neighbouring layer (the reference's own segments, their distance
  per sqrt(layer of spacing)), and :data:`OUTLIER_FACTOR` times the drift the *other* segments of
  this pair of traces show at their depths (a segment several times worse than the segments before
  and after it is not drift). Only with neither is it assumed (:data:`ASSUMED_LIMIT_FACTOR` x budget);
* ``separable``: whether the budget stays below a quarter of the neighbour distance. When it does
  not, a pair within the budget is "cannot tell", never a silent "same".

Pure numbers on the plan sample; no I/O. Every value here is reported (plan.noise, per segment).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tracediff.compare.plan.segments import MANTISSA_BITS
from tracediff.compare.plan.storage import recorded_storage

#: Expected drift of a correct run, in units of the compute dtype's rounding (half an ulp) times
#: sqrt(depth). Measured (docs/noise-model.md): 1.8-2.0 for a bf16 engine against an fp32 trainer at
#: depths 3-34 of 32-61-layer Llama, Qwen3, Mistral and DeepSeek-V3 models with massive activations.
PRIOR_UNITS = 2.0
#: The budget allows this many times the expected drift.
SAME_FACTOR = 2.0
#: A pair at least this fraction of a neighbouring layer's distance away is other data.
NEIGHBOUR_FRACTION = 0.5
#: The budget must stay below this fraction of the neighbour distance for "same" to be decided.
SEPARATION_FRACTION = 0.25
#: A segment this many times worse than the drift the other segments show at its depth is not drift.
OUTLIER_FACTOR = 4.0
#: A segment within this many times the drift its healthy neighbours in the trace show at its depth
#: (carried as sqrt(depth), as drift grows) is drift of the same tensor, even past half a neighbour
#: distance: quantised weights (FP8) drift on every layer, a wrong layer in one slot only.
CONSISTENT_FACTOR = 1.5
#: With no neighbour distance and no other segment to compare with: other data beyond this many budgets.
ASSUMED_LIMIT_FACTOR = 3.0
#: Depth assumed for a segment whose layer no side records.
DEFAULT_DEPTH = 16

_DTYPE_NAMES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float32", "fp64": "float32", "double": "float32",
}

#: Where the adapters record the dtype a side computed in (writer meta first, then the store's):
#: ours (``compute_dtype``, set by a user or the calibration tap), SGLang (``server_args.dtype``),
#: vLLM (``dtype``, the model config's), transformers (``model.dtype``, ``torch_dtype``).
COMPUTE_DTYPE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("compute_dtype",), ("server_args", "dtype"), ("dtype",), ("model", "dtype"), ("model", "torch_dtype"),
    ("target", "dtype"), ("torch_dtype",), ("config", "torch_dtype"),
)


def canonical_dtype(value: Any) -> str | None:
    """'torch.bfloat16', 'bf16', 'half' ... -> 'bfloat16' / 'float16' / 'float32'; None for anything
    else ('auto', a quantisation name, garbage)."""
    if not isinstance(value, str):
        return None
    name = value.strip().lower().removeprefix("torch.")
    return _DTYPE_NAMES.get(name)


def recorded_compute_dtype(meta: dict[str, Any]) -> tuple[str | None, str]:
    """The compute dtype one side's collected meta (``{"store", "writer", "tap"}``) records, and the
    field it came from; ``(None, "")`` when none does. The tap's ``dtype`` (the storage dtype) is
    never read: a bf16 engine may store float32 rows."""
    for part in ("writer", "store"):
        block = meta.get(part) or {}
        for path in COMPUTE_DTYPE_FIELDS:
            value: Any = block
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            found = canonical_dtype(value)
            if found is not None:
                return found, f"{part}.{'.'.join(path)}"
    # A tap that captured a module's own output in the dtype it computed (record --draft-chain)
    # records that dtype with the tap: the rows' own compute dtype, not how they were stored.
    found = canonical_dtype((meta.get("tap") or {}).get("compute_dtype"))
    return (found, "tap.compute_dtype") if found is not None else (None, "")


@dataclass(frozen=True)
class ComputeDtype:
    """The dtype whose rounding bounds the compute noise of a compare (the coarser side's), and why."""

    dtype: str
    reference: str | None
    candidate: str | None
    source: str  # "recorded" | "assumed"
    fields: dict[str, str] = field(default_factory=dict)
    #: Sides whose rows were stored quantised (side -> format, e.g. float8_e4m3fn): their rounding is
    #: storage noise the noise floor simulates (:mod:`tracediff.compare.plan.storage`), not drift.
    storage: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        def one(side: str, value: str | None) -> str:
            return f"{side} {value} ({self.fields[side]})" if value else f"{side} not recorded"
        stored = "".join(f"; the {side}'s rows were stored as {fmt}" for side, fmt in self.storage.items())
        return (f"{self.dtype} ({'recorded' if self.source == 'recorded' else 'assumed'}: "
                f"{one('reference', self.reference)}, {one('candidate', self.candidate)}){stored}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_compute_dtype(ref_meta: dict[str, Any], cand_meta: dict[str, Any]) -> ComputeDtype:
    """The coarser of the two sides' recorded compute dtypes; a side that records none counts as
    bfloat16 (what serving engines, and most trainers under autocast, compute hidden states in)."""
    r, rf = recorded_compute_dtype(ref_meta)
    c, cf = recorded_compute_dtype(cand_meta)
    known = [d for d in (r, c) if d is not None]
    dtypes = known + (["bfloat16"] if len(known) < 2 else [])
    coarse = min(dtypes, key=lambda d: MANTISSA_BITS.get(d, 23))
    fields = {k: v for k, v in (("reference", rf), ("candidate", cf)) if v}
    storage = {side: fmt for side, fmt in (("reference", recorded_storage(ref_meta)),
                                           ("candidate", recorded_storage(cand_meta))) if fmt}
    return ComputeDtype(coarse, r, c, "recorded" if len(known) == 2 else "assumed", fields, storage)


def rounding_unit(dtype: str) -> float:
    """Half an ulp, relative, of ``dtype`` (float32 counts as TF32: 10 bits, GPU matmuls' default)."""
    return 2.0 ** -(min(MANTISSA_BITS.get(dtype, 7), 10) + 1)


def prior_drift(dtype: str, depth: int) -> float:
    """Assumed standardised relative error of a correct run computed in ``dtype`` at ``depth``."""
    return PRIOR_UNITS * rounding_unit(dtype) * math.sqrt(max(1, depth))


@dataclass
class SegmentNoise:
    """The noise model of one reference segment (all errors: standardised relative, not squared)."""

    reference: int
    depth: int | None  # decoder layers deep (its physical layer); None: not recorded
    source: str  # calibrated | assumed: where ``drift`` comes from
    drift: float  # what a correct run in the compute dtype deviates here
    storage: float  # what storage rounding alone costs (measured on the sample)
    budget: float  # within it: the same tensor
    limit: float  # beyond it: other data
    limit_source: str  # neighbour | consistency (outlier of the others) | others (their drift) | assumed
    neighbour: float | None = None  # estimated distance to a neighbouring layer
    neighbour_from: list[int] | None = None  # the two reference segments it was estimated from
    consistent: float | None = None  # the drift the other segments show at this depth (as the limit used it)
    calibration_rows: int = 0
    storage_dtype: str | None = None  # quantised storage in ``storage`` (e.g. "float8_e4m3fn on the reference")

    @property
    def separable(self) -> bool:
        """Whether the data can tell numerics from a neighbouring layer here."""
        return self.neighbour is None or self.budget <= SEPARATION_FRACTION * self.neighbour

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["separable"] = self.separable
        return out


#: The tap calibration rows are recorded in (``tracediff calibrate``): the reference's own target
#: recomputed in the server's compute dtype on some of the reference's sequences.
CALIBRATION_TAP = "calibration"


@dataclass(frozen=True)
class CalibrationRows:
    """Calibration rows paired with the reference rows of the same tokens ([n, W] float32 each)."""

    values: Any
    reference: Any
    compute_dtype: str | None
    store: str
    tap: str
    sequences: int


@dataclass(frozen=True)
class Calibration:
    """Calibration rows measured against the reference: per reference segment, the drift."""

    drift: list[float | None]  # standardised relative error per reference segment (None: not covered)
    rows: int
    compute_dtype: str | None
    store: str
    tap: str
    sequences: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def segment_noise(floor_errors: list[float], depths: list[int | None], compute: str,
                  calibration: Calibration | None = None) -> list[SegmentNoise]:
    """Drift and budget of every reference segment, before the pairs are known (limits come with
    :func:`with_limits`)."""
    out = []
    for j, storage_sq in enumerate(floor_errors):
        storage = 2.0 * math.sqrt(max(storage_sq, 0.0))
        depth = depths[j]
        cal = calibration.drift[j] if calibration is not None and j < len(calibration.drift) else None
        if cal is not None and math.isfinite(cal):
            source, drift = "calibrated", cal
        else:
            source, drift = "assumed", prior_drift(compute, DEFAULT_DEPTH if depth is None else depth)
        budget = max(storage, SAME_FACTOR * drift, 1e-6)
        out.append(SegmentNoise(j, depth, source, drift, storage, budget, ASSUMED_LIMIT_FACTOR * budget, "assumed",
                                calibration_rows=calibration.rows if source == "calibrated" and calibration else 0))
    return out


def neighbour_distances(pair_error: Any, depths: list[int | None]) -> list[tuple[float, list[int]] | None]:
    """Per reference segment, the distance a neighbouring layer would be, from the reference's own
    segments: ``pair_error(k, j)`` (the standardised relative error of segment k against segment j,
    in j's scales) over sqrt(|depth_j - depth_k|), the smallest over k. Measured on deep models
    (docs/noise-model.md), layers further apart drift apart about as sqrt(spacing) does. None where
    the depths are not recorded or no other segment is at another depth."""
    out: list[tuple[float, list[int]] | None] = []
    for j, dj in enumerate(depths):
        best: tuple[float, list[int]] | None = None
        for k, dk in enumerate(depths):
            if k == j or dj is None or dk is None or dk == dj:
                continue
            e = pair_error(k, j)
            if not math.isfinite(e) or e <= 0:
                continue
            est = e / math.sqrt(abs(dj - dk))
            if best is None or est < best[0]:
                best = (est, [j, k])
        out.append(best)
    return out


def consistent_drift(errors: dict[int, float], depths: list[int | None], j: int, growth: float = 1.0) -> float | None:
    """The drift the other matched segments show, carried to segment ``j``'s depth: drift does not
    shrink with depth, and grows as depth**``growth`` (1: at most linearly, the conservative bound
    for calling a segment an outlier; 0.5: as measured, for calling it consistent) (``errors``:
    reference segment -> identity error). Segments at depth 0 (the embedding: no compute, only
    storage rounding) and unknown depths carry none."""
    dj = depths[j] if j < len(depths) else None
    if dj is None:
        return None
    found = []
    for k, e in errors.items():
        dk = depths[k] if k < len(depths) else None
        if k == j or dk is None or dk < 1 or not math.isfinite(e):
            continue
        found.append(e * max(1.0, dj / dk) ** growth)
    return min(found) if found else None


def with_limits(noise: list[SegmentNoise], neighbours: list[tuple[float, list[int]] | None],
                errors: dict[int, float]) -> list[SegmentNoise]:
    """Each segment's limit from the data: the smaller of half its neighbour distance and
    :data:`OUTLIER_FACTOR` times the drift the other segments show (carried linearly); then raised
    to :data:`CONSISTENT_FACTOR` times the drift of the segments that are within their own limits
    (carried as sqrt(depth)) where that is larger: drift on every layer is not a wrong layer in one.
    Never below the budget (a pair within its budget is decided by separability, not by its limit)."""
    depths = [m.depth for m in noise]
    for n in noise:
        nb = neighbours[n.reference] if n.reference < len(neighbours) else None
        if nb is not None:
            n.neighbour, n.neighbour_from = nb
        n.consistent = consistent_drift(errors, depths, n.reference)
        options = []
        if n.neighbour is not None:
            options.append((NEIGHBOUR_FRACTION * n.neighbour, "neighbour"))
        if n.consistent is not None:
            options.append((OUTLIER_FACTOR * max(n.consistent, n.storage), "consistency"))
        if options:
            limit, how = min(options)
            n.limit, n.limit_source = max(limit, n.budget), how
    healthy = {j: e for j, e in errors.items() if j < len(noise) and e <= noise[j].limit}
    for n in noise:
        along = consistent_drift(healthy, depths, n.reference, growth=0.5)
        if along is not None and CONSISTENT_FACTOR * along > n.limit:
            n.limit, n.limit_source = CONSISTENT_FACTOR * along, "others"
            n.consistent = along
    return noise


__all__ = ["CALIBRATION_TAP", "COMPUTE_DTYPE_FIELDS", "CalibrationRows", "DEFAULT_DEPTH", "Calibration", "ComputeDtype", "SegmentNoise", "canonical_dtype",
           "consistent_drift", "decide_compute_dtype", "neighbour_distances", "prior_drift", "recorded_compute_dtype",
           "rounding_unit", "segment_noise", "with_limits"]
