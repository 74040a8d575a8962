"""Shared fixtures of the record tests: a tiny real Llama, plain-zarr readers, CLI runners, processes.

Everything here is real: stores are zarr folders in ``tmp_path``, the CLI runs as a subprocess (or
through click's runner where only its in-process logic is under test), processes are real
processes. Nothing mocks the store.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from reliability_children import wait_for_commit

from tracediff.cli import main as cli_main

HIDDEN = 32
LAYERS = 4
VOCAB = 128
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- models
@pytest.fixture(scope="session")
def tiny():
    from tracediff.testing.tiny_llama import build_tiny_llama  # noqa: PLC0415  (imports transformers)

    return build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="session")
def seqs() -> list[list[int]]:
    from tracediff.testing.tiny_llama import make_sequences  # noqa: PLC0415

    return make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=VOCAB, seed=1)


# ------------------------------------------------------------------------ plain zarr + numpy reading
@dataclass
class PlainGroup:
    """One ``<tap>/<writer>`` group read with nothing but zarr and numpy (no tracediff code)."""

    attrs: dict[str, Any]
    values: np.ndarray  # stored representation: uint16 bits for bf16
    labels: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return int(self.attrs["commit"]["rows"])

    @property
    def commit(self) -> dict[str, Any]:
        return self.attrs["commit"]

    @property
    def phase_names(self) -> list[str]:
        return [self.attrs["phases"][c] for c in self.labels["phase"]]


def read_plain(store: Path | str, tap: str) -> dict[str, PlainGroup]:
    """Every writer group of ``tap``: committed rows only, as documented in the store format."""
    root = zarr.open_group(str(store), mode="r")
    assert "tracediff" in root.attrs, "a trace store carries a 'tracediff' root attribute"
    out: dict[str, PlainGroup] = {}
    for name in sorted(root[tap].group_keys()):
        group = root[tap][name]
        attrs = dict(group.attrs)
        rows = int(attrs["commit"]["rows"])
        values = group["values"]
        assert values.attrs["dtype"] == attrs["dtype"]
        labels = {
            key: np.asarray(group[key][:rows])
            for key in ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
        }
        out[name] = PlainGroup(attrs=attrs, values=np.asarray(values[:rows]), labels=labels)
    return out


def stored_bits(tensor) -> np.ndarray:
    """What a tensor must look like on disk: bf16 as its raw 16 bits, other dtypes as themselves."""
    import torch  # noqa: PLC0415

    flat = tensor.detach().reshape(-1, tensor.shape[-1]).contiguous()
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def writer_json(store: Path, tap: str, writer: str) -> dict[str, Any]:
    """The commit record on disk, read as JSON (what a process polls to know a batch is durable)."""
    return json.loads((store / tap / writer / "zarr.json").read_text())["attributes"]["commit"]


# ------------------------------------------------------------------------------------------ the CLI
@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRACEDIFF_CONFIG", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_tracediff(*args: str, cwd: Path | None = None, timeout: float = 120) -> CliResult:
    """``python -m tracediff ARGS`` in a real subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "tracediff", *map(str, args)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def invoke_tracediff(*args: str) -> CliResult:
    """The same command through click's runner, in this process (for error paths: no torch start-up)."""
    result = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False)
    return CliResult(result.exit_code, result.stdout, result.stderr)


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """A command that blocks (a FIFO read with no writer) fails the test instead of stalling the run."""

    def fail(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise TimeoutError(f"still running after {seconds} s: it blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)



# ------------------------------------------------------------------------------ reliability counts
# Reliability tests (crash harness, concurrent writers, full disk, hostile inputs) report what they
# measured: counts of kills by phase, rows written, peak memory. They go into the terminal summary
# of every run (CI logs included) and, when TRACEDIFF_RELIABILITY_OUT names a file, into that JSON
# file, from which docs/reliability.md quotes its numbers.
_RELIABILITY: dict[str, Any] = {}


@pytest.fixture(scope="session")
def reliability_report() -> dict[str, Any]:
    """``reliability_report["crash"] = {...}``: a JSON-able record of what a test measured."""
    return _RELIABILITY


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _RELIABILITY:
        return
    terminalreporter.section("tracediff reliability counts")
    for name, record in sorted(_RELIABILITY.items()):
        terminalreporter.write_line(f"{name}: {json.dumps(record, sort_keys=True)}")
    out = os.environ.get("TRACEDIFF_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(_RELIABILITY, indent=2, sort_keys=True) + "\n")


# -------------------------------------------------------------------------------------- processes
@pytest.fixture(scope="session")
def forkserver() -> Iterator[multiprocessing.context.BaseContext]:
    """Processes forked from a server that has torch and tracediff imported already: a real process
    per run (it can be SIGKILLed) without paying the torch import each time."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zarr", "numcodecs", "tracediff.recorder"])
    yield ctx


# ------------------------------------------------------------ bodies of recording child processes
# They live here, not in a test module, so that a forked or spawned child imports only this light
# module (no transformers) to find them; torch is imported inside them for the same reason.
KILL_WIDTH = 256


def kill_batch_sizes(n: int = 2000, seed: int = 0) -> list[int]:
    """Ragged batch sizes (1..300 rows): batches span 0 to 5 chunks of 64 rows."""
    return np.random.default_rng(seed).integers(1, 301, size=n).tolist()


def record_batches_until_killed(store: str, log: str, sizes: list[int]) -> None:
    """Record batch i (every value i + 1) through a real forward hook; log i once it is committed.

    The commit record on disk is the proof a batch is durable, so the child polls it (zarr writes
    it atomically) before logging: the test then knows which batches must have survived a kill.
    """
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    layer = torch.nn.Linear(KILL_WIDTH, 2)
    rec = tracediff.record(store, role="killed", chunk_rows=64, on_full="block")
    rec.tap(layer, "fc_in")
    commit_file = Path(store) / "fc_in" / rec.writer_name / "zarr.json"
    with open(log, "a") as out:
        for i, n in enumerate(sizes):
            rec.labels(seq=i, position=np.arange(n), step=i)
            layer(torch.full((n, KILL_WIDTH), float(i + 1)))
            wait_for_commit(commit_file, i, rec)
            out.write(f"{i}\n")
            out.flush()


def record_then_wait_for_sigterm(store: str, log: str, sizes: list[int]) -> None:
    """Queue every batch, say how far the writer got, then wait for SIGTERM.

    Queuing takes microseconds; writing takes about a second (one chunk file per row), so the
    writer is certainly behind when the test sends the signal."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    layer = torch.nn.Linear(8, 2)
    rec = tracediff.record(store, role="terminated", chunk_rows=1, on_full="block", max_queue_batches=len(sizes) + 1)
    rec.tap(layer, "fc_in")
    for i, n in enumerate(sizes):
        layer(torch.full((n, 8), float(i + 1)))
    commit_file = Path(store) / "fc_in" / rec.writer_name / "zarr.json"
    committed = json.loads(commit_file.read_text())["attributes"]["commit"]["rows"] if commit_file.exists() else 0
    Path(log + ".tmp").write_text(json.dumps({"queued": rec.stats()["fc_in"]["rows"], "committed": committed}))
    os.replace(log + ".tmp", log)  # the test polls for the file: it must appear whole
    time.sleep(60)  # SIGTERM arrives here
    raise SystemExit(99)  # never reached when the signal kills the process
