"""The test setup's pip output: the resolver complaints that --no-deps installs cause on purpose are
folded into one line, everything else pip says (a real failure) still shows, and pip's exit code
is kept. A real venv and real pip installs from the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _pip_install(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = f'source "{REPO}/requirements/pip-install.sh"; pip_install "{venv}/bin/pip" "$@"'
    return subprocess.run(["bash", "-c", script, "pip_install", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_expected_resolver_complaints_become_one_line_and_real_errors_still_show(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # requests without its dependencies, then one of them: pip's resolver lists the others as missing.
    first = _pip_install(venv, "-q", "--no-deps", "requests==2.32.3")
    assert first.returncode == 0, first.stderr
    raw = subprocess.run([f"{venv}/bin/pip", "install", "-q", "--force-reinstall", "--no-deps", "idna==3.10"],
                         capture_output=True, text=True, timeout=300)
    unfiltered = subprocess.run([f"{venv}/bin/pip", "install", "-q", "certifi==2024.8.30"], capture_output=True,
                                text=True, timeout=300)
    assert raw.returncode == 0 and "dependency resolver" in unfiltered.stderr  # what a user saw before
    second = _pip_install(venv, "-q", "urllib3==2.2.3")
    assert second.returncode == 0
    assert "dependency resolver" not in second.stderr and "requires" not in second.stderr
    assert "dependency-resolver lines left out: expected, the frameworks are installed with --no-deps" in second.stderr
    assert len([line for line in second.stderr.splitlines() if "resolver" in line]) == 1
    # A real failure is shown as pip wrote it, with pip's exit code.
    failed = _pip_install(venv, "-q", "no-such-package-tracediff-test==1.0")
    assert failed.returncode != 0
    assert "No matching distribution found for no-such-package-tracediff-test==1.0" in failed.stderr
