"""The in-process recorder on a tiny real transformers Llama: what it stores, what it never does to
its host, and what a store looks like after a failure, a full queue, a SIGTERM or a SIGKILL.

Rows are read back with plain zarr + numpy (``read_plain``) and compared bit for bit with the
tensors the draft's ``fc`` really received (``keep_inputs=True``).
"""

from __future__ import annotations

import functools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    HIDDEN,
    cli_env,
    invoke_tracediff,
    kill_batch_sizes,
    read_plain,
    record_batches_until_killed,
    record_then_wait_for_sigterm,
    stored_bits,
    writer_json,
)

import tracediff
from tracediff.errors import UsageError
from tracediff.record.recorder import Limits
from tracediff.store import TraceStore, TraceWriter
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead

FC_LAYERS = ["hs1", "hs3", "pre_norm"]  # an EAGLE-3 style choice of low, middle and last states
# The engine decodes the last 3 tokens of each sequence: packed prefills and interleaved decode
# steps in few engine steps (each step is one batch for the writer to commit).
PIPELINES = {"trainer": run_trainer, "engine": functools.partial(run_engine, prefill_len=lambda _i, s: len(s) - 3)}


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    unsigned = np.dtype(f"u{got.dtype.itemsize}")
    assert np.array_equal(got.view(unsigned), expected.view(unsigned))


def expected_labels(batches: list[Any]) -> dict[str, np.ndarray]:
    """The labels each row must carry: what the pipeline handed to ``on_batch``, row by row."""
    out = {k: np.concatenate([b.labels[k] for b in batches]) for k in ("seq", "position", "token_id", "next_token_id")}
    out["step"] = np.concatenate([np.full(b.num_rows, b.labels["step"]) for b in batches])
    out["phase"] = np.concatenate([np.array([b.labels["phase"]] * b.num_rows) for b in batches])
    return out


def host_run(
    tiny, seqs, pipeline: str = "trainer", recorder=None, on_batch=None
) -> tuple[list[Any], list[torch.Tensor]]:
    """Run a pipeline with a fresh draft; return its batches and the draft's outputs (the host's results)."""
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    outputs: list[torch.Tensor] = []
    draft.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    if recorder is not None:
        recorder.tap(draft.fc, name="fc_in", capture="input", segment_size=HIDDEN, segment_labels=FC_LAYERS)
        on_batch = on_batch or (lambda lab: recorder.labels(**lab))
    batches = PIPELINES[pipeline](tiny, draft, seqs, FC_LAYERS, on_batch=on_batch, keep_inputs=True)
    return batches, outputs


def assert_same_host_results(got: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(got) == len(reference)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.005)


def committed_batches(store: Path, tap: str, writer: str) -> int:
    try:
        return int(writer_json(store, tap, writer)["batches"])
    except FileNotFoundError:
        return 0


def assert_stored_as_fed(store: Path, batches: list[Any]) -> Any:
    """The store's one fc_in group holds what the draft's fc received, bit for bit, each row with the
    labels the pipeline gave it; returns the group."""
    (group,) = read_plain(store, "fc_in").values()
    assert_bits_equal(group.values, np.concatenate([stored_bits(b.fc_input) for b in batches]))
    expected = expected_labels(batches)
    for key in ("seq", "position", "token_id", "next_token_id", "step"):
        assert np.array_equal(group.labels[key], expected[key]), key
    assert group.phase_names == expected["phase"].tolist()
    return group


# ------------------------------------------------------------------------------- what is stored
@pytest.mark.parametrize("pipeline", ["trainer", "engine"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fc_input_rows_equal_what_the_draft_received_bit_for_bit(tmp_path: Path, tiny, seqs, dtype, pipeline) -> None:
    store = tmp_path / "trace.zarr"
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    with tracediff.record(store, role=pipeline) as rec:
        rec.tap(draft.fc, name="fc_in", capture="input", segment_size=HIDDEN, segment_labels=FC_LAYERS)
        batches = PIPELINES[pipeline](
            tiny, draft, seqs, FC_LAYERS, dtype=dtype, on_batch=lambda lab: rec.labels(**lab), keep_inputs=True
        )

    group = assert_stored_as_fed(store, batches)
    assert group.labels["valid"].all()
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    assert group.attrs["dtype"] == dtype_name and group.attrs["width"] == 3 * HIDDEN
    assert (group.attrs["segment_size"], group.attrs["segment_labels"]) == (HIDDEN, FC_LAYERS)
    assert group.attrs["capture"] == "input" and group.attrs["in_features"] == 3 * HIDDEN
    assert group.commit["status"] == "closed" and group.commit["batches"] == len(batches)
    assert group.commit["dropped_rows"] == group.commit["skipped_rows"] == 0
    root = json.loads((store / "zarr.json").read_text())["attributes"]
    assert root["tracediff"]["format"] == 1 and root["source"]["role"] == pipeline


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fc_output_rows_equal_what_fc_returned_bit_for_bit(tmp_path: Path, tiny, seqs, dtype) -> None:
    store = tmp_path / "out.zarr"
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    returned: list[torch.Tensor] = []
    draft.fc.register_forward_hook(lambda _m, _a, out: returned.append(out))
    with tracediff.record(store) as rec:
        rec.tap(draft.fc, name="fc_out", capture="output")
        batches = run_trainer(tiny, draft, seqs, FC_LAYERS, dtype=dtype, on_batch=lambda lab: rec.labels(**lab))
    (group,) = read_plain(store, "fc_out").values()
    assert group.attrs["capture"] == "output" and group.attrs["width"] == HIDDEN
    assert_bits_equal(group.values, np.concatenate([stored_bits(t) for t in returned]))
    assert np.array_equal(group.labels["token_id"], expected_labels(batches)["token_id"])


def test_a_commit_interval_stores_the_same_rows_in_fewer_commits_and_a_waiting_host_ends_its_round(
    tmp_path: Path, tiny, seqs
) -> None:
    """``commit_interval``: the writer gathers each tap's batches and writes them as one commit. Rows,
    labels and their order are what a commit a batch stores; nothing is committed before the round
    ends; ``flush`` and ``wait_for_writer`` (a host waiting: the vLLM adapter after a step) end the
    round at once, long before the interval."""
    store = tmp_path / "trace.zarr"
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    returned: list[torch.Tensor] = []
    draft.fc.register_forward_hook(lambda _m, _a, out: returned.append(out))
    engine = functools.partial(PIPELINES["engine"], tiny, draft, seqs, FC_LAYERS, dtype=torch.bfloat16, keep_inputs=True)
    with tracediff.record(store, role="engine", commit_interval=60.0) as rec:
        rec.tap(draft.fc, name="fc_in", capture="input", segment_size=HIDDEN, segment_labels=FC_LAYERS)
        rec.tap(draft.fc, name="fc_out", capture="output")
        first = engine(on_batch=lambda lab: rec.labels(**lab))
        assert len(first) > 2  # several engine steps: a batch each, per tap
        time.sleep(0.5)
        assert not (store / "fc_in").exists() or not read_plain(store, "fc_in")  # gathered, not committed
        assert rec.flush(timeout=30.0) is True  # the host waits: the round ends now, not in 60 s
        (group,) = read_plain(store, "fc_in").values()
        assert group.rows == sum(b.fc_input.shape[-2] for b in first) and group.commit["batches"] == 1
        second = engine(on_batch=lambda lab: rec.labels(**lab))
        assert rec.wait_for_writer(0, timeout=30.0) is True
        (group,) = read_plain(store, "fc_out").values()
        assert group.commit["batches"] == 2  # a commit a round, per tap
    batches = first + second
    group = assert_stored_as_fed(store, batches)
    assert group.commit["status"] == "closed" and group.commit["batches"] == 2 and group.commit["dropped_rows"] == 0
    (out,) = read_plain(store, "fc_out").values()
    assert_bits_equal(out.values, np.concatenate([stored_bits(t) for t in returned]))
    assert np.array_equal(out.labels["position"], group.labels["position"])


def test_close_writes_what_a_commit_interval_had_gathered(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 2)
    with tracediff.record(tmp_path / "s.zarr", commit_interval=60.0) as rec:
        rec.tap(layer, "x_in")
        for i in range(30):
            layer(torch.full((1, 3, 8), float(i)))
    (group,) = read_plain(tmp_path / "s.zarr", "x_in").values()
    assert group.rows == 90 and group.commit["batches"] == 1 and group.commit["status"] == "closed"
    assert np.array_equal(group.values[:, 0], np.repeat(np.arange(30, dtype=np.float32), 3))
    assert group.labels["step"].tolist() == np.repeat(np.arange(30), 3).tolist()  # call numbers, in order
    with pytest.raises(UsageError, match="commit_interval"):
        tracediff.record(tmp_path / "t.zarr", commit_interval=-1.0)


def test_rows_are_copies_taken_at_the_forward_not_views_of_host_tensors(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 3)
    x = torch.randn(2, 5, 8)
    original = x.clone()
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(layer, "x_in")
        layer(x)
        x.fill_(-7.0)  # the host reuses its buffer right after the forward
    (group,) = read_plain(tmp_path / "s.zarr", "x_in").values()
    assert np.array_equal(group.values, original.reshape(-1, 8).numpy())
    # No labels given: one sequence per leading index, positions 0..T-1, step = call number.
    assert group.labels["seq"].tolist() == [0] * 5 + [1] * 5
    assert group.labels["position"].tolist() == list(range(5)) * 2
    assert group.labels["step"].tolist() == [0] * 10


def test_string_sequence_keys_are_stored_as_ids_named_in_seq_names(tmp_path: Path) -> None:
    layer = torch.nn.Linear(4, 2)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(layer, "x_in")
        for key, n in (("req-b", 3), ("req-a", 2), ("req-b", 1)):
            rec.labels(seq=key, position=np.arange(n))
            layer(torch.ones(n, 4))
    with TraceStore(tmp_path / "s.zarr") as opened:
        (stream,) = opened.streams["x_in"]
        names = stream.seq_names
        assert [names[i] for i in stream.label("seq")] == ["req-b"] * 3 + ["req-a"] * 2 + ["req-b"]


def test_close_removes_the_hooks_and_later_forwards_record_nothing(tmp_path: Path) -> None:
    layer = torch.nn.Linear(4, 2)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(layer, "x_in")
        layer(torch.ones(3, 4))
    assert not layer._forward_pre_hooks and tracediff.current() is not rec
    layer(torch.ones(5, 4))
    tracediff.labels(seq=1)  # a no-op with nothing recording: scripts may call it unconditionally
    assert read_plain(tmp_path / "s.zarr", "x_in")[rec.writer_name].rows == 3


def test_a_label_provider_that_raises_stops_recording_but_never_the_host(tmp_path: Path, tiny, seqs) -> None:
    _, reference = host_run(tiny, seqs)
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    outputs: list[torch.Tensor] = []
    draft.register_forward_hook(lambda _m, _a, out: outputs.append(out))

    def provider(_mod, _args, _kwargs, tensor):
        if provider.calls == 1:
            raise KeyError("no request id in this batch")
        provider.calls += 1
        return {"seq": 5}

    provider.calls = 0
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(draft.fc, "fc_in", labels=provider)
        run_trainer(tiny, draft, seqs, FC_LAYERS)
    assert_same_host_results(outputs, reference)
    (group,) = read_plain(tmp_path / "s.zarr", "fc_in").values()
    assert group.commit["status"] == "failed" and "no request id in this batch" in group.commit["error"]
    assert group.rows == len(seqs[0]) and set(group.labels["seq"]) == {5}


# --------------------------------------------------------------------- failures and a full queue
def test_writer_failure_marks_the_store_failed_and_leaves_host_outputs_identical(tmp_path: Path, tiny, seqs) -> None:
    _, reference = host_run(tiny, seqs)
    store, aside = tmp_path / "s.zarr", tmp_path / "chunks-aside"
    with tracediff.record(store) as rec:

        def on_batch(labels: dict[str, Any]) -> None:
            if labels["step"] == 2:
                # Two batches are on disk; then the disk goes bad under the writer: the folder its
                # chunks go into is moved away and replaced by a file, so every later chunk write
                # fails with a real NotADirectoryError (a read-only folder would not stop root, who
                # runs these tests). The fault is repaired after the run (the folder comes back).
                wait_until(lambda: committed_batches(store, "fc_in", rec.writer_name) == 2, what="two commits")
                chunks = store / "fc_in" / rec.writer_name / "values" / "c"
                chunks.rename(aside)
                chunks.write_text("not a folder")
            rec.labels(**labels)

        batches, outputs = host_run(tiny, seqs, recorder=rec, on_batch=on_batch)
        assert len(batches) == len(seqs)  # the host went on to the end
    assert_same_host_results(outputs, reference)
    broken = store / "fc_in" / rec.writer_name / "values" / "c"
    broken.unlink()
    aside.rename(broken)

    sizes = [b.num_rows for b in batches]
    commit = writer_json(store, "fc_in", rec.writer_name)
    assert commit["status"] == "failed"
    assert "Not a directory" in commit["error"] and "writer" in commit["error"]
    assert commit["rows"] == sizes[0] + sizes[1] and commit["batches"] == 2
    # The batch in flight and any queued behind it are counted, never half-written.
    assert commit["dropped_batches"] >= 1
    assert commit["dropped_rows"] == sum(sizes[2 : 2 + commit["dropped_batches"]])
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.rows == commit["rows"]
        assert np.array_equal(stream.label("position"), expected_labels(batches[:2])["position"])

    shown = invoke_tracediff("inspect", store)
    assert shown.returncode == 0, shown.stderr
    assert "status failed" in shown.stdout
    assert "recording stopped after an error" in shown.stdout and "Not a directory" in shown.stdout


@pytest.mark.parametrize("on_full", ["drop", "block"])
def test_a_full_queue_drops_whole_batches_counts_them_and_never_changes_the_host(
    tmp_path: Path, tiny, seqs, monkeypatch: pytest.MonkeyPatch, on_full: str
) -> None:
    _, reference = host_run(tiny, seqs)
    store = tmp_path / "s.zarr"
    # The disk stalls while the writer holds the first batch (released below, after the run):
    # the real append runs, just late. With a 1-byte queue budget every later batch finds the
    # queue full, so which batches are dropped does not depend on timing.
    disk_back = threading.Event()
    real_append = TraceWriter.append

    def stalled_append(self: TraceWriter, values: np.ndarray, labels: dict[str, Any]) -> None:
        assert disk_back.wait(30)
        real_append(self, values, labels)

    monkeypatch.setattr(TraceWriter, "append", stalled_append)
    with tracediff.record(store, on_full=on_full, max_queue_bytes=1, block_timeout=0.05) as rec:
        batches, outputs = host_run(tiny, seqs, recorder=rec)
        disk_back.set()
    assert_same_host_results(outputs, reference)

    sizes = [b.num_rows for b in batches]
    (group,) = read_plain(store, "fc_in").values()
    assert group.commit["status"] == "closed"
    assert (group.rows, group.commit["batches"]) == (sizes[0], 1)
    assert (group.commit["dropped_rows"], group.commit["dropped_batches"]) == (sum(sizes[1:]), len(sizes) - 1)
    assert_bits_equal(group.values, stored_bits(batches[0].fc_input))

    shown = invoke_tracediff("inspect", store)
    assert shown.returncode == 0
    assert f"dropped {sum(sizes[1:])}" in shown.stdout and "were dropped because the writer fell behind" in shown.stdout
    as_json = json.loads(invoke_tracediff("inspect", "--json", "-", store).stdout)
    (writer,) = as_json["taps"]["fc_in"]["writers"]
    assert (writer["dropped_rows"], writer["dropped_batches"]) == (sum(sizes[1:]), len(sizes) - 1)
    assert writer["drop_reason"].startswith("the queue held")


def test_rows_an_adapter_could_not_record_are_said_with_their_reason_not_as_a_slow_writer(
    tmp_path: Path, tiny, seqs
) -> None:
    store = tmp_path / "s.zarr"
    with tracediff.record(store) as rec:
        batches, _ = host_run(tiny, seqs, recorder=rec)
        rec.count_lost("fc_in", 7, "the engine handed over rows in a layout the adapter cannot read")
    (group,) = read_plain(store, "fc_in").values()
    assert group.rows == sum(b.num_rows for b in batches) and group.commit["dropped_rows"] == 7
    assert group.commit["drop_reason"] == "the engine handed over rows in a layout the adapter cannot read"
    shown = invoke_tracediff("inspect", store)
    assert "7 rows were not recorded: the engine handed over rows in a layout the adapter cannot read" in shown.stdout
    assert "writer fell behind" not in shown.stdout


def test_block_waits_for_a_slow_writer_and_loses_nothing(tmp_path: Path, tiny, seqs, monkeypatch) -> None:
    _, reference = host_run(tiny, seqs)
    real_append = TraceWriter.append

    def slow_append(self: TraceWriter, values: np.ndarray, labels: dict[str, Any]) -> None:
        time.sleep(0.05)  # a slow disk: slower than the host produces batches
        real_append(self, values, labels)

    monkeypatch.setattr(TraceWriter, "append", slow_append)
    with tracediff.record(tmp_path / "s.zarr", on_full="block", max_queue_bytes=1, block_timeout=30) as rec:
        batches, outputs = host_run(tiny, seqs, recorder=rec)
    assert_same_host_results(outputs, reference)
    (group,) = read_plain(tmp_path / "s.zarr", "fc_in").values()
    assert group.commit["dropped_rows"] == 0 and group.commit["batches"] == len(batches)
    assert_bits_equal(group.values, np.concatenate([stored_bits(b.fc_input) for b in batches]))


# -------------------------------------------------------------------------------- sampling limits
ROW_BYTES = 3 * HIDDEN * 4  # one fp32 fc-input row


def _keep_first(n: int) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    return lambda rows: np.arange(len(rows["step"])) < n


LIMIT_CASES: dict[str, tuple[Limits, Callable[[dict[str, np.ndarray]], np.ndarray]]] = {
    "max_rows": (Limits(max_rows=25), _keep_first(25)),
    "max_rows_zero": (Limits(max_rows=0), _keep_first(0)),
    "max_bytes": (Limits(max_bytes=40 * ROW_BYTES + ROW_BYTES - 1), _keep_first(40)),
    "every_n_steps": (Limits(every_n_steps=3), lambda rows: rows["step"] % 3 == 0),
    "first_n_steps": (Limits(first_n_steps=2), lambda rows: rows["step"] < 2),
    "phases": (Limits(phases=frozenset({"decode"})), lambda rows: rows["phase"] == "decode"),
    "phases_and_max_rows": (
        Limits(phases=frozenset({"prefill"}), max_rows=30),
        lambda rows: (rows["phase"] == "prefill") & (np.cumsum(rows["phase"] == "prefill") <= 30),
    ),
}


@pytest.fixture(scope="module")
def limited_recordings(tmp_path_factory: pytest.TempPathFactory, tiny, seqs) -> tuple[Path, list[Any]]:
    """One engine run recorded by one recorder per case (each with its own limits and store)."""
    folder = tmp_path_factory.mktemp("limits")
    recorders = [tracediff.record(folder / f"{case}.zarr", limits=limits) for case, (limits, _) in LIMIT_CASES.items()]
    draft = DraftHead(HIDDEN, len(FC_LAYERS))
    for rec in recorders:
        rec.tap(draft.fc, name="fc_in")

    def on_batch(labels: dict[str, Any]) -> None:
        for rec in recorders:
            rec.labels(**labels)

    batches = PIPELINES["engine"](tiny, draft, seqs, FC_LAYERS, on_batch=on_batch, keep_inputs=True)
    for rec in reversed(recorders):  # last in, first out: each puts back the SIGTERM handler it found
        rec.close()
    return folder, batches


@pytest.mark.parametrize("case", list(LIMIT_CASES))
def test_sampling_limits_keep_the_chosen_rows_and_count_the_skipped(limited_recordings, case: str) -> None:
    folder, batches = limited_recordings
    limits, wanted = LIMIT_CASES[case]
    rows = expected_labels(batches)
    keep = wanted(rows)
    assert 0 <= keep.sum() < len(keep), "each case must skip something"
    values = np.concatenate([stored_bits(b.fc_input) for b in batches])
    batch_of_row = np.repeat(np.arange(len(batches)), [b.num_rows for b in batches])
    batches_without_rows = len(batches) - len(np.unique(batch_of_row[keep]))

    (group,) = read_plain(folder / f"{case}.zarr", "fc_in").values()
    assert group.rows == keep.sum()
    assert_bits_equal(group.values, values[keep])
    for key in ("seq", "position", "token_id", "step"):
        assert np.array_equal(group.labels[key], rows[key][keep]), key
    assert group.commit["skipped_rows"] == len(keep) - keep.sum()
    assert group.commit["skipped_batches"] == batches_without_rows
    assert group.commit["dropped_rows"] == 0 and group.commit["status"] == "closed"
    assert group.attrs["limits"] == limits.as_dict()


def test_bad_limits_are_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        Limits(every_n_steps=0)
    with pytest.raises(ValueError, match="max_rows"):
        Limits(max_rows=-1)
    with pytest.raises(ValueError, match="unknown phase"):
        Limits(phases=frozenset({"serving"}))
    with pytest.raises(ValueError, match="on_full"):
        tracediff.record(tmp_path / "s.zarr", on_full="wait")
    assert not (tmp_path / "s.zarr").exists()


# ------------------------------------------------------------------------------- process endings
@pytest.mark.slow
def test_normal_exit_without_close_flushes_and_commits_every_row(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    script = (
        "import sys, torch, tracediff\n"
        "layer = torch.nn.Linear(8, 2)\n"
        "rec = tracediff.record(sys.argv[1])\n"
        "rec.tap(layer, 'fc_in')\n"
        "for i in range(8):  # queued in microseconds, written in tens of milliseconds each\n"
        "    layer(torch.full((25, 8), float(i + 1)))\n"
        "print(rec.stats()['fc_in']['rows'])\n"  # no close(): the interpreter's exit must do it
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(store)], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["200"]
    (group,) = read_plain(store, "fc_in").values()
    assert group.commit["status"] == "closed" and group.rows == 200 and group.commit["batches"] == 8
    assert np.array_equal(group.values[:, 0], np.repeat(np.arange(1, 9, dtype=np.float32), 25))


@pytest.mark.slow
def test_sigterm_flushes_every_queued_row_and_the_process_still_dies_of_sigterm(tmp_path: Path, forkserver) -> None:
    store, log = tmp_path / "s.zarr", tmp_path / "queued.json"
    sizes = [30] * 10
    proc = forkserver.Process(target=record_then_wait_for_sigterm, args=(str(store), str(log), sizes))
    proc.start()
    wait_until(log.exists, what="the child to queue its batches")
    proc.terminate()  # SIGTERM
    proc.join(60)
    assert proc.exitcode == -signal.SIGTERM
    at_signal = json.loads(log.read_text())
    assert at_signal["queued"] == sum(sizes)
    assert at_signal["committed"] < sum(sizes), "the writer must still be behind when SIGTERM arrives"
    with TraceStore(store) as opened:
        (stream,) = opened.streams["fc_in"]
        assert stream.commit["status"] == "closed"
        assert stream.rows == sum(sizes) and stream.commit["batches"] == len(sizes)
        assert np.array_equal(stream.read()[:, 0], np.repeat(np.arange(1, 11, dtype=np.float32), 30))


@pytest.mark.slow
def test_sigkill_leaves_only_whole_batches(tmp_path: Path, forkserver) -> None:
    sizes = kill_batch_sizes()
    rng = random.Random(20261130)
    for attempt in range(5):
        store, log = tmp_path / f"killed{attempt}.zarr", tmp_path / f"killed{attempt}.log"
        proc = forkserver.Process(target=record_batches_until_killed, args=(str(store), str(log), sizes))
        proc.start()
        wait_until(lambda log=log: log.exists() and "\n" in log.read_text(), what="the first committed batch")
        time.sleep(rng.uniform(0.01, 0.5))
        proc.kill()
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        logged = log.read_text().count("\n")  # batches the child saw committed before it died

        with TraceStore(store) as opened:
            (stream,) = opened.streams["fc_in"]
            batches = stream.commit["batches"]
            assert logged <= batches <= logged + 1, "at most the batch in flight can be missing from the log"
            assert stream.commit["status"] == "recording"  # killed: never closed
            assert stream.rows == sum(sizes[:batches]), "the committed rows are a prefix of whole batches"
            batch_of_row = np.repeat(np.arange(batches), sizes[:batches])
            values = stream.read()
            assert np.array_equal(values, np.broadcast_to((batch_of_row + 1.0)[:, None], values.shape))
            labels = stream.labels()
            assert np.array_equal(labels["seq"], batch_of_row) and np.array_equal(labels["step"], batch_of_row)
            assert np.array_equal(labels["position"], np.concatenate([np.arange(n) for n in sizes[:batches]]))
        (plain,) = read_plain(store, "fc_in").values()  # a plain zarr reader sees the same rows
        assert plain.rows == stream.rows and np.array_equal(plain.values, values)
    shown = invoke_tracediff("inspect", store)
    assert shown.returncode == 0 and "did not close its writer (killed?)" in shown.stdout
