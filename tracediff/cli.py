"""The `tracediff` command: a thin layer over the library.

Every command maps :class:`tracediff.errors.TracediffError` to a one-line ``tracediff: error: ...``
message and exit code 2; a traceback from here is a bug.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from tracediff import __version__
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


def _storage_options(func: Any) -> Any:
    """``--storage-option KEY=VALUE``: fsspec options for every URL the command opens."""
    return click.option(
        "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", expose_value=False,
        callback=_set_storage_options, is_eager=True,
        help="fsspec option for the store URLs (repeatable; VALUE is JSON when it parses), e.g. "
             "endpoint_url=http://127.0.0.1:9000, anon=true, config_kwargs.read_timeout=30, retries=2 (s3fs's retry "
             "count). Credentials "
             "otherwise come from the standard environment and config files (AWS_*, ~/.aws/).",
    )(func)


def _store_name(store: Path | str) -> str:
    return str(store) if isinstance(store, Path) else str(store).rstrip("/").rsplit("/", 1)[-1]


class _Group(click.Group):
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


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracediff")
def main() -> None:
    """Record and compare the fc-input rows an EAGLE-3 draft sees in training and in serving."""


def _replay_options(func: Any) -> Any:
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


# ---------------------------------------------------------------------------------- record
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_storage_options
@click.option("-o", "--output", "output", required=True, type=STORE, help="Store to create.")
@click.option("--adapter", "adapters", multiple=True, help="Framework adapter: sglang, vllm, speculators, specforge, hf (a bank of every layer), generic; repeatable.")
@click.option("--tap", "taps", multiple=True,
              help="Tap spec [NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG] (grammar below); repeatable.")
@click.option("--labels-from", "labels_from", multiple=True,
              help="Class whose forward's input_ids/position_ids label the rows captured after it.")
@click.option("--segment-size", type=int, help="Width of one segment of the tapped rows (e.g. hidden size).")
@click.option("--segment-labels", help="Comma-separated segment names, e.g. hs0,hs3,hs6.")
@click.option("--role", default="", help="What this recording is (trainer, server, bank...).")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
@click.option("--append", "join", is_flag=True,
              help="Add this run's writer groups to the store if it exists already (several nodes recording into one "
                   "store, e.g. -o s3://bucket/server.zarr on each).")
@click.option("--max-rows", type=int, help="Rows to record at most, per tap and process.")
@click.option("--max-bytes", help="Bytes to record at most, per tap and process (e.g. 4GiB).")
@click.option("--every-n-steps", type=int, default=1, show_default=True, help="Record one step in N.")
@click.option("--first-n-steps", type=int, help="Record only steps 0..N-1.")
@click.option("--phases", help="Comma-separated phases to record (train, prefill, draft_extend, decode...).")
@click.option("--on-full", type=click.Choice(["drop", "block"]), default="drop", show_default=True,
              help="When the writer falls behind: drop and count the batch, or wait (bounded) for it.")
@click.option("--queue-bytes", default="1GiB", show_default=True, help="Host memory the queue may hold.")
@click.option("--compressor", type=click.Choice(["none", "lz4", "zstd"]), default="none", show_default=True,
              help="Compress value chunks (none is the fastest to write and to compare; zstd the smallest).")
@click.option("--chunk-rows", type=int, default=1024, show_default=True,  # tracediff.store.DEFAULT_CHUNK_ROWS
              help="Rows per chunk file: larger chunks mean fewer files, smaller ones less lost on a kill.")
@click.option("--durable", is_flag=True, help="fsync each batch before committing it.")
@click.option("--retry-seconds", type=float, default=60.0, show_default=True,  # remote_writer.DEFAULT_RETRY_SECONDS
              help="At a URL: how long a batch whose upload failed on the way (endpoint unreachable, connection "
                   "reset, timeout) is sent again before recording stops and the rest is counted as lost.")
@click.option("--all-ranks", is_flag=True,
              help="Record every tensor-parallel rank (sglang: default is attention-TP rank 0 only).")
@click.option("--commit", "commit", type=click.Choice(["step", "background"]), default="step", show_default=True,
              help="vllm: step = each drafter call's rows are committed before vLLM returns its tokens (survives a "
                   "SIGKILL of the worker); background = writes overlap serving (faster, the last rows may be lost).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def record(
    output: Path,
    adapters: tuple[str, ...],
    taps: tuple[str, ...],
    labels_from: tuple[str, ...],
    segment_size: int | None,
    segment_labels: str | None,
    role: str,
    overwrite: bool,
    join: bool,
    max_rows: int | None,
    max_bytes: str | None,
    every_n_steps: int,
    first_n_steps: int | None,
    phases: str | None,
    on_full: str,
    queue_bytes: str,
    compressor: str,
    chunk_rows: int,
    durable: bool,
    retry_seconds: float,
    all_ranks: bool,
    commit: str,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND with recording injected into each of its Python processes.

    Example: tracediff record --tap Eagle3DraftModel.fc:input -o train.zarr -- python train.py

    -o may be an fsspec URL (s3://bucket/server.zarr): the rows are uploaded as they are committed.

    \b
    Tap spec grammar: [NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG]
      NAME=       the tap's name in the store (default: the last attribute + _in or _out, e.g. fc_in)
      CLASS       a class name, qualified name or module.qualname; subclasses match too
      .ATTR.PATH  the module below each instance of CLASS (.fc, .model.fc, .layers.0.fc)
      :input      record the module's input (the default; :in works too)
      :output     record its output (:out; the first tensor of a tuple)
      @ARG        which input: a position (@0, the default) or a keyword (@hidden_states)
    Examples: Eagle3DraftModel.fc:input, fc_in=LlamaForCausalLMEagle3.model.fc, MyDraft.layers.0.fc:output

    A run that records no row leaves no store behind (with --append the store stays: other nodes may
    be recording into it). Exit code: the command's; 2 when the command exited 0 but a process lost
    rows (a writer error, an interpreter that cannot import tracediff): never 0 having lost rows.
    """
    from tracediff.adapters import adapter_info, check_installed  # noqa: PLC0415
    from tracediff.limits import Limits  # noqa: PLC0415
    from tracediff.store import create_store, default_source, open_store  # noqa: PLC0415
    from tracediff.tapspec import TapSpec  # noqa: PLC0415

    specs = [TapSpec.parse(t) for t in taps]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UsageError(f"two --tap specs share a tap name ({', '.join(names)}); name them with NAME=SPEC")
    for name in adapters:
        adapter_info(name)
        check_installed(name)
    if not specs and not adapters:
        raise UsageError("nothing to record: give --tap SPEC and/or --adapter NAME")
    if segment_size is not None and segment_size <= 0:
        raise UsageError(f"--segment-size must be positive, got {segment_size}")
    if chunk_rows <= 0:
        raise UsageError(f"--chunk-rows must be positive, got {chunk_rows}")
    if not 0 <= retry_seconds < float("inf"):
        raise UsageError(f"--retry-seconds must be a number of seconds, 0 or more, got {retry_seconds}")
    limits = Limits(
        max_rows=max_rows,
        max_bytes=parse_size(max_bytes, "--max-bytes"),
        every_n_steps=every_n_steps,
        first_n_steps=first_n_steps,
        phases=frozenset(p.strip() for p in phases.split(",") if p.strip()) if phases else None,
    )
    queue_limit = parse_size(queue_bytes, "--queue-bytes") or 0
    if queue_limit <= 0:
        raise UsageError("--queue-bytes must be positive")
    command = tuple(c for c in command if c != "--") if command[:1] == ("--",) else command
    if not command:
        raise UsageError("no command to run after --")
    if shutil.which(command[0]) is None:  # checked before the store exists: nothing is left behind
        raise UsageError(f"cannot run {command[0]!r}: no such command (check its name, path and the PATH)")
    if join and overwrite:
        raise UsageError("--append adds to the store and --overwrite replaces it: give one of them")

    from tracediff.store.location import Location  # noqa: PLC0415

    location = Location.of(output)
    config = {
        "store": location.url if location.remote else str(Path(output).resolve()),
        "role": role,
        "taps": [s.text for s in specs],
        "adapters": list(adapters),
        "labels_from": list(labels_from),
        "segment_size": segment_size,
        "segment_labels": [x.strip() for x in segment_labels.split(",")] if segment_labels else None,
        "limits": limits.as_dict(),
        "on_full": on_full,
        "max_queue_bytes": queue_limit,
        "compressor": compressor,
        "chunk_rows": chunk_rows,
        "durable": durable,
        "retry_seconds": retry_seconds,
        "all_ranks": all_ranks,
        "commit": commit,
    }
    source = default_source(role)
    source["argv"] = list(command)
    source["recorded_by"] = ["tracediff", "record", *sys.argv[2:]] if len(sys.argv) > 1 else ["tracediff", "record"]
    create_store(location if location.remote else output, role=role, source=source, overwrite=overwrite, join=join,
                 meta={"record": {k: v for k, v in config.items() if k != "store"}})
    if location.remote and location.storage_options:
        # The children write with the same options (never stored in the store's meta: credentials).
        config["storage_options"] = location.storage_options

    from tracediff.inject import ENV_REPORT_DIR, read_notes, recording_problems  # noqa: PLC0415

    env = dict(os.environ)
    hooks_dir = _hooks_dir()
    env["PYTHONPATH"] = os.pathsep.join([hooks_dir, *filter(None, [env.get("PYTHONPATH")])])
    env["TRACEDIFF_CONFIG"] = json.dumps(config)
    # Where the command's processes tell this one how they recorded (on this machine, whatever -o
    # is): the store alone cannot say that a process never recorded (an interpreter without
    # tracediff), nor which of a shared store's groups are this run's.
    notes_dir = tempfile.mkdtemp(prefix="tracediff-record-")
    env[ENV_REPORT_DIR] = notes_dir
    try:
        try:
            returncode = _run_forwarding_signals(list(command), env)
        except UsageError:
            if not join:  # the command never started: leave no empty store (with --append: others' store)
                _discard_store(location)
            raise
        problems = recording_problems(read_notes(notes_dir))
    finally:
        shutil.rmtree(notes_dir, ignore_errors=True)

    from tracediff.describe import describe_store, warnings_for  # noqa: PLC0415

    try:
        with open_store(location) as store:
            desc = describe_store(store)
    except TracediffError as exc:
        # The store cannot be read now (its endpoint gone for good, say): what the command's
        # processes said about their recording is all there is, and it is said.
        click.echo(f"tracediff: command exited with code {returncode}; store {location.display}", err=True)
        for problem in problems:
            click.echo(f"tracediff: error: {problem}", err=True)
        code = returncode or 2
        click.echo(f"tracediff: error: no summary of the store after the run: {exc}", err=True)
        click.echo(f"tracediff: error: {'recording lost rows (above)' if problems else 'the store cannot be read'}; "
                   f"exit code {code}, the command itself exited with code {returncode}", err=True)
        sys.exit(code)
    click.echo(_record_summary(desc, returncode), err=True)
    warnings = warnings_for(desc, expected_taps=names) + _adapter_warnings(adapters, command, desc)
    if problems:  # "never fired: check the class name" would send the user the wrong way
        warnings = [w for w in warnings if "never fired" not in w]
    for warning in warnings:
        click.echo(f"tracediff: warning: {warning}", err=True)
    for problem in problems:
        click.echo(f"tracediff: error: {problem}", err=True)
    if not join and not any(info["rows"] for info in desc["taps"].values()):
        # A store without one row only blocks the rerun (it would need --overwrite): leave nothing.
        # Never with --append: other nodes may be recording into that store right now.
        from tracediff.store import remove_store  # noqa: PLC0415

        remove_store(location if location.remote else output)
        click.echo(f"tracediff: removed {output}: it held no rows (rerun with the same -o; no --overwrite needed)",
                   err=True)
    if problems:
        # Never 0 having lost rows; a command that failed keeps its own code.
        code = returncode or 2
        click.echo(f"tracediff: error: recording lost rows (above); exit code {code}, the command itself "
                   f"exited with code {returncode}", err=True)
        sys.exit(code)
    sys.exit(returncode)


def _discard_store(location: Any) -> None:
    if location.remote:
        from tracediff.store import remove_store  # noqa: PLC0415

        with contextlib.suppress(TracediffError):
            remove_store(location)
    else:
        shutil.rmtree(location.local, ignore_errors=True)


def _adapter_warnings(adapters: tuple[str, ...], command: tuple[str, ...], desc: dict[str, Any]) -> list[str]:
    """What each adapter knows about a run that recorded less than it should (capture points that
    never fired and the flag to add); an adapter without ``record_warnings`` has nothing to say."""
    from tracediff.adapters import load_adapter  # noqa: PLC0415

    out: list[str] = []
    for name in adapters:
        try:
            fn = getattr(load_adapter(name), "record_warnings", None)
            out.extend(fn(list(command), desc) if fn is not None else [])
        except Exception as exc:  # noqa: BLE001  (a summary must not turn a finished run into an error)
            out.append(f"adapter {name!r} could not check the run: {type(exc).__name__}: {exc}")
    return out


def _hooks_dir() -> str:
    """The folder of the start-up shim that goes with the tracediff running here: the top-level
    hooks/ of the source tree it was imported from, else the installed package tracediff.hooks.
    (An editable install maps tracediff.hooks to its own checkout: a second checkout on PYTHONPATH
    would otherwise hand its children the first one's shim.)"""
    import tracediff  # noqa: PLC0415

    tree = Path(tracediff.__file__).resolve().parent.parent
    if (tree / "hooks" / "sitecustomize.py").is_file() and (tree / "pyproject.toml").is_file():
        return str(tree / "hooks")
    import tracediff.hooks  # noqa: PLC0415  (the top-level hooks/ folder, installed as tracediff.hooks)

    return str(Path(tracediff.hooks.__file__).resolve().parent)


def _run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run the child; forward SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it; return its exit code
    (128+N when a signal N ended it). SIGINT from a terminal reaches the child directly (same
    process group), so it is not forwarded twice."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from exc
    forwarded = [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    previous = {}

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for sig in forwarded:
        previous[sig] = signal.signal(sig, forward)
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - returncode if returncode < 0 else returncode


def _record_summary(desc: dict[str, Any], returncode: int) -> str:
    lines = [f"tracediff: command exited with code {returncode}; store {desc['path']}"]
    if not desc["taps"]:
        lines.append("tracediff: no rows were recorded")
    for tap, info in desc["taps"].items():
        for w in info["writers"]:
            lines.append(
                f"tracediff:   {tap}/{w['writer']}: {w['rows']} rows, width {w['width']} {w['dtype']}, "
                f"{w['batches']} batches, dropped {w['dropped_rows']}, skipped {w['skipped_rows']}, {w['status']}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- compare
def _progress(command: str, flag: bool | None, **counting: Any) -> Any:
    from tracediff.progress import Progress, progress_mode  # noqa: PLC0415

    return Progress(command, progress_mode(flag), **counting)


@main.command()
@_storage_options
@click.argument("stores", nargs=-1, type=STORE, metavar="REFERENCE CANDIDATE [CANDIDATE...]")
@click.option("--reference", "references", multiple=True, type=STORE, metavar="STORE",
              help="A reference store (or quoted glob); repeat for several. Then every positional is a candidate.")
@click.option("--candidate", "candidates", multiple=True, type=STORE, metavar="STORE",
              help="Another candidate store (or quoted glob); repeat for several.")
@click.option("--dask", "dask_target", metavar="ADDRESS|local:N",
              help="Run the streaming pass as dask.distributed tasks: on the scheduler at ADDRESS "
                   "(tcp://HOST:PORT), or on a LocalCluster of N worker processes (local:N). Workers open "
                   "the stores by path or URL themselves (with the --storage-option values). Needs tracediff[dask].")
@click.option("--tap", help="Tap to compare on both sides (default: the common tap, fc_in first).")
@click.option("--ref-tap", help="Tap of the reference, when the names differ.")
@click.option("--cand-tap", help="Tap of the candidate, when the names differ.")
@click.option("--segment-size", type=int, help="Width of one segment (hidden size); default from the stores.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--markdown", "markdown_path", type=click.Path(path_type=Path), help="Write a Markdown report here.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), help="Write a self-contained HTML report here.")
@click.option("--fail-on", type=click.Choice(["error", "warning"]), default="error", show_default=True,
              help="Exit 1 on error findings only, or on warnings too (strict CI).")
@click.option("--bank", type=STORE, help="A bank recorded with --adapter hf: name each segment's layer.")
@click.option("--sample-rows", type=int, default=2048, show_default=True, help="Rows sampled to plan the comparison.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line.")
@click.option("--verbose", "-v", is_flag=True,
              help="Print everything: the plan, every metric, worst rows, every finding's evidence, the config diff.")
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr: a live line on a terminal, a status line every few seconds in a log "
                   "(default); --no-progress prints none.")
@_replay_options
def compare(
    stores: tuple[str, ...],
    references: tuple[str, ...],
    candidates: tuple[str, ...],
    dask_target: str | None,
    tap: str | None,
    ref_tap: str | None,
    cand_tap: str | None,
    segment_size: int | None,
    json_path: Path | None,
    markdown_path: Path | None,
    html_path: Path | None,
    fail_on: str,
    bank: Path | None,
    sample_rows: int,
    quiet: bool,
    verbose: bool,
    progress: bool | None,
    draft: Path | None,
    target: Path | None,
    server_draft: Path | None,
    send_report: Path | None,
    steps: int,
    max_sequences: int | None,
    score_rows: int,
    multi_step_starts: int,
    replay_dtype: str,
) -> None:
    """Compare REFERENCE (what the draft learned, e.g. train.zarr) with CANDIDATE (e.g. server.zarr).

    \b
    Several stores per side (one per node or replica) are read as one trace: their writer groups
    together, rows of one sequence and position held by several stores each compared:
      tracediff compare train.zarr server-node0.zarr server-node1.zarr
      tracediff compare train.zarr 'server-node*.zarr'          (a quoted glob)
      tracediff compare --reference 'train-rank*.zarr' server.zarr

    \b
    With --dask, the streaming pass runs on a dask.distributed cluster (the plan, findings and report
    stay here; the report is the same as without it):
      tracediff compare train.zarr server.zarr --dask local:4
      tracediff compare train.zarr server.zarr --dask tcp://10.0.0.5:8786

    With --draft DIR, also replay the draft on both sides' rows (see `tracediff replay`).

    Exit code: 0 match, 1 mismatch, 2 usage or input error.
    """
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.report import render_text, write_report  # noqa: PLC0415
    from tracediff.report.text import render_verdict_line  # noqa: PLC0415
    from tracediff.storeset import expand_stores  # noqa: PLC0415

    if sample_rows <= 0:
        raise UsageError(f"--sample-rows must be positive, got {sample_rows}")
    ref_given = list(references) if references else list(stores[:1])
    cand_given = (list(stores) if references else list(stores[1:])) + list(candidates)
    if not ref_given or not cand_given:  # click's own wording, usage and help pointer
        missing = "'REFERENCE'" if not ref_given else "'CANDIDATE'"
        raise click.MissingParameter(ctx=click.get_current_context(), param_hint=missing, param_type="argument")
    reference = expand_stores(ref_given, "reference")
    candidate = expand_stores(cand_given, "candidate")
    if draft is not None and (len(reference) > 1 or len(candidate) > 1):
        raise UsageError("--draft replays one store per side; compare several stores without --draft")
    runner = None
    if dask_target is not None:
        from tracediff.distributed import DaskRunner  # noqa: PLC0415
        from tracediff.store.location import current_storage_options  # noqa: PLC0415

        # Workers have no --storage-option of their own: the command's go with every task.
        runner = DaskRunner(dask_target, storage_options=current_storage_options())
    for out in (json_path, markdown_path, html_path):
        if out is not None and not out.parent.resolve().is_dir():
            raise UsageError(f"{out}: its folder does not exist")
    if draft is not None and send_report is not None:
        from tracediff.replay import read_send_report  # noqa: PLC0415

        read_send_report(send_report)
    with _progress("compare", progress) as prog, contextlib.ExitStack() as cleanup:
        prog.stage("opening stores")
        if runner is not None:
            runner.stage = prog.stage
            cleanup.enter_context(runner)  # a cluster it starts is closed however the compare ends
        opts = CompareOptions(tap=tap, reference_tap=ref_tap, candidate_tap=cand_tap, segment_size=segment_size,
                              sample_rows=sample_rows, progress=prog.advance, progress_total=prog.total,
                              stage=prog.stage, bank=str(bank) if bank else None, runner=runner)
        report = compare_stores(reference if len(reference) > 1 else reference[0],
                                candidate if len(candidate) > 1 else candidate[0], opts)
        cleanup.close()
        if draft is not None:
            prog.stage("replaying the draft")
            _replay(report, draft, target, server_draft, send_report, steps, max_sequences, score_rows,
                    multi_step_starts, replay_dtype)
        prog.stage("writing reports")
        write_report(report, json_path=json_path, markdown_path=markdown_path, html_path=html_path)
    if quiet:
        click.echo(render_verdict_line(report))
    else:
        click.echo(render_text(report, color=sys.stdout.isatty(), verbose=verbose))
    _say_written("compare", json_path, markdown_path, html_path)
    sys.exit(report.exit_code(fail_on))


def _say_written(command: str, json_path: Path | None, markdown_path: Path | None, html_path: Path | None) -> None:
    """One line per report file written, on stderr (stdout stays the report, or -q's one line)."""
    for kind, path in (("JSON", json_path), ("Markdown", markdown_path), ("HTML", html_path)):
        if path is not None:
            click.echo(f"tracediff {command}: wrote the {kind} report {path}", err=True)


# ---------------------------------------------------------------------------------- replay
def _replay(report: Any, draft: Path, target: Path | None, server_draft: Path | None, send_report: Path | None,
            steps: int, max_sequences: int | None, score_rows: int, multi_step_starts: int,
            replay_dtype: str) -> Any:
    from tracediff.replay import ReplayOptions, attach_replay  # noqa: PLC0415

    if max_sequences is not None and max_sequences <= 0:
        raise UsageError(f"--max-sequences must be positive, got {max_sequences}")
    return attach_replay(report, ReplayOptions(
        draft=str(draft), target=str(target) if target else None, server_draft=str(server_draft) if server_draft else None,
        send_report=str(send_report) if send_report else None, steps=steps, max_sequences=max_sequences,
        score_rows=score_rows, multi_step_starts=multi_step_starts, dtype=replay_dtype))


@main.command()
@_storage_options
@click.argument("reference", type=STORE)
@click.argument("candidate", type=STORE)
@click.option("--tap", help="Tap to replay on both sides (default: as compare picks it).")
@click.option("--ref-tap", help="Tap of the reference, when the names differ.")
@click.option("--cand-tap", help="Tap of the candidate, when the names differ.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the JSON report (compare + replay).")
@click.option("--markdown", "markdown_path", type=click.Path(path_type=Path), help="Write a Markdown report here.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), help="Write a self-contained HTML report here.")
@_replay_options
def replay(reference: Path, candidate: Path, tap: str | None, ref_tap: str | None, cand_tap: str | None,
           json_path: Path | None, markdown_path: Path | None, html_path: Path | None, draft: Path | None,
           target: Path | None, server_draft: Path | None, send_report: Path | None, steps: int,
           max_sequences: int | None, score_rows: int, multi_step_starts: int, replay_dtype: str) -> None:
    """What a mismatch costs: run the EAGLE-3 draft (--draft DIR: config.json + safetensors) teacher-forced
    on REFERENCE's (trainer's) and CANDIDATE's (server's) recorded fc rows: step-0 and multi-step accuracy
    and accept length, (a) on the reference's rows, (b) on the candidate's, (c) on the candidate's with
    compare's proposed fix, next to (d) the accept length the engine reported (--send-report from
    `tracediff send --report`).

    Exit code: 0 nothing found, 1 compare or replay found a problem, 2 usage or input error.
    """
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.report import write_report  # noqa: PLC0415
    from tracediff.report.text import render_replay  # noqa: PLC0415

    if draft is None:
        raise UsageError("replay needs --draft DIR (the draft checkpoint folder: config.json + *.safetensors)")
    for out in (json_path, markdown_path, html_path):
        if out is not None and not out.parent.resolve().is_dir():
            raise UsageError(f"{out}: its folder does not exist")
    if send_report is not None:
        from tracediff.replay import read_send_report  # noqa: PLC0415

        read_send_report(send_report)
    with _progress("replay", None) as prog:
        report = compare_stores(reference, candidate, CompareOptions(tap=tap, reference_tap=ref_tap,
                                                                     candidate_tap=cand_tap, stage=prog.stage))
        prog.stage("replaying the draft")
        _replay(report, draft, target, server_draft, send_report, steps, max_sequences, score_rows, multi_step_starts,
                replay_dtype)
        prog.stage("writing reports")
        write_report(report, json_path=json_path, markdown_path=markdown_path, html_path=html_path)
    click.echo(render_replay(report))
    _say_written("replay", json_path, markdown_path, html_path)
    sys.exit(report.exit_code("error"))


# ---------------------------------------------------------------------------------- identify
@main.command()
@_storage_options
@click.argument("store", type=STORE)
@click.option("--bank", required=True, type=STORE,
              help="A trace of every layer of the target model (tracediff record --adapter hf).")
@click.option("--tap", help="Tap of STORE to identify (default fc_in).")
@click.option("--bank-tap", help="Tap of the bank (default: its only bank tap).")
@click.option("--segment-size", type=int, help="Segment width (default: from the store, else the bank's).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the result as JSON here.")
def identify(store: Path, bank: Path, tap: str | None, bank_tap: str | None, segment_size: int | None,
             json_path: Path | None) -> None:
    """Name the layer each segment of STORE comes from ("segment 0 is hidden_states[3]").

    Exit code: 0 when every segment is identified, 1 when one is not, 2 on bad input.
    """
    from tracediff.identify import identify_segments, render_identification  # noqa: PLC0415
    from tracediff.report import write_json  # noqa: PLC0415

    if json_path is not None and not json_path.parent.resolve().is_dir():
        raise UsageError(f"{json_path}: its folder does not exist")
    with _progress("identify", None) as prog:
        prog.stage("naming each segment's layer")
        ident = identify_segments(store, bank, tap=tap, bank_tap=bank_tap, segment_size=segment_size)
    if json_path is not None:
        write_json(json_path, ident.to_dict())
    click.echo(render_identification(ident))
    if json_path is not None:
        click.echo(f"tracediff identify: wrote the JSON result {json_path}", err=True)
    sys.exit(0 if all(s.verdict in ("match", "scaled") for s in ident.segments) else 1)


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
              help="The target model's local folder (save_pretrained; safetensors weights): the trainer's weights.")
@click.option("--dtype", default="bfloat16", show_default=True, help="The server's compute dtype.")
@click.option("--sequences", default=8, show_default=True, type=int, help="Sequences of STORE to recompute.")
@click.option("--tap", default="fc_in", show_default=True, help="The tap whose rows are recomputed.")
@click.option("--layers", help="HF hidden_states indices of the segments, comma-separated (pre_norm: the last layer "
                               "before the final norm); default: the layers STORE records.")
def calibrate(store: Path, model_dir: Path, dtype: str, sequences: int, tap: str, layers: str | None) -> None:
    """Append calibration rows to a trainer's STORE: some of its sequences recomputed by the target in
    the server's compute dtype, so that compare measures what a correct run drifts at every segment
    instead of assuming it."""
    from tracediff.calibration import calibrate as run_calibrate  # noqa: PLC0415

    if not (store / "zarr.json").is_file():
        raise UsageError(f"{store}: not a trace store (no zarr.json)")
    wanted = [x.strip() for x in layers.split(",") if x.strip()] if layers else None
    done = run_calibrate(store, model_dir, dtype=dtype, sequences=sequences, tap=tap, layers=wanted)
    click.echo(f"tracediff calibrate: wrote {done['rows']} calibration rows of {done['sequences']} sequences "
               f"({done['compute_dtype']}, layers {done['layers']}) to {store} (tap {done['tap']})")


# ---------------------------------------------------------------------------------- import
@main.group(name="import", cls=_Group)
def import_group() -> None:
    """Turn a trainer's offline hidden-state files into a reference trace (taps fc_in and bank)."""


_IMPORT_OPTIONS = [
    click.argument("src", type=click.Path(path_type=Path)),
    click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path), help="Store to create."),
    click.option("--overwrite", is_flag=True, help="Replace an existing store."),
    click.option("--layer-ids", help="The draft's aux layer ids, comma-separated (they name the segments)."),
    click.option("--max-files", type=int, help="Import only the first N files."),
]


def _import_options(func: Any) -> Any:
    for decorator in reversed(_IMPORT_OPTIONS):
        func = decorator(func)
    return func


@import_group.command(name="speculators")
@_import_options
def import_speculators_cmd(src: Path, output: Path, overwrite: bool, layer_ids: str | None,
                           max_files: int | None) -> None:
    """Import speculators' hs_<i>.safetensors files from SRC (or SRC/hidden_states).

    --layer-ids: eagle_aux_hidden_state_layer_ids of the draft config (vLLM ids).
    """
    from tracediff.importers import import_speculators, parse_layer_ids  # noqa: PLC0415

    if max_files is not None and max_files <= 0:
        raise UsageError(f"--max-files must be positive, got {max_files}")
    result = import_speculators(src, output, layer_ids=parse_layer_ids(layer_ids), overwrite=overwrite,
                                max_files=max_files)
    click.echo(f"tracediff: {result.summary()}", err=True)


@import_group.command(name="specforge")
@_import_options
def import_specforge_cmd(src: Path, output: Path, overwrite: bool, layer_ids: str | None,
                         max_files: int | None) -> None:
    """Import SpecForge's offline data_<i>.ckpt[.gz] files under SRC (read with torch.load(weights_only=True)).

    --layer-ids: eagle_config.eagle_aux_hidden_state_layer_ids of the draft config (SGLang ids).
    """
    from tracediff.importers import import_specforge, parse_layer_ids  # noqa: PLC0415

    if max_files is not None and max_files <= 0:
        raise UsageError(f"--max-files must be positive, got {max_files}")
    result = import_specforge(src, output, layer_ids=parse_layer_ids(layer_ids), overwrite=overwrite,
                              max_files=max_files)
    click.echo(f"tracediff: {result.summary()}", err=True)


# ---------------------------------------------------------------------------------- demo
@main.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("tracediff-demo"), show_default=True,
              help="Folder for the HTML, Markdown and JSON reports (created).")
@click.option("--samples", type=click.Path(path_type=Path),
              help="Folder of the sample stores (default: samples/ of the source checkout).")
def demo(out: Path, samples: Path | None) -> None:
    """Compare the shipped broken and fixed trace pairs, identify the broken server's layers, write reports.

    Offline, CPU only. Exit code: 0 when the demo showed what it should (the broken pair is meant to
    mismatch), 1 when a result came out otherwise, 2 when the samples are missing.
    """
    from tracediff.demo import run_demo  # noqa: PLC0415

    result = run_demo(out, samples, echo=click.echo, color=sys.stdout.isatty())
    sys.exit(result.exit_code)


# ---------------------------------------------------------------------------------- send
@main.command()
@_storage_options
@click.argument("trace", type=STORE)
@click.option("--url", required=True, help="Base URL of the running server, e.g. http://127.0.0.1:30000.")
@click.option("--engine", type=click.Choice(["sglang", "vllm"]), default="sglang", show_default=True,
              help="The server's API: SGLang /generate, or vLLM's OpenAI-compatible /v1/completions.")
@click.option("--model", "model", help="vLLM: the served model name (default: the server's first model).")
@click.option("--tap", help="Tap whose token labels give the sequences (default fc_in, else the trace's only tap).")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Requests in flight at most.")
@click.option("--max-new-tokens", type=int, default=1, show_default=True,
              help="Tokens generated per request (1: only the sequence itself is forwarded, as in training; more: "
                   "decode and verify steps too).")
@click.option("--limit", type=int, help="Send only the first N sequences.")
@click.option("--retries", type=int, default=3, show_default=True, help="Retries of a request the server did not take.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for one response.")
@click.option("--rid-prefix", default="", help="Prefix of the request ids (default: the sequence keys as they are).")
@click.option("--report", "report_path", type=click.Path(path_type=Path),
              help="Write what was sent and each response's output ids and the engine's speculative-decoding numbers "
                   "(accept length) as JSON.")
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr: a live line on a terminal, a status line every few seconds in a log "
                   "(default); --no-progress prints none.")
def send(trace: Path, url: str, engine: str, model: str | None, tap: str | None, concurrency: int,
         max_new_tokens: int, limit: int | None, retries: int, timeout: float, rid_prefix: str,
         report_path: Path | None, progress: bool | None) -> None:
    """Replay TRACE's token sequences to a running server, greedy, one request per sequence whose
    request id is the sequence key: SGLang (/generate with input_ids and rid) or vLLM (--engine vllm:
    /v1/completions with the token ids as prompt and request_id), so that a server recorded with
    `tracediff record --adapter sglang|vllm` sees exactly the training tokens.

    Exit code: 0 all sent, 1 some requests failed, 2 bad input or the server unreachable.
    """
    from tracediff.send import SendOptions, check_server, check_vocabulary, send_sequences, sequences_from_trace  # noqa: PLC0415

    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be positive, got {limit}")
    if not re.match(r"^https?://", url):
        raise UsageError(f"--url {url!r}: give a base URL such as http://127.0.0.1:30000")
    if concurrency < 1 or max_new_tokens < 1 or retries < 0 or timeout <= 0:
        raise UsageError("--concurrency and --max-new-tokens must be >= 1, --retries >= 0, --timeout > 0")
    sequences = sequences_from_trace(trace, tap=tap, limit=limit)
    info = check_server(url, retries=retries, engine=engine)
    check_vocabulary(sequences, info, url)
    opts = SendOptions(url=url, concurrency=concurrency, max_new_tokens=max_new_tokens, timeout=timeout,
                       retries=retries, rid_prefix=rid_prefix, engine=engine,
                       model=model or (info.get("served_model") if engine == "vllm" else None))
    show = sys.stderr.isatty() if progress is None else progress
    bar: Any = click.progressbar(length=len(sequences), label="sending", file=sys.stderr) if show else None
    if bar is not None:
        bar.__enter__()
    try:
        result = send_sequences(sequences, opts, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if report_path is not None:
        try:
            report_path.write_text(json.dumps({"trace": str(trace), **result.to_dict()}, indent=1) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --report {report_path}: {exc.strerror or exc}") from exc
    click.echo(f"sent {result.succeeded} of {result.sequences} sequences ({result.tokens} tokens) to {result.url} "
               f"in {result.seconds:.1f}s" + (f", {result.retried} retries" if result.retried else ""))
    for key, error in list(result.failures.items())[:10]:
        click.echo(f"tracediff: failed: sequence {key}: {error}", err=True)
    if len(result.failures) > 10:
        click.echo(f"tracediff: ... and {len(result.failures) - 10} more failed sequences", err=True)
    sys.exit(1 if result.failures else 0)


# ---------------------------------------------------------------------------------- inspect
@main.command()
@_storage_options
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect(store: Path, as_json: bool) -> None:
    """Show what STORE holds: taps, processes, rows, width, dtype, segments, phases, drops, meta."""
    from tracediff.describe import describe_store, render_text  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    opened = open_store(store)
    try:
        desc = describe_store(opened)
    finally:
        opened.close()
    click.echo(json.dumps(desc, indent=2, sort_keys=True) if as_json else render_text(desc))


# ---------------------------------------------------------------------------------- pack
@main.command()
@_storage_options
@click.argument("store", type=STORE)
@click.argument("dest", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), metavar="DEST",
              help="The .zarr.zip file to write (default: STORE.zip next to STORE), as record and import take it; "
                   "DEST may also follow STORE.")
@click.option("--overwrite", is_flag=True, help="Replace DEST if it exists already.")
def pack(store: Path | str, dest: Path | None, output: Path | None, overwrite: bool) -> None:
    """Pack a store folder (or a store at a URL) into one local .zarr.zip file (to attach to a bug report).

    \b
      tracediff pack server.zarr -o server.zarr.zip
      tracediff pack server.zarr server.zarr.zip      (the same)
    """
    from tracediff.store import pack_store  # noqa: PLC0415

    if dest is not None and output is not None and dest != output:
        raise UsageError(f"pack: DEST is given twice ({dest} and -o {output}); give it once, with -o")
    dest = output if output is not None else dest
    if dest is None:
        dest = store.with_name(store.name + ".zip") if isinstance(store, Path) else Path(_store_name(store) + ".zip")
    click.echo(str(pack_store(store, dest, overwrite=overwrite)))


# ---------------------------------------------------------------------------------- push
@main.command()
@_storage_options
@click.argument("local", type=click.Path(path_type=Path))
@click.argument("url")
@click.option("--overwrite", is_flag=True, help="Replace another store already at URL.")
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr (bytes, objects, rate): a live line on a terminal, a status line every few "
                   "seconds in a log (default); --no-progress prints none.")
def push(local: Path, url: str, overwrite: bool, progress: bool | None) -> None:
    """Upload the committed rows of store folder LOCAL to URL (s3://bucket/train.zarr, gs://...).

    The root's zarr.json first (it names the recording, so a rerun resumes), then the chunk
    objects, then array metadata, every writer group's commit record last: readers of URL never see
    a group that is not complete. Resumable: run it again after a crash and it skips the
    objects already there with the right size. The result is opened with the strict reader.
    """
    from tracediff.store.location import is_url  # noqa: PLC0415
    from tracediff.store.push import push_store  # noqa: PLC0415

    if not is_url(url) or url.startswith("file://"):
        raise UsageError(f"push URL {url!r}: give an object-store URL such as s3://bucket/train.zarr")
    with _progress("push", progress, unit="bytes", items="objects") as prog:
        prog.stage("opening the local store")
        result = push_store(local, url, overwrite=overwrite, progress=prog.advance, stage=prog.stage)
    click.echo(f"tracediff: {result.summary()}")


def run() -> None:
    """The ``tracediff`` program (console script and ``python -m tracediff``).

    Once a command has finished (its reports written and closed, its output flushed), the process
    ends without the interpreter's teardown: unloading torch and zarr costs 0.3-0.5 s, a fifth of a
    small compare. Only when nothing else runs in this process (no non-daemon thread, no recorder)
    and the exit code is a plain number; ``main`` itself (what tests and other programs call) exits
    normally.
    """
    import logging  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from tracediff.runtime import return_freed_memory  # noqa: PLC0415

    return_freed_memory()
    try:
        main(prog_name="tracediff")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):
        sys.exit(code)  # a message: let the interpreter print it
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    # A recorder in this process (the start-up shim injects one into every Python process of a
    # recorded command, this one too) closes at exit: let it.
    if others or "tracediff.recorder" in sys.modules:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(int(code or 0))


if __name__ == "__main__":
    run()
