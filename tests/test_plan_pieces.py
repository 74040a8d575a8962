"""The plan's sample statistics computed a few rows or columns at a time (to keep their temporaries in
the CPU's cache: issue #27) against the same statistics on the whole sample at once, bit for bit: a
plan's decisions and every number a report shows must not move with the batch size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracediff.compare.segments as segments


def _sample(seed: int, n: int, k: int, size: int, holes: int) -> tuple[np.ndarray, np.ndarray]:
    """Paired rows with massive activations (a few dimensions ~300x the rest), bf16-like noise
    between the sides, and ``holes`` non-finite segments on either side."""
    rng = np.random.default_rng(seed)
    scale = np.ones(k * size, np.float32)
    scale[rng.choice(k * size, max(1, size // 32), replace=False)] = 300.0
    r = (rng.standard_normal((n, k * size)) * scale).astype(np.float32)
    c = (r * (1 + rng.standard_normal(r.shape) * 2.0**-8)).astype(np.float32)
    for _ in range(holes):
        side = c if rng.random() < 0.5 else r
        row, seg = int(rng.integers(n)), int(rng.integers(k))
        side[row, seg * size + int(rng.integers(size))] = rng.choice([np.nan, np.inf, -np.inf])
    for a in (c, r):
        a.flags.writeable = False
    return c, r


def _matrices(c: np.ndarray, r: np.ndarray, size: int) -> list[np.ndarray]:
    cs, rs = segments._segment_scales(c, size, 2.0**-8), segments._segment_scales(r, size, 2.0**-8)
    return [segments.standardised_cosine_matrix(c, r, cs, rs), segments.mismatched_rows_matrix(c, r, cs, rs),
            segments.segment_cosine_matrix(c, r, size), segments.segment_cosine_matrix(c, r, size, centred=True)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 600), k=st.integers(1, 4),
       size=st.sampled_from([1, 3, 16, 64, 200]), holes=st.integers(0, 6), work=st.integers(1, 1 << 16))
def test_cosine_matrices_a_few_rows_at_a_time_equal_whole_chunks(
    seed: int, n: int, k: int, size: int, holes: int, work: int
) -> None:
    c, r = _sample(seed, n, k, size, holes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "_WORK_BYTES", 1 << 40)  # 256 rows at once, as before issue #27's change
        whole = _matrices(c, r, size)
        mp.setattr(segments, "_WORK_BYTES", work)  # from one row at a time up
        pieces = _matrices(c, r, size)
    for a, b in zip(whole, pieces, strict=True):
        np.testing.assert_array_equal(a, b)  # NaN where NaN, every other entry the same bits


def test_cosine_matrices_of_a_wide_sample_equal_whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's own shape: 2048 rows of 3 x 4096 (each temporary 12 MiB whole, 0.5 MiB in pieces)."""
    c, r = _sample(7, 2048, 3, 4096, 4)
    monkeypatch.setattr(segments, "_WORK_BYTES", 1 << 40)
    whole = _matrices(c, r, 4096)
    monkeypatch.undo()
    for a, b in zip(whole, _matrices(c, r, 4096), strict=True):
        np.testing.assert_array_equal(a, b)
