"""The commands that make, move and show stores: `import` (offline hidden-state files), `send` (a
trace's tokens to a running server, to record it), `inspect`, `pack` (a .zarr.zip) and `push` (to
object storage)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import click

from tracediff.commands.options import (
    REPORTS,
    STORE,
    Command,
    CommandGroup,
    check_output_files,
    check_output_store,
    exit_codes,
    output_option,
    section,
    stage_progress,
    storage_options,
    store_name,
    to_stdout,
    write_json_result,
)
from tracediff.errors import UsageError

# ---------------------------------------------------------------------------------- import
_IMPORT_EXITS = exit_codes((0, "the store written"),
                           (2, "usage or input error (SRC not in that framework's layout, -o exists...)"))


@click.group(name="import", cls=CommandGroup, epilog=_IMPORT_EXITS)
def import_group() -> None:
    """Turn a trainer's offline hidden-state files into a reference trace (taps fc_in and bank)."""


_OUTPUT_STORE = "Output store"


def _import_options(func: Any) -> Any:
    func = section(_OUTPUT_STORE,
                   click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
                                help="Store to create."),
                   click.option("--overwrite", is_flag=True, help="Replace an existing store."))(func)
    func = section("What to import",
                   click.option("--layer-ids", help="The draft's aux layer ids, comma-separated (they name the segments)."),
                   click.option("--max-files", type=int, help="Import only the first N files."))(func)
    return click.argument("src", type=click.Path(path_type=Path))(func)


@import_group.command(name="speculators", epilog=_IMPORT_EXITS)
@_import_options
def import_speculators_cmd(src: Path, output: Path, overwrite: bool, layer_ids: str | None,
                           max_files: int | None) -> None:
    """Import speculators' hs_<i>.safetensors files from SRC (or SRC/hidden_states).

    --layer-ids: eagle_aux_hidden_state_layer_ids of the draft config (vLLM ids).
    """
    from tracediff.importers import import_speculators, parse_layer_ids  # noqa: PLC0415

    if max_files is not None and max_files <= 0:
        raise UsageError(f"--max-files must be positive, got {max_files}")
    check_output_store("-o", output)
    result = import_speculators(src, output, layer_ids=parse_layer_ids(layer_ids), overwrite=overwrite,
                                max_files=max_files)
    click.echo(f"tracediff: {result.summary()}", err=True)


@import_group.command(name="specforge", epilog=_IMPORT_EXITS)
@_import_options
def import_specforge_cmd(src: Path, output: Path, overwrite: bool, layer_ids: str | None,
                         max_files: int | None) -> None:
    """Import SpecForge's offline data_<i>.ckpt[.gz] files under SRC (read with torch.load(weights_only=True)).

    --layer-ids: eagle_config.eagle_aux_hidden_state_layer_ids of the draft config (SGLang ids).
    """
    from tracediff.importers import import_specforge, parse_layer_ids  # noqa: PLC0415

    if max_files is not None and max_files <= 0:
        raise UsageError(f"--max-files must be positive, got {max_files}")
    check_output_store("-o", output)
    result = import_specforge(src, output, layer_ids=parse_layer_ids(layer_ids), overwrite=overwrite,
                              max_files=max_files)
    click.echo(f"tracediff: {result.summary()}", err=True)


# ---------------------------------------------------------------------------------- send
@click.command(cls=Command, epilog=exit_codes(
    (0, "every sequence sent"),
    (1, "some requests failed (each named on stderr)"),
    (2, "usage or input error, the server unreachable, or --json cannot be written")))
@click.argument("trace", type=STORE)
@section(
    "What to send",
    click.option("--tap", help="Tap whose token labels give the sequences (default fc_in, else the trace's only tap)."),
    click.option("--limit", type=int, help="Send only the first N sequences."),
    click.option("--max-new-tokens", type=int, default=1, show_default=True,
                 help="Tokens generated per request (1: only the sequence itself is forwarded, as in training; more: "
                      "decode and verify steps too)."),
    click.option("--rid-prefix", default="", help="Prefix of the request ids (default: the sequence keys as they are)."),
)
@section(
    "Server",
    click.option("--url", required=True, help="Base URL of the running server, e.g. http://127.0.0.1:30000."),
    click.option("--engine", type=click.Choice(["sglang", "vllm"]), default="sglang", show_default=True,
                 help="The server's API: SGLang /generate, or vLLM's OpenAI-compatible /v1/completions."),
    click.option("--model", "model", help="vLLM: the served model name (default: the server's first model)."),
    click.option("--concurrency", type=int, default=4, show_default=True, help="Requests in flight at most."),
    click.option("--retries", type=int, default=3, show_default=True, help="Retries of a request the server did not take."),
    click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for one response."),
)
@section(
    REPORTS,
    output_option("--json", "report_path",
                  "Write what was sent and each response's output ids and the engine's speculative-decoding numbers "
                  "(accept length) as JSON here: replay's --send-report"),
)
@storage_options
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
    """
    from tracediff.send import SendOptions, check_server, check_vocabulary, send_sequences, sequences_from_trace  # noqa: PLC0415

    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be positive, got {limit}")
    if not re.match(r"^https?://", url):
        raise UsageError(f"--url {url!r}: give a base URL such as http://127.0.0.1:30000")
    if concurrency < 1 or max_new_tokens < 1 or retries < 0 or timeout <= 0:
        raise UsageError("--concurrency and --max-new-tokens must be >= 1, --retries >= 0, --timeout > 0")
    check_output_files(("--json", report_path))
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
    # Whole or not at all (a temporary file renamed), as compare's reports.
    unwritten = write_json_result(report_path, {"trace": str(trace), **result.to_dict()})
    click.echo(f"sent {result.succeeded} of {result.sequences} sequences ({result.tokens} tokens) to {result.url} "
               f"in {result.seconds:.1f}s" + (f", {result.retried} retries" if result.retried else ""),
               err=to_stdout(report_path))
    for key, error in list(result.failures.items())[:10]:
        click.echo(f"tracediff: failed: sequence {key}: {error}", err=True)
    if len(result.failures) > 10:
        click.echo(f"tracediff: ... and {len(result.failures) - 10} more failed sequences", err=True)
    if unwritten is not None:  # what was sent, then why the report is missing: exit 2
        raise unwritten
    sys.exit(1 if result.failures else 0)


# ---------------------------------------------------------------------------------- inspect
@click.command(cls=Command, epilog=exit_codes((0, "shown (a half-pushed store too: its status line says so)"),
                                             (2, "STORE cannot be opened or read, or --json cannot be written")))
@click.argument("store", type=STORE)
@section(REPORTS, output_option("--json", "json_path", "Write what STORE holds as JSON here"))
@storage_options
def inspect(store: Path, json_path: Path | None) -> None:
    """Show what STORE holds: taps, processes, rows, width, dtype, segments, phases, drops, meta.

    With --json - the JSON alone goes to stdout; with --json FILE the text is shown as without it.
    """
    from tracediff.describe import describe_store, render_text  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    check_output_files(("--json", json_path))
    opened = open_store(store)
    try:
        desc = describe_store(opened)
    finally:
        opened.close()
    unwritten = write_json_result(json_path, desc)
    if not to_stdout(json_path):
        click.echo(render_text(desc))
    if unwritten is not None:
        raise unwritten


# ---------------------------------------------------------------------------------- pack
@click.command(cls=Command, epilog=exit_codes((0, "DEST written (its path printed)"),
                                             (2, "usage or input error, DEST exists (no --overwrite) or cannot be "
                                                 "written")))
@click.argument("store", type=STORE)
@click.argument("dest", type=click.Path(path_type=Path), required=False)
@section(
    _OUTPUT_STORE,
    click.option("-o", "--output", "output", type=click.Path(path_type=Path), metavar="DEST",
                 help="The .zarr.zip file to write (default: STORE.zip next to STORE), as record and import take it; "
                      "DEST may also follow STORE."),
    click.option("--overwrite", is_flag=True, help="Replace DEST if it exists already."),
)
@storage_options
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
        dest = store.with_name(store.name + ".zip") if isinstance(store, Path) else Path(store_name(store) + ".zip")
    check_output_files(("-o" if output is not None else "DEST", dest))
    click.echo(str(pack_store(store, dest, overwrite=overwrite)))


# ---------------------------------------------------------------------------------- push
@click.command(cls=Command, epilog=exit_codes((0, "every committed row at URL, checked with the strict reader"),
                                             (2, "usage or input error, URL unreachable or refusing (rerun: it "
                                                 "resumes)")))
@click.argument("local", type=click.Path(path_type=Path))
@click.argument("url")
@section(_OUTPUT_STORE, click.option("--overwrite", is_flag=True, help="Replace another store already at URL."))
@storage_options
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
    with stage_progress("push", progress, unit="bytes", items="objects") as prog:
        prog.stage("opening the local store")
        result = push_store(local, url, overwrite=overwrite, progress=prog.advance, stage=prog.stage)
    click.echo(f"tracediff: {result.summary()}")
