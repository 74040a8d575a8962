"""The streaming pass measures what differs, per position, and the thresholds the verdict uses.

On the shipped samples (the seed bug and its fix) and on tiny real recordings with a subset bug:
each wrong segment is profiled against the counterpart its finding names, each subset's row groups
apart, and every matched pair's per-position error is the decision metric, held to the same
numerics budget as its findings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from subset_traces import record_subset_traces

from tracediff.compare import compare_stores
from tracediff.demo import default_samples_dir

SAMPLES = default_samples_dir()


@pytest.fixture(scope="module")
def broken():
    return compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr")


@pytest.fixture(scope="module")
def fixed():
    return compare_stores(SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr")


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory):
    return record_subset_traces(tmp_path_factory.mktemp("profiles"))


def _rms(series: list[list[float]]) -> float:
    rows = sum(p[2] for p in series)
    return math.sqrt(sum(p[1] ** 2 * p[2] for p in series) / rows)


def test_each_wrong_segment_is_profiled_against_the_counterpart_its_finding_names(broken):
    findings = {f.kind: f.evidence for f in broken.findings}
    profiles = {p.kind: p for p in broken.position_profiles}
    assert sorted(profiles) == ["segment_extra", "segment_missing"]
    missing, extra = profiles["segment_missing"], profiles["segment_extra"]
    assert (missing.candidate, missing.reference) == (findings["segment_missing"]["closest_candidate"],
                                                      findings["segment_missing"]["reference_segment"])
    assert (extra.candidate, extra.reference) == (findings["segment_extra"]["candidate_segment"],
                                                  findings["segment_extra"]["closest_reference"])
    for p, kind in ((missing, "segment_missing"), (extra, "segment_extra")):
        # The plan sample is every row here: the pass's means are the numbers the finding quotes.
        assert p.std_cos_mean == pytest.approx(findings[kind]["closest_standardised_cosine"], abs=1e-4)
        assert p.cos_mean == pytest.approx(findings[kind]["closest_cosine"], abs=1e-4)
        assert p.rows == broken.plan.pairs
        for series in (p.cos_by_position, p.std_cos_by_position, p.norm_ratio_by_position, p.std_error_by_position):
            assert sum(b[2] for b in series) == p.rows
            assert [b[0] for b in series] == [b[0] for b in broken.metrics[0].cos_by_position]  # the same buckets
        assert p.numerics_budget == broken.plan.numerics_budgets[p.reference]
        assert p.std_rel_error > p.drift_limit  # other data, far beyond numerics
        assert all(b[1] < p.same_tensor_cosine for b in p.std_cos_by_position)
    assert missing.norm_ratio_mean > 1.5  # hs3 against the embedding hs0: several times its norm


@pytest.mark.parametrize("which", ["broken", "fixed"])
def test_matched_pairs_carry_the_decision_metric_by_position_and_the_verdicts_thresholds(which, request):
    report = request.getfixturevalue(which)
    assert report.metrics
    for m in report.metrics:
        assert m.numerics_budget == pytest.approx(report.plan.numerics_budgets[m.reference])
        # The limit is the noise model's (tracediff.compare.plan.noise), never below the budget.
        assert m.drift_limit == pytest.approx(report.plan.drift_limits[m.reference])
        assert m.drift_limit >= m.numerics_budget
        assert m.noise_source in ("assumed", "calibrated") and m.limit_source
        assert sum(p[2] for p in m.std_error_by_position) == m.rows
        assert _rms(m.std_error_by_position) == pytest.approx(m.std_rel_error, rel=1e-4, abs=1e-12)


def test_a_match_has_no_profile_and_every_bucket_within_its_budget(fixed, traces):
    clean = compare_stores(traces["ref"], traces["clean"])
    for report in (fixed, clean):
        assert report.verdict == "match" and report.position_profiles == []
        assert not [f for f in report.findings if f.kind == "precision"]
        for m in report.metrics:
            assert all(p[1] <= m.numerics_budget for p in m.std_error_by_position), m
    # bf16 against fp32: errors that are not zero, well inside the budget.
    assert all(0 < m.std_rel_error < m.numerics_budget for m in clean.metrics)


def test_each_subset_group_is_profiled_apart_from_the_other_rows(traces):
    report = compare_stores(traces["ref"], traces["decode_zeros"])
    subsets = [f for f in report.findings if f.kind == "segment_subset"]
    assert sorted(f.evidence["candidate_segment"] for f in subsets) == [1, 2]
    for f in subsets:
        pair = (f.evidence["candidate_segment"], f.evidence["reference_segment"])
        groups = [p for p in report.position_profiles if (p.candidate, p.reference) == pair]
        assert [p.kind for p in groups] == ["segment_subset"] * 2
        group, rest = groups
        assert group.group == f.evidence["subset"]["description"] and rest.group == "the other rows"
        assert group.rows == f.evidence["subset"]["rows"] and group.rows + rest.rows == report.plan.pairs
        assert group.norm_ratio_mean == 0.0  # zeros on those rows
        assert all(p[1] > group.drift_limit for p in group.std_error_by_position)  # every bucket off
        assert all(p[1] < rest.numerics_budget for p in rest.std_error_by_position)
        assert group.std_cos_by_position == [] and math.isnan(group.std_cos_mean)
    # A subset explains its pair: no wiring profile is left for it.
    assert {p.kind for p in report.position_profiles} == {"segment_subset"}


def _buckets_whole(positions: np.ndarray) -> tuple[list[float], list[int]]:
    """The buckets as computed before issue #27, on the whole gathered column at once."""
    top = int(positions.max()) + 1 if positions.size else 1
    count = max(1, min(64, top))
    edges = np.linspace(0, top, count + 1)
    index = np.searchsorted(edges, positions, side="right") - 1
    return edges.tolist(), np.clip(index, 0, count - 1).astype(np.int16).tolist()


@pytest.mark.parametrize("rows_at_a_time", [1, 7, 1 << 17])
def test_position_buckets_a_few_rows_at_a_time_equal_the_whole(monkeypatch: pytest.MonkeyPatch, rows_at_a_time: int) -> None:
    """PositionBuckets.of buckets the pairs' positions a few rows at a time (issue #27: no whole
    gathered or float64 copy): the same edges and buckets as the whole column at once, negative
    positions and huge ones too."""
    import tracediff.compare.stream.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "_BUCKET_ROWS", rows_at_a_time)
    rng = np.random.default_rng(rows_at_a_time)
    for column in (rng.integers(0, 5000, 3001).astype(np.int32), rng.integers(-40, -1, 50), np.arange(3),
                   np.zeros(0, dtype=np.int32), rng.integers(0, 2**40, 999)):
        rows = rng.integers(0, max(1, column.size), column.size)
        got = metrics_module.PositionBuckets.of(column, rows)
        edges, index = _buckets_whole(column[rows])
        assert got.edges.tolist() == edges
        assert got.index.dtype == np.int16 and got.index.tolist() == index


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 400), count=st.integers(1, 64), rows_at_a_time=st.sampled_from([1, 7, 64, 1 << 17]),
       dtype=st.sampled_from([np.float32, np.float64]), square=st.booleans())
def test_position_bucket_sums_are_bincounts_bits(compiled: bool, data: st.DataObject, n: int, count: int,
                                                 rows_at_a_time: int, dtype: type, square: bool) -> None:
    """PositionBuckets.sums a chunk of rows at a time (issue #27: no whole float64 copy) gives
    np.bincount's sums bit for bit: float64, each bucket summed in row order; values huge, tiny,
    of mixed signs, Inf, some rows left out; NaN where bincount's is NaN (the callers keep finite
    rows only). Without the compiled kernels, and in a process where a pass has loaded them (float32
    values then take the compiled loop)."""
    import tracediff.compare.stream.metrics as metrics_module
    from tracediff.compare.rows.kernels import fused_kernel

    index = data.draw(hnp.arrays(np.int16, n, elements=st.integers(0, count - 1)))
    values = data.draw(hnp.arrays(dtype, n, elements=st.floats(width=32)))
    keep = data.draw(hnp.arrays(np.bool_, n))
    buckets = metrics_module.PositionBuckets(np.linspace(0, count, count + 1), index)
    loaded = fused_kernel() if compiled else None
    assert (loaded is not None) == compiled
    old, old_loaded = metrics_module._BUCKET_ROWS, metrics_module.loaded_fused_kernel
    metrics_module._BUCKET_ROWS = rows_at_a_time
    metrics_module.loaded_fused_kernel = lambda: loaded
    try:
        assert metrics_module._compiled_sums_take(index, values, keep, count) == (dtype == np.float32)
        for mask in (keep, np.ones(n, dtype=bool)):
            got_sums, got_counts = buckets.sums(index, values, mask, square=square)
            w = np.square(values, dtype=np.float64) if square else values
            want_sums = np.bincount(index[mask], weights=w[mask], minlength=count)
            # (A NaN is a NaN: its sign bit, which arithmetic on NaN does not keep, is not compared.)
            number = ~np.isnan(want_sums)
            assert np.array_equal(np.isnan(got_sums), ~number)
            assert got_sums[number].view(np.int64).tolist() == want_sums[number].view(np.int64).tolist()
            assert got_counts.tolist() == np.bincount(index[mask], minlength=count).astype(np.float64).tolist()
    finally:
        metrics_module._BUCKET_ROWS, metrics_module.loaded_fused_kernel = old, old_loaded


def test_position_bucket_sums_outside_the_buckets_are_never_compiled() -> None:
    """The compiled loop does not check its buckets: an index outside ``0..count - 1`` (or of another
    type, or strided) takes numpy's path, which refuses it as it always did."""
    import tracediff.compare.stream.metrics as metrics_module

    index = np.array([0, 1, 2], dtype=np.int16)
    values, keep = np.ones(3, dtype=np.float32), np.ones(3, dtype=bool)
    assert metrics_module._compiled_sums_take(index, values, keep, 3)
    assert not metrics_module._compiled_sums_take(index, values, keep, 2)
    assert not metrics_module._compiled_sums_take(np.array([-1, 0, 1], dtype=np.int16), values, keep, 3)
    assert not metrics_module._compiled_sums_take(index.astype(np.int32), values, keep, 3)
    assert not metrics_module._compiled_sums_take(index, np.ones(6, dtype=np.float32)[::2], keep, 3)
    with pytest.raises(IndexError):
        metrics_module.PositionBuckets(np.linspace(0, 2, 3), index).sums(index, values, keep)


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_position_bucket_sums_of_nan_and_inf(compiled: bool) -> None:
    """A bucket with a NaN (of either sign), or with Inf and -Inf, sums to NaN; one with Inf alone to
    Inf; the others are untouched, with or without the compiled loop, and without numpy's warnings."""
    import warnings

    import tracediff.compare.stream.metrics as metrics_module
    from tracediff.compare.rows.kernels import fused_kernel

    loaded = fused_kernel() if compiled else None
    index = np.array([0, 0, 1, 1, 2, 3], dtype=np.int16)
    values = np.array([1.5, 0.0, np.inf, -np.inf, np.inf, 2.0], dtype=np.float32)
    values[1] = -np.float32(np.nan)
    buckets = metrics_module.PositionBuckets(np.linspace(0, 4, 5), index)
    old = metrics_module.loaded_fused_kernel
    metrics_module.loaded_fused_kernel = lambda: loaded
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for square in (False, True):
                sums, counts = buckets.sums(index, values, np.ones(6, dtype=bool), square=square)
                assert np.isnan(sums[0]) and sums[2] == np.inf and sums[3] == (4.0 if square else 2.0)
                assert np.isnan(sums[1]) != square and (not square or sums[1] == np.inf)
                assert counts.tolist() == [2.0, 2.0, 1.0, 1.0]
    finally:
        metrics_module.loaded_fused_kernel = old
