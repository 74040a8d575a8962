"""Interop: a trace store opens in plain zarr, xarray (one writer group or the whole store) and dask,
and every one of them sees the rows tracediff's own reader sees: the committed ones.

Stores are recorded by the real recorder from a tiny real Llama's forward passes (bf16 and fp32),
two writer groups of one tap (a trainer and an engine run, as two ranks would write them); crashed
stores come from recorders SIGKILLed at a chosen write (``reliability_children.KillSwitch``).
xarray is given ``consolidated=False``: a store has no consolidated metadata (writers append
without locks, so there is no one moment to consolidate at).
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import zarr
from conftest import HIDDEN, invoke_tracediff, stored_bits
from reliability_children import record_with_kill_point, stored_crash_rows

import tracediff
from tracediff.errors import CorruptStoreError, StoreNotFoundError, UsageError
from tracediff.store import LABEL_FIELDS, TraceStore, decode_values, pack_store
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead

if TYPE_CHECKING:
    import xarray as xr

FC_LAYERS = ["hs1", "hs3", "pre_norm"]
CHUNK_ROWS = 16
WRITERS = ("rank0", "rank1")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Recorded:
    store: Path
    dtype: str  # the store's logical dtype: bfloat16 or float32
    fc_inputs: dict[str, np.ndarray]  # writer -> what the draft's fc received, as stored (bf16 bits)


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    unsigned = np.dtype(f"u{got.dtype.itemsize}")
    assert np.array_equal(got.view(unsigned), expected.view(unsigned))


@pytest.fixture(scope="module", params=sorted(DTYPES))
def recorded(request, tmp_path_factory, tiny, seqs) -> Recorded:
    """rank0: a trainer pass over every sequence; rank1: an engine (packed prefill, then decode
    steps), appended to the same store: one tap, two writer groups, several chunks each."""
    dtype = DTYPES[request.param]
    store = tmp_path_factory.mktemp(f"interop-{request.param}") / "trace.zarr"
    fc_inputs = {}
    for rank, (writer, pipeline) in enumerate(zip(WRITERS, (run_trainer, run_engine), strict=True)):
        draft = DraftHead(HIDDEN, len(FC_LAYERS))
        with tracediff.record(
            store, role="trainer", append=rank > 0, writer_name=writer, rank=rank, world_size=2, chunk_rows=CHUNK_ROWS
        ) as rec:
            rec.tap(draft.fc, name="fc_in", capture="input", segment_size=HIDDEN, segment_labels=FC_LAYERS)
            batches = pipeline(tiny, draft, seqs, FC_LAYERS, dtype=dtype, on_batch=lambda lab, rec=rec: rec.labels(**lab),
                               keep_inputs=True)
        fc_inputs[writer] = np.concatenate([stored_bits(b.fc_input) for b in batches])
    return Recorded(store, "bfloat16" if dtype == torch.bfloat16 else "float32", fc_inputs)


def array_docs(store: Path) -> dict[str, dict[str, Any]]:
    """Every array's zarr.json of the store, by its path in the store."""
    return {
        p.parent.relative_to(store).as_posix(): doc
        for p in sorted(store.rglob("zarr.json"))
        if (doc := json.loads(p.read_text()))["node_type"] == "array"
    }


def open_group(store: Path | str | zarr.storage.ZipStore, writer: str) -> xr.Dataset:
    import xarray as xr  # noqa: PLC0415  (xarray and dask are imported by the tests that run, not at collection)

    return xr.open_zarr(store, group=f"fc_in/{writer}", consolidated=False)


# --------------------------------------------------------------------------------- plain zarr
def test_every_array_names_its_dimensions_and_values_names_its_coordinates(recorded: Recorded) -> None:
    docs = array_docs(recorded.store)
    assert sorted(docs) == sorted(f"fc_in/{w}/{name}" for w in WRITERS for name in ("values", *LABEL_FIELDS))
    for key, doc in docs.items():
        expected = ["row", "feature"] if key.endswith("/values") else ["row"]
        assert doc["dimension_names"] == expected, key
    for writer in WRITERS:
        values = docs[f"fc_in/{writer}/values"]
        assert values["attributes"] == {"dtype": recorded.dtype, "coordinates": " ".join(LABEL_FIELDS)}


def test_plain_zarr_opens_every_array_at_exactly_the_committed_rows(recorded: Recorded) -> None:
    root = zarr.open_group(str(recorded.store), mode="r")
    for writer in WRITERS:
        group = root["fc_in"][writer]
        rows = group.attrs["commit"]["rows"]
        assert rows == len(recorded.fc_inputs[writer])
        assert group["values"].metadata.dimension_names == ("row", "feature")
        assert group["values"].shape == (rows, 3 * HIDDEN)
        assert all(group[name].shape == (rows,) for name in LABEL_FIELDS)
        assert_bits_equal(group["values"][:], recorded.fc_inputs[writer])  # no [:rows] needed


# ------------------------------------------------------------------------------------- xarray
def test_xarray_opens_a_writer_group_with_the_labels_as_coordinates(recorded: Recorded) -> None:
    with TraceStore(recorded.store) as opened:
        streams = {s.writer: s for s in opened.streams["fc_in"]}
        for writer in WRITERS:
            stream = streams[writer]
            ds = open_group(recorded.store, writer)
            assert ds["values"].dims == ("row", "feature")
            assert ds.sizes == {"row": stream.rows, "feature": 3 * HIDDEN}
            assert list(ds.data_vars) == ["values"]
            assert set(ds.coords) == set(LABEL_FIELDS)
            assert all(ds[name].dims == ("row",) for name in LABEL_FIELDS)
            assert ds.attrs["commit"]["rows"] == stream.rows and ds.attrs["dtype"] == recorded.dtype
            # xarray shows the values as stored (bf16: raw uint16 bits, its attribute says so) ...
            raw = ds["values"].values
            assert_bits_equal(raw, stream.read())
            assert_bits_equal(raw, recorded.fc_inputs[writer])
            assert ds["values"].attrs["dtype"] == recorded.dtype
            # ... and the documented one-liner widens them to what TraceStore's float32 read gives.
            values = ds["values"]
            if values.attrs["dtype"] == "bfloat16":
                values = values.copy(data=(values.data.astype(np.uint32) << 16).view(np.float32))
            assert_bits_equal(values.values, stream.read_float32())
            for name, column in stream.labels().items():
                assert np.array_equal(ds[name].values, column), name
                assert ds[name].dtype == column.dtype, name  # no fill value masked to NaN


def test_xarray_opens_the_whole_store_as_a_datatree(recorded: Recorded) -> None:
    import xarray as xr  # noqa: PLC0415

    tree = xr.open_datatree(recorded.store, engine="zarr", consolidated=False)
    assert tree.attrs["tracediff"] == {"format": 1, "version": tracediff.__version__}
    assert sorted(tree["fc_in"].children) == list(WRITERS)
    with TraceStore(recorded.store) as opened:
        for stream in opened.streams["fc_in"]:
            node = tree[f"fc_in/{stream.writer}"]
            assert node.dataset.sizes == {"row": stream.rows, "feature": stream.width}
            assert set(node.dataset.coords) == set(LABEL_FIELDS)
            assert node.attrs["rank"] == WRITERS.index(stream.writer)
            assert_bits_equal(node["values"].values, stream.read())


SAMPLES = Path(__file__).resolve().parents[1] / "samples"


@pytest.mark.parametrize("name", ["train", "server_broken", "server_fixed", "bank"])
def test_xarray_opens_every_shipped_sample_with_its_dimensions_and_coordinates(name: str) -> None:
    # The samples are written by samples/make_samples.py with the writer of the day: what docs/format.md
    # promises of a store (dimension names, the labels as CF coordinates) holds for the shipped ones too.
    import xarray as xr  # noqa: PLC0415

    store = SAMPLES / f"{name}.zarr"
    with TraceStore(store) as opened:
        streams = [stream for tap in opened.taps for stream in opened.streams[tap]]
        assert streams
        for stream in streams:
            ds = xr.open_zarr(store, group=f"{stream.tap}/{stream.writer}", consolidated=False)
            assert ds["values"].dims == ("row", "feature")
            assert ds.sizes == {"row": stream.rows, "feature": stream.width}
            assert list(ds.data_vars) == ["values"] and set(ds.coords) == set(LABEL_FIELDS)
            assert all(ds[label].dims == ("row",) for label in LABEL_FIELDS)
            assert ds["values"].attrs["dtype"] == stream.dtype
            assert_bits_equal(ds["values"].values, stream.read())
            for label, column in stream.labels().items():
                assert np.array_equal(ds[label].values, column), label
        taps = opened.taps
    tree = xr.open_datatree(store, engine="zarr", consolidated=False)
    assert sorted(tree.children) == taps


# --------------------------------------------------------------------------------------- dask
def test_open_values_is_a_lazy_float32_dask_array_of_every_writer_group(recorded: Recorded) -> None:
    import dask.array as da  # noqa: PLC0415

    with TraceStore(recorded.store) as opened:
        streams = opened.streams["fc_in"]
        expected = np.concatenate([s.read_float32() for s in streams])
        labels = {name: np.concatenate([s.label(name) for s in streams]) for name in LABEL_FIELDS}
    values = tracediff.open_values(recorded.store)
    assert isinstance(values, da.Array) and values.dtype == np.float32
    assert values.shape == expected.shape == (sum(len(v) for v in recorded.fc_inputs.values()), 3 * HIDDEN)
    assert_bits_equal(values.compute(), expected)
    assert_bits_equal(values.compute(), decode_values(np.concatenate(list(recorded.fc_inputs.values())), recorded.dtype))
    assert_bits_equal(pickle.loads(pickle.dumps(values)).compute(), expected)  # a worker reopens by path

    got = tracediff.open_labels(recorded.store)
    assert sorted(got) == sorted([*LABEL_FIELDS, "writer"])
    for name, column in labels.items():
        assert np.array_equal(got[name], column) and got[name].dtype == column.dtype, name
    assert got["writer"].tolist() == [w for w in WRITERS for _ in range(len(recorded.fc_inputs[w]))]


@pytest.mark.parametrize("writer", WRITERS)
def test_open_values_of_one_writer_group_in_blocks_of_store_chunks(recorded: Recorded, writer: str) -> None:
    with TraceStore(recorded.store) as opened:
        (stream,) = [s for s in opened.streams["fc_in"] if s.writer == writer]
        expected = stream.read_float32()
    values = tracediff.open_values(recorded.store, "fc_in", writer, block_rows=2 * CHUNK_ROWS)
    assert set(values.chunks[0][:-1]) == {2 * CHUNK_ROWS} and values.chunks[1] == (3 * HIDDEN,)
    assert_bits_equal(values.compute(), expected)
    assert_bits_equal(values[5:40:3, 7:50].compute(), expected[5:40:3, 7:50])  # across block edges
    assert np.array_equal(tracediff.open_labels(recorded.store, "fc_in", writer)["position"], stream.label("position"))


def test_a_packed_zip_store_opens_in_xarray_and_in_open_values(recorded: Recorded, tmp_path: Path) -> None:
    import xarray as xr  # noqa: PLC0415

    packed = pack_store(recorded.store, tmp_path / "trace.zarr.zip")
    with TraceStore(recorded.store) as opened:
        streams = {s.writer: s for s in opened.streams["fc_in"]}
        for writer in WRITERS:
            ds = open_group(zarr.storage.ZipStore(packed, mode="r"), writer)  # xarray needs the store object
            assert set(ds.coords) == set(LABEL_FIELDS)
            assert_bits_equal(ds["values"].values, streams[writer].read())
        tree = xr.open_datatree(zarr.storage.ZipStore(packed, mode="r"), engine="zarr", consolidated=False)
        assert sorted(tree["fc_in"].children) == list(WRITERS)
        expected = np.concatenate([s.read_float32() for s in opened.streams["fc_in"]])
    assert_bits_equal(tracediff.open_values(packed).compute(), expected)


# -------------------------------------------------------------------- crashed writers
SIZES = [5, 6, 7, 9]  # batch 2 (rows 11..18) is the one a kill interrupts; 8-row chunks


def record_killed(forkserver: Any, tmp_path: Path, dtype: str, kill: dict[str, Any]) -> Path:
    store = tmp_path / "killed.zarr"
    plan = {"sizes": SIZES, "dtype": dtype, "chunk_rows": 8, "compressor": "none", "durable": False, "kill": kill}
    proc = forkserver.Process(
        target=record_with_kill_point, args=(str(store), str(tmp_path / "log"), str(tmp_path / "phase"), plan)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, "the child must die at its kill point"
    return store


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_writer_killed_while_writing_chunks_shows_every_reader_only_the_committed_rows(
    forkserver: Any, tmp_path: Path, dtype: str
) -> None:
    # Killed right after batch 2's first values chunk reached the disk (writes 1, 2-3, 4-5).
    store = record_killed(forkserver, tmp_path, dtype, {"point": "put", "target": "append:values_chunk", "n": 4, "when": "after"})
    committed = sum(SIZES[:2])
    expected, labels = stored_crash_rows(SIZES[:2], dtype)
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.rows == committed and stream.commit["status"] == "recording"
        writer = stream.writer
    ds = open_group(store, writer)
    assert ds.sizes["row"] == committed  # the chunks past the shapes are invisible
    assert_bits_equal(ds["values"].values, expected)
    assert np.array_equal(ds["position"].values, labels["position"])
    assert_bits_equal(tracediff.open_values(store).compute(), decode_values(expected, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_writer_killed_before_its_commit_record_shows_xarray_only_whole_batches(
    forkserver: Any, tmp_path: Path, dtype: str
) -> None:
    # Killed before batch 2's commit record: its chunks and shapes are on disk, commit.rows is not.
    store = record_killed(forkserver, tmp_path, dtype, {"point": "call", "target": "_commit", "n": 3, "when": "before"})
    committed = sum(SIZES[:2])
    expected, labels = stored_crash_rows(SIZES[:3], dtype)
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.rows == committed and stream.commit["batches"] == 2
        writer = stream.writer
    # open_values trusts commit.rows, as tracediff does everywhere ...
    assert_bits_equal(tracediff.open_values(store).compute(), decode_values(expected[:committed], dtype))
    assert len(tracediff.open_labels(store)["seq"]) == committed
    # ... xarray trusts the shapes: one batch more, and that batch whole (its real rows and labels,
    # never fill values), with commit.rows in the attributes to cut it off.
    ds = open_group(store, writer)
    assert ds.sizes["row"] == sum(SIZES[:3]) and ds.attrs["commit"]["rows"] == committed
    assert_bits_equal(ds["values"].values, expected)
    for name in LABEL_FIELDS:
        assert np.array_equal(ds[name].values, labels[name]), name
    assert_bits_equal(ds.isel(row=slice(0, ds.attrs["commit"]["rows"]))["values"].values, expected[:committed])


# ----------------------------------------------------------------------- old and hostile stores
def strip_dimension_names(store: Path) -> None:
    """What the writer of format 1 wrote before naming dimensions, mid-recording: no
    dimension_names, no coordinates attribute, arrays grown ahead of the commit record with
    rows past it that are not data."""
    for key in array_docs(store):
        path = store / key / "zarr.json"
        doc = json.loads(path.read_text())
        doc.pop("dimension_names")
        doc["attributes"].pop("coordinates", None)
        path.write_text(json.dumps(doc))
    group = zarr.open_group(str(store), mode="r+")["fc_in"]
    for writer in group.group_keys():
        g = group[writer]
        rows = g.attrs["commit"]["rows"]
        g["values"].resize((rows + 40, g["values"].shape[1]))
        g["values"][rows:] = np.full((40, g["values"].shape[1]), 0x7F80 if g.attrs["dtype"] == "bfloat16" else 9.0)
        for name in LABEL_FIELDS:
            g[name].resize((rows + 4096,))


def test_a_store_without_dimension_names_is_read_by_tracediff_and_refused_by_xarray(
    recorded: Recorded, tmp_path: Path
) -> None:
    import shutil  # noqa: PLC0415

    old = tmp_path / "old.zarr"
    shutil.copytree(recorded.store, old)
    strip_dimension_names(old)
    assert all("dimension_names" not in doc for doc in array_docs(old).values())
    with TraceStore(old) as opened, TraceStore(recorded.store) as new:
        for before, after in zip(new.streams["fc_in"], opened.streams["fc_in"], strict=True):
            assert after.rows == before.rows
            assert_bits_equal(after.read(), before.read())
            assert all(np.array_equal(after.label(n), before.label(n)) for n in LABEL_FIELDS)
        expected = np.concatenate([s.read_float32() for s in new.streams["fc_in"]])
    assert_bits_equal(tracediff.open_values(old).compute(), expected)  # committed rows only
    with pytest.raises(KeyError, match="dimension_names"):  # xarray never guesses the rows
        open_group(old, WRITERS[0])


HOSTILE_DIMENSION_NAMES = {
    "one name for two dimensions": ("values", ["row"]),
    "three names for two dimensions": ("values", ["row", "feature", "extra"]),
    "a string (zarr reads it as one name per letter)": ("values", "rf"),
    "an object (zarr reads its keys)": ("seq", {"r": 1}),
    "a number": ("position", 7),
    "a name that is a number": ("valid", [0]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_DIMENSION_NAMES))
def test_hostile_dimension_names_are_one_line_errors_naming_the_array(recorded: Recorded, tmp_path: Path, case: str) -> None:
    import shutil  # noqa: PLC0415

    array, names = HOSTILE_DIMENSION_NAMES[case]
    store = tmp_path / "hostile.zarr"
    shutil.copytree(recorded.store, store)
    meta = store / "fc_in" / WRITERS[1] / array / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["dimension_names"] = names
    meta.write_text(json.dumps(doc))
    for open_ in (TraceStore, tracediff.open_values):
        with pytest.raises(CorruptStoreError) as err:
            open_(store)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"{meta}: field dimension_names is "), message
    shown = invoke_tracediff("inspect", store)
    assert shown.returncode == 2 and str(meta) in shown.stderr and "dimension_names" in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------- the API
def test_open_values_refuses_bad_arguments_with_one_line_naming_the_store_and_field(
    recorded: Recorded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = recorded.store
    cases = [
        ((tmp_path / "missing.zarr",), {}, StoreNotFoundError, [str(tmp_path / "missing.zarr"), "no such trace store"]),
        ((store, "bank"), {}, UsageError, [str(store), "no tap named 'bank'", "fc_in"]),
        ((store, "fc_in", "rank7"), {}, UsageError, [f"{store}/fc_in", "'rank7'", "rank0, rank1"]),
        ((store,), {"block_rows": CHUNK_ROWS + 1}, UsageError, [f"{store}/fc_in/rank0", "block_rows=17", "16"]),
        ((42,), {}, UsageError, ["store must be a path", "int"]),
    ]
    for args, kwargs, error, parts in cases:
        with pytest.raises(error) as err:
            tracediff.open_values(*args, **kwargs)
        assert "\n" not in str(err.value) and all(p in str(err.value) for p in parts), str(err.value)
    with pytest.raises(UsageError, match="no tap named 'bank'"):
        tracediff.open_labels(store, "bank")
    monkeypatch.setitem(sys.modules, "dask.array", None)  # dask not installed
    with pytest.raises(UsageError, match=r"needs dask, which is not installed here .*pip install 'tracediff\[dask\]'"):
        tracediff.open_values(store)


def test_open_values_accepts_an_open_store_of_a_writer_still_recording(tmp_path: Path) -> None:
    from tracediff.store import TraceWriter, create_store  # noqa: PLC0415

    store = create_store(tmp_path / "s.zarr")
    w = TraceWriter(store, "fc_in", "w", width=4, dtype="float16", chunk_rows=4)
    w.append(np.arange(24, dtype=np.float16).reshape(6, 4), {"seq": np.zeros(6)})
    with pytest.raises(UsageError):  # a rejected batch: nothing written, nothing shown
        w.append(np.zeros((3, 4), np.float16), {"seq": np.zeros(2)})
    with TraceStore(store) as opened:
        values = tracediff.open_values(opened)
        assert values.shape == (6, 4) and values.dtype == np.float32
        assert np.array_equal(values.compute(), np.arange(24, dtype=np.float32).reshape(6, 4))
    assert open_group(store, "w").sizes["row"] == 6  # recording, not closed: shapes already exact


def test_importing_tracediff_stays_cheap_and_exports_the_interop_functions() -> None:
    code = (
        "import sys, tracediff; "
        "assert callable(tracediff.open_values) and callable(tracediff.open_labels); "
        "assert {'open_values', 'open_labels'} <= set(tracediff.__all__); "
        "print(sorted(m for m in ('numpy', 'dask', 'torch', 'zarr', 'xarray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_recipes_of_the_format_page_run_as_written_on_a_recorded_store(recorded: Recorded, tmp_path: Path) -> None:
    """docs/format.md's Python blocks, run as written on a store whose first writer group is pid1234."""
    import re  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    store = tmp_path / "train.zarr"
    shutil.copytree(recorded.store, store)
    (store / "fc_in" / WRITERS[0]).rename(store / "fc_in" / "pid1234")
    page = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    with TraceStore(store) as opened:
        streams = {s.writer: s for s in opened.streams["fc_in"]}
        mine = streams["pid1234"].read_float32()
        everything = np.concatenate([s.read_float32() for s in opened.streams["fc_in"]])
        valid = np.concatenate([s.label("valid") for s in opened.streams["fc_in"]])
    ran = []
    for block in blocks:
        scope: dict[str, Any] = {}
        exec(compile(block.replace('"train.zarr"', repr(str(store))), "docs/format.md", "exec"), scope)
        if "tracediff.open_values" in block:
            ran.append("open_values")
            assert_bits_equal(scope["values"].compute(), everything)
            assert np.isclose(float(scope["norms"][scope["labels"]["valid"]].mean().compute()),
                              np.linalg.norm(everything[valid], axis=1).mean())
        elif "da.from_zarr" in block:
            ran.append("dask")
            assert_bits_equal(np.asarray(scope["values"].compute(), dtype=np.float32), mine)
        elif "xr.open_zarr" in block:
            ran.append("xarray")
            assert_bits_equal(scope["v"].values, mine)
            seq0 = streams["pid1234"].label("seq") == 0
            assert_bits_equal(scope["first"].values, mine[seq0])
            assert scope["tree"]["fc_in/pid1234"].dataset.sizes["row"] == len(mine)
        elif "zarr.open_group" in block:
            ran.append("zarr")
            assert_bits_equal(np.asarray(scope["values"], dtype=np.float32), mine)
            assert np.array_equal(scope["labels"]["position"], streams["pid1234"].label("position"))
    assert sorted(ran) == ["dask", "open_values", "xarray", "zarr"]
