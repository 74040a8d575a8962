"""How the reading commands end (issue #48, "clear exits"): a signal is one ``tracediff:`` line and
130 or 143 (never click's ``Aborted!`` and 1, which reads as "mismatch"), a report path that cannot
be written is refused before anything is read, a report that fails to write at the end still leaves
the verdict on stdout, every command's help states its exit codes, and no "done" line comes before an
error.

Real ``tracediff`` subprocesses on real stores; the signals are sent by pid to a compare in its
streaming pass (a store pair whose pass takes seconds: the progress status lines in a log say when
it is there).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli_env

SAMPLES = REPO / "samples"
TRAIN, BROKEN, BANK = SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", SAMPLES / "bank.zarr"
STATUS = "tracediff compare: "  # the progress status lines of a compare in a log


@pytest.fixture(scope="module")
def long_pass(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A trainer and a server store of 49,152 rows of 3 x 1024 bf16 (blosc-zstd: small on disk, each
    chunk decoded in the pass) that match: a compare whose streaming pass takes a few seconds."""
    from tracediff.store import TraceWriter, create_store  # noqa: PLC0415
    from tracediff.store import encode_bfloat16 as bf16  # noqa: PLC0415

    root = tmp_path_factory.mktemp("long-pass")
    seq_len, n_seq, segment = 256, 192, 1024
    rng = np.random.default_rng(0)
    base = rng.integers(-3, 4, size=(seq_len * 4, 3 * segment)).astype(np.float32)
    sides = {"train.zarr": ("trainer", bf16(base)), "server.zarr": ("server", bf16(base * np.float32(1 + 2**-7)))}
    for name, (role, values) in sides.items():
        create_store(root / name, role=role, meta={"hidden_size": segment})
        writer = TraceWriter(root / name, "fc_in", "rank0", width=3 * segment, dtype="bfloat16", chunk_rows=256,
                             compressor="zstd", attrs={"segment_size": segment})
        order = list(range(n_seq)) if role == "trainer" else list(reversed(range(n_seq)))  # another order
        for lo in range(0, n_seq, 32):
            seqs = order[lo : lo + 32]
            starts = [(s * 37) % (3 * seq_len) for s in seqs]
            writer.append(np.concatenate([values[a : a + seq_len] for a in starts]), {
                "seq": np.repeat(seqs, seq_len), "position": np.tile(np.arange(seq_len), len(seqs)),
                "token_id": np.concatenate([(np.arange(seq_len) * 7 + s) % 1000 for s in seqs])})
        writer.close()
    return root / "train.zarr", root / "server.zarr"


def _start_compare(*args: str | Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tracediff", "compare", *map(str, args), "--progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(TRACEDIFF_PROGRESS_SECONDS="0.05"))


def _wait_for_streaming_pass(proc: subprocess.Popen) -> list[str]:
    """The stderr lines up to the first status line of the streaming pass ("comparing rows")."""
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(STATUS) and "comparing rows" in line:
            return seen
    proc.wait()
    raise AssertionError(f"the compare ended before its streaming pass: {''.join(seen)}")


# ------------------------------------------------------------------------------------------ signals
@pytest.mark.parametrize(("signum", "times", "code", "line"), [
    (signal.SIGINT, 1, 130, "tracediff: interrupted"),
    (signal.SIGTERM, 1, 143, "tracediff: terminated (SIGTERM)"),
    (signal.SIGINT, 2, 130, "tracediff: interrupted"),  # Ctrl-C pressed twice: still one line
], ids=["SIGINT", "SIGTERM", "SIGINT twice"])
def test_a_signal_in_the_streaming_pass_ends_compare_with_one_line_and_128_plus_the_signal(
    long_pass: tuple[Path, Path], tmp_path: Path, signum: int, times: int, code: int, line: str
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    proc = _start_compare(*long_pass, "--html", reports / "r.html", "--json", reports / "r.json")
    before = _wait_for_streaming_pass(proc)
    sent = time.monotonic()
    for _ in range(times):
        os.kill(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == code, (proc.returncode, err)
    assert took < 5, f"the compare took {took:.1f} s to end after the signal"
    assert out == ""  # no verdict: the compare did not finish
    assert "Traceback" not in err and "Aborted" not in err and "done in" not in err, err
    after = [x for x in err.splitlines() if not x.startswith(STATUS)]
    assert after == [line], "".join(before) + err
    assert sorted(os.listdir(reports)) == []  # no report, no temporary file


def test_ctrl_c_in_a_program_that_calls_main_is_130_and_one_line_too(long_pass: tuple[Path, Path]) -> None:
    """``tracediff.cli.main`` in another Python program, whose SIGINT is Python's KeyboardInterrupt."""
    code = "import sys\nfrom tracediff.cli import main\nmain(sys.argv[1:], prog_name='tracediff')\n"
    proc = subprocess.Popen([sys.executable, "-c", code, "compare", *map(str, long_pass), "--progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(TRACEDIFF_PROGRESS_SECONDS="0.05"))
    _wait_for_streaming_pass(proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (130, ""), err
    assert [x for x in err.splitlines() if not x.startswith(STATUS)] == ["tracediff: interrupted"], err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_send_waits_for_a_silent_server_ends_with_one_line(signum: int, code: int) -> None:
    """Another command, blocked elsewhere: `send` waiting on a server that took the connection and
    never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(60)
        proc = subprocess.Popen([sys.executable, "-m", "tracediff", "send", str(TRAIN), "--url",
                                 f"http://127.0.0.1:{server.getsockname()[1]}"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cli_env())
        connection, _ = server.accept()  # send is waiting for the answer now
        with connection:
            time.sleep(0.3)
            os.kill(proc.pid, signum)
            out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (code, ""), err
    assert err.splitlines() == [{130: "tracediff: interrupted", 143: "tracediff: terminated (SIGTERM)"}[code]], err


def _processes_in_group(pgid: int) -> dict[int, str]:
    """The live (not zombie) processes of process group ``pgid``: pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(entry)] = cmdline
    return found


@pytest.mark.slow  # worker processes that import torch: ~10 s here
def test_a_signal_while_dask_workers_run_ends_compare_and_its_workers(long_pass: tuple[Path, Path]) -> None:
    pytest.importorskip("distributed")
    proc = subprocess.Popen([sys.executable, "-m", "tracediff", "compare", *map(str, long_pass), "--dask", "local:2",
                             "--progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(TRACEDIFF_PROGRESS_SECONDS="0.05"), start_new_session=True)
    try:
        _wait_for_streaming_pass(proc)
        deadline = time.monotonic() + 120
        while not any("dask worker" in c for c in _processes_in_group(proc.pid).values()):
            assert proc.poll() is None and time.monotonic() < deadline, "no dask worker started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert [x for x in err.splitlines() if not x.startswith(STATUS)] == ["tracediff: terminated (SIGTERM)"], err
    assert out == ""
    deadline = time.monotonic() + 10
    while (left := _processes_in_group(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running: {left}"


# ------------------------------------------------------------------------------ report output paths
def _under_a_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("not a folder\n")
    return tmp / "a-file" / "r.html"


def _a_folder(tmp: Path) -> Path:
    (tmp / "r.html").mkdir()
    return tmp / "r.html"


def _a_fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "r.html")
    return tmp / "r.html"


@pytest.mark.parametrize(("make", "says"), [
    (lambda tmp: tmp / "no-such-folder" / "r.html", "does not exist"),
    (_under_a_file, "is not a folder"),
    (lambda tmp: Path("/proc/r.html"), "cannot create a file in /proc"),  # root may write anywhere else
    (_a_folder, "is a folder"),
    (_a_fifo, "not a regular file"),
], ids=["missing folder", "under a file", "proc", "a folder", "a fifo"])
def test_an_unwritable_html_path_is_refused_before_the_compare_starts(
    long_pass: tuple[Path, Path], tmp_path: Path, make, says: str
) -> None:
    path = make(tmp_path)
    proc = _start_compare(*long_pass, "--html", path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert out == ""
    assert err.splitlines() == [err.strip()], err  # one line: not one status line of a compare
    assert err.startswith(f"tracediff: error: --html {path}: ") and says in err, err


def test_two_reports_to_one_file_are_refused_before_the_compare_starts(long_pass: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    proc = _start_compare(*long_pass, "--json", tmp_path / "r", "--html", tmp_path / "r")
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out) == (2, "")
    assert err.splitlines() == [f"tracediff: error: --html {tmp_path / 'r'}: --json names the same file; give each "
                                "report its own path"], err


@pytest.mark.parametrize(("args", "option"), [
    (["identify", BROKEN, "--bank", BANK, "--json", "/proc/ident.json"], "--json /proc/ident.json"),
    (["replay", TRAIN, BROKEN, "--draft", "no-such-draft", "--markdown", "/proc/r.md"], "--markdown /proc/r.md"),
    (["send", TRAIN, "--url", "http://127.0.0.1:9", "--json", "/proc/sent.json"], "--json /proc/sent.json"),
    (["pack", TRAIN, "-o", "/proc/train.zarr.zip"], "-o /proc/train.zarr.zip"),
    (["import", "speculators", "no-such-folder", "-o", "/proc/train.zarr"], "-o /proc/train.zarr"),
    (["import", "specforge", "no-such-folder", "-o", "/proc/train.zarr"], "-o /proc/train.zarr"),
    (["lint", TRAIN, "--json", "/proc/lint.json"], "--json /proc/lint.json"),
], ids=["identify", "replay", "send", "pack", "import speculators", "import specforge", "lint"])
def test_every_command_writing_a_file_refuses_an_unwritable_path_first(args: list, option: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          env=cli_env(), timeout=120)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.startswith(f"tracediff: error: {option}: cannot create a file in /proc"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_demo_refuses_an_out_folder_under_a_file_before_comparing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x\n")
    proc = subprocess.run([sys.executable, "-m", "tracediff", "demo", "--out", str(tmp_path / "a-file" / "demo")],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.startswith(f"tracediff: error: --out {tmp_path / 'a-file' / 'demo'}: "), proc.stderr


def test_a_report_that_fails_to_write_at_the_end_leaves_the_verdict_then_the_error(
    long_pass: tuple[Path, Path], tmp_path: Path
) -> None:
    """The folder was there when the compare started and is gone when the report is written."""
    reports = tmp_path / "reports"
    reports.mkdir()
    proc = _start_compare(*long_pass, "--html", reports / "r.html")
    _wait_for_streaming_pass(proc)
    shutil.rmtree(reports)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert out.startswith("tracediff compare: MATCH"), out  # the verdict it computed
    errors = [x for x in err.splitlines() if not x.startswith(STATUS)]
    assert len(errors) == 1 and errors[0].startswith(f"tracediff: error: cannot write report {reports / 'r.html'}"), err
    assert "done in" not in err


def test_a_send_report_that_fails_to_write_at_the_end_leaves_the_summary_then_the_error(tmp_path: Path) -> None:
    from test_send import FakeServer  # noqa: PLC0415

    server = FakeServer()
    server.vocab_size, server.delay = None, 0.5
    reports = tmp_path / "reports"
    reports.mkdir()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tracediff", "send", str(TRAIN), "--url", server.url,
                                 "--no-progress", "--json", str(reports / "sent.json")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cli_env())
        deadline = time.monotonic() + 60
        while not server.max_in_flight:  # the folder was there when send started; now it goes
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.01)
        shutil.rmtree(reports)
        out, err = proc.communicate(timeout=120)
    finally:
        server.stop()
    assert proc.returncode == 2, err
    assert out.startswith("sent 6 of 6 sequences"), out
    assert err.splitlines() == [err.strip()] and err.startswith(f"tracediff: error: cannot write {reports / 'sent.json'}"), err


# ------------------------------------------------------------------------------------------ help
def _commands() -> list[str]:
    """Every command the program has, sub-commands too (a new command is checked without a list to update)."""
    import click  # noqa: PLC0415

    from tracediff.cli import main  # noqa: PLC0415

    out: list[str] = []

    def walk(group: click.Group, prefix: str) -> None:
        for name, command in sorted(group.commands.items()):
            out.append(prefix + name)
            if isinstance(command, click.Group):
                walk(command, prefix + name + " ")

    walk(main, "")
    return out


COMMANDS = _commands()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_lists_its_exit_codes(command: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tracediff", *command.split(), "--help"], capture_output=True,
                          text=True, env=cli_env(COLUMNS="100"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Exit codes:" in proc.stdout, proc.stdout
    codes = re.findall(r"^ +(\d+) +\S", proc.stdout[proc.stdout.index("Exit codes:"):], re.MULTILINE)
    assert codes[0] == "0" and "2" in codes and codes[-2:] == ["130", "143"], codes
    assert "interrupted" in proc.stdout and "SIGTERM" in proc.stdout


def test_the_program_help_says_what_every_command_exits_with() -> None:
    proc = subprocess.run([sys.executable, "-m", "tracediff", "--help"], capture_output=True, text=True,
                          env=cli_env(), timeout=60)
    codes = re.findall(r"^ +(\d+) +\S", proc.stdout[proc.stdout.index("Exit codes:"):], re.MULTILINE)
    assert codes == ["0", "1", "2", "130", "143"], proc.stdout
    assert "each command's own codes end its 'tracediff COMMAND -h'" in " ".join(proc.stdout.split())


# ------------------------------------------------------------------------------------------ push
def test_push_to_a_port_nothing_listens_on_prints_no_done_line_before_the_error(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = cli_env(TRACEDIFF_PROGRESS_SECONDS="0.02", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp_path / "none"),
                  AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    proc = subprocess.run([sys.executable, "-m", "tracediff", "push", str(TRAIN), "s3://td-nobody/train.zarr",
                           "--storage-option", f"endpoint_url={dead}"], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert any(x.startswith("tracediff push: listing") for x in lines), proc.stderr  # its progress was on
    assert not any("done" in x for x in lines), proc.stderr
    assert lines[-1].startswith("tracediff: error: s3://td-nobody/train.zarr: cannot be listed"), proc.stderr
    assert [x for x in lines if not x.startswith("tracediff push: ")] == [lines[-1]], proc.stderr
    assert proc.stdout == ""


INTERRUPTIBLE = """
import sys, time
from pathlib import Path
import torch

class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)

head = Head()
with torch.no_grad():
    for step in range(3):
        head(torch.full((64, 8), float(step)))
Path(sys.argv[1]).write_text("recorded")
try:
    time.sleep(120)
except KeyboardInterrupt:
    Path(sys.argv[2]).write_text("interrupted")
    raise
"""


def test_a_sigint_sent_to_records_pid_reaches_its_command_which_keeps_its_rows(tmp_path: Path) -> None:
    """A supervisor's or a notebook's interrupt goes to `record`'s pid only (no terminal): record hands
    it to the command, which stops, and the rows it recorded stay committed."""
    (tmp_path / "head.py").write_text(INTERRUPTIBLE)
    ready, interrupted, store = tmp_path / "ready", tmp_path / "interrupted", tmp_path / "it.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "tracediff", "record", "--tap", "Head.fc:input", "-o", str(store),
                             "--", sys.executable, "head.py", str(ready), str(interrupted)],
                            cwd=tmp_path, env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)  # record's pid alone, as `kill -INT PID` does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert interrupted.read_text() == "interrupted", err
    # record exits with its command's code: Python's for an uncaught KeyboardInterrupt here
    assert proc.returncode == 1 and "KeyboardInterrupt" in err, err
    assert "tracediff: command exited with code 1;" in err
    from tracediff.store import open_store  # noqa: PLC0415

    with open_store(store) as opened:
        assert opened.rows("fc_in") == 3 * 64
