"""A recorder's row accounting that survives the death of its process.

A process recorded by ``tracediff record -- CMD`` can end without closing its recorder: vLLM
SIGKILLs its worker at shutdown, a trainer is killed by its scheduler. The rows its writer had not
committed by then are gone, and so is the process that could have counted them. So every injected
recorder keeps, per tap, four running counts in a small file mapped into its memory (``MAP_SHARED``:
what the process wrote to it stays in the file whatever ends the process):

``offered``
    rows that reached the recorder (a capture of a tap with rows of its layout, or a capture that a
    stopped tap or recorder could not take);
``committed``
    rows the writer thread committed to the store;
``dropped``
    rows counted as lost (the queue was full, a writer or hook error, a timeout);
``skipped``
    rows left out on purpose (``--every-n-steps``, ``--first-n-steps``, ``--phases``, ``--max-rows``,
    sampling, switched off);
``switched_off``
    the part of ``skipped`` seen while recording was switched off (a process that was off all along
    and then killed leaves no writer group to say it: this says it).

After the command, ``tracediff record`` reads them back (:func:`read_ledger`) with the store's own
commit records: ``offered - skipped - committed - dropped`` rows were still queued when the process
ended (lost, uncounted by the process itself). Each ledger is two files in the report folder,
``<pid>-ledger<n>.json`` (which tap is which slot, its writer group and why it first dropped rows:
written when one of those is new) and ``<pid>-ledger<n>.bin`` (the counts, int64 in the machine's byte order).

What this module must never do: raise into the recorder's host (a failure turns the ledger off,
logged once), or do I/O on a capture beyond the first of a new tap (a count is a memory write).
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("tracediff")

FIELDS = ("offered", "committed", "dropped", "skipped", "switched_off")
OFFERED, COMMITTED, DROPPED, SKIPPED, SWITCHED_OFF = range(len(FIELDS))
SLOTS = 256  # taps per recorder; a tap past them is not accounted (logged once)
_serial = itertools.count(1)


class Ledger:
    """The counts of one recorder, in ``folder``; see the module docstring."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.pid = os.getpid()
        stem = Path(folder) / f"{self.pid}-ledger{next(_serial)}"
        self.header_path, self.bin_path = stem.with_suffix(".json"), stem.with_suffix(".bin")
        self.taps: dict[str, int] = {}
        self.groups: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.failed = False
        self._lock = threading.Lock()
        size = SLOTS * len(FIELDS) * 8
        with open(self.bin_path, "w+b") as fh:
            fh.truncate(size)
            self._map = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_WRITE)
        self._counts = memoryview(self._map).cast("q")
        self._write_header()

    def add(self, tap: str, field: int, rows: int) -> None:
        """Add ``rows`` to ``field`` of ``tap``. Never raises."""
        if self.failed or rows <= 0:
            return
        slot = self.taps.get(tap)
        if slot is None:
            slot = self._new_tap(tap)
            if slot is None:
                return
        with self._lock:
            self._counts[slot * len(FIELDS) + field] += rows

    def set_group(self, tap: str, group: str) -> None:
        """The writer group ``tap``'s rows go to (``fc_in/pid123``), once it exists."""
        if self.failed or self.groups.get(tap) == group:
            return
        if tap not in self.taps and self._new_tap(tap) is None:
            return
        with self._lock:
            self.groups[tap] = group
            self._write_header()

    def set_reason(self, tap: str, why: str) -> None:
        """Why ``tap`` first dropped rows (the queue was full, an adapter could not label them)."""
        if self.failed or tap in self.reasons:
            return
        if tap not in self.taps and self._new_tap(tap) is None:
            return
        with self._lock:
            self.reasons[tap] = why
            self._write_header()

    def _new_tap(self, tap: str) -> int | None:
        with self._lock:
            if tap in self.taps:
                return self.taps[tap]
            if len(self.taps) >= SLOTS:
                self._fail(f"more than {SLOTS} taps")
                return None
            self.taps[tap] = len(self.taps)
            self._write_header()
            return self.taps[tap]

    def _write_header(self) -> None:
        note = {"pid": self.pid, "executable": sys.executable, "bin": self.bin_path.name, "fields": list(FIELDS),
                "taps": dict(self.taps), "groups": dict(self.groups), "reasons": dict(self.reasons)}
        tmp = self.header_path.with_name(self.header_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(note))
            os.replace(tmp, self.header_path)
        except OSError as exc:
            self._fail(str(exc))

    def _fail(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            log.error("tracediff: row accounting off in pid %d (%s): a loss after this is not counted", self.pid, why)


def read_ledger(header: dict[str, Any], folder: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The counts a ledger header (its JSON, as read back) points at: ``{tap: {field: rows, "group":
    group or None}}``; empty when its counts file is missing or short."""
    try:
        data = (Path(folder) / str(header["bin"])).read_bytes()
        fields = list(header.get("fields") or FIELDS)
        counts = memoryview(data).cast("q")
        out: dict[str, dict[str, Any]] = {}
        for tap, slot in (header.get("taps") or {}).items():
            base = int(slot) * len(fields)
            row: dict[str, Any] = {name: int(counts[base + i]) for i, name in enumerate(fields)}
            row["group"] = (header.get("groups") or {}).get(tap)
            row["reason"] = (header.get("reasons") or {}).get(tap, "")
            out[str(tap)] = row
        return out
    except (OSError, KeyError, TypeError, ValueError, IndexError):
        return {}
