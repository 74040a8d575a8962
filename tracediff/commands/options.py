"""What the `tracediff` commands share: the store argument type, ``--storage-option``, sizes, the
replay options of `compare --draft` and `replay`, stage progress, the check of output paths before a
command computes anything, the exit codes their help states, and the command group that maps every
:class:`tracediff.errors.TracediffError` (and click's usage errors) to one line and exit code 2.

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


def _set_storage_options(ctx: click.Context, param: Any, value: tuple[str, ...]) -> None:
    from tracediff.store.location import default_storage_options, parse_storage_options  # noqa: PLC0415

    ctx.with_resource(default_storage_options(parse_storage_options(value)))


def storage_options(func: Any) -> Any:
    """``--storage-option KEY=VALUE``: fsspec options for every URL the command opens."""
    return click.option(
        "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", expose_value=False,
        callback=_set_storage_options, is_eager=True,
        help="fsspec option for the store URLs (repeatable; VALUE is JSON when it parses), e.g. "
             "endpoint_url=http://127.0.0.1:9000, anon=true, config_kwargs.read_timeout=30, retries=2 (s3fs's retry "
             "count). Credentials "
             "otherwise come from the standard environment and config files (AWS_*, ~/.aws/).",
    )(func)


def store_name(store: Path | str) -> str:
    """A store's name: a path as given, a URL's last part (``s3://b/x/train.zarr`` -> ``train.zarr``)."""
    return str(store) if isinstance(store, Path) else str(store).rstrip("/").rsplit("/", 1)[-1]


class CommandGroup(click.Group):
    """A click group whose every error, click's usage errors included, is one ``tracediff: error:`` line
    and exit code 2; a KeyboardInterrupt is one ``tracediff: interrupted`` line and 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            # click's own three lines (usage, hint, message) as one, like every other error here.
            where = exc.ctx or ctx
            usage = where.get_usage().replace("Usage: ", "", 1).strip()
            message = exc.format_message().rstrip(".")
            message = message[:1].lower() + message[1:]
            help_hint = f"{where.command_path} -h"
            click.echo(f"tracediff: error: {message} (usage: {usage}; see '{help_hint}')", err=True)
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
            ctx.exit(130)


def replay_options(func: Any) -> Any:
    """The options of `replay`, shared by `compare --draft`."""
    options = [
        click.option("--draft", type=click.Path(path_type=Path),
                     help="EAGLE-3 draft checkpoint folder (config.json + *.safetensors): replay it on both sides' rows."),
        click.option("--target", type=click.Path(path_type=Path),
                     help="Target model folder (safetensors), for the embedding of a draft that has none."),
        click.option("--server-draft", type=click.Path(path_type=Path),
                     help="The checkpoint the server loaded, when it is not --draft (e.g. another conversion)."),
        click.option("--send-report", type=click.Path(path_type=Path),
                     help="tracediff send --report FILE: the engine's own accept length per request, for (d)."),
        click.option("--steps", type=int, default=3, show_default=True, help="Draft steps to replay (K)."),
        click.option("--max-sequences", type=int, help="Replay only the first N common sequences."),
        click.option("--score-rows", type=int, default=4096, show_default=True,
                     help="Score step 0 at most at N starts per replay, evenly spread (every row's key is computed)."),
        click.option("--multi-step-starts", type=int, default=1024, show_default=True,
                     help="Draft steps >= 1 from at most N of the scored starts."),
        click.option("--dtype", "replay_dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
                     show_default=True, help="Replay compute dtype (auto: the checkpoint's; bf16 stays bf16)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def stage_progress(command: str, flag: bool | None, **counting: Any) -> Any:
    """The stage progress of a long command on stderr (``--progress/--no-progress``; None: by the terminal);
    ``counting``: what it counts (:class:`tracediff.progress.Progress`)."""
    from tracediff.progress import Progress, progress_mode  # noqa: PLC0415

    return Progress(command, progress_mode(flag), **counting)


def check_output_files(*outputs: tuple[str, Path | None]) -> None:
    """Before a command computes anything: each output file it was given (``("--html", path)``; None:
    not given) can be written, i.e. it is no folder, no device or other special file (the file is
    renamed over it), its folder exists and a file can be created there (tried: permission bits say
    nothing to root, nor on a read-only mount), and no two options name the same file. Raises
    :class:`UsageError` naming the option and the path."""
    seen: dict[Path, str] = {}
    for option, path in outputs:
        if path is None:
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
        lines += textwrap.wrap(text, width=76, initial_indent=f"  {code!s:<5}", subsequent_indent=" " * 7)
    return "\n".join(lines)


def write_reports(report: Any, json_path: Path | None, markdown_path: Path | None,
                  html_path: Path | None) -> TracediffError | None:
    """Write a compare's report files (each whole or not at all); a failure (the folder gone or full
    since :func:`check_output_files`) is returned, for the command to raise once it has printed the
    verdict it computed: a report that cannot be written never hides the verdict."""
    from tracediff.report import write_report  # noqa: PLC0415

    try:
        write_report(report, json_path=json_path, markdown_path=markdown_path, html_path=html_path)
    except TracediffError as exc:
        return exc
    return None


def write_json_result(path: Path | None, data: Any) -> TracediffError | None:
    """Write a command's JSON result, when asked (whole or not at all); a failure is returned, as by
    :func:`write_reports`, for the command to raise once it has printed what it found."""
    if path is None:
        return None
    from tracediff.report import write_json  # noqa: PLC0415

    try:
        write_json(path, data)
    except TracediffError as exc:
        return exc
    return None


def say_written(command: str, json_path: Path | None, markdown_path: Path | None, html_path: Path | None) -> None:
    """One line per report file written, on stderr (stdout stays the report, or -q's one line)."""
    for kind, path in (("JSON", json_path), ("Markdown", markdown_path), ("HTML", html_path)):
        if path is not None:
            click.echo(f"tracediff {command}: wrote the {kind} report {path}", err=True)
