"""The writer's direct path: an uncompressed local store's chunk files are written by tracediff
itself, not by zarr, and must be exactly the files zarr writes for the same rows.

The oracle is zarr: the arrays' own metadata (what the writer created) copied into a fresh folder,
the whole data assigned through zarr in one go, and every chunk file compared byte for byte. Then
plain zarr and tracediff's reader read the direct store back, after every batch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import read_plain

import tracediff.store.writer as writer_module
from tracediff.store import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_LABEL_CHUNK_ROWS,
    LABEL_FIELDS,
    TraceStore,
    TraceWriter,
    create_store,
    encode_bfloat16,
)
from tracediff.store.format import LABEL_DTYPES

CHUNK_ROWS = 64
SIZES = {
    "aligned": [64, 128, 64, 192],
    "mid_chunk": [1, 63, 65, 200, 7, 1, 64, 3],
    "crosses_label_chunks": [4000, 200, 5000, 1],
}


def rows_of(batch: int, n: int, width: int, dtype: str) -> np.ndarray:
    """Random rows of batch ``batch`` in the store dtype (bf16 as its bits); zeros in some rows, so a
    chunk that is all fill value is written too."""
    rows = np.random.default_rng(batch).standard_normal((n, width), dtype=np.float32)
    rows[::5] = 0.0
    return encode_bfloat16(rows) if dtype == "bfloat16" else rows.astype(dtype)


def labels_of(batch: int, first_row: int, n: int) -> dict[str, np.ndarray]:
    positions = np.arange(first_row, first_row + n)
    return {
        "seq": np.full(n, batch),
        "position": positions,
        "token_id": positions * 7 % 1000,
        "next_token_id": (positions * 7 + 1) % 1000,
        "step": np.full(n, batch),
        "phase": np.full(n, 2 + batch % 3, dtype=np.int8),
        "valid": positions % 3 != 1,
    }


class ChunkFileCounter:
    """Counts the chunk files the direct path writes (it still writes them: this only watches)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[Path] = []
        put = writer_module._put_chunk

        def counted(path: Path, data) -> None:
            self.files.append(path)
            put(path, data)

        monkeypatch.setattr(writer_module, "_put_chunk", counted)


def zarr_oracle(store: Path, writer: str, values: np.ndarray, labels: dict[str, np.ndarray], into: Path) -> Path:
    """The same arrays (their zarr.json copied from ``store``) written whole by zarr itself."""
    group = into / "fc_in" / writer
    for name in ("values", *LABEL_FIELDS):
        (group / name).mkdir(parents=True)
        shutil.copy(store / "fc_in" / writer / name / "zarr.json", group / name / "zarr.json")
    zarr.open_array(str(group / "values"), mode="r+")[:] = values
    for name, column in labels.items():
        zarr.open_array(str(group / name), mode="r+")[:] = column
    return group


def chunk_files(group: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(group)): p.read_bytes()
        for p in sorted(group.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", sorted(SIZES))
def test_direct_chunk_files_are_the_bytes_zarr_writes_and_every_reader_sees_each_committed_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, layout: str
) -> None:
    counter = ChunkFileCounter(monkeypatch)
    store = create_store(tmp_path / "direct.zarr")
    width, sizes = 8, SIZES[layout]
    w = TraceWriter(store, "fc_in", "w0", width=width, dtype=dtype, chunk_rows=CHUNK_ROWS)
    values = np.empty((0, width), dtype=rows_of(0, 1, width, dtype).dtype)
    labels: dict[str, np.ndarray] = {name: np.empty(0, LABEL_DTYPES[name]) for name in LABEL_FIELDS}
    for batch, n in enumerate(sizes):
        new_values, new_labels = rows_of(batch, n, width, dtype), labels_of(batch, values.shape[0], n)
        w.append(new_values, new_labels)
        values = np.concatenate([values, new_values])
        labels = {name: np.concatenate([labels[name], new_labels[name].astype(LABEL_DTYPES[name])]) for name in labels}
        # After every batch, a batch that ended mid-chunk included: plain zarr and tracediff's reader
        # see exactly the committed rows.
        plain = read_plain(store, "fc_in")["w0"]
        assert np.array_equal(plain.values, values) and plain.values.dtype == values.dtype
        assert all(np.array_equal(plain.labels[name], labels[name]) for name in LABEL_FIELDS)
        with TraceStore(store) as opened:
            (stream,) = opened.streams["fc_in"]
            assert stream.rows == values.shape[0]
            assert np.array_equal(stream.read(), values)
            assert np.array_equal(np.concatenate([stream.read_chunk(i) for i in range(stream.chunks)]), values)
            assert all(np.array_equal(column, labels[name]) for name, column in stream.labels().items())
    w.close()

    # Every chunk went through the direct path: each values chunk once per batch that touched it.
    ends = np.cumsum([0, *sizes])
    touched = sum(
        -(-int(stop) // CHUNK_ROWS) - int(start) // CHUNK_ROWS for start, stop in zip(ends[:-1], ends[1:], strict=True)
    )
    assert sum(1 for path in counter.files if path.parent.parent.parent.name == "values") == touched
    oracle = zarr_oracle(store, "w0", values, labels, tmp_path / "oracle.zarr")
    written, expected = chunk_files(store / "fc_in" / "w0"), chunk_files(oracle)
    assert written.keys() == expected.keys()
    assert [name for name in written if written[name] != expected[name]] == []
    assert not list(store.rglob("*.partial"))


def test_a_store_with_chunks_of_a_mebibyte_or_more_writes_back_each_batch_and_reads_unchanged(
    tmp_path: Path,
) -> None:
    # 1024 x 512 bf16 rows: 1 MiB chunks, whose pages a writer that is not durable drops per batch.
    store = create_store(tmp_path / "big.zarr")
    width, sizes = 512, [1500, 548, 1024, 10]
    w = TraceWriter(store, "fc_in", "w0", width=width, dtype="bfloat16")
    assert w.chunk_rows == DEFAULT_CHUNK_ROWS == 1024
    parts = [rows_of(i, n, width, "bfloat16") for i, n in enumerate(sizes)]
    first = 0
    for i, part in enumerate(parts):
        w.append(part, labels_of(i, first, part.shape[0]))
        first += part.shape[0]
    w.close()
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert np.array_equal(stream.read(), np.concatenate(parts))
        assert stream.commit["status"] == "closed" and stream.commit["rows"] == sum(sizes)


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
def test_a_compressed_store_keeps_zarrs_write_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compressor: str
) -> None:
    counter = ChunkFileCounter(monkeypatch)
    store = create_store(tmp_path / "packed.zarr")
    w = TraceWriter(store, "fc_in", "w0", width=8, dtype="float32", chunk_rows=CHUNK_ROWS, compressor=compressor)
    parts = [rows_of(i, n, 8, "float32") for i, n in enumerate([70, 5, 200])]
    first = 0
    for i, part in enumerate(parts):
        w.append(part, labels_of(i, first, part.shape[0]))
        first += part.shape[0]
    w.close()
    assert counter.files == []
    assert np.array_equal(read_plain(store, "fc_in")["w0"].values, np.concatenate(parts))


def test_a_failed_direct_batch_leaves_the_committed_rows_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real write, failing as a full disk fails it: after part of the batch's files are written.
    store = create_store(tmp_path / "s.zarr")
    w = TraceWriter(store, "fc_in", "w0", width=8, dtype="float16", chunk_rows=CHUNK_ROWS)
    kept = rows_of(0, 100, 8, "float16")
    w.append(kept, labels_of(0, 0, 100))
    put, calls = writer_module._put_chunk, []

    def full_after_two(path: Path, data) -> None:
        calls.append(path)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        put(path, data)

    monkeypatch.setattr(writer_module, "_put_chunk", full_after_two)
    with pytest.raises(Exception, match="No space left on device"):
        w.append(rows_of(1, 300, 8, "float16"), labels_of(1, 100, 300))
    monkeypatch.setattr(writer_module, "_put_chunk", put)
    w.close()
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.commit["status"] == "failed" and stream.rows == 100
        assert np.array_equal(stream.read(), kept)
    assert np.array_equal(read_plain(store, "fc_in")["w0"].values, kept)
    assert not list(store.rglob("*.partial"))
    # The failed batch's chunks past the committed rows are gone (their space is the disk's again).
    assert sorted(p.name for p in (store / "fc_in" / "w0" / "values" / "c").iterdir()) == ["0", "1"]
    assert DEFAULT_LABEL_CHUNK_ROWS > 400  # one label chunk: replaced whole or not at all
