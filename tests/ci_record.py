"""The record of a whole-suite run as ``.ci/run`` runs it: what README's cost table quotes.

With ``--only-allowed-skips`` (only ``.ci/run`` passes it) and nothing deselected, the session writes
``.ci/last-run.json`` (git-ignored): the commit and date, how many tests were collected, passed,
failed and skipped, how long pytest ran, how long ``requirements/test-env.sh`` took just before it
(it leaves ``.venv/tracediff-setup.json``), and the disk the test venvs take.
``benchmarks/readme_costs.py`` turns that record into README's table, and
``tests/test_readme_figures.py`` fails when the table and the tree disagree, so the figures cannot
drift from the tree they describe.

A partial run (a file, ``-k``, ``-m``, ``--deselect``) writes nothing: its figures would not be the
suite's.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAST_RUN = ROOT / ".ci" / "last-run.json"
SETUP_RECORD = ROOT / ".venv" / "tracediff-setup.json"
VENVS = (".venv", ".venv-vllm")
#: A setup record older than this before pytest started belongs to another run.
_SETUP_FRESH_S = 30 * 60


def load_readme_costs():  # noqa: ANN201
    """benchmarks/readme_costs.py (a script, not a package): what measures and renders the figures."""
    spec = importlib.util.spec_from_file_location("readme_costs", ROOT / "benchmarks" / "readme_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _whole_suite(config: pytest.Config, session: pytest.Session) -> bool:
    option = config.option
    narrowed = [getattr(option, name, None) for name in ("keyword", "markexpr", "deselect", "lf", "last_failed")]
    if any(narrowed) or (getattr(option, "maxfail", 0) or 0) > 0:  # -x is maxfail=1
        return False
    testpaths = [str((ROOT / p).resolve()) for p in config.getini("testpaths")]
    given = [str(Path(a).resolve()) for a in config.args]
    return sorted(given) == sorted(testpaths) and session.testscollected == len(session.items)


class CiRecord:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.time()
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        self.failed_ids: list[str] = []
        self.at_start = load_readme_costs().git_commit()  # the tree the tests are collected from

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.passed:
                self.counts["passed"] += 1
            elif report.skipped:
                self.counts["skipped"] += 1
            elif report.when == "setup":
                self.counts["errors"] += 1
            else:
                self.counts["failed"] += 1
                self.failed_ids.append(report.nodeid)
        elif report.when == "teardown" and report.failed:
            self.counts["errors"] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        try:
            self._write(session)
        except Exception as exc:  # noqa: BLE001  (the record is a by-product: never the run's outcome)
            print(f"\ntests/ci_record.py: no run record written: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _write(self, session: pytest.Session) -> None:
        if not _whole_suite(self.config, session):
            return
        ended = time.time()
        costs = load_readme_costs()
        at_end = costs.git_commit()
        # Measured on the commit the run started from; a commit or an edit while it ran makes it dirty.
        dirty = bool(self.at_start["dirty"] or at_end["dirty"] or at_end["commit"] != self.at_start["commit"])
        record: dict[str, Any] = {
            "commit": self.at_start["commit"], "dirty": dirty,
            "date": dt.datetime.fromtimestamp(ended, dt.timezone.utc).strftime("%Y-%m-%d"),
            "collected": session.testscollected,
            **self.counts,
            "failed_ids": self.failed_ids,
            "exit_status": int(session.exitstatus),
            "pytest_seconds": round(ended - self.started, 1),
            "setup_seconds": _setup_seconds(self.started),
            "python": sys.version.split()[0],
            "disk_bytes": {v: costs.disk_bytes(ROOT / v) for v in VENVS if (ROOT / v).is_dir()},
        }
        LAST_RUN.parent.mkdir(exist_ok=True)
        LAST_RUN.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _setup_seconds(pytest_started: float) -> float | None:
    try:
        setup = json.loads(SETUP_RECORD.read_text())
        seconds, finished = float(setup["seconds"]), float(setup["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return seconds if 0 <= pytest_started - finished <= _SETUP_FRESH_S else None


def register(config: pytest.Config) -> None:
    if config.getoption("--only-allowed-skips") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(CiRecord(config), "tracediff-ci-record")
