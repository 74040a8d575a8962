"""`tracediff record --overwrite` never loses a good recording to a run that records nothing, and a
run whose taps never fired never exits 0.

Every store here is recorded by a real `tracediff record -- python script.py` of a tiny torch
module (576 rows: 9 forwards of 64 rows), and every rerun is a real command in a real subprocess:
one that raises before its first forward, one whose tap class is mistyped, one that records, and a
`record` process SIGKILLed while its command runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import CliResult, cli_env, invoke_tracediff, run_tracediff

HEAD = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path

    import torch


    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x)


    steps = int(sys.argv[1])
    wait_gone = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    if wait_gone is not None and not wait_gone.exists():
        sys.exit(6)  # the previous store must wait aside until a row is committed
    head = Head()
    with torch.no_grad():
        for step in range(steps):
            head(torch.full((64, 8), float(step)))
    if wait_gone is not None:
        # record deletes the previous store once this run has committed a row, while it runs.
        deadline = time.monotonic() + 60
        while wait_gone.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(7 if wait_gone.exists() else 0)
    """
)

CRASH = "import torch\nraise RuntimeError('the data loader failed before the first forward')\n"

# Starts, says so, and waits (never reaching a forward) until the test lets it end.
BLOCKED = textwrap.dedent(
    """
    import os
    import sys
    import time
    from pathlib import Path

    import torch

    Path(sys.argv[1]).write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)

OLD_ROWS = 576


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good 576-row store, recorded once; each test works on a copy."""
    work = tmp_path_factory.mktemp("good")
    (work / "head.py").write_text(HEAD)
    store = work / "it.zarr"
    result = run_tracediff("record", "--tap", "Head.fc:input", "--role", "old", "-o", store, "--",
                           sys.executable, "head.py", "9", cwd=work, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _rows(store) == OLD_ROWS
    return store


@pytest.fixture
def old_store(recorded: Path, tmp_path: Path) -> Path:
    for name, text in (("head.py", HEAD), ("crash.py", CRASH), ("blocked.py", BLOCKED)):
        (tmp_path / name).write_text(text)
    store = tmp_path / "it.zarr"
    shutil.copytree(recorded, store)
    return store


def _rows(store: Path) -> int:
    shown = invoke_tracediff("inspect", "--json", "-", store)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["taps"]["fc_in"]["rows"]


def _digest(store: Path) -> str:
    """Every file of the store, path and bytes."""
    h = hashlib.sha256()
    for path in sorted(p for p in store.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(store)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _record_over(store: Path, tap: str, script: str, *args: str) -> CliResult:
    return invoke_tracediff("record", "--overwrite", "--tap", tap, "--role", "new", "-o", store, "--",
                            sys.executable, store.parent / script, *args)  # fmt: skip


def _siblings(store: Path) -> list[str]:
    """What sits next to the store that is no script of the test."""
    return sorted(p.name for p in store.parent.iterdir() if p.suffix != ".py")


def test_a_command_that_fails_before_its_first_forward_keeps_the_old_store(old_store: Path) -> None:
    before = _digest(old_store)
    result = _record_over(old_store, "Head.fc:input", "crash.py")
    assert result.returncode == 1, result.stderr
    assert "tracediff: command exited with code 1; store" in result.stderr
    assert f"tracediff: kept the previous store at {old_store}: this run recorded no rows" in result.stderr
    assert _digest(old_store) == before and _rows(old_store) == OLD_ROWS
    assert _siblings(old_store) == ["it.zarr"]


def test_a_mistyped_tap_class_exits_non_zero_and_keeps_the_old_store(old_store: Path) -> None:
    before = _digest(old_store)
    result = _record_over(old_store, "Haed.fc:input", "head.py", "3")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tracediff: error: ")]
    assert len(errors) == 1, result.stderr
    assert "no row was recorded: tap 'fc_in' (--tap Haed.fc:input) never fired in any process" in errors[0]
    assert "check the class name" in errors[0] and "the command itself exited with code 0" in errors[0]
    assert f"tracediff: kept the previous store at {old_store}: this run recorded no rows" in result.stderr
    assert _digest(old_store) == before and _rows(old_store) == OLD_ROWS
    assert _siblings(old_store) == ["it.zarr"]


def test_a_run_that_records_replaces_the_old_store_once_its_first_row_is_committed(old_store: Path) -> None:
    aside = old_store.with_name("it.zarr.previous")
    # The script exits 6 unless the old store waits aside when it starts, and 7 unless record
    # deletes it while the script still runs (after its rows are committed).
    result = _record_over(old_store, "Head.fc:input", "head.py", "3", str(aside))
    assert result.returncode == 0, result.stderr
    assert f"tracediff: moved the previous store to {aside}" in result.stderr
    shown = json.loads(invoke_tracediff("inspect", "--json", "-", old_store).stdout)
    assert shown["source"]["role"] == "new" and shown["taps"]["fc_in"]["rows"] == 3 * 64
    assert _siblings(old_store) == ["it.zarr"]  # no backup, no half-deleted folder


def test_a_sigkilled_record_leaves_the_old_store_where_it_said(old_store: Path) -> None:
    before = _digest(old_store)
    started, finish = old_store.parent / "started", old_store.parent / "finish"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracediff", "record", "--overwrite", "--tap", "Head.fc:input", "-o", str(old_store),
         "--", sys.executable, "blocked.py", str(started), str(finish)],
        cwd=old_store.parent, env=cli_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        told = ""  # printed before the command starts
        while not told.startswith("tracediff: moved the previous store"):
            told = proc.stderr.readline()
            assert told, "record ended without naming where the previous store went"
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), told
        proc.send_signal(signal.SIGKILL)  # record itself, mid-run
        proc.wait(timeout=30)
    finally:
        finish.touch()  # the command ends by itself
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()
    aside = old_store.with_name("it.zarr.previous")
    assert told.strip() == (f"tracediff: moved the previous store to {aside}: it is deleted once this run commits "
                            f"its first row, and moved back to {old_store} if the run commits none")  # fmt: skip
    assert _digest(aside) == before and _rows(aside) == OLD_ROWS
    # A later --overwrite never replaces the store an interrupted run kept aside.
    again = _record_over(old_store, "Head.fc:input", "head.py", "1")
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert again.stderr.startswith(f"tracediff: error: {aside}: holds the store an interrupted `record --overwrite`")
    assert _digest(aside) == before


def test_an_existing_store_without_overwrite_is_refused_in_the_clis_words(old_store: Path) -> None:
    result = invoke_tracediff("record", "--tap", "Head.fc", "-o", old_store, "--", sys.executable, "-c", "pass")
    assert result.returncode == 2
    assert result.stderr == f"tracediff: error: {old_store}: already exists; pass --overwrite to replace it\n"


def test_record_help_documents_every_exit_code() -> None:
    shown = invoke_tracediff("record", "--help").stdout
    codes = shown[shown.index("Exit codes:"):]
    assert "0    the command exited 0" in codes and "2    a bad option" in codes and "N    any other" in codes
    assert "STORE.previous" in shown and "at a URL it is deleted before the command starts" in " ".join(shown.split())


# ------------------------------------------------------------- the Python API: tracediff.record(overwrite=True)
API_RUN = textwrap.dedent(
    """
    import os
    import sys
    import time
    from pathlib import Path

    import torch
    import tracediff

    store, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fc = torch.nn.Linear(8, 4)
    with tracediff.record(store, role="new", overwrite=True) as rec:
        rec.tap(fc, name="fc_in", capture="input")
        if mode == "raise":
            raise RuntimeError("the data loader failed before the first forward")
        with torch.no_grad():
            for step in range(steps):
                fc(torch.full((64, 8), float(step)))
        if mode == "hang":  # a trainer that dies mid-run, before its recorder closed
            Path(store + ".started").write_text(str(os.getpid()))
            time.sleep(120)
    """
)


def _api_run(store: Path, steps: int, mode: str = "finish") -> subprocess.CompletedProcess:
    (store.parent / "api_run.py").write_text(API_RUN)
    return subprocess.run([sys.executable, "api_run.py", str(store), str(steps), mode], cwd=store.parent,
                          env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_python_api_replaces_the_old_store_only_once_the_new_run_committed_rows(old_store: Path) -> None:
    done = _api_run(old_store, 3)
    assert done.returncode == 0, done.stderr
    assert _rows(old_store) == 3 * 64
    assert f"moved the previous store to {old_store}.previous" in done.stderr
    assert _siblings(old_store) == ["it.zarr"]  # the old store deleted, no backup left


def test_the_python_api_gives_the_old_store_back_when_the_run_records_nothing(old_store: Path) -> None:
    before = _digest(old_store)
    done = _api_run(old_store, 0, "raise")
    assert done.returncode == 1 and "the data loader failed" in done.stderr
    assert f"this run committed no row: the previous store is back at {old_store}" in done.stderr
    assert _digest(old_store) == before and _siblings(old_store) == ["it.zarr"]


def test_a_killed_trainer_using_the_python_api_leaves_the_old_store_aside(old_store: Path) -> None:
    before = _digest(old_store)
    (old_store.parent / "api_run.py").write_text(API_RUN)
    started = Path(str(old_store) + ".started")
    proc = subprocess.Popen([sys.executable, "api_run.py", str(old_store), "0", "hang"], cwd=old_store.parent,
                            env=cli_env(), stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert started.exists(), "the trainer never reached its run"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    aside = old_store.with_name("it.zarr.previous")
    assert _digest(aside) == before and _rows(aside) == OLD_ROWS


def test_a_second_tap_that_never_fires_exits_2_and_keeps_the_other_taps_rows(old_store: Path) -> None:
    """Two taps asked for, one class mistyped: the store lacks what was asked, so never exit 0; the rows
    of the tap that fired stay, and the error says which tap."""
    store = old_store.parent / "two.zarr"
    result = invoke_tracediff("record", "--tap", "Head.fc:input", "--tap", "extra=Haed.fc:output", "-o", store, "--",
                              sys.executable, old_store.parent / "head.py", "3")  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("tracediff: error:")]
    assert errors == [f"tracediff: error: tap 'extra' (--tap extra=Haed.fc:output) recorded no row while the other "
                      f"taps did (their rows are in {store}); exit code 2, the command itself exited with code 0"]
    assert "never fired in any process" not in result.stderr  # one line for one problem
    shown = json.loads(invoke_tracediff("inspect", "--json", "-", store).stdout)
    assert shown["taps"]["fc_in"]["rows"] == 3 * 64


def test_a_deletion_a_killed_run_left_behind_is_finished_by_the_next_overwrite(old_store: Path) -> None:
    """A SIGKILL while record deleted the old store (renamed first to a hidden folder) leaves that
    folder; the next --overwrite of the same path removes it, and never one whose process still runs."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = old_store.parent / f".it.zarr.previous.deleting-{int(gone.stdout)}"
    running = old_store.parent / f".it.zarr.previous.deleting-{os.getpid()}"
    for folder in (abandoned, running):
        shutil.copytree(old_store, folder)
    result = _record_over(old_store, "Head.fc:input", "head.py", "1")
    assert result.returncode == 0, result.stderr
    assert not abandoned.exists() and running.exists()
