"""The streaming pass's quantiles (one partition for several q) against numpy's single-q
``np.quantile``, bit for bit: the reports' p1/p50/p99 must not move when the computation is shared."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tracediff.compare.metrics import _quantiles

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


def test_quantiles_of_a_million_metric_like_values_equal_numpys() -> None:
    rng = np.random.default_rng(3)
    for values in (1 - np.abs(rng.normal(0, 1e-3, 1_000_003)).astype(np.float32),   # cosines near 1
                   np.exp(rng.normal(0, 0.01, 999_999)).astype(np.float32),          # norm ratios
                   np.where(rng.random(500_000) < 0.01, np.nan, rng.random(500_000)).astype(np.float32)):
        assert _same(_quantiles(values, 0.01, 0.5, 0.99), _numpy(values, 0.01, 0.5, 0.99))
    assert _same(_quantiles(np.array([np.nan, np.inf], np.float32), 0.5), [float("nan")])
