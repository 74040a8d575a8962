"""Progress of a long command on stderr, stage by stage.

On a terminal: one live line, redrawn in place (stage, a bar when the stage knows its total, rows,
rate, elapsed). Anywhere else (CI logs, a pipe): nothing for a command that ends within a few
seconds, then one short status line every ``interval`` seconds, so a log shows that a long compare is
alive and how far it got, without a line per row block.

The library reports through three callbacks (``stage(name, total)``, ``advance(n)``, ``total(n)``,
and nothing else); this module is the CLI's edge and never decides anything. A command that moves
bytes (``push``) counts them in ``unit="bytes"`` (shown as MiB) and, beside them, the objects they
came in (``items="objects"``: ``advance(n, items=k)``, ``stage(name, total, items_total)``). A ticker thread does the periodic
printing, so a stage that runs one long call (planning) still shows; it never touches the data.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO

#: Seconds between two status lines in a log (and before the first one); TRACEDIFF_PROGRESS_SECONDS sets it.
LOG_INTERVAL = 5.0
#: Seconds between two redraws of the live line on a terminal.
LIVE_INTERVAL = 0.2
BAR_WIDTH = 24


def _rate(n: float, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    return f"{_count(n / seconds)}/s"


def _count(n: float) -> str:
    """``812``, ``81.2k``, ``8.12M`` rows."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _mib(n: float) -> str:
    """Bytes as ``0.4``, ``12.3``, ``1536`` (MiB, the unit written after it)."""
    return f"{n / 2**20:.3g}" if n < 1000 * 2**20 else f"{n / 2**20:.0f}"


class Progress:
    """Prints the progress of one command; use as a context manager.

    ``mode`` is ``"live"`` (a terminal), ``"log"`` (status lines every ``interval`` seconds) or
    ``"off"``; :func:`progress_mode` picks it from the stream and the user's ``--progress`` flag.
    """

    def __init__(self, command: str, mode: str, stream: IO[str] | None = None, *, unit: str = "rows",
                 items: str | None = None, interval: float | None = None) -> None:
        self.command = command
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self.unit = unit
        self.items = items
        if interval is None:
            interval = LIVE_INTERVAL if mode == "live" else _log_interval()
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()
        self._stage = "starting"
        self._stage_start = self._start
        self._total: int | None = None
        self._done = 0
        self._items_total: int | None = None
        self._items_done = 0
        self._printed = False
        self._closed = False
        self._live_width = 0

    # -- the callbacks the library calls
    def stage(self, name: str, total: int | None = None, items_total: int | None = None) -> None:
        """A new stage begins (``total``: how many units it will advance, when known; ``items_total``:
        how many items, for a progress counting both)."""
        with self._lock:
            self._stage, self._total, self._done = name, total, 0
            self._items_total, self._items_done = items_total, 0
            self._stage_start = time.monotonic()
        if self.mode == "live":
            self._draw()

    def advance(self, n: int, items: int = 0) -> None:
        with self._lock:
            self._done += int(n)
            self._items_done += int(items)

    def total(self, n: int) -> None:
        """The current stage's total, when it is known only after the stage began."""
        with self._lock:
            self._total = int(n)

    # -- lifecycle
    def __enter__(self) -> Progress:
        if self.mode != "off":
            self._thread = threading.Thread(target=self._tick, name="tracediff-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(finished=exc_type is None)

    def close(self, finished: bool = True) -> None:
        """Stop the ticker; in a log, a command that printed status lines ends them with ``done in N s``,
        unless it did not finish (``finished=False``: an error or a signal says why, no "done" before it).
        Only the first call counts."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        with self._lock:
            if self.mode == "live" and self._live_width:
                self._write("\r" + " " * self._live_width + "\r")
                self._live_width = 0
            elif self.mode == "log" and self._printed and finished:
                self._write(f"tracediff {self.command}: done in {time.monotonic() - self._start:.0f} s\n")

    # -- drawing
    def status(self) -> str:
        """The current status as one line: stage, rows done (of total), rate, elapsed."""
        with self._lock:
            stage, total, done = self._stage, self._total, self._done
            items_total, items_done = self._items_total, self._items_done
            stage_start = self._stage_start
        now = time.monotonic()
        size, unit = (_mib, "MiB") if self.unit == "bytes" else (_count, self.unit)
        parts = [stage]
        if total:
            parts.append(f"{size(done)} of {size(total)} {unit} ({100.0 * done / total:.0f}%)")
        elif done:
            parts.append(f"{size(done)} {unit}")
        if self.items and items_total:
            parts.append(f"{_count(items_done)} of {_count(items_total)} {self.items}")
        elif self.items and items_done:
            parts.append(f"{_count(items_done)} {self.items}")
        if done:
            seconds = now - stage_start
            parts.append(f"{size(done / seconds)} {unit}/s" if self.unit == "bytes" and seconds > 0
                         else _rate(done, seconds))
        parts.append(f"{now - self._start:.0f} s")
        return ", ".join(parts)

    def _bar(self) -> str:
        with self._lock:
            total, done = self._total, self._done
        if not total:
            return ""
        filled = min(BAR_WIDTH, int(BAR_WIDTH * done / total))
        return "[" + "#" * filled + " " * (BAR_WIDTH - filled) + "] "

    def _draw(self) -> None:
        text = f"{self.command}: {self._bar()}{self.status()}"
        with self._lock:
            pad = max(0, self._live_width - len(text))
            self._write("\r" + text + " " * pad)
            self._live_width = len(text)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            if self.mode == "live":
                self._draw()
            else:
                line = f"tracediff {self.command}: {self.status()}\n"
                with self._lock:
                    self._write(line)
                    self._printed = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not end the command
            self.mode = "off"


def _log_interval() -> float:
    """Seconds between status lines in a log: ``TRACEDIFF_PROGRESS_SECONDS`` or :data:`LOG_INTERVAL`."""
    text = os.environ.get("TRACEDIFF_PROGRESS_SECONDS", "")
    try:
        value = float(text) if text else LOG_INTERVAL
    except ValueError:
        return LOG_INTERVAL
    return value if value > 0 else LOG_INTERVAL


def progress_mode(flag: bool | None, stream: IO[str] | None = None) -> str:
    """``--progress`` / ``--no-progress`` / neither -> ``live``, ``log`` or ``off``: live on a terminal,
    status lines elsewhere, unless turned off."""
    if flag is False:
        return "off"
    stream = stream if stream is not None else sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "live" if tty else "log"
