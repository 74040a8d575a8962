"""The command line as a new user meets it: one-line errors, help that shows the grammar, progress in
a terminal and in a log, a compare of a store with itself, a run that records nothing.

Real subprocesses (and a real pseudo-terminal for the live progress line) on the shipped samples.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from conftest import cli_env, invoke_tracediff, run_tracediff

from tracediff.cli import main as cli_main
from tracediff.demo import default_samples_dir

SAMPLES = default_samples_dir()
TRAIN, BROKEN, FIXED = SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", SAMPLES / "server_fixed.zarr"


def _one_line_error(result, *parts: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tracediff: error: "), lines[0]
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["compare", TRAIN], ["missing argument 'CANDIDATE'", "usage: tracediff compare [OPTIONS] REFERENCE CANDIDATE",
                              "'tracediff compare -h'"]),
        (["compare", TRAIN, FIXED, "--bogus"], ["no such option --bogus", "tracediff compare -h"]),
        (["compare", TRAIN, FIXED, "--fail-on", "never"], ["'--fail-on'", "'never' is not one of"]),
        (["nosuch"], ["no such command nosuch", "usage: tracediff [OPTIONS] COMMAND"]),
        (["record", "-o", "x.zarr"], ["missing argument 'COMMAND...'", "tracediff record -h"]),
        (["identify", BROKEN], ["missing option '--bank'"]),
    ],
)
def test_usage_errors_are_one_line_with_the_usage_and_where_help_is(args, parts):
    _one_line_error(run_tracediff(*args), *parts)


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("Foo.fc:inptu", "the capture 'inptu' after ':' must be input or output"),
        ("=Foo.fc", "the NAME before '=' is empty"),
        ("Foo..fc", "the attribute path has an empty part"),
        ("Foo.fc@", "the @ARG '' must be an input's position"),
        ("foo-bar.fc", "the CLASS 'foo-bar' is not a Python class name"),
        ("Foo.f-c", "the attribute path part 'f-c'"),
        ("Foo.fc:input:output", "only one ':input' or ':output'"),
        ("Foo.fc:output@1", "@ARG selects an input"),
    ],
)
def test_a_bad_tap_spec_names_the_part_that_is_wrong(tmp_path, spec, part):
    store = tmp_path / "never.zarr"
    line = _one_line_error(invoke_tracediff("record", "--tap", spec, "-o", store, "--", "true"), part)
    assert repr(spec) in line
    assert not store.exists()


def test_record_help_shows_the_whole_tap_spec_grammar():
    out = run_tracediff("record", "--help").stdout
    assert "[NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG]" in out
    for part in ("NAME=", "CLASS", ".ATTR.PATH", ":input", ":output", "@ARG"):
        assert re.search(rf"^\s+{re.escape(part)}\s+\S", out, re.M), part
    assert "@hidden_states" in out


def _commands(group: click.Group, prefix: str = "tracediff"):
    for name, command in group.commands.items():
        yield f"{prefix} {name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix} {name}")


@pytest.mark.parametrize(("path", "command"), list(_commands(cli_main)), ids=lambda x: x if isinstance(x, str) else "")
def test_every_option_of_every_command_says_what_it_does(path, command):
    undocumented = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not p.hidden
                    and not (p.help or "").strip()]
    assert not undocumented, f"{path}: options without help text: {undocumented}"


# ------------------------------------------------------------------------------------ quiet, same store
def test_quiet_prints_one_line_with_correct_plurals():
    broken = run_tracediff("compare", TRAIN, BROKEN, "-q")
    assert broken.returncode == 1
    # One misconfiguration: counted as one root cause, every finding still counted by severity.
    assert broken.stdout == "mismatch: 1 root cause, 2 consequences; 3 errors, 1 warning, 1 info\n"
    fixed = run_tracediff("compare", TRAIN, FIXED, "-q")
    assert fixed.stdout == "match: 0 errors, 0 warnings, 2 info\n"


def test_a_store_compared_with_itself_or_its_own_zip_says_so(tmp_path):
    packed = tmp_path / "train.zarr.zip"
    assert run_tracediff("pack", TRAIN, packed).returncode == 0
    for other, how in ((TRAIN, "the same store"), (packed, "two copies of one recording")):
        result = run_tracediff("compare", TRAIN, other)
        assert result.returncode == 0, result.stderr
        text = re.sub(r"\s+", " ", result.stdout)
        assert "Both sides are one recording" in text
        assert f"WARN same_recording: Both sides are {how}" in text
        strict = run_tracediff("compare", TRAIN, other, "-q", "--fail-on", "warning")
        assert strict.returncode == 1 and strict.stdout == "match: 0 errors, 1 warning, 0 info\n"
    assert "same_recording" not in run_tracediff("compare", TRAIN, FIXED).stdout


def _wrote(stderr: str) -> list[str]:
    """The lines naming written files, which end stderr (a slow run may print progress lines before them)."""
    lines = stderr.splitlines()
    wrote = [line for line in lines if ": wrote the " in line]
    assert lines[len(lines) - len(wrote):] == wrote, stderr
    return wrote


def test_each_report_option_says_which_file_it_wrote(tmp_path):
    paths = {"--json": tmp_path / "r.json", "--markdown": tmp_path / "r.md", "--html": tmp_path / "r.html"}
    args = [x for option, path in paths.items() for x in (option, path)]
    result = run_tracediff("compare", TRAIN, BROKEN, "-q", *args)
    assert result.returncode == 1
    assert result.stdout.startswith("mismatch: ") and len(result.stdout.splitlines()) == 1  # -q: still one line
    assert _wrote(result.stderr) == [
        f"tracediff compare: wrote the JSON report {paths['--json']}",
        f"tracediff compare: wrote the Markdown report {paths['--markdown']}",
        f"tracediff compare: wrote the HTML report {paths['--html']}",
    ]
    assert all(path.is_file() for path in paths.values())
    only_html = run_tracediff("compare", TRAIN, FIXED, "--no-progress", "--html", tmp_path / "fixed.html")
    assert only_html.returncode == 0
    assert only_html.stderr == f"tracediff compare: wrote the HTML report {tmp_path / 'fixed.html'}\n"
    named = run_tracediff("identify", BROKEN, "--bank", SAMPLES / "bank.zarr", "--json", tmp_path / "id.json")
    assert named.returncode == 0 and (tmp_path / "id.json").is_file()
    assert _wrote(named.stderr) == [f"tracediff identify: wrote the JSON result {tmp_path / 'id.json'}"]


def test_pack_takes_its_destination_with_o_as_record_and_import_do(tmp_path):
    with_o = tmp_path / "a.zarr.zip"
    result = run_tracediff("pack", TRAIN, "-o", with_o)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(with_o) and with_o.is_file()
    positional = tmp_path / "b.zarr.zip"
    assert run_tracediff("pack", TRAIN, positional).returncode == 0 and positional.is_file()
    _one_line_error(invoke_tracediff("pack", TRAIN, tmp_path / "c.zip", "-o", tmp_path / "d.zip"),
                    "DEST is given twice", "give it once, with -o")
    assert not (tmp_path / "c.zip").exists() and not (tmp_path / "d.zip").exists()


def test_verbose_adds_the_plan_metrics_and_config_diff():
    short = run_tracediff("compare", TRAIN, BROKEN).stdout
    full = run_tracediff("compare", TRAIN, BROKEN, "--verbose").stdout
    for section in ("\nPlan", "\nConfig diff", "\nSegment metrics", "worst row:"):
        assert section not in short and section in full
    # About a screen: the Fix box at the top (issue #25) takes ~10 of these lines.
    assert len(short.splitlines()) <= 80 < len(full.splitlines())
    # A segment size says where it came from in words.
    assert "segment size     64 (recorded in the stores)" in full


# ------------------------------------------------------------------------------------ progress
def test_a_log_gets_a_status_line_every_few_seconds_naming_the_stage():
    env = cli_env(TRACEDIFF_PROGRESS_SECONDS="0.02")
    proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(TRAIN), str(BROKEN), "-q"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("tracediff compare: ") for line in lines), proc.stderr
    assert re.search(r"^tracediff compare: done in \d+ s$", lines[-1])
    status = [line for line in lines[:-1]]
    assert status and all(re.search(r", \d+ s$", line) for line in status)
    stages = {line.split(": ", 1)[1].split(",")[0] for line in status}
    assert stages & {"opening stores", "reading labels", "aligning sequences", "planning: label offset",
                     "planning: segment map", "comparing rows", "findings", "writing reports"}


def test_a_short_compare_in_a_log_prints_no_progress_and_no_progress_turns_it_off():
    quick = run_tracediff("compare", TRAIN, FIXED, "-q")
    assert quick.stderr == ""
    env = cli_env(TRACEDIFF_PROGRESS_SECONDS="0.02")
    off = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(TRAIN), str(FIXED), "-q", "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and off.stderr == ""


def test_a_terminal_gets_one_live_line_redrawn_in_place_and_cleared():
    main_fd, child_fd = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(TRAIN), str(BROKEN), "-q"],
                              env=cli_env(), stdout=subprocess.PIPE, stderr=child_fd, text=True, timeout=120)
        os.close(child_fd)
        child_fd = -1
        chunks = []
        while True:
            try:
                data = os.read(main_fd, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if child_fd >= 0:
            os.close(child_fd)
        os.close(main_fd)
    shown = b"".join(chunks).decode()
    assert proc.returncode == 1 and proc.stdout == "mismatch: 1 root cause, 2 consequences; 3 errors, 1 warning, 1 info\n"
    assert "\n" not in shown.replace("\r\n", "")  # never a new line per update: redrawn in place
    assert shown.count("\r") >= 2 and "compare: " in shown
    assert shown.split("\r")[-1].strip() == ""  # cleared at the end


# ------------------------------------------------------------------------------------ record
def test_a_record_that_never_sees_its_class_leaves_nothing_in_the_way(tmp_path: Path):
    store = tmp_path / "train.zarr"
    first = invoke_tracediff("record", "--tap", "NoSuchDraft.fc", "-o", store, "--", sys.executable, "-c", "pass")
    assert first.returncode == 2  # no tap fired
    assert "never fired" in first.stderr and "no --overwrite needed" in first.stderr
    assert not store.exists()
    script = tmp_path / "train.py"
    script.write_text("import torch\nclass NoSuchDraft(torch.nn.Module):\n    def __init__(self):\n"
                      "        super().__init__()\n        self.fc = torch.nn.Linear(8, 4)\n"
                      "NoSuchDraft().fc(torch.ones(5, 8))\n")
    second = invoke_tracediff("record", "--tap", "NoSuchDraft.fc", "-o", store, "--", sys.executable, script)
    assert second.returncode == 0, second.stderr
    assert "removed" not in second.stderr and (store / "zarr.json").is_file()


# ------------------------------------------------------------------------------------ start-up
@pytest.mark.parametrize(
    ("args", "not_imported"),
    [
        (["--help"], ["torch", "numpy", "zarr", "deepdiff"]),
        (["compare", "--help"], ["torch", "numpy", "zarr", "deepdiff"]),
        (["inspect", str(TRAIN)], ["torch", "deepdiff", "pandas"]),
        (["compare", str(TRAIN), str(FIXED), "-q"], ["pandas", "transformers"]),
    ],
)
def test_a_command_imports_only_what_it_needs(args, not_imported):
    code = ("import sys\nsys.argv = ['tracediff', *sys.argv[1:]]\nfrom tracediff.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    loaded = set(proc.stderr.strip().splitlines()[-1].split())
    assert "tracediff.cli" in loaded
    assert not loaded & set(not_imported), sorted(loaded & set(not_imported))


def test_the_program_ends_without_teardown_but_keeps_its_output_and_exit_code(tmp_path):
    # `tracediff` ends with os._exit once a command is done: stdout, stderr, the reports and the exit
    # code must all be there, through a pipe too.
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(TRAIN), str(BROKEN), "--json", str(out)],
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.startswith("tracediff compare: MISMATCH") and proc.stdout.rstrip().endswith("--html FILE.")
    assert json.loads(out.read_text())["verdict"] == "mismatch"
    bad = subprocess.run([sys.executable, "-m", "tracediff", "inspect", str(tmp_path / "nope.zarr")], env=cli_env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("tracediff: error: ") and bad.stdout == ""
