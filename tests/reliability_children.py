"""Bodies of the processes the reliability tests start: recorders killed at chosen points, and
recorders that write one store side by side.

A forked or spawned child imports this module to find its target, so it imports nothing heavy at
module level: torch, zarr and tracediff are imported inside the functions.

The data is deterministic from the batch index (``crash_batch``, ``crash_labels``), so the parent can
say bit for bit what every committed batch must hold without asking the child.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

CRASH_WIDTH = 40
CRASH_VOCAB = 1000
PHASE_BYTES = 64  # the phase file: what the writer was doing, readable after a SIGKILL


def wait_for_commit(commit_file: Path, batch: int, rec: Any, poll: float = 0.001, timeout: float = 30) -> None:
    """Poll the commit record on disk (zarr writes it atomically) until it shows batch ``batch``:
    the proof that the batch is durable, which a child logs for its parent."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            committed = json.loads(commit_file.read_text())["attributes"]["commit"]["batches"]
        except FileNotFoundError:  # the writer thread has not created its group yet
            committed = 0
        if committed > batch:
            return
        if rec.error or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch} was never committed: {rec.error}")
        time.sleep(poll)


# ------------------------------------------------------------------------- deterministic data
def crash_batch(k: int, n: int) -> np.ndarray:
    """Float32 rows of batch ``k``: seeded by the index, so every batch differs from every other."""
    return np.random.default_rng(k).standard_normal((n, CRASH_WIDTH), dtype=np.float32)


def crash_labels(k: int, n: int) -> dict[str, Any]:
    """Labels of batch ``k`` as handed to ``Recorder.labels``."""
    rows = np.arange(n)
    token = (k * 31 + rows) % CRASH_VOCAB
    return {
        "seq": k,
        "position": rows,
        "token_id": token,
        "next_token_id": (token + 1) % CRASH_VOCAB,
        "step": k,
        "phase": "prefill" if k % 2 == 0 else "decode",
        "valid": rows % 7 != 3,
    }


def stored_crash_rows(sizes: list[int], dtype: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What the store must hold after the batches ``sizes``: values as stored (bf16 as uint16 bits,
    rounded by torch as the recorder's tensors are) and every label column."""
    import torch  # noqa: PLC0415

    phases = ["unknown", "train", "prefill", "extend", "draft_extend", "decode", "verify", "idle"]
    width = CRASH_WIDTH
    values = [crash_batch(k, n) for k, n in enumerate(sizes)]
    flat = np.concatenate(values) if values else np.empty((0, width), np.float32)
    if dtype == "bfloat16":
        flat = torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    labels: dict[str, list[np.ndarray]] = {}
    for k, n in enumerate(sizes):
        for name, value in crash_labels(k, n).items():
            if name == "phase":
                value = phases.index(value)
            labels.setdefault(name, []).append(np.broadcast_to(np.asarray(value), (n,)))
    dtypes = {"phase": np.int8, "valid": np.bool_}
    columns = {
        name: (np.concatenate(labels[name]) if sizes else np.empty(0)).astype(dtypes.get(name, np.int64))
        for name in ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
    }
    return flat, columns


# ------------------------------------------------------------------------------ kill points
class KillSwitch:
    """Watches this process's writes to one store and SIGKILLs the process at a planned point.

    Every file zarr writes goes through ``zarr.storage._local._put`` (write a temporary file, rename
    it over the old one), every chunk file the writer's direct path writes (uncompressed stores)
    through ``tracediff.store.writer._put_chunk`` (the same, without zarr), and every chunk zarr
    removes through ``LocalStore.delete``; the switch wraps all three, and the :class:`TraceWriter`
    methods that frame them, so each write has a *phase*:
    ``<section>:<file kind>``, e.g. ``append:values_chunk``, ``commit:commit_record``,
    ``close:array_meta``. A kill point is the ``n``-th write of one phase (``before`` it,
    ``middle``: half of its temporary file written, or ``after`` it) or the ``n``-th call of a
    writer method (``before`` or ``after``). The current phase is kept in a small shared file so the
    parent can tell what an externally timed kill interrupted.
    """

    SECTIONS = {"__init__": "create_writer", "append": "append", "_commit": "commit", "close": "close"}

    def __init__(self, store: str, kill: dict[str, Any] | None, phase_file: str | None) -> None:
        self.root = os.path.abspath(store)
        self.kill = kill
        self.section = "idle"
        self.puts: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._phase: mmap.mmap | None = None
        if phase_file:
            with open(phase_file, "wb") as fh:
                fh.write(b" " * PHASE_BYTES)
            with open(phase_file, "r+b") as fh:
                self._phase = mmap.mmap(fh.fileno(), PHASE_BYTES)
        self.mark("start")

    def mark(self, phase: str) -> None:
        if self._phase is not None:
            self._phase[:] = phase.encode()[:PHASE_BYTES].ljust(PHASE_BYTES)

    @staticmethod
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered before this returns

    def phase_of(self, path: os.PathLike[str] | str) -> str:
        parts = os.path.relpath(os.fspath(path), self.root).split(os.sep)
        if parts[-1] == "zarr.json":
            kind = {1: "root_meta", 2: "tap_group", 3: "group_meta", 4: "array_meta"}.get(len(parts), "other")
            if kind == "group_meta" and self.section in ("commit", "close_commit"):
                kind = "commit_record"
        elif len(parts) >= 5 and parts[3] == "c":
            kind = "values_chunk" if parts[2] == "values" else "labels_chunk"
        else:
            kind = "other"
        return f"{self.section}:{kind}"

    def reach(self, phase: str) -> str | None:
        """Count one write of ``phase``, mark it as the current phase and die now if this is the kill
        point's "before"; returns the kill point's "when" for this write ("middle", "after", None)."""
        with self._lock:
            self.puts[phase] += 1
            when = self._hit("put", phase, self.puts[phase])
        self.mark(phase)
        if when == "before":
            self.die()
        return when

    def _hit(self, point: str, key: str, count: int) -> str | None:
        k = self.kill
        if k and k["point"] == point and k["target"] == key and k["n"] == count:
            return str(k["when"])
        return None

    # -- wrappers ------------------------------------------------------------------------------
    def install(self) -> None:
        import zarr.storage._local as local  # noqa: PLC0415

        import tracediff.record.recorder  # noqa: PLC0415
        import tracediff.store.writer as writer_module  # noqa: PLC0415
        from tracediff.store import TraceWriter  # noqa: PLC0415

        switch = self
        put, delete, put_chunk = local._put, local.LocalStore.delete, writer_module._put_chunk

        def watched_put(path: Path, value: Any, exclusive: bool = False) -> int:
            phase = switch.phase_of(path)
            when = switch.reach(phase)
            if when == "middle":  # what zarr's atomic write leaves when killed halfway through it
                data = memoryview(value.as_buffer_like()).cast("B")
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path.with_suffix(f".{uuid.uuid4().hex}.partial"), "wb") as fh:
                    fh.write(data[: len(data) // 2])
                switch.die()
            written = put(path, value, exclusive=exclusive)
            if when == "after":
                switch.die()
            switch.mark(switch.section)
            return written

        async def watched_delete(store: Any, key: str) -> None:
            phase = switch.phase_of(store.root / key).rsplit(":", 1)[0] + ":delete"
            when = switch.reach(phase)
            await delete(store, key)
            if when == "after":
                switch.die()
            switch.mark(switch.section)

        def watched_put_chunk(path: Path, data: Any) -> None:
            phase = switch.phase_of(path)
            when = switch.reach(phase)
            if when == "middle":  # what the direct path's atomic write leaves when killed halfway
                raw = memoryview(data if isinstance(data, bytes) else np.ascontiguousarray(data)).cast("B")
                with open(path.with_suffix(f".{uuid.uuid4().hex}.partial"), "wb") as fh:
                    fh.write(raw[: len(raw) // 2])
                switch.die()
            put_chunk(path, data)
            if when == "after":
                switch.die()
            switch.mark(switch.section)

        local._put = watched_put
        local.LocalStore.delete = watched_delete
        writer_module._put_chunk = watched_put_chunk

        def framed(name: str, section: str) -> None:
            method = getattr(TraceWriter, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                switch.calls[name] += 1
                when = switch._hit("call", name, switch.calls[name])
                outer = switch.section
                # The final commit, from close, is a phase of its own (it writes status "closed").
                switch.section = "close_commit" if section == "commit" and outer == "close" else section
                switch.mark(switch.section)
                if when == "before":
                    switch.die()
                try:
                    result = method(*args, **kwargs)
                finally:
                    switch.section = outer
                    switch.mark(outer)
                if when == "after":
                    switch.die()
                return result

            setattr(TraceWriter, name, wrapper)

        for name, section in self.SECTIONS.items():
            framed(name, section)

        create_store = tracediff.record.recorder.create_store

        def watched_create_store(*args: Any, **kwargs: Any) -> Any:
            switch.section = "create_store"
            try:
                return create_store(*args, **kwargs)
            finally:
                switch.section = "idle"
                switch.mark("idle")

        tracediff.record.recorder.create_store = watched_create_store


def _write_json(path: str, obj: Any) -> None:
    Path(path + ".tmp").write_text(json.dumps(obj))
    os.replace(path + ".tmp", path)  # the parent reads it whole or not at all


def record_with_kill_point(store: str, log: str, phase_file: str, plan: dict[str, Any]) -> None:
    """Record ``plan["sizes"]`` batches through a real forward hook, close, and die at the kill point.

    The log says ``begin k`` before batch k is handed to the recorder and ``done k`` once the commit
    record on disk shows it; ``created`` once the store exists; ``close`` / ``closed`` around
    ``Recorder.close``. Without a kill point (``plan["kill"]`` None) the run is the reference: it
    writes its write counts (per phase, cumulative after each batch and for close) to
    ``plan["counts_out"]``.
    """
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415
    import tracediff.store.writer  # noqa: PLC0415

    switch = KillSwitch(store, plan.get("kill"), phase_file)
    switch.install()
    if plan.get("label_chunk_rows"):
        # Small label chunks make small stores cross label chunk boundaries too.
        tracediff.store.writer.DEFAULT_LABEL_CHUNK_ROWS = int(plan["label_chunk_rows"])
    dtype = getattr(torch, plan["dtype"])
    layer = torch.nn.Linear(CRASH_WIDTH, 2, dtype=dtype)
    per_batch: list[dict[str, int]] = []
    with open(log, "a") as out:

        def say(line: str) -> None:
            out.write(line + "\n")
            out.flush()

        say("start")
        rec = tracediff.record(
            store,
            role="killed",
            chunk_rows=plan["chunk_rows"],
            compressor=plan["compressor"],
            durable=plan["durable"],
            on_full="block",
            handle_sigterm=False,
        )
        say("created")
        rec.tap(layer, "fc_in")
        commit_file = Path(store) / "fc_in" / rec.writer_name / "zarr.json"
        for k, n in enumerate(plan["sizes"]):
            say(f"begin {k}")
            rec.labels(**crash_labels(k, n))
            with torch.no_grad():
                layer(torch.from_numpy(crash_batch(k, n)).to(dtype))
            wait_for_commit(commit_file, k, rec, poll=0.0005)
            # A pause before saying so: a kill right after the commit record's rename then finds
            # the batch committed but not logged (the one in flight), the case the parent allows.
            time.sleep(0.002)
            say(f"done {k}")
            per_batch.append(dict(switch.puts))
        say("close")
        before_close = Counter(switch.puts)
        rec.close()
        say("closed")
    if plan.get("counts_out"):
        close = {p: c - before_close[p] for p, c in switch.puts.items() if c - before_close[p]}
        calls = dict(switch.calls)
        _write_json(
            plan["counts_out"], {"per_batch": per_batch, "close": close, "calls": calls, "all": dict(switch.puts)}
        )


# ------------------------------------------------------------------------ concurrent writers
WRITER_TAPS = {"fc_in": ("float32", 24), "aux": ("bfloat16", 16)}


def encoded_rows(process: int, batch: int, n: int, width: int) -> np.ndarray:
    """Rows that name themselves: columns 0..2 hold (process, batch, row), exact in bf16 below 256."""
    rows = np.zeros((n, width), dtype=np.float32)
    rows[:, 0] = process
    rows[:, 1] = batch
    rows[:, 2] = np.arange(n)
    rows[:, 3:] = np.linspace(-1.0, 1.0, width - 3, dtype=np.float32)[None, :] * (process + 1)
    return rows


def record_side_by_side(store: str, process: int, sizes: list[int], ready: Any, go: Any, report: str) -> None:
    """One of several processes recording into ``store`` at once (like SGLang's TP schedulers):
    two taps through the real recorder, its own writer group per tap. Waits for ``go`` so that all
    processes create their tap and writer groups at the same moment; reports what it sent."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    torch.set_num_threads(1)
    layers = {
        tap: torch.nn.Linear(width, 2, dtype=getattr(torch, dtype)) for tap, (dtype, width) in WRITER_TAPS.items()
    }
    rec = tracediff.record(
        store,
        append=True,
        role="server",
        rank=process,
        world_size=8,
        chunk_rows=16,
        on_full="block",
        handle_sigterm=False,
    )
    for tap, layer in layers.items():
        rec.tap(layer, tap)
    ready.set()
    if not go.wait(120):
        raise RuntimeError("the parent never said go")
    sent: dict[str, list[int]] = {tap: [] for tap in layers}
    with torch.no_grad():
        for b, n in enumerate(sizes):
            for tap, layer in layers.items():
                rec.labels(seq=process * 1000 + b, position=np.arange(n), token_id=process, step=b)
                dtype, width = WRITER_TAPS[tap]
                layer(torch.from_numpy(encoded_rows(process, b, n, width)).to(getattr(torch, dtype)))
                sent[tap].append(n)
    rec.close()
    _write_json(report, {"writer": rec.writer_name, "sent": sent, "stats": rec.stats(), "error": rec.error})


# ------------------------------------------------------------------- shared objects, created at once
def create_groups_at_once(base: str, process: int, rounds: int, barrier: Any, results: Any) -> None:
    """One of several processes that, in each round, join store ``<base>/r<round>.zarr`` (as
    ``record --append`` does: the root created if absent) and create their writer group in its one
    tap, all released by ``barrier`` at the same moment: the shared root and tap group are created
    by whichever process comes first while the others find, or are creating, the same objects.
    Puts ``(process, round, rows committed, error or None)`` on ``results`` for every round."""
    from tracediff.store import TraceWriter, create_store  # noqa: PLC0415
    from tracediff.store.location import Location  # noqa: PLC0415
    from tracediff.store.remote_writer import RemoteTraceWriter  # noqa: PLC0415

    rows = encoded_rows(process, 0, 5, 8)
    for r in range(rounds):
        url = f"{base.rstrip('/')}/r{r}.zarr"
        loc = Location.of(url)
        barrier.wait(timeout=120)
        try:
            create_store(loc if loc.remote else url, role="node", join=True)
            cls = RemoteTraceWriter if loc.remote else TraceWriter
            writer = cls(loc if loc.remote else url, "fc_in", f"p{process}", width=8, dtype="float32", chunk_rows=4)
            writer.append(rows, {"seq": np.full(5, process), "position": np.arange(5)})
            writer.close()
            results.put((process, r, writer.counts.rows, None))
        except Exception as exc:  # noqa: BLE001  (reported to the parent, which fails the test with it)
            results.put((process, r, 0, f"{type(exc).__name__}: {exc}"))


def race_group_creation(base: str, processes: int, rounds: int) -> list[tuple[int, int, int, str | None]]:
    """Run :func:`create_groups_at_once` in ``processes`` spawned processes (the parent side):
    every outcome, sorted by round and process."""
    import multiprocessing  # noqa: PLC0415

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=create_groups_at_once, args=(base, p, rounds, barrier, results)) for p in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=300) for _ in range(processes * rounds)]
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return sorted(outcomes, key=lambda o: (o[1], o[0]))
