"""The order in which a compare reads the two sides' label columns (issue #27): the light ones
(chunks that zstd undoes faster than the Python work around each) one after the other first, the
rest of both sides at once. What is read, the indexes built and the errors raised are those of
loading each side on its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracediff.compare import compare_stores
from tracediff.compare.rows.index import RowIndex
from tracediff.compare.run import _load_indexes
from tracediff.errors import CorruptStoreError
from tracediff.store import DEFAULT_LABEL_CHUNK_ROWS, TraceStore, TraceWriter, create_store
from tracediff.store.pack import pack_store

ROWS = 3 * DEFAULT_LABEL_CHUNK_ROWS + 100  # three whole label chunks and part of a fourth


def _store(path: Path, seed: int) -> Path:
    """Rows of 3 x 4 float32 values: token ids drawn at random (chunks zstd barely shrinks), the
    sequence, phase and valid columns constant over long runs (chunks of a few dozen bytes)."""
    rng = np.random.default_rng(seed)
    create_store(path)
    w = TraceWriter(path, "fc_in", "rank0", width=12, dtype="float32", chunk_rows=1024)
    tokens = rng.integers(0, 150_000, ROWS, dtype=np.int64)
    next_tokens = np.r_[tokens[1:], -1]
    for a in range(0, ROWS, 5000):
        b = min(ROWS, a + 5000)
        w.append(rng.standard_normal((b - a, 12), dtype=np.float32), {
            "seq": np.full(b - a, 0, dtype=np.int64), "position": np.arange(a, b, dtype=np.int64),
            "token_id": tokens[a:b], "next_token_id": next_tokens[a:b],
            "step": np.full(b - a, a // 5000, dtype=np.int64), "phase": np.zeros(b - a, dtype=np.int8)})
    w.close()
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("label_order")
    return _store(root / "a.zarr", 0), _store(root / "b.zarr", 1)


def test_light_labels_are_the_columns_compressed_far_below_their_size(stores: tuple[Path, Path]) -> None:
    """Classified from the bytes each column's chunk files hold (checked when the store opens): the
    constant columns are light, the random token ids are not; a packed (zip) store, read through
    zarr, has none."""
    stream = TraceStore(stores[0]).tap_streams("fc_in")[0]
    assert {"seq", "phase", "valid"} <= stream.light_labels
    assert "token_id" not in stream.light_labels and "next_token_id" not in stream.light_labels
    zipped = pack_store(stores[0], stores[0].with_suffix(".zarr.zip"))
    assert TraceStore(zipped).tap_streams("fc_in")[0].light_labels == frozenset()


def test_the_indexes_loaded_light_columns_first_are_each_sides_own(stores: tuple[Path, Path]) -> None:
    ref, cand = TraceStore(stores[0]), TraceStore(stores[1])
    light = RowIndex.light_labels(ref, "fc_in")
    assert {k for _, k in light} == {"seq", "phase", "valid"}
    got = _load_indexes(ref, "fc_in", cand, "fc_in")
    for index, store in zip(got, (ref, cand), strict=True):
        want = RowIndex.load(store, "fc_in")
        for name in ("group", "position", "token_id", "phase", "valid", "offsets"):
            a, b = getattr(index, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert index.group_keys == want.group_keys
        assert np.array_equal(index.column("next_token_id"), want.column("next_token_id"))


def _break(store: Path, label: str) -> Path:
    """Chunk 1 of ``label``: a file that is not a zstd frame (caught when the column is read)."""
    chunk = store / "fc_in" / "rank0" / label / "c" / "1"
    chunk.write_bytes(b"not a zstd frame")
    return chunk


@pytest.mark.parametrize("broken", [("ref:token_id", "cand:phase"), ("cand:phase",), ("ref:phase",), ("cand:token_id",)])
def test_the_reference_error_comes_first_whatever_the_read_order(tmp_path: Path, broken: tuple[str, ...]) -> None:
    """A broken light column of the candidate is read before a broken heavy column of the
    reference, yet the compare raises the reference's error, as when each side loaded on its own;
    a side broken alone is named, in one line."""
    paths = {"ref": _store(tmp_path / "ref.zarr", 0), "cand": _store(tmp_path / "cand.zarr", 1)}
    chunks = [_break(paths[side], label) for side, label in (b.split(":") for b in broken)]
    assert TraceStore(paths["cand"]).tap_streams("fc_in")[0].light_labels >= {"phase"}
    with pytest.raises(CorruptStoreError) as caught:
        compare_stores(paths["ref"], paths["cand"])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{chunks[0]}: chunk cannot be decoded"), message
