"""Starting and stopping the live servers the end-to-end tests run (SGLang, vLLM): on 127.0.0.1
only, and stopped through the pid of the process the test started (its own session)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT = 300.0


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT) -> None:
    """Until ``url``/health answers 200; a test failure with the log's tail when the server exits or
    does not come up in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode} before it was healthy:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"the server was not healthy within {timeout:.0f}s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM to the process we started (``tracediff record`` forwards it), then SIGKILL to the
    session we started for it, nothing else."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
