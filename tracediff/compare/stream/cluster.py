"""The streaming pass of a compare as dask.distributed tasks: ``compare --dask ADDRESS|local:N``.

The plan and the findings stay on the client. The pass's small inputs (:class:`~tracediff.compare.stream.blocks.PassPlan`:
segment pairs, scales, profile requests, and where each writer group's rows are) go to every worker
once; each task then carries a few consecutive blocks of row pairs as
:class:`~tracediff.compare.stream.blocks.BlockSpec` (per pair, the stream and stored row of each side: never the
whole row index), opens the stores itself by location through :func:`tracediff.store.open_store`,
reads only those rows and returns the blocks' partial results. The client merges them with the same
code, in the same block order, as the threaded pass: the report is the same bits.

A worker holds one block of raw rows of both sides (about 16 MiB), the float32 sub-block buffers of
:mod:`tracediff.compare.stream.blocks`, and the per-row metrics of the task it runs: never the trace. Of stores read
by whole chunks (compressed, or at a URL) it also caches up to 72 decoded chunks a thread, and a remote
stream keeps the chunks it read ahead (about 2 x 64 MiB at most). When the compare ends, the client has
every worker close that compare's stores and its threads' buffers (``_forget``): an idle worker holds
none of its rows or open files, however many compares a long-lived cluster runs. Tasks carry only
numbers and strings the client made; nothing read from a store is unpickled anywhere.

This module imports ``distributed`` only when a runner starts (``pip install 'tracediff[dask]'``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from tracediff.compare.rows.gather import StreamLocation
from tracediff.compare.stream.blocks import BlockResult, BlockSpec, BlockWorker, PassPlan
from tracediff.errors import CompareError, StoreError, UsageError, first_line
from tracediff.store import TraceStore, TraceStream
from tracediff.store.storeset import open_side

__all__ = ["DaskRunner", "parse_dask_target"]

_LOCAL = re.compile(r"local:(\d+)")
#: Raw rows a task reads at most (a few blocks: the scheduler's per-task cost stays small next to it).
_TASK_BYTES = 64 << 20
_LOST = {"KilledWorker", "CancelledError", "FutureCancelledError"}


def parse_dask_target(text: str) -> tuple[str, int | str]:
    """``("local", N)`` for ``local:N`` (a LocalCluster of N worker processes), else
    ``("address", ADDRESS)`` for a running scheduler (``tcp://host:8786``, ``host:8786``)."""
    text = text.strip()
    if text.startswith("local"):
        m = _LOCAL.fullmatch(text)
        if m is None or not 1 <= int(m.group(1)) <= 256:
            raise UsageError(f"--dask {text!r}: expected local:N with N worker processes (1..256), e.g. local:2")
        return "local", int(m.group(1))
    if not text or any(c.isspace() for c in text):
        raise UsageError(f"--dask {text!r}: expected a scheduler address (tcp://HOST:PORT) or local:N")
    return "address", text


class DaskRunner:
    """Runs a pass's blocks on a dask.distributed cluster (a :class:`tracediff.compare.stream.one_pass.BlockRunner`).

    ``target`` is ``local:N`` (a LocalCluster of N single-threaded worker processes on 127.0.0.1,
    no dashboard, started when the pass begins and closed with the runner) or a scheduler address.
    ``storage_options`` reach :func:`tracediff.store.open_store` on the workers with each store's
    location. Use as a context manager: leaving it closes the client and any cluster it started.
    """

    def __init__(self, target: str, storage_options: dict[str, Any] | None = None,
                 stage: Callable[[str], None] | None = None, task_bytes: int = _TASK_BYTES) -> None:
        self.kind, self.where = parse_dask_target(target)
        self.target = target
        self.storage_options = dict(storage_options or {})
        self.stage = stage
        self.task_bytes = task_bytes
        self.client: Any = None
        self.cluster: Any = None
        self._quiet: list[tuple[logging.Logger, int]] = []

    # -- life cycle
    def __enter__(self) -> DaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        with contextlib.suppress(Exception):  # a cluster whose workers died may fail to say goodbye
            if client is not None:
                client.close()
        with contextlib.suppress(Exception):
            if cluster is not None:
                cluster.close()
        for logger, level in self._quiet:
            logger.setLevel(level)
        self._quiet = []

    def _silence(self) -> None:
        # distributed logs worker deaths, retries and shutdown chatter; a failure reaches the user as
        # one CompareError instead.
        for name in ("distributed", "tornado"):
            logger = logging.getLogger(name)
            self._quiet.append((logger, logger.level))
            logger.setLevel(logging.CRITICAL)

    def start(self) -> Any:
        """The client (started on first use)."""
        if self.client is not None:
            return self.client
        try:
            import dask  # noqa: PLC0415
            import distributed  # noqa: PLC0415
        except ImportError as exc:
            raise UsageError("--dask needs dask.distributed: pip install 'tracediff[dask]'") from exc
        self._silence()
        if self.stage is not None:
            self.stage(f"starting dask ({self.target})" if self.kind == "local" else f"connecting to dask {self.where}")
        try:
            if self.kind == "local":
                self.cluster = distributed.LocalCluster(
                    n_workers=int(self.where), threads_per_worker=1, processes=True, host="127.0.0.1",
                    # Its HTTP server on a free port of 127.0.0.1 (None would try 8787, warn when taken).
                    dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL,
                    worker_dashboard_address=None,
                )
                self.client = distributed.Client(self.cluster, set_as_default=False)
            else:
                # dask's own setting (distributed.comm.timeouts.connect, DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT).
                timeout = dask.config.get("distributed.comm.timeouts.connect", "30s")
                self.client = distributed.Client(str(self.where), timeout=timeout, set_as_default=False)
        except Exception as exc:  # noqa: BLE001  (distributed raises OSError, TimeoutError and its own)
            self.close()
            what = f"a LocalCluster of {self.where} workers" if self.kind == "local" else f"dask scheduler {self.where}"
            raise CompareError(f"--dask {self.target}: cannot start {what} ({type(exc).__name__}: {first_line(exc)})") from exc
        return self.client

    def workers(self) -> dict[str, int]:
        """Worker address -> its threads."""
        info = self.start().scheduler_info(n_workers=-1) if _takes_n_workers() else self.start().scheduler_info()
        return {addr: int(w.get("nthreads", 1)) for addr, w in info.get("workers", {}).items()}

    # -- the pass
    def run(self, plan: PassPlan, specs: Iterable[BlockSpec], blocks: int, add: Callable[[BlockResult], None]) -> None:
        from distributed import as_completed  # noqa: PLC0415

        client = self.start()
        if self.kind == "local":
            client.wait_for_workers(int(self.where), timeout=120)
        threads = sum(self.workers().values())
        if threads == 0:
            raise CompareError(f"--dask {self.target}: the scheduler has no workers")
        # Unique among every client of a shared cluster, and never that of an earlier runner whose
        # id() this one reuses: a worker keeps a compare's stores and buffers under its key.
        key = f"tracediff-{os.getpid()}-{uuid.uuid4().hex}"
        raw_row = _raw_row_bytes(plan)
        per_task = max(1, min(self.task_bytes // max(1, plan.block * raw_row), -(-blocks // (4 * threads))))
        plan_future = client.scatter(plan, broadcast=True, hash=False)
        tasks = _batches(iter(specs), per_task)
        window = 2 * threads + 1
        pending: dict[Any, list[BlockSpec]] = {}
        done = as_completed(loop=client.loop)

        def submit(n: int) -> None:
            for batch in islice(tasks, n):
                first = batch[0].number
                fut = client.submit(run_block_task, plan_future, key, self.storage_options, batch,
                                    key=f"{key}-blocks-{first}", pure=False)
                pending[fut] = batch
                done.add(fut)

        try:
            submit(window)
            for fut in done:
                batch = pending.pop(fut)
                try:
                    results = fut.result()
                except Exception as exc:  # noqa: BLE001  (a task's error or a worker's death, whatever the type)
                    raise CompareError(_task_error(plan, batch, exc)) from exc
                for res in results:
                    add(res)
                submit(1)
        finally:
            for fut in list(pending):
                fut.cancel()
            with contextlib.suppress(Exception):
                plan_future.release()
            with contextlib.suppress(Exception):
                client.run(_forget, key)


def _takes_n_workers() -> bool:
    import inspect  # noqa: PLC0415

    from distributed import Client  # noqa: PLC0415

    return "n_workers" in inspect.signature(Client.scheduler_info).parameters


def _raw_row_bytes(plan: PassPlan) -> int:
    from tracediff.store import VALUE_DTYPES  # noqa: PLC0415

    return (plan.candidate_width * VALUE_DTYPES[plan.candidate_dtype].itemsize
            + plan.reference_width * VALUE_DTYPES[plan.reference_dtype].itemsize)


def _batches(specs: Iterator[BlockSpec], n: int) -> Iterator[list[BlockSpec]]:
    while batch := list(islice(specs, n)):
        yield batch


def _stores_of(locations: tuple[StreamLocation, ...], streams: Iterable[int]) -> str:
    names = sorted({locations[int(s)].location for s in streams})
    return ", ".join(names)


def _task_error(plan: PassPlan, batch: list[BlockSpec], exc: BaseException) -> str:
    """One line: which blocks, which stores, what went wrong."""
    import numpy as np  # noqa: PLC0415

    cand = _stores_of(plan.candidate_streams, np.unique(np.concatenate([b.cand_stream for b in batch])).tolist())
    ref = _stores_of(plan.reference_streams, np.unique(np.concatenate([b.ref_stream for b in batch])).tolist())
    blocks = f"block {batch[0].number}" if len(batch) == 1 else f"blocks {batch[0].number}-{batch[-1].number}"
    where = f"{blocks} (row pairs {batch[0].start}..{batch[-1].stop}) of candidate {cand} against reference {ref}"
    if type(exc).__name__ in _LOST:  # the workers died under it (killed, out of memory) or the scheduler dropped it
        return (f"dask: the task running {where} was lost ({type(exc).__name__}): its worker processes were killed "
                f"or ran out of memory, or the scheduler went away; no report was written")
    return f"dask worker failed on {where}: {first_line(exc)}"


# ---------------------------------------------------------------------------------- on the worker
# What a worker process keeps between the tasks of one compare: its stores (shared by its threads) and
# one BlockWorker per thread (buffers, chunk caches). Both are let go by ``_forget`` when the compare
# ends, explicitly: a store and its streams refer to each other, so without it they (and the rows
# they hold) would wait for the cyclic garbage collector, one compare's worth at a time.
_LOCK = threading.Lock()
_STORES: dict[tuple[str, str, str], TraceStore] = {}  # (compare key, location, options) -> store


@dataclass
class _Slot:
    """A worker thread's BlockWorker for one compare; ``busy`` while a task runs blocks on it."""

    key: str
    worker: BlockWorker
    busy: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        self.worker.close()


_SLOTS: dict[int, _Slot] = {}  # worker thread ident -> its slot


def _open(key: str, location: str, storage_options: dict[str, Any]) -> TraceStore:
    options = json.dumps(storage_options, sort_keys=True, default=str)
    with _LOCK:
        for k in [k for k in _STORES if k[0] != key]:  # another compare's stores: closed
            _STORES.pop(k).close()
        store = _STORES.get((key, location, options))
        if store is None:
            store = open_side(location, storage_options)  # type: ignore[assignment]  (one location: one store)
            _STORES[(key, location, options)] = store
        return store


def _streams(key: str, locations: tuple[StreamLocation, ...], storage_options: dict[str, Any], width: int,
             dtype: str) -> list[TraceStream]:
    """The writer groups the client planned on, opened here, each checked to hold its rows still."""
    out = []
    for loc in locations:
        store = _open(key, loc.location, storage_options)
        stream = next((s for s in store.streams.get(loc.tap, []) if s.writer == loc.writer), None)
        if stream is None or stream.rows < loc.rows:
            have = "no such writer group" if stream is None else f"{stream.rows} committed rows"
            raise StoreError(f"{loc.location}/{loc.tap}/{loc.writer}: planned on {loc.rows} committed rows, "
                             f"the worker sees {have}: is the store at this location on every worker?")
        if stream.width != width or stream.dtype != dtype:
            raise StoreError(f"{loc.location}/{loc.tap}/{loc.writer}: width {stream.width} {stream.dtype} on the "
                             f"worker, {width} {dtype} on the client: a different store at this location")
        out.append(stream)
    return out


def _slot(plan: PassPlan, key: str, storage_options: dict[str, Any]) -> _Slot:
    """This thread's slot for compare ``key`` (made on its first task here; another compare's, closed)."""
    ident = threading.get_ident()
    with _LOCK:
        slot = _SLOTS.get(ident)
    if slot is not None and slot.key == key and not slot.closed:
        return slot
    if slot is not None:
        with slot.busy:
            slot.close()
    ref = _streams(key, plan.reference_streams, storage_options, plan.reference_width, plan.reference_dtype)
    cand = _streams(key, plan.candidate_streams, storage_options, plan.candidate_width, plan.candidate_dtype)
    slot = _Slot(key, BlockWorker(plan, ref, cand))
    with _LOCK:
        _SLOTS[ident] = slot
    return slot


def run_block_task(plan: PassPlan, key: str, storage_options: dict[str, Any], specs: list[BlockSpec]) -> list[BlockResult]:
    """A dask task: the partial results of ``specs`` (consecutive blocks of one compare)."""
    # One thread per block, as the threaded pass runs them: the cluster's workers are the parallelism.
    while True:
        slot = _slot(plan, key, storage_options)
        with slot.busy:
            if not slot.closed:  # else the compare's end closed it between the two lines: a new one
                return [slot.worker.run(spec) for spec in specs]


def _forget(key: str) -> None:
    """Run on every worker after a compare: close its stores and its threads' BlockWorkers, so an idle
    worker holds none of its rows or buffers. A thread still running a task of it (a cancelled
    compare) keeps its BlockWorker until its next task."""
    with _LOCK:
        stores = [_STORES.pop(k) for k in [k for k in _STORES if k[0] == key]]
        slots = [(ident, slot) for ident, slot in _SLOTS.items() if slot.key == key]
        for ident, slot in slots:
            if slot.busy.acquire(blocking=False):
                try:
                    slot.close()
                    del _SLOTS[ident]
                finally:
                    slot.busy.release()
    for store in stores:
        store.close()
