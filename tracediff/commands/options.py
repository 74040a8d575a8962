"""The conventions every `tracediff` command follows, in one place (docs/cli.md says them to users):

- its help groups the options under section headings (:func:`section`; what to compare first,
  reports, replay, remote stores last, then "Other") and ends with its exit codes (:func:`exit_codes`);
- every report or result it writes is ``--json PATH`` / ``--markdown PATH`` / ``--html PATH``
  (:func:`output_option`), ``-`` for stdout, and then the text it would print goes to stderr;
- an unknown option or command is one ``tracediff: error:`` line with a did-you-mean and exit code 2
  (:class:`CommandGroup`), as is every :class:`tracediff.errors.TracediffError`; a renamed option
  says its new name.

Also what they share: the store argument type, ``--storage-option``, sizes, the replay options of
`compare --draft` and `replay`, stage progress, the check of output paths before a command computes
anything.

Imports nothing heavy: `tracediff --help` loads this module.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path
from typing import Any

import click

from tracediff.errors import TracediffError, UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | None, what: str) -> int | None:
    """'512MiB', '2G', '1000' -> bytes (binary multiples)."""
    if text is None:
        return None
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"{what}: cannot read size {text!r}; use e.g. 512MiB or 2GiB")
    number, unit = float(match[1]), match[2].lower()
    return int(number * (1024 ** " kmgt".index(unit or " ")))


class _StoreType(click.ParamType):
    """A store argument: a local path (a Path) or an fsspec URL (kept as the string: a Path would
    fold the ``//`` of ``s3://``)."""

    name = "store"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, Path):
            return value
        from tracediff.store.location import is_url  # noqa: PLC0415

        return str(value) if is_url(str(value)) else Path(value)


STORE = _StoreType()


# ------------------------------------------------------------------------------ help sections
#: The section headings of the commands' help, in the order they come (sections a command does not
#: use are left out; "Remote stores" and "Other" come last whatever the order of the options).
WHAT_TO_COMPARE = "What to compare"
REPORTS = "Reports"
REPLAY = "Replay (with --draft)"
REMOTE = "Remote stores"
OTHER = "Other"


def section(title: str, *decorators: Any) -> Any:
    """Apply click option ``decorators`` and file their options under ``title`` in the help."""

    def apply(func: Any) -> Any:
        before = len(getattr(func, "__click_params__", []))
        for decorator in reversed(decorators):
            func = decorator(func)
        for param in func.__click_params__[before:]:
            param.help_section = title
        return func

    return apply


def _format_sections(command: click.Command, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    sections: dict[str, list[tuple[str, str]]] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None and not isinstance(param, click.Argument):
            sections.setdefault(getattr(param, "help_section", OTHER), []).append(record)
    last = [title for title in (REMOTE, OTHER) if title in sections]
    for title in [t for t in sections if t not in last] + last:
        with formatter.section("Options" if list(sections) == [OTHER] else title):
            formatter.write_dl(sections[title])


class Command(click.Command):
    """A tracediff command: its help shows the options by :func:`section`; its epilog is
    :func:`exit_codes`."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_sections(self, ctx, formatter)


# ------------------------------------------------------------------------------ errors
#: Options that were renamed: the error for the old name says the new one (not "no such option" alone).
RENAMED_OPTIONS = {
    ("compare", "--dtype"): "--replay-dtype",
    ("replay", "--dtype"): "--replay-dtype",
    ("calibrate", "--dtype"): "--server-dtype",
    ("send", "--report"): "--json",
}


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """``"; did you mean --aux-layers?"``: the nearest of ``candidates`` (the nearly as near too), or ''."""
    import difflib  # noqa: PLC0415

    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in candidates), reverse=True)
    near = [c for score, c in scored if score >= max(0.6, scored[0][0] - 0.05)] if scored else []
    return f"; did you mean {' or '.join(near)}?" if near else ""


def _usage_error_line(exc: click.UsageError, ctx: click.Context) -> str:
    """click's usage error (usage, hint, message in three lines) as one line."""
    where = exc.ctx or ctx
    if isinstance(exc, click.NoSuchOption):
        renamed = RENAMED_OPTIONS.get((where.info_name or "", exc.option_name))
        message = f"no such option {exc.option_name}"
        if renamed is not None:
            message += f"; it is {renamed} now"
        else:
            options = [o for p in where.command.get_params(where) for o in [*p.opts, *p.secondary_opts]
                       if o.startswith("-")]
            message += _did_you_mean(exc.option_name, options)
    else:
        message = exc.format_message().rstrip(".")
        message = message[:1].lower() + message[1:]
    usage = where.get_usage().replace("Usage: ", "", 1).strip()
    return f"tracediff: error: {message} (usage: {usage}; see '{where.command_path} -h')"


class CommandGroup(click.Group):
    """The tracediff group (and `import`'s): its commands are :class:`Command` (help in sections); an
    unknown command or option is one ``tracediff: error:`` line with a did-you-mean and exit code 2, as
    is every click usage error and every :class:`TracediffError`; a KeyboardInterrupt is one
    ``tracediff: interrupted`` line and 130."""

    command_class = Command
    group_class = type  # a group made with @group.group is a CommandGroup too

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_sections(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # The program's own options (`tracediff --bogus`) are parsed before invoke: same one line.
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `tracediff import` alone: its help, as click shows it
                raise
            click.echo(_usage_error_line(exc, ctx), err=True)
            ctx.exit(2)
            raise  # (ctx.exit raises)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            name = args[0] if args else ""
            if not name or name.startswith("-") or name in self.commands:
                raise
            hint = _did_you_mean(name, list(self.commands)) or f"; the commands: {', '.join(sorted(self.commands))}"
            raise click.UsageError(f"no such command {name}{hint}", ctx) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                raise
            click.echo(_usage_error_line(exc, ctx), err=True)
            ctx.exit(2)
        except TracediffError as exc:
            # One line whatever the message embeds (a library's multi-line text, a file name with a
            # newline): scripts and CI logs read the first line only.
            text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            click.echo(f"tracediff: error: {text}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            # Ctrl-C where the program's own handler is not installed (``main`` called by another
            # program): as tracediff.cli.run says it, not click's "Aborted!" and exit 1 ("mismatch").
            click.echo("tracediff: interrupted", err=True)
            from tracediff.store.files import silence_abandoned_io  # noqa: PLC0415

            silence_abandoned_io()
            ctx.exit(130)


# ------------------------------------------------------------------------------ shared options
def _set_storage_options(ctx: click.Context, param: Any, value: tuple[str, ...]) -> None:
    from tracediff.store.location import default_storage_options, parse_storage_options  # noqa: PLC0415

    ctx.with_resource(default_storage_options(parse_storage_options(value)))


def storage_options(func: Any) -> Any:
    """``--storage-option KEY=VALUE``: fsspec options for every URL the command opens (section
    "Remote stores", near the end of the help whatever the decorator's place)."""
    return section(REMOTE, click.option(
        "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", expose_value=False,
        callback=_set_storage_options, is_eager=True,
        help="fsspec option for the store URLs (repeatable; VALUE is JSON when it parses), e.g. "
             "endpoint_url=http://127.0.0.1:9000, anon=true, config_kwargs.read_timeout=30, retries=2 (s3fs's retry "
             "count). Credentials "
             "otherwise come from the standard environment and config files (AWS_*, ~/.aws/).",
    ))(func)


def store_name(store: Path | str) -> str:
    """A store's name: a path as given, a URL's last part (``s3://b/x/train.zarr`` -> ``train.zarr``)."""
    return str(store) if isinstance(store, Path) else str(store).rstrip("/").rsplit("/", 1)[-1]


def replay_options(title: str) -> Any:
    """The options of `replay`, shared by `compare --draft`, under ``title`` in the help."""
    return section(
        title,
        click.option("--draft", type=click.Path(path_type=Path),
                     help="EAGLE-3 draft checkpoint folder (config.json + *.safetensors): replay it on both sides' rows."),
        click.option("--target", type=click.Path(path_type=Path),
                     help="Target model folder (safetensors), for the embedding of a draft that has none; compare also "
                          "reads its final norm weight to name a slot normalised on one side only as the final norm."),
        click.option("--server-draft", type=click.Path(path_type=Path),
                     help="The checkpoint the server loaded, when it is not --draft (e.g. another conversion)."),
        click.option("--send-report", type=click.Path(path_type=Path),
                     help="What tracediff send --json FILE wrote: the engine's own accept length per request, for (d)."),
        click.option("--steps", type=int, default=3, show_default=True, help="Draft steps to replay (K)."),
        click.option("--max-sequences", type=int, help="Replay only the first N common sequences."),
        click.option("--score-rows", type=int, default=4096, show_default=True,
                     help="Score step 0 at most at N starts per replay, evenly spread (every row's key is computed)."),
        click.option("--multi-step-starts", type=int, default=1024, show_default=True,
                     help="Draft steps >= 1 from at most N of the scored starts."),
        click.option("--replay-dtype", "replay_dtype", type=click.Choice(["auto", "float32", "bfloat16"]),
                     default="auto", show_default=True,
                     help="The dtype the draft runs in (auto: the checkpoint's; bf16 stays bf16)."),
    )


def stage_progress(command: str, flag: bool | None, **counting: Any) -> Any:
    """The stage progress of a long command on stderr (``--progress/--no-progress``; None: by the terminal);
    ``counting``: what it counts (:class:`tracediff.progress.Progress`)."""
    from tracediff.progress import Progress, progress_mode  # noqa: PLC0415

    return Progress(command, progress_mode(flag), **counting)


def _output_path(ctx: click.Context, param: Any, value: str | None) -> Path | str | None:
    # '-' stays the string: a Path would fold './-' (a file named '-') into '-' as well.
    return value if value is None or value == "-" else Path(value)


def output_option(flag: str, dest: str, what: str) -> Any:
    """A report or result output: ``--json PATH`` (``--markdown``, ``--html``), ``-`` for stdout (the
    string ``"-"``; every other value a Path, ``./-`` a file)."""
    return click.option(flag, dest, type=click.Path(allow_dash=True), callback=_output_path, metavar="PATH",
                        help=f"{what} ('-': stdout, and the printed text goes to stderr).")


def to_stdout(path: Path | str | None) -> bool:
    """The output option said ``-``: the document goes to stdout."""
    return isinstance(path, str) and path == "-"


def check_output_files(*outputs: tuple[str, Path | None]) -> None:
    """Before a command computes anything: each output file it was given (``("--html", path)``; None:
    not given; ``-``: stdout, for one of them at most) can be written, i.e. it is no folder, no device
    or other special file (the file is renamed over it), its folder exists and a file can be created
    there (tried: permission bits say nothing to root, nor on a read-only mount), and no two options
    name the same file. Raises :class:`UsageError` naming the option and the path."""
    to_out = [option for option, path in outputs if to_stdout(path)]
    if len(to_out) > 1:
        raise UsageError(f"{to_out[0]} - and {to_out[1]} -: one output at most goes to stdout; give the other a "
                         f"file path")
    seen: dict[Path, str] = {}
    for option, path in outputs:
        if path is None or to_stdout(path):
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise UsageError(f"{option} {path}: {seen[key]} names the same file; give each report its own path")
        seen[key] = option
        if path.is_dir():
            raise UsageError(f"{option} {path}: is a folder; give a file name")
        if path.exists() and not path.is_file():
            raise UsageError(f"{option} {path}: is not a regular file (a device, a pipe: the file written would replace it); give a file path")
        _check_creatable(option, path, key.parent)


def check_output_folder(option: str, folder: Path) -> None:
    """Before a command computes anything: ``folder`` (created by the command where missing) is or can
    be a folder where files can be created. Raises :class:`UsageError` naming the option and the path."""
    existing = Path(os.path.abspath(folder))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == Path(os.path.abspath(folder)) and not existing.is_dir():
        raise UsageError(f"{option} {folder}: exists and is not a folder; give a folder for the reports")
    _check_creatable(option, folder, existing)


def check_output_store(option: str, store: Path) -> None:
    """Before a command reads anything: the folder of the local store it creates at ``store`` (built
    beside it under a hidden name, then renamed) takes new files. Raises :class:`UsageError`."""
    _check_creatable(option, store, Path(os.path.abspath(store)).parent)


def _check_creatable(option: str, path: Path, folder: Path) -> None:
    if not folder.exists():
        raise UsageError(f"{option} {path}: folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: {folder} is not a folder")
    probe = folder / f".tracediff-probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create a file in {folder}: {exc.strerror or exc}") from exc
    with contextlib.suppress(OSError):
        os.unlink(probe)


def exit_codes(*codes: tuple[int | str, str]) -> str:
    """The ``Exit codes`` block of a command's help (its epilog): its own codes, ``(0, "match")``, ...,
    then the two every command shares (:mod:`tracediff.cli`: one ``tracediff:`` line, then 130 or 143)."""
    import textwrap  # noqa: PLC0415

    rows = [*codes, (130, "interrupted (Ctrl-C, SIGINT)"), (143, "terminated (SIGTERM)")]
    lines = ["\b", "Exit codes:"]
    for code, text in rows:
        lines += textwrap.wrap(text, width=76, initial_indent=f"  {code!s:<5}", subsequent_indent=" " * 7,
                               break_on_hyphens=False)
    return "\n".join(lines)


def write_reports(report: Any, json_path: Path | None, markdown_path: Path | None,
                  html_path: Path | None) -> TracediffError | None:
    """Write a compare's reports: the one given as ``-`` to stdout, the files each whole or not at all;
    a failure (the folder gone or full since :func:`check_output_files`) is returned, for the command
    to raise once it has printed the verdict it computed: a report that cannot be written never hides
    the verdict."""
    from tracediff.report import render_html, render_markdown, write_report  # noqa: PLC0415

    for path, render in ((json_path, lambda r: r.to_json() + "\n"), (markdown_path, render_markdown),
                         (html_path, render_html)):
        if to_stdout(path):
            click.echo(render(report), nl=False)
    files = [None if to_stdout(p) else p for p in (json_path, markdown_path, html_path)]
    try:
        write_report(report, json_path=files[0], markdown_path=files[1], html_path=files[2])
    except TracediffError as exc:
        return exc
    return None


def write_json_result(path: Path | None, data: Any) -> TracediffError | None:
    """Write a command's JSON result, when asked: to stdout for ``-``, else to the file, whole or not
    at all; a failure is returned, as by :func:`write_reports`, for the command to raise once it has
    printed what it found."""
    if path is None:
        return None
    from tracediff.report import json_text, write_json  # noqa: PLC0415

    if to_stdout(path):
        click.echo(json_text(data), nl=False)
        return None
    try:
        write_json(path, data)
    except TracediffError as exc:
        return exc
    return None


def say_written(command: str, json_path: Path | None, markdown_path: Path | None, html_path: Path | None) -> None:
    """One line per report file written, on stderr (stdout stays the report, or -q's one line)."""
    for kind, path in (("JSON", json_path), ("Markdown", markdown_path), ("HTML", html_path)):
        if path is not None and not to_stdout(path):
            click.echo(f"tracediff {command}: wrote the {kind} report {path}", err=True)
