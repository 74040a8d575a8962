"""`tracediff record` fails on any row it lost, and says how many of which tap, why, and the flag.

Every case is a real command under `tracediff record`, its taps attached by the injected shim, a real
recorder and a writer really slower than the captures (1 MiB batches, zstd, an fsync a batch):

* the writer falls behind with ``--on-full drop`` and a small ``--queue-bytes``: the dropped batches
  are counted, and the run that lost them exits 2 instead of 0;
* a recording process is SIGKILLed while its writer still holds queued batches (how vLLM ends its
  worker) and the command itself exits 0: the rows it took but never committed are counted from its
  row ledger (:mod:`tracediff.record.ledger`), and the run exits 2;
* the same with ``--on-full block`` and room to queue everything, the process ending normally: every
  row committed, exit 0 (the ledger costs no false alarm).

In each, what the script captured (it prints it) = rows in the store + rows the error lines count.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import cli_env

from tracediff.record.ledger import Ledger, read_ledger
from tracediff.store import open_store

ROWS, WIDTH = 64, 4096  # one batch: 64 rows of 4096 float32 = 1 MiB

CHILD = textwrap.dedent(
    f"""
    import sys

    import torch


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear({WIDTH}, 8)

        def forward(self, x):
            return self.fc(x)


    if __name__ == "__main__":
        batches = int(sys.argv[1])
        net = Net()
        x = torch.randn({ROWS}, {WIDTH})
        with torch.no_grad():
            for _ in range(batches):
                net(x)
        print(f"captured {{batches * {ROWS}}}", flush=True)
        if sys.argv[2] == "wait":
            sys.stdin.read()  # until the parent kills us
    """
)

PARENT = textwrap.dedent(
    """
    import subprocess
    import sys

    # The "engine": records, tells how many rows it fed, and is SIGKILLed with its writer behind.
    child = subprocess.Popen([sys.executable, "child.py", sys.argv[1], "wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    child.kill()
    child.wait()
    print(line.strip(), "then killed", flush=True)
    sys.exit(0)
    """
)

LOST = re.compile(r"tracediff: error: fc_in(?:/[\w-]+)? \(pid \d+\): ([\d,]+) of ([\d,]+) rows (dropped|were taken)")


def _record(tmp_path: Path, *options: str, command: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    store = tmp_path / "out.zarr"
    run = subprocess.run([sys.executable, "-m", "tracediff", "record", "--tap", "Net.fc:input", "--compressor", "zstd",
                          "--durable", *options, "-o", str(store), "--", sys.executable, *command],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    return run, store


def _stored(store: Path) -> int:
    if not store.exists():
        return 0
    with open_store(store) as s:
        return s.rows("fc_in") if "fc_in" in s.taps else 0


def _captured(run: subprocess.CompletedProcess[str]) -> int:
    return int(re.search(r"captured (\d+)", run.stdout).group(1))


def test_batches_dropped_when_the_writer_falls_behind_fail_the_run_and_name_the_flag(tmp_path: Path) -> None:
    run, store = _record(tmp_path, "--on-full", "drop", "--queue-bytes", "2MiB",
                         command=["child.py", "200", "exit"])
    lost = [(int(a.replace(",", "")), int(b.replace(",", "")), kind) for a, b, kind in LOST.findall(run.stderr)]
    assert len(lost) == 1 and lost[0][2] == "dropped", run.stderr
    dropped, offered, _ = lost[0]
    assert offered == _captured(run) == 200 * ROWS
    assert dropped > 0 and _stored(store) + dropped == offered, run.stderr
    assert "--on-full block" in run.stderr and "--queue-bytes" in run.stderr
    assert "the queue held" in run.stderr  # why: which budget was full
    assert run.returncode == 2, run.stderr  # the command exited 0


@pytest.mark.parametrize("interval", [None, "60"], ids=["a-commit-a-batch", "commit-interval"])
def test_rows_a_killed_process_had_not_committed_are_counted_and_fail_a_command_that_exited_0(tmp_path: Path,
                                                                                             interval) -> None:
    # --commit-interval: the rows the writer was gathering when the kill came are lost, and counted.
    options = ["--commit-interval", interval] if interval else []
    run, store = _record(tmp_path, "--on-full", "block", *options, command=["parent.py", "200"])
    assert "then killed" in run.stdout, run.stdout + run.stderr
    lost = [(int(a.replace(",", "")), int(b.replace(",", "")), kind) for a, b, kind in LOST.findall(run.stderr)]
    assert len(lost) == 1 and lost[0][2] == "were taken", run.stderr
    never, offered, _ = lost[0]
    assert offered == _captured(run) == 200 * ROWS
    assert never > 0 and _stored(store) + never == offered, run.stderr
    assert "killed before it closed its recorder" in run.stderr
    assert run.returncode == 2, run.stderr


def test_a_run_that_committed_every_row_it_took_exits_0(tmp_path: Path) -> None:
    run, store = _record(tmp_path, "--on-full", "block", command=["child.py", "20", "exit"])
    assert run.returncode == 0, run.stderr
    assert _stored(store) == _captured(run) == 20 * ROWS
    assert "error" not in run.stderr, run.stderr


def test_the_ledger_keeps_its_counts_after_the_process_that_wrote_them_is_killed(tmp_path: Path) -> None:
    """The counts live in a shared file mapping: a SIGKILL right after a count does not lose it."""
    code = textwrap.dedent(
        f"""
        import os, signal
        from tracediff.record.ledger import COMMITTED, OFFERED, SKIPPED, SWITCHED_OFF, Ledger
        ledger = Ledger({str(tmp_path)!r})
        ledger.add("fc_in", OFFERED, 640)
        ledger.add("fc_in", COMMITTED, 64)
        ledger.set_group("fc_in", "fc_in/pid1")
        ledger.add("draft_steps", OFFERED, 3)
        ledger.add("draft_steps", SKIPPED, 3)
        ledger.add("draft_steps", SWITCHED_OFF, 3)  # seen while recording was switched off
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    (header,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-ledger*.json")]
    counts = read_ledger(header, tmp_path)
    assert counts == {
        "fc_in": {"offered": 640, "committed": 64, "dropped": 0, "skipped": 0, "switched_off": 0, "group": "fc_in/pid1",
                  "reason": ""},
        "draft_steps": {"offered": 3, "committed": 0, "dropped": 0, "skipped": 3, "switched_off": 3, "group": None,
                        "reason": ""}}


@pytest.mark.parametrize("bad", ["missing", "short"])
def test_a_ledger_whose_counts_cannot_be_read_gives_no_counts(tmp_path: Path, bad: str) -> None:
    ledger = Ledger(tmp_path)
    ledger.add("fc_in", 0, 5)
    header = {"bin": ledger.bin_path.name, "taps": {"fc_in": 300}}  # a slot past the file's end
    if bad == "missing":
        header = {"bin": "nowhere.bin", "taps": {"fc_in": 0}}
    assert read_ledger(header, tmp_path) == {}


def test_rows_an_adapter_could_not_capture_are_counted_lost_with_its_reason(tmp_path: Path) -> None:
    """An adapter that sees rows it cannot label (``Recorder.count_lost``): counted in the store, the
    outcome and the ledger, and `record` says how many and why (not the writer's pace: no flag)."""
    import torch

    import tracediff
    from tracediff.record.inject import read_notes, recording_problems

    notes = tmp_path / "notes"
    notes.mkdir()
    with tracediff.record(tmp_path / "s.zarr", ledger=Ledger(notes)) as rec:
        rec.capture("fc_in", torch.ones(5, 8))
        rec.count_lost("fc_in", 7, "a drafter batch whose rows do not match its query_start_loc")
        rec.count_lost("draft_steps", 3, "a draft step's logits had (2, 100) rows for 3 requests")
    outcome = rec.outcome()["taps"]
    assert outcome["fc_in"]["rows"] == 5 and outcome["fc_in"]["dropped_rows"] == 7
    assert outcome["draft_steps"]["dropped_rows"] == 3
    with open_store(tmp_path / "s.zarr") as s:
        (stream,) = s.tap_streams("fc_in")
        assert stream.commit["dropped_rows"] == 7
    problems = recording_problems(read_notes(notes), {outcome["fc_in"]["group"]: 5})
    assert problems == [
        f"{outcome['fc_in']['group']} (pid {os.getpid()}): 7 of 12 rows lost, not recorded: a drafter batch whose rows "
        f"do not match its query_start_loc",
        f"draft_steps (pid {os.getpid()}): 3 of 3 rows lost, not recorded: a draft step's logits had (2, 100) rows for "
        f"3 requests"], problems


def test_waiting_for_the_writer_bounds_the_backlog_a_kill_can_take(tmp_path: Path) -> None:
    """``wait_for_writer(N)`` (what the vLLM adapter calls after each drafter call with --commit
    background): returns once at most N batches are queued and unwritten; at its timeout, False."""
    import torch

    import tracediff

    with tracediff.record(tmp_path / "s.zarr", compressor="zstd", durable=True, on_full="block") as rec:
        x = torch.randn(ROWS, WIDTH)
        for _ in range(40):
            rec.capture("fc_in", x)
        behind = rec._enqueued - rec._done
        assert behind > 4  # the writer really is behind (an fsync a 1 MiB batch)
        assert rec.wait_for_writer(4, timeout=0.0) is False
        assert rec.wait_for_writer(4, timeout=120.0) is True
        assert rec._enqueued - rec._done <= 4
    assert rec.wait_for_writer(0) is True  # closed: nothing left to wait for


def test_a_ledger_alone_says_why_a_stopped_tap_lost_rows_without_a_phantom_queued_loss(tmp_path: Path) -> None:
    """A process killed after one of its taps stopped on an error leaves only its ledger: the line
    gives the error as the reason (not the writer's pace), and rows counted once, not twice."""
    import torch

    from tracediff.record.inject import read_notes, recording_problems
    from tracediff.record.recorder import Recorder

    notes = tmp_path / "notes"
    notes.mkdir()
    rec = Recorder(tmp_path / "s.zarr", ledger=Ledger(notes), handle_sigterm=False)
    try:
        rec.capture("fc_in", torch.ones(5, 8))
        rec.capture("fc_in", torch.ones(5, 8), labels={"phase": "no-such-phase"})  # the tap stops here
        rec.capture("fc_in", torch.ones(3, 8))
        assert rec.flush(timeout=60)
        (line,) = recording_problems(read_notes(notes))  # what record says if the process died now
    finally:
        rec.close()
    assert line.startswith(f"fc_in/pid{os.getpid()} (pid {os.getpid()}): 8 of 13 rows lost, not recorded: tap "
                           f"'fc_in' stopped recording after an error in its capture"), line
    assert "--on-full" not in line


def test_the_vllm_advice_for_a_killed_worker_names_what_the_run_lacked() -> None:
    """record runs outside vLLM's processes: the adapter reads --commit from the recording's config
    (the store's meta.record), not from an activation config it does not have."""
    from tracediff.adapters import vllm

    serve = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "t", "--speculative-config", "{}",
             "--no-enable-prefix-caching"]
    step = vllm.loss_advice(serve, {"commit": "step"})
    assert "--shutdown-timeout 10" in step and "--commit step" not in step
    background = vllm.loss_advice(serve, {"commit": "background"})
    assert "--shutdown-timeout 10" in background and "--commit step" in background
    graceful = vllm.loss_advice([*serve, "--shutdown-timeout", "10"], {"commit": "background"})
    assert "--commit step" in graceful and "--shutdown-timeout" not in graceful
    rows = {"taps": {"fc_in": {"rows": 3}}}
    warned = vllm.record_warnings(serve, {**rows, "meta": {"record": {"commit": "background"}}})
    assert any("--shutdown-timeout 10" in w for w in warned), warned
    assert not vllm.record_warnings(serve, {**rows, "meta": {"record": {"commit": "step"}}})
