"""The recorder: runs inside someone else's training step or server forward and captures rows.

Path of a captured tensor::

    forward hook ──> Recorder.capture ──> one copy off the forward path ──> bounded queue
        (host thread: clone on CPU, async copy into a pinned buffer on CUDA; nothing else)
    writer thread ──> waits for the copy ──> numpy ──> TraceWriter.append (chunks, then commit)

What this module must never do to its host: raise out of a hook, block a forward for longer than
``block_timeout`` seconds, hold more than ``max_queue_bytes`` of copies, or change a tensor the host
uses. An exception in a tap's hook (picking its tensor, its label provider, its labels) is logged
once and stops that tap; one in the writer (a full disk) stops the whole recorder. Either way the
reason goes into the store, rows that could not be written are counted as dropped, committed rows
stay readable, and the host goes on.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from tracediff.errors import StoreExistsError, UsageError
from tracediff.record.ledger import DROPPED, OFFERED, SKIPPED, Ledger
from tracediff.record.limits import Limits
from tracediff.store import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    LABEL_FIELDS,
    TraceWriter,
    create_store,
    default_source,
    phase_code,
)
from tracediff.store.location import Location
from tracediff.store.previous import PreviousStore
from tracediff.store.remote_writer import (
    DEFAULT_RETRY_SECONDS,
    RemoteTraceWriter,
    default_writer_name,
    store_exists,
)
from tracediff.store.row_model import RowModel
from tracediff.store.row_model import from_json as row_model_from_json

log = logging.getLogger("tracediff")

from tracediff.record.capture import CapturePath  # noqa: E402
from tracediff.record.parts import (  # noqa: E402
    LABEL_KEYS,
    Batch,
    HostPool,
    LabelProvider,
    TapState,
    input_slot,
    one_line,
    pick_input,
    pick_output,
)
from tracediff.record.switch import Switchable  # noqa: E402
from tracediff.record.writing import MAX_COMMIT_INTERVAL, WriterThread  # noqa: E402

_active: list[weakref.ReferenceType[Recorder]] = []
_active_lock = threading.Lock()


def active_recorder() -> Recorder | None:
    """The most recently started recorder of this process that is still open."""
    with _active_lock:
        for ref in reversed(_active):
            rec = ref()
            if rec is not None and not rec.closed:
                return rec
    return None


def _close_all_at_exit() -> None:
    with _active_lock:
        recs = [ref() for ref in _active]
    for rec in recs:
        if rec is not None and not rec.closed:
            rec.close()


def _register_exit_hook() -> None:
    """Close recorders at interpreter exit *before* thread pools shut down.

    zarr does its I/O on a thread pool; ``concurrent.futures`` refuses new work once the
    interpreter's threading shutdown has begun, which happens before ``atexit`` callbacks run. So
    our close goes through ``threading._register_atexit``, registered after the pool's own hook
    (those run in reverse order). ``atexit`` stays as the fallback for Pythons without it.
    """
    import concurrent.futures.thread  # noqa: F401, PLC0415  (its exit hook must be registered first)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_close_all_at_exit)
            return
        except RuntimeError:  # already shutting down
            pass
    atexit.register(_close_all_at_exit)


_register_exit_hook()


class Recorder(CapturePath, WriterThread, Switchable):
    """Records tapped tensors of this process into a trace store.

    Use as a context manager (``with tracediff.record(path) as rec:``) or call :meth:`close`.
    ``path`` may be an fsspec URL (``s3://bucket/train.zarr``, with ``storage_options`` for fsspec):
    the same commit protocol, written as objects (see ``docs/remote.md``).
    ``append=True`` adds this process's groups to an existing store (how `tracediff record -- CMD`
    children write); otherwise the store is created, refusing an existing path unless ``overwrite``.
    ``on_close(recorder)`` is called once every group is closed, from the writer thread (how an
    injected recorder tells `tracediff record` what :meth:`outcome` it had); what it raises is logged.
    If the writer has not finished when :meth:`close` times out (a store out of reach), it is called
    from the closing thread instead, with the rows still queued counted as lost.
    ``retry_seconds`` (a store at a URL): how long a batch whose upload failed on the way (endpoint
    unreachable, connection reset, timeout) is sent again before the writer stops for good.
    ``max_queue_batches``: the most batches queued at once (default: one per 256 KiB of
    ``max_queue_bytes``, 64 to 4096).
    ``draft_chain``: the trainer adapters tap the draft's whole forward, in order (fc output, decoder
    layer input and output, final norm, the logits' top k), each step labelled (docs/draft-chain.md).
    ``commit_interval``: seconds the writer gathers a tap's batches before writing them as one commit
    (0: one commit a batch); :meth:`flush`, a host waiting in :meth:`wait_for_writer`, a queue half full
    and close write at once. Fewer, larger commits cost the host less; a SIGKILL loses that much more.
    ``ledger``: where to keep this recorder's row counts so that they outlive a SIGKILL (how
    `tracediff record` learns what a killed process lost; :mod:`tracediff.record.ledger`).
    """

    unsampled_reason = "request not sampled"  # what an adapter gives count_lost for rows sampling left out

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        role: str = "",
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        append: bool = False,
        writer_name: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        limits: Limits | None = None,
        on_full: str = "drop",
        block_timeout: float = 10.0,
        max_queue_bytes: int = 1 << 30,
        max_queue_batches: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        compressor: str = DEFAULT_COMPRESSOR,
        durable: bool = False,
        framework: str = "",
        framework_version: str = "",
        adapter: str | None = None,
        handle_sigterm: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        on_close: Callable[[Recorder], None] | None = None,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        ledger: Ledger | None = None,
        row_model: RowModel | Mapping[str, Any] | None = None,
        draft_chain: bool = False,
        commit_interval: float = 0.0,
    ) -> None:
        if on_full not in ("drop", "block"):
            raise UsageError(f"on_full must be 'drop' or 'block', got {on_full!r}")
        if max_queue_batches is None:
            # Bytes are the budget; the batch count only bounds what the bytes do not count (a
            # batch's labels): one batch a 256 KiB of budget, 64 to 4096. A fixed 64 was hit first
            # by a server's many small batches (a step's draft rows), long before the bytes.
            max_queue_batches = max(64, min(4096, int(max_queue_bytes) >> 18))
        if max_queue_bytes <= 0 or max_queue_batches <= 0:
            raise UsageError("max_queue_bytes and max_queue_batches must be positive")
        if not retry_seconds >= 0:
            raise UsageError(f"retry_seconds must be 0 or more, got {retry_seconds!r}")
        if not 0 <= commit_interval <= MAX_COMMIT_INTERVAL:
            raise UsageError(f"commit_interval must be 0 to {MAX_COMMIT_INTERVAL:g} seconds, got {commit_interval!r}")
        # A folder, or an fsspec URL (s3://...) written through zarr's FsspecStore.
        self.location = Location.of(path, None if storage_options is None else dict(storage_options))
        self.path: Any = self.location if self.location.remote else Path(self.location.local)
        self.role = role
        # The row model of taps that declare none (record --row-model); checked before any I/O.
        self.row_model: RowModel | None = None if row_model is None else row_model_from_json(row_model)
        # record --draft-chain: the trainer adapters also tap the draft's forward in order (docs/draft-chain.md).
        self.draft_chain = bool(draft_chain)
        self.limits = limits or Limits()
        self.on_full = on_full
        self.block_timeout = float(block_timeout)
        self.max_queue_bytes = int(max_queue_bytes)
        self.chunk_rows = chunk_rows
        self.compressor = compressor
        self.durable = durable
        self.commit_interval = float(commit_interval)  # the writer's rounds (writing.py); 0: a commit a batch
        self.rank = rank
        self.world_size = world_size
        self.meta: dict[str, Any] = dict(meta or {})
        self.source = default_source(role, framework, framework_version)
        if adapter:
            self.source["adapter"] = adapter
        self.enabled = True
        self.closed = False
        self.explicit_labels = False  # labels() called without labelled_by (see labels())
        self.error: str | None = None
        self._taps: dict[str, TapState] = {}
        self._handles: list[Any] = []
        self._writers: dict[str, TraceWriter] = {}
        self._row_checks: dict[str, dict[str, Any]] = {}  # tap -> the light lint of its rows (writing.py)
        self._queue: queue.Queue[Batch | str | None] = queue.Queue(maxsize=max_queue_batches)  # str: writing.WAKE
        self._wake_queued = False  # a WAKE on the queue (writing.py)
        self._queued_bytes = 0
        self._enqueued = 0  # batches put on the queue / taken off it and written (or dropped): flush()
        self._done = 0
        self._cond = threading.Condition()
        self._tls = threading.local()
        self._label_generation = 0
        self._explicit_step: int | None = None
        self._pool = HostPool(max_bytes=min(1 << 30, self.max_queue_bytes))
        self._logged_once: set[str] = set()
        self._writer_error: str | None = None
        self._state_lock = threading.Lock()  # drop counts: host threads and the writer add to them
        self._close_lock = threading.RLock()  # re-entrant: SIGTERM may arrive while close() runs
        self._on_close = on_close
        self._reported = False  # on_close called (once: by the writer, or by close() on a timeout)
        self._unfinished: dict[str, int] = {}  # tap -> rows still queued when close() gave up waiting
        self._close_errors: dict[str, str] = {}  # tap -> why its final commit failed
        self.retry_seconds = float(retry_seconds)
        self._ledger = ledger
        self._give_up_at: float | None = None  # set by close(): no upload retry starts after it
        self._previous: PreviousStore | None = None  # a local store overwrite=True replaces

        # (the processes of `tracediff record` append to the store it created: the message says both)
        no_store = f"{self.path}: no trace store there to append to (append=True, or record's --append, adds to one)"
        if self.location.remote:
            if append:
                if not store_exists(self.location):
                    raise UsageError(no_store)
            else:
                create_store(self.location, role=role, meta=self.meta, source=self.source, overwrite=overwrite)
        elif append:
            if not (self.path / "zarr.json").is_file():
                raise UsageError(no_store)
        else:
            if self.path.exists() and not overwrite:
                raise StoreExistsError(f"{self.path}: already exists; pass overwrite=True (--overwrite) to replace it")
            # The old rows stay on disk (at PATH.previous) until this run has committed a row.
            self._previous = PreviousStore.set_aside(self.path) if overwrite else None
            create_store(self.path, role=role, meta=self.meta, source=self.source, overwrite=overwrite)
            if self._previous is not None:
                log.warning("tracediff: moved the previous store to %s: it is deleted once this run commits a row, "
                            "and put back if it commits none", self._previous.aside)
                self._previous.watch()
        pid = os.getpid()
        if writer_name is None and self.location.remote:  # nodes share the store: pids repeat
            writer_name = default_writer_name(rank, pid)
        self.writer_name = writer_name or (f"rank{rank}-pid{pid}" if rank is not None else f"pid{pid}")
        self._thread = threading.Thread(target=self._writer_loop, name="tracediff-writer", daemon=True)
        self._thread.start()
        with _active_lock:
            _active.append(weakref.ref(self))
        self._prev_sigterm: Any = None
        if handle_sigterm:
            self._install_sigterm()

    # ------------------------------------------------------------------ public API (host thread)
    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def declare(
        self,
        name: str,
        *,
        segment_size: int | None = None,
        segment_labels: Iterable[str] | None = None,
        row_model: RowModel | Mapping[str, Any] | None = None,
        **attrs: Any,
    ) -> TapState:
        """Declare a tap (its segment layout, its row model (:mod:`tracediff.store.row_model`: what each
        slot of a row holds, stored as the writer group's ``row_model``) and any attributes to store with it)."""
        if not isinstance(name, str) or not name or "/" in name or name.startswith((".", "_")):
            raise UsageError(f"invalid tap name {name!r}: use letters, digits, '_' and '-'")
        if segment_size is not None and (not isinstance(segment_size, int) or segment_size <= 0):
            raise UsageError(f"tap {name!r}: segment_size must be a positive integer, got {segment_size!r}")
        state = self._taps.get(name)
        if state is None:
            state = TapState(name=name)
            self._taps[name] = state
        if segment_size is not None:
            state.segment_size = segment_size
        if segment_labels is not None:
            state.segment_labels = [str(x) for x in segment_labels]
        if row_model is not None:
            state.attrs["row_model"] = row_model_from_json(row_model).to_json()
        state.attrs.update(attrs)
        return state

    def tap(
        self,
        module: torch.nn.Module,
        name: str = "fc_in",
        *,
        capture: str = "input",
        arg: int | str = 0,
        segment_size: int | None = None,
        segment_labels: Iterable[str] | None = None,
        labels: LabelProvider | None = None,
        module_path: str | None = None,
        row_model: RowModel | Mapping[str, Any] | None = None,
    ) -> TapState:
        """Hook ``module``: ``capture='input'`` takes its input (positional ``arg`` index or keyword
        name), ``'output'`` its output (first tensor of a tuple). ``labels`` is an optional provider
        ``(module, args, kwargs, tensor) -> dict`` of row labels read from the forward's arguments.
        ``row_model``: what each slot of a row holds (e.g. ``tracediff.store.row_model.mtp()``)."""
        if capture not in ("input", "output"):
            raise UsageError(f"tap {name!r}: capture must be 'input' or 'output', got {capture!r}")
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"tap {name!r}: expected a torch.nn.Module, got {type(module).__name__}")
        state = self.declare(
            name,
            segment_size=segment_size,
            segment_labels=segment_labels,
            row_model=row_model,
            module=module_path or type(module).__qualname__,
            module_class=f"{type(module).__module__}.{type(module).__qualname__}",
            capture=capture,
        )
        if isinstance(module, torch.nn.Linear):
            state.attrs.setdefault("in_features" if capture == "input" else "out_features",
                                   module.in_features if capture == "input" else module.out_features)

        if capture == "input":
            what = f"input {arg!r}"
            index, keyword = input_slot(module, arg)

            def pick(args: tuple, kwargs: dict) -> Any:
                return pick_input(args, kwargs, arg, index, keyword)

            def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                self._on_hook(state, what, labels, mod, args, kwargs, lambda: pick(args, kwargs))

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:

            def post_hook(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                self._on_hook(state, "output", labels, mod, args, kwargs, lambda: pick_output(output))

            self._handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
        return state

    def _on_hook(
        self,
        state: TapState,
        what: str,
        labels: LabelProvider | None,
        mod: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        pick: Callable[[], Any],
    ) -> None:
        """The body of every tap hook. Never raises: a failure stops this tap (logged once, reason
        kept for the store); rows a stopped tap or recorder sees are counted as dropped."""
        if self.closed or self.skips_off(state, pick):  # switched off: no copy, the rows counted skipped
            return
        try:
            tensor = pick()
        except Exception as exc:  # noqa: BLE001  (a hook must never raise into the host)
            if self.enabled:
                self._fail_tap(state, f"its {what}", exc)
            return
        if not self.enabled or state.error is not None:
            self._count_lost(state, tensor)
            return
        extra = None
        if labels is not None:
            try:
                extra = labels(mod, args, kwargs, tensor)
            except Exception as exc:  # noqa: BLE001
                self._fail_tap(state, "its label provider", exc)
                self._count_lost(state, tensor)
                return
        self.capture(state.name, tensor, labels=extra)

    def count_lost(self, name: str, rows: int, why: str) -> None:
        """Rows of tap ``name`` the host produced that cannot be captured (an adapter that cannot
        label or pick them): counted as dropped, with ``why`` (the first reason a tap gives is kept),
        so that a run that lost them says so; ``why`` :attr:`off_reason`: skipped while switched off,
        counted as such (:meth:`skip_off`); :attr:`unsampled_reason`: rows of requests sampling did not
        choose, skipped as a capture would have skipped them. Never raises."""
        try:
            if rows <= 0:
                return
            if why == self.off_reason:
                self.skip_off(name, rows)
                return
            state = self._taps.get(name) or self.declare(name)
            if why == self.unsampled_reason and self.limits.samples_requests:
                self._account(name, OFFERED, rows)
                self._add_skip(state, rows)
                return
            self._note_drop_reason(state, why)
            self._account(name, OFFERED, rows)
            self._add_drop(state, rows)
        except Exception:  # noqa: BLE001, S110  (counting is best effort; the host comes first)
            pass

    def keep_handle(self, handle: Any) -> None:
        """Keep a hook handle an adapter registered, so that :meth:`close` removes it."""
        self._handles.append(handle)

    def labels(self, *, labelled_by: Mapping[str, Any] | None = None, **fields: Any) -> None:
        """Labels for the next capture of each tap in this thread (sequence keys, positions, token
        ids, next token ids, phase, step, valid). Arrays must have one entry per row (any shape,
        flattened) or be scalars, broadcast to every row. Each tap uses them at most once.

        ``labelled_by`` is given by a label source (a module whose forward's ``input_ids`` label the
        rows): ``{"class": ..., "how": ...}``, kept as the ``labelled_by`` attribute of each tap
        that uses them. Labels given without it (the script's own ``tracediff.labels``) make
        :attr:`explicit_labels` true: automatic label sources then stand aside."""
        unknown = set(fields) - set(LABEL_KEYS)
        if unknown:
            raise UsageError(f"unknown label field(s) {sorted(unknown)}; fields: {', '.join(LABEL_KEYS)}")
        if "phase" in fields and isinstance(fields["phase"], str):
            phase_code(fields["phase"])  # validate now, where the caller can see the error
        if labelled_by is None:
            self.explicit_labels = True
        self._label_generation += 1
        self._tls.labels = (self._label_generation, dict(fields), dict(labelled_by) if labelled_by else None)

    def pending_labelled_by(self) -> dict[str, Any] | None:
        """Who gave this thread's latest labels (``labelled_by`` of :meth:`labels`), None if nobody
        or the script itself."""
        pending = getattr(self._tls, "labels", None)
        return pending[2] if pending is not None else None

    def step(self, step: int | None = None) -> int:
        """Set (or advance by one) the step number that sampling limits and the ``step`` label use."""
        if step is None:
            self._explicit_step = 0 if self._explicit_step is None else self._explicit_step + 1
        else:
            self._explicit_step = int(step)
        return self._explicit_step

    def capture(
        self,
        name: str,
        tensor: torch.Tensor,
        *,
        labels: Mapping[str, Any] | None = None,
        fresh: bool = False,
    ) -> None:
        """Record ``tensor`` ([..., width]) as rows of tap ``name``. Never raises into the caller.

        ``fresh=True`` says the tensor is a private copy nobody will modify (skips the clone)."""
        state = self._taps.get(name)
        if self.closed:  # a capture racing close(): the rows are lost, and counted
            if state is not None:
                self._count_lost(state, tensor)
            return
        if self.skips_off(name, tensor):
            return
        if not self.enabled or (state is not None and state.error is not None):
            if state is not None:
                self._count_lost(state, tensor)
            return
        self._tls.offered = 0
        try:
            self._capture(name, tensor, labels, fresh)
        except Exception as exc:  # noqa: BLE001
            state = self._taps.get(name)
            if state is None:
                self.fail(f"capture of tap {name!r}", exc)
            else:
                self._fail_tap(state, "its capture", exc)
                offered = getattr(self._tls, "offered", 0)  # rows _capture had counted as offered
                if offered:
                    self._note_drop_reason(state, state.error or "")
                    self._add_drop(state, offered)
                else:
                    self._count_lost(state, tensor)

    def stats(self) -> dict[str, Any]:
        """Counts per tap as seen from the host thread (rows queued, dropped, skipped)."""
        return {
            name: {
                "calls": t.calls,
                "rows": t.rows_queued,
                "bytes": t.bytes_queued,
                "dropped_rows": t.dropped_rows,
                "dropped_batches": t.dropped_batches,
                "skipped_rows": t.skipped_rows,
                "skipped_batches": t.skipped_batches,
                "width": t.width,
                "dtype": t.dtype,
                "error": t.error,
            }
            for name, t in self._taps.items()
        }

    def outcome(self) -> dict[str, Any]:
        """What this recorder wrote, per tap: its writer group, rows committed, rows dropped and
        skipped, the group's status and, where recording stopped, why (plain JSON). Complete once
        :meth:`close` has returned."""
        taps: dict[str, Any] = {}
        for name, state in self._taps.items():
            writer = self._writers.get(name)
            unfinished = self._unfinished.get(name, 0)
            error = (writer.error if writer is not None else "") or state.error or self.error
            error = error or self._close_errors.get(name) or ""
            if unfinished:
                error = (f"{error}; " if error else "") + (
                    f"the writer had not finished when the recorder stopped waiting: {unfinished} rows were still "
                    f"queued")
            taps[name] = {
                "group": f"{name}/{writer.writer}" if writer is not None else None,
                "rows": writer.counts.rows if writer is not None else 0,
                "dropped_rows": state.dropped_rows + unfinished,
                "skipped_rows": state.skipped_rows,
                "drop_reason": state.drop_reason,
                "status": writer.status if writer is not None else ("failed" if error else "no rows"),
                "error": error,
            }
        return {"store": self.location.display, "error": self.error or "", "taps": taps}

    def close(self, timeout: float = 120.0) -> None:
        """Stop capturing, write what is queued, trim and commit every group. Idempotent, from any
        thread: a second call returns once the first has finished."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            self.enabled = False
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            # One deadline for the whole close: a store out of reach stops retrying halfway through
            # it, so that the last commit records (tried once) and the report fit in the rest.
            deadline = time.monotonic() + max(float(timeout), 0.0)
            self._give_up_at = time.monotonic() + max(float(timeout), 0.0) / 2
            for writer in list(self._writers.values()):
                if isinstance(writer, RemoteTraceWriter):
                    writer.give_up_at = self._give_up_at
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                log.error("tracediff: writer queue stuck at close; %s may miss its last batches", self.path)
            if self._thread is threading.current_thread():
                return  # closed from inside the writer (a callback): it finishes after this batch
            self._thread.join(max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive():
                self._unfinished = {n: max(0, s.rows_queued - s.rows_settled) for n, s in self._taps.items()}
                log.error("tracediff: the writer did not finish within %.0f s; %s keeps its committed rows, the %d "
                          "rows still queued are lost", timeout, self.location.display, sum(self._unfinished.values()))
                self._report()
            if self._previous is not None:
                self._previous.settle_and_say()
            self._restore_sigterm()

    # ------------------------------------------------------------------ host-thread internals
    def _warn_tap(self, state: TapState, key: str, message: str) -> None:
        if key not in state.warned:
            state.warned.add(key)
            log.warning("tracediff: %s", message)

    def _log_once(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            log.warning(fmt, *args)

    def fail(self, where: str, exc: BaseException) -> None:
        """Disable recording for good, log once (one line), keep the reason for the store (adapters
        call it from their own hooks)."""
        self.enabled = False
        if self.error is None:
            self.error = f"{where}: {one_line(exc)}"
            log.error("tracediff: recording disabled after an error in %s (the host goes on)", self.error)

    def _fail_tap(self, state: TapState, where: str, exc: BaseException) -> None:
        """Stop one tap for good (its hook or labels failed): logged once, kept for its store group."""
        if state.error is None:
            state.error = f"tap {state.name!r} stopped recording after an error in {where}: {one_line(exc)}"
            log.error("tracediff: %s (other taps and the host go on)", state.error)

    def _add_drop(self, state: TapState, rows: int, batches: int = 1) -> None:
        with self._state_lock:
            state.dropped_rows += rows
            state.dropped_batches += batches
        self._account(state.name, DROPPED, rows)

    def _add_skip(self, state: TapState, rows: int, batches: int = 1) -> None:
        with self._state_lock:
            state.skipped_rows += rows
            state.skipped_batches += batches
        self._account(state.name, SKIPPED, rows)

    def _account(self, tap: str, field: int, rows: int) -> None:
        """Count rows in the ledger (when there is one): a memory write, never raises."""
        if self._ledger is not None:
            self._ledger.add(tap, field, rows)

    def _count_lost(self, state: TapState, tensor: Any) -> None:
        """Count the rows of a capture a stopped tap (or recorder) cannot write; never raises."""
        try:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[-1] > 0:
                rows = tensor.numel() // tensor.shape[-1]
                if rows:
                    self._note_drop_reason(state, state.error or self.error or "the recorder was closed")
                    self._account(state.name, OFFERED, rows)
                    self._add_drop(state, rows)
        except Exception:  # noqa: BLE001, S110  (counting is best effort; the host comes first)
            pass

    # ------------------------------------------------------------------ writer thread
__all__ = ["LABEL_FIELDS", "Limits", "Recorder", "TapState", "active_recorder"]
