"""README's first screen is current: its cost table is what the last measurements say, those
measurements are of this tree (the tests it counts are the tests collected now, the commits it names
exist), and every `tracediff` command README shows names a real command and real options.

When one of these fails: run ``.ci/run``, then ``python benchmarks/readme_costs.py tests`` (and
``demo`` if the demo changed), and commit README.md with benchmarks/costs.json.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from ci_record import ROOT, load_readme_costs

from tracediff.cli import main as cli_main

COSTS = load_readme_costs()
README = ROOT / "README.md"


def _costs() -> dict:
    return json.loads(COSTS.COSTS.read_text())


def test_the_cost_table_is_what_the_measurements_say():
    expected = COSTS.render_table(_costs(), COSTS.ci_test_command())
    assert COSTS.readme_table(README) == expected, "run: python benchmarks/readme_costs.py tests (or demo)"


def test_the_test_command_in_readme_is_the_one_ci_runs():
    test_command = COSTS.ci_test_command()
    assert test_command.startswith("bash requirements/test-env.sh") and "--only-allowed-skips" in test_command
    assert f"`{test_command}`" in README.read_text()


@pytest.mark.slow
def test_the_quoted_test_count_is_the_number_collected_now():
    tests = _costs()["tests"]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    counted = re.search(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    assert counted, done.stdout[-2000:] + done.stderr[-2000:]
    assert int(counted[1]) == tests["collected"], (
        f"README quotes {tests['collected']:,} tests (measured on {tests['commit'][:7]}), {counted[1]} are "
        "collected now: rerun .ci/run and python benchmarks/readme_costs.py tests")


def test_the_quoted_run_passed_with_no_skip_unaccounted():
    tests = _costs()["tests"]
    assert tests["failed"] == tests["errors"] == 0 and not tests["dirty"]
    assert tests["passed"] + tests["skipped"] == tests["collected"]


def _is_git_checkout() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode == 0


def test_the_measured_commits_are_in_this_tree_s_history():
    if not _is_git_checkout():  # an sdist or a copy: the other tests still check the figures
        return
    for what, record in _costs().items():
        known = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", record["commit"], "HEAD"],
                               capture_output=True)
        assert known.returncode == 0, f"benchmarks/costs.json {what}.commit {record['commit']} is not an ancestor of HEAD"


def test_the_demo_command_pins_the_torch_the_test_setup_installs():
    pin = re.search(r"torch==([\w.+]+)", COSTS.DEMO_COMMAND)
    assert pin and f"torch=={pin[1]}" in (ROOT / "requirements" / "test-env.sh").read_text()


def _readme_commands() -> list[list[str]]:
    """Every `tracediff ...` README shows, in code spans and blocks, as argv (what precedes `--`)."""
    text = README.read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"^\$ (.+)$", text, re.MULTILINE)
    spans += [ln.strip() for block in re.findall(r"```(?:\w+)?\n(.*?)```", text, re.DOTALL)
              for ln in block.splitlines()]
    commands = []
    for span in spans:
        for part in re.split(r"&&|\bthen\b|;|\|", span):
            words = part.strip().split()
            # "tracediff compare: MISMATCH ..." is a report's first line, not a command
            if words and Path(words[0]).name == "tracediff" and len(words) > 1 and not words[1].endswith(":"):
                try:
                    argv = shlex.split(part.strip())[1:]
                except ValueError:
                    continue
                commands.append(argv[:argv.index("--")] if "--" in argv else argv)
    return commands


def test_every_command_readme_shows_is_a_real_command_with_real_options():
    commands = _readme_commands()
    assert len(commands) >= 5, commands  # the jobs table alone shows six
    for argv in commands:
        command = cli_main
        ctx = click.Context(cli_main)
        words = list(argv)
        while isinstance(command, click.Group) and words and not words[0].startswith("-"):
            name = words.pop(0)
            sub = command.get_command(ctx, name)
            assert sub is not None, f"README shows `tracediff {' '.join(argv)}`: no command {name!r}"
            command = sub
        known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
        for word in words:
            if word.startswith("-") and word != "-":
                option = word.split("=", 1)[0]
                assert option in known, f"README shows `tracediff {' '.join(argv)}`: {command.name} has no {option}"
