"""Renderers of a compare report: they format findings, they never compute.

Each renderer reads a :class:`tracediff.compare.results.Report` and returns a string:
:func:`render_text` (terminal), :func:`render_markdown` (pull request or issue) and
:func:`render_html` (one self-contained file). :func:`write_report` writes the JSON, Markdown and
HTML files a user asked for, each atomically: a reader never sees half a report, and a failed write
leaves no file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from tracediff.compare.results import Report
from tracediff.errors import ReportWriteError, UsageError
from tracediff.report.html import render_html
from tracediff.report.markdown import render_markdown
from tracediff.report.text import render_text


def write_report(
    report: Report,
    *,
    json_path: str | os.PathLike[str] | None = None,
    markdown_path: str | os.PathLike[str] | None = None,
    html_path: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write each requested report file atomically and return the paths written, in that order.

    Every path is checked and every document rendered before the first byte is written, so a bad
    path or a rendering bug writes nothing. Each file is written to a temporary file in its own
    folder and renamed over the target; on error the temporary file is removed and the target is
    left as it was. Raises :class:`ReportWriteError` (an ``OSError``) naming the file.
    """
    requested: list[tuple[Path, Callable[[Report], str]]] = [
        (Path(p), render)
        for p, render in (
            (json_path, _render_json),
            (markdown_path, render_markdown),
            (html_path, render_html),
        )
        if p is not None
    ]
    seen: set[Path] = set()
    for path, _ in requested:
        key = path.absolute()
        if key in seen:
            raise UsageError(
                f"report path {path} is given twice: give the JSON, Markdown and HTML reports different paths"
            )
        seen.add(key)
        parent = path.parent
        if not parent.is_dir():
            raise ReportWriteError(f"cannot write report {path}: folder {parent} does not exist; create it first")
        if path.is_dir():
            raise ReportWriteError(f"cannot write report {path}: it is a folder; give a file name")
    documents = [(path, render(report)) for path, render in requested]
    for path, text in documents:
        _write_atomic(path, text)
    return [path for path, _ in documents]


def write_json(path: str | os.PathLike[str], document: object) -> Path:
    """Write any JSON-able document atomically (identify's result, for one)."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ReportWriteError(f"cannot write {target}: folder {target.parent} does not exist; create it first")
    _write_atomic(target, json_text(document))
    return target


def json_text(document: object) -> str:
    """A JSON-able document as :func:`write_json` writes it (the CLI's ``--json -`` prints it)."""
    import json  # noqa: PLC0415

    from tracediff.compare.results import json_safe  # noqa: PLC0415

    return json.dumps(json_safe(document), indent=2, allow_nan=False, default=str) + "\n"


def _render_json(report: Report) -> str:
    return report.to_json() + "\n"


def _write_atomic(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL: never write through a file (or link) someone else put there; 0o666 & umask, like open().
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
            raise ReportWriteError(
                f"cannot write report {path}: {reason}; check that the folder is writable and the disk has space"
            ) from exc
        raise


__all__ = ["ReportWriteError", "json_text", "render_html", "render_markdown", "render_text", "write_json", "write_report"]
