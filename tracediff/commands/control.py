"""`tracediff control STORE|URL status|on|off`: switch the recording of a running `tracediff record`
on or off without restarting it, or ask where it stands (:mod:`tracediff.record.control`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from tracediff.commands.options import (
    REPORTS,
    Command,
    check_output_files,
    exit_codes,
    output_option,
    section,
    to_stdout,
    write_json_result,
)


@click.command(cls=Command, epilog=exit_codes(
    (0, "every running recording process answered (on / off: switched, or it already was)"),
    (2, "bad input, no endpoint in STORE, or an endpoint that cannot be reached (one 'tracediff: error:' line "
        "naming it; the others are still asked)")))
@click.argument("target", metavar="STORE|URL")
@click.argument("action", type=click.Choice(["status", "on", "off"]), metavar="status|on|off")
@section(
    "Endpoints",
    click.option("--timeout", type=float, default=5.0, show_default=True,
                 help="Seconds each endpoint may take to answer."),
)
@section(REPORTS, output_option("--json", "json_path", "Write each endpoint's answer as JSON here"))
def control(target: str, action: str, timeout: float, json_path: Path | None) -> None:
    """Switch recording on or off in a running `tracediff record --control-port N`, or show its state.

    STORE is the local store being recorded: every recording process (each TP rank) wrote its endpoint
    there, and each is asked. URL (http://127.0.0.1:PORT) asks one process. While off, the recorder's
    hooks return at once and the rows they see are counted as skipped ("switched off"), never as lost.

    \b
    Examples:
      tracediff control server.zarr off
      tracediff control server.zarr status --json -
      tracediff control http://127.0.0.1:7777 on
    """
    from tracediff.errors import ControlError, UsageError  # noqa: PLC0415
    from tracediff.record.control import ask, find_endpoints  # noqa: PLC0415

    check_output_files(("--json", json_path))
    if not timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    out = to_stdout(json_path)
    if target.startswith(("http://", "https://")):
        endpoints: list[dict[str, Any]] = [{"url": target.rstrip("/")}]
    else:
        endpoints = find_endpoints(target)
    for ended in (e for e in endpoints if e.get("ended")):
        click.echo(f"tracediff control: pid {ended.get('pid')} ({ended.get('writer')}) has ended: not asked", err=True)
    live = [e for e in endpoints if not e.get("ended")]
    if not live:
        raise UsageError(f"{target}: every recording process of this store has ended "
                         f"(pids {', '.join(str(e.get('pid')) for e in endpoints)})")
    results, errors = [], []
    for endpoint in live:
        try:
            answer = ask(endpoint["url"], action, timeout)
        except ControlError as exc:
            errors.append(str(exc))
            results.append({"url": endpoint["url"], "error": str(exc)})
            continue
        results.append({"url": endpoint["url"], **answer})
        click.echo(_line(action, answer), err=out)
    unwritten = write_json_result(json_path, {"action": action, "target": target, "endpoints": results})
    for error in errors:
        click.echo(f"tracediff: error: {error}", err=True)
    if unwritten is not None:
        raise unwritten
    if json_path is not None and not out:
        click.echo(f"tracediff control: wrote the JSON result {json_path}", err=True)
    sys.exit(2 if errors else 0)


def _line(action: str, answer: dict[str, Any]) -> str:
    """One endpoint's answer, one line."""
    rows = answer.get("rows") if isinstance(answer.get("rows"), dict) else {}
    state, since, by = answer.get("state"), answer.get("since"), answer.get("by")
    if action == "status":
        what = f"{state} since {since} (by {by})"
    elif answer.get("changed"):
        what = f"switched {state} at {since} (by {by})"
    else:
        what = f"already {state} since {since} (by {by})"
    return (f"pid {answer.get('pid')} ({answer.get('writer')}) {answer.get('url')}: {what}; "
            f"{rows.get('recorded', 0):,} rows recorded, {rows.get('skipped', 0):,} skipped "
            f"({rows.get('switched_off', 0):,} while off), {rows.get('lost', 0):,} lost")
