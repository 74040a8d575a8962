"""The writer-thread half of :class:`tracediff.record.recorder.Recorder`: takes captured batches off
the queue, waits for their copies, writes and commits them (a local folder or an object store), counts
what it could not write, and on close or SIGTERM finishes the queue and reports the outcome.

With a ``commit_interval`` the writer works in rounds: it gathers the batches captured within the
interval (or fewer: a host waiting for it, a queue half full, close), then writes each tap's batches of
the round as one append, one commit. A commit costs the same for one row as for a thousand (chunk
files, every array's shape, the commit record): on a server that records one row a request a step,
the commits were the recording's cost (benchmarks/RESULTS.md, ## bench_serve_record)."""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any

import numpy as np
import torch

from tracediff.record.cores import place_this_thread
from tracediff.record.ledger import COMMITTED
from tracediff.record.parts import Batch, DefaultLabels, TapState, one_line
from tracediff.store import (
    PHASES,
    TraceWriter,
)
from tracediff.store.batches import batch_columns
from tracediff.store.remote_writer import (
    RemoteTraceWriter,
)
from tracediff.store.ring import RingWriter

log = logging.getLogger("tracediff")

#: Put on the queue by a host thread that waits for the writer (flush, wait_for_writer): the writer
#: ends its round and writes what it gathered at once.
WAKE = "wake"
#: The longest commit interval (seconds): rows wait in memory that long, and a kill loses them.
MAX_COMMIT_INTERVAL = 60.0


class WriterThread:
    """The writer-thread half of a :class:`~tracediff.record.recorder.Recorder` (a mixin: the state it
    reads is the Recorder's)."""

    threads: dict[str, Any] | None = None  # where the writer runs (tracediff.record.cores), for the store
    _bounded_behind: int | None = None  # the backlog a host bounds with wait_for_writer (its last call)

    def _writer_loop(self) -> None:
        self.threads = place_this_thread("writer")  # off the engine's cores, before any write
        closing = False
        while True:
            if closing:
                # close() was called: a capture that raced it may have queued behind the sentinel.
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            else:
                item = self._queue.get()
            if item is None:
                closing = True
                continue
            if item is WAKE:
                self._wake_queued = False
                continue
            batches = [item]
            if self.commit_interval > 0:
                closing = self._gather(batches) or closing
            self._write_round(batches)
        self._finish()

    def _gather(self, batches: list[Batch]) -> bool:
        """Add to ``batches`` what the queue brings within the commit interval, counted from the first:
        stop early at a host waiting for the writer (:data:`WAKE`), at close (True: the sentinel was
        taken), or at half the queue's batches or bytes (the captures never drop for the rows the
        writer holds) or of the backlog a host bounds with :meth:`wait_for_writer` (it then never
        waits for a round). Once the interval is over, what is queued already still joins the round."""
        deadline = time.monotonic() + self.commit_interval
        most = max(1, min(self._queue.maxsize, self._bounded_behind or self._queue.maxsize) // 2)
        held = batches[0].nbytes
        while len(batches) < most and held < self.max_queue_bytes // 2:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            if item is WAKE:
                self._wake_queued = False
                return False
            batches.append(item)
            held += item.nbytes
        return False

    def _write_round(self, batches: list[Batch]) -> None:
        """Write a round: each tap's batches (in order) as one append, then settle every batch (its
        buffer back to the pool, its bytes off the budget, flush's count)."""
        taps: dict[str, list[Batch]] = {}  # each tap's batches, in the order captured
        for item in batches:
            taps.setdefault(item.tap, []).append(item)
        try:
            for run in taps.values():
                try:
                    if self._writer_error is None:
                        self._write(run)
                    else:
                        for item in run:
                            self._count_drop(item)
                except BaseException as exc:  # noqa: BLE001  (even SystemExit: a dead writer would stall the host)
                    self._writer_error = one_line(exc)
                    self.fail(f"the writer of tap {run[0].tap!r}", exc)
                    for item in run:
                        self._count_drop(item)
        finally:
            for item in batches:
                state = self._taps.get(item.tap)
                if state is not None:
                    state.rows_settled += item.rows
                if item.pooled:
                    self._pool.put(item.data, pinned=item.event is not None)
                self._release(item.nbytes, done=True)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch captured before this call is written and committed (or counted
        as dropped), at most ``timeout`` seconds; True when it is. While the host thread waits here
        the writer thread has the interpreter to itself, so this is also the fastest way through a
        backlog. Never raises; a closed or failed recorder returns at once."""
        if self.closed or not self._thread.is_alive() or self._thread is threading.current_thread():
            return self.closed
        deadline = time.monotonic() + max(float(timeout), 0.0)
        with self._cond:
            target = self._enqueued
            if self._done < target:
                self._wake_writer()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def wait_for_writer(self, behind: int, timeout: float = 10.0) -> bool:
        """Wait until the writer is at most ``behind`` batches behind the captures (queued and not yet
        written), at most ``timeout`` seconds; True when it is. A host that calls this after each step
        bounds what a kill can take (``behind`` batches) without waiting for every write. Never
        raises; a closed or failed recorder returns at once."""
        if self.closed or not self._thread.is_alive() or self._thread is threading.current_thread():
            return self.closed
        self._bounded_behind = max(int(behind), 1)
        deadline = time.monotonic() + max(float(timeout), 0.0)
        with self._cond:
            if self._enqueued - self._done > behind:
                self._wake_writer()
            while self._enqueued - self._done > behind:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def _wake_writer(self) -> None:
        """End the writer's round now (with a commit interval): one :data:`WAKE` on the queue at a time
        (called holding ``_cond``); a full queue needs none, the round ends at half of it."""
        if self.commit_interval <= 0 or self._wake_queued:
            return
        self._wake_queued = True  # before the put: the writer, which clears it, may take the WAKE at once
        try:
            self._queue.put_nowait(WAKE)
        except queue.Full:
            self._wake_queued = False

    def _writer_for(self, item: Batch) -> TraceWriter:
        writer = self._writers.get(item.tap)
        if writer is None:
            state = self._taps[item.tap]
            assert state.width is not None and state.dtype is not None
            writer = self._open_writer(state)
        return writer

    def _open_writer(self, state: TapState, retry_seconds: float | None = None) -> TraceWriter:
        attrs = dict(state.attrs)
        segment_size, segment_labels = self._segment_layout(state)
        row_model = self._row_model(state, segment_size)
        if row_model is not None:
            attrs["row_model"] = row_model
            segment_size = segment_size or int(state.width or 0) // len(row_model["slots"])
        else:
            attrs.pop("row_model", None)
        attrs.update(
            {
                "segment_size": segment_size,
                "segment_labels": segment_labels,
                "rank": self.rank,
                "world_size": self.world_size,
                "source": self.source,
                "meta": self.meta,
                "limits": self.limits.as_dict(),
                "threads": self.threads,
                "phases": list(PHASES),
            }
        )
        common = {"width": int(state.width or 0), "dtype": str(state.dtype), "attrs": attrs,
                  "chunk_rows": self.chunk_rows, "compressor": self.compressor, "durable": self.durable}
        writer: Any
        if self.location.remote:
            retry = self.retry_seconds if retry_seconds is None else retry_seconds
            writer = RemoteTraceWriter(self.location, state.name, self.writer_name, retry_seconds=retry, **common)
            writer.give_up_at = self._give_up_at
        elif self.limits.ring and self.limits.max_bytes:  # --max-bytes SIZE --ring (tracediff.store.ring)
            writer = RingWriter(self.path, state.name, self.writer_name, budget=self.limits.max_bytes,
                                store_wide=self.limits.ring_store, **common)
        else:
            writer = TraceWriter(self.path, state.name, self.writer_name, **common)
        self._writers[state.name] = writer
        if self._ledger is not None:
            self._ledger.set_group(state.name, f"{state.name}/{writer.writer}")
        return writer

    def _row_model(self, state: TapState, segment_size: int | None) -> dict[str, Any] | None:
        """The tap's row model (its own, else the recorder's) if its slots fit the width the tap saw;
        otherwise none, with one warning naming the tap and the field (as for the segment layout)."""
        declared = state.attrs.get("row_model")
        if declared is None and self.row_model is not None:
            declared = self.row_model.to_json()
        if declared is None:
            return None
        width, slots = int(state.width or 0), len(declared["slots"])
        if (width // segment_size if segment_size else (slots if width % slots == 0 else -1)) != slots:
            self._warn_tap(state, "row_model", f"tap {state.name!r}: field row_model names {slots} slots, which do "
                           f"not fit the width {width}; the row model is not stored")
            return None
        return declared

    def _segment_layout(self, state: TapState) -> tuple[int | None, list[str] | None]:
        """The declared segment layout if it fits the width the tap really saw; otherwise none (one
        warning naming the tap and the field): readers refuse a layout that does not fit, and the
        rows are worth more than the layout, which compare can infer."""
        width = int(state.width or 0)
        size, labels = state.segment_size, state.segment_labels
        if size is None and labels and width % len(labels) == 0:
            size = width // len(labels)  # one label a segment: the labels say the segment size
        if size is not None and width % size:
            self._warn_tap(state, "segment_size", f"tap {state.name!r}: field segment_size {size} does not divide "
                           f"the width {width} it records; the rows are stored without a segment layout")
            return None, None
        if labels is not None:
            segments = width // size if size is not None else len(labels)
            if size is None and (not labels or width % len(labels)):
                segments = -1
            if segments != len(labels):
                self._warn_tap(state, "segment_labels", f"tap {state.name!r}: field segment_labels names "
                               f"{len(labels)} segments, which do not fit the width {width}; the labels are not stored")
                return size, None
        return size, labels

    def _write(self, run: list[Batch]) -> None:
        """One append of a tap's batches (one commit). Each batch's labels are checked against its own
        rows first (:func:`batch_columns`: two wrong batches must not add up to a right length)."""
        writer = self._writer_for(run[0])
        arrays, columns = [], []
        for item in run:
            if item.event is not None:
                item.event.synchronize()
            values = item.values
            bf16 = values.dtype == torch.bfloat16
            arrays.append(values.view(torch.int16).numpy().view(np.uint16) if bf16 else values.numpy())
            labels = {
                k: (v.numpy() if isinstance(v, torch.Tensor) else v.array() if isinstance(v, DefaultLabels) else v)
                for k, v in item.labels.items()
            }
            seq = labels.get("seq")
            if seq is not None and np.asarray(seq).dtype.kind in "OUS":
                labels["seq"] = np.array([writer.seq_id(k) for k in np.asarray(seq).reshape(-1)], dtype=np.int64)
            rows = arrays[-1].shape[0]
            columns.append({k: (np.broadcast_to(np.asarray(v), (rows,)) if np.ndim(v) == 0 else v)
                            for k, v in labels.items()})
        if len(run) == 1:
            array, labels = arrays[0], columns[0]
        else:
            state = self._taps[run[0].tap]
            width, dtype = int(state.width or 0), str(state.dtype)
            columns = [batch_columns(a, c, state.name, width, dtype) for a, c in zip(arrays, columns, strict=True)]
            array = np.concatenate(arrays)
            labels = {k: np.concatenate([c[k] for c in columns]) for k in columns[0]}
        self._sync_counts(writer, run[0].tap)
        self._check_rows(run[0].tap, writer, array, labels.get("position"))
        writer.append(array, labels)
        self._account(run[0].tap, COMMITTED, int(array.shape[0]))

    def _check_rows(self, tap: str, writer: TraceWriter, array: np.ndarray, position: Any = None) -> None:
        """The light lint (:mod:`tracediff.lint.light`): all-zero rows per segment, counted as the
        batches are written, kept in the writer group's ``row_checks`` (committed with the batch).
        Rows at the positions a tap's ``zeroed_slots`` attribute declares the engine zeroes (vLLM's
        MTP embedding at position 0) are its design, not a slot left unfilled: not counted."""
        from tracediff.lint.light import zero_rows  # noqa: PLC0415

        size = self._taps[tap].segment_size or (self._segment_layout(self._taps[tap])[0])
        declared = self._taps[tap].attrs.get("zeroed_slots")
        positions = [p for d in declared or [] if isinstance(d, dict) for p in d.get("positions") or []]
        if positions and position is not None and np.shape(position) == (array.shape[0],):
            array = array[~np.isin(np.asarray(position), positions)]
        counts = zero_rows(array, size)
        checks = self._row_checks.setdefault(tap, {"rows": 0, "zero_rows": [0] * len(counts)})
        if len(checks["zero_rows"]) != len(counts):
            return
        checks["rows"] += int(array.shape[0])
        checks["zero_rows"] = [a + b for a, b in zip(checks["zero_rows"], counts, strict=True)]
        writer.note_attr("row_checks", checks)

    def _sync_counts(self, writer: TraceWriter, tap: str) -> None:
        state = self._taps[tap]
        writer.counts.dropped_rows = state.dropped_rows
        writer.counts.dropped_batches = state.dropped_batches
        writer.counts.drop_reason = state.drop_reason if state.dropped_rows else ""
        writer.counts.skipped_rows = state.skipped_rows
        writer.counts.skipped_batches = state.skipped_batches
        self.note_switch(writer, tap)  # the on/off history and the rows skipped while off (switch.py)

    def _count_drop(self, item: Batch) -> None:
        state = self._taps.get(item.tap)
        if state is not None:
            self._note_drop_reason(state, f"the writer stopped: {self._writer_error or self.error}")
            self._add_drop(state, item.rows)

    def _finish(self) -> None:
        """Final commit of every group, with drop counts; taps that only dropped still get a group."""
        for name, state in self._taps.items():
            if name in self._writers or state.width is None:
                continue
            if state.dropped_rows or state.skipped_rows or state.error:
                try:
                    # One try (no retry round at close): where the writer failed, the store is
                    # likely out of reach, and the error was said when it happened.
                    self._open_writer(state, retry_seconds=0.0)
                except Exception as exc:  # noqa: BLE001
                    self._close_errors[name] = one_line(exc)
                    if not (state.error or self.error):  # else said below, with the count
                        log.error("tracediff: cannot record the drop counts of tap %r: %s", name, exc)
        for name, writer in self._writers.items():
            try:
                self._sync_counts(writer, name)
                error = self._taps[name].error or self.error
                writer.close(status="failed" if error else "closed", error=error or "")
            except Exception as exc:  # noqa: BLE001
                self._close_errors[name] = one_line(exc)
                if not (self._taps[name].error or self.error):  # else said below, with the count
                    log.error("tracediff: closing %s/%s: %s (committed rows stay readable)", self.path, name, exc)
        self._log_losses()
        self.switch_closed()  # the switch's endpoint leaves the store (control.py)
        self._report()

    def _log_losses(self) -> None:
        """After an error stopped recording (logged once, when it happened) and the store could not
        be reached for the final commit record either (so the store cannot say it): one line per tap
        with what it cost, rows committed and rows lost (a warning: the error was the one error)."""
        for name, info in self.outcome()["taps"].items():
            close_error = self._close_errors.get(name)
            if not close_error or not (self._taps[name].error or self.error):
                continue
            log.warning("tracediff: %s/%s: %d rows committed, %d rows lost after the error; the final commit "
                        "record could not be written either (%s)", self.location.display, info["group"] or name,
                        info["rows"], info["dropped_rows"], close_error)

    def _report(self) -> None:
        """Call ``on_close`` once, whichever thread gets here first (the writer when it is done, or
        close() when it stopped waiting for it); what it raises is logged, never raised."""
        with self._state_lock:
            if self._reported or self._on_close is None:
                return
            self._reported = True
        try:
            self._on_close(self)
        except Exception as exc:  # noqa: BLE001  (a report must never break the host's exit)
            log.error("tracediff: reporting the recording's outcome failed: %s", one_line(exc))

    # ------------------------------------------------------------------ SIGTERM
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            prev = signal.getsignal(signal.SIGTERM)
            if prev is None:
                return  # installed from C; leave it alone
            self._prev_sigterm = prev
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):
            self._prev_sigterm = None

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_sigterm)
        except (ValueError, OSError):
            pass
        self._prev_sigterm = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        prev = self._prev_sigterm
        self.close(timeout=30.0)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
