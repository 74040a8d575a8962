"""``--max-bytes SIZE --ring``: a recorder that writes more than SIZE keeps the newest rows within SIZE
on disk, drops the oldest a whole segment at a time, counts what it dropped, and leaves a store that
reads valid after every commit (tracediff.store.ring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_env

import tracediff
from tracediff.describe import describe_store
from tracediff.errors import UsageError
from tracediff.record.limits import Limits
from tracediff.store import TraceStore

WIDTH = 256  # float32: 1 KiB a row
ROWS = 10  # a batch


def _disk_bytes(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(folder) for f in files)


def _batch(i: int) -> tuple[torch.Tensor, dict[str, object]]:
    return torch.full((ROWS, WIDTH), float(i)), {"seq": i, "position": np.arange(ROWS),
                                                 "token_id": np.arange(ROWS) + i, "step": i}


def _kept(store: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(values' first column, step labels, writer groups) of every row the store holds, in order."""
    with TraceStore(store) as st:
        streams = st.streams["fc_in"]
        values = np.concatenate([s.read_float32(0, s.rows)[:, 0] for s in streams]) if streams else np.zeros(0)
        steps = np.concatenate([s.labels(("step",))["step"] for s in streams]) if streams else np.zeros(0)
        return values, steps, [s.writer for s in streams]


def test_a_ring_keeps_the_newest_whole_batches_within_its_budget_and_counts_what_it_dropped(tmp_path) -> None:
    store, budget, batches = tmp_path / "ring.zarr", 200_000, 60
    with tracediff.record(store, max_bytes=budget, ring=True) as rec:
        for i in range(batches):
            values, labels = _batch(i)
            rec.capture("fc_in", values, labels=labels)
            assert rec.flush()
            # After every commit: the store opens (every check of the reader), holds at most the budget,
            # and holds whole batches, the newest ones, in order.
            assert _disk_bytes(store / "fc_in") <= budget
            first_col, steps, _ = _kept(store)
            kept = np.unique(steps)
            assert kept.tolist() == list(range(i - len(kept) + 1, i + 1))
            assert all(int((steps == s).sum()) == ROWS for s in kept)
            assert (first_col == steps).all()
        outcome = rec.outcome()["taps"]["fc_in"]
    first_col, steps, writers = _kept(store)
    assert 0 < len(np.unique(steps)) < batches  # it did drop, and kept something
    with TraceStore(store) as st:
        desc = describe_store(st)
    (ring,) = desc["taps"]["fc_in"]["rings"].values()
    assert ring["segments"] == writers and writers[0].startswith(outcome["group"].split("/")[1] + "_r")
    assert ring["rows"] == len(steps)
    assert ring["dropped_rows"] + ring["rows"] == batches * ROWS == outcome["rows"]
    assert ring["dropped_batches"] + len(np.unique(steps)) == batches
    assert ring["dropped_bytes"] == ring["dropped_rows"] * WIDTH * 4
    assert ring["dropped_segments"] > 0 and ring["budget_bytes"] == budget
    # The dropped rows are the ring's, never the recorder's losses: nothing is counted as dropped or skipped.
    assert sum(w["dropped_rows"] + w["skipped_rows"] for w in desc["taps"]["fc_in"]["writers"]) == 0


def test_request_ids_are_named_by_the_segment_that_holds_their_rows(tmp_path) -> None:
    """String sequence keys (a server's request ids) get their integers from the segment the batch
    goes to, also in the batch that starts a new segment."""
    store = tmp_path / "ring.zarr"
    with tracediff.record(store, max_bytes=200_000, ring=True) as rec:
        for i in range(30):
            values, labels = _batch(i)
            rec.capture("fc_in", values, labels=dict(labels, seq=np.array([f"req-{i}"] * ROWS, dtype=object)))
    with TraceStore(store) as st:
        assert len(st.streams["fc_in"]) > 1
        for stream in st.streams["fc_in"]:
            seq, step = stream.labels(("seq", "step")).values()
            assert [stream.seq_names[int(k)] for k in seq] == [f"req-{int(s)}" for s in step]


def test_a_ring_lowers_the_chunk_rows_to_an_eighth_of_a_segment(tmp_path) -> None:
    store, budget = tmp_path / "ring.zarr", 400_000  # a segment of 80,000 bytes: 78 rows of 1 KiB
    with tracediff.record(store, max_bytes=budget, ring=True, chunk_rows=1024) as rec:
        for i in range(30):
            rec.capture("fc_in", *(_batch(i)[:1]), labels=_batch(i)[1])
            assert rec.flush()
            assert _disk_bytes(store / "fc_in") <= budget
    doc = json.loads((store / "fc_in" / _kept(store)[2][-1] / "values" / "zarr.json").read_text())
    assert doc["chunk_grid"]["configuration"]["chunk_shape"][0] == 78 // 8


def test_without_ring_max_bytes_is_still_a_cap(tmp_path) -> None:
    store = tmp_path / "cap.zarr"
    with tracediff.record(store, max_bytes=25 * WIDTH * 4) as rec:
        for i in range(5):
            rec.capture("fc_in", *(_batch(i)[:1]), labels=_batch(i)[1])
    _, steps, writers = _kept(store)
    assert steps.tolist() == [0] * ROWS + [1] * ROWS + [2] * 5 and len(writers) == 1


def test_a_ring_needs_a_budget_and_a_local_store() -> None:
    with pytest.raises(UsageError, match="--max-bytes"):
        Limits(ring=True)
    with pytest.raises(UsageError, match="URL"):  # refused before anything is written there
        tracediff.record("s3://bucket/server.zarr", max_bytes=1 << 20, ring=True)


RING_SCRIPT = """
import torch
m = torch.nn.Linear(256, 4)
for i in range(40):
    m(torch.full((10, 256), float(i)))
"""


def test_record_ring_reports_what_the_ring_dropped_and_exits_0(tmp_path) -> None:
    script = tmp_path / "run.py"
    script.write_text(RING_SCRIPT)
    store = tmp_path / "run.zarr"
    out = subprocess.run([sys.executable, "-m", "tracediff", "record", "--tap", "Linear:input", "--max-bytes",
                          "150000", "--ring", "-o", store, "--", sys.executable, script], capture_output=True,
                         text=True, env=cli_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ring pid" in out.stderr and "dropped" in out.stderr
    assert _disk_bytes(store / "linear_in") <= 150_000
    _, steps, _ = _kept_tap(store, "linear_in")
    assert steps.size and steps.max() == 39
    inspected = subprocess.run([sys.executable, "-m", "tracediff", "inspect", store], capture_output=True, text=True,
                               env=cli_env(), timeout=60)
    assert inspected.returncode == 0 and "ring pid" in inspected.stdout


def test_record_refuses_a_ring_at_a_url(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "tracediff", "record", "--tap", "Linear:input", "--max-bytes", "1MiB",
                          "--ring", "-o", "s3://bucket/x.zarr", "--", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, env=cli_env(), timeout=60)
    assert out.returncode == 2 and "--ring" in out.stderr and "URL" in out.stderr


def _kept_tap(store: Path, tap: str) -> tuple[None, np.ndarray, list[str]]:
    with TraceStore(store) as st:
        streams = st.streams[tap]
        return None, np.concatenate([s.labels(("step",))["step"] for s in streams]), [s.writer for s in streams]


def test_a_ring_store_whose_requests_span_segments_matches_the_trainer(tmp_path) -> None:
    """A server's requests recorded in two batches each (prompt, then continuation), the ring rotating
    between them: compare pairs every row with the trainer's, and the ring's bookkeeping is no config
    difference."""
    rng = np.random.default_rng(0)
    hidden, length = 64, 40
    seqs = {f"s{i}": rng.integers(0, 500, length) for i in range(12)}
    table = rng.standard_normal((600, 3 * hidden)).astype(np.float32)

    def rows(ids: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(table[ids] + 0.01 * pos[:, None].astype(np.float32))

    def labels(key: str, ids: np.ndarray, part: slice) -> dict[str, object]:
        pos = np.arange(length)[part]
        return {"seq": np.array([key] * pos.size, dtype=object), "position": pos, "token_id": ids[part],
                "next_token_id": np.r_[ids[1:], -1][part]}

    train, server = tmp_path / "train.zarr", tmp_path / "server.zarr"
    with tracediff.record(train, role="trainer") as rec:
        rec.declare("fc_in", segment_size=hidden)
        for key, ids in seqs.items():
            rec.capture("fc_in", rows(ids, np.arange(length)), labels=labels(key, ids, slice(None)))
    with tracediff.record(server, role="server", max_bytes=1_000_000, ring=True) as rec:
        rec.declare("fc_in", segment_size=hidden)
        for part in (slice(0, length // 2), slice(length // 2, length)):
            for key, ids in seqs.items():
                rec.capture("fc_in", rows(ids[part], np.arange(length)[part]), labels=labels(key, ids, part))
    _, _, writers = _kept(server)
    assert len(writers) == 2
    out = subprocess.run([sys.executable, "-m", "tracediff", "compare", train, server, "--json", tmp_path / "r.json"],
                         capture_output=True, text=True, env=cli_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "match"
    assert not any("tap.ring" in json.dumps(f) for f in report["findings"])


def test_a_store_wide_ring_keeps_the_whole_store_near_its_budget_across_writers(tmp_path) -> None:
    """--ring-store: two writers (as two processes would) share one budget; each drops its own oldest segments
    while the store is above it. The store stays within the budget plus the segments being written."""
    store, budget = tmp_path / "ring.zarr", 400_000
    limits = Limits(max_bytes=budget, ring=True, ring_store=True)
    tracediff.record(store, limits=limits).close()
    with (tracediff.record(store, append=True, writer_name="a", limits=limits) as a,
          tracediff.record(store, append=True, writer_name="b", limits=limits) as b):
        for i in range(80):
            for rec in (a, b):
                values, labels = _batch(i)
                rec.capture("fc_in", values, labels=labels)
                assert rec.flush()
            assert _disk_bytes(store) <= budget + 2 * (budget // 20) + 32768
    with TraceStore(store) as st:
        desc = describe_store(st)
    rings = desc["taps"]["fc_in"]["rings"]
    assert sorted(rings) == ["a", "b"]
    for ring in rings.values():
        assert ring["dropped_segments"] > 0 and ring["rows"] + ring["dropped_rows"] == 80 * ROWS
    _, steps, _ = _kept(store)
    assert steps.max() == 79 and 0 < np.unique(steps).size < 80


def test_a_store_wide_ring_needs_a_ring() -> None:
    with pytest.raises(UsageError, match="--ring"):
        Limits(max_bytes=1000, ring_store=True)
