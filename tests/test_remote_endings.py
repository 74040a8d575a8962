"""Every way a recording to object storage can end, and what each leaves: the committed rows
survive, nothing reported as committed is missing, and rows that could not be committed are
reported with their count, never silently.

Each case runs a real ``tracediff record -o s3://... -- python child.py`` (tests/object_store.py
``ENDING_SCRIPT``: batch i is ``3 + i % 5`` rows of the value i + 1, labelled seq i) against moto's
S3 server on 127.0.0.1. The endpoint that goes away is an :class:`~object_store.Endpoint`, a relay
in front of that server which the test closes (connections refused, open ones reset) and opens
again on the same port; the buckets live on behind it, and the test reads them directly. Where the
endpoint goes away, botocore's own retries are turned off
(``--storage-option config_kwargs.retries.max_attempts=1``), so that what rides out the outage is
tracediff's own retry, not luck in botocore's random backoff.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env
from object_store import (
    ENDING_SCRIPT,
    ENDING_WIDTH,
    Endpoint,
    ObjectStore,
    ending_batch_rows,
    object_store,
    record_until_close_times_out,
)

from tracediff.store import open_store

__all__ = ["object_store"]  # the fixture, used by name

NO_BOTOCORE_RETRIES = ("--storage-option", "config_kwargs.retries.max_attempts=1")


def _record(tmp_path: Path, url: str, *child: object, options: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """``tracediff record`` of ENDING_SCRIPT with ``child`` arguments (pace, commit, batches), its
    stdout and stderr piped."""
    (tmp_path / "child.py").write_text(ENDING_SCRIPT)
    command = [sys.executable, "-m", "tracediff", "record", "--tap", "Head.fc:input", "--chunk-rows", "16",
               *options, "-o", url, "--", sys.executable, "child.py", *map(str, child)]  # fmt: skip
    return subprocess.Popen(command, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _lines(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def _wait_for(path: Path, count: int, proc: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while _lines(path) < count:
        if proc.poll() is not None:
            _out, err = proc.communicate()
            pytest.fail(f"the recording ended before {path.name} had {count} lines:\n{err[-4000:]}")
        assert time.monotonic() < deadline, f"{path.name} never reached {count} lines"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started for it, nothing else
        proc.communicate()
        pytest.fail("the recording did not end: a stall")
    return err


def _committed(url: str) -> Any:
    """The one writer group at ``url``, opened with the strict reader, after checking that it holds
    whole batches 0..k-1, bit for bit what the child fed its layer: returns the stream."""
    with open_store(url) as store:
        (stream,) = store.streams["fc_in"]
        batches = stream.commit["batches"]
        sizes = [ending_batch_rows(i) for i in range(batches)]
        assert stream.rows == sum(sizes)
        seq = stream.label("seq")
        assert np.array_equal(seq, np.repeat(np.arange(batches), sizes))
        assert np.array_equal(stream.label("position"), np.concatenate([np.arange(n) for n in sizes] or [[]]))
        values = stream.read_float32()
        assert values.shape == (stream.rows, ENDING_WIDTH)
        assert np.array_equal(values, np.repeat(seq[:, None] + 1.0, ENDING_WIDTH, axis=1))
    return stream


def _summary_rows(stderr: str, writer: str) -> int:
    """Rows the summary of `tracediff record` says the group committed."""
    match = re.search(rf"fc_in/{re.escape(writer)}: (\d+) rows,", stderr)
    assert match, stderr
    return int(match.group(1))


def _fed_rows(batches: int) -> int:
    return sum(ending_batch_rows(i) for i in range(batches))


def _report(reliability_report: dict[str, Any], ending: str, **counts: Any) -> None:
    """What one ending left, for the reliability counts (docs/reliability.md quotes them)."""
    reliability_report.setdefault("remote_endings", {})[ending] = counts


# ----------------------------------------------------------------------------- the endings
@pytest.mark.slow
def test_a_recording_that_ends_normally_has_committed_every_row_it_was_given(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    url = f"s3://{object_store.bucket()}/normal.zarr"
    (tmp_path / "last").touch()
    err = _finish(_record(tmp_path, url, 0, 0, 24))
    assert "tracediff: command exited with code 0" in err and "tracediff: error" not in err, err
    assert _lines(tmp_path / "fed.log") == 24
    stream = _committed(url)
    assert stream.commit["batches"] == 24 and stream.commit["status"] == "closed"
    assert stream.commit["dropped_rows"] == 0
    assert _summary_rows(err, stream.writer) == stream.rows == _fed_rows(24)
    _report(reliability_report, "normal_exit", rows_fed=_fed_rows(24), rows_committed=stream.rows, rows_lost=0,
            exit_code=0)


@pytest.mark.slow
def test_sigterm_commits_what_was_queued_and_the_exit_code_says_sigterm(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    """SIGTERM to `tracediff record` (a scheduler's stop) is forwarded to the command, whose
    recorder writes what is queued and closes its group before the signal ends the process."""
    url = f"s3://{object_store.bucket()}/terminated.zarr"
    proc = _record(tmp_path, url, 0.02, 0, 0, options=("--on-full", "block"))
    _wait_for(tmp_path / "fed.log", 25, proc)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "tracediff: error" not in err and "Traceback" not in err, err
    fed = _lines(tmp_path / "fed.log")
    stream = _committed(url)
    # Every batch the child fed before the signal, and at most the one whose log line it had not
    # written yet; the group closed: nothing queued was left behind.
    assert fed <= stream.commit["batches"] <= fed + 1
    assert stream.commit["status"] == "closed" and stream.commit["dropped_rows"] == 0
    assert _summary_rows(err, stream.writer) == stream.rows
    _report(reliability_report, "sigterm", batches_fed_before_the_signal=fed, batches_committed=stream.commit["batches"],
            rows_committed=stream.rows, rows_lost=0, exit_code=proc.returncode)


@pytest.mark.slow
def test_sigkill_mid_upload_keeps_every_batch_reported_committed_and_record_says_so(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    """The command's process SIGKILLed (the OOM killer) while it uploads: `tracediff record` lives
    on, exits 128 + 9, and names the group that was never closed; the store holds every batch the
    child saw committed, whole."""
    url = f"s3://{object_store.bucket()}/killed.zarr"
    proc = _record(tmp_path, url, 0, 1, 0)
    _wait_for(tmp_path / "committed.log", 8, proc)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)  # the child, which is uploading batch 9
    err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err
    logged = _lines(tmp_path / "committed.log")
    stream = _committed(url)
    assert stream.commit["batches"] >= logged
    assert stream.commit["status"] == "recording"
    assert _summary_rows(err, stream.writer) == stream.rows
    assert f"fc_in/{stream.writer}: the process did not close its writer (killed?)" in err
    _report(reliability_report, "sigkill_mid_upload", batches_seen_committed=logged,
            batches_committed=stream.commit["batches"], batches_fed=_lines(tmp_path / "fed.log"),
            exit_code=proc.returncode)


@pytest.mark.slow
def test_an_endpoint_gone_for_seconds_costs_no_row(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    """The endpoint goes away for 4 s while the command records, then comes back: the writer sends
    the failed batch again until it goes through, the rows fed meanwhile wait in the queue, and
    every row is committed; two warnings say it (retrying, went through), no error, exit 0."""
    url = f"s3://{object_store.bucket()}/outage.zarr"
    with Endpoint(object_store.endpoint) as endpoint:
        proc = _record(tmp_path, url, 0.1, 0, 0,
                       options=("--storage-option", f"endpoint_url={endpoint.url}", *NO_BOTOCORE_RETRIES))  # fmt: skip
        _wait_for(tmp_path / "fed.log", 10, proc)
        endpoint.go_away()
        before = _lines(tmp_path / "fed.log")
        time.sleep(4)
        during = _lines(tmp_path / "fed.log") - before
        endpoint.come_back()
        (tmp_path / "last").touch()
        err = _finish(proc)
    assert proc.returncode == 0, err
    assert "tracediff: error" not in err and "Traceback" not in err, err
    assert during > 0  # the host went on while the endpoint was away
    retrying = [line for line in err.splitlines() if "sending it again for up to" in line]
    through = [line for line in err.splitlines() if re.search(r"went through after \d+ retries", line)]
    assert retrying and len(through) == len(retrying), err
    fed = _lines(tmp_path / "fed.log")
    stream = _committed(url)
    assert stream.commit["batches"] == fed and stream.commit["status"] == "closed"
    assert stream.commit["dropped_rows"] == 0
    assert _summary_rows(err, stream.writer) == stream.rows == _fed_rows(fed)
    retries = sum(int(re.search(r"after (\d+) retries", line).group(1)) for line in through)
    _report(reliability_report, "endpoint_away_4s", batches_fed=fed, batches_fed_while_away=during,
            rows_committed=stream.rows, rows_lost=0, outages_seen=len(retrying), retries=retries,
            exit_code=proc.returncode)


@pytest.mark.slow
def test_an_endpoint_gone_for_good_is_one_error_the_host_goes_on_and_the_loss_is_counted(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    """The endpoint goes away and never comes back. The writer retries for --retry-seconds, then
    stops: the command logs one error line and later the count, feeds every batch it meant to and
    exits 0; `tracediff record` prints the rows committed and lost and exits 2 (it cannot read the
    store for its summary: that is said too). The store, read directly, holds the committed rows."""
    url = f"s3://{object_store.bucket()}/gone.zarr"
    (tmp_path / "last").touch()
    with Endpoint(object_store.endpoint) as endpoint:
        proc = _record(tmp_path, url, 0.05, 1, 40,
                       options=("--storage-option", f"endpoint_url={endpoint.url}", *NO_BOTOCORE_RETRIES,
                                "--retry-seconds", "2"))  # fmt: skip
        _wait_for(tmp_path / "committed.log", 8, proc)
        endpoint.go_away()
        err = _finish(proc)
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    assert _lines(tmp_path / "fed.log") == 40  # the host went on to the end
    lines = err.splitlines()
    # The command's own log: one error when recording stopped, one line with the count at the end.
    assert len([line for line in lines if line.startswith("tracediff: recording disabled after an error")]) == 1, err
    counted = [line for line in lines if re.search(r": \d+ rows committed, \d+ rows lost after the error", line)]
    assert len(counted) == 1, err
    # What `tracediff record` says: the group, rows committed and lost, the store it cannot read.
    problems = [line for line in lines if line.startswith("tracediff: error: fc_in/")]
    assert len(problems) == 1, err
    committed, lost = map(int, re.search(r"after (\d+) committed rows, (\d+) rows lost", problems[0]).groups())
    assert any(line.startswith("tracediff: error: no summary of the store after the run: s3://") for line in lines)
    assert lines[-1] == ("tracediff: error: recording lost rows (above); exit code 2, the command itself exited "
                         "with code 0")
    assert committed + lost == _fed_rows(40) and lost > 0
    stream = _committed(url)
    # Nothing reported as committed is missing, to the child (each batch it logged) or by record (a
    # commit record that arrived unanswered may hold one batch more than the writer knew of: that
    # batch is counted lost, never the other way).
    assert stream.commit["batches"] >= _lines(tmp_path / "committed.log") >= 8
    assert committed <= stream.rows <= committed + max(ending_batch_rows(i) for i in range(5))
    assert stream.commit["status"] == "recording"  # the final commit record never reached it
    _report(reliability_report, "endpoint_gone_for_good", rows_fed=_fed_rows(40), rows_reported_committed=committed,
            rows_reported_lost=lost, rows_in_the_store=stream.rows, error_lines_of_the_host=1,
            exit_code=proc.returncode)


@pytest.mark.slow
def test_an_endpoint_that_stops_answering_cannot_stall_close_and_the_queued_rows_are_reported(
    object_store: ObjectStore, tmp_path: Path, reliability_report: dict[str, Any]
) -> None:
    """A hung endpoint (connections accepted, never answered) holds the writer in a request far
    longer than any retry time: close(timeout) still returns, the rows it could not commit are
    counted as lost in the outcome it reports (once), and the committed ones stay readable."""
    url = f"s3://{object_store.bucket()}/hung.zarr"
    with Endpoint(object_store.endpoint) as endpoint:
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=record_until_close_times_out, args=(url, endpoint.url, str(tmp_path)))
        child.start()
        try:
            deadline = time.monotonic() + 180
            while not (tmp_path / "committed").exists():
                assert child.is_alive() and time.monotonic() < deadline, "the child never committed its first batch"
                time.sleep(0.02)
            endpoint.go_silent()
            (tmp_path / "go").touch()
            child.join(timeout=120)
            assert child.exitcode == 0, "the child did not end: close stalled"
        finally:
            if child.is_alive():
                child.kill()
                child.join()
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert len(reports) == 1  # on_close: once
    (tap,) = reports[0]["taps"].values()
    assert tap["rows"] == ending_batch_rows(0)
    assert tap["dropped_rows"] == sum(ending_batch_rows(i) for i in range(1, 4))
    assert "had not finished when the recorder stopped waiting: " in tap["error"]
    stream = _committed(url)
    assert stream.rows == ending_batch_rows(0)
    _report(reliability_report, "endpoint_hung", rows_committed=tap["rows"], rows_reported_lost=tap["dropped_rows"],
            close_timeout_s=3, reports=len(reports))


def test_a_bucket_whose_name_says_bucket_records_like_any_other(object_store: ObjectStore) -> None:
    """A prefix with nothing under it is s3fs's FileNotFoundError naming the path: with "bucket" in
    the bucket's name it was taken for a missing bucket ("create the bucket first")."""
    import torch

    import tracediff

    bucket = f"my-bucket-{uuid.uuid4().hex[:8]}"
    object_store.fs.mkdir(bucket)
    layer = torch.nn.Linear(ENDING_WIDTH, 2)
    with tracediff.record(f"s3://{bucket}/x.zarr") as rec:
        rec.tap(layer, "fc_in")
        layer(torch.ones(3, ENDING_WIDTH))
    with open_store(f"s3://{bucket}/x.zarr") as store:
        assert store.rows("fc_in") == 3
