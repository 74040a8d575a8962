"""The plan's sample statistics computed a few rows or columns at a time (to keep their temporaries in
the CPU's cache: issue #27) against the same statistics on the whole sample at once, bit for bit: a
plan's decisions and every number a report shows must not move with the batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracediff.compare.plan.decide as plan
import tracediff.compare.plan.segments as segments
import tracediff.store.stream as store_stream
from tracediff.compare.rows.index import RowIndex
from tracediff.store import TraceWriter, create_store, open_store


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("compressor", ["none", "zstd"])
def test_sample_rows_read_a_few_at_a_time_are_the_stored_values_widened(
    tmp_path: Path, dtype: str, compressor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_rows` of any rows, in any order, from real stores (uncompressed chunk files are read row
    by row through a staging buffer a few rows at a time; compressed chunks are decoded whole): the
    stored values widened to float32 exactly, as one gather of every row then widened."""
    rng = np.random.default_rng(5)
    path = tmp_path / f"{dtype}-{compressor}.zarr"
    create_store(path, role="trainer")
    n, width = 700, 96
    values = (rng.standard_normal((n, width)) * 40).astype(np.float32)
    values[3, 5], values[9, 0], values[11, 7] = np.nan, np.inf, -np.inf
    stored = (values.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else values.astype(dtype)
    for w, part in enumerate((slice(0, 300), slice(300, n))):  # two writer groups: rows of two streams
        writer = TraceWriter(path, "fc_in", f"w{w}", width=width, dtype=dtype, chunk_rows=64, compressor=compressor)
        rows = np.arange(n)[part]
        writer.append(stored[part], {"seq": rows // 50, "position": rows % 50, "token_id": rows % 97})
        writer.close()
    store = open_store(path)
    index = RowIndex.load(store, "fc_in")
    assert index.streams[0].reads_rows_directly == (compressor == "none")
    if dtype == "bfloat16":
        expected_all = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        expected_all = stored.astype(np.float32)
    # Each index entry's stored row, found by its labels (the index orders rows its own way).
    where = {(int(s), int(p)): i for i, (s, p) in enumerate(zip(np.arange(n) // 50, np.arange(n) % 50, strict=True))}
    by_entry = np.array([where[(int(s), int(p))] for s, p in zip(index.column("seq"), index.position, strict=True)])
    for stage in (1, 200, 1000, 1 << 19):  # one row at a time, a few, all at once
        monkeypatch.setattr(plan, "_STAGE_BYTES", stage)
        monkeypatch.setattr(store_stream, "_SCATTER_BYTES", stage)  # out-of-order rows put in place as many at a time
        for rows in (np.arange(len(index)), rng.permutation(len(index))[:333], np.array([5, 5, 699, 0, 5])):
            got = plan.read_rows(index, rows)
            assert got.dtype == np.float32 and got.shape == (rows.size, width) and not got.flags.writeable
            np.testing.assert_array_equal(got.view(np.uint32), expected_all[by_entry[rows]].view(np.uint32))
            # Into a reused buffer (the offset search's): the same values, a read-only view of it.
            into = np.full((rows.size + 3, width), np.nan, dtype=np.float32)
            for again in (rows[::-1].copy(), rows):
                got = plan.read_rows(index, again, into)
                assert np.shares_memory(got, into) and got.shape == (again.size, width) and not got.flags.writeable
                np.testing.assert_array_equal(got.view(np.uint32), expected_all[by_entry[again]].view(np.uint32))
                del got
    store.close()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), cols=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       chunk=st.sampled_from([1, 7, 4096, 1 << 16]))
def test_noise_draws_a_piece_at_a_time_are_the_whole_draw(rows: int, cols: int, seed: int, chunk: int) -> None:
    """The noise floor's uniform numbers drawn a piece at a time are the 24 low bits of one whole
    draw of the seeded Mersenne Twister, times 2**-24 (the numbers every noise floor was made of)."""
    raw = np.random.RandomState(seed)._bit_generator.random_raw(rows * cols)
    whole = ((raw & 0xFFFFFF).astype(np.float32) * np.float32(2.0**-24)).reshape(rows, cols)
    old = segments._UNIFORM_CHUNK
    segments._UNIFORM_CHUNK = chunk
    try:
        got = segments._uniform((rows, cols), seed)
    finally:
        segments._UNIFORM_CHUNK = old
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_array_equal(got.view(np.uint32), whole.view(np.uint32))


def _lower_middle(x: np.ndarray) -> np.ndarray:
    """Each column's lower middle value, by a whole sort (what the selections must equal)."""
    return np.sort(x, axis=0)[(x.shape[0] - 1) // 2]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 700), k=st.integers(1, 3),
       size=st.sampled_from([1, 5, 64, 129, 300]), kind=st.sampled_from(["normal", "massive", "ties", "half"]),
       columns=st.sampled_from([1, 7, 128]), tile=st.sampled_from([1, 3, 16]))
def test_column_medians_and_spreads_by_selection_are_a_sorts_middle_values(
    seed: int, n: int, k: int, size: int, kind: str, columns: int, tile: int
) -> None:
    """The scales' median and MAD of each column of a segment (a strided view of the sample),
    selected a few columns and rows at a time, are the sort's lower middle values, bit for bit
    (signed zeros, ties, massive activations and float16-rounded values included)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k * size)).astype(np.float32)
    if kind == "massive":
        x[:, rng.choice(k * size, max(1, k * size // 16), replace=False)] *= 500
    elif kind == "ties":
        x = (np.round(x * 2) / 2).astype(np.float32)
        x[rng.random(x.shape) < 0.3] = -0.0
    elif kind == "half":
        x = x.astype(np.float16).astype(np.float32)
    seg = segments.split(x, size)[:, k - 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "_MEDIAN_COLUMNS", columns)
        mp.setattr(segments, "_TILE_ROWS", tile)
        med, spread = segments._medians_and_spreads(seg)
    want_med = _lower_middle(seg)
    want_spread = _lower_middle(np.abs(seg - want_med))
    # The same values; a signed zero compares equal to its other sign (a sort may put either first).
    np.testing.assert_array_equal(med, want_med)
    np.testing.assert_array_equal(spread, want_spread)
    assert med.dtype == spread.dtype == np.float32


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), k=st.integers(1, 3),
       size=st.sampled_from([1, 2, 5, 64, 300]), rows=st.sampled_from([1, 2, 8, 1000]))
def test_mean_squares_a_few_rows_at_a_time_are_numpys_bits(
    seed: int, n: int, k: int, size: int, rows: int
) -> None:
    """The scales' mean square of each column, summed a few rows at a time, is the same bits as
    ``np.mean(np.square(x), axis=0, dtype=np.float32)`` of the whole segment."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, k * size)) * rng.choice([1.0, 300.0], k * size)).astype(np.float32)
    seg = segments.split(x, size)[:, k - 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "_SQUARE_ROWS", rows)
        got = segments._mean_square(seg)
    want = np.mean(np.square(seg), axis=0, dtype=np.float32)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_cosine_matrices_are_the_float64_cosines_within_float32_rounding() -> None:
    """The plan's matrices (float32 cosines of each row, summed in float64) against the same
    cosines computed in float64: within float32 rounding, and 1 (within it) for a segment paired
    with itself."""
    c, r = _sample(3, 300, 3, 256, 0)
    size = 256
    got = segments.segment_cosine_matrix(c, r, size)
    c64, r64 = segments.split(c, size).astype(np.float64), segments.split(r, size).astype(np.float64)
    cu = c64 / np.linalg.norm(c64, axis=2, keepdims=True)
    ru = r64 / np.linalg.norm(r64, axis=2, keepdims=True)
    want = np.einsum("nkh,njh->kj", cu, ru) / c.shape[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    same = segments.segment_cosine_matrix(r, r, size)
    np.testing.assert_allclose(np.diag(same), 1.0, rtol=0, atol=2e-6)
