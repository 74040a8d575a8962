"""The streaming pass's quantiles (one partition for several q) against numpy's single-q
``np.quantile``, bit for bit: the reports' p1/p50/p99 must not move when the computation is shared."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tracediff.compare.stream.metrics import Accumulator, _order_statistics, _quantiles, reduce_block

QS = (0.0, 0.01, 0.25, 0.5, 0.75, 0.99, 1.0)


def _numpy(values: np.ndarray, *qs: float) -> list[float]:
    finite = values[np.isfinite(values)]
    return [float(np.quantile(finite, q)) if finite.size else float("nan") for q in qs]


def _same(a: list[float], b: list[float]) -> bool:
    return all((x == y) or (np.isnan(x) and np.isnan(y)) for x, y in zip(a, b, strict=True))


@settings(max_examples=400, deadline=None)
@given(
    values=hnp.arrays(np.float32, st.integers(0, 300),
                      elements=st.floats(width=32)),
    qs=st.lists(st.sampled_from(QS) | st.floats(0, 1), min_size=1, max_size=4),
)
def test_quantiles_equal_numpys_single_q_calls_bit_for_bit(values: np.ndarray, qs: list[float]) -> None:
    assert _same(_quantiles(values.copy(), *qs), _numpy(values, *qs))


@settings(max_examples=400, deadline=None)
@given(data=st.data(),
       values=hnp.arrays(np.float32, st.integers(1, 200),
                         elements=st.floats(width=32, allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, 1.0])))
def test_order_statistics_are_the_sorted_values_for_any_set_of_ranks(data: st.DataObject, values: np.ndarray) -> None:
    """One partition a rank, from the top down, and the maximum of the front for a rank just below
    the one before: each rank's value is the sorted array's (runs of adjacent ranks, ties included)."""
    n = values.size
    starts = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))
    runs = data.draw(st.lists(st.integers(1, 4), min_size=len(starts), max_size=len(starts)))
    ranks = {min(n - 1, a + i) for a, r in zip(starts, runs, strict=True) for i in range(r)}
    got = _order_statistics(values.copy(), ranks)
    ordered = np.sort(values)
    assert set(got) == ranks
    assert all(got[k] == ordered[k] for k in ranks)


def test_quantiles_of_a_million_metric_like_values_equal_numpys() -> None:
    rng = np.random.default_rng(3)
    for values in (1 - np.abs(rng.normal(0, 1e-3, 1_000_003)).astype(np.float32),   # cosines near 1
                   np.exp(rng.normal(0, 0.01, 999_999)).astype(np.float32),          # norm ratios
                   np.where(rng.random(500_000) < 0.01, np.nan, rng.random(500_000)).astype(np.float32)):
        assert _same(_quantiles(values.copy(), 0.01, 0.5, 0.99), _numpy(values, 0.01, 0.5, 0.99))
    assert _same(_quantiles(np.array([np.nan, np.inf], np.float32), 0.5), [float("nan")])


rows = hnp.arrays(np.float32, st.integers(1, 300),
                  elements=st.sampled_from([0.0, 1.0, 2.5, 7.0, np.inf, np.nan]) | st.floats(0, 10, width=32))


@settings(max_examples=400, deadline=None)
@given(rel_diff=rows, max_abs=rows, cuts=st.lists(st.integers(1, 299), max_size=6), order=st.randoms())
def test_block_reductions_folded_in_order_are_the_whole_arrays_statistics(
    rel_diff: np.ndarray, max_abs: np.ndarray, cuts: list[int], order: object
) -> None:
    """rel_diff's mean and maximum and the max |diff| with its first row, reduced block by block
    (blocks reduced in any order, folded in block order), are numpy's over the whole pass: the
    maximum and its row exactly, the mean within float32 summation order."""
    n = min(rel_diff.size, max_abs.size)
    rel_diff, max_abs = rel_diff[:n], max_abs[:n]
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    spans = list(zip(bounds, bounds[1:], strict=False))
    shuffled = list(range(len(spans)))
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    parts = {b: reduce_block(spans[b][0], rel_diff[slice(*spans[b])], max_abs[slice(*spans[b])]) for b in shuffled}
    acc = Accumulator(0, 0)
    for b in range(len(spans)):
        acc.add_block(parts[b])
    known = rel_diff[~np.isnan(rel_diff)]
    if known.size:
        assert acc.rel_diff_rows == known.size and acc.rel_diff_max == float(known.max())
        want = float(np.mean(known, dtype=np.float64))
        assert acc.rel_diff_sum / acc.rel_diff_rows == want or abs(acc.rel_diff_sum / acc.rel_diff_rows - want) <= 1e-6 * abs(want)
    else:
        assert acc.rel_diff_rows == 0 and np.isnan(acc.rel_diff_max)
    assert acc.max_abs_finite == bool(np.isfinite(max_abs).any())
    if not np.isnan(max_abs).all():
        k = int(np.nanargmax(max_abs))
        assert (acc.max_abs_at, acc.max_abs) == (k, float(max_abs[k]))
    else:
        assert acc.max_abs_at == -1


columns_of = st.integers(0, 60).flatmap(lambda n: st.tuples(*(
    hnp.arrays(np.float32, n, elements=st.floats(0, 4, width=32) | st.sampled_from([np.nan, np.inf, 0.0]))
    for _ in range(3))))


@settings(max_examples=300, deadline=None)
@given(columns=columns_of, std_den=st.sampled_from([0.0, 1.0, 37.5]), piece=st.sampled_from([1, 3, 7, 1 << 20]))
def test_finish_metrics_from_file_or_memory_columns_gives_the_defined_metrics(columns: tuple[np.ndarray, ...],
                                                                              std_den: float, piece: int) -> None:
    """finish_metrics reads a pair's columns one after the other (errors, cosines, norm ratios): the
    same metrics whether the columns live in memory or in the pass's temporary file, the per-row
    errors written back, and the worst rows as defined: the five largest per-row errors (ties in row
    order), as many as rows with a finite cosine, whatever the piece of rows ranked at a time."""
    import functools

    import tracediff.compare.stream.metrics as metrics_module
    from tracediff.compare.align.rowpairs import RowPairs
    from tracediff.compare.rows.index import RowIndex
    from tracediff.compare.stream.metrics import finish_metrics
    from tracediff.compare.stream.rowcolumns import COLUMNS, STD_ERROR, RowColumns

    cos, ratio, num = columns
    n = cos.size
    index = RowIndex(store=None, tap="fc_in", streams=[], offsets=np.array([0, n]), group=np.zeros(n, np.int32),
                     position=np.arange(n, dtype=np.int32), token_id=np.arange(n, dtype=np.int32) + 7,
                     phase=np.zeros(n, np.int8), valid=np.ones(n, bool), group_keys=["s"])
    pairs = RowPairs(np.arange(n, dtype=np.int32)[::-1].copy(), np.arange(n, dtype=np.int32), 0, 0, 0, {}, {})
    results, errors = [], []
    old_piece, metrics_module._WORST_PIECE = metrics_module._WORST_PIECE, piece
    for spill in (False, True):
        store = RowColumns(1, n, spill_bytes=0 if spill else 1 << 62)
        assert store.spilled == (spill and n > 0)
        for c, values in enumerate((cos, ratio, num)):
            store.write(0, c, 0, values)
        read: list[str] = []

        def rows_of(name: str, store: RowColumns = store, read: list[str] = read) -> np.ndarray:
            read.append(name)
            return store.read(0, COLUMNS.index(name))

        acc = Accumulator(1, 2, std_num=3.0, std_den=std_den, sq_err=1.0, sq_ref=2.0)
        keep = functools.partial(store.write, 0, STD_ERROR, 0) if store.spilled else None
        results.append(finish_metrics(acc, rows_of, pairs, index, index, keep_errors=keep))
        assert read == ["std_error", "cosine", "norm_ratio"]
        errors.append(store.read(0, STD_ERROR).copy())
        store.close()
    metrics_module._WORST_PIECE = old_piece
    assert repr(results[0]) == repr(results[1])
    held = results[0]
    # The per-row errors kept: the numerators over the mean reference size, square-rooted.
    mean_den = std_den / max(1, int(np.isfinite(num).sum()))
    with np.errstate(all="ignore"):
        err = np.sqrt(num / np.float32(mean_den)) if mean_den > 0 else np.full(n, np.nan, np.float32)
    for kept in errors:
        np.testing.assert_array_equal(kept, err)
    rows = int(np.isfinite(cos).sum())
    rank = np.where(np.isfinite(err), -err, np.inf)
    order = np.argsort(rank, kind="stable")[: min(5, rows)] if rows else []
    # (repr: NaN equals NaN there)
    assert repr([w["std_error"] for w in held.worst_rows]) == repr([float(err[k]) for k in order])
    assert repr([(w["cosine"], w["norm_ratio"]) for w in held.worst_rows]) == repr(
        [(float(cos[k]), float(ratio[k])) for k in order])
    assert [w["candidate"]["position"] for w in held.worst_rows] == [int(n - 1 - k) for k in order]
    # The column statistics computed in place on the columns (no copies) are numpy's own, bit for bit.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fin_cos, fin_ratio, fin_err = cos[np.isfinite(cos)], ratio[np.isfinite(ratio)], err[np.isfinite(err)]
        want = {
            "cos_mean": float(np.nanmean(cos)) if rows else float("nan"),
            "cos_min": float(np.nanmin(cos)) if rows else float("nan"),
            "cos_p1": float(np.quantile(fin_cos, 0.01)) if fin_cos.size else float("nan"),
            "norm_ratio_mean": float(np.nanmean(ratio)) if rows else float("nan"),
            **{f"norm_ratio_p{q}": float(np.quantile(fin_ratio, q / 100)) if fin_ratio.size else float("nan")
               for q in (1, 50, 99)},
            "std_row_error_p50": float(np.quantile(fin_err, 0.5)) if fin_err.size else float("nan"),
            "std_row_error_p99": float(np.quantile(fin_err, 0.99)) if fin_err.size else float("nan"),
        }
    assert repr({k: getattr(held, k) for k in want}) == repr(want)
    positive = ratio[np.isfinite(ratio) & (ratio > 0)]
    if positive.size:
        logr = np.log2(positive)
        lo, hi = float(logr.min()), float(logr.max())
        if hi - lo < 1e-3:
            lo, hi = lo - 0.05, hi + 0.05
        counts, edges = np.histogram(logr, bins=40, range=(lo, hi))
        assert held.norm_ratio_hist == {"edges": [float(e) for e in edges], "counts": [float(c) for c in counts]}
    else:
        assert held.norm_ratio_hist == {"edges": [], "counts": []}


@pytest.mark.parametrize("spilled", [False, True])
def test_finishing_pairs_a_column_at_a_time_on_threads_gives_one_threads_metrics(monkeypatch, spilled: bool) -> None:
    """The pass's last step (metrics.finish_pairs) on two threads, a column of a pair a task, makes
    the same metrics and per-row errors, bit for bit, as finish_metrics one pair after another: on
    the shipped samples (bf16, engine order), the per-row columns in memory or in the spill file."""
    from tracediff.compare.align.rowpairs import pair_rows  # noqa: PLC0415
    from tracediff.compare.align.sequences import align_sequences  # noqa: PLC0415
    from tracediff.compare.rows.index import RowIndex  # noqa: PLC0415
    from tracediff.compare.stream import metrics, one_pass, rowcolumns  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    if spilled:
        monkeypatch.setattr(rowcolumns, "SPILL_BYTES", 1)
    samples = Path(__file__).resolve().parents[1] / "samples"
    ref = RowIndex.load(open_store(samples / "train.zarr"), "fc_in")
    cand = RowIndex.load(open_store(samples / "server_broken.zarr"), "fc_in")
    pairs = pair_rows(align_sequences(ref, cand))
    matches = [(0, 0), (1, 1), (2, 2), (0, 1), (2, 0)]
    calls: list[int] = []
    finish = metrics.finish_pairs

    def counted(jobs, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(args[-1])
        return finish(jobs, *args)

    monkeypatch.setattr(one_pass, "finish_pairs", counted)
    results = []
    for cpus in (1, 2):
        monkeypatch.setattr(one_pass, "usable_cpus", lambda cpus=cpus: cpus)
        results.append(one_pass.stream_metrics(pairs, ref, cand, matches, 64, workers=1))
    assert calls == [1, 2] and len(pairs) > 100
    one, two = results
    as_json = lambda ms: json.dumps([dataclasses.asdict(m) for m in ms], default=str)  # noqa: E731  (NaN == NaN here)
    assert as_json(two.metrics) == as_json(one.metrics)
    assert [(m.candidate, m.reference) for m in two.metrics] == matches
    for key in one.row_errors:
        np.testing.assert_array_equal(two.row_errors[key], one.row_errors[key])
