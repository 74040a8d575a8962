#!/usr/bin/env python
"""Recording benchmark: hook cost on a forward step, and durable writer throughput.

Run by hand (not a test)::

    python benchmarks/bench_record.py                 # full run, rewrites '## bench_record' in RESULTS.md
    python benchmarks/bench_record.py --quick         # smoke run (prints only, unless --out is given)

What it measures (DESIGN.md §7):

1. Step time of a draft-like block whose ``fc`` input is [rows, width] bf16 (default [4096, 6144],
   48 MiB a step): (a) no hook, (b) a forward pre-hook that only clones the input, (c) a tracediff
   ``Recorder`` with ``rec.tap(fc, capture="input")``, ``on_full="block"`` (nothing dropped; drops
   are reported anyway). Two blocks: the ``full`` one (fc 6144->2048, the real draft's shape, slow on a
   CPU without bf16 instructions) and a ``short`` one (the same captured input, fc 6144->256) where the
   hook's cost and the writer thread's competition for the cores are visible. Modes run in blocks of
   steps, in the order a,b,c then c,b,a (drift cancels); the first step of each block is warm-up.
2. Writer throughput, durable: the same batches written by ``TraceWriter.append`` (several codecs and
   chunk sizes), by ``torch.save`` one ``.pt`` per step (the peer approach, as SGLang's dumper does)
   and by ``np.save`` one ``.npy`` per step (about the disk's limit). The timed region ends after an
   fsync of every written file and directory. Cases are interleaved over rounds (order reversed every
   other round) and reported as medians, with the CPU seconds the process spent per GB (robust to other
   load) and the CPU load other processes put on the machine during each case.
3. The full recorder path end to end (capture -> queue -> writer thread -> committed): from the first
   capture until ``close()`` returns plus the final fsync.

All data lives under ``--dir`` (default: a fresh folder under benchmarks/_data, git-ignored) and is
deleted at the end, also on errors. ``--proposals`` adds experimental write paths (copies of the
TraceWriter write path patched here, not tracediff code) to test suggested changes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from results_md import write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

import tracediff
from tracediff.record.recorder import Recorder
from tracediff.store import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    DEFAULT_LABEL_CHUNK_ROWS,
    LABEL_FIELDS,
    TraceWriter,
    create_store,
    open_store,
)

HERE = Path(__file__).resolve().parent
SECTION = "## bench_record"
GB = 1e9


# ------------------------------------------------------------------------------------------ helpers
def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path``'s parent, for its own entry)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(path) for f in fs)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _busy_jiffies() -> int:
    with open("/proc/stat") as fh:
        parts = fh.readline().split()[1:]
    vals = [int(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals[:8]) - idle


_HZ = os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """CPU used by *other* processes while a case runs (in cores): total busy minus our own."""

    def __enter__(self) -> LoadMeter:
        self._busy0 = _busy_jiffies()
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        busy = (_busy_jiffies() - self._busy0) / _HZ
        own = time.process_time() - self._cpu0
        self.own_cpu = own
        self.wall = wall
        self.other_cores = max(0.0, (busy - own) / wall) if wall > 0 else 0.0


def wait_quiet(max_wait: float, threshold: float = 0.5) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``threshold`` cores; return it."""
    deadline = time.monotonic() + max_wait
    while True:
        with LoadMeter() as m:
            time.sleep(0.5)
        if m.other_cores < threshold or time.monotonic() >= deadline:
            return m.other_cores


def settle(pause: float) -> None:
    """Flush what earlier cases left dirty, then give the VM a moment (freed pages are reported to
    the host within ~2 s; starting every case from the same state keeps cases comparable)."""
    gc.collect()
    os.sync()
    time.sleep(pause)


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or not np.isfinite(x):
        return "-"
    return f"{x:.{digits}f}"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------ data
def make_batches(n: int, rows: int, width: int, seed: int = 0) -> list[torch.Tensor]:
    """Realistic-looking bf16 fc inputs: three concatenated hidden states of different scales (layer
    norms grow with depth), per-channel scales, a few outlier channels. Mantissas are noise, like in
    real activations, so codecs get only the exponent/sign redundancy."""
    g = torch.Generator().manual_seed(seed)
    seg = max(1, width // 3)
    col_scale = torch.empty(width)
    for k, s in enumerate((0.6, 2.0, 7.0)):
        col_scale[k * seg : (k + 1) * seg if k < 2 else width] = s
    col_scale *= torch.exp(0.35 * torch.randn(width, generator=g))
    outliers = torch.randint(0, width, (max(1, width // 512),), generator=g)
    col_scale[outliers] *= 40.0
    out = []
    for _ in range(n):
        x = torch.randn(rows, width, generator=g) * col_scale
        out.append(x.to(torch.bfloat16).contiguous())
    return out


def as_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def make_labels(rows: int, step: int) -> dict[str, np.ndarray]:
    seq_len = 1024
    pos = np.arange(rows, dtype=np.int64) % seq_len
    seq = np.arange(rows, dtype=np.int64) // seq_len + step * (rows // seq_len + 1)
    tok = (np.arange(rows, dtype=np.int64) * 7919 + step) % 128256
    return {
        "seq": seq,
        "position": pos,
        "token_id": tok,
        "next_token_id": np.roll(tok, -1),
        "step": np.full(rows, step, dtype=np.int64),
        "phase": np.full(rows, 1, dtype=np.int8),
        "valid": np.ones(rows, dtype=bool),
    }


# ------------------------------------------------------------------------------------------ forward
class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


class DraftBlock(torch.nn.Module):
    """The front of an EAGLE-3 draft: fc over 3 concatenated hidden states, then a norm and a gated
    activation (what the decoder layer starts with). The fc input is what tracediff records."""

    def __init__(self, width: int, fc_out: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, fc_out, bias=False)
        self.norm = RMSNorm(fc_out)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.fc(hidden)
        return torch.nn.functional.silu(self.norm(h)) * h


@dataclass
class StepResult:
    forward: str
    fc_out: int
    mode: str
    times: list[float] = field(default_factory=list)
    block_walls: list[float] = field(default_factory=list)  # first timed step .. close() returned
    drains: list[float] = field(default_factory=list)
    dropped_rows: int = 0
    rows: int = 0
    other_cores: list[float] = field(default_factory=list)


def bench_steps(
    args: argparse.Namespace, data_dir: Path, batches: list[torch.Tensor], forward: str, fc_out: int, steps: int
) -> dict[str, StepResult]:
    torch.manual_seed(0)
    block = DraftBlock(args.width, fc_out).to(torch.bfloat16).eval()
    order = ["none", "clone", "tracediff"] + (["tracediff+pool"] if args.proposals else [])
    results = {m: StepResult(forward, fc_out, m) for m in order}
    sink: list[Any] = [None]

    def clone_hook(_mod: torch.nn.Module, fargs: tuple) -> None:
        sink[0] = fargs[0].clone()  # kept until the next step, like a queue that holds the copy

    for rnd in range(args.rounds):
        for mode in order if rnd % 2 == 0 else order[::-1]:
            settle(args.pause)
            wait_quiet(args.quiet_wait)
            res = results[mode]
            handle = None
            rec = None
            store = data_dir / f"steps-{forward}-{rnd}.zarr"
            if mode == "clone":
                handle = block.fc.register_forward_pre_hook(clone_hook)
            elif mode.startswith("tracediff"):
                rec = Recorder(store, role="bench", on_full="block", handle_sigterm=False)
                if mode == "tracediff+pool":
                    patch_pooled_cpu_copy(rec)
                rec.tap(block.fc, "fc_in", capture="input", segment_size=args.width // 3)
            try:
                with LoadMeter() as meter, torch.inference_mode():
                    t_first = None
                    for i in range(steps + 1):  # step 0 is warm-up
                        x = batches[i % len(batches)]
                        t0 = time.perf_counter()
                        block(x)
                        dt = time.perf_counter() - t0
                        if i == 0:
                            t_first = time.perf_counter()
                        else:
                            res.times.append(dt)
                    t_close = time.perf_counter()
                    if rec is not None:
                        rec.close()
                        stats = rec.stats()["fc_in"]
                        res.dropped_rows += stats["dropped_rows"]
                        res.rows += stats["rows"]
                    t_end = time.perf_counter()
                res.drains.append(t_end - t_close)
                res.block_walls.append(t_end - (t_first or t_end))
                res.other_cores.append(meter.other_cores)
            finally:
                if handle is not None:
                    handle.remove()
                if rec is not None:
                    rec.close()
                sink[0] = None
                remove(store)
            print(
                f"  steps {forward:5s} {mode:9s} round {rnd}: median {median(res.times[-steps:]) * 1e3:8.1f} ms"
                f"  (other load {meter.other_cores:.2f} cores)",
                flush=True,
            )
    return results


# ------------------------------------------------------------------------------------------ writers
@dataclass
class WriterCase:
    name: str
    kind: str  # baseline / tracediff / proposal
    run: Callable[[Path, list[np.ndarray], int], None]
    note: str = ""
    store: bool = True  # writes a trace store (checked after the first round)


@dataclass
class WriterResult:
    case: WriterCase
    durable_gbps: list[float] = field(default_factory=list)
    buffered_gbps: list[float] = field(default_factory=list)
    cpu_s_per_gb: list[float] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)
    ratio: float = float("nan")


def case_np_save(path: Path, bits: list[np.ndarray], steps: int) -> None:
    path.mkdir()
    for i in range(steps):
        np.save(path / f"step{i:06d}.npy", bits[i % len(bits)])


def case_torch_save(path: Path, bits: list[np.ndarray], steps: int) -> None:
    path.mkdir()
    for i in range(steps):
        t = torch.from_numpy(bits[i % len(bits)].view(np.int16)).view(torch.bfloat16)
        torch.save(t, path / f"step{i:06d}.pt")


def trace_writer_case(compressor: str, chunk_rows: int, durable: bool = False, patch: Callable | None = None):
    def run(path: Path, bits: list[np.ndarray], steps: int) -> None:
        create_store(path, role="bench")
        w = TraceWriter(
            path,
            "fc_in",
            "w0",
            width=bits[0].shape[1],
            dtype="bfloat16",
            chunk_rows=chunk_rows,
            compressor=compressor,
            durable=durable,
        )
        if patch is not None:
            patch(w)
        for i in range(steps):
            w.append(bits[i % len(bits)], make_labels(bits[0].shape[0], i))
        w.close()

    return run


def recorder_case(compressor: str, chunk_rows: int, durable: bool = False):
    """capture -> queue -> writer thread -> committed, as a host would drive it (each capture clones)."""

    def run(path: Path, bits: list[np.ndarray], steps: int) -> None:
        tensors = [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bits]
        rec = Recorder(
            path,
            role="bench",
            on_full="block",
            chunk_rows=chunk_rows,
            compressor=compressor,
            durable=durable,
            handle_sigterm=False,
        )
        rec.declare("fc_in", segment_size=bits[0].shape[1] // 3)
        try:
            for i in range(steps):
                rec.labels(**make_labels(bits[0].shape[0], i))
                rec.capture("fc_in", tensors[i % len(tensors)])
        finally:
            rec.close()
        stats = rec.stats()["fc_in"]
        if stats["dropped_rows"] or rec.error:
            raise RuntimeError(f"recorder dropped {stats['dropped_rows']} rows / error {rec.error}")

    return run


# -- proposals: copies of the TraceWriter write path, patched here (tracediff itself is untouched) -----
def _fsync_drop(path: Path, drop: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop:
            # The pages are clean now: let the kernel reuse them for the next batch instead of taking
            # fresh ones (and keep the recording from evicting the host's own page cache).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def case_np_save_drop(path: Path, bits: list[np.ndarray], steps: int) -> None:
    path.mkdir()
    for i in range(steps):
        f = path / f"step{i:06d}.npy"
        np.save(f, bits[i % len(bits)])
        _fsync_drop(f, True)


def _use_zarr_write_path(w: TraceWriter) -> None:
    """The write path TraceWriter used before it wrote chunk files itself: every chunk through zarr."""
    w._direct = False


def _no_writeback_per_batch(w: TraceWriter) -> None:
    """The direct path without its per-batch writeback (fsync + page drop): pages stay cached."""
    w._writeback_min_bytes = float("inf")


def _patch_incremental_fsync(w: TraceWriter, drop: bool = False) -> None:
    """durable=True, but fsync only the chunk files this batch wrote (plus their folders), not the
    whole group at every commit (os.walk + fsync of every file so far: O(files) per commit).
    ``drop``: then drop the pages of the values chunks (labels are read back for merging)."""
    base = w.store_path / w.tap / w.writer
    _use_zarr_write_path(w)
    state = {"start": 0}
    orig_append = w.append

    def append(values: np.ndarray, labels: Any) -> None:
        state["start"] = w.counts.rows - w._tail_rows
        orig_append(values, labels)

    def commit(*_args: Any) -> None:
        if w.counts.rows:
            start, stop = state["start"], w.counts.rows
            cr, lab = w.chunk_rows, DEFAULT_LABEL_CHUNK_ROWS
            paths = [base / "values" / "c" / str(ci) / "0" for ci in range(start // cr, -(-stop // cr))]
            for name in LABEL_FIELDS:
                paths += [base / name / "c" / str(ci) for ci in range(start // lab, -(-stop // lab))]
            for f in [*paths, *{f.parent for f in paths}]:
                with contextlib.suppress(FileNotFoundError):
                    _fsync_drop(f, drop and f.name == "0" and f.parent.parent.name == "c")
        w._group.attrs.put(w._attrs())

    w.append = append  # type: ignore[method-assign]
    w._commit = commit  # type: ignore[method-assign]


class _CpuPool:
    """Reused host buffers for CPU captures (the recorder pools pinned buffers for CUDA only)."""

    def __init__(self, max_buffers: int = 8) -> None:
        import threading

        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._max = max_buffers

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            bucket = self._free.get((numel, dtype))
            if bucket:
                return bucket.pop()
        return torch.empty(numel, dtype=dtype)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            bucket = self._free.setdefault((buf.numel(), buf.dtype), [])
            if len(bucket) < self._max:
                bucket.append(buf)


def patch_pooled_cpu_copy(rec: Recorder) -> None:
    """[proposal] CPU captures copy into a reused buffer instead of a fresh clone each step."""
    pool = _CpuPool()
    rec._pool = pool  # type: ignore[assignment]
    orig = rec._copy_off_path

    def copy_off_path(flat: torch.Tensor, fresh: bool) -> tuple[torch.Tensor, Any, bool]:
        if flat.device.type != "cpu" or fresh:
            return orig(flat, fresh)
        buf = pool.get(flat.numel(), flat.dtype).view(flat.shape)
        buf.copy_(flat)
        return buf, None, True

    rec._copy_off_path = copy_off_path  # type: ignore[method-assign]


def writer_cases(args: argparse.Namespace) -> list[WriterCase]:
    cases = [
        WriterCase(
            "np.save, one .npy per step",
            "baseline",
            case_np_save,
            note="raw bytes: about the disk's limit",
            store=False,
        ),
        WriterCase(
            "torch.save, one .pt per step",
            "baseline",
            case_torch_save,
            note="the peer approach (SGLang dumper)",
            store=False,
        ),
        WriterCase(
            f"TraceWriter {DEFAULT_COMPRESSOR}, {DEFAULT_CHUNK_ROWS}-row chunks (default)",
            "tracediff",
            trace_writer_case(DEFAULT_COMPRESSOR, DEFAULT_CHUNK_ROWS),
            note="chunk files written directly, values written back + pages dropped per batch",
        ),
        WriterCase(
            "TraceWriter none, 256-row chunks, zarr write path (the previous default)",
            "tracediff",
            trace_writer_case("none", 256, patch=_use_zarr_write_path),
            note="as before the direct path (tracediff 442bd25)",
        ),
        WriterCase("TraceWriter none, 256-row chunks", "tracediff", trace_writer_case("none", 256)),
        WriterCase("TraceWriter none, 4096-row chunks", "tracediff", trace_writer_case("none", 4096)),
        WriterCase(
            f"TraceWriter lz4, {DEFAULT_CHUNK_ROWS}-row chunks",
            "tracediff",
            trace_writer_case("lz4", DEFAULT_CHUNK_ROWS),
            note="zarr write path",
        ),
        WriterCase(
            f"TraceWriter zstd, {DEFAULT_CHUNK_ROWS}-row chunks",
            "tracediff",
            trace_writer_case("zstd", DEFAULT_CHUNK_ROWS),
            note="zarr write path",
        ),
        WriterCase(
            f"TraceWriter none, {DEFAULT_CHUNK_ROWS}, durable=True",
            "tracediff",
            trace_writer_case("none", DEFAULT_CHUNK_ROWS, durable=True),
            note="fsync at every commit",
        ),
        WriterCase(
            f"Recorder end to end ({DEFAULT_COMPRESSOR}, {DEFAULT_CHUNK_ROWS})",
            "tracediff",
            recorder_case(DEFAULT_COMPRESSOR, DEFAULT_CHUNK_ROWS),
            note="capture (clone) -> queue -> writer -> close() + fsync",
        ),
        WriterCase(
            "Recorder end to end, durable=True",
            "tracediff",
            recorder_case("none", DEFAULT_CHUNK_ROWS, durable=True),
            note="close() returns durable",
        ),
    ]
    if args.proposals:
        cases += [
            WriterCase(
                "[reference] np.save + fsync + drop pages, per file",
                "proposal",
                case_np_save_drop,
                note="the disk's limit here (no fresh page-cache pages)",
                store=False,
            ),
            WriterCase(
                f"[proposal] direct path, {DEFAULT_CHUNK_ROWS}-row chunks, no writeback per batch",
                "proposal",
                trace_writer_case("none", DEFAULT_CHUNK_ROWS, patch=_no_writeback_per_batch),
                note="pages left in the page cache until the final fsync",
            ),
            WriterCase(
                "[proposal] zarr path, durable=True, fsync new files only",
                "proposal",
                trace_writer_case("none", 256, durable=True, patch=_patch_incremental_fsync),
            ),
            WriterCase(
                "[proposal] zarr path, durable=True, new files only + drop their pages",
                "proposal",
                trace_writer_case("none", 256, durable=True, patch=lambda w: _patch_incremental_fsync(w, drop=True)),
            ),
        ]
    return cases


def bench_writers(args: argparse.Namespace, data_dir: Path, bits: list[np.ndarray]) -> list[WriterResult]:
    cases = writer_cases(args)
    if args.cases:
        wanted = [s.strip().lower() for s in args.cases.split(",")]
        cases = [c for c in cases if any(w in c.name.lower() for w in wanted)]
    results = [WriterResult(c) for c in cases]
    raw = args.steps * bits[0].nbytes
    for rnd in range(args.writer_rounds):
        for res in results if rnd % 2 == 0 else results[::-1]:
            path = data_dir / f"w{rnd}-{uuid.uuid4().hex[:8]}"
            settle(args.pause)
            wait_quiet(args.quiet_wait)
            try:
                with LoadMeter() as meter:
                    t0 = time.perf_counter()
                    res.case.run(path, bits, args.steps)
                    t1 = time.perf_counter()
                    fsync_tree(path)
                    t2 = time.perf_counter()
                res.durable_gbps.append(raw / (t2 - t0) / GB)
                res.buffered_gbps.append(raw / (t1 - t0) / GB)
                res.cpu_s_per_gb.append(meter.own_cpu / (raw / GB))
                res.other_cores.append(meter.other_cores)
                if rnd == 0:
                    res.ratio = raw / tree_bytes(path)
                    if res.case.store:
                        _verify(path, bits, args.steps)
            finally:
                remove(path)
            print(
                f"  writer round {rnd} {res.case.name:48s} durable {res.durable_gbps[-1]:5.2f} GB/s"
                f"  buffered {res.buffered_gbps[-1]:5.2f}  cpu {res.cpu_s_per_gb[-1]:5.2f} s/GB"
                f"  other load {meter.other_cores:.2f}",
                flush=True,
            )
    return results


def _verify(path: Path, bits: list[np.ndarray], steps: int) -> None:
    """The store holds what was written (the last batch, bit for bit) and every row is committed."""
    with open_store(path) as store:
        (stream,) = store.tap_streams("fc_in")
        rows = bits[0].shape[0]
        assert stream.rows == steps * rows, (stream.rows, steps * rows)
        last = stream.read((steps - 1) * rows, steps * rows)
        assert np.array_equal(last, bits[(steps - 1) % len(bits)]), "store content differs from the input"


# ------------------------------------------------------------------------------------------ report
def machine_info(data_dir: Path) -> dict[str, str]:
    import numcodecs
    import zarr

    mem = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    fs = "?"
    with contextlib.suppress(OSError):
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ, opts = line.split()[:4]
            if str(data_dir.resolve()).startswith(mnt) and len(mnt) >= len(best):
                best, fs = mnt, f"{typ} on {dev} ({opts.split(',')[0]}{', discard' if 'discard' in opts else ''})"
    commit = "?"
    with contextlib.suppress(Exception):
        root = HERE.parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "tracediff"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        if dirty:
            commit += " + uncommitted changes in tracediff/"
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{os.cpu_count()} x {cpu} (torch threads: {torch.get_num_threads()})",
        "memory": mem,
        "kernel": platform.release(),
        "data dir filesystem": fs,
        "versions": (
            f"python {platform.python_version()}, torch {torch.__version__}, zarr {zarr.__version__}, "
            f"numcodecs {numcodecs.__version__}, numpy {np.__version__}, tracediff {tracediff.__version__} ({commit})"
        ),
    }


def first_touch_gbps(nbytes: int = 512 << 20) -> float:
    """How fast this machine hands out memory it has not touched recently (page faults; on a VM with
    free-page reporting every such page costs a fault in the host too). Page-cache pages of newly
    written files come from the same pool, so this bounds buffered writes."""
    time.sleep(3)  # let recently freed pages be reported, as they are between cases
    t0 = time.perf_counter()
    a = np.ones(nbytes, dtype=np.uint8)
    dt = time.perf_counter() - t0
    del a
    return nbytes / dt / GB


def render(
    args: argparse.Namespace,
    info: dict[str, str],
    steps: dict[str, dict[str, StepResult]],
    writers: list[WriterResult],
    elapsed: float,
    touch_gbps: tuple[float, float],
    load_before: float,
) -> str:
    batch_mib = args.rows * args.width * 2 / 2**20
    lines = [SECTION, ""]
    if args.quick:
        lines += ["**Quick smoke run: too small to be representative.**", ""]
    lines += [
        "Produced by `benchmarks/bench_record.py` (hook cost on a step, durable writer throughput). "
        "Rewritten as a whole by each run; other benchmarks keep their own `##` sections.",
        "",
        "```",
        "$ " + " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "```",
        "",
        "| machine | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += [
        f"| fresh-memory first touch | {touch_gbps[0]:.2f} GB/s at start, {touch_gbps[1]:.2f} at end "
        "(512 MiB, after 3 s idle) |",
        f"| load from other processes | {load_before:.2f} cores at start (see the per-case column) |",
        f"| run time | {elapsed / 60:.1f} min |",
        "",
        f"Per step: fc input [{args.rows}, {args.width}] bf16 = {batch_mib:.0f} MiB; writer cases write "
        f"{args.steps} steps = {args.steps * batch_mib / 1024:.2f} GiB each.",
        "",
    ]
    if steps:
        lines += [
            "### Step time",
            "",
            f"Median over the timed steps ({args.rounds} rounds per mode, blocks in the order none, clone, "
            "tracediff, then reversed; one warm-up step per block, not counted). "
            "`tracediff`: `Recorder(on_full='block')` + `rec.tap(block.fc, capture='input')`; the writer thread "
            "runs concurrently. *amortized* = wall time from the first timed step until `close()` returned, "
            "divided by the steps: it includes the writer draining what was still queued.",
            "",
            "| forward | mode | steps | ms/step (median) | min..max | vs no hook | vs clone-only | amortized ms/step "
            "| drain at close (s) | rows dropped | other load (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for fwd, res in steps.items():
            base = median(res["none"].times)
            clone = median(res["clone"].times)
            for mode, r in res.items():
                m = median(r.times)
                amort = sum(r.block_walls) / max(1, len(r.times))
                label = f"{fwd} (fc {args.width}->{r.fc_out})"
                lines.append(
                    f"| {label} | {mode} | {len(r.times)} | {m * 1e3:.1f} | {min(r.times) * 1e3:.0f}..{max(r.times) * 1e3:.0f} "
                    f"| {(m / base - 1) * 100:+.1f}% | {(m / clone - 1) * 100:+.1f}% | {amort * 1e3:.1f} "
                    f"| {fmt(max(r.drains), 2) if mode.startswith('tracediff') else '-'} "
                    f"| {r.dropped_rows if mode.startswith('tracediff') else '-'} | {fmt(median(r.other_cores))} |"
                )
        lines.append("")
    if writers:
        np_ref = next((w for w in writers if w.case.name.startswith("np.save")), None)
        pt_ref = next((w for w in writers if w.case.name.startswith("torch.save")), None)
        lines += [
            "### Writer throughput (durable)",
            "",
            f"GB/s of raw value rows (1 GB = 1e9 B), median of {args.writer_rounds} interleaved rounds; the timed "
            "region ends after fsync of every written file and folder. *buffered* = the same run before the "
            "final fsync. *CPU s/GB*: CPU time of this process (all threads) per GB, robust to other load. "
            "*ratio*: raw bytes / bytes on disk (whole store, labels included). TraceWriter cases write the 7 "
            "label columns too (~0.3% more bytes, not counted).",
            "",
            "| writer | durable GB/s | min..max | vs np.save | vs torch.save | buffered GB/s | CPU s/GB | ratio "
            "| other load (cores) | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w in writers:
            m = median(w.durable_gbps)
            vs_np = f"{m / median(np_ref.durable_gbps) * 100:.0f}%" if np_ref else "-"
            vs_pt = f"{m / median(pt_ref.durable_gbps) * 100:.0f}%" if pt_ref else "-"
            lines.append(
                f"| {w.case.name} | {m:.2f} | {min(w.durable_gbps):.2f}..{max(w.durable_gbps):.2f} | {vs_np} "
                f"| {vs_pt} | {median(w.buffered_gbps):.2f} | {median(w.cpu_s_per_gb):.2f} | {w.ratio:.2f} "
                f"| {fmt(median(w.other_cores))} | {w.case.note} |"
            )
        lines.append("")
    lines += [
        "### How to read this",
        "",
        "- The machine is a 2-vCPU VM shared with other work: *other load* is the CPU other processes used "
        "during each case (in cores). Step times and wall-clock GB/s move with it; *CPU s/GB* moves much less.",
        "- *Fresh-memory first touch* is how fast the VM hands out memory nobody touched in the last seconds: "
        "this VM returns freed pages to its host (virtio-balloon free page reporting), and each comes back "
        "through a host page fault; when it is slow (well under 1 GB/s), a 48 MiB `clone()` pays it every step, "
        "and so does every page-cache page of a newly written file: buffered writes of every method are then "
        "capped near that rate, whatever the disk does. Other processes freeing memory make it fast for a "
        "while, so it varies during a run. The `[reference]` row (fsync, then `posix_fadvise(DONTNEED)`, "
        "so the kernel reuses the same pages) shows what the disk itself does.",
        "- `tracediff+pool` and `[proposal]` rows are experiments patched in by this benchmark "
        "(`--proposals`), not tracediff's behaviour.",
        "",
        "### Targets (DESIGN.md §7)",
        "",
    ]
    lines += targets(steps, writers)
    lines.append("")
    return "\n".join(lines)


def targets(steps: dict[str, dict[str, StepResult]], writers: list[WriterResult]) -> list[str]:
    out = []
    for fwd, res in steps.items():
        clone = median(res["clone"].times)
        rec = median(res["tracediff"].times)
        over = (rec / clone - 1) * 100
        amort = sum(res["tracediff"].block_walls) / max(1, len(res["tracediff"].times))
        amort_clone = sum(res["clone"].block_walls) / max(1, len(res["clone"].times))
        times = res["clone"].times
        spread = (max(times) - min(times)) / clone * 100 if times else 0.0
        noisy = spread > 4 * abs(over)
        out.append(
            f"- recording overhead within 5% of the clone-only hook, `{fwd}` forward: "
            f"{'**met**' if over <= 5 else '**missed**'} ({over:+.1f}% median step; {(amort / amort_clone - 1) * 100:+.1f}% "
            f"amortized incl. drain{'; clone-only steps themselves spread over ' + f'{spread:.0f}% of their median, so this is within noise' if noisy else ''})"
        )
    by_name = {w.case.name: w for w in writers}
    default = next((w for w in writers if "(default)" in w.case.name), None)
    np_ref = next((w for w in writers if w.case.name.startswith("np.save")), None)
    pt_ref = next((w for w in writers if w.case.name.startswith("torch.save")), None)
    if default and pt_ref:
        d, p = median(default.durable_gbps), median(pt_ref.durable_gbps)
        out.append(
            f"- default writer at least 1.5x torch.save (issue #16): {'**met**' if d >= 1.5 * p else '**missed**'} "
            f"({d / p:.2f}x: {d:.2f} vs {p:.2f} GB/s)"
        )
        dc, pc = median(default.cpu_s_per_gb), median(pt_ref.cpu_s_per_gb)
        out.append(
            f"- default writer at no more CPU per GB than torch.save: {'**met**' if dc <= pc else '**missed**'} "
            f"({dc:.2f} vs {pc:.2f} CPU s/GB)"
        )
    if default and np_ref:
        d, n = median(default.durable_gbps), median(np_ref.durable_gbps)
        out.append(
            f"- default writer at least 80% of np.save: {'**met**' if d >= 0.8 * n else '**missed**'} "
            f"({d / n * 100:.0f}%: {d:.2f} vs {n:.2f} GB/s)"
        )
    del by_name
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=32, help="batches (steps) per writer case (default 32: 1.5 GiB)")
    p.add_argument("--rows", type=int, default=4096, help="rows per step (default 4096)")
    p.add_argument("--width", type=int, default=3 * 2048, help="fc input width (default 6144 = 3 x 2048)")
    p.add_argument(
        "--fwd-steps",
        type=int,
        default=None,
        help="timed forward steps per mode and round (default 3 for the full forward, 8 for the short one)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of the step-time modes (default 2: a,b,c,c,b,a)")
    p.add_argument("--writer-rounds", type=int, default=3, help="interleaved rounds of writer cases (default 3)")
    p.add_argument("--forwards", default="full,short", help="step-time blocks to run: full,short (or 'none')")
    p.add_argument("--short-fc-out", type=int, default=256, help="fc out_features of the short forward (default 256)")
    p.add_argument("--cases", default="", help="only writer cases whose name contains one of these (comma list)")
    p.add_argument("--skip-writers", action="store_true", help="step time only")
    p.add_argument("--proposals", action="store_true", help="add experimental write paths (patched copies)")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of settling (after os.sync) before each case")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=10.0,
        help="wait up to this long before a case for other processes to use < 0.5 cores (default 10)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default benchmarks/RESULTS.md; --quick prints only unless --out is given)",
    )
    p.add_argument("--dir", type=Path, default=None, help="data folder (default: new folder under benchmarks/_data)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 4)
        args.rows = min(args.rows, 512)
        args.rounds = 1
        args.writer_rounds = 1
        args.pause = 0.0
        args.quiet_wait = 0.0
        args.fwd_steps = args.fwd_steps or 2
    if args.out is None and not args.quick:
        args.out = HERE / "RESULTS.md"
    if args.steps < 1 or args.rows < 1 or args.width < 3:
        p.error("--steps, --rows must be >= 1 and --width >= 3")
    return args


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks: the data folder is deleted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t_start = time.perf_counter()
    batch_bytes = args.rows * args.width * 2
    needed = max(args.steps, (args.fwd_steps or 8) + 1) * batch_bytes
    base = args.dir if args.dir is not None else HERE / "_data"
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < 3 * needed:
        print(
            f"refusing to run: {base} has {free / 2**30:.1f} GiB free, need 3 x {needed / 2**30:.1f} GiB",
            file=sys.stderr,
        )
        return 2
    data_dir = Path(tempfile.mkdtemp(prefix="bench_record-", dir=base))
    print(f"data in {data_dir} ({free / 2**30:.0f} GiB free; peak use about {needed / 2**30:.2f} GiB)", flush=True)
    try:
        info = machine_info(data_dir)
        load_before = wait_quiet(0)
        touch0 = first_touch_gbps()
        print(f"fresh-memory first touch: {touch0:.2f} GB/s; other load {load_before:.2f} cores", flush=True)
        batches = make_batches(4, args.rows, args.width)
        bits = [as_bits(b) for b in batches]
        steps: dict[str, dict[str, StepResult]] = {}
        forwards = [f for f in args.forwards.split(",") if f and f != "none"]
        for fwd in forwards:
            if fwd not in ("full", "short"):
                raise SystemExit(f"unknown forward {fwd!r}")
            fc_out = 2048 if fwd == "full" else args.short_fc_out
            if args.quick:
                fc_out = min(fc_out, 256)
            n = args.fwd_steps or (3 if fwd == "full" else 8)
            print(f"step time, {fwd} forward (fc {args.width}->{fc_out}), {n} steps x {args.rounds} rounds", flush=True)
            steps[fwd] = bench_steps(args, data_dir, batches, fwd, fc_out, n)
        writers: list[WriterResult] = []
        if not args.skip_writers:
            print(f"writer throughput, {args.steps} steps a case, {args.writer_rounds} rounds", flush=True)
            writers = bench_writers(args, data_dir, bits)
        touch1 = first_touch_gbps()
        elapsed = time.perf_counter() - t_start
        section = render(args, info, steps, writers, elapsed, (touch0, touch1), load_before)
        print()
        print(section)
        if args.out is not None:
            write_section(args.out, section, SECTION)
            print(f"wrote section {SECTION!r} of {args.out}")
    finally:
        remove(data_dir)
        with contextlib.suppress(OSError):
            base.rmdir()  # only if empty
    return 0


if __name__ == "__main__":
    sys.exit(main())
