"""A ring of writer groups: ``--max-bytes SIZE --ring`` keeps the most recent rows of one (tap,
process) within SIZE bytes on disk, dropping the oldest rows a whole segment at a time.

:class:`RingWriter` stands where a :class:`~tracediff.store.writer.TraceWriter` would (the recorder's
writer thread calls the same methods). It writes a sequence of ordinary writer groups, its
*segments*: ``<writer>`` first, then ``<writer>_r000001``, ``<writer>_r000002``... (zero-padded so
that the sorted order readers use is the order they were written in), each of about SIZE / 5 bytes.
Before a batch is appended, the oldest closed segments are dropped while the segments on disk plus
the batch would exceed SIZE. A segment is dropped in two steps: its ``zarr.json`` is deleted (one
unlink: from then on it is no zarr node, and readers that list the store skip it), and its files
are deleted at the next rotation (sooner when their room is needed), so that a reader that opened
the store just before still finds the chunks it was told about. Every commit of every segment follows the store's commit protocol, so the
store is valid for ``compare`` / ``inspect`` at any moment, and never holds part of a dropped batch.

Each segment carries a ``ring`` attribute (docs/format.md, "Ring stores"): the ring's writer name,
its segment number, the budget, and what the ring has dropped so far (rows, batches, bytes,
segments; the newest segment's numbers are the totals). The commit counts ``dropped_*`` and
``skipped_*`` of the recorder are kept by the newest segment only (a segment closed by a rotation
records zero), so that summing them over a tap's writer groups counts each row once.

``--ring-store`` (``store_wide``): SIZE is the whole store's budget, shared by every process and tap
recording into it. Segments are then SIZE / 20, and after each rotation the process measures the
store on disk and drops its own oldest segments (at once) while the store would exceed SIZE; it can
exceed SIZE by the segments being written (one per process and tap) and by what processes that have
not rotated since hold.

Local folders only (the writer thread's own; never raises past :class:`StoreWriteError`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.store.batches import WriterCounts
from tracediff.store.format import LABEL_DTYPES, VALUE_DTYPES
from tracediff.store.writer import TraceWriter

#: A ring rotates to a new segment once the current one holds this share of the budget (1 / 5: four
#: segments of rows, and room for a dropped one whose files wait for deletion).
SEGMENTS = 5
#: With ``--ring-store`` (one budget for the whole store): segments of 1 / 20 of it.
STORE_SEGMENTS = 20
CHUNKS_PER_SEGMENT = 8
_LABEL_BYTES = sum(dtype.itemsize for dtype in LABEL_DTYPES.values())
_COUNT_FIELDS = ("dropped_rows", "dropped_batches", "skipped_rows", "skipped_batches", "drop_reason")


def segment_name(base: str, index: int) -> str:
    """The writer group of segment ``index`` of the ring whose first group is ``base``."""
    return base if index == 0 else f"{base}_r{index:06d}"


class _RingCounts:
    """What the recorder reads and sets as ``writer.counts``: ``rows`` / ``batches`` / ``bytes`` are
    the ring's totals (every row the process committed, the dropped ones included: what its row
    ledger counts); the recorder's dropped / skipped counts go to the newest segment."""

    def __init__(self, ring: RingWriter) -> None:
        object.__setattr__(self, "_ring", ring)

    def __getattr__(self, name: str) -> Any:
        ring = object.__getattribute__(self, "_ring")
        if name in ("rows", "batches", "bytes"):
            return getattr(ring.totals, name)
        return getattr(ring.current.counts, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_ring").current.counts, name, value)

    def as_dict(self) -> dict[str, Any]:
        ring = object.__getattribute__(self, "_ring")
        return {**ring.current.counts.as_dict(), **{k: getattr(ring.totals, k) for k in ("rows", "batches", "bytes")}}


class RingWriter:
    """The most recent rows of one (tap, process) within ``budget`` bytes (see the module docstring).
    ``chunk_rows`` is lowered to at most an eighth of a segment (a chunk is written whole)."""

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        tap: str,
        writer: str,
        *,
        budget: int,
        width: int,
        dtype: str,
        attrs: Mapping[str, Any] | None = None,
        chunk_rows: int = 1024,
        compressor: str = "none",
        durable: bool = False,
        store_wide: bool = False,
    ) -> None:
        self.store_path = Path(store_path)
        self.tap = tap
        self.budget = int(budget)
        # --ring-store: the budget is the whole store's, so segments are smaller (every process and
        # tap writes one at a time, beyond what the others can drop).
        self.store_wide = bool(store_wide)
        self.segment_budget = max(1, self.budget // (STORE_SEGMENTS if self.store_wide else SEGMENTS))
        self._share_pending = False  # store_wide: a rotation since the store's size was last measured
        row_bytes = int(width) * VALUE_DTYPES[dtype].itemsize if dtype in VALUE_DTYPES else int(width)
        self.row_bytes = row_bytes
        # A chunk is written whole (a partial one padded): at most an eighth of a segment, so that
        # padding never holds more than that of the budget.
        self.chunk_rows = max(1, min(int(chunk_rows), self.segment_budget // CHUNKS_PER_SEGMENT // max(row_bytes, 1)))
        self._make = {"width": width, "dtype": dtype, "chunk_rows": self.chunk_rows, "compressor": compressor,
                      "durable": durable}
        self._attrs = dict(attrs or {})
        self.totals = WriterCounts()
        self.dropped = {"rows": 0, "batches": 0, "bytes": 0, "segments": 0}
        self.closed: list[tuple[str, int, int, int]] = []  # (group, bytes on disk, rows, batches), oldest first
        # A dropped segment whose files wait for deletion (until the next rotation, or until its
        # room is needed): a reader that opened the store just before its drop can still read it.
        self._lingering: tuple[Path | None, int] = (None, 0)
        self._ahead_of_lingering = 0  # rotations since the lingering segment was dropped
        self.index = 0
        self.current = TraceWriter(self.store_path, tap, writer, attrs=self._segment_attrs(), **self._make)
        self.writer = self.current.writer  # the ring's name: its first group (what the ledger reports)
        self.counts = _RingCounts(self)

    # -- what the recorder's writer thread calls, as on a TraceWriter ------------------------------
    @property
    def status(self) -> str:
        return self.current.status

    @property
    def error(self) -> str:
        return self.current.error

    def note_attr(self, name: str, value: Any) -> None:
        self._attrs[name] = value
        self.current.note_attr(name, value)

    def seq_id(self, key: Any) -> int:
        # The segment the batch will go to names its sequences: a rotation comes first.
        self._rotate_when_full()
        return self.current.seq_id(key)

    def append(self, values: np.ndarray, labels: Mapping[str, np.ndarray]) -> None:
        rows = int(values.shape[0])
        if rows == 0:
            return
        self._rotate_when_full()
        self._make_room(rows)
        if self._share_pending:
            self._share_store(rows)
        self.current.note_attr("ring", self._ring_attr())
        self.current.append(values, labels)
        self.totals.rows += rows
        self.totals.batches += 1
        self.totals.bytes += int(values.nbytes)

    def close(self, status: str = "closed", error: str = "") -> None:
        self.current.note_attr("ring", self._ring_attr())
        self.current.close(status=status, error=error)
        if self._lingering[0] is not None:
            self._delete_lingering()

    # -- the ring ------------------------------------------------------------------------------
    def on_disk(self) -> int:
        """Bytes the ring's live segments hold (closed ones measured, the current one estimated)."""
        return sum(c[1] for c in self.closed) + self._current_bytes(0)

    def _current_bytes(self, extra_rows: int) -> int:
        """The current segment's bytes once ``extra_rows`` more rows are written: whole value chunks
        (a partial last chunk is written padded), the labels, and metadata."""
        rows = self.current.counts.rows + extra_rows
        chunks = -(-rows // self.chunk_rows)
        return chunks * self.chunk_rows * self.row_bytes + rows * _LABEL_BYTES + 16384

    def _segment_attrs(self) -> dict[str, Any]:
        return {**self._attrs, "ring": self._ring_attr()}

    def _ring_attr(self) -> dict[str, Any]:
        return {"writer": getattr(self, "writer", None), "segment": self.index, "budget_bytes": self.budget,
                "segment_bytes": self.segment_budget, **({"store_wide": True} if self.store_wide else {}),
                **{f"dropped_{k}": v for k, v in self.dropped.items()}}

    def _rotate_when_full(self) -> None:
        if self.current.counts.rows and self._current_bytes(0) >= self.segment_budget:
            self._rotate()

    def _rotate(self) -> None:
        """Close the current segment (its recorder counts moved on to the next) and open the next."""
        old = self.current
        carried = {k: getattr(old.counts, k) for k in _COUNT_FIELDS}
        for k in _COUNT_FIELDS:
            setattr(old.counts, k, "" if k == "drop_reason" else 0)
        if "skip_reasons" in self._attrs:  # a breakdown of skipped_rows: it moves on with them
            old.note_attr("skip_reasons", {})
        old.note_attr("ring", self._ring_attr())
        old.close(status="closed")
        self.closed.append((old.writer, _folder_bytes(self.store_path / self.tap / old.writer), old.counts.rows,
                            old.counts.batches))
        self.index += 1
        self._ahead_of_lingering += 1
        self._share_pending = self.store_wide
        self.current = TraceWriter(self.store_path, self.tap, segment_name(self.writer, self.index),
                                   attrs=self._segment_attrs(), **self._make)
        for k, v in carried.items():
            setattr(self.current.counts, k, v)

    def _make_room(self, rows: int) -> None:
        """Drop the oldest closed segments while the ring with ``rows`` more would exceed the budget
        (a dropped segment whose files still wait for deletion counts too, and goes first)."""
        while sum(c[1] for c in self.closed) + self._lingering[1] + self._current_bytes(rows) > self.budget:
            if self._lingering[0] is not None:
                self._delete_lingering()
            elif self.closed:
                group, size, seg_rows, batches = self.closed.pop(0)
                folder = self.store_path / self.tap / group
                with contextlib.suppress(FileNotFoundError):
                    (folder / "zarr.json").unlink()  # no node from now on (the one step a reader sees)
                self._lingering = (folder, size)
                self._ahead_of_lingering = 0
                self._count_drop(seg_rows, batches)
            else:
                break
        if self._lingering[0] is not None and self._ahead_of_lingering >= 1:
            self._delete_lingering()

    def _share_store(self, rows: int) -> None:
        """``--ring-store``, after a rotation: drop this process's own oldest segments (at once, no
        grace) while the whole store (every process and tap, as measured on disk now) plus ``rows``
        more would exceed the budget. Each process can only drop its own: one that writes little
        keeps its rows until it rotates."""
        self._share_pending = False
        if self._lingering[0] is not None:
            self._delete_lingering()
        extra = self._current_bytes(rows) - self._current_bytes(0)
        total = _folder_bytes(self.store_path) + extra
        while total > self.budget and self.closed:
            group, size, seg_rows, batches = self.closed.pop(0)
            folder = self.store_path / self.tap / group
            with contextlib.suppress(FileNotFoundError):
                (folder / "zarr.json").unlink()
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            self._count_drop(seg_rows, batches)

    def _count_drop(self, rows: int, batches: int) -> None:
        self.dropped["rows"] += rows
        self.dropped["batches"] += batches
        self.dropped["bytes"] += rows * self.row_bytes
        self.dropped["segments"] += 1

    def _delete_lingering(self) -> None:
        shutil.rmtree(self._lingering[0], ignore_errors=True)  # type: ignore[arg-type]
        self._lingering = (None, 0)


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def ring_of(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """A writer group's ``ring`` attribute when it is one (a segment of a ring), else None."""
    ring = attrs.get("ring")
    return ring if isinstance(ring, dict) and isinstance(ring.get("writer"), str) else None


def ring_summary(writers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ring (its first group's name) among a tap's described writer groups (``describe_stream``
    dicts carrying ``ring``): ``segments`` (the live groups), ``rows`` they hold, and what the ring
    dropped (``dropped_rows`` / ``_batches`` / ``_bytes`` / ``_segments``: the newest segment's)."""
    out: dict[str, dict[str, Any]] = {}
    for w in writers:
        ring = w.get("ring")
        if not isinstance(ring, dict) or not isinstance(ring.get("writer"), str):
            continue
        entry = out.setdefault(ring["writer"], {"segments": [], "rows": 0, "newest": -1, "budget_bytes":
                                                 ring.get("budget_bytes")})
        entry["segments"].append(w["writer"])
        entry["rows"] += int(w.get("rows") or 0)
        if int(ring.get("segment") or 0) > entry["newest"]:
            entry["newest"] = int(ring.get("segment") or 0)
            for k in ("rows", "batches", "bytes", "segments"):
                entry[f"dropped_{k}"] = int(ring.get(f"dropped_{k}") or 0)
    return out


def committed_rows(desc: dict[str, Any]) -> dict[str, int]:
    """The rows each writer (``tap/writer``) committed, from a described store (``describe_store``):
    a group's ``commit.rows``, and for a ring (keyed by its first group, as the process's row ledger
    names it) its live segments' rows plus the rows it dropped."""
    out: dict[str, int] = {}
    for tap, info in desc["taps"].items():
        for w in info["writers"]:
            if not isinstance(w.get("ring"), dict):
                out[f"{tap}/{w['writer']}"] = int(w["rows"])
        for name, ring in (info.get("rings") or ring_summary(info["writers"])).items():
            out[f"{tap}/{name}"] = int(ring["rows"]) + int(ring.get("dropped_rows") or 0)
    return out
