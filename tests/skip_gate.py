"""The skip gate: with ``--only-allowed-skips`` (``.ci/run`` passes it), a run whose tests skip for a
reason not listed in :data:`ALLOWED_SKIPS` fails, naming each such skip. A green CI then means the
tests ran: a framework that did not install, or a venv where tracediff does not import, is a failure,
not a quiet "s" in the progress line. Without the option (a developer's partial run) skips are
only reported.

Each entry is justified: the skip is about the machine (no browser, no mount namespace), never about
tracediff or its test environment, and another test covers what the skipped one would.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class AllowedSkip:
    nodeid: str  # an fnmatch pattern over the test id
    reason: str  # a regular expression searched in the skip's reason
    why: str


ALLOWED_SKIPS = (
    AllowedSkip(
        "tests/test_report_browser.py::*",
        r"chromium is not on PATH",
        "a machine without Chromium (no apt, no root): requirements/browser.sh says so and skips the browser "
        "test; the HTML report's content is checked without a browser in tests/test_report_render.py",
    ),
    AllowedSkip(
        "*",
        r"cannot mount a private tmpfs here",
        "the full-disk tests need a private mount namespace (root, or unprivileged user namespaces); "
        "tests/test_writer_direct.py still checks a writer's ENOSPC, injected in-process",
    ),
)


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def is_allowed(nodeid: str, reason: str, allowed: tuple[AllowedSkip, ...] = ALLOWED_SKIPS) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, a.nodeid) and re.search(a.reason, reason) for a in allowed)


class SkipGate:
    """Collects every skip (at collection and at run time) and fails the session on one not allowed."""

    def __init__(self, enforce: bool) -> None:
        self.enforce = enforce
        self.unlisted: list[tuple[str, str]] = []

    def _seen(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not getattr(report, "wasxfail", None):
            reason = _reason(report)
            if not is_allowed(report.nodeid, reason):
                self.unlisted.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._seen(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._seen(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.enforce and self.unlisted and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.unlisted:
            return
        verb = "fail this run" if self.enforce else "would fail .ci/run"
        terminalreporter.section("skips not in tests/skip_gate.py's ALLOWED_SKIPS")
        for nodeid, reason in self.unlisted:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line(f"{len(self.unlisted)} unlisted skip(s) {verb}: install what they name, or "
                                    "list the skip in tests/skip_gate.py with why it is allowed")


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--only-allowed-skips", action="store_true",
                     help="fail the run when a test skips for a reason tests/skip_gate.py does not list (.ci/run)")


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipGate(config.getoption("--only-allowed-skips")), "tracediff-skip-gate")
