"""The command line's conventions (docs/cli.md, tracediff.commands.options), held for every command:
help in option sections that ends with the exit codes, --json/--markdown/--html PATH with '-' for
stdout, a mistyped option or command as one line with a did-you-mean (record's included, which then
runs nothing), a renamed option that says its new name, errors in the command line's words.

Help and errors through click's runner (no torch start-up); the outputs on stdout in real
subprocesses on the shipped samples.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
import pytest
from conftest import invoke_tracediff, run_tracediff

from tracediff.cli import main as cli_main
from tracediff.commands.options import OTHER, REMOTE, Command, CommandGroup
from tracediff.demo import default_samples_dir

SAMPLES = default_samples_dir()
TRAIN, BROKEN, BANK = SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", SAMPLES / "bank.zarr"
_HEADING = re.compile(r"^([A-Z][^:\n]*):$", re.MULTILINE)


def _every_command(group: click.Group = cli_main, path: tuple[str, ...] = ()):
    yield path, group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _every_command(command, (*path, name))
        else:
            yield (*path, name), command


COMMANDS = list(_every_command())
LEAVES = [(path, command) for path, command in COMMANDS if not isinstance(command, click.Group)]


def _ids(value: object) -> str:
    return " ".join(["tracediff", *value]) if isinstance(value, tuple) else ""


def _help(path: tuple[str, ...]) -> str:
    result = invoke_tracediff(*path, "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def _one_line_error(result, *parts: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=_ids)
def test_every_help_ends_with_its_exit_codes(path: tuple[str, ...], command: click.Command) -> None:
    shown = _help(path).rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(shown) if line.strip() == "Exit codes:")
    rows = shown[start + 1:]
    assert rows and all(re.match(r"^ {4}(\d+|N) +\S", row) or re.match(r"^ {9}\S", row) for row in rows), rows
    codes = [row.split()[0] for row in rows if re.match(r"^ {4}\S", row)]
    assert codes[0] == "0" and "2" in codes and codes[-2:] == ["130", "143"], codes


@pytest.mark.parametrize(("path", "command"), LEAVES, ids=_ids)
def test_every_command_groups_its_options_with_remote_stores_last(path: tuple[str, ...], command: click.Command) -> None:
    assert isinstance(command, Command), f"{_ids(path)}: make it @click.command(cls=tracediff.commands.options.Command)"
    shown = _help(path)
    headings = _HEADING.findall(shown[:shown.index("Exit codes:")])
    sections = [h for h in headings if h not in ("Usage", "Commands")]
    assert "Options" not in sections and sections[-1] == OTHER, sections
    assert len(sections) >= 2, f"{_ids(path)}: its options in one section {sections}"
    if REMOTE in sections:
        assert sections[-2] == REMOTE, sections
    if any("--storage-option" in p.opts for p in command.params):
        listed = re.search(r"^  --storage-option KEY=VALUE", shown, re.MULTILINE)
        assert listed is not None, shown
        assert _HEADING.findall(shown[:listed.start()])[-1] == REMOTE, f"{_ids(path)}: --storage-option not under {REMOTE}"


@pytest.mark.parametrize(("path", "command"), [c for c in COMMANDS if isinstance(c[1], click.Group)], ids=_ids)
def test_every_group_is_a_command_group_with_its_commands_listed(path: tuple[str, ...], command: click.Group) -> None:
    assert isinstance(command, CommandGroup)
    assert "Commands:" in _help(path)


def test_the_docs_page_gives_every_commands_exit_codes() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    table = page[page.index("## Exit codes"):]
    listed = {name.strip() for row in re.findall(r"^\| ([a-z][^|]*?) \|", table, re.MULTILINE) if row != "command"
              for name in row.split(",")}
    assert listed == {" ".join(path) for path, _ in LEAVES}


# ------------------------------------------------------------------------------------------ outputs
@pytest.mark.parametrize(("path", "command"), LEAVES, ids=_ids)
def test_every_report_output_is_a_path_named_json_markdown_or_html_and_takes_a_dash(
        path: tuple[str, ...], command: click.Command) -> None:
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        if set(param.opts) & {"--json", "--markdown", "--html"}:
            assert not param.is_flag, f"{_ids(path)} {param.opts}: a flag, not a PATH"
            assert isinstance(param.type, click.Path) and param.type.allow_dash, f"{_ids(path)} {param.opts}"
            assert "'-': stdout" in (param.help or ""), param.help
        assert not {"--report", "--dtype"} & set(param.opts), f"{_ids(path)}: {param.opts} (renamed: docs/cli.md)"


def test_compare_json_dash_is_the_report_on_stdout_and_the_verdict_on_stderr() -> None:
    result = run_tracediff("compare", TRAIN, BROKEN, "--json", "-")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "mismatch"
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("mismatch: 1 root cause"), result.stderr


def test_compare_markdown_dash_goes_to_stdout_with_a_json_file_beside_it(tmp_path: Path) -> None:
    result = run_tracediff("compare", TRAIN, BROKEN, "--markdown", "-", "--json", tmp_path / "r.json")
    assert result.returncode == 1, result.stderr
    assert result.stdout.lstrip().startswith("#") and "segment_order" in result.stdout
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "mismatch"
    assert f"wrote the JSON report {tmp_path / 'r.json'}" in result.stderr
    assert not (Path.cwd() / "-").exists()


def test_inspect_and_identify_json_dash_print_only_the_json(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shown = invoke_tracediff("inspect", TRAIN, "--json", "-")
    assert shown.returncode == 0, shown.stderr
    assert "fc_in" in json.loads(shown.stdout)["taps"]
    written = invoke_tracediff("inspect", TRAIN, "--json", tmp_path / "d.json")
    assert written.returncode == 0 and "fc_in" in written.stdout  # the text as without --json
    assert json.loads((tmp_path / "d.json").read_text()) == json.loads(shown.stdout)
    assert invoke_tracediff("inspect", TRAIN, "--json", "./-").stdout == written.stdout  # a file named '-'
    assert json.loads((tmp_path / "-").read_text()) == json.loads(shown.stdout)
    ident = run_tracediff("identify", BROKEN, "--bank", BANK, "--json", "-")
    assert ident.returncode in (0, 1), ident.stderr
    assert [s["verdict"] for s in json.loads(ident.stdout)["segments"]]
    assert ident.stderr.strip(), "identify's table goes to stderr"


def test_send_json_dash_is_what_was_sent_on_stdout_and_the_summary_on_stderr() -> None:
    from test_send import FakeServer  # noqa: PLC0415

    server = FakeServer()
    server.vocab_size = None
    try:
        result = run_tracediff("send", TRAIN, "--url", server.url, "--no-progress", "--json", "-")
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    sent = json.loads(result.stdout)
    assert sent["trace"] == str(TRAIN) and len(sent["responses"]) == 6
    assert result.stderr.startswith("sent 6 of 6 sequences"), result.stderr


def test_two_outputs_to_stdout_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    _one_line_error(invoke_tracediff("compare", tmp_path / "none.zarr", BROKEN, "--json", "-", "--html", "-"),
                    "--json - and --html -: one output at most goes to stdout")


def test_inspect_json_without_a_path_says_it_takes_one() -> None:
    _one_line_error(invoke_tracediff("inspect", TRAIN, "--json"), "'--json' requires an argument")


# ------------------------------------------------------------------------------------------ mistyped
def test_a_mistyped_record_option_is_one_line_and_the_command_never_runs(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    store = tmp_path / "x.zarr"
    for args, wrong, meant in (
        (["--aux-layer", "0,3", "-o", store, "--", *command], "--aux-layer", "--aux-layers"),
        (["--tap", "Head.fc", "-o", store, "--ovewrite", *command], "--ovewrite", "--overwrite"),
    ):
        result = invoke_tracediff("record", *args)
        _one_line_error(result, f"no such option {wrong}; did you mean {meant}?")
        assert not ran.exists() and not store.exists()


def test_record_passes_everything_from_the_command_on_untouched(tmp_path: Path) -> None:
    argv = tmp_path / "argv.json"
    script = f"import json, sys; json.dump(sys.argv[1:], open({str(argv)!r}, 'w'))"
    run_tracediff("record", "--tap", "Head.fc", "-o", tmp_path / "a.zarr", "--", sys.executable, "-c", script,
                  "--tap", "-o", "--", "--bogus", cwd=tmp_path)
    assert json.loads(argv.read_text()) == ["--tap", "-o", "--", "--bogus"]
    run_tracediff("record", "--tap", "Head.fc", "-o", tmp_path / "b.zarr", sys.executable, "-c", script,
                  "--aux-layer", cwd=tmp_path)
    assert json.loads(argv.read_text()) == ["--aux-layer"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["compar", TRAIN, BROKEN], "no such command compar; did you mean compare?"),
        (["import", "specforg", "x", "-o", "y"], "no such command specforg; did you mean specforge?"),
        (["import", "nothing"], "no such command nothing; the commands: specforge, speculators"),
        (["compare", TRAIN, BROKEN, "--verbos"], "no such option --verbos; did you mean --verbose?"),
        (["send", TRAIN, "--ur", "http://127.0.0.1:9"], "no such option --ur; did you mean --url?"),
        (["--bogus"], "no such option --bogus (usage: "),
        (["compare", TRAIN, BROKEN, "--dtype", "auto"], "no such option --dtype; it is --replay-dtype now"),
        (["calibrate", TRAIN, "--model", "m", "--dtype", "bfloat16"], "no such option --dtype; it is --server-dtype now"),
        (["send", TRAIN, "--url", "http://x", "--report", "s.json"], "no such option --report; it is --json now"),
    ],
)
def test_a_mistyped_command_or_option_says_what_was_meant(args: list, line: str) -> None:
    _one_line_error(invoke_tracediff(*args), line)


# ------------------------------------------------------------------------------------------ words
def test_an_existing_destination_is_refused_in_the_command_lines_words(tmp_path: Path) -> None:
    dest = tmp_path / "train.zarr.zip"
    dest.write_bytes(b"")
    line = _one_line_error(invoke_tracediff("pack", TRAIN, "-o", dest), "already exists; pass --overwrite")
    assert "=True" not in line
