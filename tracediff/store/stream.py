"""One (tap, writer) group opened for reading: :class:`TraceStream`, the committed rows read in
bounded chunks (straight from the chunk files where they hold plain bytes)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.errors import (
    CorruptStoreError,
    UsageError,
    first_line,
)
from tracediff.store.files import ChunkFiles, open_chunk_file, open_plain_file, read_error
from tracediff.store.format import LABEL_DTYPES, LABEL_FIELDS, MAX_CHUNK_BYTES, VALUE_DTYPES, decode_values
from tracediff.store.location import remote_error
from tracediff.store.row_model import RowModel
from tracediff.store.row_model import from_json as row_model_from_json

#: Chunks of a remote store that :meth:`TraceStream.read_chunk` fetches together: at most this
#: many, and at most READ_AHEAD_BYTES of them.
READ_AHEAD_CHUNKS = 16
READ_AHEAD_BYTES = 64 << 20
#: Bytes of out-of-order rows :meth:`TraceStream.read_rows` moves to their places at a time (under
#: glibc's 1 MiB mmap threshold that the tracediff program sets: the copy reuses heap memory).
_SCATTER_BYTES = 256 << 10
#: Rows at least this wide are read straight to their places, one read per run of consecutive
#: destinations, never staged (a ``pread`` costs ~1 us; copying a 24 KiB row again ~5 us: at 3 GiB
#: of 3 x 4096 the reference side, read in engine order, took 2.4x the candidate's time staged).
_DIRECT_ROW_BYTES = 4096


def _within(values: np.ndarray, bound: int) -> bool:
    return values.size == 0 or (int(values.min()) >= -bound and int(values.max()) < bound)


def compact_int(values: np.ndarray, bound: int) -> np.ndarray:
    """Integer ``values`` as int32 when every one lies in ``[-bound, bound)``, else as int64 (the same
    values): the row index's compact label columns (:func:`tracediff.compare.rows.index.compact`)."""
    return values.astype(np.int32 if _within(values, bound) else np.int64, copy=False)


class _Column:
    """A label column filled chunk by chunk. With a ``bound``, an integer column is held as int32
    while every value lies in ``[-bound, bound)`` and widened to int64 at the first chunk that holds
    another (the index's compact columns, :func:`tracediff.compare.rows.index.compact`, without a whole
    int64 copy of the column). Only the first ``committed`` rows count: the last chunk's padding
    never widens the column."""

    def __init__(self, rows: int, dtype: np.dtype, bound: int | None, committed: int) -> None:
        self.bound, self.committed = bound, committed
        self.data = np.empty(rows, dtype=np.int32 if bound is not None else dtype)

    def put(self, start: int, values: np.ndarray) -> None:
        if (self.data.dtype == np.int32 and self.bound is not None
                and not _within(values[: max(0, self.committed - start)], self.bound)):
            wide = np.empty(self.data.shape, dtype=np.int64)
            wide[:start] = self.data[:start]
            self.data = wide
        self.data[start : start + values.size] = values


@dataclass
class TraceStream:
    """The committed rows of one (tap, writer) group, read lazily and in bounded chunks."""

    #: The :class:`~tracediff.store.reader.TraceStore` this group belongs to (not imported here: the
    #: reader opens streams, so this module stays below it).
    store: Any
    tap: str
    writer: str
    attrs: dict[str, Any]
    rows: int
    width: int
    dtype: str
    chunk_rows: int
    _group: Any = field(repr=False)  # array name -> zarr array, opened by exact path after validation
    _values_raw: bool = field(default=False, repr=False)  # values chunks hold plain bytes (no codec)
    _values_endian: str = field(default="little", repr=False)
    #: label name -> (byte order, chunk rows) for label arrays read straight from their zstd chunk
    #: files (a folder store whose label codecs are exactly bytes + zstd); others go through zarr.
    _label_direct: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)
    #: Of those, in a local store, the ones whose chunks decode in less time than the Python work around
    #: each (see :data:`tracediff.store.reader.LIGHT_LABEL_RATIO`): read them one after the other.
    light_labels: frozenset[str] = field(default=frozenset(), repr=False)

    @property
    def commit(self) -> dict[str, Any]:
        return dict(self.attrs.get("commit") or {})

    @property
    def segment_size(self) -> int | None:
        size = self.attrs.get("segment_size")
        return int(size) if isinstance(size, int) and size > 0 else None

    @property
    def segment_labels(self) -> list[str] | None:
        labels = self.attrs.get("segment_labels")
        return [str(x) for x in labels] if isinstance(labels, list) else None

    @property
    def row_model(self) -> RowModel | None:
        """The stored row model (the reader checked it), None when the writer stored none."""
        stored = self.attrs.get("row_model")
        return None if stored is None else row_model_from_json(stored)

    @property
    def seq_names(self) -> dict[int, str]:
        names = self.commit.get("seq_names") or {}
        return {int(v): str(k) for k, v in names.items()} if isinstance(names, dict) else {}

    def label(self, name: str, compact_below: int | None = None) -> np.ndarray:
        """One committed label column as numpy (small: 8 bytes a row). With ``compact_below``, an
        integer column is returned as int32 when every value lies in ``[-compact_below,
        compact_below)``, else as int64 (the same values); columns read straight from their chunk
        files are then decoded chunk by chunk into the int32 column, without an int64 copy of it."""
        if name not in LABEL_FIELDS:
            raise UsageError(f"unknown label field {name!r}; fields: {', '.join(LABEL_FIELDS)}")
        where = f"{self.store.path}/{self.tap}/{self.writer}/{name}"
        arr = self._group.get(name)
        if arr is None:
            raise CorruptStoreError(f"{where}: label array is missing")
        if arr.ndim != 1 or arr.shape[0] < self.rows:
            raise CorruptStoreError(f"{where}: has shape {arr.shape}, expected at least {self.rows} rows")
        dtype = LABEL_DTYPES[name]
        bound = compact_below if dtype == np.int64 else None
        if self.rows == 0:
            return np.empty(0, dtype=np.int32 if bound is not None else dtype)
        direct = self._label_direct.get(name)
        if direct is not None and direct[1] == arr.chunks[0]:
            data = self._read_label_direct(name, *direct, bound)
        else:
            data = self._read_array(name, np.arange(0, -(-self.rows // arr.chunks[0])), lambda a: a[: self.rows])
            if data.shape == (self.rows,) and data.dtype == dtype and bound is not None:
                data = compact_int(data, bound)
        if data.shape != (self.rows,) or (data.dtype != dtype and not (bound is not None and data.dtype == np.int32)):
            raise CorruptStoreError(f"{where}: read {data.shape} {data.dtype}, expected ({self.rows},) {dtype}")
        return data

    def labels(self, names: Sequence[str] = LABEL_FIELDS) -> dict[str, np.ndarray]:
        return {name: self.label(name) for name in names}

    def _read_label_direct(self, name: str, endian: str, chunk_rows: int, bound: int | None = None) -> np.ndarray:
        """One label column decoded straight from its zstd chunk files (zarr's per-chunk machinery
        costs ~0.65 ms a chunk; this, the file read and the decompression). The same checks as
        through zarr: every chunk a plain file, each decoding to exactly one chunk of the dtype.
        ``bound``: as :meth:`label`'s ``compact_below``."""
        from numcodecs import Zstd  # noqa: PLC0415

        dtype = LABEL_DTYPES[name].newbyteorder("<" if endian == "little" else ">")
        expect = chunk_rows * dtype.itemsize
        count = -(-self.rows // chunk_rows)
        out = _Column(count * chunk_rows, LABEL_DTYPES[name], bound, self.rows)
        codec = Zstd()
        if self.store._remote is not None:  # the chunk objects, fetched together
            keys = [f"{self.tap}/{self.writer}/{name}/c/{index}" for index in range(count)]
            blobs = self.store._chunk_objects(keys, None, MAX_CHUNK_BYTES)
            for index, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
                out.put(index * chunk_rows, self._decode_label(codec, blob, self.store._display(key), expect, dtype))
            return out.data[: self.rows]
        folder = os.fspath(self.store.path / self.tap / self.writer / name / "c")
        for index in range(count):
            path = f"{folder}/{index}"
            opened = open_plain_file(path)
            if opened is None:
                raise CorruptStoreError(f"{path}: chunk file is missing (deleted?) but holds committed rows")
            fd, size = opened
            try:
                if size == 0 or size > MAX_CHUNK_BYTES:
                    raise CorruptStoreError(f"{path}: chunk file holds {size} bytes (truncated or foreign file?)")
                blob = os.pread(fd, size, 0)
            except OSError as exc:
                raise read_error(path, exc) from exc
            finally:
                os.close(fd)
            out.put(index * chunk_rows, self._decode_label(codec, blob, path, expect, dtype))
        return out.data[: self.rows]

    @staticmethod
    def _decode_label(codec: Any, blob: bytes, where: str, expect: int, dtype: np.dtype) -> np.ndarray:
        try:
            raw = codec.decode(blob)
        except Exception as exc:  # noqa: BLE001  (the codec raises several types for a bad frame)
            raise CorruptStoreError(
                f"{where}: chunk cannot be decoded ({type(exc).__name__}: {first_line(exc)})"
            ) from exc
        if len(raw) != expect:
            raise CorruptStoreError(f"{where}: chunk cannot be decoded to {expect} bytes (it holds {len(raw)})")
        return np.frombuffer(raw, dtype=dtype)

    def _chunk_key(self, name: str, index: int) -> str:
        return f"{self.tap}/{self.writer}/{name}/c/{index}" + ("/0" if name == "values" else "")

    def _read_array(self, name: str, chunks: np.ndarray, select: Any) -> np.ndarray:
        """``select(zarr_array)`` as numpy, once the chunk files it reads (``chunks``, sorted indices)
        have been checked to be plain files of a plausible size (no FIFO, loop or hole reaches zarr).
        A chunk that zarr cannot decode is named in the error: the one that fails on its own."""
        arr = self._group[name]
        raw_size = self._raw_chunk_bytes if name == "values" and self._values_raw else None
        for c in chunks.tolist():
            self.store._check_chunk(self._chunk_key(name, c), raw_size)
        try:
            return np.asarray(select(arr))
        except Exception as exc:  # noqa: BLE001  (codecs raise many types; all mean "cannot be decoded")
            if self.store._remote is not None and _is_transport_error(exc):
                # the object store failed (retries spent), not the data: no hunt chunk by chunk
                where = self.store._display(self._chunk_key(name, int(chunks[0]) if chunks.size else 0))
                if isinstance(exc, FileNotFoundError):
                    raise CorruptStoreError(
                        f"{where}: a chunk object is missing (deleted?) but holds committed rows"
                    ) from exc
                raise remote_error(where, exc) from exc
            bad, cause = self._failing_chunk(arr, chunks, exc)
            where = self.store._display(self._chunk_key(name, bad))
            if isinstance(cause, OSError):
                raise read_error(where, cause) from exc
            raise CorruptStoreError(
                f"{where}: chunk cannot be decoded ({type(cause).__name__}: {first_line(cause)})"
            ) from exc

    def _failing_chunk(self, arr: Any, chunks: np.ndarray, exc: Exception) -> tuple[int, Exception]:
        cr = arr.chunks[0]
        for c in chunks.tolist()[:4096]:  # an error path: find the culprit, within reason
            try:
                np.asarray(arr[c * cr : (c + 1) * cr])
            except Exception as cause:  # noqa: BLE001
                return c, cause
        return int(chunks[0]) if chunks.size else 0, exc

    @property
    def _raw_chunk_bytes(self) -> int:
        return self.chunk_rows * self.width * VALUE_DTYPES[self.dtype].itemsize

    def _remote_chunks(self, chunks: Sequence[int]) -> list[np.ndarray]:
        """Uncompressed values chunks ``chunks`` of a remote store: their objects fetched together
        (a response cut short fails the size check), as [chunk_rows, width] arrays."""
        keys = [self._chunk_key("values", c) for c in chunks]
        blobs = self.store._chunk_objects(keys, self._raw_chunk_bytes, self._raw_chunk_bytes)
        dtype = VALUE_DTYPES[self.dtype]
        return [
            np.frombuffer(b, dtype=self._raw_dtype).reshape(self.chunk_rows, self.width).astype(dtype, copy=False)
            for b in blobs
        ]

    def _remote_take(self, rows: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of a remote store's uncompressed values: a chunk most of whose rows are
        wanted is fetched whole; from the others, each run of consecutive rows is one ranged GET
        (a sample spread over a store reads its rows, not every chunk). Every body's length is
        checked: a response cut short is an error, never rows."""
        out = np.empty((rows.size, self.width), dtype=VALUE_DTYPES[self.dtype])
        cr = self.chunk_rows
        row_bytes = self.width * VALUE_DTYPES[self.dtype].itemsize
        unique = np.unique(rows)
        per_chunk = np.bincount(unique // cr - chunks[0], minlength=int(chunks[-1] - chunks[0]) + 1)
        whole = [int(c) for c in chunks.tolist() if per_chunk[c - chunks[0]] * 4 >= cr]
        for lo in range(0, len(whole), 64):  # a bounded number of chunks in memory at once
            part = whole[lo : lo + 64]
            for c, data in zip(part, self._remote_chunks(part), strict=True):
                hit = np.flatnonzero(rows // cr == c)
                out[hit] = data[rows[hit] - c * cr]
        sparse = unique[~np.isin(unique // cr, whole)]
        if sparse.size:
            breaks = np.flatnonzero((np.diff(sparse) != 1) | (np.diff(sparse // cr) != 0)) + 1
            runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(sparse, breaks)]
            keys = [self._chunk_key("values", a // cr) for a, _ in runs]
            spans = [((a % cr) * row_bytes, (a % cr + b - a) * row_bytes) for a, b in runs]
            assert self.store._remote is not None
            found: dict[int, np.ndarray] = {}
            for (a, b), key, blob in zip(runs, keys, self.store._remote.read_objects(keys, spans=spans), strict=True):
                where = self.store._display(key)
                if isinstance(blob, FileNotFoundError):
                    raise CorruptStoreError(f"{where}: chunk object is missing (deleted?) but holds committed rows")
                if isinstance(blob, BaseException):
                    raise remote_error(where, blob) from blob
                if len(blob) != (b - a) * row_bytes:
                    raise CorruptStoreError(
                        f"{where}: rows {a}..{b} came back as {len(blob)} bytes, expected {(b - a) * row_bytes} "
                        "(object truncated or response cut short)"
                    )
                block = np.frombuffer(blob, dtype=self._raw_dtype).reshape(b - a, self.width)
                for r in range(a, b):
                    found[r] = block[r - a]
            hit = np.flatnonzero(np.isin(rows, sparse))
            out[hit] = np.stack([found[int(r)] for r in rows[hit].tolist()]).astype(out.dtype, copy=False)
        return out

    @property
    def _remote_raw(self) -> bool:
        """Values chunks are objects of plain bytes on object storage: fetched and sliced here."""
        return self._values_raw and self.store._remote is not None

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Raw stored values of rows [start, stop) (uint16 bits for bf16)."""
        stop = self.rows if stop is None else min(stop, self.rows)
        start = max(0, start)
        if start >= stop:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        chunks = np.arange(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1)
        if self._remote_raw:
            first = int(chunks[0]) * self.chunk_rows
            block = np.concatenate(self._remote_chunks(chunks.tolist()))
            return block[start - first : stop - first]
        return self._read_array("values", chunks, lambda a: a[start:stop])

    def read_float32(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return decode_values(self.read(start, stop), self.dtype)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Raw values of arbitrary row indices (sorted internally; for small samples)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        if rows.min() < 0 or rows.max() >= self.rows:
            raise UsageError(f"row index out of range 0..{self.rows - 1}")
        chunks = np.unique(rows // self.chunk_rows)
        if self._remote_raw:
            return self._remote_take(rows, chunks)
        return self._read_array("values", chunks, lambda a: a.get_orthogonal_selection((rows, slice(None))))

    def read_chunk(
        self,
        index: int,
        rows: np.ndarray | None = None,
        *,
        out: np.ndarray | None = None,
        dest: np.ndarray | None = None,
        files: ChunkFiles | None = None,
    ) -> np.ndarray:
        """Raw values of chunk ``index`` (rows index*chunk_rows ..), committed rows only.

        Uncompressed chunks of a store folder are read straight from their file (zarr v3 keeps edge
        chunks full size), which is about twice as fast as zarr's read path; anything else (codecs,
        zip) goes through zarr.

        With ``rows`` (row offsets within the chunk, each below the chunk's committed rows), only
        those rows are read, into ``out[dest]`` (``dest`` defaults to 0, 1, ...; ``out`` to a new
        array) and ``out`` is returned. From an uncompressed chunk file the rows are read in place
        (one ``preadv`` per run of consecutive rows, no whole-chunk buffer); ``files`` keeps the
        chunk files open between calls (one :class:`ChunkFiles` per reading thread).
        """
        start = index * self.chunk_rows
        stop = min(start + self.chunk_rows, self.rows)
        if rows is not None:
            return self._read_chunk_rows(index, max(0, stop - start), rows, out, dest, files)
        if start >= stop:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        if self._raw_chunks:
            path = self._chunk_path(index)
            fd = open_chunk_file(path, self._raw_chunk_bytes)
            try:
                data = np.empty(self.chunk_rows * self.width, dtype=self._raw_dtype)
                self._pread(fd, path, [data.data.cast("B")], 0, data.nbytes)
            finally:
                os.close(fd)
            return data.reshape(self.chunk_rows, self.width)[: stop - start].astype(
                VALUE_DTYPES[self.dtype], copy=False
            )
        if self.store._remote is not None:
            return self._read_ahead(index)[: stop - start]
        return self.read(start, stop)

    def _read_ahead(self, index: int) -> np.ndarray:
        """Chunk ``index`` of a remote store, fetched with the next ones (READ_AHEAD_CHUNKS objects
        in flight together, not one round trip per chunk): a streaming pass asks for chunks in
        order, and each request costs a round trip to the object store.

        Each chunk is its own array (never a view of one block of them): a caller that keeps a chunk
        (a cache of decoded chunks) keeps its own bytes, not the read-ahead block around it. The
        chunks fetched ahead are held until :meth:`drop_read_ahead` (the store's ``close``)."""
        import threading  # noqa: PLC0415
        from collections import OrderedDict  # noqa: PLC0415

        state = self.__dict__.get("_ahead_state")
        if state is None:
            state = self.__dict__["_ahead_state"] = (threading.Lock(), OrderedDict())
        lock, ahead = state
        with lock:
            data = ahead.pop(index, None)
            if data is not None:
                return data
            row_bytes = self.width * VALUE_DTYPES[self.dtype].itemsize
            count = max(1, min(READ_AHEAD_CHUNKS, READ_AHEAD_BYTES // max(1, self.chunk_rows * row_bytes)))
            stop_chunk = min(index + count, self.chunks)
            if self._remote_raw:  # one array per chunk object, as fetched
                chunks = self._remote_chunks(list(range(index, stop_chunk)))
            else:  # decoded by zarr into one block: each chunk copied out of it
                block = self.read(index * self.chunk_rows, stop_chunk * self.chunk_rows)
                chunks = [block[lo : lo + self.chunk_rows].copy() for lo in range(0, block.shape[0], self.chunk_rows)]
            for c in range(index + 1, stop_chunk):
                ahead[c] = chunks[c - index]
            while len(ahead) > 2 * count:  # chunks skipped over: bounded memory
                ahead.popitem(last=False)
            return chunks[0]

    def drop_read_ahead(self) -> None:
        """Forget the chunks fetched ahead (a remote store's): the memory goes now, not whenever
        the garbage collector frees this stream (a stream and its store refer to each other)."""
        state = self.__dict__.get("_ahead_state")
        if state is not None:
            with state[0]:
                state[1].clear()

    def _read_chunk_rows(
        self,
        index: int,
        committed: int,
        rows: np.ndarray,
        out: np.ndarray | None,
        dest: np.ndarray | None,
        files: ChunkFiles | None,
    ) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= committed):
            raise UsageError(f"read_chunk: row offsets must lie in 0..{committed - 1} for chunk {index}")
        if not self._raw_chunks:
            out, dest = self._rows_out(rows, out, dest)
            if rows.size:
                out[dest] = self.read_chunk(index)[rows]
            return out
        return self.read_rows(rows + index * self.chunk_rows, out=out, dest=dest, files=files)

    def _rows_out(
        self, rows: np.ndarray, out: np.ndarray | None, dest: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        dtype = VALUE_DTYPES[self.dtype]
        if out is None:
            out = np.empty((rows.size, self.width), dtype=dtype)
        dest = np.arange(rows.size, dtype=np.int64) if dest is None else np.asarray(dest, dtype=np.int64).reshape(-1)
        if out.ndim != 2 or out.shape[1] != self.width or out.dtype != dtype or not out.flags.c_contiguous:
            raise UsageError(f"read_rows: out must be a C-contiguous [rows, {self.width}] {dtype} array")
        if dest.size != rows.size:
            raise UsageError(f"read_rows: {rows.size} rows but {dest.size} destinations")
        if dest.size and (int(dest.min()) < 0 or int(dest.max()) >= out.shape[0]):
            raise UsageError(f"read_rows: destinations must lie in 0..{out.shape[0] - 1}")
        return out, dest

    def read_rows(
        self,
        rows: np.ndarray,
        *,
        out: np.ndarray | None = None,
        dest: np.ndarray | None = None,
        files: ChunkFiles | None = None,
    ) -> np.ndarray:
        """Raw values of committed rows ``rows`` (any order, any chunks) into ``out[dest]``.

        The helper behind :meth:`read_chunk`'s ``rows`` mode, for uncompressed folder stores (see
        :attr:`reads_rows_directly`); other stores go through :meth:`take`. Rows are read straight
        from the chunk files, one ``pread`` per run of consecutive rows of a chunk: into ``out`` when
        the run's destinations are consecutive too, else into a staging buffer (``files``' scratch,
        reused) from which one gather puts every such row in its place. Copies from the page cache
        run several times faster into a 64-byte aligned ``out``.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out, dest = self._rows_out(rows, out, dest)
        n = rows.size
        if n == 0:
            return out
        if int(rows.min()) < 0 or int(rows.max()) >= self.rows:
            raise UsageError(f"read_rows: rows must lie in 0..{self.rows - 1}")
        if not self._raw_chunks:
            order = np.argsort(rows, kind="stable")
            out[dest[order]] = self.take(rows[order])
            return out
        if n > 1 and bool((rows[1:] < rows[:-1]).any()):
            order = np.argsort(rows, kind="stable")
            rows, dest = rows[order], dest[order]
        cr = self.chunk_rows
        row_bytes = self.width * VALUE_DTYPES[self.dtype].itemsize
        chunk = rows // cr
        # Runs: consecutive rows of one chunk. A run goes straight to ``out`` when its destinations
        # are consecutive (the count of destination breaks is the same at both of its ends). Rows of
        # _DIRECT_ROW_BYTES or more are never staged: a run is cut where its destinations jump (a
        # read more costs less than copying such rows again from the staging buffer).
        cut = (np.diff(rows) != 1) | (np.diff(chunk) != 0)
        if row_bytes >= _DIRECT_ROW_BYTES:
            cut |= np.diff(dest) != 1
        starts = np.flatnonzero(np.r_[True, cut])
        ends = np.r_[starts[1:], n]
        breaks = np.r_[0, np.cumsum(np.diff(dest) != 1)]
        direct = breaks[ends - 1] == breaks[starts]
        own = files is None
        files = ChunkFiles(limit=4) if files is None else files
        try:
            if files.runs_reader is not None:
                self._read_runs_compiled(files, rows, dest, out, starts, ends, chunk[starts], direct, row_bytes)
            else:
                self._read_runs(files, rows, dest, out, starts, ends, chunk[starts], direct, row_bytes)
        finally:
            if own:
                files.close()
        if self._raw_dtype.byteorder not in ("=", "|", "<" if sys.byteorder == "little" else ">"):
            out[dest] = out[dest].byteswap()
        return out

    def open_runs(self, first: np.ndarray, lengths: np.ndarray, files: ChunkFiles) -> tuple[np.ndarray, np.ndarray] | None:
        """Runs of consecutive committed rows, run r the ``lengths[r]`` rows from ``first[r]``, each
        inside one chunk, as a compiled loop reads them (:func:`tracediff.compare.rows.fused.read_and_measure`):
        per run the file descriptor of its chunk file (opened through ``files``: open while it is
        asked for no more than ``files.limit`` others) and the run's byte offset in it. None where
        rows are not read straight from plain chunk files in this machine's byte order (the caller
        then reads them with :meth:`read_rows`)."""
        if not self._raw_chunks or self._raw_dtype.byteorder not in ("=", "|", "<" if sys.byteorder == "little" else ">"):
            return None
        first = np.asarray(first, dtype=np.int64)
        if first.size and (int(first.min()) < 0 or int((first + lengths).max()) > self.rows):
            raise UsageError(f"open_runs: rows must lie in 0..{self.rows - 1}")
        cr = self.chunk_rows
        row_bytes = self.width * VALUE_DTYPES[self.dtype].itemsize
        chunk = first // cr
        if first.size and bool((first + lengths - 1 >= (chunk + 1) * cr).any()):
            raise UsageError("open_runs: a run must lie inside one chunk")
        names, which = np.unique(chunk, return_inverse=True)
        fds = np.array([self._open_chunk(files, c) for c in names.tolist()], dtype=np.int32)
        return fds[which], (first - chunk * cr) * row_bytes

    def _chunk_path(self, chunk: int) -> str:
        """The file of values chunk ``chunk`` (uncompressed folder stores)."""
        return f"{self._values_dir}/c/{chunk}/0"

    def _open_chunk(self, files: ChunkFiles, chunk: int) -> int:
        """File descriptor of values chunk ``chunk``, opened through ``files`` (a chunk file holds
        ``chunk_rows`` whole rows: any other size is corruption)."""
        return files.open(self._chunk_path(chunk), self._raw_chunk_bytes)

    def _read_runs(self, files: ChunkFiles, rows: np.ndarray, dest: np.ndarray, out: np.ndarray, starts: np.ndarray,
                   ends: np.ndarray, chunks: np.ndarray, direct: np.ndarray, row_bytes: int) -> None:
        """:meth:`read_rows`' runs ``starts[r]..ends[r]`` (of chunks ``chunks[r]``) read one ``pread``
        at a time: into ``out`` where ``direct[r]``, else into ``files``' staging buffer, from which
        every staged row is then put in its place."""
        cr = self.chunk_rows
        staged = None if bool(direct.all()) else np.repeat(~direct, ends - starts)
        flat = out.data.cast("B")
        stage = None if staged is None else files.scratch(int(ends[-1]) * row_bytes)
        for a, b, c, r0, d0, straight in zip(starts.tolist(), ends.tolist(), chunks.tolist(), rows[starts].tolist(),
                                             dest[starts].tolist(), direct.tolist(), strict=True):
            path = self._chunk_path(c)
            fd = files.open(path, self._raw_chunk_bytes)  # (as _open_chunk, the path kept for its errors)
            size = (b - a) * row_bytes
            at = d0 * row_bytes if straight else a * row_bytes
            self._pread(fd, path, [(flat if straight else stage)[at : at + size]], (r0 - c * cr) * row_bytes, size)
        if staged is not None:
            # Rows to their places a few at a time: a whole block's gathered copy would be a fresh
            # allocation (and fresh pages to fault in) for every block read.
            k = np.flatnonzero(staged) + int(starts[0])
            to = out.view(np.uint8).reshape(out.shape[0], row_bytes)
            src = np.frombuffer(stage, dtype=np.uint8, count=int(ends[-1]) * row_bytes).reshape(-1, row_bytes)
            step = max(1, _SCATTER_BYTES // row_bytes)
            for i in range(0, k.size, step):
                part = k[i : i + step]
                to[dest[part]] = src[part]

    def _read_runs_compiled(self, files: ChunkFiles, rows: np.ndarray, dest: np.ndarray, out: np.ndarray,
                            starts: np.ndarray, ends: np.ndarray, chunks: np.ndarray, direct: np.ndarray,
                            row_bytes: int) -> None:
        """:meth:`_read_runs` by ``files.runs_reader`` (:func:`tracediff.store.fused_reads.read_runs`:
        every ``pread`` and staged copy in one compiled loop, without the GIL), the runs of at most
        ``files.limit`` chunk files at a time (each opened here, and so open, through the call). A run
        it could not read whole is read again, with the runs after it of that call, by
        :meth:`_read_runs`: the same one-line error a short read or a failing file gives there."""
        cr = self.chunk_rows
        flat = out.view(np.uint8).reshape(-1)
        stage = np.frombuffer(files.scratch(int(np.max(ends - starts, initial=0)) * row_bytes), dtype=np.uint8)
        offsets = (rows[starts] - chunks * cr) * row_bytes
        # Rows are sorted: each file's runs are consecutive. Batches of runs over <= limit files.
        first = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]])
        for lo in range(0, first.size, files.limit):
            files_of = first[lo : lo + files.limit]
            r0 = int(files_of[0])
            r1 = int(first[lo + files.limit]) if lo + files.limit < first.size else starts.size
            fds = np.repeat(
                np.array([self._open_chunk(files, c) for c in chunks[files_of].tolist()], dtype=np.int32),
                np.diff(np.r_[files_of, r1]),
            )
            failed = int(files.runs_reader(fds, offsets[r0:r1], starts[r0:r1], ends[r0:r1], direct[r0:r1], dest, flat,
                                           stage, row_bytes))
            if failed >= 0:
                at = r0 + failed
                self._read_runs(files, rows, dest, out, starts[at:r1], ends[at:r1], chunks[at:r1], direct[at:r1],
                                row_bytes)

    @staticmethod
    def _pread(fd: int, path: str, buffers: list[memoryview], offset: int, size: int) -> None:
        try:
            got = os.preadv(fd, buffers, offset)
        except OSError as exc:
            raise read_error(path, exc) from exc
        if got != size:
            raise CorruptStoreError(f"{path}: short read at byte {offset} (file truncated while reading?)")

    @property
    def reads_rows_directly(self) -> bool:
        """True when :meth:`read_chunk` reads single rows straight from the chunk files (uncompressed
        folder stores): no chunk is decoded whole, so callers need no chunk cache."""
        return self._raw_chunks

    @property
    def _values_dir(self) -> str:
        cached = self.__dict__.get("_values_dir_cache")
        if cached is None:
            cached = os.fspath(self.store.path / self.tap / self.writer / "values")
            self.__dict__["_values_dir_cache"] = cached
        return cached

    @property
    def _raw_chunks(self) -> bool:
        """Values chunks are plain files of plain bytes (a folder store, no codec but ``bytes``), so
        rows can be read straight from them; decided from the metadata checked on open."""
        return self._values_raw and self.store._zip is None and self.store._remote is None

    @property
    def _raw_dtype(self) -> np.dtype:
        return VALUE_DTYPES[self.dtype].newbyteorder("<" if self._values_endian == "little" else ">")

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk_rows) if self.chunk_rows else 0

    def iter_chunks(self, batch_rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (start_row, raw values) in chunk-aligned batches; memory stays at one batch."""
        step = batch_rows or max(self.chunk_rows, 1)
        step = max(self.chunk_rows, (step // max(self.chunk_rows, 1)) * self.chunk_rows)
        for start in range(0, self.rows, step):
            yield start, self.read(start, start + step)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * VALUE_DTYPES[self.dtype].itemsize


def _is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the object store or the network failing, not a codec
    refusing the data: a request error of botocore/aiohttp, a timeout, a refused connection."""
    seen = 0
    while exc is not None and seen < 8:
        module = type(exc).__module__ or ""
        if module.startswith(("botocore", "aiohttp", "aiobotocore", "s3fs", "gcsfs", "urllib3")):
            return True
        if isinstance(exc, (ConnectionError, TimeoutError, PermissionError, FileNotFoundError)):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False
