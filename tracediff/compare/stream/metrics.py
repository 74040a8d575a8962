"""What the streaming pass's numbers become: per matched segment pair its metrics (means, quantiles,
worst rows, per-position series), per wrong segment its per-position profile, and the per-row
arrays the subset localisation reads. Pure numpy over the pass's results; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.align.sequences import kept_in_place
from tracediff.compare.plan.decide import ProfileRequest
from tracediff.compare.results import RowRef, SegmentMetrics, SegmentProfile
from tracediff.compare.rows.index import RowIndex
from tracediff.compare.rows.kernels import loaded_fused_kernel


@dataclass
class Accumulator:
    """One matched pair's totals over the pass; rel_diff and max |diff| reduced block by block
    (:func:`reduce_block`, :meth:`add_block`). Its per-row columns (cosine, norm ratio, squared
    standardised error) live in :class:`tracediff.compare.stream.rowcolumns.RowColumns`."""

    cand_seg: int
    ref_seg: int
    rel_diff_sum: float = 0.0  # over the rows whose rel_diff is not NaN (inf counts, as in np.nanmean)
    rel_diff_rows: int = 0
    rel_diff_max: float = float("nan")  # np.nanmax: NaN rows left out
    max_abs: float = float("nan")  # the largest non-NaN max |diff| of a row (np.nanargmax's), its row
    max_abs_at: int = -1
    max_abs_finite: bool = False  # some row's max |diff| is finite (else no max is reported)
    sq_err: float = 0.0
    std_num: float = 0.0  # sum over rows of |(c - r) / s|^2
    std_den: float = 0.0  # sum over rows of |(r - mean) / s|^2
    sq_ref: float = 0.0
    nonfinite_c: int = 0
    nonfinite_r: int = 0

    def add_block(self, part: BlockReduction) -> None:
        """Fold in one block's :func:`reduce_block` (blocks in order: the sum is then the same bits
        however the blocks ran; the maximum and its first row do not depend on the order)."""
        if part.rel_diff_rows:
            self.rel_diff_rows += part.rel_diff_rows
            self.rel_diff_sum += part.rel_diff_sum
            self.rel_diff_max = (part.rel_diff_max if math.isnan(self.rel_diff_max)
                                 else max(self.rel_diff_max, part.rel_diff_max))
        self.max_abs_finite = self.max_abs_finite or part.max_abs_finite
        if part.max_abs_at >= 0 and (self.max_abs_at < 0 or part.max_abs > self.max_abs
                                     or (part.max_abs == self.max_abs and part.max_abs_at < self.max_abs_at)):
            self.max_abs, self.max_abs_at = part.max_abs, part.max_abs_at


@dataclass(frozen=True)
class BlockReduction:
    """One block's rel_diff and max |diff| of one pair, reduced: what :class:`Accumulator` keeps of them."""

    rel_diff_sum: float
    rel_diff_rows: int
    rel_diff_max: float
    max_abs: float
    max_abs_at: int  # the pass's row (-1: every row NaN)
    max_abs_finite: bool


def reduce_block(start: int, rel_diff: np.ndarray, max_abs: np.ndarray) -> BlockReduction:
    """rel_diff and max |diff| of the rows ``start``... of one block: the float64 sum, count and maximum
    of the non-NaN rel_diff (inf counts, as in ``np.nanmean``), and the largest non-NaN max |diff| with
    its first row (``np.nanargmax``'s)."""
    known = rel_diff[~np.isnan(rel_diff)]
    count = int(known.size)
    total = float(known.sum(dtype=np.float64)) if count else 0.0
    top = float(known.max()) if count else float("nan")
    at, value = -1, float("nan")
    if not np.isnan(max_abs).all():
        k = int(np.nanargmax(max_abs))
        at, value = start + k, float(max_abs[k])
    return BlockReduction(total, count, top, value, at, bool(np.isfinite(max_abs).any()))


#: Per-position series have at most this many position buckets.
POSITION_BUCKETS = 64
_BUCKET_ROWS = 1 << 17  # rows at a time (PositionBuckets.of, PositionBuckets.sums)


@dataclass(frozen=True)
class PositionBuckets:
    """The aligned rows grouped by reference position into at most :data:`POSITION_BUCKETS` equal
    buckets; every per-position series of a compare uses the same ones, so their buckets line up."""

    edges: np.ndarray  # [buckets + 1] float64
    index: np.ndarray  # per aligned row: its bucket (int16)

    @classmethod
    def of(cls, positions: np.ndarray, rows: np.ndarray | None = None) -> PositionBuckets:
        """The buckets of ``positions`` (``positions[rows]`` with ``rows``: an index's column and the
        pairs' rows), a few rows at a time: no whole float64 or gathered copy beside the result."""
        n = positions.size if rows is None else rows.size
        highest = None
        for a in range(0, n, _BUCKET_ROWS):
            part = positions[a : a + _BUCKET_ROWS] if rows is None else positions[rows[a : a + _BUCKET_ROWS]]
            highest = int(part.max()) if highest is None else max(highest, int(part.max()))
        top = highest + 1 if highest is not None else 1
        count = max(1, min(POSITION_BUCKETS, top))
        edges = np.linspace(0, top, count + 1)
        index = np.empty(n, dtype=np.int16)
        for a in range(0, n, _BUCKET_ROWS):
            part = positions[a : a + _BUCKET_ROWS] if rows is None else positions[rows[a : a + _BUCKET_ROWS]]
            at = np.searchsorted(edges, part, side="right")
            at -= 1
            np.clip(at, 0, count - 1, out=at)
            index[a : a + at.size] = at
        return cls(edges, index)

    @property
    def count(self) -> int:
        return int(self.edges.size) - 1

    def sums(self, index: np.ndarray, values: np.ndarray, keep: np.ndarray,
             square: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per bucket: the sum of ``values`` (of their squares in float64, with ``square``) where
        ``keep``, and how many rows that is. ``np.bincount``'s sums exactly (float64, each bucket
        summed in row order), a chunk of rows at a time: no whole float64 or index-sized copies."""
        total = np.zeros(self.count)
        counts = np.zeros(self.count, dtype=np.int64)
        every = bool(keep.all())
        compiled = loaded_fused_kernel()
        if compiled is not None and _compiled_sums_take(index, values, keep, self.count):
            # (one loop where a pass loaded the compiled kernels: ufunc.at costs ~10 ns a row)
            compiled.bucket_sums(index, values, keep, every, square, total, counts)
            return total, counts.astype(np.float64)
        for a in range(0, index.size, _BUCKET_ROWS):
            idx, w = index[a : a + _BUCKET_ROWS], values[a : a + _BUCKET_ROWS]
            if not every:
                k = keep[a : a + _BUCKET_ROWS]
                idx, w = idx[k], w[k]
            # ufunc.at adds value after value in row order, as bincount does: the same bits. (Inf and
            # -Inf in one bucket give NaN, as in the compiled loop, without numpy's warning.)
            with np.errstate(invalid="ignore"):
                np.add.at(total, idx.astype(np.intp), np.square(w, dtype=np.float64) if square else w.astype(np.float64))
            counts += np.bincount(idx, minlength=self.count)
        return total, counts.astype(np.float64)

    def series(self, sums: np.ndarray, counts: np.ndarray, divide: float = 1.0, root: bool = False) -> list[list[float]]:
        """``[[bucket start, sum / (rows x divide), rows], ...]`` (its square root if ``root``) for the
        buckets with rows."""
        out = []
        for b in range(self.count):
            if counts[b]:
                v = float(sums[b] / (counts[b] * divide))
                out.append([float(self.edges[b]), math.sqrt(v) if root and v >= 0 else v, int(counts[b])])
        return out


def _compiled_sums_take(index: np.ndarray, values: np.ndarray, keep: np.ndarray, count: int) -> bool:
    """Whether :func:`tracediff.compare.rows.fused.bucket_sums` takes these arrays as the one signature it
    is compiled for ahead of a compare (:func:`tracediff.compare.rows.fused.load`): contiguous int16
    buckets within ``0..count - 1`` (the compiled loop does not check them), float32 values (the
    finish's per-row columns), bool flags. Others (the profiles' float64 sums) take numpy's path: no
    compile inside a compare."""
    return (index.dtype == np.int16 and values.dtype == np.float32 and keep.dtype == np.bool_
            and index.ndim == values.ndim == keep.ndim == 1 and index.size == values.size == keep.size
            and index.flags.c_contiguous and values.flags.c_contiguous and keep.flags.c_contiguous
            and (index.size == 0 or (int(index.min()) >= 0 and int(index.max()) < count)))


@dataclass
class StreamResult:
    metrics: list[SegmentMetrics]
    nonfinite_candidate: dict[int, tuple[int, int | None]]  # segment -> (rows, first pair index)
    nonfinite_reference: dict[int, tuple[int, int | None]]
    bytes_read: int
    # Per matched pair: each aligned row's standardised error over the pair's mean reference size
    # (float32, NaN where not finite), for localising the rows that differ. Mappings that may read
    # each lookup from a file (tracediff.compare.stream.rowcolumns): hold an array while it is needed.
    row_errors: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)
    # Per matched pair, each aligned row's raw cosine and norm ratio (the same numbers the metrics
    # came from), for the per-position profiles of a subset's row groups.
    row_cosines: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)
    row_norm_ratios: Mapping[tuple[int, int], np.ndarray] = field(default_factory=dict)
    limits: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (budget, drift limit)
    buckets: PositionBuckets | None = None
    profiles: list[SegmentProfile] = field(default_factory=list)


def profile_of(r: ProfileRequest, sums: np.ndarray, den: np.ndarray, buckets: PositionBuckets) -> SegmentProfile:
    mean_den = den[0] / den[1] if den[1] else float("nan")
    ok_den = math.isfinite(mean_den) and mean_den > 0

    def total(k: int) -> float:
        return float(sums[2 * k].sum() / sums[2 * k + 1].sum()) if sums[2 * k + 1].sum() else float("nan")

    return SegmentProfile(
        kind=r.kind, candidate=r.candidate, reference=r.reference, group=None, rows=int(sums[1].sum()),
        cos_mean=total(0), std_cos_mean=total(1), norm_ratio_mean=total(2),
        std_rel_error=math.sqrt(total(3) / mean_den) if ok_den else float("nan"),
        numerics_budget=r.numerics_budget, drift_limit=r.drift_limit, same_tensor_cosine=r.same_tensor_cosine,
        cos_by_position=buckets.series(sums[0], sums[1]),
        std_cos_by_position=buckets.series(sums[2], sums[3]),
        norm_ratio_by_position=buckets.series(sums[4], sums[5]),
        std_error_by_position=buckets.series(sums[6], sums[7], mean_den, root=True) if ok_den else [],
    )


def with_subset_profiles(stream: StreamResult, subsets: dict[tuple[int, int], tuple[Any, Any]]) -> list[SegmentProfile]:
    """The stream's profiles with each subset finding's row groups added (the group, then the other
    rows, from the pass's per-row numbers), and without the wiring profiles a subset explains (the
    findings report such a pair once, as the subset)."""
    explained_c = {i for i, _ in subsets}
    explained_r = {j for _, j in subsets}
    out = [p for p in stream.profiles
           if not (p.kind == "segment_missing" and p.reference in explained_r)
           and not (p.kind == "segment_extra" and p.candidate in explained_c)]
    buckets = stream.buckets
    if buckets is None:
        return out
    for (i, j), (subset, _content) in sorted(subsets.items()):
        cos, ratio, err = stream.row_cosines.get((i, j)), stream.row_norm_ratios.get((i, j)), stream.row_errors.get((i, j))
        if cos is None or ratio is None or err is None:
            continue
        budget, drift = stream.limits.get((i, j), (float("nan"), float("nan")))
        inside = np.zeros(cos.size, dtype=bool)
        inside[subset.members] = True
        for group, mask in ((subset.description, inside), ("the other rows", ~inside)):
            series = []
            for values, square in ((cos, False), (ratio, False), (err, True)):
                keep = mask & np.isfinite(values)
                v = values.astype(np.float64) ** 2 if square else values
                series.append((*buckets.sums(buckets.index, v, keep), float(v[keep].sum(dtype=np.float64)),
                               int(keep.sum())))
            (cs, cn, ct, ck), (rs, rn, rt, rk), (es, en, et, ek) = series
            out.append(SegmentProfile(
                kind="segment_subset", candidate=i, reference=j, group=group, rows=int(mask.sum()),
                cos_mean=ct / ck if ck else float("nan"), std_cos_mean=float("nan"),
                norm_ratio_mean=rt / rk if rk else float("nan"),
                std_rel_error=math.sqrt(et / ek) if ek else float("nan"),
                numerics_budget=budget, drift_limit=drift, same_tensor_cosine=float("nan"),
                cos_by_position=buckets.series(cs, cn), norm_ratio_by_position=buckets.series(rs, rn),
                std_error_by_position=buckets.series(es, en, root=True),
            ))
    return out


def row_ref(index: RowIndex, i: int) -> RowRef:
    return RowRef(seq=index.group_keys[int(index.group[i])], position=int(index.position[i]),
                  token_id=int(index.token_id[i]))


def _quantiles(values: np.ndarray, *qs: float, finite_at: np.ndarray | None = None) -> list[float]:
    """``float(np.quantile(finite, q))`` for each q, of the finite values (NaN without any): one
    partition for every q together, and each q's interpolation done as numpy's single-q call does it
    (a float32 lerp with a Python-float weight), so the reports stay bit-identical to that call's
    (held to it by tests/test_metrics_quantiles.py). ``values`` is overwritten: its finite values
    (``finite_at``, when already known) are moved to its front and partitioned there, no copy."""
    finite = kept_in_place(values, np.isfinite(values) if finite_at is None else finite_at)
    n = finite.size
    if not n:
        return [float("nan")] * len(qs)
    where = []
    for q in qs:
        v = float((n - 1) * np.float64(q))  # numpy's virtual index for the "linear" method
        if v >= n - 1:
            where.append((n - 1, n - 1, v + 1.0))  # numpy: both bounds the last value
        else:
            lo = math.floor(v)
            where.append((lo, lo + 1, v - lo))
    ranked = _order_statistics(finite, {k for lo, hi, _ in where for k in (lo, hi)})
    out = []
    for lo, hi, t in where:
        a, b = ranked[lo], ranked[hi]
        diff = b - a
        out.append(float(b - diff * (1 - t) if t >= 0.5 else a + diff * t))
    return out


def _order_statistics(values: np.ndarray, ranks: set[int]) -> dict[int, np.float32]:
    """The value of each rank (0-based, ascending) of a finite 1-d array, which is reordered in place.

    One rank a partition, from the highest down, each on the front that the one before left below
    it; a rank just below the one before is the maximum of that front. numpy partitions around one
    rank by a vectorised selection (x86-simd-sort: ~12 ms for 8 M float32 here) and around several
    by a scalar introselect (~160 ms for four ranks): the same order statistics, 3-5x faster. (Values
    that compare equal may come from different places: -0.0 and 0.0 both count as the same rank.)"""
    out: dict[int, np.float32] = {}
    top = values.size  # values[:top] holds ranks 0 .. top - 1 (in any order)
    for k in sorted(ranks, reverse=True):
        if k == top - 1 and k + 1 in out:
            out[k] = values[:top].max()  # (the front stays: it is ranks 0 .. k)
        else:
            front = values[:top]
            front.partition(k)
            out[k] = front[k]
            top = k
    return out


def _nanmean_in_place(values: np.ndarray) -> float:
    """``float(np.nanmean(values))`` (NaN where every value is NaN), computed as numpy computes it
    (the NaNs made zeros, one pairwise float32 sum, divided by the count) on ``values`` itself,
    whose NaNs become zeros: no copy of the column."""
    nan = np.isnan(values)
    count = np.intp(values.size - int(np.count_nonzero(nan)))
    np.copyto(values, 0, where=nan)
    del nan
    if count == 0:
        return float("nan")
    total = np.sum(values)
    return float(total.dtype.type(total / count))


def _own(column: np.ndarray) -> np.ndarray:
    """``column`` when it is an array of its own (read from the pass's file), else a copy (a held
    column, a view of the pass's memory columns, is not to be overwritten)."""
    return column if column.flags.owndata and column.flags.writeable else column.copy()


def _smallest(rank: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k smallest values of ``rank``, ties in index order: exactly
    ``np.argsort(rank, kind="stable")[:k]``, without sorting every row."""
    if rank.size <= 4 * k:
        return np.argsort(rank, kind="stable")[:k]
    kth = np.partition(rank, k - 1)[k - 1]
    below = np.flatnonzero(rank < kth)
    chosen = np.concatenate([below, np.flatnonzero(rank == kth)[: k - below.size]])
    return chosen[np.lexsort((chosen, rank[chosen]))]


def _largest_errors(err: np.ndarray, ok: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of ``err`` (those not ``ok`` ranked last), ties in index order:
    exactly ``np.argsort(where(ok, -err, inf), kind="stable")[:k]``, a piece of rows at a time (each
    piece's own k smallest hold the whole column's: no whole ranking array)."""
    if k <= 0 or err.size == 0:
        return np.zeros(0, dtype=np.int64)
    found = []
    for a in range(0, err.size, _WORST_PIECE):
        rank = np.negative(err[a : a + _WORST_PIECE])
        rank[~ok[a : a + _WORST_PIECE]] = np.inf
        found.append(_smallest(rank, min(k, rank.size)).astype(np.int64) + a)
    at = np.sort(np.concatenate(found))  # in row order: ties below go to the earlier row
    rank = np.where(ok[at], np.negative(err[at]), np.float32(np.inf)).astype(err.dtype, copy=False)
    return at[_smallest(rank, min(k, at.size))]


#: Rows :func:`_largest_errors` ranks at a time.
_WORST_PIECE = 1 << 20


def finish_metrics(acc: Accumulator, rows_of: Callable[[str], np.ndarray], pairs: RowPairs, reference: RowIndex,
                   candidate: RowIndex, buckets: PositionBuckets | None = None,
                   limits: tuple[float, float] = (float("nan"), float("nan")),
                   keep_errors: Callable[[np.ndarray], None] | None = None) -> SegmentMetrics:
    """One matched pair's metrics from the pass's totals and its per-row columns, ``rows_of(name)``
    for "std_error", "cosine" and "norm_ratio" in turn (each let go before the next is read: a pass
    whose columns live in a file holds one at a time). The error column's squared numerators become
    the per-row errors the subset search reads: in place, and handed to ``keep_errors`` when given.
    (:func:`finish_pairs`: the same for several pairs, their columns on several threads.)"""
    if buckets is None:
        buckets = PositionBuckets.of(reference.position, pairs.reference)
    errors = _finish_errors(acc, rows_of, buckets, keep_errors)
    return _metrics_of(acc, errors, _finish_cosines(rows_of, errors.worst, buckets),
                       _finish_ratios(rows_of, errors.worst), pairs, reference, candidate, limits)


@dataclass(frozen=True)
class FinishJob:
    """One pair for :func:`finish_pairs`: as :func:`finish_metrics`'s arguments of the same names."""

    acc: Accumulator
    rows_of: Callable[[str], np.ndarray]
    limits: tuple[float, float]
    keep_errors: Callable[[np.ndarray], None] | None = None


def finish_pairs(jobs: list[FinishJob], pairs: RowPairs, reference: RowIndex, candidate: RowIndex,
                 buckets: PositionBuckets, workers: int) -> list[SegmentMetrics]:
    """:func:`finish_metrics` of every job, in order: the same numbers, each pair's three columns
    finished as three tasks on ``workers`` threads (every pair's errors first: the cosines and
    ratios read its worst rows). Three pairs on two cores were two rounds of whole pairs, one core
    idle through the second; a column at a time, both stay busy. Each task holds one column, as
    :func:`finish_metrics` does."""
    workers = min(int(workers), 3 * len(jobs))
    if workers <= 1:
        return [finish_metrics(j.acc, j.rows_of, pairs, reference, candidate, buckets, j.limits, j.keep_errors)
                for j in jobs]
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with ThreadPoolExecutor(workers, thread_name_prefix="tracediff-finish") as ex:
        errors = [ex.submit(_finish_errors, j.acc, j.rows_of, buckets, j.keep_errors) for j in jobs]
        # (queued after every pair's errors: a task waits at most for its own pair's, already running)
        cosines, ratios = [], []
        for j, err in zip(jobs, errors, strict=True):
            cosines.append(ex.submit(lambda j=j, err=err: _finish_cosines(j.rows_of, err.result().worst, buckets)))
            ratios.append(ex.submit(lambda j=j, err=err: _finish_ratios(j.rows_of, err.result().worst)))
    return [_metrics_of(j.acc, e.result(), c.result(), r.result(), pairs, reference, candidate, j.limits)
            for j, e, c, r in zip(jobs, errors, cosines, ratios, strict=True)]


@dataclass(frozen=True)
class _Errors:
    worst: np.ndarray  # the rows of the five largest errors, largest first
    worst_err: np.ndarray
    by_pos: list[list[float]]
    largest: float
    p50: float
    p99: float


@dataclass(frozen=True)
class _Cosines:
    rows: int  # rows with a finite cosine
    worst_cos: np.ndarray
    by_pos: list[list[float]]
    smallest: float
    mean: float
    p1: float


@dataclass(frozen=True)
class _Ratios:
    worst_ratio: np.ndarray
    mean: float  # (of every finite ratio; reported only where some cosine is finite)
    p1: float
    p50: float
    p99: float
    hist: dict[str, list[float]]


def _finish_errors(acc: Accumulator, rows_of: Callable[[str], np.ndarray], buckets: PositionBuckets,
                   keep_errors: Callable[[np.ndarray], None] | None) -> _Errors:
    # -- per-row errors. Relative to the pair's mean reference size: one bad row stands out whatever
    # its own norm (a row near the mean would blow up a per-row ratio).
    row_err = rows_of("std_error")
    mean_den = acc.std_den / max(1, int(np.isfinite(row_err).sum()))
    # In place: the squared numerators become the per-row errors. (Whole-array temporaries are few:
    # each is a fresh mapping the size of the pairs, paid for in page faults.)
    if mean_den > 0:
        np.divide(row_err, mean_den, out=row_err)
        np.sqrt(row_err, out=row_err)
    else:
        row_err[:] = np.nan
    if keep_errors is not None:
        keep_errors(row_err)
    err_ok = np.isfinite(row_err)
    # The worst rows: the five largest errors (of the rows with a finite cosine: a prefix, below).
    worst = _largest_errors(row_err, err_ok, min(5, row_err.size))
    worst_err = row_err[worst]
    err_by_pos = buckets.series(*buckets.sums(buckets.index, row_err, err_ok, square=True), root=True)
    err_max = float(np.nanmax(row_err)) if err_ok.any() else float("nan")
    # Each column's last statistics work on it in place when it is a fresh read from the pass's
    # file (the errors written back first): no whole copies (:func:`_own`).
    err_p50, err_p99 = _quantiles(_own(row_err), 0.5, 0.99, finite_at=err_ok)
    return _Errors(worst, worst_err, err_by_pos, err_max, err_p50, err_p99)


def _finish_cosines(rows_of: Callable[[str], np.ndarray], worst: np.ndarray, buckets: PositionBuckets) -> _Cosines:
    cos = rows_of("cosine")
    finite = np.isfinite(cos)
    rows = int(finite.sum())
    worst_cos = cos[worst[: min(5, rows)]]  # the smallest-k of the ranking are a prefix of its smallest 5
    # Cosine by (reference) position, in the compare's position buckets.
    by_pos = buckets.series(*buckets.sums(buckets.index, cos, finite)) if rows else []
    cos_min = float(np.nanmin(cos)) if rows else float("nan")
    cos = _own(cos)
    cos_mean = _nanmean_in_place(cos) if rows else float("nan")  # (its NaNs become zeros: not finite before)
    (cos_p1,) = _quantiles(cos, 0.01, finite_at=finite)
    return _Cosines(rows, worst_cos, by_pos, cos_min, cos_mean, cos_p1)


def _finish_ratios(rows_of: Callable[[str], np.ndarray], worst: np.ndarray) -> _Ratios:
    ratio = rows_of("norm_ratio")
    worst_ratio = ratio[worst]
    ratio = _own(ratio)
    finite = np.isfinite(ratio)
    ratio_mean = _nanmean_in_place(ratio)
    ratio_p1, ratio_p50, ratio_p99 = _quantiles(ratio, 0.01, 0.5, 0.99, finite_at=finite)
    # The finite ratios are now the front of ``ratio`` (in another order): the positive ones' log2,
    # in place (the histogram's range and counts do not depend on their order).
    front = ratio[: int(np.count_nonzero(finite))]
    del finite
    logr = kept_in_place(front, front > 0)
    hist: dict[str, list[float]] = {"edges": [], "counts": []}
    if logr.size:
        np.log2(logr, out=logr)
        lo, hi = float(logr.min()), float(logr.max())
        if hi - lo < 1e-3:
            lo, hi = lo - 0.05, hi + 0.05
        counts_h, edges_h = np.histogram(logr, bins=40, range=(lo, hi))
        hist = {"edges": [float(e) for e in edges_h], "counts": [float(c) for c in counts_h]}
    return _Ratios(worst_ratio, ratio_mean, ratio_p1, ratio_p50, ratio_p99, hist)


def _metrics_of(acc: Accumulator, err: _Errors, cos: _Cosines, ratio: _Ratios, pairs: RowPairs,
                reference: RowIndex, candidate: RowIndex, limits: tuple[float, float]) -> SegmentMetrics:
    rows = cos.rows
    worst = err.worst[: min(5, rows)]
    worst_rows = [
        {
            "cosine": float(cos.worst_cos[n]),
            "std_error": float(err.worst_err[n]),
            "norm_ratio": float(ratio.worst_ratio[n]),
            "candidate": row_ref(candidate, pairs.candidate[k]).__dict__,
            "reference": row_ref(reference, pairs.reference[k]).__dict__,
        }
        for n, k in enumerate(worst.tolist())
    ] if rows else []
    max_abs_row = None
    max_abs = float("nan")
    if acc.max_abs_finite:
        max_abs = acc.max_abs
        max_abs_row = row_ref(candidate, pairs.candidate[acc.max_abs_at])
    return SegmentMetrics(
        candidate=acc.cand_seg,
        reference=acc.ref_seg,
        rows=rows,
        cos_mean=cos.mean,
        cos_p1=cos.p1,
        cos_min=cos.smallest,
        norm_ratio_mean=ratio.mean if rows else float("nan"),
        norm_ratio_p1=ratio.p1,
        norm_ratio_p50=ratio.p50,
        norm_ratio_p99=ratio.p99,
        rel_l2=math.sqrt(acc.sq_err / acc.sq_ref) if acc.sq_ref > 0 else float("nan"),
        rel_diff_mean=acc.rel_diff_sum / acc.rel_diff_rows if rows and acc.rel_diff_rows else float("nan"),
        rel_diff_max=acc.rel_diff_max if rows else float("nan"),
        max_abs_diff=max_abs,
        max_abs_diff_row=max_abs_row,
        nonfinite_candidate=acc.nonfinite_c,
        nonfinite_reference=acc.nonfinite_r,
        worst_rows=worst_rows,
        cos_by_position=cos.by_pos,
        norm_ratio_hist=ratio.hist,
        std_rel_error=math.sqrt(acc.std_num / acc.std_den) if acc.std_den > 0 else float("nan"),
        std_row_error_p50=err.p50,
        std_row_error_p99=err.p99,
        std_row_error_max=err.largest,
        std_error_by_position=err.by_pos,
        numerics_budget=float(limits[0]),
        drift_limit=float(limits[1]),
    )
