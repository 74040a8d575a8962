"""What a trace store holds, as plain data (``tracediff inspect`` and the end-of-record summary).

Reads metadata and label columns only, never the values: cheap even on a large store.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracediff.store import PHASES, TraceStore, TraceStream
from tracediff.store.ring import ring_of, ring_summary


def describe_stream(stream: TraceStream) -> dict[str, Any]:
    commit = stream.commit
    labels = stream.labels(("seq", "phase", "valid", "token_id", "position"))
    phase_counts = np.bincount(labels["phase"].clip(0, len(PHASES) - 1).astype(np.int64), minlength=len(PHASES))
    segment_size = stream.segment_size
    return {
        "tap": stream.tap,
        "writer": stream.writer,
        "rows": stream.rows,
        "width": stream.width,
        "dtype": stream.dtype,
        "bytes": stream.nbytes,
        "segment_size": segment_size,
        "segments": stream.width // segment_size if segment_size and stream.width % segment_size == 0 else None,
        "segment_labels": stream.segment_labels,
        "module": stream.attrs.get("module"),
        "capture": stream.attrs.get("capture"),
        "rank": stream.attrs.get("rank"),
        "pid": (stream.attrs.get("source") or {}).get("pid"),
        "phases": {PHASES[i]: int(c) for i, c in enumerate(phase_counts) if c},
        "sequences": int(np.unique(labels["seq"]).size),
        "invalid_rows": int((~labels["valid"]).sum()),
        "rows_without_token": int((labels["token_id"] < 0).sum()),
        "labelled_by": stream.attrs.get("labelled_by") if isinstance(stream.attrs.get("labelled_by"), dict) else None,
        "max_position": int(labels["position"].max()) if stream.rows else None,
        "status": commit.get("status"),
        "error": commit.get("error") or None,
        "batches": commit.get("batches", 0),
        "dropped_rows": commit.get("dropped_rows", 0),
        "dropped_batches": commit.get("dropped_batches", 0),
        "drop_reason": commit.get("drop_reason") or None,
        "skipped_rows": commit.get("skipped_rows", 0),
        # The light lint record ran as it wrote (tracediff.lint.light): all-zero rows per segment.
        "row_checks": stream.attrs.get("row_checks") if isinstance(stream.attrs.get("row_checks"), dict) else None,
        # Recording switched on and off (tracediff.record.switch), and where the writer thread ran.
        "switch": stream.attrs.get("switch") if isinstance(stream.attrs.get("switch"), list) else None,
        "skip_reasons": stream.attrs.get("skip_reasons") if isinstance(stream.attrs.get("skip_reasons"), dict) else None,
        "threads": stream.attrs.get("threads") if isinstance(stream.attrs.get("threads"), dict) else None,
        # A segment of a ring (record --max-bytes SIZE --ring): tracediff.store.ring.
        "ring": ring_of(stream.attrs),
        "limits": stream.attrs.get("limits") if isinstance(stream.attrs.get("limits"), dict) else None,
    }


def describe_store(store: TraceStore) -> dict[str, Any]:
    streams = [describe_stream(s) for tap in store.taps for s in store.streams[tap]]
    return {
        "path": str(store.path),
        "format": store.format,
        "written_by": store.version,
        "incomplete": store.incomplete,
        "source": store.source,
        "meta": store.meta,
        "taps": {
            tap: {
                "rows": sum(s["rows"] for s in streams if s["tap"] == tap),
                "writers": [s for s in streams if s["tap"] == tap],
                "rings": ring_summary([s for s in streams if s["tap"] == tap]),
            }
            for tap in store.taps
        },
    }


def keeping_lines(info: dict[str, Any]) -> list[str]:
    """What a tap's sampling and rings left out on purpose (``describe_store``'s tap entry): the
    request sampling rate, and per ring the segments kept and what it dropped."""
    out = []
    rates = {(w.get("limits") or {}).get("sample_requests") for w in info["writers"]} - {None}
    caps = {(w.get("limits") or {}).get("max_requests") for w in info["writers"]} - {None}
    if rates or caps:
        what = [f"rate {', '.join(map(str, sorted(rates)))} by prompt hash (tracediff.sampled)"] if rates else []
        what += [f"at most {', '.join(map(str, sorted(caps)))} requests"] if caps else []
        out.append(f"sampled requests: {'; '.join(what)}; the others are skipped rows")
    for name, ring in info.get("rings", {}).items():
        out.append(f"ring {name}: {len(ring['segments'])} segment(s), {ring['rows']} rows kept within "
                   f"{ring['budget_bytes']} bytes; dropped {ring['dropped_rows']} rows in {ring['dropped_batches']} "
                   f"batches ({ring['dropped_bytes']} bytes, {ring['dropped_segments']} segments), oldest first")
    return out


def switch_lines(writer: dict[str, Any]) -> list[str]:
    """A writer's on/off history (``describe_stream``'s entry), when it was ever switched off: each
    change with its time and who made it, and the rows skipped while off."""
    history = [e for e in writer.get("switch") or [] if isinstance(e, dict)]
    if not any(e.get("state") == "off" for e in history):
        return []
    changes = ", ".join(f"{e.get('state')} at {e.get('time')} ({e.get('by')})" for e in history)
    off = (writer.get("skip_reasons") or {}).get("switched off", 0)
    return [f"switched off {off} rows: {changes}"]


def warnings_for(desc: dict[str, Any], expected_taps: list[str] | None = None) -> list[str]:
    """Problems a person should see: taps that never fired, writers that did not close, drops."""
    out: list[str] = [desc["incomplete"]] if desc.get("incomplete") else []
    for tap in expected_taps or []:
        if tap not in desc["taps"] or desc["taps"][tap]["rows"] == 0:
            out.append(
                f"tap {tap!r} never fired in any process: check the class name in the tap spec, that the "
                f"module runs a Python forward (CUDA-graph replay skips hooks: add --disable-cuda-graph), "
                f"and the sampling limits"
            )
    for tap, info in desc["taps"].items():
        for w in info["writers"]:
            where = f"{tap}/{w['writer']}"
            if w["status"] == "recording":
                out.append(f"{where}: the process did not close its writer (killed?); its {w['rows']} committed rows are readable")
            elif w["status"] == "failed":
                out.append(f"{where}: recording stopped after an error: {w['error']}")
            if w["dropped_rows"] and w["status"] == "failed":
                out.append(
                    f"{where}: {w['dropped_rows']} rows in {w['dropped_batches']} batches were dropped (not written "
                    f"after the error above, or the writer fell behind)"
                )
            elif w["dropped_rows"] and w.get("drop_reason") and not _queue_full(w["drop_reason"]):
                out.append(f"{where}: {w['dropped_rows']} rows were not recorded: {w['drop_reason']}")
            elif w["dropped_rows"]:
                out.append(
                    f"{where}: {w['dropped_rows']} rows in {w['dropped_batches']} batches were dropped because the "
                    f"writer fell behind (raise --queue-bytes, use --on-full block, or record fewer steps)"
                )
    return out


def _queue_full(reason: str) -> bool:
    """The recorder's words for rows its full queue refused (tracediff.record.capture._reserve)."""
    return reason.startswith("the queue held")


def labelling_lines(desc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What labelled each tap's rows: ``(notes, warnings)``. A note names the class whose forward's
    ``input_ids`` labelled them (and how it was chosen); a warning says loudly that rows carry no
    token ids (compare can then align them only by sequence index and position) and what to pass."""
    notes: list[str] = []
    warnings: list[str] = []
    adapters = set(((desc.get("meta") or {}).get("record") or {}).get("adapters") or []) - {"generic"}
    for tap, info in desc["taps"].items():
        writers = [w for w in info["writers"] if w["rows"]]
        rows = sum(w["rows"] for w in writers)
        missing = sum(w["rows_without_token"] for w in writers)
        by = {_source_text(w["labelled_by"]) for w in writers if w.get("labelled_by")}
        if by:
            notes.append(f"{tap}: rows labelled by {'; '.join(sorted(by))}")
        script = any((w.get("labelled_by") or {}).get("how") == "tracediff.labels" for w in writers)
        if rows and missing and not script and not adapters:
            # (Rows the script labels itself without token ids are aligned by its own sequence keys;
            # a framework adapter labels its own rows and says itself what a run lacks.)
            what = "the rows carry" if missing == rows else f"{missing} of {rows} rows carry"
            warnings.append(
                f"{tap}: {what} no token ids (no module whose forward gets input_ids labelled them): compare "
                f"cannot align them by content, only by sequence index and position; record again with "
                f"--labels-from CLASS (the model whose forward gets the token ids) or call "
                f"tracediff.labels(token_id=..., position=...) in the script before the tapped forward")
    return notes, warnings


def _source_text(by: dict[str, Any]) -> str:
    if by.get("how") == "tracediff.labels":
        return "the script (tracediff.labels)"
    how = {"automatic": "found automatically: the outermost forward that gets input_ids",
           "--labels-from": "--labels-from"}.get(str(by.get("how")), str(by.get("how") or "label source"))
    text = f"{by.get('class')} (its forward's input_ids; {how})"
    if by.get("holds_tap"):
        text += (" - it holds the tapped module: if its input_ids are the draft's own input tokens, the rows' "
                 "tokens are one position ahead; pass --labels-from with the target model's class")
    return text


def render_text(desc: dict[str, Any]) -> str:
    lines = [f"store   {desc['path']}  (format {desc['format']}, written by tracediff {desc['written_by']})"]
    if desc.get("incomplete"):
        lines.append(f"status  {desc['incomplete']}")
    src = desc.get("source") or {}
    if src:
        lines.append(
            f"source  role={src.get('role') or '-'} host={src.get('host', '-')} pid={src.get('pid', '-')} "
            f"started={src.get('started', '-')}"
        )
    meta = desc.get("meta") or {}
    if meta:
        keys = ", ".join(sorted(meta))
        lines.append(f"meta    {keys}")
    if not desc["taps"]:
        lines.append("taps    none (nothing was recorded)")
    for tap, info in desc["taps"].items():
        lines.append(f"tap {tap}: {info['rows']} rows from {len(info['writers'])} writer(s)")
        for w in info["writers"]:
            seg = (
                f"{w['segments']} x {w['segment_size']}"
                + (f" [{', '.join(w['segment_labels'])}]" if w["segment_labels"] else "")
                if w["segments"]
                else "segments unknown"
            )
            phases = ", ".join(f"{k} {v}" for k, v in w["phases"].items()) or "-"
            lines.append(
                f"  {w['writer']:<22} rows {w['rows']:>9}  width {w['width']} {w['dtype']}  {seg}"
            )
            lines.append(
                f"  {'':<22} sequences {w['sequences']}  phases {phases}  invalid {w['invalid_rows']}  "
                f"dropped {w['dropped_rows']}  skipped {w['skipped_rows']}  status {w['status']}"
            )
            if w["module"]:
                lines.append(f"  {'':<22} module {w['module']} ({w['capture']})")
            if w.get("labelled_by"):
                lines.append(f"  {'':<22} labelled by {_source_text(w['labelled_by'])}")
            lines += [f"  {'':<22} {line}" for line in switch_lines(w)]
        lines += [f"  {line}" for line in keeping_lines(info)]
    for warning in warnings_for(desc):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
