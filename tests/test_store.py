"""Trace store format 1: what a writer commits is exactly what a reader (tracediff's or plain zarr's) sees.

Real zarr folders and zip files in tmp_path; torch is the oracle for bfloat16 rounding.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import read_plain, run_tracediff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracediff.errors import CorruptStoreError, StoreExistsError, UsageError
from tracediff.store import (
    LABEL_FIELDS,
    TraceStore,
    TraceWriter,
    create_store,
    decode_values,
    encode_bfloat16,
    pack_store,
)
from tracediff.store.files import ChunkFiles


def _batch(first_row: int, rows: int, width: int, dtype: str) -> np.ndarray:
    """Rows whose every value names its global row index: any misplaced row is visible."""
    base = np.arange(first_row, first_row + rows, dtype=np.float32)[:, None] + np.linspace(0, 0.5, width)[None, :]
    base = base.astype(np.float32)
    return encode_bfloat16(base) if dtype == "bfloat16" else base.astype(dtype)


def _labels(first_row: int, rows: int, seq: int) -> dict[str, np.ndarray]:
    return {
        "seq": np.full(rows, seq, dtype=np.int64),
        "position": np.arange(first_row, first_row + rows, dtype=np.int64),
        "token_id": np.arange(rows, dtype=np.int64) * 7,
        "step": np.full(rows, seq, dtype=np.int64),
        "phase": np.full(rows, 2, dtype=np.int8),
    }


def _write(
    path: Path,
    tap: str,
    writer: str,
    sizes: list[int],
    *,
    width: int = 8,
    dtype: str = "float32",
    chunk_rows: int = 4,
    close: bool = True,
) -> TraceWriter:
    w = TraceWriter(path, tap, writer, width=width, dtype=dtype, chunk_rows=chunk_rows)
    row = 0
    for i, n in enumerate(sizes):
        w.append(_batch(row, n, width, dtype), _labels(row, n, i))
        row += n
    if close:
        w.close()
    return w


# ---------------------------------------------------------------------------------------- bfloat16
def test_bfloat16_encoding_rounds_like_torch_bit_for_bit() -> None:
    import torch  # noqa: PLC0415  (only here: the spawned writers of this module must start fast)

    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 38, 20000),
            np.array(
                [
                    0.0,
                    -0.0,
                    np.inf,
                    -np.inf,
                    1.0 + 2**-8,
                    1.0 + 3 * 2**-8,
                    3.3895314e38,
                    3.4028235e38,
                    1e-45,
                    -1e-45,
                    1.1754942e-38,
                ],
                dtype=np.float32,
            ),
        ]
    ).astype(np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(encode_bfloat16(values), expected)
    nan = encode_bfloat16(np.array([np.nan], dtype=np.float32))
    assert np.isnan(decode_values(nan, "bfloat16")).all()


def test_bfloat16_decodes_to_the_exact_float32_torch_widens_to() -> None:
    import torch  # noqa: PLC0415

    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)  # every bf16 value
    widened = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    decoded = decode_values(bits, "bfloat16")
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded.view(np.uint32), widened.view(np.uint32))


def test_bfloat16_rows_round_trip_bit_exact_and_are_stored_as_uint16_bits(tmp_path: Path) -> None:
    import torch  # noqa: PLC0415

    store = create_store(tmp_path / "s.zarr", role="unit")
    tensor = torch.randn(37, 24).to(torch.bfloat16)
    bits = tensor.view(torch.int16).numpy().view(np.uint16)
    w = TraceWriter(store, "fc_in", "w0", width=24, dtype="bfloat16", chunk_rows=8, compressor="lz4")
    w.append(bits[:10], {})
    w.append(bits[10:], {})
    w.close()
    plain = read_plain(store, "fc_in")["w0"]
    assert plain.values.dtype == np.uint16 and plain.attrs["dtype"] == "bfloat16"
    assert np.array_equal(plain.values, bits)
    with TraceStore(store) as opened:
        stream = opened.streams["fc_in"][0]
        assert np.array_equal(stream.read(), bits)
        assert torch.equal(torch.from_numpy(stream.read_float32()), tensor.float())


# ----------------------------------------------------------------------------------- round trips
@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Chunks of 3 and 7 rows make batches smaller than, equal to and across chunk boundaries common.
    sizes=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=5),
    chunk_rows=st.sampled_from([3, 7, 64]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    close=st.booleans(),
)
def test_any_sequence_of_batch_sizes_round_trips(sizes: list[int], chunk_rows: int, dtype: str, close: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = create_store(Path(tmp) / "s.zarr")
        _write(store, "t", "w", sizes, width=5, dtype=dtype, chunk_rows=chunk_rows, close=close)
        total = sum(sizes)
        expected = _batch(0, total, 5, dtype)
        seq = np.repeat(np.arange(len(sizes)), sizes)
        with TraceStore(store) as opened:
            stream = opened.streams["t"][0]
            assert stream.rows == total
            assert stream.commit["batches"] == sum(1 for n in sizes if n)
            assert stream.commit["status"] == ("closed" if close else "recording")
            assert np.array_equal(stream.read(), expected)
            labels = stream.labels()
            assert np.array_equal(labels["seq"], seq)
            assert np.array_equal(labels["position"], np.arange(total))
            assert labels["next_token_id"].tolist() == [-1] * total  # not given: the documented fill
            assert labels["valid"].all()
        plain = read_plain(store, "t")["w"]
        assert np.array_equal(plain.values, expected)


def test_rows_past_the_commit_record_are_invisible(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr")
    _write(store, "t", "w", [5, 3], chunk_rows=4, close=False)
    # A batch killed halfway: capacity grown, its chunks and labels on disk, the commit still 8 rows.
    group = zarr.open_group(str(store), mode="r+")["t/w"]
    group["values"].resize((16, 8))
    group["values"][8:16] = np.full((8, 8), -1.0, dtype=np.float32)
    group["seq"][8:16] = 99
    with TraceStore(store) as opened:
        stream = opened.streams["t"][0]
        assert stream.rows == 8 and stream.nbytes == 8 * 8 * 4
        assert stream.read().shape == (8, 8) and (stream.read() >= 0).all()
        assert stream.read(6, 100).shape == (2, 8)
        assert 99 not in stream.label("seq")
        assert [start for start, _ in stream.iter_chunks()] == [0, 4]
        assert all((block >= 0).all() for _, block in stream.iter_chunks())
    assert read_plain(store, "t")["w"].values.shape == (8, 8)


def test_rejected_batch_leaves_committed_rows_and_the_next_batch_intact(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr")
    w = TraceWriter(store, "t", "w", width=2, dtype="float32", chunk_rows=4)
    w.append(np.full((2, 2), 1.0, np.float32), {})
    with pytest.raises(UsageError, match="label 'seq' has 2 entries for 3 rows"):
        w.append(np.full((3, 2), 2.0, np.float32), {"seq": np.arange(2)})
    with pytest.raises(UsageError, match="label 'seq' is not int64"):
        w.append(np.full((3, 2), 2.0, np.float32), {"seq": np.array(["a", "b", "c"])})
    with pytest.raises(UsageError, match="does not match width 2"):
        w.append(np.full((3, 5), 2.0, np.float32), {})
    with pytest.raises(UsageError, match="not the store dtype"):
        w.append(np.full((3, 2), 2.0, np.float64), {})
    w.append(np.full((3, 2), 3.0, np.float32), {})
    w.close()
    with TraceStore(store) as opened:
        stream = opened.streams["t"][0]
        assert stream.commit["batches"] == 2
        assert stream.read()[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]


def test_store_records_format_source_and_meta_at_its_root(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr", role="trainer", meta={"hidden_size": np.int64(64), "layers": (1, 2)})
    root = json.loads((store / "zarr.json").read_text())["attributes"]
    assert root["tracediff"]["format"] == 1
    assert root["source"]["role"] == "trainer" and isinstance(root["source"]["pid"], int)
    assert root["meta"] == {"hidden_size": 64, "layers": [1, 2]}


# ------------------------------------------------------------------------------------- zip stores
@pytest.mark.parametrize("via", ["api", "cli"])
def test_packed_zip_store_reads_like_the_folder(tmp_path: Path, via: str) -> None:
    store = create_store(tmp_path / "s.zarr", role="unit")
    _write(store, "fc_in", "w0", [7, 9], dtype="bfloat16", chunk_rows=4)
    _write(store, "fc_in", "w1", [3])
    if via == "api":
        packed = pack_store(store, tmp_path / "s.zarr.zip")
    else:
        result = run_tracediff("pack", store)
        assert result.returncode == 0, result.stderr
        packed = Path(result.stdout.strip())
    assert packed == tmp_path / "s.zarr.zip" and packed.is_file()
    assert not list(tmp_path.glob("*.partial"))
    with TraceStore(store) as folder, TraceStore(packed) as zipped:
        assert zipped.taps == folder.taps == ["fc_in"]
        for a, b in zip(folder.streams["fc_in"], zipped.streams["fc_in"], strict=True):
            assert (a.writer, a.rows, a.dtype) == (b.writer, b.rows, b.dtype)
            assert np.array_equal(a.read(), b.read())
            for name in LABEL_FIELDS:
                assert np.array_equal(a.label(name), b.label(name))
    with pytest.raises(StoreExistsError, match="already exists"):
        pack_store(store, packed)


def test_zip_store_refuses_to_be_recorded_into(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="read-only"):
        create_store(tmp_path / "s.zarr.zip")
    assert not (tmp_path / "s.zarr.zip").exists()


# --------------------------------------------------------------------------------- concurrency
def test_two_writers_in_one_process_append_to_one_store_concurrently(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr")
    sizes = {"a": [5, 17, 1, 30, 2] * 4, "b": [9, 3, 64, 8] * 5}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            _write(store, "fc_in", name, sizes[name], chunk_rows=8)
        except BaseException as exc:  # noqa: BLE001  (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    groups = read_plain(store, "fc_in")
    assert sorted(groups) == ["a", "b"]
    for name, group in groups.items():
        assert group.rows == sum(sizes[name])
        assert np.array_equal(group.values, _batch(0, sum(sizes[name]), 8, "float32"))


def _write_in_child(store: str, writer: str, sizes: list[int], ready, go) -> None:
    ready.set()
    go.wait(30)
    _write(Path(store), "fc_in", writer, sizes, chunk_rows=8)


@pytest.mark.slow
def test_two_processes_append_to_one_store_concurrently(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr", role="server", meta={"model": "tiny"})
    ctx = multiprocessing.get_context("spawn")
    sizes = {"rank0": [11, 40, 3] * 4, "rank1": [1, 2, 70] * 4}
    ready = {n: ctx.Event() for n in sizes}
    go = ctx.Event()
    procs = [ctx.Process(target=_write_in_child, args=(str(store), n, s, ready[n], go)) for n, s in sizes.items()]
    for p in procs:
        p.start()
    for event in ready.values():
        assert event.wait(60)
    go.set()  # both create their tap and writer groups at the same moment
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    groups = read_plain(store, "fc_in")
    assert sorted(groups) == sorted(sizes)
    for name, group in groups.items():
        assert group.commit["status"] == "closed"
        assert np.array_equal(group.values, _batch(0, sum(sizes[name]), 8, "float32"))
    with TraceStore(store) as opened:  # the root attributes survived both writers
        assert opened.source["role"] == "server" and opened.meta == {"model": "tiny"}


def test_a_second_writer_of_the_same_name_gets_its_own_group(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr")
    first = _write(store, "t", "pid7", [2])
    second = _write(store, "t", "pid7", [3])
    assert (first.writer, second.writer) == ("pid7", "pid7_2")
    assert {k: g.rows for k, g in read_plain(store, "t").items()} == {"pid7": 2, "pid7_2": 3}


# ------------------------------------------------------------------------------ labels and reads
def test_string_sequence_keys_get_stable_ids_listed_in_seq_names(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr")
    w = TraceWriter(store, "t", "w", width=2, dtype="float32")
    for keys in (["req-a", "req-b", "req-a"], ["req-c", "req-b"]):
        ids = np.array([w.seq_id(k) for k in keys], dtype=np.int64)
        w.append(np.zeros((len(keys), 2), np.float32), {"seq": ids})
    assert w.seq_id(41) == 41  # integer keys pass through
    w.close()
    with TraceStore(store) as opened:
        stream = opened.streams["t"][0]
        names = stream.seq_names
        assert names == {0: "req-a", 1: "req-b", 2: "req-c"}
        assert [names[i] for i in stream.label("seq")] == ["req-a", "req-b", "req-a", "req-c", "req-b"]


@pytest.mark.parametrize("batch_rows", [None, 1, 10, 16, 1000])
def test_iter_chunks_reads_bounded_chunk_aligned_batches(tmp_path: Path, batch_rows: int | None) -> None:
    store = create_store(tmp_path / "s.zarr")
    _write(store, "t", "w", [13, 29, 5], chunk_rows=8)
    with TraceStore(store) as opened:
        stream = opened.streams["t"][0]
        parts = list(stream.iter_chunks(batch_rows))
    bound = max(8, ((batch_rows or 8) // 8) * 8)
    assert all(start % 8 == 0 for start, _ in parts)
    assert all(len(block) <= bound for _, block in parts)
    assert [start for start, _ in parts] == list(range(0, 47, bound))
    assert np.array_equal(np.concatenate([block for _, block in parts]), _batch(0, 47, 8, "float32"))


# ------------------------------------------------------------------------------- create / replace
def test_create_store_refuses_an_existing_store_without_overwrite(tmp_path: Path) -> None:
    store = create_store(tmp_path / "s.zarr", role="old")
    before = (store / "zarr.json").read_bytes()
    with pytest.raises(StoreExistsError, match="already exists; pass --overwrite"):
        create_store(store, role="new")
    assert (store / "zarr.json").read_bytes() == before
    create_store(store, role="new", overwrite=True)
    with TraceStore(store) as opened:
        assert opened.source["role"] == "new" and opened.taps == []


def test_overwrite_never_deletes_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    with pytest.raises(StoreExistsError, match="not a tracediff store; refusing to delete it"):
        create_store(folder, overwrite=True)
    assert (folder / "thesis.tex").read_text() == "precious"


def test_joining_keeps_a_store_and_refuses_a_folder_that_is_not_one(tmp_path: Path) -> None:
    """``join`` (record --append): a store there is kept as it is; a folder holding only what a
    process killed while writing the root left is joined; anything else is refused, untouched."""
    store = create_store(tmp_path / "s.zarr", role="first")
    before = (store / "zarr.json").read_bytes()
    assert create_store(store, role="second", join=True) == store
    assert (store / "zarr.json").read_bytes() == before
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    with pytest.raises(StoreExistsError, match="results: exists and is not a tracediff store; refusing to add to it"):
        create_store(folder, join=True)
    assert [p.name for p in folder.iterdir()] == ["thesis.tex"]
    killed = tmp_path / "k.zarr"
    killed.mkdir()
    (killed / "zarr.0123abcd.partial").write_text("{")
    create_store(killed, role="joined", join=True)
    with TraceStore(killed) as opened:
        assert opened.source["role"] == "joined"


# ------------------------------------------------------------------------------- label fast path
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_labels_read_straight_from_their_chunk_files_equal_what_zarr_reads(tmp_path: Path, dtype: str) -> None:
    """A folder store's zstd label chunks are decoded without zarr's per-chunk machinery: the
    columns must be exactly zarr's, across chunk boundaries and a partial last chunk."""
    create_store(tmp_path / "s.zarr")
    _write(tmp_path / "s.zarr", "fc_in", "rank0", [3000, 5000, 1, 900], dtype=dtype, chunk_rows=256)
    stream = TraceStore(tmp_path / "s.zarr").tap_streams("fc_in")[0]
    assert set(stream._label_direct) == set(LABEL_FIELDS)
    fast = stream.labels()
    via_zarr = {name: np.asarray(zarr.open_array(str(tmp_path / "s.zarr" / "fc_in" / "rank0" / name), mode="r")[
        : stream.rows]) for name in LABEL_FIELDS}
    assert stream.rows == 8901
    for name in LABEL_FIELDS:
        assert fast[name].dtype == via_zarr[name].dtype and np.array_equal(fast[name], via_zarr[name]), name


def test_a_label_chunk_of_the_wrong_length_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    from numcodecs import Zstd

    create_store(tmp_path / "s.zarr")
    _write(tmp_path / "s.zarr", "fc_in", "rank0", [100])
    chunk = tmp_path / "s.zarr" / "fc_in" / "rank0" / "position" / "c" / "0"
    chunk.write_bytes(Zstd().encode(np.arange(10, dtype=np.int64).tobytes()))  # a valid frame, too short
    with pytest.raises(CorruptStoreError, match=r"position/c/0: chunk cannot be decoded to \d+ bytes \(it holds 80\)"):
        TraceStore(tmp_path / "s.zarr").tap_streams("fc_in")[0].label("position")


@pytest.fixture(scope="module")
def raw_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uncompressed store of 61 rows in chunks of 7 (rows read straight from the chunk files)."""
    store = create_store(tmp_path_factory.mktemp("rows") / "s.zarr")
    _write(store, "t", "w", [20, 30, 11], width=6, dtype="bfloat16", chunk_rows=7)
    return store


@pytest.fixture(scope="module")
def wide_raw_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same rows 4 KiB wide: runs are cut where their destinations jump, never staged."""
    from tracediff.store.stream import _DIRECT_ROW_BYTES

    store = create_store(tmp_path_factory.mktemp("wide_rows") / "s.zarr")
    _write(store, "t", "w", [20, 30, 11], width=_DIRECT_ROW_BYTES // 2, dtype="bfloat16", chunk_rows=7)
    return store


def _compiled_reader() -> object:
    """The compiled run reader the streaming pass gives its ChunkFiles (numba is a dependency)."""
    from tracediff.store import fused_reads

    return fused_reads.read_runs


@pytest.mark.parametrize("rows_of", ["raw_store", "wide_raw_store"])
@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_rows_puts_every_row_at_its_destination_like_take(request: pytest.FixtureRequest, rows_of: str,
                                                               compiled: bool, data: st.DataObject) -> None:
    """Any rows (repeated, out of order, across chunks) to any distinct destinations of a larger
    ``out``: runs whose destinations are consecutive go straight in, the rest through the staging
    buffer; either way each row lands where asked and nothing else is written. Run by run in Python
    or by the compiled loop, over fewer open files than the request touches (its runs in batches)."""
    rows = np.array(data.draw(st.lists(st.integers(0, 60), max_size=80)), dtype=np.int64)
    spare = data.draw(st.integers(0, 5))
    consecutive = data.draw(st.booleans())
    if consecutive:  # the common case: destinations in the order rows were asked for
        dest = np.arange(rows.size, dtype=np.int64) + spare
    else:
        dest = np.array(data.draw(st.permutations(range(rows.size + spare)))[: rows.size], dtype=np.int64)
    with TraceStore(request.getfixturevalue(rows_of)) as opened, \
            ChunkFiles(limit=data.draw(st.integers(1, 4))) as files:
        files.runs_reader = _compiled_reader() if compiled else None
        stream = opened.streams["t"][0]
        assert stream.reads_rows_directly
        out = np.full((rows.size + spare, stream.width), 0xFFFF, dtype=np.uint16)
        stream.read_rows(rows, out=out, dest=dest, files=files)
        expected = np.full_like(out, 0xFFFF)
        if rows.size:
            expected[dest] = stream.take(np.sort(rows))[np.argsort(np.argsort(rows, kind="stable"), kind="stable")]
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_chunk_file_cut_short_under_an_open_reader_is_a_one_line_error_naming_it(tmp_path: Path,
                                                                                   compiled: bool) -> None:
    """A chunk file truncated after the reader opened it (its size checked then): the compiled loop's
    short read is read again in Python, which names the file, as the Python loop does."""
    store = create_store(tmp_path / "s.zarr")
    _write(store, "t", "w", [30], width=6, dtype="bfloat16", chunk_rows=7)
    with TraceStore(store) as opened, ChunkFiles(limit=8) as files:
        files.runs_reader = _compiled_reader() if compiled else None
        stream = opened.streams["t"][0]
        everything = stream.read_rows(np.arange(30))
        rows = np.array([0, 1, 2, 15, 16, 3, 4], dtype=np.int64)  # chunk 0, then chunk 2, then chunk 0 again
        out = np.zeros((rows.size, 6), dtype=np.uint16)
        stream.read_rows(rows, out=out, files=files)  # both files now open
        assert np.array_equal(out, everything[rows])
        chunk = store / "t" / "w" / "values" / "c" / "2" / "0"
        chunk.write_bytes(chunk.read_bytes()[: 6 * 2 * 2])  # two rows of the chunk's seven are left
        out[:] = 0
        with pytest.raises(CorruptStoreError, match=r"values/c/2/0: short read at byte \d+ \(file truncated"):
            stream.read_rows(rows, out=out, files=files)
        assert np.array_equal(stream.read_rows(rows[[0, 1, 2, 5, 6]]), everything[[0, 1, 2, 3, 4]])  # chunk 0 reads
