"""`tracediff record -- COMMAND`: run a command with recording injected into each of its Python
processes (through the start-up shim in hooks/), forward signals to it, then summarise the store and
fail a run that lost rows."""

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

from tracediff.commands.options import REMOTE, STORE, Command, exit_codes, parse_size, section, storage_options
from tracediff.errors import TracediffError, UsageError


@click.command(cls=Command, context_settings={"allow_interspersed_args": False}, epilog=exit_codes(
    (0, "the command exited 0, rows were recorded and none was lost"),
    (2, "a bad option or -o (one error line, the command not run); or the command exited 0 but a process lost "
        "rows (dropped when its writer fell behind, still queued when the process was killed, a writer error, an "
        "interpreter that cannot import tracediff: each said on stderr, with the tap, the rows and the flag that "
        "avoids it) or no row was recorded (no tap fired: a mistyped class, a module never reached), or one "
        "--tap never fired while others did (the rows of the others are kept)"),
    ("N", "any other: the command's own exit code (128+S when signal S ended it: 130 after Ctrl-C, 143 after "
          "SIGTERM, which record forwards), kept whether or not rows were lost")))
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@section(
    "What to record",
    click.option("--tap", "taps", multiple=True,
                 help="Tap spec [NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG] (grammar above); repeatable."),
    click.option("--adapter", "adapters", multiple=True, help="Framework adapter: sglang, vllm, speculators, specforge, hf (a bank of every layer), generic; repeatable."),
    click.option("--labels-from", "labels_from", multiple=True,
                 help="Class whose forward's input_ids/position_ids label the rows captured after it. Without it (and "
                      "without --adapter) the outermost module whose forward gets input_ids labels them."),
    click.option("--segment-size", type=int, help="Width of one segment of the tapped rows (e.g. hidden size)."),
    click.option("--segment-labels", help="Comma-separated segment names, e.g. hs0,hs3,hs6 (hsN: HF hidden_states[N]; "
                                          "without --aux-layers they are the recorded aux layers)."),
    click.option("--aux-layers", "aux_layers",
                 help="The target layers the tapped rows concatenate, comma-separated ids (e.g. 0,3,6), numbered as "
                      "--convention says; stored as meta aux_layers so compare knows them."),
    click.option("--convention", type=click.Choice(["hf", "capture", "vllm", "sglang", "sglang_deepseek"]),
                 help="Numbering of the --aux-layers ids (default hf: HF hidden_states indices; docs/format.md)."),
    click.option("--row-model", "row_model", type=click.Choice(["eagle3", "mtp", "mtp-post-norm"]),
                 help="What each slot of a tapped row holds (docs/row-models.md): mtp = cat(enorm(embed(next token)), "
                      "hnorm(last hidden state before the final norm)), mtp-post-norm = the same after it, eagle3 = "
                      "the --aux-layers hidden states. Default: EAGLE-3 of the recorded aux layers."),
    click.option("--draft-chain", "draft_chain", is_flag=True,
                 help="Also tap the draft's forward in order (fc output, decoder layer input and output, final norm, "
                      "the logits' top k), every draft step labelled, so that compare names the first tap that "
                      "diverges (speculators, SpecForge, vLLM and SGLang adapters; docs/draft-chain.md)."),
    click.option("--role", default="", help="What this recording is (trainer, server, bank...)."),
    click.option("--all-ranks", is_flag=True,
                 help="Record every tensor-parallel rank (sglang: default is attention-TP rank 0 only)."),
)
@section(
    "Output store",
    click.option("-o", "--output", "output", required=True, type=STORE, help="Store to create."),
    click.option("--overwrite", is_flag=True,
                 help="Replace an existing store: a local one is moved to STORE.previous, deleted once this run commits "
                      "its first row and moved back if it commits none; at a URL it is deleted before the command starts."),
    click.option("--append", "join", is_flag=True,
                 help="Add this run's writer groups to the store if it exists already (several nodes recording into one "
                      "store, e.g. -o s3://bucket/server.zarr on each)."),
)
@section(
    "What to keep",
    click.option("--max-rows", type=int, help="Rows to record at most, per tap and process."),
    click.option("--max-bytes", help="Bytes to record at most, per tap and process (e.g. 4GiB); with --ring the "
                                     "disk budget of the most recent rows instead."),
    click.option("--ring", is_flag=True,
                 help="With --max-bytes SIZE: keep recording, holding the most recent rows within SIZE on disk per "
                      "tap and process (the oldest dropped a whole segment at a time, counted; local stores)."),
    click.option("--ring-store", "ring_store", is_flag=True,
                 help="With --ring: SIZE is the whole store's budget, shared by every process and tap recording into "
                      "it (each drops its own oldest segments while the store is above it)."),
    click.option("--sample-requests", "sample_requests", type=float, metavar="RATE",
                 help="Record whole requests (trainer samples) chosen by a hash of their prompt's token ids, a share "
                      "RATE (0 < RATE <= 1) of them; tracediff.sampled(token_ids, RATE) says which."),
    click.option("--max-requests", "max_requests", type=int, metavar="N",
                 help="Record the first N requests (of those sampled) whole, per process (vllm)."),
    click.option("--every-n-steps", type=int, default=1, show_default=True, help="Record one step in N."),
    click.option("--first-n-steps", type=int, help="Record only steps 0..N-1."),
    click.option("--phases", help="Comma-separated phases to record (train, prefill, draft_extend, decode...)."),
)
@section(
    "Switching on and off",
    click.option("--control-port", "control_port", type=click.IntRange(0, 65535), metavar="PORT",
                 help="Open an endpoint on 127.0.0.1:PORT in each recording process (0: a free port each; a taken "
                      "port: a free one) that `tracediff control STORE on|off|status` switches recording with, "
                      "without a restart (docs/recording.md). SIGUSR1 / SIGUSR2 to a recording process switch it too."),
    click.option("--start-off", "start_off", is_flag=True,
                 help="Begin with recording switched off (rows counted as skipped) until switched on."),
)
@section(
    "Writing",
    click.option("--on-full", type=click.Choice(["drop", "block"]), default="drop", show_default=True,
                 help="When the writer falls behind: drop and count the batch, or wait (bounded) for it."),
    click.option("--queue-bytes", default="1GiB", show_default=True, help="Host memory the queue may hold."),
    click.option("--compressor", type=click.Choice(["none", "lz4", "zstd"]), default="none", show_default=True,
                 help="Compress value chunks (none is the fastest to write and to compare; zstd the smallest)."),
    click.option("--chunk-rows", type=int, default=1024, show_default=True,  # tracediff.store.DEFAULT_CHUNK_ROWS
                 help="Rows per chunk file: larger chunks mean fewer files, smaller ones less lost on a kill."),
    click.option("--durable", is_flag=True, help="fsync each batch before committing it."),
    click.option("--commit", "commit", type=click.Choice(["step", "background"]), default="step", show_default=True,
                 help="vllm: step = each drafter call's rows are committed before vLLM returns its tokens (survives a "
                      "SIGKILL of the worker); background = writes overlap serving, at most 64 batches behind (faster; a "
                      "kill loses that backlog: counted, and record exits 2)."),
    click.option("--commit-interval", type=click.FloatRange(0, 60), default=None, metavar="SECONDS",
                 help="Gather each tap's rows this long and write them as one commit (fewer, larger commits: less cost "
                      "to the host; a kill loses up to this much more). Default: 1 with --commit background, else 0 "
                      "(a commit a batch). A waiting host (--commit step, close) is served at once."),
)
@section(
    REMOTE,
    click.option("--retry-seconds", type=float, default=60.0, show_default=True,  # remote_writer.DEFAULT_RETRY_SECONDS
                 help="At a URL: how long a batch whose upload failed on the way (endpoint unreachable, connection "
                      "reset, timeout) is sent again before recording stops and the rest is counted as lost."),
)
@storage_options
def record(
    output: Path,
    adapters: tuple[str, ...],
    taps: tuple[str, ...],
    labels_from: tuple[str, ...],
    segment_size: int | None,
    segment_labels: str | None,
    aux_layers: str | None,
    convention: str | None,
    row_model: str | None,
    draft_chain: bool,
    role: str,
    overwrite: bool,
    join: bool,
    max_rows: int | None,
    max_bytes: str | None,
    ring: bool,
    ring_store: bool,
    sample_requests: float | None,
    max_requests: int | None,
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
    commit_interval: float | None,
    control_port: int | None,
    start_off: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND with recording injected into each of its Python processes.

    Example: tracediff record --tap Eagle3DraftModel.fc:input -o train.zarr -- python train.py

    The options before COMMAND are record's own, and a mistyped one is an error (nothing runs);
    everything from COMMAND on (after --, or from the first word that is no option) goes to it
    untouched.

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
    be recording into it). --overwrite never loses the old store to a run that records nothing: it
    waits at STORE.previous (named on stderr before the command starts; after a SIGKILL of record it
    is still there) until the new store has committed a row, and is back at STORE if none was.

    """
    from tracediff.adapters import adapter_info, check_installed  # noqa: PLC0415
    from tracediff.record.limits import Limits  # noqa: PLC0415
    from tracediff.record.tapspec import TapSpec  # noqa: PLC0415
    from tracediff.store import create_store, default_source, open_store  # noqa: PLC0415

    specs = [TapSpec.parse(t) for t in taps]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UsageError(f"two --tap specs share a tap name ({', '.join(names)}); name them with NAME=SPEC")
    for name in adapters:
        adapter_info(name)
        check_installed(name)
    if not specs and not adapters:
        raise UsageError("nothing to record: give --tap SPEC and/or --adapter NAME")
    if draft_chain and not {"speculators", "specforge", "vllm", "sglang"} & set(adapters):
        raise UsageError("--draft-chain taps the draft of --adapter speculators, specforge, vllm or sglang "
                         "(docs/draft-chain.md)")
    if segment_size is not None and segment_size <= 0:
        raise UsageError(f"--segment-size must be positive, got {segment_size}")
    labels_list = [x.strip() for x in segment_labels.split(",")] if segment_labels else None
    aux_meta, labels_list = _aux_layers_meta(aux_layers, convention, labels_list)
    model = _row_model(row_model, aux_meta)
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
        sample_requests=sample_requests,
        max_requests=max_requests,
        ring=ring,
        ring_store=ring_store,
    )
    queue_limit = parse_size(queue_bytes, "--queue-bytes") or 0
    if queue_limit <= 0:
        raise UsageError("--queue-bytes must be positive")
    # click takes the first `--` itself; a second one right after it (`-- -- CMD`, from a wrapper) too.
    command = command[1:] if command[:1] == ("--",) else command
    if not command:
        raise UsageError("no command to run after --")
    if shutil.which(command[0]) is None:  # checked before the store exists: nothing is left behind
        raise UsageError(f"cannot run {command[0]!r}: no such command (check its name, path and the PATH)")
    if join and overwrite:
        raise UsageError("--append adds to the store and --overwrite replaces it: give one of them")

    from tracediff.store.location import Location  # noqa: PLC0415

    location = Location.of(output)
    if ring and location.remote:
        raise UsageError(f"--ring keeps a local store within --max-bytes; {location.display} is at a URL: record "
                         f"into a local folder (tracediff push uploads it), or drop --ring")
    config = {
        "store": location.url if location.remote else str(Path(output).resolve()),
        "role": role,
        "taps": [s.text for s in specs],
        "adapters": list(adapters),
        "labels_from": list(labels_from),
        "segment_size": segment_size,
        "segment_labels": labels_list,
        "row_model": model,
        "draft_chain": draft_chain,
        "limits": limits.as_dict(),
        "on_full": on_full,
        "max_queue_bytes": queue_limit,
        "compressor": compressor,
        "chunk_rows": chunk_rows,
        "durable": durable,
        "retry_seconds": retry_seconds,
        "all_ranks": all_ranks,
        "commit": commit,
        "commit_interval": (1.0 if commit == "background" else 0.0) if commit_interval is None else commit_interval,
        "control_port": control_port,  # tracediff.record.control
        "start_off": start_off,
    }
    source = default_source(role)
    source["argv"] = list(command)
    source["recorded_by"] = ["tracediff", "record", *sys.argv[2:]] if len(sys.argv) > 1 else ["tracediff", "record"]
    from tracediff.store.previous import PreviousStore  # noqa: PLC0415

    # Local --overwrite: the old store waits aside until the new one has committed a row.
    previous = PreviousStore.set_aside(output) if overwrite and not location.remote else None
    if overwrite and location.remote and not join:
        from tracediff.store.remote_writer import store_exists  # noqa: PLC0415

        if store_exists(location):  # said before it happens: object storage cannot keep it aside
            click.echo(f"tracediff: deleting the previous store at {location.display} before the command starts "
                       f"(object storage has no rename to keep it aside; copy it first to keep it)", err=True)
    try:
        create_store(location if location.remote else output, role=role, source=source, overwrite=overwrite,
                     join=join, meta={**aux_meta, "record": {k: v for k, v in config.items() if k != "store"}})
    except BaseException:
        if previous is not None:
            previous.settle()
        raise
    if previous is not None:
        click.echo(f"tracediff: moved the previous store to {previous.aside}: it is deleted once this run commits "
                   f"its first row, and moved back to {output} if the run commits none", err=True)
        previous.watch()
        # However record ends (an error, an exit code): the old store is deleted or put back.
        click.get_current_context().call_on_close(lambda: _settle_previous(previous, output))
    if location.remote and location.storage_options:
        # The children write with the same options (never stored in the store's meta: credentials).
        config["storage_options"] = location.storage_options

    from tracediff.record.inject import ENV_REPORT_DIR, read_notes, recording_problems  # noqa: PLC0415

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
        notes = read_notes(notes_dir)
        advice = _adapter_loss_advice(adapters, command, config)
        problems = recording_problems(notes, on_full=on_full, **advice)
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
    # Again with the rows each group committed, as its commit record says: a killed process's own
    # count may miss its last commit.
    from tracediff.store.ring import committed_rows  # noqa: PLC0415

    problems = recording_problems(notes, committed_rows(desc), on_full=on_full, **advice)
    click.echo(_record_summary(desc, returncode), err=True)
    warnings = warnings_for(desc, expected_taps=names) + _adapter_warnings(adapters, command, desc)
    recorded_nothing = not join and not any(info["rows"] for info in desc["taps"].values())
    # Nothing recorded, nothing else wrong: the error line below says which taps never fired.
    no_tap_fired = recorded_nothing and not problems and returncode == 0
    # A --tap asked for by name that recorded nothing while others did: the store lacks what was asked.
    silent = [s for s in specs if not desc["taps"].get(s.name, {}).get("rows")]
    some_taps_silent = bool(silent) and not recorded_nothing and not problems and returncode == 0
    if problems or no_tap_fired or some_taps_silent:  # (with problems, "check the class name" would send the user the wrong way)
        warnings = [w for w in warnings if "never fired in any process" not in w]
    if no_tap_fired and _switched_off_rows(desc, notes):
        warnings = []  # the taps fired while switched off: the note below says so ("did a request reach it?" would not)
    for warning in warnings:
        click.echo(f"tracediff: warning: {warning}", err=True)
    for problem in problems:
        click.echo(f"tracediff: error: {problem}", err=True)
    if recorded_nothing and previous is not None:
        if previous.settle() == "restored":
            click.echo(f"tracediff: kept the previous store at {output}: this run recorded no rows", err=True)
    elif recorded_nothing:
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
    if no_tap_fired and _switched_off_rows(desc, notes):
        # Off the whole time is what was asked for (--start-off, never switched on): said, not an error.
        click.echo(f"tracediff: note: {_never_fired(specs, adapters, desc, notes)}", err=True)
        sys.exit(returncode)
    if no_tap_fired:
        click.echo(f"tracediff: error: {_never_fired(specs, adapters, desc, notes)}; exit code 2, the command itself exited with "
                   f"code 0", err=True)
        sys.exit(2)
    if some_taps_silent:
        asked = ", ".join(f"tap {s.name!r} (--tap {s.text})" for s in silent)
        click.echo(f"tracediff: error: {asked} recorded no row while the other taps did (their rows are in "
                   f"{location.display}); exit code 2, the command itself exited with code 0", err=True)
        sys.exit(2)
    sys.exit(returncode)


def _switched_off_rows(desc: dict[str, Any], notes: list[dict[str, Any]]) -> int:
    """Rows seen while recording was switched off: the processes' row ledgers count them (a process
    off all along and then killed, as vLLM ends its worker, leaves no writer group); without a
    ledger, the store's writers (``skip_reasons``)."""
    from tracediff.record.ledger import FIELDS, SWITCHED_OFF  # noqa: PLC0415

    key = FIELDS[SWITCHED_OFF]
    ledgers = [n for n in notes if n.get("kind") == "ledger" and n.get("counts")]
    if ledgers:
        return sum(int(c.get(key) or 0) for n in ledgers for c in n["counts"].values())
    return sum(int((w.get("skip_reasons") or {}).get("switched off") or 0)
               for info in desc["taps"].values() for w in info["writers"])


def _never_fired(specs: list[Any], adapters: tuple[str, ...], desc: dict[str, Any], notes: list[dict[str, Any]]) -> str:
    """The one line of a run that recorded no row although its command succeeded (``desc``: the
    store's description, ``notes``: what its processes left: rows seen while recording was switched
    off say why)."""
    off = _switched_off_rows(desc, notes)
    if off:
        return (f"no row was recorded: recording was switched off the whole time ({off:,} rows skipped while off: "
                f"--start-off, tracediff control STORE off, SIGUSR2); switch it on with tracediff control STORE on "
                f"(record --control-port) or SIGUSR1")
    what = [f"tap {s.name!r} (--tap {s.text})" for s in specs] + [f"the capture points of adapter {a!r}" for a in adapters]
    return (f"no row was recorded: {', '.join(what)} never fired in any process; check the class name in each "
            f"--tap spec, that the command reaches the module (a forward run in Python: CUDA-graph replay skips "
            f"hooks, add --disable-cuda-graph), and the sampling limits (--phases, --first-n-steps, --max-rows)")


def _settle_previous(previous: Any, output: Path) -> None:
    """However record ends: the old store of an --overwrite run is deleted (the new one committed a
    row) or put back; where neither could be done, the line says where it is."""
    before = previous.outcome
    after = previous.settle()
    if after == "restored" and before != after:  # (record's own summary says it when it gets that far)
        click.echo(f"tracediff: kept the previous store at {output}: this run recorded no rows", err=True)
    elif after == "kept aside":
        click.echo(f"tracediff: the previous store is still at {previous.aside}: {output} holds something else now",
                   err=True)


_HS_LABEL = re.compile(r"^hs(\d+)$")


def _row_model(name: str | None, aux_meta: dict[str, Any]) -> dict[str, Any] | None:
    """--row-model as the stored JSON (eagle3: the --aux-layers in the physical numbering), or None."""
    if name is None:
        return None
    from tracediff.adapters.conventions import FINAL_NORM, convention, to_physical  # noqa: PLC0415
    from tracediff.store.row_model import from_cli  # noqa: PLC0415

    layers = None
    aux = aux_meta.get("aux_layers")
    if aux:
        conv = convention(aux["convention"])
        assert conv is not None  # (checked by _aux_layers_meta)
        layers = [p if p == FINAL_NORM else int(p) for p in to_physical(list(aux["ids"]), conv)]
    return from_cli(name, layers).to_json()


def _aux_layers_meta(ids_text: str | None, convention_name: str | None, labels: list[str] | None
                     ) -> tuple[dict[str, Any], list[str] | None]:
    """The store meta that says which target layers a generic tap's rows concatenate
    (``{"aux_layers": {"ids", "convention"}}``, as a trainer writes it), from --aux-layers and
    --convention, else from --segment-labels that are all ``hsN`` (HF ``hidden_states[N]``); and
    the segment labels to record (``hsN`` of each layer when none were given). Checked before
    anything is created: a bad combination is one usage error."""
    from tracediff.adapters.conventions import FINAL_NORM, convention, to_physical  # noqa: PLC0415

    matches = [_HS_LABEL.match(x) for x in labels or []]
    hs = [int(m.group(1)) for m in matches if m] if labels and all(matches) else None
    if ids_text is None:
        if convention_name is not None:
            raise UsageError(f"--convention {convention_name} says how --aux-layers ids are numbered: give "
                             f"--aux-layers too (e.g. --aux-layers 0,3,6 --convention {convention_name})")
        return ({"aux_layers": {"ids": hs, "convention": "hf"}} if hs else {}), labels
    try:
        ids = [int(x) for x in ids_text.split(",")]
    except ValueError:
        raise UsageError(f"--aux-layers takes comma-separated integer layer ids (e.g. 0,3,6), got {ids_text!r}") from None
    conv = convention(convention_name or "hf")
    assert conv is not None
    bad = [i for i in ids if i < 0 and i not in (conv.embedding_id, conv.final_norm_id)]
    if bad:
        raise UsageError(f"--aux-layers {ids_text}: {bad[0]} is no layer id in the {conv.name} numbering "
                         f"({conv.meaning})")
    physical = to_physical(ids, conv)
    if labels is not None and len(labels) != len(physical):
        raise UsageError(f"--segment-labels names {len(labels)} segments but --aux-layers {ids_text} "
                         f"({conv.name} numbering) concatenates {len(physical)} layers: give one label per layer")
    if hs is not None and any(p != FINAL_NORM and p != h for p, h in zip(physical, hs, strict=True)):
        raise UsageError(f"--segment-labels {','.join(labels or [])} are HF hidden_states {hs} but --aux-layers "
                         f"{ids_text} ({conv.name} numbering) are hidden_states "
                         f"{['final norm' if p == FINAL_NORM else p for p in physical]}: make them agree")
    if labels is None and FINAL_NORM not in physical:
        labels = [f"hs{p}" for p in physical]
    return {"aux_layers": {"ids": ids, "convention": conv.name}}, labels


def _discard_store(location: Any) -> None:
    if location.remote:
        from tracediff.store import remove_store  # noqa: PLC0415

        with contextlib.suppress(TracediffError):
            remove_store(location)
    else:
        shutil.rmtree(location.local, ignore_errors=True)


def _adapter_loss_advice(adapters: tuple[str, ...], command: tuple[str, ...], config: dict[str, Any]) -> dict[str, str]:
    """``killed_advice`` for recording_problems from the first adapter that knows how its engine's
    processes end without being killed (``loss_advice(command, config)``); empty: the generic advice."""
    from tracediff.adapters import load_adapter  # noqa: PLC0415

    for name in adapters:
        try:
            fn = getattr(load_adapter(name), "loss_advice", None)
            advice = fn(list(command), config) if fn is not None else ""
        except Exception:  # noqa: BLE001, S112  (advice only)
            continue
        if advice:
            return {"killed_advice": advice}
    return {}


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


def _terminal_interrupts_the_child() -> bool:
    """Whether a SIGINT here came from the terminal's Ctrl-C, which the terminal also sent to the
    child (record runs in the terminal's foreground process group, and so does its child)."""
    for stream in (sys.stdin, sys.stderr, sys.stdout):
        try:
            if stream is not None and stream.isatty():
                return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
        except (OSError, ValueError):
            continue
    return False


def _run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run the child; forward SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it; return its exit code
    (128+N when a signal N ended it). SIGINT is forwarded too, except a terminal's Ctrl-C: that
    one reaches the child directly (same foreground process group), and a second copy would cut
    short the child's own cleanup (its recorder's last commit). A SIGINT sent to record's pid
    alone (a supervisor, ``kill -INT``, a notebook's interrupt) reaches the child through record."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from exc
    forwarded = [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    previous = {}

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    def interrupt(signum: int, frame: Any) -> None:
        if not _terminal_interrupts_the_child():
            forward(signum, frame)

    for sig in forwarded:
        previous[sig] = signal.signal(sig, forward)
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:  # started with it ignored (nohup, a background job): kept so
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
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
    from tracediff.describe import labelling_lines  # noqa: PLC0415
    from tracediff.lint.light import zero_row_warnings  # noqa: PLC0415

    for tap, info in desc["taps"].items():
        for w in info["writers"]:
            checks = w.get("row_checks") or {}
            if isinstance(checks.get("zero_rows"), list):
                lines += [f"tracediff: warning: {text}" for text in zero_row_warnings(
                    f"{tap}/{w['writer']}", checks["zero_rows"], int(checks.get("rows") or 0), w.get("segment_labels"))]
    from tracediff.describe import keeping_lines, switch_lines  # noqa: PLC0415

    for tap, info in desc["taps"].items():
        lines += [f"tracediff:   {tap}: {line}" for line in keeping_lines(info)]
        lines += [f"tracediff:   {tap}/{w['writer']}: {line}" for w in info["writers"] for line in switch_lines(w)]
    notes, no_tokens = labelling_lines(desc)
    lines += [f"tracediff:   {note}" for note in notes]
    lines += [f"tracediff: warning: {line}" for line in no_tokens]
    return "\n".join(lines)
