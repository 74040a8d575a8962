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
import inspect
import logging
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff.errors import StoreExistsError, UsageError
from tracediff.record.limits import Limits
from tracediff.store import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    LABEL_FIELDS,
    PHASES,
    TraceWriter,
    create_store,
    default_source,
    phase_code,
)
from tracediff.store.location import Location
from tracediff.store.remote_writer import (
    DEFAULT_RETRY_SECONDS,
    RemoteTraceWriter,
    default_writer_name,
    store_exists,
)

log = logging.getLogger("tracediff")

_TORCH_TO_STORE = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}
_LABEL_KEYS = ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
LabelProvider = Callable[..., "Mapping[str, Any] | None"]


@dataclass
class TapState:
    """One named tap in this process: its declaration and running counts (host-thread side)."""

    name: str
    segment_size: int | None = None
    segment_labels: list[str] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    rows_queued: int = 0
    bytes_queued: int = 0
    dropped_rows: int = 0
    dropped_batches: int = 0
    skipped_rows: int = 0
    skipped_batches: int = 0
    rows_settled: int = 0  # rows of queued batches the writer has committed or counted as dropped
    width: int | None = None
    dtype: str | None = None
    next_seq: int = 0
    label_generation: int = -1
    warned: set[str] = field(default_factory=set)
    error: str | None = None  # why this tap stopped recording (its hook or labels failed)


@dataclass(frozen=True)
class _DefaultLabels:
    """``seq`` or ``position`` labels nobody gave (one sequence per leading index, positions
    0..per-1). The writer thread builds the arrays: off the forward path, and a batch waiting in the
    queue holds no label arrays of its own."""

    field: str
    first: int  # first sequence key (seq)
    lead: int
    per: int
    rows: int  # rows kept: fewer than lead * per when a sampling limit cut the batch
    ndim: int = 1

    def __getitem__(self, cut: slice) -> _DefaultLabels:
        return replace(self, rows=len(range(self.rows)[cut]))

    def array(self) -> np.ndarray:
        if self.field == "seq":
            full = np.repeat(np.arange(self.first, self.first + self.lead, dtype=np.int64), self.per)
        else:
            full = np.tile(np.arange(self.per, dtype=np.int64), self.lead)
        return full[: self.rows]


@dataclass
class _Batch:
    """One queued capture: its host buffer, small Python objects, and the labels the host gave.
    The [rows, width] view of the buffer is made by the writer thread."""

    tap: str
    data: torch.Tensor  # a pooled 1-D buffer (pinned when copied from a device) or the captured tensor
    rows: int
    width: int
    labels: dict[str, Any]
    event: Any  # torch.cuda.Event or None
    nbytes: int  # what it holds against the queue's budget
    pooled: bool  # ``data`` goes back to the pool once written

    @property
    def values(self) -> torch.Tensor:
        """The rows, [rows, width] (made by the writer thread)."""
        if self.pooled:
            return self.data[: self.rows * self.width].view(self.rows, self.width)
        return self.data.reshape(self.rows, self.width)


class _HostPool:
    """Reuses host buffers: pinned ones for device-to-host copies (pinning memory is slow) and plain
    ones for CPU captures (a fresh 48 MiB tensor costs page faults on every step; on a VM that returns
    freed memory to its host they run at 0.1-0.3 GB/s). Buffers are bucketed by size (powers of two,
    so servers whose steps differ in rows reuse them too) and the pool keeps at most ``max_bytes``
    (the recorder's ``max_queue_bytes``: buffers in flight are bounded by the queue's budget, idle ones
    by this)."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self._free: dict[tuple[int, torch.dtype, bool], list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._max = max_bytes

    @staticmethod
    def bucket_numel(numel: int) -> int:
        return max(1 << 12, 1 << (numel - 1).bit_length())

    def get(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements; give this same tensor back to :meth:`put`."""
        key = (self.bucket_numel(numel), dtype, pinned)
        with self._lock:
            bucket = self._free.get(key)
            if bucket:
                buf = bucket.pop()
                self._bytes -= buf.nbytes
                return buf
        # A buffer made under inference_mode would be an inference tensor, which no later capture
        # outside it may write into (an eval loop, then training): pool buffers are always normal.
        with torch.inference_mode(False):
            return torch.empty(key[0], dtype=dtype, pin_memory=pinned)

    def put(self, buf: torch.Tensor, pinned: bool) -> None:
        with self._lock:
            if self._bytes + buf.nbytes <= self._max:
                self._free.setdefault((buf.numel(), buf.dtype, pinned), []).append(buf)
                self._bytes += buf.nbytes


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


class Recorder:
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
    """

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
        max_queue_batches: int = 64,
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
    ) -> None:
        if on_full not in ("drop", "block"):
            raise UsageError(f"on_full must be 'drop' or 'block', got {on_full!r}")
        if max_queue_bytes <= 0 or max_queue_batches <= 0:
            raise UsageError("max_queue_bytes and max_queue_batches must be positive")
        if not retry_seconds >= 0:
            raise UsageError(f"retry_seconds must be 0 or more, got {retry_seconds!r}")
        # A folder, or an fsspec URL (s3://...) written through zarr's FsspecStore.
        self.location = Location.of(path, None if storage_options is None else dict(storage_options))
        self.path: Any = self.location if self.location.remote else Path(self.location.local)
        self.role = role
        self.limits = limits or Limits()
        self.on_full = on_full
        self.block_timeout = float(block_timeout)
        self.max_queue_bytes = int(max_queue_bytes)
        self.chunk_rows = chunk_rows
        self.compressor = compressor
        self.durable = durable
        self.rank = rank
        self.world_size = world_size
        self.meta: dict[str, Any] = dict(meta or {})
        self.source = default_source(role, framework, framework_version)
        if adapter:
            self.source["adapter"] = adapter
        self.enabled = True
        self.closed = False
        self.error: str | None = None
        self._taps: dict[str, TapState] = {}
        self._handles: list[Any] = []
        self._writers: dict[str, TraceWriter] = {}
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max_queue_batches)
        self._queued_bytes = 0
        self._enqueued = 0  # batches put on the queue / taken off it and written (or dropped): flush()
        self._done = 0
        self._cond = threading.Condition()
        self._tls = threading.local()
        self._label_generation = 0
        self._explicit_step: int | None = None
        self._pool = _HostPool(max_bytes=min(1 << 30, self.max_queue_bytes))
        self._logged_once: set[str] = set()
        self._writer_error: str | None = None
        self._state_lock = threading.Lock()  # drop counts: host threads and the writer add to them
        self._close_lock = threading.RLock()  # re-entrant: SIGTERM may arrive while close() runs
        self._on_close = on_close
        self._reported = False  # on_close called (once: by the writer, or by close() on a timeout)
        self._unfinished: dict[str, int] = {}  # tap -> rows still queued when close() gave up waiting
        self._close_errors: dict[str, str] = {}  # tap -> why its final commit failed
        self.retry_seconds = float(retry_seconds)
        self._give_up_at: float | None = None  # set by close(): no upload retry starts after it

        if self.location.remote:
            if append:
                if not store_exists(self.location):
                    raise UsageError(f"{self.path}: append=True needs an existing trace store")
            else:
                create_store(self.location, role=role, meta=self.meta, source=self.source, overwrite=overwrite)
        elif append:
            if not (self.path / "zarr.json").is_file():
                raise UsageError(f"{self.path}: append=True needs an existing trace store")
        else:
            if self.path.exists() and not overwrite:
                raise StoreExistsError(f"{self.path}: already exists; pass overwrite=True (--overwrite) to replace it")
            create_store(self.path, role=role, meta=self.meta, source=self.source, overwrite=overwrite)
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
        **attrs: Any,
    ) -> TapState:
        """Declare a tap (its segment layout and any attributes to store with it)."""
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
    ) -> TapState:
        """Hook ``module``: ``capture='input'`` takes its input (positional ``arg`` index or keyword
        name), ``'output'`` its output (first tensor of a tuple). ``labels`` is an optional provider
        ``(module, args, kwargs, tensor) -> dict`` of row labels read from the forward's arguments."""
        if capture not in ("input", "output"):
            raise UsageError(f"tap {name!r}: capture must be 'input' or 'output', got {capture!r}")
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"tap {name!r}: expected a torch.nn.Module, got {type(module).__name__}")
        state = self.declare(
            name,
            segment_size=segment_size,
            segment_labels=segment_labels,
            module=module_path or type(module).__qualname__,
            module_class=f"{type(module).__module__}.{type(module).__qualname__}",
            capture=capture,
        )
        if isinstance(module, torch.nn.Linear):
            state.attrs.setdefault("in_features" if capture == "input" else "out_features",
                                   module.in_features if capture == "input" else module.out_features)

        if capture == "input":
            what = f"input {arg!r}"
            index, keyword = _input_slot(module, arg)

            def pick(args: tuple, kwargs: dict) -> Any:
                return _pick_input(args, kwargs, arg, index, keyword)

            def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                self._on_hook(state, what, labels, mod, args, kwargs, lambda: pick(args, kwargs))

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:

            def post_hook(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                self._on_hook(state, "output", labels, mod, args, kwargs, lambda: _pick_output(output))

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
        if self.closed:
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

    def keep_handle(self, handle: Any) -> None:
        """Keep a hook handle an adapter registered, so that :meth:`close` removes it."""
        self._handles.append(handle)

    def labels(self, **fields: Any) -> None:
        """Labels for the next capture of each tap in this thread (sequence keys, positions, token
        ids, next token ids, phase, step, valid). Arrays must have one entry per row (any shape,
        flattened) or be scalars, broadcast to every row. Each tap uses them at most once."""
        unknown = set(fields) - set(_LABEL_KEYS)
        if unknown:
            raise UsageError(f"unknown label field(s) {sorted(unknown)}; fields: {', '.join(_LABEL_KEYS)}")
        if "phase" in fields and isinstance(fields["phase"], str):
            phase_code(fields["phase"])  # validate now, where the caller can see the error
        self._label_generation += 1
        self._tls.labels = (self._label_generation, dict(fields))

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
        if self.closed:
            return
        state = self._taps.get(name)
        if not self.enabled or (state is not None and state.error is not None):
            if state is not None:
                self._count_lost(state, tensor)
            return
        try:
            self._capture(name, tensor, labels, fresh)
        except Exception as exc:  # noqa: BLE001
            state = self._taps.get(name)
            if state is None:
                self.fail(f"capture of tap {name!r}", exc)
            else:
                self._fail_tap(state, "its capture", exc)
                self._count_lost(state, tensor)

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
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

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
            self._restore_sigterm()

    # ------------------------------------------------------------------ host-thread internals
    def _capture(self, name: str, tensor: torch.Tensor, labels: Mapping[str, Any] | None, fresh: bool) -> None:
        state = self._taps.get(name) or self.declare(name)
        state.calls += 1
        if not isinstance(tensor, torch.Tensor):
            self._warn_tap(state, "type", f"tap {name!r}: got {type(tensor).__name__}, not a tensor; skipped")
            return
        if tensor.dim() == 0 or tensor.shape[-1] == 0:
            self._warn_tap(state, "shape", f"tap {name!r}: tensor of shape {tuple(tensor.shape)} has no rows; skipped")
            return
        if tensor.dtype not in _TORCH_TO_STORE:
            self._warn_tap(state, "dtype", f"tap {name!r}: dtype {tensor.dtype} is not a float type; skipped")
            return
        if tensor.is_meta:
            self._warn_tap(state, "meta", f"tap {name!r}: tensor on the meta device holds no data; skipped")
            return
        width = int(tensor.shape[-1])
        dtype = _TORCH_TO_STORE[tensor.dtype]
        if state.width is None:
            state.width, state.dtype = width, dtype
        elif (width, dtype) != (state.width, state.dtype):
            self._warn_tap(
                state,
                f"layout{width}{dtype}",
                f"tap {name!r}: got width {width} {dtype} after {state.width} {state.dtype}; rows of the new "
                f"layout are skipped (record them under another tap name)",
            )
            return
        rows = tensor.numel() // width
        if rows == 0:
            return  # nothing to record (an empty batch); the layout above is still learnt
        step = self._explicit_step if self._explicit_step is not None else state.calls - 1
        label_fields = self._resolve_labels(state, tensor, labels, rows, step)
        phase = label_fields.get("phase")
        nbytes = rows * width * tensor.element_size()

        if not self.limits.wants_step(step) or not self._wants_phase(phase):
            state.skipped_rows += rows
            state.skipped_batches += 1
            return
        take = rows
        if self.limits.max_rows is not None:
            take = min(take, self.limits.max_rows - state.rows_queued)
        if self.limits.max_bytes is not None:
            take = min(take, (self.limits.max_bytes - state.bytes_queued) // (width * tensor.element_size()))
        if take <= 0:
            state.skipped_rows += rows
            state.skipped_batches += 1
            return
        if take < rows:
            state.skipped_rows += rows - take
            nbytes = take * width * tensor.element_size()
            # Scalar labels (0-d arrays: a step or seq given once for the batch) apply to every row.
            label_fields = {
                k: (v[:take] if isinstance(v, (np.ndarray, torch.Tensor, _DefaultLabels)) and v.ndim else v)
                for k, v in label_fields.items()
            }

        # The queue's budget counts the memory a copy really holds: pooled buffers are a power of two.
        held = nbytes
        if not fresh and tensor.device.type in ("cpu", "cuda"):
            held = self._pool.bucket_numel(take * width) * tensor.element_size()
        if not self._reserve(held):
            self._add_drop(state, take)
            return
        try:
            flat = tensor.detach().reshape(rows, width)[:take]
            data, event, pooled = self._copy_off_path(flat, fresh)
            with self._cond:
                self._queue.put_nowait(_Batch(name, data, take, width, label_fields, event, held, pooled))
                self._enqueued += 1
        except queue.Full:  # another host thread filled the last slot first
            self._release(held)
            self._add_drop(state, take)
            return
        except BaseException:
            self._release(held)
            raise
        state.rows_queued += take
        state.bytes_queued += nbytes

    def _wants_phase(self, phase: Any) -> bool:
        if self.limits.phases is None:
            return True
        if phase is None:
            return "unknown" in self.limits.phases
        if isinstance(phase, np.ndarray):
            return any(PHASES[int(c)] in self.limits.phases for c in np.unique(phase))
        return PHASES[phase_code(phase)] in self.limits.phases

    def _reserve(self, nbytes: int) -> bool:
        """Account ``nbytes`` against the queue budget; drop or wait (bounded) when it is spent."""
        deadline = None
        with self._cond:
            while True:
                fits = self._queued_bytes + nbytes <= self.max_queue_bytes or self._queued_bytes == 0
                if fits and not self._queue.full():
                    self._queued_bytes += nbytes
                    return True
                if self.on_full == "drop" or not self.enabled:
                    return False
                now = time.monotonic()
                deadline = deadline or now + self.block_timeout
                if now >= deadline:
                    self._log_once("block-timeout", "tracediff: writer behind for %.1fs; dropping a batch", self.block_timeout)
                    return False
                self._cond.wait(deadline - now)

    def _release(self, nbytes: int, done: bool = False) -> None:
        with self._cond:
            self._queued_bytes -= nbytes
            if done:
                self._done += 1
            self._cond.notify_all()

    def _copy_off_path(self, flat: torch.Tensor, fresh: bool) -> tuple[torch.Tensor, Any, bool]:
        """The one copy on the forward path: async into a pooled pinned buffer for CUDA, into a pooled
        plain buffer on CPU. Returns (host data, event or None, whether the data is a pooled buffer).
        The view written through is dropped at once: a queued batch keeps only the pooled buffer."""
        if flat.device.type == "cuda":
            base = self._pool.get(flat.numel(), flat.dtype, pinned=True)
            base[: flat.numel()].view(flat.shape).copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))
            return base, event, True
        if flat.device.type != "cpu":
            return flat.to("cpu"), None, False
        if fresh and flat.is_contiguous():
            return flat, None, False
        base = self._pool.get(flat.numel(), flat.dtype, pinned=False)
        base[: flat.numel()].view(flat.shape).copy_(flat)
        return base, None, True

    def _resolve_labels(
        self,
        state: TapState,
        tensor: torch.Tensor,
        provided: Mapping[str, Any] | None,
        rows: int,
        step: int,
    ) -> dict[str, Any]:
        """Labels for this batch: the provider's, else this thread's ``labels()`` (once per tap),
        else defaults (one sequence per leading index, positions 0..T-1). Arrays are flattened to
        ``rows`` entries; host copies only (label tensors are small)."""
        fields: dict[str, Any] = {}
        pending = getattr(self._tls, "labels", None)
        if pending is not None and pending[0] != state.label_generation:
            generation, values = pending
            if _labels_fit(values, rows):
                state.label_generation = generation
                fields.update(values)
            else:
                self._warn_tap(
                    state,
                    "labels-size",
                    f"tap {state.name!r}: labels given for {_label_rows(values)} rows but the tensor has {rows}; "
                    f"using default labels",
                )
        if provided:
            if _labels_fit(provided, rows):
                fields.update({k: v for k, v in provided.items() if v is not None})
            else:
                self._warn_tap(state, "provider-size", f"tap {state.name!r}: label provider gave the wrong row count")
        out: dict[str, Any] = {}
        for key, value in fields.items():
            if key not in _LABEL_KEYS or value is None:
                continue
            out[key] = _label_array(key, value, rows)
        if "seq" not in out or "position" not in out:
            lead = tensor.shape[0] if tensor.dim() >= 3 else 1
            per = rows // max(lead, 1)
            if "seq" not in out:
                out["seq"] = _DefaultLabels("seq", state.next_seq, lead, per, rows)
                state.next_seq += lead
            if "position" not in out:
                out["position"] = _DefaultLabels("position", 0, lead, per, rows)
        out.setdefault("step", np.int64(step))
        return out

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
            self.error = f"{where}: {_one_line(exc)}"
            log.error("tracediff: recording disabled after an error in %s (the host goes on)", self.error)

    def _fail_tap(self, state: TapState, where: str, exc: BaseException) -> None:
        """Stop one tap for good (its hook or labels failed): logged once, kept for its store group."""
        if state.error is None:
            state.error = f"tap {state.name!r} stopped recording after an error in {where}: {_one_line(exc)}"
            log.error("tracediff: %s (other taps and the host go on)", state.error)

    def _add_drop(self, state: TapState, rows: int, batches: int = 1) -> None:
        with self._state_lock:
            state.dropped_rows += rows
            state.dropped_batches += batches

    def _count_lost(self, state: TapState, tensor: Any) -> None:
        """Count the rows of a capture a stopped tap (or recorder) cannot write; never raises."""
        try:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[-1] > 0:
                rows = tensor.numel() // tensor.shape[-1]
                if rows:
                    self._add_drop(state, rows)
        except Exception:  # noqa: BLE001, S110  (counting is best effort; the host comes first)
            pass

    # ------------------------------------------------------------------ writer thread
    def _writer_loop(self) -> None:
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
            try:
                if self._writer_error is None:
                    self._write(item)
                else:
                    self._count_drop(item)
            except BaseException as exc:  # noqa: BLE001  (even SystemExit: a dead writer would stall the host)
                self._writer_error = _one_line(exc)
                self.fail(f"the writer of tap {item.tap!r}", exc)
                self._count_drop(item)
            finally:
                state = self._taps.get(item.tap)
                if state is not None:
                    state.rows_settled += item.rows
                if item.pooled:
                    self._pool.put(item.data, pinned=item.event is not None)
                self._release(item.nbytes, done=True)
        self._finish()

    def _writer_for(self, item: _Batch) -> TraceWriter:
        writer = self._writers.get(item.tap)
        if writer is None:
            state = self._taps[item.tap]
            assert state.width is not None and state.dtype is not None
            writer = self._open_writer(state)
        return writer

    def _open_writer(self, state: TapState, retry_seconds: float | None = None) -> TraceWriter:
        attrs = dict(state.attrs)
        segment_size, segment_labels = self._segment_layout(state)
        attrs.update(
            {
                "segment_size": segment_size,
                "segment_labels": segment_labels,
                "rank": self.rank,
                "world_size": self.world_size,
                "source": self.source,
                "meta": self.meta,
                "limits": self.limits.as_dict(),
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
        else:
            writer = TraceWriter(self.path, state.name, self.writer_name, **common)
        self._writers[state.name] = writer
        return writer

    def _segment_layout(self, state: TapState) -> tuple[int | None, list[str] | None]:
        """The declared segment layout if it fits the width the tap really saw; otherwise none (one
        warning naming the tap and the field): readers refuse a layout that does not fit, and the
        rows are worth more than the layout, which compare can infer."""
        width = int(state.width or 0)
        size, labels = state.segment_size, state.segment_labels
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

    def _write(self, item: _Batch) -> None:
        if item.event is not None:
            item.event.synchronize()
        values = item.values
        bf16 = values.dtype == torch.bfloat16
        array = values.view(torch.int16).numpy().view(np.uint16) if bf16 else values.numpy()
        writer = self._writer_for(item)
        labels = {
            k: (v.numpy() if isinstance(v, torch.Tensor) else v.array() if isinstance(v, _DefaultLabels) else v)
            for k, v in item.labels.items()
        }
        seq = labels.get("seq")
        if seq is not None and np.asarray(seq).dtype.kind in "OUS":
            labels["seq"] = np.array([writer.seq_id(k) for k in np.asarray(seq).reshape(-1)], dtype=np.int64)
        rows = array.shape[0]
        labels = {k: (np.broadcast_to(np.asarray(v), (rows,)) if np.ndim(v) == 0 else v) for k, v in labels.items()}
        self._sync_counts(writer, item.tap)
        writer.append(array, labels)

    def _sync_counts(self, writer: TraceWriter, tap: str) -> None:
        state = self._taps[tap]
        writer.counts.dropped_rows = state.dropped_rows
        writer.counts.dropped_batches = state.dropped_batches
        writer.counts.skipped_rows = state.skipped_rows
        writer.counts.skipped_batches = state.skipped_batches

    def _count_drop(self, item: _Batch) -> None:
        state = self._taps.get(item.tap)
        if state is not None:
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
                    self._close_errors[name] = _one_line(exc)
                    if not (state.error or self.error):  # else said below, with the count
                        log.error("tracediff: cannot record the drop counts of tap %r: %s", name, exc)
        for name, writer in self._writers.items():
            try:
                self._sync_counts(writer, name)
                error = self._taps[name].error or self.error
                writer.close(status="failed" if error else "closed", error=error or "")
            except Exception as exc:  # noqa: BLE001
                self._close_errors[name] = _one_line(exc)
                if not (self._taps[name].error or self.error):  # else said below, with the count
                    log.error("tracediff: closing %s/%s: %s (committed rows stay readable)", self.path, name, exc)
        self._log_losses()
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
            log.error("tracediff: reporting the recording's outcome failed: %s", _one_line(exc))

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


# ---------------------------------------------------------------------- small pure helpers
def _input_slot(module: torch.nn.Module, arg: int | str) -> tuple[int | None, str | None]:
    """Where input ``arg`` arrives: its position and its keyword, from ``module.forward``'s signature
    (``forward(hidden_states, ...)`` may be called either way). None where the signature cannot say
    (``*args`` forwards, builtins)."""
    index = arg if isinstance(arg, int) else None
    keyword = arg if isinstance(arg, str) else None
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return index, keyword
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if isinstance(arg, int) and arg < len(positional) and positional[arg].kind == positional[arg].POSITIONAL_OR_KEYWORD:
        keyword = positional[arg].name
    elif isinstance(arg, str):
        index = next((i for i, p in enumerate(positional) if p.name == arg and p.kind == p.POSITIONAL_OR_KEYWORD), None)
    return index, keyword


def _pick_input(args: tuple, kwargs: dict, arg: int | str, index: int | None, keyword: str | None) -> Any:
    """The tapped input of one call: by position, else by keyword (see :func:`_input_slot`)."""
    if index is not None and index < len(args):
        return args[index]
    if keyword is not None and keyword in kwargs:
        return kwargs[keyword]
    if isinstance(arg, int) and keyword is None and not args:
        # Keywords only and no signature to name them: the first tensor keyword.
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return value
    raise UsageError(f"input {arg!r} not found among {len(args)} positional and {sorted(kwargs)} keyword arguments")


def _pick_output(output: Any) -> Any:
    """The module's output tensor: itself, else the first tensor of a tuple / list or of a mapping
    (a ``ModelOutput`` or a dict, in insertion order)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor):
                return value
    if isinstance(output, Mapping):
        for value in output.values():
            if isinstance(value, torch.Tensor):
                return value
    raise UsageError(f"module output of type {type(output).__name__} holds no tensor to capture")


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (torch's messages span several), for the log and the store."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _label_rows(values: Mapping[str, Any]) -> int | None:
    for value in values.values():
        n = _numel(value)
        if n is not None and n != 1:
            return n
    return None


def _labels_fit(values: Mapping[str, Any], rows: int) -> bool:
    for value in values.values():
        n = _numel(value)
        if n is not None and n not in (1, rows):
            return False
    return True


def _numel(value: Any) -> int | None:
    if value is None or isinstance(value, (str, bytes, int, float, np.generic)):
        return None
    if isinstance(value, torch.Tensor):
        return value.numel()
    return int(np.asarray(value).size)


def _label_array(key: str, value: Any, rows: int) -> Any:
    """One label field as a flat host numpy array of ``rows`` entries (or a numpy scalar)."""
    if key == "phase":
        if isinstance(value, (str, int, np.integer)):
            return np.int8(phase_code(value))
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        arr = arr.reshape(-1)
        if arr.dtype.kind in "OUS":
            return np.array([phase_code(str(x)) for x in arr], dtype=np.int8)
        return arr.astype(np.int8)
    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
        # No sync on the forward path: copy asynchronously; the batch's CUDA event (recorded after
        # this copy was queued) is waited for by the writer before it reads the labels.
        flat = value.detach().reshape(-1)
        if flat.numel() == 1 and rows != 1:
            flat = flat.expand(rows)
        host = torch.empty(flat.shape, dtype=torch.bool if key == "valid" else torch.int64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        return host
    if isinstance(value, torch.Tensor):
        arr = value.detach().to("cpu").numpy().reshape(-1)
    elif isinstance(value, (str, bytes)):
        return np.array([value] * rows, dtype=object) if key == "seq" else _bad_label(key, value)
    elif np.isscalar(value):
        return np.asarray(value).astype(np.bool_ if key == "valid" else np.int64)
    else:
        arr = np.asarray(value).reshape(-1)
    if arr.size == 1 and rows != 1:
        arr = np.repeat(arr, rows)
    if key == "seq" and arr.dtype.kind in "OUS":
        return arr.astype(object)
    if key == "valid":
        return arr.astype(np.bool_)
    return arr.astype(np.int64)


def _bad_label(key: str, value: Any) -> Any:
    raise UsageError(f"label {key!r} must be numeric, got {value!r}")


__all__ = ["LABEL_FIELDS", "Limits", "Recorder", "TapState", "active_recorder"]
