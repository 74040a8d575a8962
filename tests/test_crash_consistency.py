"""Crash consistency: a recorder SIGKILLed at any of 100 points leaves a store that opens, holds
exactly the batches committed before the kill, bit for bit, and never a torn one.

Each kill is a real process forked from the ``forkserver`` fixture, recording through a real forward
hook into a real zarr folder. Kill points are of two kinds:

* **external**: the parent SIGKILLs the child after a random delay, wherever it happens to be;
* **targeted**: the child wraps the store's own write path (zarr's file write and chunk deletion,
  ``TraceWriter.__init__`` / ``append`` / ``_commit`` / ``close``) and SIGKILLs itself before, in
  the middle of (half of the temporary file written) or after the n-th write of one phase: a values
  or labels chunk, an array's metadata (grow, trim), the commit record, the group creation.

The child logs ``begin k`` before it hands batch k to the recorder and ``done k`` once the commit
record on disk shows it, so the parent knows which batches must have survived: every ``done`` one,
plus at most the one in flight. The data is a function of the batch index, so the parent knows what
they must hold. Counts go to ``reliability_report["crash_consistency"]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import invoke_tracediff, read_plain, run_tracediff
from reliability_children import PHASE_BYTES, record_with_kill_point, stored_crash_rows

from tracediff.store import LABEL_FIELDS, TraceStore, TraceWriter, create_store

KILLS = 100
EXTERNAL_KILLS = 30
SEED = 20261201
CHUNK_ROWS = 64
MAX_BATCHES = 8  # a run records 2..8 batches of 1..200 rows: 0 to 4 chunk boundaries each
LABEL_CHUNKS = {"default": None, "small": 128}  # small label chunks: label writes cross chunks too
CLOSE_PHASES = ("close_commit:commit_record", "close:array_meta", "close:delete")
WHENS = ("before", "middle", "after")
# Targeted kill points, drawn from a shuffled cycle. A put point names a write phase (section:file
# kind, see reliability_children.KillSwitch), a call point a TraceWriter method. Chunk writes, the
# commit record and close come up most often.
TARGETS: list[tuple[str, str, str]] = [
    *[("put", phase, w) for phase in ("create_store:root_meta", "create_writer:tap_group") for w in WHENS],
    *[("put", phase, w) for phase in ("create_writer:array_meta", "create_writer:group_meta") for w in WHENS],
    *[("put", "append:array_meta", w) for w in WHENS],
    *[("put", phase, w) for phase in ("append:values_chunk", "append:labels_chunk") for w in WHENS * 3],
    *[("put", "commit:commit_record", w) for w in WHENS * 4],
    # A normal close trims nothing (every batch sets the arrays' shapes to the committed rows), so
    # close's writes are its final commit record; close:array_meta / close:delete follow a failed batch.
    *[("put", "close_commit:commit_record", w) for w in WHENS * 3],
    *[("call", "close", "before") for _ in range(2)],
    *[("call", method, w) for method in ("__init__", "append") for w in ("before", "after")],
    *[("call", method, w) for method in ("_commit", "close") for w in ("before", "after") * 2],
]


@dataclass
class Calibration:
    """A run without a kill point: the intact reference store, how long a whole run takes, and how
    many writes of each phase it made after each batch and during close."""

    store: Path
    log: Path
    per_batch: list[dict[str, int]]
    close: dict[str, int]
    seconds: float


@dataclass
class Run:
    index: int
    plan: dict[str, Any]
    kind: str  # external, targeted or reference
    delay: float = 0.0  # external: seconds after the child started
    store: Path = field(default_factory=Path)
    log: Path = field(default_factory=Path)
    phase_file: Path = field(default_factory=Path)
    proc: Any = None
    killer: threading.Thread | None = None


def coarse_phase(phase: str) -> str:
    """What a kill interrupted, in the words of the reliability report."""
    section, _, kind = phase.partition(":")
    if section.startswith("close"):
        return "close"
    if section.startswith("create"):
        return "create"
    if section == "commit":
        return "commit_record"
    if kind in ("values_chunk", "labels_chunk"):
        return "chunk_write"
    if kind == "array_meta":
        return "array_resize"
    if section == "append":
        return "append_between_writes"
    return "outside_the_writer"


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    unsigned = np.dtype(f"u{got.dtype.itemsize}")
    assert np.array_equal(got.view(unsigned), expected.view(unsigned))


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class Planner:
    """Kill runs, deterministic from ``rng``: a recording configuration (batches, dtype, codec,
    durability, label chunking) and either a random delay (external) or the next targeted point of
    a shuffled cycle through :data:`TARGETS`, its ``n`` drawn from the writes such a run makes."""

    def __init__(self, rng: random.Random, sizes: list[int], calibrations: dict[str, Calibration]) -> None:
        self.rng, self.sizes, self.calibrations = rng, sizes, calibrations
        self.targets: list[tuple[str, str, str]] = []
        self.index = 0

    def next_run(self, kind: str) -> Run:
        rng = self.rng
        while True:
            label_chunks = rng.choice(sorted(LABEL_CHUNKS))
            batches = rng.randint(2, len(self.sizes))
            plan = {
                "sizes": self.sizes[:batches],
                "dtype": rng.choice(["float32", "bfloat16"]),
                "chunk_rows": CHUNK_ROWS,
                "compressor": rng.choice(["none", "none", "lz4"]),
                "durable": rng.random() < 0.25,
                "label_chunk_rows": LABEL_CHUNKS[label_chunks],
                "kill": None,
            }
            calibration = self.calibrations[label_chunks]
            self.index += 1
            if kind == "external":
                # Recording is most of a run's life: the kill lands anywhere in it, close included.
                share = (batches + 1) / (len(self.sizes) + 1)
                return Run(self.index, plan, kind, delay=rng.uniform(0.0, calibration.seconds * share))
            if not self.targets:
                self.targets = list(TARGETS)
                rng.shuffle(self.targets)
            point, target, when = self.targets.pop()
            if point == "call":
                available = {"__init__": 1, "append": batches, "_commit": batches + 1, "close": 1}[target]
            elif target in CLOSE_PHASES:  # counted for the longest run; a shorter one may trim less
                available = calibration.close.get(target, 0)
            else:
                available = calibration.per_batch[batches - 1].get(target, 0)
            if available:
                plan["kill"] = {"point": point, "target": target, "when": when, "n": rng.randint(1, available)}
                return Run(self.index, plan, kind)


class KillHarness:
    """Starts kill runs, and checks what each one left while the next one runs."""

    def __init__(self, tmp_path: Path, forkserver: Any, sizes: list[int]) -> None:
        self.tmp_path, self.forkserver, self.sizes = tmp_path, forkserver, sizes
        self.counts: Counter[str] = Counter()
        self.by_phase: Counter[str] = Counter()
        self.by_point: Counter[str] = Counter()
        self.kills = 0
        self.cli_checks: list[Future[None]] = []
        self._cli_phases: set[str] = set()
        self._cli = ThreadPoolExecutor(max_workers=1)  # real `tracediff` subprocesses, in the background
        self.calibrations = {
            "default": self._calibrate("float32", LABEL_CHUNKS["default"]),
            "small": self._calibrate("bfloat16", LABEL_CHUNKS["small"]),
        }
        self.references = {"float32": self.calibrations["default"].store, "bfloat16": self.calibrations["small"].store}
        self.expected = {dtype: stored_crash_rows(sizes, dtype) for dtype in self.references}
        for dtype, ref in zip(self.references, self.calibrations.values(), strict=True):  # whole and closed
            checked = self.check_store(ref.store, log_lines(ref.log), sizes, dtype, Counter())
            assert checked is not None and checked["batches"] == len(sizes)

    def _calibrate(self, dtype: str, label_chunk_rows: int | None) -> Calibration:
        counts = self.tmp_path / f"reference-{dtype}.counts.json"
        plan = {
            "sizes": self.sizes,
            "dtype": dtype,
            "chunk_rows": CHUNK_ROWS,
            "compressor": "none",
            "durable": False,
            "label_chunk_rows": label_chunk_rows,
            "kill": None,
            "counts_out": str(counts),
        }
        run = Run(0, plan, "reference")
        self.launch(run, name=f"reference-{dtype}")
        deadline = time.monotonic() + 120  # the first run also starts the fork server: time from "start"
        while "start" not in log_lines(run.log) and run.proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        started = time.monotonic()
        run.proc.join(120)
        assert run.proc.exitcode == 0, f"the reference run failed: {log_lines(run.log)[-3:]}"
        data = json.loads(counts.read_text())
        return Calibration(run.store, run.log, data["per_batch"], data["close"], time.monotonic() - started)

    def launch(self, run: Run, name: str | None = None) -> Run:
        name = name or f"run{run.index}"
        run.store, run.log, run.phase_file = (self.tmp_path / f"{name}{ext}" for ext in (".zarr", ".log", ".phase"))
        run.proc = self.forkserver.Process(
            target=record_with_kill_point, args=(str(run.store), str(run.log), str(run.phase_file), run.plan)
        )
        run.proc.start()
        if run.kind == "external":
            run.killer = threading.Thread(target=self._kill_after_start, args=(run,))
            run.killer.start()
        return run

    @staticmethod
    def _kill_after_start(run: Run) -> None:
        # By pid, not Process.kill(): polling a Process from two threads can lose its exit status.
        deadline = time.monotonic() + 60
        while "start" not in log_lines(run.log) and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(run.delay)
        with contextlib.suppress(ProcessLookupError):  # the run may have ended already
            os.kill(run.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        self._cli.shutdown(wait=True)

    def finish(self, run: Run) -> bool:
        """Wait for the run, check its store; True if it was killed (else it ended on its own)."""
        if run.killer is not None:
            run.killer.join(120)
        run.proc.join(60)
        assert run.proc.exitcode is not None, f"run {run.index} hangs"
        lines = log_lines(run.log)
        killed = run.proc.exitcode != 0
        phase = "none"
        if killed:
            assert run.proc.exitcode == -signal.SIGKILL, (
                f"run {run.index} died of exit code {run.proc.exitcode}: {lines[-3:]}"
            )
            self.kills += 1
            phase = coarse_phase(run.phase_file.read_bytes()[:PHASE_BYTES].decode().strip())
            self.by_phase[phase] += 1
            self.counts[f"{run.kind}_kills"] += 1
            if run.kind == "targeted":
                kill = run.plan["kill"]
                self.by_point[f"{kill['point']} {kill['target']} {kill['when']}"] += 1
                self.counts[f"targeted_{kill['when']}"] += 1
            else:
                self.counts[f"external_during_{phase}"] += 1
        else:  # a targeted point a shorter run never reached, or an external kill that came late
            self.counts[f"{run.kind}_runs_that_ended_before_their_kill"] += 1
        dtype = run.plan["dtype"]
        checked = self.check_store(run.store, lines, run.plan["sizes"], dtype, self.counts)
        if checked is None:
            return killed
        shown = invoke_tracediff("inspect", run.store)
        assert shown.returncode == 0, shown.stderr
        compared = invoke_tracediff("compare", self.references[dtype], run.store, "--quiet")
        if checked["rows"]:  # the committed prefix matches the intact reference bit for bit
            assert compared.returncode == 0 and compared.stdout.startswith("match"), compared.stdout + compared.stderr
        else:  # nothing to compare: a one-line error, exit 2
            assert compared.returncode == 2 and compared.stderr.startswith("tracediff: error:"), compared.stderr
        self.counts[f"compare_exit_{compared.returncode}"] += 1
        if killed and checked["rows"] and phase not in self._cli_phases and len(self._cli_phases) < 3:
            self._cli_phases.add(phase)  # the real command line, on stores killed in three phases
            self.cli_checks.append(self._cli.submit(self._check_with_real_cli, run.store, dtype))
        return killed

    def _check_with_real_cli(self, store: Path, dtype: str) -> None:
        shown = run_tracediff("inspect", store)
        assert shown.returncode == 0 and "fc_in" in shown.stdout, shown.stderr
        compared = run_tracediff("compare", self.references[dtype], store, "--quiet")
        assert compared.returncode == 0 and compared.stdout.startswith("match"), compared.stderr

    def check_store(
        self, store: Path, lines: list[str], sizes: list[int], dtype: str, counts: Counter[str]
    ) -> dict[str, int] | None:
        """Everything a killed run must leave: its committed batches, bit for bit, and nothing else."""
        begun = [int(line.split()[1]) for line in lines if line.startswith("begin ")]
        done = [int(line.split()[1]) for line in lines if line.startswith("done ")]
        assert begun == list(range(len(begun))) and done == list(range(len(done)))
        in_flight = len(begun) > len(done)
        if not (store / "zarr.json").exists():
            # Killed inside create_store, before the root group's zarr.json existed: no store, and
            # nothing in the way of recording there again.
            assert "created" not in lines
            counts["killed_before_the_store_existed"] += 1
            create_store(store, overwrite=True)
            return None
        values, labels = self.expected[dtype]
        with TraceStore(store) as opened:
            counts["stores_opened"] += 1
            streams = opened.streams.get("fc_in", [])
            assert len(streams) <= 1
            if not streams:  # killed before its writer group was whole: nothing half-made is visible
                assert not done, "a batch was logged committed but the store has no writer group"
                counts["stores_without_a_writer_group"] += 1
                return {"rows": 0, "batches": 0}
            (stream,) = streams
            commit = stream.commit
            batches = commit["batches"]
            assert len(done) <= batches <= len(done) + in_flight, f"{batches} batches committed; log ends {lines[-3:]}"
            rows = sum(sizes[:batches])
            assert stream.rows == commit["rows"] == rows, "the committed rows are exactly the committed batches"
            assert commit["dropped_rows"] == commit["skipped_rows"] == 0
            assert_bits_equal(stream.read(), values[:rows])
            if rows:  # the direct chunk-file reader that compare uses sees the same rows
                assert_bits_equal(np.concatenate([stream.read_chunk(i) for i in range(stream.chunks)]), values[:rows])
            for name, column in stream.labels().items():
                assert np.array_equal(column, labels[name][:rows]), name
            assert commit["status"] in ("recording", "closed")
            if "closed" in lines:
                assert commit["status"] == "closed"
            if commit["status"] == "closed":
                assert "close" in lines and batches == len(sizes)
                counts["stores_with_status_closed"] += 1
        plain = read_plain(store, "fc_in")[stream.writer]  # a plain zarr reader sees the same
        assert plain.rows == rows
        assert_bits_equal(plain.values, values[:rows])
        for name, column in plain.labels.items():
            assert np.array_equal(column, labels[name][:rows]), name
        group = zarr.open_group(str(store), mode="r")["fc_in"][stream.writer]
        assert all(group[name].shape[0] >= rows for name in ("values", *LABEL_FIELDS))
        counts["batches_verified"] += batches
        counts["rows_verified"] += rows
        counts["in_flight_batch_committed"] += int(in_flight and batches > len(done))
        counts["in_flight_batch_lost"] += int(in_flight and batches == len(done))
        counts["max_committed_batches_not_logged"] = max(
            counts["max_committed_batches_not_logged"], batches - len(done)
        )
        counts["partial_files_left"] += sum(1 for _ in store.rglob("*.partial"))
        return {"rows": rows, "batches": batches}


# A writer killed while creating its group leaves a folder with arrays and no group zarr.json: not a
# zarr group, so zarr skips it when listing the tap, with this warning.
SKIPPED_FOLDER_WARNING = "ignore:Object at .* is not recognized as a component of a Zarr hierarchy"


@pytest.mark.filterwarnings(SKIPPED_FOLDER_WARNING)
@pytest.mark.slow
def test_sigkill_at_100_points_leaves_every_committed_batch_and_nothing_torn(
    tmp_path: Path, forkserver, reliability_report
) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    sizes = [rng.randint(1, 200) for _ in range(MAX_BATCHES)]
    harness = KillHarness(tmp_path, forkserver, sizes)
    planner = Planner(rng, sizes, harness.calibrations)
    schedule = ["external"] * EXTERNAL_KILLS + ["targeted"] * (KILLS - EXTERNAL_KILLS)
    rng.shuffle(schedule)
    kinds = deque(schedule)

    running: Run | None = None
    try:
        while harness.kills < KILLS or running is not None:  # one run records while the last is checked
            launched = None
            if harness.kills + (running is not None) < KILLS:
                launched = harness.launch(planner.next_run(kinds.popleft()))
            if running is not None and not harness.finish(running):
                kinds.appendleft(running.kind)  # ended before its kill: another run takes its place
            running = launched
            assert planner.index < 2 * KILLS, "most planned kill points never fired"
        for check in harness.cli_checks:
            check.result()
    finally:
        harness.close()

    by_phase = harness.by_phase
    assert harness.counts["external_kills"] == EXTERNAL_KILLS
    assert by_phase["chunk_write"] >= 10 and by_phase["commit_record"] >= 10 and by_phase["close"] >= 10, by_phase
    reliability_report["crash_consistency"] = {
        "kills": harness.kills,
        "kills_by_phase": dict(by_phase),
        "targeted_kills_by_point": dict(harness.by_point),
        **dict(harness.counts),
        "runs": planner.index,
        "cli_subprocess_checks": len(harness.cli_checks),
        "batch_sizes": sizes,
        "chunk_rows": CHUNK_ROWS,
        "seconds": round(time.monotonic() - started, 1),
    }


@pytest.mark.filterwarnings(SKIPPED_FOLDER_WARNING)
@pytest.mark.parametrize(
    "kill",
    [
        {"point": "put", "target": "create_writer:array_meta", "when": "middle", "n": 4},
        {"point": "put", "target": "create_writer:group_meta", "when": "before", "n": 1},
    ],
    ids=["amid-the-arrays", "before-the-group-zarr-json"],
)
def test_a_writer_killed_while_creating_its_group_is_skipped_by_readers_and_avoided_by_writers(
    tmp_path: Path, forkserver, kill: dict[str, Any]
) -> None:
    plan = {"sizes": [5], "dtype": "float32", "chunk_rows": 4, "compressor": "none", "durable": False, "kill": kill}
    store, log = tmp_path / "s.zarr", tmp_path / "s.log"
    proc = forkserver.Process(target=record_with_kill_point, args=(str(store), str(log), str(tmp_path / "p"), plan))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    (folder,) = (p for p in (store / "fc_in").iterdir() if p.is_dir())
    assert (folder / "values" / "zarr.json").exists() and not (folder / "zarr.json").exists()

    with TraceStore(store) as opened:  # the half-made group is no stream, and no error
        assert opened.streams == {"fc_in": []}
    assert invoke_tracediff("inspect", store).returncode == 0
    again = TraceWriter(store, "fc_in", folder.name, width=3, dtype="float32")  # a restarted writer
    assert again.writer == f"{folder.name}_2"
    again.append(np.ones((2, 3), np.float32), {})
    again.close()
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.writer == again.writer and stream.rows == 2
    assert sorted(read_plain(store, "fc_in")) == [again.writer]
