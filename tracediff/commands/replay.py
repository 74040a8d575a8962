"""`tracediff replay`: the draft replayed on both sides' rows (what a mismatch costs), and the
replay step `compare --draft` runs after its compare."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from tracediff.commands.options import (
    REPORTS,
    STORE,
    WHAT_TO_COMPARE,
    Command,
    check_output_files,
    exit_codes,
    output_option,
    replay_options,
    say_written,
    section,
    stage_progress,
    storage_options,
    to_stdout,
    write_reports,
)
from tracediff.errors import UsageError


def replay_draft(report: Any, draft: Path, target: Path | None, server_draft: Path | None, send_report: Path | None,
                 steps: int, max_sequences: int | None, score_rows: int, multi_step_starts: int,
                 replay_dtype: str) -> Any:
    """Replay the draft on both sides' rows of a finished compare and attach the result to ``report``."""
    from tracediff.replay import ReplayOptions, attach_replay  # noqa: PLC0415

    if max_sequences is not None and max_sequences <= 0:
        raise UsageError(f"--max-sequences must be positive, got {max_sequences}")
    return attach_replay(report, ReplayOptions(
        draft=str(draft), target=str(target) if target else None, server_draft=str(server_draft) if server_draft else None,
        send_report=str(send_report) if send_report else None, steps=steps, max_sequences=max_sequences,
        score_rows=score_rows, multi_step_starts=multi_step_starts, dtype=replay_dtype))


@click.command(cls=Command, epilog=exit_codes(
    (0, "nothing found (--against-chain: every judged tap matches)"),
    (1, "compare or replay found a problem (--against-chain: a tap of the served draft diverges)"),
    (2, "compare cannot tell (--against-chain: the server store holds no draft chain); or a usage or input error, "
        "or a report file that cannot be written (when only the write failed, after the result)")))
@click.argument("reference", type=STORE)
@click.argument("candidate", type=STORE, required=False)
@replay_options("Replay")
@section(
    WHAT_TO_COMPARE,
    click.option("--against-chain", "against_chain", is_flag=True,
                 help="One store, the server's, recorded with --draft-chain: run --draft on its fc rows and input "
                      "tokens, each draft step as the server ran it, and compare every point of the draft's forward "
                      "with what the served draft produced (docs/replay.md)."),
    click.option("--tap", help="Tap to replay on both sides (default: as compare picks it)."),
    click.option("--ref-tap", help="Tap of the reference, when the names differ."),
    click.option("--cand-tap", help="Tap of the candidate, when the names differ."),
)
@section(
    REPORTS,
    output_option("--json", "json_path", "Write the JSON report (compare + replay) here"),
    output_option("--markdown", "markdown_path", "Write a Markdown report here"),
    output_option("--html", "html_path", "Write a self-contained HTML report here"),
)
@storage_options
def replay(reference: Path, candidate: Path | None, against_chain: bool, tap: str | None, ref_tap: str | None,
           cand_tap: str | None, json_path: Path | None, markdown_path: Path | None, html_path: Path | None,
           draft: Path | None, target: Path | None, server_draft: Path | None, send_report: Path | None, steps: int,
           max_sequences: int | None, score_rows: int, multi_step_starts: int, replay_dtype: str) -> None:
    """What a mismatch costs: run the EAGLE-3 draft (--draft DIR: config.json + safetensors) teacher-forced
    on REFERENCE's (trainer's) and CANDIDATE's (server's) recorded fc rows: step-0 and multi-step accuracy
    and accept length, (a) on the reference's rows, (b) on the candidate's, (c) on the candidate's with
    compare's proposed fix, next to (d) the accept length the engine reported (--send-report from
    `tracediff send --json`).

    `tracediff replay SERVER --draft DIR --against-chain`: does the served draft compute what the
    checkpoint computes? Replays the draft on the server's own recorded inputs (record --draft-chain)
    and names the first point of the draft's forward where they differ, per draft step.

    One of --json, --markdown and --html may be '-': that report goes to stdout, the replay's text to
    stderr.
    """
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.report.text import render_replay  # noqa: PLC0415

    if draft is None:
        raise UsageError("replay needs --draft DIR (the draft checkpoint folder: config.json + *.safetensors)")
    if against_chain:
        _check_against_chain(candidate, tap=tap, ref_tap=ref_tap, cand_tap=cand_tap, server_draft=server_draft,
                             send_report=send_report)
    elif candidate is None:
        raise UsageError("replay needs two stores (REFERENCE CANDIDATE), or one server store with --against-chain")
    check_output_files(("--json", json_path), ("--markdown", markdown_path), ("--html", html_path))
    if against_chain:
        _against_chain(reference, draft, target, max_sequences, replay_dtype, json_path, markdown_path, html_path)
    if send_report is not None:
        from tracediff.replay import read_send_report  # noqa: PLC0415

        read_send_report(send_report)
    with stage_progress("replay", None) as prog:
        report = compare_stores(reference, candidate, CompareOptions(tap=tap, reference_tap=ref_tap,
                                                                     candidate_tap=cand_tap, stage=prog.stage))
        prog.stage("replaying the draft")
        replay_draft(report, draft, target, server_draft, send_report, steps, max_sequences, score_rows, multi_step_starts,
                replay_dtype)
        prog.stage("writing reports")
        unwritten = write_reports(report, json_path, markdown_path, html_path)
        prog.close(finished=unwritten is None)  # no "done" line before the error
    click.echo(render_replay(report), err=any(to_stdout(p) for p in (json_path, markdown_path, html_path)))
    if unwritten is not None:
        raise unwritten
    say_written("replay", json_path, markdown_path, html_path)
    sys.exit(report.exit_code("error"))


def _check_against_chain(candidate: Path | None, **given: Any) -> None:
    if candidate is not None:
        raise UsageError("--against-chain takes one store (the server's, recorded with --draft-chain), got two")
    for name, value in given.items():
        if value is not None:
            raise UsageError(f"--{name.replace('_', '-')} does not apply to --against-chain (the server's own chain "
                             f"says which rows and steps to replay)")


def _against_chain(server: Path, draft: Path, target: Path | None, max_sequences: int | None, replay_dtype: str,
                   json_path: Path | None, markdown_path: Path | None, html_path: Path | None) -> None:
    """`replay SERVER --against-chain`: the checkpoint on the server's chain inputs, compared tap by tap.
    A server store without chain taps is one 'cannot tell' line and exit code 2."""
    from tracediff.replay.chain import ChainReplayOptions, NoServerChainError, replay_against_chain  # noqa: PLC0415
    from tracediff.report.text import render_replay_chain  # noqa: PLC0415

    if max_sequences is not None and max_sequences <= 0:
        raise UsageError(f"--max-sequences must be positive, got {max_sequences}")
    with stage_progress("replay", None) as prog:
        try:
            report = replay_against_chain(server, ChainReplayOptions(
                draft=str(draft), target=str(target) if target else None, max_sequences=max_sequences,
                dtype=replay_dtype, stage=prog.stage))
        except NoServerChainError as exc:
            prog.close(finished=False)
            click.echo(f"tracediff replay: {exc}", err=True)
            sys.exit(2)
        prog.stage("writing reports")
        unwritten = write_reports(report, json_path, markdown_path, html_path)
        prog.close(finished=unwritten is None)
    click.echo(render_replay_chain(report), err=any(to_stdout(p) for p in (json_path, markdown_path, html_path)))
    if unwritten is not None:
        raise unwritten
    say_written("replay", json_path, markdown_path, html_path)
    sys.exit(report.exit_code("error"))
