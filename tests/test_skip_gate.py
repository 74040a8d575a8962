"""The skip gate (tests/skip_gate.py): .ci/run fails on a skip it does not list, and only then."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from skip_gate import ALLOWED_SKIPS, is_allowed

TESTS = Path(__file__).parent

SUITE = '''
import pytest

def test_runs():
    pass

def test_needs_a_framework():
    pytest.skip("vLLM is not installed")

def test_needs_a_browser():
    pytest.skip("chromium is not on PATH: install Debian's package with requirements/browser.sh")
'''

CONFTEST = '''
import skip_gate

def pytest_addoption(parser):
    skip_gate.add_option(parser)

def pytest_configure(config):
    skip_gate.register(config)
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder),
                           *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def _suite(tmp_path: Path, body: str = SUITE) -> Path:
    folder = tmp_path / "suite"
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "conftest.py").write_text(CONFTEST)
    (folder / "tests" / "test_report_browser.py").write_text(body)
    return folder


def test_an_unlisted_skip_fails_the_gated_run_and_names_itself(tmp_path: Path) -> None:
    folder = _suite(tmp_path)
    gated = _pytest(folder, "--only-allowed-skips")
    assert gated.returncode == 1, gated.stdout
    assert "tests/test_report_browser.py::test_needs_a_framework: vLLM is not installed" in gated.stdout
    assert "test_needs_a_browser:" not in gated.stdout  # listed: a missing browser is allowed
    assert "1 unlisted skip(s) fail this run" in gated.stdout


def test_without_the_option_skips_are_reported_not_failed(tmp_path: Path) -> None:
    plain = _pytest(_suite(tmp_path))
    assert plain.returncode == 0, plain.stdout
    assert "would fail .ci/run" in plain.stdout


def test_allowed_skips_alone_pass_the_gated_run(tmp_path: Path) -> None:
    folder = _suite(tmp_path, SUITE.replace('pytest.skip("vLLM is not installed")', "pass"))
    gated = _pytest(folder, "--only-allowed-skips")
    assert gated.returncode == 0, gated.stdout
    assert "unlisted" not in gated.stdout


def test_a_module_skipped_at_collection_is_gated_too(tmp_path: Path) -> None:
    folder = _suite(tmp_path, 'import pytest\npytest.skip("SGLang is not installed", allow_module_level=True)\n')
    gated = _pytest(folder, "--only-allowed-skips")
    assert gated.returncode == 1, gated.stdout
    assert "SGLang is not installed" in gated.stdout


def test_every_allowed_skip_says_why_and_matches_only_its_reason() -> None:
    for allowed in ALLOWED_SKIPS:
        assert len(allowed.why) > 40, allowed
    assert is_allowed("tests/test_report_browser.py::test_x", "chromium is not on PATH: install it")
    assert not is_allowed("tests/test_report_browser.py::test_x", "vLLM is not installed")
    assert not is_allowed("tests/test_vllm_live.py::test_x", "root writes into read-only folders")
    assert not is_allowed("tests/test_report_render.py::test_x", "root writes into read-only folders")
