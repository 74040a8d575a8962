"""Recording switched on and off at runtime, without restarting the host.

The switch half of :class:`tracediff.record.recorder.Recorder` (a mixin: the state it reads is the
Recorder's). Off means: the recorder's hooks return at once (no copy, no label, nothing queued) and
the rows they see are counted as left out on purpose (the ledger's ``skipped`` class, reason
``switched off``), never as lost. Each change is kept with its time and who made it; the writer
thread writes the history into every writer group's attributes with its next commit (``switch``: a
list of ``{time, state, by}``; ``skip_reasons``: ``{"switched off": rows}``).

Who switches: :mod:`tracediff.record.control` (an HTTP endpoint on 127.0.0.1, SIGUSR1 / SIGUSR2,
``record --start-off``) or a script (``rec.switch(False)``). What this module must never do: raise
into a hook, or block one (a flip is one assignment; counting is a few additions under a lock).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tracediff.record.ledger import OFFERED, SWITCHED_OFF
from tracediff.record.parts import TORCH_TO_STORE

log = logging.getLogger("tracediff")

OFF_REASON = "switched off"
_lock = threading.RLock()  # re-entrant: a signal handler may switch while its thread counts


def switch_time() -> str:
    """Now, as the switch history writes it: ISO 8601 in UTC, to the millisecond."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}+0000"


class Switchable:
    """On/off state, its history and its counts; a recorder starts on."""

    off_reason = OFF_REASON  # what an adapter gives count_lost for rows it skipped while off
    _switched_on: bool = True
    _switch_changes: tuple[dict[str, str], ...] = ()
    _started_off_by: str = ""
    _off_rows: dict[str, int] | None = None  # tap -> rows skipped while off
    _switch_closers: tuple[Any, ...] = ()

    @property
    def recording_on(self) -> bool:
        """Whether the recorder is switched on (a closed recorder may still say on: see ``closed``)."""
        return self._switched_on

    def switch(self, on: bool, by: str = "api") -> bool:
        """Switch recording on or off (``by``: who, kept in the history); True when the state changed.
        Never raises; a closed recorder stays as it is."""
        with _lock:
            if self.closed or bool(on) == self._switched_on:  # type: ignore[attr-defined]
                return False
            self._switched_on = bool(on)
            self._switch_changes = (*self._switch_changes,
                                    {"time": switch_time(), "state": "on" if on else "off", "by": str(by)[:80]})
        return True

    def start_off(self, by: str = "--start-off") -> None:
        """Begin switched off (before any row was seen): the history starts with ``off``."""
        with _lock:
            if not self._switch_changes:
                self._switched_on = False
                self._started_off_by = by

    def switch_history(self) -> list[dict[str, str]]:
        """Every state since the recorder started, oldest first: ``[{time, state, by}, ...]``."""
        started = str((self.source or {}).get("started") or "")  # type: ignore[attr-defined]
        first = {"time": started, "state": "off" if self._started_off_by else "on",
                 "by": self._started_off_by or "start"}
        return [first, *self._switch_changes]

    def skips_off(self, tap: Any, tensor: Any) -> bool:
        """True when recording is switched off; the rows of ``tensor`` (or of what a callable returns:
        a hook's input picker) are then counted as skipped for ``tap`` (a name or a tap state).
        Never raises."""
        if self._switched_on:
            return False
        try:
            value = tensor() if callable(tensor) else tensor
            shape = tuple(getattr(value, "shape", ()))
            if shape and shape[-1]:
                name = getattr(tap, "name", tap)
                self.skip_off(name, int(value.numel()) // int(shape[-1]))
                state = self._taps[name]  # type: ignore[attr-defined]
                if state.width is None and value.dtype in TORCH_TO_STORE:
                    # the layout, as a capture learns it: a tap off all along still gets its writer group
                    state.width, state.dtype = int(shape[-1]), TORCH_TO_STORE[value.dtype]
        except Exception:  # noqa: BLE001, S110  (counting is best effort; the host comes first)
            pass
        return True

    def skip_off(self, name: str, rows: int) -> None:
        """Count ``rows`` of tap ``name`` as left out because recording was switched off (an adapter
        that skips a whole call without a tensor to hand calls this). Never raises."""
        try:
            if rows <= 0:
                return
            state = self._taps.get(name) or self.declare(name)  # type: ignore[attr-defined]
            self._account(name, OFFERED, rows)  # type: ignore[attr-defined]
            self._add_skip(state, rows)  # type: ignore[attr-defined]
            self._account(name, SWITCHED_OFF, rows)  # type: ignore[attr-defined]
            with _lock:
                counts = self._off_rows if self._off_rows is not None else {}
                counts[name] = counts.get(name, 0) + rows
                self._off_rows = counts
        except Exception:  # noqa: BLE001, S110
            pass

    def on_switch_close(self, fn: Any) -> None:
        """Call ``fn()`` once the recorder has closed (from the writer thread, after the last commit):
        how a control endpoint takes its file out of the store."""
        with _lock:
            self._switch_closers = (*self._switch_closers, fn)

    def switch_closed(self) -> None:
        for fn in self._switch_closers:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001  (a close must never fail for this)
                log.error("tracediff: closing the recording switch: %s", exc)

    def note_switch(self, writer: Any, tap: str) -> None:
        """Put the switch history and the rows skipped while off into ``writer``'s next commit record
        (writer thread)."""
        writer.note_attr("switch", self.switch_history())
        off = (self._off_rows or {}).get(tap, 0)
        if off:
            writer.note_attr("skip_reasons", {OFF_REASON: off})

    def switch_status(self) -> dict[str, Any]:
        """What ``GET /status`` answers: the state, since when and by whom, and the rows recorded
        (committed), skipped (switched off, sampling limits) and lost, per tap and in all."""
        history = self.switch_history()
        taps: dict[str, dict[str, int]] = {}
        for name, state in list(self._taps.items()):  # type: ignore[attr-defined]
            writer = self._writers.get(name)  # type: ignore[attr-defined]
            taps[name] = {"recorded": int(writer.counts.rows) if writer is not None else 0,
                          "skipped": int(state.skipped_rows), "switched_off": (self._off_rows or {}).get(name, 0),
                          "lost": int(state.dropped_rows)}
        totals = {key: sum(t[key] for t in taps.values()) for key in ("recorded", "skipped", "switched_off", "lost")}
        return {
            "state": "closed" if self.closed else ("on" if self._switched_on else "off"),  # type: ignore[attr-defined]
            "since": history[-1]["time"],
            "by": history[-1]["by"],
            "rows": totals,
            "taps": taps,
            "switch": history,
            "writer": self.writer_name,  # type: ignore[attr-defined]
            "threads": getattr(self, "threads", None),  # where the writer runs (tracediff.record.cores)
            "store": self.location.display,  # type: ignore[attr-defined]
        }


__all__ = ["OFF_REASON", "Switchable", "switch_time"]
