"""Wide rows read and measured a part at a time (issue #27): the streaming pass reads each block's
rows of at least 4 KiB a side in parts the cache holds and measures each part while it is there
(tracediff/compare/rows/fused.py ``read_and_measure``), instead of reading the block whole and measuring
it afterwards. The numbers must be the whole block's, bit for bit, on every path a block can take:
runs of rows cut by the parts, rows of several writer streams, non-finite rows and rows of extreme
norms (which read the block whole after all), blocks whose rows span more chunk files than a reader
keeps open, and a chunk file cut short while the pass reads it (the store's one-line error)."""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wide_traces import bf16, write_wide_traces

import tracediff.compare.stream.blocks as blocks
from tracediff.compare import CompareOptions, compare_stores
from tracediff.compare.rows.kernels import fused_kernel
from tracediff.errors import StoreError
from tracediff.store import fused_reads

# The parts path reads through the compiled pread, which runs on 64-bit POSIX only (elsewhere blocks are
# read whole, which the rest of the suite covers): a platform without it has nothing here to test.
pytestmark = pytest.mark.skipif(not fused_reads.usable(), reason="the compiled reads run on 64-bit POSIX only")


# -------------------------------------------------------------------- the compiled loop on its own
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), part=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       c_bf16=st.booleans(), r_bf16=st.booleans())
def test_reading_and_measuring_part_by_part_is_the_kernel_on_the_whole_block(tmp_path_factory, n, part, seed,
                                                                             c_bf16, r_bf16):
    """Rows of two files per side, each block row taken from a random place (runs of consecutive
    stored rows of random lengths, a run cut by the parts anywhere): every output of the part-by-part
    loop equals the kernel's on the block gathered whole, bit for bit."""
    compiled = fused_kernel()
    assert compiled is not None
    rng = np.random.default_rng(seed)
    folder = tmp_path_factory.mktemp("parts")
    size, kc, kr = 8, 3, 2
    seg_c, seg_r = np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64)

    def side(name: str, k: int, as_bf16: bool):
        stored = []
        fds = []
        for f in range(2):
            rows = 30 + 7 * f
            values = (rng.standard_normal((rows, k * size)) * rng.choice([1e-3, 1.0, 300.0], size=(rows, 1)))
            values = values.astype(np.float32)
            data = bf16(values) if as_bf16 else values
            path = folder / f"{name}{f}"
            path.write_bytes(data.tobytes())
            stored.append(data)
            fds.append(os.open(path, os.O_RDONLY))
        # Runs in block order: from a random file and row, of random lengths.
        file_of, row_of, dest, lengths, offsets, run_fds = [], [], [], [], [], []
        at = 0
        while at < n:
            f = int(rng.integers(2))
            length = int(min(n - at, rng.integers(1, 8)))
            first = int(rng.integers(0, stored[f].shape[0] - length + 1))
            file_of += [f] * length
            row_of += list(range(first, first + length))
            dest.append(at)
            lengths.append(length)
            offsets.append(first * stored[f].strides[0])
            run_fds.append(fds[f])
            at += length
        block = np.stack([stored[f][r] for f, r in zip(file_of, row_of, strict=True)])
        runs = (np.array(run_fds, dtype=np.int32), np.array(offsets, dtype=np.int64), np.array(dest, dtype=np.int64),
                np.array(lengths, dtype=np.int64))
        return block, runs, fds, np.zeros((part, k * size), dtype=block.dtype)

    cblock, cruns, cfds, cbuf = side("c", kc, c_bf16)
    rblock, rruns, rfds, rbuf = side("r", kr, r_bf16)
    means = rng.standard_normal((2, size)).astype(np.float32)
    invs = (1.0 / (0.5 + rng.random((2, size)))).astype(np.float32)

    def outputs():
        return [np.full((n, kc), np.nan, np.float32), np.full((n, kr), np.nan, np.float32)] + \
            [np.full((2, n), np.nan, np.float32) for _ in range(4)]

    whole, parts = outputs(), outputs()
    compiled.kernel(cblock, rblock, n, size, seg_c, seg_r, means, invs, *whole)
    try:
        failed = compiled.read_and_measure(*cruns, *rruns, cbuf, rbuf, n, size, seg_c, seg_r, means, invs, *parts)
    finally:
        for fd in cfds + rfds:
            os.close(fd)
    assert failed == -1
    for got, want in zip(parts, whole, strict=True):
        assert got.tobytes() == want.tobytes()


def test_a_short_read_names_the_part_it_stopped_at(tmp_path):
    """A run past the end of its file (a chunk file cut short after it was opened) stops the loop at
    the part that needed it: the rows before are measured, the caller reads the block again."""
    compiled = fused_kernel()
    size = 4
    rows = np.arange(12 * size, dtype=np.float32).reshape(12, size) + 1
    path = tmp_path / "rows"
    path.write_bytes(rows.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        # Six rows: the first four from row 0, then two from row 11 (the second of them is not there).
        runs = (np.array([fd, fd], dtype=np.int32), np.array([0, 11 * size * 4], dtype=np.int64),
                np.array([0, 4], dtype=np.int64), np.array([4, 2], dtype=np.int64))
        seg = np.zeros(1, dtype=np.int64)
        out = [np.zeros((6, 1), np.float32), np.zeros((6, 1), np.float32)] + [np.zeros((1, 6), np.float32)
                                                                              for _ in range(4)]
        failed = compiled.read_and_measure(*runs, *runs, np.zeros((2, size), np.float32), np.zeros((2, size), np.float32),
                                           6, size, seg, seg, np.zeros((1, size), np.float32),
                                           np.ones((1, size), np.float32), *out)
    finally:
        os.close(fd)
    assert failed == 4
    np.testing.assert_allclose(out[0][:4, 0], np.linalg.norm(rows[:4], axis=1), rtol=1e-6)


# -------------------------------------------------------------------- whole compares
@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path]:
    return write_wide_traces(tmp_path_factory.mktemp("wide"))


#: Raw rows of 12 KiB a pair: blocks of 64 rows, or 256 when read by parts.
BLOCK_BYTES = 768 << 10


def _report(ref: Path, cand: Path) -> str:
    return json.dumps(compare_stores(ref, cand, CompareOptions(block_bytes=BLOCK_BYTES)).to_dict(), sort_keys=True,
                      default=str)


def _same_report(a: str, b: str, rel: float = 1e-12) -> None:
    """Every field the same, floats within ``rel`` (float64 sums added in another grouping)."""
    def walk(x, y, where: str) -> None:
        assert type(x) is type(y), where
        if isinstance(x, dict):
            assert x.keys() == y.keys(), where
            for k in x:
                walk(x[k], y[k], f"{where}/{k}")
        elif isinstance(x, list):
            assert len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                walk(u, v, f"{where}[{i}]")
        elif isinstance(x, float) and not (math.isnan(x) and math.isnan(y)):
            assert x == pytest.approx(y, rel=rel, abs=1e-300), where
        elif not isinstance(x, float):
            assert x == y, where

    walk(json.loads(a), json.loads(b), "")


def _count_calls(monkeypatch) -> list[int]:
    """Count the part-by-part loop's calls (the compiled module's attribute, as the pass reaches it)."""
    compiled = fused_kernel()
    real = compiled.read_and_measure
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(compiled, "read_and_measure", counted)
    return calls


def test_a_compare_of_wide_rows_read_by_parts_is_the_whole_blocks_compare(monkeypatch, traces):
    """Parts of one to a few rows (runs of the candidate's chunks cut anywhere), blocks of 64 rows
    either way: the report is the one of blocks read whole, bit for bit, non-finite and tiny-norm
    rows included."""
    ref, cand = traces
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    monkeypatch.setattr(blocks, "_PART_ROW_BYTES", 1 << 40)  # every block read whole
    whole = _report(ref, cand)
    monkeypatch.undo()

    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    monkeypatch.setattr(blocks, "_PARTS_BLOCK", 1)  # blocks of the same rows
    calls = _count_calls(monkeypatch)
    for part_bytes in (1, 30 << 10, 1 << 20):  # parts of 1 row, 2 rows, the whole block
        monkeypatch.setattr(blocks, "_PART_BYTES", part_bytes)
        calls.clear()
        assert _report(ref, cand) == whole
        assert len(calls) > 10, "the pass read its blocks part by part"
    report = json.loads(whole)
    assert report["verdict"] and any(f["kind"] == "nonfinite" for f in report["findings"])


@pytest.mark.parametrize("many_odd", [False, True])
def test_larger_blocks_read_by_parts_give_the_report_within_summation_order(monkeypatch, tmp_path, many_odd):
    """Blocks read by parts are four times larger (256 rows here; their rows are never held whole):
    the same report as 64-row blocks read whole, its float64 sums added in another grouping; with
    more non-finite and tiny-norm rows in a block than the raw buffers hold, those rows read again
    a buffer at a time."""
    ref, cand = write_wide_traces(tmp_path, seed=2, many_odd=many_odd)
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    monkeypatch.setattr(blocks, "_PART_ROW_BYTES", 1 << 40)
    whole = _report(ref, cand)
    monkeypatch.undo()

    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    calls = _count_calls(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        by_parts = _report(ref, cand)
    # Rows whose norms float32 cannot hold are measured, not warned about.
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    pairs = json.loads(whole)["plan"]["pairs"]
    assert len(calls) == -(-pairs // 256), "every block of 256 rows read by parts"
    _same_report(by_parts, whole)
    if many_odd:
        assert sum(f["kind"] == "nonfinite" for f in json.loads(whole)["findings"]) >= 1


def test_blocks_over_more_chunk_files_than_a_reader_keeps_open_are_read_in_slices(monkeypatch, traces):
    """A reference reader keeping 12 files open: blocks whose reference rows span more are measured
    as blocks the raw buffers hold (64 rows), the others by parts, in one pass: the same report."""
    ref, cand = traces
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    monkeypatch.setattr(blocks, "_PART_ROW_BYTES", 1 << 40)
    whole = _report(ref, cand)
    monkeypatch.undo()

    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    monkeypatch.setattr(blocks, "reference_files", lambda: 12)
    sliced: list[int] = []
    real = blocks._Pass._in_slices

    def counted(self, w, spec):
        sliced.append(spec.stop - spec.start)
        return real(self, w, spec)

    monkeypatch.setattr(blocks._Pass, "_in_slices", counted)
    calls = _count_calls(monkeypatch)
    by_parts = _report(ref, cand)
    count = -(-json.loads(whole)["plan"]["pairs"] // 256)
    assert calls and sliced and len(calls) + len(sliced) == count, "some blocks by parts, some in slices"
    _same_report(by_parts, whole)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the open chunk file through /proc (Linux)")
def test_a_chunk_file_cut_short_during_the_pass_is_the_stores_one_line_error(monkeypatch, tmp_path):
    """A candidate chunk file truncated after the pass opened it: the part-by-part read comes back
    short, the block is read again and the compare stops with the store's error naming the file."""
    ref, cand = write_wide_traces(tmp_path, seed=1)
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    compiled = fused_kernel()
    real = compiled.read_and_measure
    cut: list[str] = []
    once = threading.Lock()

    def truncating(*args):
        with once:  # (blocks run on two threads: one file is cut, once)
            if not cut:
                path = os.readlink(f"/proc/self/fd/{int(args[0][0])}")
                os.truncate(path, 100)
                cut.append(path)
        return real(*args)

    monkeypatch.setattr(compiled, "read_and_measure", truncating)
    with pytest.raises(StoreError) as err:
        compare_stores(ref, cand, CompareOptions(block_bytes=BLOCK_BYTES))
    message = str(err.value)
    assert cut and cut[0] in message and "\n" not in message
