"""The commands that read traces and decide: `compare`, `identify`, `calibrate` and `demo`."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import click

from tracediff.commands.options import (
    REPLAY,
    REPORTS,
    STORE,
    WHAT_TO_COMPARE,
    Command,
    check_output_files,
    check_output_folder,
    exit_codes,
    output_option,
    replay_options,
    say_written,
    section,
    stage_progress,
    storage_options,
    to_stdout,
    write_json_result,
    write_reports,
)
from tracediff.commands.replay import replay_draft
from tracediff.errors import UsageError


def _final_norm(target: Path | None) -> tuple[Any, str] | None:
    """--target's final norm weight and where it was read (None without --target or without one)."""
    if target is None:
        return None
    from tracediff.adapters.hf import final_norm_weight  # noqa: PLC0415

    weight, where = final_norm_weight(target)
    return None if weight is None else (weight, where)


@click.command(cls=Command, epilog=exit_codes(
    (0, "match (no finding at --fail-on's severity)"),
    (1, "mismatch"),
    (2, "cannot tell (the evidence a conclusion needs was not recorded: the report says what to record); or a "
        "usage or input error, or a report file that cannot be written (one 'tracediff: error:' line; when only "
        "the write failed, after the verdict)")))
@click.argument("stores", nargs=-1, type=STORE, metavar="REFERENCE CANDIDATE [CANDIDATE...]")
@section(
    WHAT_TO_COMPARE,
    click.option("--reference", "references", multiple=True, type=STORE, metavar="STORE",
                 help="A reference store (or quoted glob); repeat for several. Then every positional is a candidate."),
    click.option("--candidate", "candidates", multiple=True, type=STORE, metavar="STORE",
                 help="Another candidate store (or quoted glob); repeat for several."),
    click.option("--tap", help="Tap to compare on both sides (default: the common tap, fc_in first)."),
    click.option("--ref-tap", help="Tap of the reference, when the names differ."),
    click.option("--cand-tap", help="Tap of the candidate, when the names differ."),
    click.option("--segment-size", type=int, help="Width of one segment (hidden size); default from the stores."),
    click.option("--bank", type=STORE, help="A bank recorded with --adapter hf: name each segment's layer."),
    click.option("--sample-rows", type=int, default=2048, show_default=True, help="Rows sampled to plan the comparison."),
)
@section(
    REPORTS,
    output_option("--json", "json_path", "Write the JSON report here"),
    output_option("--markdown", "markdown_path", "Write a Markdown report here"),
    output_option("--html", "html_path", "Write a self-contained HTML report here"),
    click.option("--fail-on", type=click.Choice(["error", "warning"]), default="error", show_default=True,
                 help="Exit 1 on error findings only, or on warnings too (strict CI)."),
    click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line."),
    click.option("--verbose", "-v", is_flag=True,
                 help="Print everything: the plan, every metric, worst rows, every finding's evidence, the config diff."),
)
@replay_options(REPLAY)
@section(
    "Running",
    click.option("--dask", "dask_target", metavar="ADDRESS|local:N",
                 help="Run the streaming pass as dask.distributed tasks: on the scheduler at ADDRESS "
                      "(tcp://HOST:PORT), or on a LocalCluster of N worker processes (local:N). Workers open "
                      "the stores by path or URL themselves (with the --storage-option values). Needs tracediff[dask]."),
    click.option("--progress/--no-progress", default=None,
                 help="Progress on stderr: a live line on a terminal, a status line every few seconds in a log "
                      "(default); --no-progress prints none."),
)
@storage_options
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

    The --json, --markdown and --html paths are checked before anything is read: each file's folder
    exists and takes a new file. Each report is written whole or not at all (a temporary file renamed).
    One of them may be '-': that report goes to stdout, and the verdict line to stderr (-v: the whole
    text report).
    """
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.report import render_text  # noqa: PLC0415
    from tracediff.report.text import render_verdict_line  # noqa: PLC0415
    from tracediff.store.storeset import expand_stores  # noqa: PLC0415

    if sample_rows <= 0:
        raise UsageError(f"--sample-rows must be positive, got {sample_rows}")
    check_output_files(("--json", json_path), ("--markdown", markdown_path), ("--html", html_path))
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
        from tracediff.compare.stream.cluster import DaskRunner  # noqa: PLC0415
        from tracediff.store.location import current_storage_options  # noqa: PLC0415

        # Workers have no --storage-option of their own: the command's go with every task.
        runner = DaskRunner(dask_target, storage_options=current_storage_options())
    if draft is not None and send_report is not None:
        from tracediff.replay import read_send_report  # noqa: PLC0415

        read_send_report(send_report)
    with stage_progress("compare", progress) as prog, contextlib.ExitStack() as cleanup:
        prog.stage("opening stores")
        if runner is not None:
            runner.stage = prog.stage
            cleanup.enter_context(runner)  # a cluster it starts is closed however the compare ends
        opts = CompareOptions(tap=tap, reference_tap=ref_tap, candidate_tap=cand_tap, segment_size=segment_size,
                              sample_rows=sample_rows, progress=prog.advance, progress_total=prog.total,
                              stage=prog.stage, bank=str(bank) if bank else None, runner=runner,
                              final_norm=_final_norm(target))
        report = compare_stores(reference if len(reference) > 1 else reference[0],
                                candidate if len(candidate) > 1 else candidate[0], opts)
        cleanup.close()
        if draft is not None:
            prog.stage("replaying the draft")
            replay_draft(report, draft, target, server_draft, send_report, steps, max_sequences, score_rows,
                    multi_step_starts, replay_dtype)
        prog.stage("writing reports")
        unwritten = write_reports(report, json_path, markdown_path, html_path)
        prog.close(finished=unwritten is None)  # no "done" line before the error
    # A report on stdout keeps it to itself: the text goes to stderr, the verdict line unless -v.
    piped = any(to_stdout(p) for p in (json_path, markdown_path, html_path))
    if quiet or (piped and not verbose):
        click.echo(render_verdict_line(report), err=piped)
    else:
        stream = sys.stderr if piped else sys.stdout
        click.echo(render_text(report, color=stream.isatty(), verbose=verbose), err=piped)
    if unwritten is not None:  # the verdict above, then why a report is missing: exit 2
        raise unwritten
    say_written("compare", json_path, markdown_path, html_path)
    sys.exit(report.exit_code(fail_on))


# ---------------------------------------------------------------------------------- identify
@click.command(cls=Command, epilog=exit_codes(
    (0, "every segment identified (a layer, or a layer scaled)"),
    (1, "a segment is not identified"),
    (2, "usage or input error, or --json cannot be written (when only the write failed, after the result)")))
@click.argument("store", type=STORE)
@section(
    "What to identify",
    click.option("--bank", required=True, type=STORE,
                 help="A trace of every layer of the target model (tracediff record --adapter hf)."),
    click.option("--tap", help="Tap of STORE to identify (default fc_in)."),
    click.option("--bank-tap", help="Tap of the bank (default: its only bank tap)."),
    click.option("--segment-size", type=int, help="Segment width (default: from the store, else the bank's)."),
)
@section(REPORTS, output_option("--json", "json_path", "Write the result as JSON here"))
@storage_options
def identify(store: Path, bank: Path, tap: str | None, bank_tap: str | None, segment_size: int | None,
             json_path: Path | None) -> None:
    """Name the layer each segment of STORE comes from ("segment 0 is hidden_states[3]")."""
    from tracediff.compare.plan.identify import identify_segments, render_identification  # noqa: PLC0415

    check_output_files(("--json", json_path))
    with stage_progress("identify", None) as prog:
        prog.stage("naming each segment's layer")
        ident = identify_segments(store, bank, tap=tap, bank_tap=bank_tap, segment_size=segment_size)
    unwritten = write_json_result(json_path, ident.to_dict())
    click.echo(render_identification(ident), err=to_stdout(json_path))
    if unwritten is not None:
        raise unwritten
    if json_path is not None and not to_stdout(json_path):
        click.echo(f"tracediff identify: wrote the JSON result {json_path}", err=True)
    sys.exit(0 if all(s.verdict in ("match", "scaled") for s in ident.segments) else 1)


@click.command(cls=Command, epilog=exit_codes(
    (0, "calibration rows appended"),
    (2, "usage or input error (STORE, the model, the layers)")))
@click.argument("store", type=click.Path(path_type=Path))
@section(
    "What to recompute",
    click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path),
                 help="The target model's local folder (save_pretrained; safetensors weights): the trainer's weights."),
    click.option("--server-dtype", "server_dtype", default="bfloat16", show_default=True,
                 help="The server's compute dtype, which the sequences are recomputed in (bfloat16, float16, float32)."),
    click.option("--sequences", default=8, show_default=True, type=int, help="Sequences of STORE to recompute."),
    click.option("--tap", default="fc_in", show_default=True, help="The tap whose rows are recomputed."),
    click.option("--layers", help="HF hidden_states indices of the segments, comma-separated (pre_norm: the last "
                                  "layer before the final norm); default: the layers STORE records."),
)
def calibrate(store: Path, model_dir: Path, server_dtype: str, sequences: int, tap: str, layers: str | None) -> None:
    """Append calibration rows to a trainer's STORE: some of its sequences recomputed by the target in
    the server's compute dtype, so that compare measures what a correct run drifts at every segment
    instead of assuming it."""
    from tracediff.record.calibration import calibrate as run_calibrate  # noqa: PLC0415

    if not (store / "zarr.json").is_file():
        raise UsageError(f"{store}: not a trace store (no zarr.json)")
    wanted = [x.strip() for x in layers.split(",") if x.strip()] if layers else None
    done = run_calibrate(store, model_dir, dtype=server_dtype, sequences=sequences, tap=tap, layers=wanted)
    click.echo(f"tracediff calibrate: wrote {done['rows']} calibration rows of {done['sequences']} sequences "
               f"({done['compute_dtype']}, layers {done['layers']}) to {store} (tap {done['tap']})")


# ---------------------------------------------------------------------------------- demo
@click.command(cls=Command, epilog=exit_codes(
    (0, "the demo showed what it should (the broken pair mismatches, the fixed one matches)"),
    (1, "a result came out otherwise"),
    (2, "the samples are missing, or --out cannot hold the reports")))
@section(
    REPORTS,
    click.option("--out", type=click.Path(path_type=Path), default=Path("tracediff-demo"), show_default=True,
                 help="Folder for the HTML, Markdown and JSON reports (created)."),
)
@section(
    WHAT_TO_COMPARE,
    click.option("--samples", type=click.Path(path_type=Path),
                 help="Folder of the sample stores (default: samples/ of the source checkout)."),
)
def demo(out: Path, samples: Path | None) -> None:
    """Compare the shipped broken and fixed trace pairs, identify the broken server's layers, write reports.

    Offline, CPU only.
    """
    from tracediff.demo import run_demo  # noqa: PLC0415

    check_output_folder("--out", out)
    result = run_demo(out, samples, echo=click.echo, color=sys.stdout.isatty())
    sys.exit(result.exit_code)
