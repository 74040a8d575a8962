"""`tracediff preflight`: what each engine will feed a draft, from configs alone (:mod:`tracediff.preflight`)."""

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
    to_stdout,
    write_json_result,
)
from tracediff.errors import UsageError


def _versions(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for text in values:
        name, sep, version = text.partition("=")
        if not sep or name.strip().lower() not in ("sglang", "vllm", "speculators", "specforge") or not version.strip():
            raise UsageError(f"--engine-version {text!r}: expected NAME=VERSION with NAME one of sglang, vllm, "
                             f"speculators, specforge (e.g. sglang=0.5.23)")
        out[name.strip().lower()] = version.strip()
    return out


def _layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p != ""] or None
    except ValueError:
        raise UsageError(f"--trainer-layers {text!r}: expected integers separated by commas, e.g. 0,3,31") from None


@click.command(cls=Command, epilog=exit_codes(
    (0, "the same layers everywhere: every engine feeds the draft what the trainer fed, and no check failed"),
    (1, "a difference: an engine feeds other layers, leaves a slot unfilled or fails, or the fc width, d2t map or "
        "vocabulary does not fit the target; or cannot tell (verdict unknown: the layers depend on a --target "
        "not given)"),
    (2, "bad input (one 'tracediff: error: FILE: field ...' line), or --json cannot be written")))
@click.argument("draft_dir", type=click.Path(path_type=Path), metavar="DRAFT_DIR")
@section(
    "What to check",
    click.option("--target", "target_dir", type=click.Path(path_type=Path), metavar="TARGET_DIR",
                 help="The target model's folder (its config.json): layer count, hidden size, family, vocabulary."),
    click.option("--engine", type=click.Choice(["sglang", "vllm", "all"]), default="all", show_default=True,
                 help="Which serving engine(s) to predict."),
    click.option("--trainer", metavar="speculators|specforge|STORE",
                 help="What the trainer fed: its convention for the same draft config, or a trainer store "
                      "recorded by tracediff (its recorded aux layers). Default: speculators when the draft config "
                      "is in its format, else unknown (the engines are then compared with each other)."),
    click.option("--trainer-layers", metavar="LIST",
                 help="The layers the trainer fed, as HF hidden_states indices (0 = embedding), e.g. 0,3,31."),
    click.option("--engine-version", "engine_versions", multiple=True, metavar="NAME=VERSION",
                 help="The version the server runs (repeatable), e.g. sglang=0.5.23; default: the installed one, "
                      "else unknown (a warning, and the newest rule read)."),
)
@section(REPORTS, output_option("--json", "json_path", "Write the result as JSON here"))
def preflight(draft_dir: Path, target_dir: Path | None, engine: str, trainer: str | None,
              trainer_layers: str | None, engine_versions: tuple[str, ...], json_path: Path | None) -> None:
    """Before anything is recorded: which target layers each engine will feed DRAFT_DIR's fc.

    Reads the draft's config.json and safetensors headers (never the weights), the target's config.json
    and each engine's rule (docs/preflight.md lists them with the version and source file each was read
    from), and prints per engine the ids it reads and where from, how it numbers them, the layers it
    captures (HF hidden_states indices) in order, against what the trainer fed, and the fix in that
    engine's own config field. Also checks the fc width, the d2t map, vocabularies and depth.
    """
    from tracediff.preflight import render_text, run_preflight  # noqa: PLC0415

    check_output_files(("--json", json_path))
    if trainer is not None and trainer_layers is not None:
        raise UsageError("--trainer and --trainer-layers both say what the trainer fed: give one")
    engines = ("sglang", "vllm") if engine == "all" else (engine,)
    pf = run_preflight(draft_dir, target_dir, engines, trainer=trainer, trainer_layers=_layers(trainer_layers),
                       versions=_versions(engine_versions))
    unwritten = write_json_result(json_path, pf.to_dict())
    click.echo(render_text(pf), err=to_stdout(json_path))
    if unwritten is not None:
        raise unwritten
    if json_path is not None and not to_stdout(json_path):
        click.echo(f"tracediff preflight: wrote the JSON result {json_path}", err=True)
    sys.exit(pf.exit_code)
