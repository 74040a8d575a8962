"""Segments: split rows into their K hidden-state slots and decide which slot matches which.

Decisions are made by ranking and margin, never by one fixed cosine threshold: adjacent layers of a
real model have cosine 0.6-0.95 with each other, and hidden states share a large common direction,
so raw cosines between *unrelated* rows are high too. We therefore decide on centred cosines (each
segment minus its mean over the sample rows) and compare a pair's distance ``d = 1 - cos`` with

* the storage noise floor (what rounding both dtypes alone would cost), and
* the runner-up: the next-best reference segment, or the same segment on mismatched rows.

Pure numpy on in-memory samples (no torch: a compare never imports it); no I/O here.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracediff.compare.plan.storage import round_trip
from tracediff.compare.rows.kernels import dot, norms

# A pair whose distance is below this fraction of its runner-up's is the same tensor up to numerics;
# below the second fraction, the same source transformed (scaled, normalised, other context).
NEAR_FRACTION = 0.02
RELATED_FRACTION = 0.35
# Rounding noise is a floor, not a tolerance: kernels and accumulation order add more. Distances
# within this factor of the floor count as exact.
EXACT_FACTOR = 50.0

MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows -> float32 array (bf16 bits widened exactly: the 16 bits are a float32's top half)."""
    if dtype == "bfloat16":
        return widen_into(raw, dtype, np.empty(raw.shape, dtype=np.float32))
    return np.ascontiguousarray(raw).astype(np.float32, copy=False)


def widen_into(raw: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """:func:`to_float32` of ``raw`` written into ``out`` (float32, the same shape): the same bits."""
    if dtype == "bfloat16":
        np.left_shift(np.ascontiguousarray(raw).view(np.uint16), 16, dtype=np.uint32, out=out.view(np.uint32))
    else:
        np.copyto(out, raw, casting="unsafe")
    return out


def split(rows: np.ndarray, size: int) -> np.ndarray:
    """[n, K*size] -> [n, K, size] (a view)."""
    n, width = rows.shape
    return rows.reshape(n, width // size, size)


def _finite_rows(*arrays: np.ndarray) -> np.ndarray:
    mask = np.ones(arrays[0].shape[0], dtype=bool)
    for t in arrays:
        mask &= np.isfinite(t).all(axis=1)
    return mask


#: No serving engine resolves a dimension finer than bf16 does: a dimension's scale is its variation
#: over tokens, but never less than this fraction of its magnitude (a near-constant massive
#: activation would otherwise turn rounding into a huge standardised error).
RESOLUTION = 2.0**-8
#: Rows the robust scale is estimated from.
SCALE_ROWS = 512
#: A dimension whose robust spread over tokens is below this many units of the compute dtype's
#: resolution at its own magnitude is *resolution-limited*: a massive activation (hundreds of times
#: the median, nearly constant), whose every value an engine rounds by a good part of its spread at
#: each layer. Such a dimension carries rounding, not identity, and must not decide which tensor a
#: segment is nor how far two are apart: it is left out of every standardised statistic.
RESOLUTION_LIMITED_UNITS = 8.0
#: The scale given to a resolution-limited dimension: its standardised values are 0 on both sides.
EXCLUDED_SCALE = 1e30


def resolution_of(dtype: str) -> float:
    """Relative spacing of representable values (one ulp at the top of a binade) of a compute dtype;
    float32 counts as TF32 (10 bits), what GPU matmuls run in by default."""
    return 2.0 ** -min(MANTISSA_BITS.get(dtype, 7), 10)


@dataclass(frozen=True)
class SegmentScales:
    """Per segment and dimension, from a plan sample: the mean and the robust scale ([K, H] each).

    The scale is the median absolute deviation over rows (x 1.4826, so it equals the standard
    deviation for Gaussian data), combined with the dimension's bf16 resolution. Dividing by it
    makes every dimension count the same: a few massive activations (100-1000x the median, nearly
    constant over tokens, the same in every layer after an early one) can then no longer dominate a
    cosine, a noise floor or a relative error. Resolution-limited dimensions (see
    :data:`RESOLUTION_LIMITED_UNITS`) get :data:`EXCLUDED_SCALE`: ``excluded`` counts them per segment.
    """

    mean: np.ndarray
    scale: np.ndarray
    excluded: tuple[int, ...] = ()

    def standardise(self, rows: np.ndarray) -> np.ndarray:
        """[n, K*H] -> [n, K, H], centred and divided by the scale."""
        return (split(rows, self.mean.shape[1]) - self.mean) / self.scale


#: Answers remembered per sample array (see :func:`_memo`): id(array) -> (a weak reference, answers).
_MEMO: dict[int, tuple[Any, dict]] = {}


def _memo(rows: np.ndarray, key: str, size: int, compute: Any) -> Any:
    """``compute()``, remembered for the sample array ``rows`` itself and this ``size``.

    The plan asks the same questions of the same sample many times (its finite mask ~30 times, its
    scales ~10: each a pass over 25-100 MB); the answer is kept while the array lives (a weak
    reference drops it with the array). Samples are never changed in place (:func:`read_rows` hands
    them out read-only); a writeable array is not remembered.
    """
    if rows.flags.writeable:
        return compute()
    ident = id(rows)
    entry = _MEMO.get(ident)
    if entry is None or entry[0]() is not rows:
        entry = (weakref.ref(rows, lambda _ref, ident=ident: _MEMO.pop(ident, None)), {})
        _MEMO[ident] = entry
    value = entry[1].get((key, size))
    if value is None:
        value = entry[1][(key, size)] = compute()
    return value


def frozen(rows: np.ndarray) -> np.ndarray:
    """``rows`` made read-only (so that the plan's answers about it can be remembered)."""
    rows.flags.writeable = False
    return rows


def segment_finite(rows: np.ndarray, size: int) -> np.ndarray:
    """[n, K] bool: which segments of which rows hold only finite values."""
    return _memo(rows, "finite", size, lambda: _segment_finite(split(rows, size)))


def _segment_finite(x: np.ndarray) -> np.ndarray:
    # A segment's sum is finite when all its values are (one read, no [n, K, H] mask); a non-finite
    # sum may also be an overflow of finite values: only those segments are checked value by value.
    with np.errstate(over="ignore", invalid="ignore"):
        fin = np.isfinite(x.sum(axis=2))
    if not fin.all():
        rows, segs = np.nonzero(~fin)
        fin[rows, segs] = np.isfinite(x[rows, segs]).all(axis=1)
    return fin


def segment_scales(rows: np.ndarray, size: int, compute_dtype: str | None = None) -> SegmentScales:
    """Robust per-dimension location and scale of each segment of ``rows``, each segment over the
    rows where it is finite (a segment that is NaN on every row gets location 0, scale 1).

    ``compute_dtype``: the dtype the rows were computed in (not the one they are stored in); its
    resolution decides which dimensions are resolution-limited. None: bfloat16, the coarsest an
    engine computes its hidden states in."""
    res = resolution_of(compute_dtype or "bfloat16")
    return _memo(rows, f"scales@{res}", size, lambda: _segment_scales(rows, size, res))


def _segment_scales(rows: np.ndarray, size: int, resolution: float) -> SegmentScales:
    x = split(rows, size)
    fin = segment_finite(rows, size)
    k = x.shape[1]
    means, scales = np.zeros((k, size), np.float32), np.ones((k, size), np.float32)
    excluded = []
    for j in range(k):
        xj = x[:, j] if fin[:, j].all() else x[fin[:, j], j]
        if xj.shape[0] == 0:
            excluded.append(0)
            continue
        # The median and MAD of a few hundred rows are as good a scale as of thousands, at a
        # fraction of the sort's cost (the plan's largest one).
        head = xj[:SCALE_ROWS]
        med, spread = _medians_and_spreads(head)
        mad = spread * np.float32(1.4826)
        rms = np.sqrt(_mean_square(xj))
        scale = np.sqrt(np.square(mad) + np.square(np.float32(RESOLUTION) * rms))
        # A dimension that never varies and is zero (padding) must not divide by zero.
        typical = max(float(lower_median(scale)), 1e-30)
        scale = np.maximum(np.maximum(scale, np.float32(1e-6 * typical)), np.float32(1e-30))
        # Resolution-limited dimensions (massive activations) are left out, as long as most of the
        # segment is not (a segment of near-constant values is compared as it is).
        limited = mad < np.float32(RESOLUTION_LIMITED_UNITS * resolution) * np.abs(med)
        if head.shape[0] >= 8 and 0 < int(limited.sum()) <= size // 4:
            scale = np.where(limited, np.float32(EXCLUDED_SCALE), scale)
            excluded.append(int(limited.sum()))
        else:
            excluded.append(0)
        scales[j] = scale
        means[j] = np.mean(xj, axis=0, dtype=np.float32)
    return SegmentScales(means, scales, tuple(excluded))


def lower_median(v: np.ndarray) -> np.float32:
    """The lower middle value of a 1-d array (a median that is one of its values)."""
    k = (v.size - 1) // 2
    return np.partition(v, k)[k]


#: Columns of the sample transposed and selected at a time, and rows copied a tile at a time: the tile
#: stays in the CPU's cache and below the allocator's mmap threshold. A whole transposed copy ([H, n],
#: 8 MiB at 512 x 4096) cost 4x the selection itself here, most of it faulting in fresh pages.
_MEDIAN_COLUMNS = 128
_TILE_ROWS = 16
#: Rows whose squares are summed at a time (below the mmap threshold at H = 8192).
_SQUARE_ROWS = 8


def _medians_and_spreads(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lower middle value of each column of a finite [n, H] array, and the lower middle value of
    each column's absolute deviations from it, by partial selections over contiguous columns: the
    same values as a sort's, at a fraction of its cost. Each column's deviations are taken from its
    selected copy (the same values in another order: the same order statistic)."""
    n, h = x.shape
    k = (n - 1) // 2
    med, spread = np.empty(h, x.dtype), np.empty(h, x.dtype)
    buf = np.empty((min(_MEDIAN_COLUMNS, h), n), x.dtype)
    for c in range(0, h, _MEDIAN_COLUMNS):
        cols = buf[: min(_MEDIAN_COLUMNS, h - c)]
        for r in range(0, n, _TILE_ROWS):
            cols[:, r : r + _TILE_ROWS] = x[r : r + _TILE_ROWS, c : c + cols.shape[0]].T
        cols.partition(k, axis=1)
        m = med[c : c + cols.shape[0]]
        m[:] = cols[:, k]
        np.subtract(cols, m[:, None], out=cols)
        np.abs(cols, out=cols)
        cols.partition(k, axis=1)
        spread[c : c + cols.shape[0]] = cols[:, k]
    return med, spread


def _mean_square(x: np.ndarray) -> np.ndarray:
    """``np.mean(np.square(x), axis=0, dtype=np.float32)`` of a float32 [n, H] array, bit for bit (a
    reduction over rows adds them one after the other, each partial sum carried into the next
    block's first row), without an [n, H] temporary. A single column is numpy's pairwise sum of
    it: that one is left to numpy (no temporary worth saving)."""
    n, h = x.shape
    with np.errstate(over="ignore"):  # (values whose squares float32 cannot hold give inf, as numpy's would)
        if h < 2:
            return np.mean(np.square(x), axis=0, dtype=np.float32)
        buf = np.empty((_SQUARE_ROWS + 1, h), np.float32)
        acc = np.empty(h, np.float32)
        first = min(_SQUARE_ROWS, n)
        np.square(x[:first], out=buf[:first])
        np.add.reduce(buf[:first], axis=0, out=acc)
        for r in range(first, n, _SQUARE_ROWS):
            rows = x[r : r + _SQUARE_ROWS]
            buf[0] = acc
            np.square(rows, out=buf[1 : 1 + rows.shape[0]])
            np.add.reduce(buf[: 1 + rows.shape[0]], axis=0, out=acc)
        return np.true_divide(acc, n, out=acc, casting="unsafe")


def _unit(z: np.ndarray) -> np.ndarray:
    norm = np.empty(z.shape[:-1], np.result_type(z.dtype, np.float32))
    norms(z, norm)
    norm = norm[..., None]
    return z / np.maximum(norm, np.float32(1e-30))


#: Rows of the plan's sample whose cosines are summed (in float64) at a time.
_CHUNK_ROWS = 256
#: Bytes of one temporary ([rows, K, H] float32) the cosines are computed on: rows are taken a few at
#: a time, so that the standardised and unit segments stay in the CPU's cache and below the
#: allocator's mmap threshold (256 rows at 3 x 4096 made 12 MiB temporaries, each mapped and faulted
#: in afresh: 2.5x the time). Each row's cosines are the same numbers whatever the batch.
_WORK_BYTES = 1 << 19


def _masked_mean_cosines(c: np.ndarray, mc: np.ndarray, r: np.ndarray, mr: np.ndarray,
                         prepare_c: Any = None, prepare_r: Any = None, r_rows: np.ndarray | None = None) -> np.ndarray:
    """Mean over rows of cos(c[:, i], r[:, j]) ([n, Kc, H], [n, Kr, H]), each (i, j) over the rows
    where both segments are finite (masks [n, Kc], [n, Kr]); NaN where there is none.

    ``prepare_c`` / ``prepare_r`` map a few rows to the segments compared (e.g. standardised);
    ``r_rows``, the reference row paired with each row (default: the same row). Each row's cosines
    are computed on their own (float32) and summed in float64 :data:`_CHUNK_ROWS` rows at a time."""
    n, kc, kr = c.shape[0], c.shape[1], r.shape[1]
    if r_rows is not None:
        mr = mr[r_rows]
    # Where every segment of every row is finite (nearly always), the masks change nothing: skip them.
    all_c, all_r = bool(mc.all()), bool(mr.all())
    sums = np.zeros((kc, kr), np.float64)
    step = max(1, min(_CHUNK_ROWS, _WORK_BYTES // (4 * max(kc * c.shape[2], kr * r.shape[2], 1))))
    prods = np.empty((min(n, _CHUNK_ROWS), kc, kr), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for s in range(0, n, _CHUNK_ROWS):
            e = min(n, s + _CHUNK_ROWS)
            for a in range(s, e, step):
                b = min(e, a + step)
                cz = c[a:b] if prepare_c is None else prepare_c(c[a:b])
                rz = r[a:b] if r_rows is None else r[r_rows[a:b]]
                rz = rz if prepare_r is None else prepare_r(rz)
                cu = _unit(cz) if all_c else np.where(mc[a:b, :, None], _unit(np.where(mc[a:b, :, None], cz, 0.0)), 0.0)
                ru = _unit(rz) if all_r else np.where(mr[a:b, :, None], _unit(np.where(mr[a:b, :, None], rz, 0.0)), 0.0)
                # [b, Kc, 1, H] . [b, 1, Kr, H] -> [b, Kc, Kr] (float32, each row's cosines). Not a stacked
                # matmul: one BLAS call a row, 7x the time here, with the GIL held throughout.
                dot(cu.astype(np.float32, copy=False)[:, :, None, :], ru.astype(np.float32, copy=False)[:, None, :, :],
                    prods[a - s : b - s])
            sums += prods[: e - s].sum(axis=0, dtype=np.float64)
    counts = mc.astype(np.float64).T @ mr.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def segment_cosine_matrix(cand: np.ndarray, ref: np.ndarray, size: int, *, centred: bool = False) -> np.ndarray:
    """Mean over rows of the raw cos(candidate segment i, reference segment j): a [Kc, Kr] matrix.

    ``cand`` and ``ref`` are paired rows ([n, Wc], [n, Wr], float32); each entry uses the rows where
    both segments are finite. ``centred`` subtracts each segment's mean row first. Reported for
    users (it is the number they know); decisions use :func:`standardised_cosine_matrix`.
    """
    c, r = split(cand, size), split(ref, size)
    mc, mr = segment_finite(cand, size), segment_finite(ref, size)
    if centred:
        c = c - (np.where(mc[:, :, None], c, 0.0).sum(0) / np.maximum(mc.sum(0), 1)[:, None]).astype(np.float32)
        r = r - (np.where(mr[:, :, None], r, 0.0).sum(0) / np.maximum(mr.sum(0), 1)[:, None]).astype(np.float32)
    return _masked_mean_cosines(c, mc, r, mr)


def standardised_cosine_matrix(cand: np.ndarray, ref: np.ndarray, cand_scales: SegmentScales,
                               ref_scales: SegmentScales, *, roll: int = 0) -> np.ndarray:
    """Mean over rows of cos(z_c[i], z_r[j]), each side standardised by its own segment scales,
    each entry over the rows where both segments are finite. ``roll``: candidate row i is paired
    with reference row (i - roll) mod n (``np.roll(ref, roll, axis=0)``, without the copy).

    Invariant to a per-dimension affine map on either side (a norm weight, a constant factor, an
    offset), so it says which tensor a segment *comes from*; how it was transformed is decided
    afterwards by fitting (:mod:`tracediff.compare.plan.transforms`).
    """
    size = ref_scales.mean.shape[1]
    n = cand.shape[0]
    r_rows = (np.arange(n) - roll) % n if roll else None
    return _masked_mean_cosines(split(cand, size), segment_finite(cand, size), split(ref, size),
                                segment_finite(ref, size), _standardiser(cand_scales), _standardiser(ref_scales),
                                r_rows)


def _standardiser(scales: SegmentScales) -> Any:
    mean, scale = scales.mean, scales.scale
    return lambda x3: (x3 - mean) / scale


def mismatched_rows_matrix(cand: np.ndarray, ref: np.ndarray, cand_scales: SegmentScales,
                           ref_scales: SegmentScales) -> np.ndarray:
    """The same standardised matrix on deliberately mismatched rows: what 'unrelated' looks like here."""
    n = cand.shape[0]
    size = ref_scales.mean.shape[1]
    if n < 2:
        return np.full((cand.shape[1] // size, ref.shape[1] // size), np.nan)
    return standardised_cosine_matrix(cand, ref, cand_scales, ref_scales, roll=n // 2)


def relative_error(cand_seg: np.ndarray, ref_seg: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> float:
    """Squared relative error of ``cand_seg`` against ``ref_seg`` ([n, H] each), every dimension in
    units of the reference's robust scale: sum |(c - r) / s|^2 / sum |(r - mean) / s|^2."""
    keep = np.isfinite(cand_seg).all(axis=1) & np.isfinite(ref_seg).all(axis=1)
    if not keep.any():
        return float("nan")
    c, r = (cand_seg, ref_seg) if keep.all() else (cand_seg[keep], ref_seg[keep])
    with np.errstate(over="ignore", invalid="ignore"):
        num = np.square((c - r) / scale).sum(dtype=np.float64)
        den = np.square((r - mean) / scale).sum(dtype=np.float64)
    return float(num / den) if float(den) > 0 else float("nan")


@dataclass(frozen=True)
class NoiseFloor:
    """What storage rounding alone costs, measured the way decisions measure: the standardised
    ``1 - cos`` (segment matching) and the squared standardised relative error (value checks)."""

    distance: float
    error: float  # the largest over the segments
    errors: tuple[float, ...] = ()  # per reference segment


def noise_floor(ref: np.ndarray, size: int, dtype_ref: str, dtype_cand: str, scales: SegmentScales,
                seed: int = 0, quantised: str | None = None) -> NoiseFloor:
    """Measured, not assumed: the sample rows are perturbed by a relative rounding error of each
    dtype's half-ulp (uniform), and the distance is measured the way matching measures it. With
    ``quantised`` (a side's rows were stored in that FP8 format before being widened to its dtype),
    the rows are first rounded as that storage does (:func:`tracediff.compare.plan.storage.round_trip`)."""
    x = ref[:512]
    if x.shape[0] == 0:
        return NoiseFloor(0.0, 0.0, tuple(0.0 for _ in range(ref.shape[1] // size)))
    rel = np.float32(sum(2.0 ** -(MANTISSA_BITS.get(dt, 23) + 1) for dt in (dtype_ref, dtype_cand)))
    base = x if quantised is None else round_trip(x, quantised)
    noisy = frozen(base * (1 + (_uniform(x.shape, seed) * 2 - 1) * rel))
    m = standardised_cosine_matrix(noisy, x, scales, scales)
    errors = [relative_error(split(noisy, size)[:, j], split(x, size)[:, j], scales.mean[j], scales.scale[j])
              for j in range(x.shape[1] // size)]
    errors = [e if math.isfinite(e) else 0.0 for e in errors]
    diag = np.diag(m)
    distance = 1.0 - float(np.nanmean(diag)) if np.isfinite(diag).any() else 0.0
    return NoiseFloor(float(max(0.0, distance)), float(max(errors, default=0.0)),
                      tuple(float(e) for e in errors))


def _uniform(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Uniform float32 numbers in [0, 1): the 24 low bits of each output of a Mersenne Twister seeded
    with ``seed`` (the numbers torch's CPU ``rand`` draws from ``manual_seed(seed)``, so noise floors
    stay those of reports made before compare stopped using torch)."""
    bits = np.random.RandomState(seed)._bit_generator
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.float32)
    for a in range(0, n, _UNIFORM_CHUNK):  # the same stream, drawn a piece at a time (no n x 8-byte temporaries)
        raw = bits.random_raw(min(_UNIFORM_CHUNK, n - a))
        np.bitwise_and(raw, 0xFFFFFF, out=raw)
        out[a : a + raw.size] = raw
    out *= np.float32(2.0**-24)  # exact: 24-bit integers times a power of two
    return out.reshape(shape)


_UNIFORM_CHUNK = 1 << 16


@dataclass
class SegmentDecision:
    """How candidate segment ``candidate`` relates to the reference, before naming."""

    candidate: int
    reference: int | None
    tier: str  # exact | near | related | none
    distance: float  # centred 1 - cos to the chosen reference segment
    runner_up: int | None
    runner_up_distance: float
    duplicate_of: int | None = None  # another candidate segment carrying the same reference segment


def exact_distance(floor: float) -> float:
    """The standardised distance ``1 - cos`` at or below which matching calls a pair the same tensor
    outright, whatever its runner-up (the "exact" tier): :data:`EXACT_FACTOR` times the noise floor."""
    return max(floor * EXACT_FACTOR, 1e-7)


def tier_of(d1: float, d2: float, floor: float) -> str:
    if not math.isfinite(d1):
        return "none"
    if d1 <= exact_distance(floor):
        return "exact"
    if not math.isfinite(d2) or d2 <= 0:
        return "none"
    if d1 <= NEAR_FRACTION * d2:
        return "near"
    if d1 <= RELATED_FRACTION * d2:
        return "related"
    return "none"


def match_segments(centred: np.ndarray, baseline: np.ndarray, floor: float) -> list[SegmentDecision]:
    """Assign candidate segments to reference segments from the centred cosine matrix.

    Confident pairs are assigned first (smallest distance relative to the runner-up), each reference
    segment at most once; a second candidate segment that matches an assigned reference segment as
    well is a duplicate.
    """
    kc, kr = centred.shape
    dist = 1.0 - centred
    base = 1.0 - baseline
    options: list[tuple[float, int, int, str, float, int | None]] = []
    for i in range(kc):
        for j in range(kr):
            others = [dist[i, k] for k in range(kr) if k != j and math.isfinite(dist[i, k])]
            # The runner-up for (i, j): another reference segment for i, another candidate segment
            # for j, or j on mismatched rows; whichever is closest.
            others += [dist[k, j] for k in range(kc) if k != i and math.isfinite(dist[k, j])
                       and tier_of(dist[k, j], np.inf, floor) != "exact"]
            if math.isfinite(base[i, j]):
                others.append(base[i, j])
            d2 = min(others) if others else float("inf")
            runner = None
            cands = [(dist[i, k], k) for k in range(kr) if k != j and math.isfinite(dist[i, k])]
            if cands:
                runner = min(cands)[1]
            tier = tier_of(float(dist[i, j]), float(d2), floor)
            if tier != "none":
                ratio = float(dist[i, j]) / d2 if d2 > 0 and math.isfinite(d2) else 0.0
                options.append((ratio, i, j, tier, float(d2), runner))
    options.sort()
    decisions: dict[int, SegmentDecision] = {}
    ref_taken: dict[int, int] = {}
    for _ratio, i, j, tier, d2, runner in options:
        if i in decisions:
            continue
        if j in ref_taken:
            continue
        decisions[i] = SegmentDecision(i, j, tier, float(dist[i, j]), runner, d2)
        ref_taken[j] = i
    # Weak evidence, for what is left: mutual best among the unassigned segments, and much closer
    # than unrelated rows are. Identity is not proven (another context or a neighbouring layer can
    # look like this), so such pairs are "related", never "same".
    duplicates: dict[int, int] = {}
    for i in range(kc):
        if i in decisions:
            continue
        finite = [(dist[i, k], k) for k in range(kr) if math.isfinite(dist[i, k])]
        if finite:
            d_best, best = min(finite)
            if best in ref_taken and tier_of(float(d_best), np.inf, floor) == "exact":
                duplicates[i] = best
    while True:
        free_c = [i for i in range(kc) if i not in decisions and i not in duplicates]
        free_r = [j for j in range(kr) if j not in ref_taken]
        best_pair = None
        for i in free_c:
            row = [(dist[i, j], j) for j in free_r if math.isfinite(dist[i, j])]
            if not row:
                continue
            d_ij, j = min(row)
            col = [(dist[k, j], k) for k in free_c if math.isfinite(dist[k, j])]
            if min(col)[1] != i or not math.isfinite(base[i, j]) or d_ij > 0.5 * base[i, j]:
                continue
            if best_pair is None or d_ij < best_pair[0]:
                best_pair = (d_ij, i, j)
        if best_pair is None:
            break
        d_ij, i, j = best_pair
        decisions[i] = SegmentDecision(i, j, "related", float(d_ij), None, float(base[i, j]))
        ref_taken[j] = i
    out = []
    for i in range(kc):
        if i in decisions:
            out.append(decisions[i])
            continue
        finite = [(dist[i, k], k) for k in range(kr) if math.isfinite(dist[i, k])]
        best = min(finite)[1] if finite else None
        d_best = float(dist[i, best]) if best is not None else float("nan")
        dup = None
        if best is not None and best in ref_taken:
            owner = decisions[ref_taken[best]]
            if i in duplicates or (owner.tier in ("exact", "near") and d_best <= 2 * owner.distance + floor * EXACT_FACTOR):
                dup = ref_taken[best]
        runner_d = min([dist[i, k] for k in range(kr) if k != best and math.isfinite(dist[i, k])] or [float("inf")])
        out.append(SegmentDecision(i, best if dup is not None else None, "none", d_best,
                                   best, runner_d, duplicate_of=dup))
    return out


@dataclass(frozen=True)
class Counterpart:
    """A segment the wiring findings call wrong, with the segment on the other side it is closest to."""

    kind: str  # segment_missing | segment_extra | segment_duplicate
    candidate: int
    reference: int


def closest_counterparts(decisions: list[SegmentDecision], standardised: np.ndarray,
                         dead_candidate: frozenset[int] = frozenset(),
                         dead_reference: frozenset[int] = frozenset()) -> list[Counterpart]:
    """Every wrong segment of ``decisions`` with its closest counterpart, by the rules the wiring
    findings name them (``tracediff.compare.findings.segments``): a reference segment no candidate segment
    carries, with the candidate segment of the highest standardised cosine to it; a candidate segment
    with no counterpart, with its runner-up; a duplicate, with the reference segment it repeats.
    Segments that are non-finite on every sampled row are non-finite findings, not wiring: left out."""
    kc, kr = standardised.shape
    taken = {d.reference for d in decisions if d.reference is not None and d.duplicate_of is None}
    out: list[Counterpart] = []
    for j in range(kr):
        if j in taken or j in dead_reference or (j in dead_candidate and j < kc):
            continue
        col = standardised[:, j]
        finite = [(float(col[i]), i) for i in range(kc) if math.isfinite(col[i])]
        if finite:
            out.append(Counterpart("segment_missing", max(finite)[1], j))
    for d in decisions:
        if d.duplicate_of is not None and d.reference is not None:
            out.append(Counterpart("segment_duplicate", d.candidate, d.reference))
        elif d.reference is None and d.candidate not in dead_candidate and d.runner_up is not None:
            out.append(Counterpart("segment_extra", d.candidate, d.runner_up))
    return out


def infer_segment_size(width_ref: int, width_cand: int, ref: np.ndarray, cand: np.ndarray) -> tuple[int, str]:
    """Guess the segment size from the data when no metadata says it.

    Hidden states of one model keep their per-channel magnitude profile across layers (the same
    channels carry the outliers), so the column-magnitude profile of a concatenation repeats with
    period H. We take the smallest lag, among sizes that divide both widths, whose autocorrelation
    is close to the best one. Returns (size, how it was decided).
    """
    common = math.gcd(width_ref, width_cand)
    sizes = [s for s in range(1, common + 1) if common % s == 0 and s >= 8 and width_ref // s <= 16 and width_cand // s <= 16]
    if not sizes:
        return common, f"gcd of the widths ({common})"
    profiles = []
    for t in (ref, cand):
        keep = _finite_rows(t)
        if keep.any():
            profiles.append(np.log(np.abs(t[keep]).mean(axis=0, dtype=np.float32).astype(np.float64) + 1e-12))
    scores: dict[int, float] = {}
    for s in sizes:
        vals = []
        for p in profiles:
            if s < p.size:
                a, b = p[:-s], p[s:]
                if a.std() > 0 and b.std() > 0:
                    vals.append(float(np.corrcoef(a, b)[0, 1]))
        if vals:
            scores[s] = float(np.mean(vals))
    if not scores:
        return common, "single segment (no repeating channel profile found)"
    best = max(scores.values())
    if best < 0.2:
        size = common if width_ref != width_cand else max(width_ref, width_cand)
        return size, f"no repeating channel profile (best autocorrelation {best:.2f}); assumed {size}"
    size = min(s for s, v in scores.items() if v >= best - 0.1 * abs(best))
    return size, f"inferred from the repeating channel-magnitude profile (autocorrelation {scores[size]:.2f} at lag {size})"
