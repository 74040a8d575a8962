"""Reading aligned rows: any rows of a side's streams, in any order, into reused aligned buffers.

Rows of uncompressed chunk files are read straight into the output (only the rows asked for, by
``preadv``); other chunks are decoded whole, through a small LRU cache. Used by the plan (its samples)
and by every block of the streaming pass (:mod:`tracediff.compare.stream.one_pass`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracediff.compare.rows.index import RowIndex
from tracediff.store import ChunkFiles, TraceStream


class ChunkReader:
    """Gathers arbitrary rows of a list of streams: rows of uncompressed chunk files are read straight
    into the output (only the rows asked for); other chunks are decoded whole, through a small LRU
    cache. Not thread-safe: one per thread."""

    def __init__(self, streams: Sequence[TraceStream], max_chunks: int = 64, max_files: int | None = None,
                 compiled: bool = False) -> None:
        """``compiled``: rows of uncompressed chunk files are read by the compiled loop
        (:func:`tracediff.compare.rows.kernels.read_kernel`) where it runs."""
        self.streams = list(streams)
        self.cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.max_chunks = max_chunks
        self.bytes_read = 0
        self.files = ChunkFiles(limit=max(8, max_chunks) if max_files is None else max_files)
        if compiled:
            from tracediff.compare.rows.kernels import read_kernel  # noqa: PLC0415

            reads = read_kernel()
            self.files.runs_reader = reads.read_runs if reads is not None else None

    def close(self) -> None:
        self.files.close()
        self.cache.clear()

    def _chunk(self, stream: int, chunk: int) -> np.ndarray:
        key = (stream, chunk)
        data = self.cache.get(key)
        if data is not None:
            self.cache.move_to_end(key)
            return data
        data = self.streams[stream].read_chunk(chunk)
        self.bytes_read += data.nbytes
        self.cache[key] = data
        if len(self.cache) > self.max_chunks:
            self.cache.popitem(last=False)
        return data

    def runs_at(self, stream: np.ndarray, within: np.ndarray) -> RowRuns | None:
        """The rows ``within[k]`` of streams ``stream[k]`` (k = 0..n, the rows of a block in its order)
        as runs of consecutive stored rows in that order, their files open (run r: rows
        ``dest[r]..dest[r] + lengths[r]`` of the block), for the compiled loop that reads and measures
        them part by part (:func:`tracediff.compare.rows.fused.read_and_measure`). None where that loop
        cannot read them: no compiled reads here, chunks not plain files, or more chunk files than
        this reader keeps open (the block is then read with :meth:`gather_at`). The caller counts
        the bytes it reads in :attr:`bytes_read`."""
        n = stream.size
        if self.files.runs_reader is None or n == 0:
            return None
        single = len(self.streams) == 1
        rows_per_chunk = self.streams[0].chunk_rows if single else \
            np.array([s.chunk_rows for s in self.streams], dtype=np.int64)[stream]
        chunk = within // rows_per_chunk
        cut = (np.diff(within) != 1) | (np.diff(chunk) != 0)
        if not single:
            cut |= np.diff(stream) != 0
        dest = np.flatnonzero(np.r_[True, cut])
        lengths = np.diff(np.r_[dest, n])
        files = np.unique(chunk[dest] if single else stream[dest] * (int(chunk.max()) + 1) + chunk[dest])
        if files.size > self.files.limit:
            return None
        fds = np.empty(dest.size, dtype=np.int32)
        offsets = np.empty(dest.size, dtype=np.int64)
        for s in [0] if single else np.unique(stream[dest]).tolist():
            sel = slice(None) if single else np.flatnonzero(stream[dest] == s)
            opened = self.streams[s].open_runs(within[dest[sel]], lengths[sel], self.files)
            if opened is None:
                return None
            fds[sel], offsets[sel] = opened
        return RowRuns(fds, offsets, dest, lengths)

    def gather(self, index: RowIndex, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Raw values of RowIndex entries ``rows`` into ``out[:len(rows)]``."""
        rows = np.asarray(rows)
        streams = index.stream_of(rows)
        return self.gather_at(streams, index.row_of(rows, streams), out)

    def gather_at(self, stream: np.ndarray, within: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Raw values of the rows ``within[k]`` of streams ``stream[k]`` into ``out[:len(stream)]``."""
        n = stream.size
        if n == 0:
            return out[:0]
        single = len(self.streams) == 1
        for s in [0] if single else np.unique(stream).tolist():
            sel = np.arange(n) if single else np.flatnonzero(stream == s)
            st = self.streams[s]
            cr = st.chunk_rows
            w = within if single else within[sel]
            if st.reads_rows_directly:
                st.read_rows(w, out=out, dest=sel, files=self.files)
                self.bytes_read += int(sel.size) * out.itemsize * out.shape[1]
                continue
            chunks = w // cr
            for c in np.unique(chunks):
                part = sel[chunks == c]
                data = self._chunk(int(s), int(c))
                out[part] = data[within[part] - c * cr]
        return out[:n]


@dataclass(frozen=True)
class RowRuns:
    """A block's rows of one side as runs of consecutive stored rows (:meth:`ChunkReader.runs_at`):
    run r, ``lengths[r]`` rows at byte ``offsets[r]`` of the open file ``fds[r]``, goes to the block's
    rows ``dest[r]..dest[r] + lengths[r]``."""

    fds: np.ndarray  # int32
    offsets: np.ndarray  # int64
    dest: np.ndarray  # int64
    lengths: np.ndarray  # int64


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Each call's result, in order, the calls run on up to :func:`usable_cpus` threads (numpy's
    large kernels release the GIL; the plan's steps are independent numpy work). An exception is
    raised as the first failing call (in call order) raised it, after every call has ended."""
    workers = min(len(calls), usable_cpus())
    if workers <= 1:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with ThreadPoolExecutor(workers, thread_name_prefix="tracediff-plan") as ex:
        futures = [ex.submit(call) for call in calls]
    return [f.result() for f in futures]


def reference_files() -> int:
    """Open chunk files each streaming thread keeps for the reference: 512 where the process may
    open many files (reopening a chunk file costs ~25 us, and engine-ordered rows revisit hundreds of
    them), 64 under a low open-file limit."""
    try:
        import resource  # noqa: PLC0415  (POSIX only)

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 512 if soft == resource.RLIM_INFINITY or soft >= 8192 else 64


@dataclass(frozen=True)
class StreamLocation:
    """Where one writer group's rows are: the store's location (path or URL), tap, writer, and the
    committed rows the plan was made on."""

    location: str
    tap: str
    writer: str
    rows: int


def location_of(stream: TraceStream) -> StreamLocation:
    """A stream's :class:`StreamLocation`: its store's full URL (with any query string: ``str`` of a
    :class:`~tracediff.store.Location` leaves secrets out, for messages) or its local path."""
    loc = getattr(stream.store, "location", None)
    if loc is not None and getattr(loc, "remote", False):
        where = loc.url
    elif loc is not None and getattr(loc, "local", None) is not None:
        where = os.fspath(loc.local)
    else:
        where = os.fspath(stream.store.path)
    return StreamLocation(str(where), stream.tap, stream.writer, int(stream.rows))
