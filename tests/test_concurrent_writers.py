"""Concurrent writers: eight processes started like SGLang's TP schedulers (multiprocessing *spawn*)
record into one store at the same moment through the real recorder, two taps each, and no row is
lost, duplicated or mixed into another process's group.

Every row names itself: its first three values are (process, batch, row), so the rows found in the
store are checked for exact set equality against what each process reports it sent.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import invoke_tracediff, read_plain, run_tracediff
from reliability_children import WRITER_TAPS, encoded_rows, race_group_creation, record_side_by_side

from tracediff.store import TraceStore, create_store, open_store

PROCESSES = 8
BATCHES = 20
META = {"model": "tiny", "tp_size": PROCESSES}


def stored_rows(process: int, batch: int, n: int, tap: str) -> np.ndarray:
    """The rows of one batch as the store must hold them (bf16 as its bits, rounded like torch)."""
    import torch  # noqa: PLC0415

    dtype, width = WRITER_TAPS[tap]
    rows = encoded_rows(process, batch, n, width)
    if dtype == "bfloat16":
        return torch.from_numpy(rows).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return rows


def row_keys(values: np.ndarray, dtype: str) -> list[tuple[int, int, int]]:
    """(process, batch, row) of every stored row, read from its first three values."""
    if dtype == "bfloat16":
        values = (values[:, :3].astype(np.uint32) << 16).view(np.float32)
    return [tuple(int(x) for x in row) for row in values[:, :3]]


@pytest.mark.slow
def test_eight_spawned_processes_record_one_store_at_once_and_lose_no_row(tmp_path: Path, reliability_report) -> None:
    started = time.monotonic()
    store = create_store(tmp_path / "tp.zarr", role="server", meta=META)
    ctx = multiprocessing.get_context("spawn")
    rng = np.random.default_rng(8)
    sizes = {p: rng.integers(1, 61, size=BATCHES).tolist() for p in range(PROCESSES)}  # 16-row chunks
    ready = [ctx.Event() for _ in range(PROCESSES)]
    go = ctx.Event()
    reports = [tmp_path / f"sent{p}.json" for p in range(PROCESSES)]
    procs = [
        ctx.Process(target=record_side_by_side, args=(str(store), p, sizes[p], ready[p], go, str(reports[p])))
        for p in range(PROCESSES)
    ]
    try:
        for proc in procs:
            proc.start()
        for event in ready:
            assert event.wait(120), "a process did not get ready"
        go.set()  # all eight create their tap and writer groups and write at the same moment
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)

    sent = [json.loads(path.read_text()) for path in reports]
    for p, report in enumerate(sent):
        assert report["error"] is None and report["sent"] == {tap: sizes[p] for tap in WRITER_TAPS}
        assert all(report["stats"][tap]["dropped_rows"] == 0 for tap in WRITER_TAPS)
    writers = {report["writer"]: p for p, report in enumerate(sent)}
    assert len(writers) == PROCESSES, "each process has its own writer group"

    rows_checked = Counter()
    with TraceStore(store) as opened:
        assert opened.source["role"] == "server" and opened.meta == META, "the root attributes survived"
        assert sorted(opened.taps) == sorted(WRITER_TAPS)
        for tap, (dtype, _width) in WRITER_TAPS.items():
            streams = {s.writer: s for s in opened.tap_streams(tap)}
            assert sorted(streams) == sorted(writers)
            plain = read_plain(store, tap)
            assert sorted(plain) == sorted(writers)
            found: list[tuple[int, int, int]] = []
            for writer, stream in streams.items():
                p = writers[writer]
                assert stream.attrs["rank"] == p and stream.attrs["world_size"] == PROCESSES
                assert stream.commit["status"] == "closed" and stream.commit["batches"] == BATCHES
                expected = np.concatenate([stored_rows(p, b, n, tap) for b, n in enumerate(sizes[p])])
                values = stream.read()
                assert np.array_equal(values, expected), f"{tap}/{writer}: rows differ from what process {p} sent"
                assert np.array_equal(plain[writer].values, values), "a plain zarr reader sees the same rows"
                labels = stream.labels()
                batch_of_row = np.repeat(np.arange(BATCHES), sizes[p])
                assert np.array_equal(labels["seq"], p * 1000 + batch_of_row)
                assert np.array_equal(labels["step"], batch_of_row)
                assert np.array_equal(labels["position"], np.concatenate([np.arange(n) for n in sizes[p]]))
                assert (labels["token_id"] == p).all()
                for name, column in plain[writer].labels.items():
                    assert np.array_equal(column, labels[name]), name
                found.extend(row_keys(values, dtype))
            sent_keys = {(p, b, r) for p in range(PROCESSES) for b, n in enumerate(sizes[p]) for r in range(n)}
            rows_checked[f"{tap}_rows"] = len(found)
            rows_checked["rows_duplicated"] += len(found) - len(set(found))
            rows_checked["rows_lost"] += len(sent_keys - set(found))
            rows_checked["rows_not_sent"] += len(set(found) - sent_keys)
            assert set(found) == sent_keys and len(found) == len(sent_keys), f"{tap}: {rows_checked}"

    shown = invoke_tracediff("inspect", store)
    assert shown.returncode == 0 and all(w in shown.stdout for w in writers), shown.stderr
    real = run_tracediff("inspect", store)  # the real command line agrees
    assert real.returncode == 0 and real.stdout == shown.stdout, real.stderr
    reliability_report["concurrent_writers"] = {
        "processes": PROCESSES,
        "start_method": "spawn",
        "started_writing_together": PROCESSES,
        "taps_per_process": len(WRITER_TAPS),
        "writer_groups": PROCESSES * len(WRITER_TAPS),
        "batches_per_tap_and_process": BATCHES,
        **dict(rows_checked),
        "seconds": round(time.monotonic() - started, 1),
    }


@pytest.mark.slow
def test_processes_that_join_one_folder_at_the_same_moment_all_get_their_group(tmp_path: Path) -> None:
    """Six processes released by one barrier each join a store folder (``record --append`` on
    several hosts of a shared filesystem) and create their writer group in its one tap, ten rounds:
    the root and the tap group are created by whichever comes first; finding them made, or being
    made, by another is no error. (Before issue #24 every round failed: "already exists".)"""
    processes, rounds = 6, 10
    outcomes = race_group_creation(str(tmp_path), processes, rounds)
    assert [o for o in outcomes if o[3] is not None] == []
    for r in range(rounds):
        with open_store(tmp_path / f"r{r}.zarr") as store:
            assert store.source["role"] == "node"
            streams = store.streams["fc_in"]
            assert sorted(s.writer for s in streams) == [f"p{p}" for p in range(processes)]
            assert all(s.rows == 5 and s.commit["status"] == "closed" for s in streams)
            for s in streams:
                assert np.array_equal(s.read(), encoded_rows(int(s.writer[1:]), 0, 5, 8))

