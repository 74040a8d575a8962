"""The streaming pass's per-row metrics past a size go to an unlinked temporary file (issue #27: a
compare's memory does not hold 12 bytes a row a pair): the reports must be the in-memory ones, bit for
bit, the subset search and the subset profiles included; no room for the file keeps them in memory."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest
from subset_traces import record_subset_traces

import tracediff.compare.rows.gather as gather
import tracediff.compare.stream.rowcolumns as rowcolumns
from tracediff.compare import compare_stores
from tracediff.compare.stream.rowcolumns import COSINE, STD_ERROR, RowColumns
from tracediff.demo import default_samples_dir

SAMPLES = default_samples_dir()


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return record_subset_traces(tmp_path_factory.mktemp("spill"))


def _json(report) -> str:
    return json.dumps(report.to_dict(), sort_keys=True, default=str)


def _pair(name: str, traces: dict[str, Path]) -> tuple[Path, Path]:
    if name in ("server_broken", "server_fixed"):
        return SAMPLES / "train.zarr", SAMPLES / f"{name}.zarr"
    return traces["ref"], traces[name]


@pytest.mark.parametrize("name", ["server_broken", "server_fixed", "decode_zeros"])
def test_a_spilled_pass_gives_the_in_memory_report(monkeypatch: pytest.MonkeyPatch, traces: dict[str, Path],
                                                   name: str) -> None:
    ref, cand = _pair(name, traces)
    in_memory = compare_stores(ref, cand)
    made: list[bool] = []
    real = rowcolumns._spill_file

    def spill_file(size: int):
        f = real(size)
        made.append(f is not None)
        return f

    monkeypatch.setattr(rowcolumns, "SPILL_BYTES", 0)
    monkeypatch.setattr(rowcolumns, "_spill_file", spill_file)
    spilled = compare_stores(ref, cand)
    assert made and all(made), "the pass's columns went to a file"
    assert _json(spilled) == _json(in_memory)
    if name == "decode_zeros":  # the subset search and its profiles read the spilled columns
        assert any(f.kind == "segment_subset" for f in spilled.findings)
        assert any(p.kind == "segment_subset" for p in spilled.position_profiles)


@pytest.mark.parametrize("spill", [False, True])
def test_pairs_finished_on_several_threads_give_the_one_thread_report(monkeypatch: pytest.MonkeyPatch,
                                                                      traces: dict[str, Path], spill: bool) -> None:
    """Each matched pair's metrics are finished from its own columns (read back from the file, or
    held), pairs on several threads at once: the report of one thread, bit for bit."""
    ref, cand = _pair("server_fixed", traces)
    if spill:
        monkeypatch.setattr(rowcolumns, "SPILL_BYTES", 0)
    monkeypatch.setattr(gather, "usable_cpus", lambda: 1)
    one = compare_stores(ref, cand)
    monkeypatch.setattr(gather, "usable_cpus", lambda: 4)
    several = compare_stores(ref, cand)
    assert len(one.metrics) >= 2  # (pairs to finish side by side)
    assert _json(several) == _json(one)


def test_no_room_for_the_file_keeps_the_columns_in_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    ref, cand = _pair("server_broken", {})
    in_memory = compare_stores(ref, cand)
    missing = tmp_path / "no such folder"
    monkeypatch.setattr(tempfile, "tempdir", str(missing))  # TMPDIR gone: the file cannot be made
    monkeypatch.setattr(rowcolumns, "SPILL_BYTES", 0)
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        report = compare_stores(ref, cand)
    assert _json(report) == _json(in_memory)
    assert "per-row metrics in memory" in caplog.text and str(missing) in caplog.text


@pytest.mark.parametrize("spill", [False, True])
def test_columns_hold_every_block_written_in_any_order(spill: bool) -> None:
    rng = np.random.default_rng(3)
    pairs, rows = 3, 10_001
    columns = RowColumns(pairs, rows, spill_bytes=0 if spill else 1 << 62)
    assert columns.spilled == spill
    want = rng.standard_normal((pairs, 3, rows)).astype(np.float32)
    want[0, 1, 17] = np.nan
    want[2, 2, 9_000] = -np.inf
    edges = np.r_[0, np.sort(rng.choice(np.arange(1, rows), 40, replace=False)), rows]
    blocks = list(zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True))
    rng.shuffle(blocks)  # blocks arrive in any order
    for a, b in blocks:
        block = np.ascontiguousarray(np.moveaxis(want[:, :, a:b], 2, 1))  # [pairs, rows, 3], strided per column
        for p in range(pairs):
            for c in range(3):
                columns.write(p, c, a, block[p, :, c])
    for p in range(pairs):
        for c in range(3):
            assert columns.read(p, c).view(np.uint32).tolist() == want[p, c].view(np.uint32).tolist()
    errors = columns.read(1, STD_ERROR)
    np.sqrt(np.abs(errors), out=errors)  # what finish_metrics does to the error column, written back
    columns.write(1, STD_ERROR, 0, errors)
    keys = [(0, 0), (1, 2), (2, 1)]
    by_pair = columns.mapping(keys, STD_ERROR)
    assert list(by_pair) == keys and len(by_pair) == 3 and by_pair.get((9, 9)) is None
    np.testing.assert_array_equal(by_pair[(1, 2)], np.sqrt(np.abs(want[1, 2])))
    np.testing.assert_array_equal(columns.mapping(keys, COSINE)[(2, 1)], want[2, 0])
    columns.close()
