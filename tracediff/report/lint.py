"""Renderers of a lint result (:class:`tracediff.lint.LintResult`): text for the terminal, one
self-contained HTML file, and the JSON document. Formatting only: every number comes from the result.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tracediff.errors import ReportWriteError
from tracediff.report.charts import esc

_TITLES = {"error": "ERROR", "warning": "WARNING", "info": "INFO"}
_COLUMNS = ("slot", "label", "kind", "rows", "zero", "constant", "non-finite", "repeated", "RMS mean", "RMS cv",
            "massive dims", "rms(x/w)=1")


def _num(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def slot_rows(result: Any) -> list[list[str]]:
    """The slot table, one row of strings per slot."""
    rows = []
    for s in result.slots:
        massive = ",".join(map(str, s.massive_dims[:4])) + (" ..." if len(s.massive_dims) > 4 else "")
        if s.massive_dims and s.massive_ratio:
            massive += f" ({s.massive_ratio:.0f}x)"
        rows.append([str(s.index), s.label, s.kind, str(s.rows), str(s.zero_rows), str(s.constant_rows),
                     str(s.nonfinite_rows), str(s.duplicate_rows), _num(s.rms_mean), _pct(s.rms_cv), massive or "none",
                     _pct(s.unit_rms_after_norm)])
    return rows


def headline(result: Any) -> str:
    c = result.counts()
    parts = [f"{c[k]} {k}{'s' if c[k] != 1 else ''}" for k in ("error", "warning", "info") if c[k]]
    verdict = "CLEAN" if result.verdict == "clean" else "FINDINGS"
    return f"tracediff lint: {verdict}  ({', '.join(parts) or 'nothing to say'}; exit code {result.exit_code})"


def data_line(result: Any) -> str:
    what = f"{result.samples} sample{'s' if result.samples != 1 else ''}, {result.rows} rows"
    return (f"{result.source}: {result.format}, {what}, {len(result.slots)} slots of {result.segment_size}, "
            f"stored as {result.storage}")


def render_lint_text(result: Any, verbose: bool = False) -> str:
    lines = [headline(result), f"  {'data':<10}{data_line(result)}"]
    lines += [f"  {name:<10}{text}" for name, text in result.checks.items()]
    if result.findings:
        lines += ["", "Findings"]
        for f in result.findings:
            lines.append(f"  {_TITLES[f.severity]} {f.kind}: {f.message}")
            if verbose and f.evidence:
                lines.append(f"      evidence: {json.dumps(f.evidence, default=str)[:400]}")
    table = [list(_COLUMNS), *slot_rows(result)]
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
    lines += ["", "Slots (per-row RMS over the rows with data; massive: dimensions >= 20x the median dimension's RMS)"]
    lines += ["  " + "  ".join(c.ljust(w) if i in (1, 2, 10) else c.rjust(w) for i, (c, w) in
                               enumerate(zip(r, widths, strict=True))).rstrip() for r in table]
    if result.fp8:
        fp8 = result.fp8
        lines += ["", f"FP8 scales over {fp8['tokens']} tokens: {fp8['zero_scales']} zero, {fp8['negative_scales']} "
                      f"negative, {fp8['nonfinite_scales']} non-finite; {fp8['nan_codes']} tokens with NaN codes, "
                      f"{fp8['saturated_tokens']} saturated"]
    lines.append(f"({result.seconds:.1f} s)")
    return "\n".join(lines)


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; background: #f6f8fa; color: #1f2328; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 24px 40px; }
header { padding: 18px 24px; color: #fff; }
header.findings { background: #c62828; } header.clean { background: #2e7d32; }
header h1 { margin: 0 0 4px; font-size: 24px; }
section { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 14px 18px; margin: 16px 0; }
table { border-collapse: collapse; } td, th { padding: 3px 8px; border-bottom: 1px solid #d0d7de; text-align: right; }
td:nth-child(2), td:nth-child(3), th { text-align: left; }
.error { color: #c62828; font-weight: 600; } .warning { color: #b26a00; font-weight: 600; } .info { color: #1565c0; }
li { margin: 4px 0; } code { background: #eff1f3; padding: 0 3px; }
"""


def render_lint_html(result: Any) -> str:
    findings = "".join(
        f"<li><span class='{f.severity}'>{_TITLES[f.severity]}</span> <code>{esc(f.kind)}</code> {esc(f.message)}"
        + (f"<details><summary>evidence</summary><pre>{esc(json.dumps(f.evidence, indent=1, default=str))}</pre>"
           f"</details>" if f.evidence else "") + "</li>"
        for f in result.findings) or "<li>none</li>"
    head = "".join(f"<th>{esc(c)}</th>" for c in _COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in slot_rows(result))
    checks = "".join(f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in result.checks.items())
    fp8 = ""
    if result.fp8:
        fp8 = f"<section><h2>FP8 scales</h2><pre>{esc(json.dumps(result.fp8, indent=1, default=str))}</pre></section>"
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>tracediff lint</title>"
            f"<style>{_CSS}</style></head><body><header class='{result.verdict}'><h1>{esc(headline(result))}</h1>"
            f"<p>{esc(data_line(result))}</p></header><main>"
            f"<section><h2>Findings</h2><ul>{findings}</ul></section>"
            f"<section><h2>Slots</h2><table><tr>{head}</tr>{body}</table></section>{fp8}"
            f"<section><h2>Checks</h2><ul>{checks}</ul></section></main></body></html>\n")


def write_lint_html(path: Path, result: Any) -> Path:
    """The HTML result, written whole or not at all (a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(render_lint_html(result), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ReportWriteError(f"cannot write {path}: {exc.strerror or exc}; check that the folder is writable") from exc
    return path


__all__ = ["write_lint_html", "data_line", "headline", "render_lint_html", "render_lint_text", "slot_rows"]
