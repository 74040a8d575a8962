"""A disk that fills up or slows down under a real recording: the host goes on unchanged, the store
keeps every committed row and says why recording stopped, and host memory stays within the queue's
budget.

The full disk is real: a small tmpfs mounted in a private mount namespace (``unshare``), so nothing
outlives the test even if it dies. The recording child (``disk_fault_children.py``) trains a real
model twice, without and with a recorder, and copies the store out before its namespace (and the
tmpfs) goes away. The slow disk is the real store code behind a sleep.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env, invoke_tracediff, read_plain

from tracediff.store import TraceStore

CHILD = Path(__file__).with_name("disk_fault_children.py")
MIB = 1 << 20


# ------------------------------------------------------------------------------------ full disk
@functools.cache
def _namespace_prefix() -> tuple[str, ...] | str:
    """The ``unshare`` command that lets this user mount a tmpfs nobody else sees, or why none does."""
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"tracediff-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    tried = []
    try:
        for prefix in (
            ("unshare", "--mount", "--propagation", "private"),
            ("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"),
        ):
            try:
                done = subprocess.run(
                    [*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(probe)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                tried.append(f"{' '.join(prefix)}: {exc}")
                continue
            if done.returncode == 0:
                return prefix
            tried.append(f"{' '.join(prefix)}: {done.stderr.strip()}")
    finally:
        probe.rmdir()
    return "cannot mount a private tmpfs here (" + "; ".join(tried) + ")"


def record_onto_tmpfs(folder: Path, size_kib: int, **params: Any) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the full-disk child with its store on a fresh ``size_kib`` tmpfs at ``folder/disk``."""
    prefix = _namespace_prefix()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    disk, out = folder / "disk", folder / "out"
    disk.mkdir()
    out.mkdir()
    args = json.dumps({"store": str(disk / "trace.zarr"), "out": str(out), **params})
    shell = f'mount -t tmpfs -o size={size_kib}k tmpfs "$1" && shift && exec "$@"'
    proc = subprocess.run(
        [*prefix, "sh", "-c", shell, "sh", str(disk), sys.executable, str(CHILD), "full_disk", args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, out


FULL_DISK = {"steps": 60, "batch": 32, "width": 128, "chunk_rows": 64}  # 60 x 16 KiB of fp32 rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size_kib", "writer"),
    [(384, {}), (640, {}), (384, {"durable": True}), (384, {"compressor": "lz4"})],
    ids=["384k", "640k", "384k-durable", "384k-lz4-zarr-path"],
)
def test_a_full_disk_stops_recording_with_one_clear_error_and_keeps_every_committed_row(
    tmp_path: Path, size_kib: int, writer: dict[str, Any], reliability_report: dict[str, Any]
) -> None:
    # Batches of 32 rows in 64-row chunks: every other batch ends mid-chunk, and the disk fills up
    # in the middle of some batch's chunk files (the writer's direct path unless a compressor is set).
    proc, out = record_onto_tmpfs(tmp_path, size_kib, **FULL_DISK, **writer)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert list((tmp_path / "disk").iterdir()) == []  # the tmpfs was private: nothing reached the real disk
    result = json.loads((out / "result.json").read_text())
    store_on_tmpfs = tmp_path / "disk" / "trace.zarr"

    # The host trained to the end and computed exactly what it computes unrecorded.
    assert result["recorded"] == result["reference"]
    assert len(result["recorded"]["losses"]) == FULL_DISK["steps"]

    # One line in the log says what happened and where.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, proc.stderr
    assert "No space left on device" in errors[0] and str(store_on_tmpfs) in errors[0]
    assert "recording disabled" in errors[0] and "'fc_in'" in errors[0]
    assert "No space left on device" in result["error"]

    # The store holds whole batches, bit for bit what the tapped layer received, up to the failure.
    batch, steps = FULL_DISK["batch"], FULL_DISK["steps"]
    fed = np.load(out / "fed.npy")
    copied = out / "store.zarr"
    group = read_plain(copied, "fc_in")[result["writer"]]
    commit = group.commit
    rows = group.rows
    assert 0 < rows < steps * batch
    assert rows % batch == 0 and commit["batches"] == rows // batch
    assert commit["status"] == "failed" and "No space left on device" in commit["error"]
    assert group.values.dtype == fed.dtype and np.array_equal(group.values.view(np.uint32), fed[:rows].view(np.uint32))
    committed = np.repeat(np.arange(rows // batch), batch)
    assert np.array_equal(group.labels["step"], committed) and np.array_equal(group.labels["seq"], committed)
    # Every row that did not land is counted: the batch the disk refused and every later one.
    assert (commit["dropped_rows"], commit["dropped_batches"]) == (steps * batch - rows, steps - rows // batch)
    assert result["stats"]["fc_in"]["dropped_rows"] == commit["dropped_rows"]

    with TraceStore(copied) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.rows == rows
        assert np.array_equal(stream.read(), fed[:rows])

    shown = invoke_tracediff("inspect", copied)
    assert shown.returncode == 0, shown.stderr
    assert "status failed" in shown.stdout and "No space left on device" in shown.stdout

    key = "_".join([f"tmpfs_{size_kib}k", *(f"{k}_{v}" for k, v in writer.items())])
    reliability_report.setdefault("full_disk", {})[key] = {
        "tmpfs_kib": size_kib,
        "rows_fed": steps * batch,
        "rows_committed": rows,
        "batches_committed": rows // batch,
        "dropped_rows": commit["dropped_rows"],
        "store_kib_when_full": round((result["fs_total"] - result["fs_free_after"]) / 1024),
        "time_to_finish_s": round(result["total_s"], 2),
        "host_loop_s": round(result["loop_s"], 2),
    }


# ------------------------------------------------------------------------------------ slow disk
# Drop mode: 300 steps of 1000 x 256 fp32 rows (~1 MB each, held in 1 MiB pool buffers), ~293 MiB in
# all, against a 16 MiB queue; the writer sleeps 50 ms before each batch, so most batches are dropped.
DROP = {"width": 256, "rows": 1000, "steps": 300, "max_queue_bytes": 16 * MIB}
BLOCK = {"width": 64, "rows": 100, "steps": 20, "max_queue_bytes": 64 * 1024}  # 25 KiB batches, 2 fit
WRITE_DELAY = 0.05
# What the recorder may add to the host's memory beyond its queue budget: the writer thread's working
# set (one batch converted for zarr, the chunk tail, zarr's buffers for a few chunks) and the lazy start
# of zarr's event loop and thread pool with their malloc arenas. Measured at 9 MiB with a 1-byte
# queue; 16 MiB leaves room for another batch or two.
WRITER_MARGIN = 16 * MIB


def slow_disk_children(runs: dict[str, tuple[bool, dict[str, str]]], folder: Path) -> dict[str, dict[str, Any]]:
    """Run the slow-disk child once per ``name: (with block mode, environment)``, side by side."""
    procs = {}
    for name, (block, env) in runs.items():
        (folder / name).mkdir()
        params = {
            "folder": str(folder / name),
            "write_delay": WRITE_DELAY,
            "drop": DROP,
            "block": BLOCK if block else None,
        }
        procs[name] = subprocess.Popen(
            [sys.executable, str(CHILD), "slow_disk", json.dumps(params)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        assert "ERROR" not in stderr, stderr
        results[name] = json.loads((folder / name / "result.json").read_text())
    return results


def check_drop_run(folder: Path, drop: dict[str, Any]) -> float:
    """What must hold for a drop-mode run whatever the allocator; returns the RSS growth in bytes."""
    assert drop["outputs"] == drop["reference"]  # the host's results, step by step
    stats = drop["stats"]
    assert stats["dropped_batches"] > 0  # the disk really was too slow
    assert stats["rows"] + stats["dropped_rows"] == DROP["steps"] * DROP["rows"]
    group = read_plain(folder / "drop.zarr", "fc_in")[drop["writer"]]
    assert group.commit["status"] == "closed"
    assert (group.rows, group.commit["dropped_rows"]) == (stats["rows"], stats["dropped_rows"])
    # Batches are kept or dropped whole, and each kept one is exactly what the layer received then.
    steps, counts = np.unique(group.labels["step"], return_counts=True)
    assert (counts == DROP["rows"]).all()
    for step, start in zip(steps.tolist(), range(0, group.rows, DROP["rows"]), strict=True):
        rows = np.ascontiguousarray(group.values[start : start + DROP["rows"]])
        assert f"{zlib.crc32(rows):08x}" == drop["fed_digests"][step]
    return drop["rss_peak"] - drop["rss_baseline"]


@pytest.mark.slow
def test_a_slow_disk_never_holds_more_host_memory_than_the_queue_allows_and_block_loses_nothing(
    tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    pytest.importorskip("psutil")  # the children measure their memory with it
    produced = DROP["steps"] * DROP["rows"] * DROP["width"] * 4
    bound = DROP["max_queue_bytes"]

    # Two runs side by side: the host's allocator as it is (glibc with its dynamic mmap threshold), and
    # with that threshold fixed, so that freed temporaries go back to the system at once and what is
    # left is only what the recorder itself holds.
    runs = slow_disk_children(
        {"default": (True, cli_env()), "fixed": (False, cli_env(MALLOC_MMAP_THRESHOLD_="131072"))}, tmp_path
    )
    held = check_drop_run(tmp_path / "fixed", runs["fixed"]["drop"])
    growth = check_drop_run(tmp_path / "default", runs["default"]["drop"])
    # What the recorder holds: copies in flight never exceed the bound (counted at their pooled,
    # power-of-two size), plus the writer's working set.
    assert held < bound + WRITER_MARGIN, f"RSS grew {held / MIB:.1f} MiB"
    # The real host: glibc's heap (its mmap threshold risen to the size of the host's temporaries)
    # keeps freed host temporaries resident around the recorder's long-lived small blocks (pooled
    # buffers' tensor headers, queued items), up to about one temporary per queued batch. Measured
    # 27-44 MiB here, varying with thread timing: bounded by the queue, not by what the host produces.
    assert growth < 3 * bound + WRITER_MARGIN, f"RSS grew {growth / MIB:.1f} MiB"
    assert growth < produced / 4

    # Block mode: the host waits for the writer instead, and every row lands, bit for bit.
    block = runs["default"]["block"]
    assert block["outputs"] == block["reference"]
    assert block["stats"]["dropped_rows"] == 0
    group = read_plain(tmp_path / "default" / "block.zarr", "fc_in")[block["writer"]]
    fed = np.load(tmp_path / "default" / "fed_block.npy")
    assert group.commit["status"] == "closed" and group.commit["dropped_rows"] == 0
    assert group.rows == BLOCK["steps"] * BLOCK["rows"] and np.array_equal(
        group.values.view(np.uint32), fed.view(np.uint32)
    )

    drop = runs["default"]["drop"]
    reliability_report["slow_disk"] = {
        "write_delay_s_per_batch": WRITE_DELAY,
        "queue_bound_mib": bound / MIB,
        "produced_mib": round(produced / MIB, 1),
        "peak_rss_growth_mib": round(growth / MIB, 1),
        "peak_rss_growth_mib_fixed_mmap_threshold": round(held / MIB, 1),
        "rss_method": drop["rss_method"],
        "drop_batches_dropped": drop["stats"]["dropped_batches"],
        "drop_batches_written": DROP["steps"] - drop["stats"]["dropped_batches"],
        "drop_host_loop_s": round(drop["loop_s"], 2),
        "drop_time_to_finish_s": round(drop["total_s"], 2),
        "drop_host_step_ms_median": round(drop["step_ms_median"], 2),
        "drop_host_step_ms_max": round(drop["step_ms_max"], 2),
        "unrecorded_step_ms_median": round(drop["reference_step_ms_median"], 2),
        "unrecorded_step_ms_max": round(drop["reference_step_ms_max"], 2),
        "block_rows": group.rows,
        "block_time_to_finish_s": round(block["total_s"], 2),
    }
