"""The row index holds 12 bytes an entry (issue #27): which stream and stored row an entry is are
computed from the streams' row counts, and the labels read only after the alignment (sequence id,
next token, step) are read again from the store. Both must give exactly what the stored labels say,
over several writer groups of different lengths, with label values on both sides of the int32 bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracediff.compare.rows.index import COMPACT_BOUND, RowIndex
from tracediff.errors import UsageError
from tracediff.store import TraceWriter, create_store, open_store


def _store(path: Path, lengths: list[int], huge_step_at: int | None) -> list[dict[str, np.ndarray]]:
    """A store of ``len(lengths)`` writer groups; the labels each was given."""
    rng = np.random.default_rng(len(lengths))
    create_store(path, role="server")
    written = []
    for w, n in enumerate(lengths):
        rows = np.arange(n, dtype=np.int64)
        labels = {"seq": 1000 * w + rows // 37, "position": rows % 37, "token_id": rng.integers(0, 50_000, n),
                  "next_token_id": rng.integers(-1, 50_000, n), "step": 3 * w + rows // 5}
        if huge_step_at is not None and w == 1:
            labels["step"][huge_step_at:] += COMPACT_BOUND  # past the bound from a later chunk on
        writer = TraceWriter(path, "fc_in", f"w{w}", width=8, dtype="float32", chunk_rows=64, compressor="none")
        writer.append(rng.standard_normal((n, 8)).astype(np.float32), labels)
        writer.close()
        written.append(labels)
    return written


@pytest.mark.parametrize("huge_step_at", [None, 0, 4500])
def test_an_entry_names_its_stream_row_and_labels_as_stored(tmp_path: Path, huge_step_at: int | None) -> None:
    lengths = [5000, 9000, 1, 3100]
    written = _store(tmp_path / "s.zarr", lengths, huge_step_at)
    store = open_store(tmp_path / "s.zarr")
    index = RowIndex.load(store, "fc_in")
    assert len(index) == sum(lengths)
    writers = [s.writer for s in index.streams]
    order = [int(w[1:]) for w in writers]  # the streams in the index's order
    want_stream = np.concatenate([np.full(lengths[w], k) for k, w in enumerate(order)])
    want_row = np.concatenate([np.arange(lengths[w]) for w in order])
    assert index.stream.tolist() == want_stream.tolist()
    rng = np.random.default_rng(0)
    for entries in (np.arange(len(index)), rng.integers(0, len(index), 777), np.array([0, len(index) - 1, 5000])):
        assert index.stream_of(entries).tolist() == want_stream[entries].tolist()
        assert index.row_of(entries).tolist() == want_row[entries].tolist()
    # The labels set aside, read again: the stored values, compact where they fit.
    for name in ("seq", "next_token_id", "step"):
        got = index.column(name)
        want = np.concatenate([written[w][name] for w in order])
        assert got.tolist() == want.tolist()
        fits = bool(want.min() >= -COMPACT_BOUND and want.max() < COMPACT_BOUND)
        assert got.dtype == (np.int32 if fits else np.int64)
    # The held columns: the stored labels, each entry its own row's.
    positions = np.concatenate([written[w]["position"] for w in order])
    assert index.position.tolist() == positions.tolist()
    for s in index.streams:  # the compact read gives the int64 read's values
        for name in ("seq", "position", "step"):
            a, b = s.label(name, COMPACT_BOUND), s.label(name)
            assert a.tolist() == b.tolist() and b.dtype == np.int64
            assert a.dtype == (np.int32 if b.min() >= -COMPACT_BOUND and b.max() < COMPACT_BOUND else np.int64)
    held = sum(getattr(index, k).nbytes for k in ("group", "position", "token_id", "phase", "valid"))
    assert held <= 14 * len(index)
    with pytest.raises(UsageError, match="position"):
        index.column("position")
    store.close()


def test_labels_read_through_zarr_compact_like_the_direct_read(tmp_path: Path) -> None:
    """A label array tracediff does not decode itself (another codec: zarr reads it) is compacted after
    the read: the same values and dtypes as the direct, chunk-by-chunk read."""
    _store(tmp_path / "s.zarr", [5000, 9000], 4500)
    store = open_store(tmp_path / "s.zarr")
    for s in store.tap_streams("fc_in"):
        direct = {k: s.label(k, COMPACT_BOUND) for k in ("seq", "position", "step", "phase", "valid")}
        assert s._label_direct  # the store's labels are bytes + zstd: read directly above
        s._label_direct = {}  # as for a store whose label arrays use another codec
        for k, want in direct.items():
            got = s.label(k, COMPACT_BOUND)
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
    store.close()


@pytest.mark.parametrize("sequences", [32_767, 32_768])
def test_group_ids_are_int16_up_to_32767_sequences_and_pair_the_same_either_side(tmp_path: Path, sequences: int) -> None:
    """Sequence group ids are int16 up to 32,767 sequences (2 bytes a row) and int32 past it; either
    way the alignment finds every sequence and pairs every row with its own (a trace against itself,
    one side in engine order)."""
    from tracediff.compare.align.rowpairs import pair_rows
    from tracediff.compare.align.sequences import align_sequences

    n = sequences * 5
    rows = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(sequences)
    labels = {"seq": rows // 5, "position": rows % 5, "token_id": rng.integers(0, 1 << 20, n),
              "next_token_id": np.full(n, -1), "step": np.zeros(n, dtype=np.int64)}
    # The engine side: every sequence's first position, then every second... (interleaved, each
    # sequence's rows still in order, as an engine records them).
    for name, order in (("ref", rows), ("cand", np.lexsort((rows // 5, rows % 5)))):
        create_store(tmp_path / f"{name}.zarr", role="trainer")
        writer = TraceWriter(tmp_path / f"{name}.zarr", "fc_in", "w0", width=4, dtype="float32", chunk_rows=1 << 14,
                             compressor="none")
        writer.append(np.zeros((n, 4), np.float32), {k: v[order] for k, v in labels.items()})
        writer.close()
    ref, cand = (RowIndex.load(open_store(tmp_path / f"{name}.zarr"), "fc_in") for name in ("ref", "cand"))
    for index in (ref, cand):
        assert index.group.dtype == (np.int16 if sequences < (1 << 15) else np.int32)
        assert len(index.group_keys) == sequences and int(index.group.max()) == sequences - 1
        assert index.split_sequences == 0
    pairs = pair_rows(align_sequences(ref, cand), 0)
    assert len(pairs) == n and pairs.replicas == 0 and pairs.duplicates == 0
    seq_of = [index.column("seq") for index in (ref, cand)]
    np.testing.assert_array_equal(seq_of[0][pairs.reference], seq_of[1][pairs.candidate])
    np.testing.assert_array_equal(ref.position[pairs.reference], cand.position[pairs.candidate])
