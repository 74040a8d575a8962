"""`tracediff lint`: check training hidden states (a trace store, a trainer's offline files) before a
run (:mod:`tracediff.lint`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tracediff.commands.options import (
    REPORTS,
    Command,
    check_output_files,
    exit_codes,
    output_option,
    section,
    stage_progress,
    to_stdout,
    write_json_result,
)


@click.command(cls=Command, epilog=exit_codes(
    (0, "clean: no row, sample, slot or FP8 scale defect (info lines may say what could not be checked)"),
    (1, "findings: a slot with all-zero, constant, non-finite or repeated rows, duplicated samples, a post-norm "
        "slot or one of another depth, bad FP8 scales"),
    (2, "bad input (one 'tracediff: error: FILE: field ...' line), or a report cannot be written")))
@click.argument("data", type=click.Path(path_type=Path), metavar="STORE|DIR")
@section(
    "What to check",
    click.option("--target", "target_dir", type=click.Path(path_type=Path), metavar="TARGET_DIR",
                 help="The target model's folder: its config.json (depth, hidden size) and the final norm's weight "
                      "from its safetensors (one tensor), to tell a post-norm slot."),
    click.option("--bank", type=click.Path(path_type=Path), metavar="BANK",
                 help="A store of every hidden state of the target (record --adapter hf), to tell a slot of another "
                      "depth."),
    click.option("--tap", help="The store's tap to check (default fc_in, else its only tap)."),
    click.option("--layer-ids", help="Offline files: the draft's aux layer ids, comma-separated (they name the slots; "
                                     "speculators: vLLM ids, SpecForge: SGLang ids)."),
)
@section(REPORTS,
         output_option("--json", "json_path", "Write the result as JSON here"),
         output_option("--html", "html_path", "Write the result as one HTML file here"),
         click.option("-v", "--verbose", is_flag=True, help="Print each finding's evidence."))
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr: a live line on a terminal, a status line every few seconds in a log (default).")
def lint(data: Path, target_dir: Path | None, bank: Path | None, tap: str | None, layer_ids: str | None,
         json_path: Path | None, html_path: Path | None, verbose: bool, progress: bool | None) -> None:
    """Check training hidden states: a trace store, or a trainer's offline folder (speculators'
    hs_<i>.safetensors, bf16 or FP8 with per-token scales; SpecForge's .ckpt cache).

    Per slot: all-zero, constant, non-finite and repeated rows (counts, where, examples), duplicated
    samples, the RMS and massive-dimension profile; with --target, a slot that holds the final norm's
    output; with --bank, a slot that holds another layer than its label says; FP8 scales. One
    streaming pass, memory bounded by two files (one read ahead) or one store chunk.
    """
    from tracediff.importers import parse_layer_ids  # noqa: PLC0415
    from tracediff.lint import lint as run_lint  # noqa: PLC0415
    from tracediff.report.lint import render_lint_html, render_lint_text, write_lint_html  # noqa: PLC0415

    check_output_files(("--json", json_path), ("--html", html_path))
    with stage_progress("lint", progress, items="files") as bar:
        result = run_lint(data, target=target_dir, bank=bank, tap=tap, layer_ids=parse_layer_ids(layer_ids),
                          progress=bar)
    unwritten = write_json_result(json_path, result.to_dict())
    if unwritten is None and html_path is not None:
        if to_stdout(html_path):
            click.echo(render_lint_html(result), nl=False)
        else:
            from tracediff.errors import TracediffError  # noqa: PLC0415

            try:
                write_lint_html(html_path, result)
            except TracediffError as exc:
                unwritten = exc
    click.echo(render_lint_text(result, verbose), err=to_stdout(json_path) or to_stdout(html_path))
    if unwritten is not None:
        raise unwritten
    for kind, path in (("JSON", json_path), ("HTML", html_path)):
        if path is not None and not to_stdout(path):
            click.echo(f"tracediff lint: wrote the {kind} result {path}", err=True)
    sys.exit(result.exit_code)
