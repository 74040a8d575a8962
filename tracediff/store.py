"""Trace store, format 1: the zarr v3 layout every other part of tracediff reads or writes.

Layout (documented for plain zarr + numpy readers in ``docs/format.md``)::

    STORE.zarr/                      root group; attrs: tracediff, source, meta
      <tap>/                         one group per tap (attrs empty: created race-free by any writer)
        <writer>/                    one group per writing process; attrs: see WriterAttrs
          values      [capacity, width]  bf16 kept as raw uint16 bits, else the tensor's dtype
          seq, position, token_id, next_token_id, step   int64 (-1 = unknown)
          phase       int8 (index into PHASES)
          valid       bool

Commit protocol: rows are written to the arrays first (each chunk file is replaced atomically by
zarr's LocalStore), then the writer group's ``commit`` attribute is rewritten (also atomically) with
the new row count. Readers only trust ``commit.rows``: rows past it (capacity grown ahead, a batch
killed halfway) are invisible. A SIGKILL therefore loses at most the batch in flight, never a torn
one. Several processes write one store without locks because each owns its ``<tap>/<writer>`` group.

This module never imports torch: the recorder converts tensors to numpy before calling it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff import __version__
from tracediff.errors import (
    CorruptStoreError,
    FormatVersionError,
    NotATraceStoreError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StoreWriteError,
    UsageError,
)

FORMAT = 1
PHASES: tuple[str, ...] = (
    "unknown",
    "train",
    "prefill",
    "extend",
    "draft_extend",
    "decode",
    "verify",
    "idle",
)
LABEL_FIELDS: tuple[str, ...] = ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
_INT_LABELS = ("seq", "position", "token_id", "next_token_id", "step")
LABEL_DTYPES: dict[str, np.dtype] = {
    **{name: np.dtype("int64") for name in _INT_LABELS},
    "phase": np.dtype("int8"),
    "valid": np.dtype("bool"),
}
LABEL_FILL: dict[str, Any] = {**{name: -1 for name in _INT_LABELS}, "phase": 0, "valid": True}

# Logical dtype name -> numpy dtype used on disk. bfloat16 has no numpy dtype: its 16 bits are kept
# verbatim as uint16 so that a round trip is bit-exact.
VALUE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("uint16"),
    "float16": np.dtype("float16"),
    "float32": np.dtype("float32"),
    "float64": np.dtype("float64"),
}
COMPRESSORS = ("none", "lz4", "zstd")
DEFAULT_CHUNK_ROWS = 256
DEFAULT_LABEL_CHUNK_ROWS = 4096
DEFAULT_COMPRESSOR = "none"


def phase_code(phase: str | int | None) -> int:
    """Code of a phase name in :data:`PHASES` (``None`` -> unknown)."""
    if phase is None:
        return 0
    if isinstance(phase, (int, np.integer)):
        if not 0 <= int(phase) < len(PHASES):
            raise UsageError(f"phase code {phase} is out of range 0..{len(PHASES) - 1}")
        return int(phase)
    name = str(phase).lower()
    if name not in PHASES:
        raise UsageError(f"unknown phase {phase!r}; known phases: {', '.join(PHASES)}")
    return PHASES.index(name)


def decode_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values -> float32 (bf16 bits are widened exactly: bf16 is the top half of fp32)."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def encode_bfloat16(values_f32: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), for tests and importers without torch."""
    bits = np.ascontiguousarray(values_f32, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values_f32)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def default_source(role: str, framework: str = "", framework_version: str = "") -> dict[str, Any]:
    """Provenance of the process that writes: who, where, when, with what command line."""
    return {
        "role": role,
        "framework": framework,
        "framework_version": framework_version,
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _now_iso(),
        "python": sys.version.split()[0],
    }


def _zarr():
    import zarr  # noqa: PLC0415  (imported lazily: the injected shim must stay cheap)

    return zarr


def _compressors(name: str, itemsize: int):
    if name == "none":
        return None
    from zarr.codecs import BloscCodec  # noqa: PLC0415

    _thread_local_blosc_mutex()
    if name == "lz4":
        return [BloscCodec(cname="lz4", clevel=1, shuffle="bitshuffle", typesize=itemsize)]
    if name == "zstd":
        return [BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle", typesize=itemsize)]
    raise UsageError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")


def _zstd():
    from zarr.codecs import ZstdCodec  # noqa: PLC0415

    return ZstdCodec(level=1)


def _thread_local_blosc_mutex() -> None:
    """numcodecs' blosc creates a *multiprocessing* Lock on first use. Inside a process started by
    multiprocessing (SGLang's schedulers), that semaphore's finaliser fails at exit and prints a
    traceback into the host's log. A process-local lock guards the same (per-process) blosc state."""
    import threading  # noqa: PLC0415

    try:
        import numcodecs.blosc as blosc  # noqa: PLC0415

        if not getattr(blosc, "_MUTEX_IS_INIT", True):
            blosc._MUTEX = threading.Lock()
            blosc._MUTEX_IS_INIT = True
    except (ImportError, AttributeError):  # another numcodecs: keep its own behaviour
        pass


def create_store(
    path: str | os.PathLike[str],
    *,
    role: str = "",
    meta: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Create an empty trace store (the root group and its attributes).

    Refuses an existing path unless ``overwrite``; then only a trace store (or an empty folder) is
    replaced, never an unrelated directory.
    """
    path = Path(path)
    if str(path).endswith(".zip"):
        raise UsageError(f"{path}: a .zarr.zip store is read-only; record into a folder and pack it")
    if path.exists():
        if not overwrite:
            raise StoreExistsError(f"{path}: already exists; pass --overwrite (overwrite=True) to replace it")
        # A plain file is never a store folder (packed .zip stores are refused above): keep it too.
        if not path.is_dir() or (any(path.iterdir()) and not _looks_like_trace_store(path)):
            raise StoreExistsError(
                f"{path}: exists and is not a tracediff store; refusing to delete it, choose another path"
            )
        _remove_tree(path)
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StoreWriteError(f"{path}: cannot create the store: {blocker} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        zarr = _zarr()
        attrs = {
            "tracediff": {"format": FORMAT, "version": __version__},
            "source": dict(source) if source is not None else default_source(role),
            "meta": _jsonable(dict(meta or {})),
        }
        zarr.open_group(str(path), mode="w-", attributes=attrs)
    except OSError as exc:
        raise StoreWriteError(f"{path}: cannot create the store: {exc.strerror or exc}") from exc
    return path


def update_store_meta(path: str | os.PathLike[str], meta: Mapping[str, Any]) -> None:
    """Merge ``meta`` into the root ``meta`` attribute (single writer only: the recording parent)."""
    zarr = _zarr()
    group = zarr.open_group(str(path), mode="r+")
    attrs = dict(group.attrs)
    merged = dict(attrs.get("meta") or {})
    merged.update(_jsonable(dict(meta)))
    attrs["meta"] = merged
    group.attrs.put(attrs)


def _looks_like_trace_store(path: Path) -> bool:
    try:
        doc = json.loads((path / "zarr.json").read_text())
        return "tracediff" in doc.get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return False


def _remove_tree(path: Path) -> None:
    import shutil  # noqa: PLC0415

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _jsonable(obj: Any) -> Any:
    """Best-effort conversion of metadata to JSON types (numpy scalars, tuples, paths, dtypes)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, bool)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else str(value)
    return str(obj)


@dataclass
class WriterCounts:
    """What one writer saw; stored in the commit record so a reader knows what is missing."""

    rows: int = 0
    batches: int = 0
    dropped_rows: int = 0
    dropped_batches: int = 0
    skipped_rows: int = 0
    skipped_batches: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class TraceWriter:
    """Appends batches of rows for one (tap, process) pair to a store, committing after each batch.

    Not thread-safe: one writer thread owns it. Every method either completes or raises
    :class:`StoreWriteError`; rows committed before an error stay readable.
    """

    def __init__(
        self,
        store_path: str | os.PathLike[str],
        tap: str,
        writer: str,
        *,
        width: int,
        dtype: str,
        attrs: Mapping[str, Any] | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        compressor: str = DEFAULT_COMPRESSOR,
        durable: bool = False,
    ) -> None:
        if dtype not in VALUE_DTYPES:
            raise UsageError(f"tap {tap!r}: unsupported value dtype {dtype!r}; supported: {', '.join(VALUE_DTYPES)}")
        if width <= 0:
            raise UsageError(f"tap {tap!r}: width must be positive, got {width}")
        if chunk_rows <= 0:
            raise UsageError(f"chunk_rows must be positive, got {chunk_rows}")
        _check_name(tap, "tap")
        self.store_path = Path(store_path)
        self.tap = tap
        self.width = int(width)
        self.dtype = dtype
        self.chunk_rows = int(chunk_rows)
        self.durable = durable
        self.counts = WriterCounts()
        self.seq_names: dict[str, int] = {}
        self.status = "recording"
        self.error = ""
        self._extra_attrs = _jsonable(dict(attrs or {}))
        self._capacity = 0
        self._tail_rows = 0  # rows at the end that do not fill a whole values chunk yet
        self._tail: np.ndarray | None = None
        self._resized = False  # array metadata rewritten since the last durable commit
        zarr = _zarr()
        try:
            root = zarr.open_group(str(self.store_path), mode="r+")
        except Exception as exc:  # zarr raises several types for a missing/odd root
            raise NotATraceStoreError(f"{self.store_path}: cannot open as a trace store to append: {exc}") from exc
        if "tracediff" not in root.attrs:
            raise NotATraceStoreError(f"{self.store_path}: not a tracediff store (no 'tracediff' root attribute)")
        try:
            tap_group = _require_group(root, tap)
            self.writer = _unique_child(tap_group, writer)
            _check_name(self.writer, "writer")
            self._group = tap_group.create_group(self.writer, attributes=self._attrs())
            store_dtype = VALUE_DTYPES[dtype]
            self._values = self._group.create_array(
                "values",
                shape=(0, self.width),
                chunks=(self.chunk_rows, self.width),
                dtype=store_dtype,
                compressors=_compressors(compressor, store_dtype.itemsize),
                fill_value=0,
                config={"write_empty_chunks": True},
                attributes={"dtype": dtype},
            )
            self._labels = {
                name: self._group.create_array(
                    name,
                    shape=(0,),
                    chunks=(DEFAULT_LABEL_CHUNK_ROWS,),
                    dtype=LABEL_DTYPES[name],
                    # Labels compress ~10x (positions count up, ids repeat) and are small: zstd
                    # (not blosc, whose multiprocessing lock misbehaves in spawned children).
                    compressors=[_zstd()],
                    fill_value=LABEL_FILL[name],
                    config={"write_empty_chunks": True},
                )
                for name in LABEL_FIELDS
            }
        except OSError as exc:
            raise StoreWriteError(f"{self.store_path}/{tap}: cannot create writer group: {exc}") from exc
        self.compressor = compressor

    # -- attributes / commit record -------------------------------------------------------------
    def _attrs(self) -> dict[str, Any]:
        attrs = dict(self._extra_attrs)
        attrs.update(
            {
                "tap": self.tap,
                "dtype": self.dtype,
                "width": self.width,
                "commit": {
                    **self.counts.as_dict(),
                    "status": self.status,
                    "error": self.error,
                    "seq_names": {name: idx for name, idx in self.seq_names.items()},
                    "updated": _now_iso(),
                },
            }
        )
        return attrs

    def _commit(self, first_row: int | None = None) -> None:
        """Write the commit record, the row count readers trust. A durable writer first makes rows
        ``first_row``.. durable: it fsyncs the chunk files they live in, the folders whose entries
        changed (new chunk folders, the renames of zarr's atomic writes) and resized array metadata,
        never the whole group (that costs ~0.2 ms a file at every commit: quadratic in the store).
        The values chunks then leave the page cache: the next batch reuses their pages instead of
        fresh ones (several times faster on a VM), and the host's own cache is not evicted."""
        base = self.store_path / self.tap / self.writer
        if self.durable and first_row is not None and first_row < self.counts.rows:
            stop, cr, lr = self.counts.rows, self.chunk_rows, DEFAULT_LABEL_CHUNK_ROWS
            chunks = [base / "values" / "c" / str(i) / "0" for i in range(first_row // cr, -(-stop // cr))]
            labels = [base / n / "c" / str(i) for n in LABEL_FIELDS for i in range(first_row // lr, -(-stop // lr))]
            folders = {p.parent for p in chunks + labels} | {base / "values" / "c"}
            if self._resized:
                meta = [base / n / "zarr.json" for n in ("values", *LABEL_FIELDS)]
                folders |= {p.parent for p in meta} | {p.parent / "c" for p in meta}
                _fsync_paths(meta)
                self._resized = False
            _fsync_paths(chunks, drop=True)
            _fsync_paths(labels)
            _fsync_paths(sorted(folders))
        self._group.attrs.put(self._attrs())
        if self.durable:
            _fsync_paths([base / "zarr.json", base])

    def seq_id(self, key: Any) -> int:
        """Integer id for a sequence key (ints pass through, strings get stable small ids)."""
        if isinstance(key, (int, np.integer)):
            return int(key)
        name = str(key)
        if name not in self.seq_names:
            self.seq_names[name] = len(self.seq_names)
        return self.seq_names[name]

    def _grow(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = max(needed, 2 * self._capacity, self.chunk_rows)
        capacity = -(-capacity // self.chunk_rows) * self.chunk_rows
        self._values.resize((capacity, self.width))
        label_capacity = -(-capacity // DEFAULT_LABEL_CHUNK_ROWS) * DEFAULT_LABEL_CHUNK_ROWS
        for arr in self._labels.values():
            arr.resize((label_capacity,))
        self._capacity = capacity
        self._resized = True

    def append(self, values: np.ndarray, labels: Mapping[str, np.ndarray]) -> None:
        """Write one batch of rows and commit it. ``values`` is [rows, width] in the store dtype."""
        if self.status != "recording":
            raise StoreWriteError(f"{self.store_path}/{self.tap}/{self.writer}: writer is {self.status}")
        rows = int(values.shape[0])
        if values.ndim != 2 or values.shape[1] != self.width:
            raise UsageError(
                f"tap {self.tap!r}: batch of shape {tuple(values.shape)} does not match width {self.width}"
            )
        if values.dtype != VALUE_DTYPES[self.dtype]:
            raise UsageError(f"tap {self.tap!r}: batch dtype {values.dtype} is not the store dtype of {self.dtype}")
        if rows == 0:
            return
        # Labels are checked before any I/O: a rejected batch must leave neither chunks nor the
        # in-memory tail behind (the tail is rewritten into the next batch's first chunk).
        columns: dict[str, np.ndarray] = {}
        for name in LABEL_FIELDS:
            column = labels.get(name)
            if column is None:
                columns[name] = np.full(rows, LABEL_FILL[name], dtype=LABEL_DTYPES[name])
                continue
            try:
                column = np.asarray(column).astype(LABEL_DTYPES[name], copy=False).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"tap {self.tap!r}: label {name!r} is not {LABEL_DTYPES[name]}: {exc}") from exc
            if column.shape[0] != rows:
                raise UsageError(f"tap {self.tap!r}: label {name!r} has {column.shape[0]} entries for {rows} rows")
            columns[name] = column
        start = self.counts.rows
        stop = start + rows
        try:
            self._grow(stop)
            # Values: start writes at a chunk boundary (the tail kept from the last batch in memory is
            # rewritten with the new rows), so zarr never reads a chunk back to merge it.
            if self._tail is not None and self._tail_rows:
                block = np.concatenate([self._tail, values])
                block_start = start - self._tail_rows
            else:
                block = values
                block_start = start
            self._values[block_start:stop] = block
            tail_rows = stop % self.chunk_rows
            self._tail = block[len(block) - tail_rows :].copy() if tail_rows else None
            self._tail_rows = tail_rows
            for name, column in columns.items():
                self._labels[name][start:stop] = column
            self.counts.rows = stop
            self.counts.batches += 1
            self.counts.bytes += int(values.nbytes)
            self._commit(block_start)
        except OSError as exc:
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            raise StoreWriteError(
                f"{self.store_path}/{self.tap}/{self.writer}: write of rows {start}..{stop} failed: {exc}"
            ) from exc

    def record_drop(self, rows: int, batches: int = 1, *, skipped: bool = False) -> None:
        """Count rows not written (queue full or error: dropped; sampling limits: skipped)."""
        if skipped:
            self.counts.skipped_rows += rows
            self.counts.skipped_batches += batches
        else:
            self.counts.dropped_rows += rows
            self.counts.dropped_batches += batches

    def close(self, status: str = "closed", error: str = "") -> None:
        """Write the final commit record, then trim the arrays to the committed rows.

        The commit goes first: it is what readers trust, and the failure that stopped a writer (a
        broken chunk folder, a full disk) often breaks the trim too; it must not also hide the
        status and the error. Trimming never cuts below ``commit.rows``, so the store is consistent
        whichever of the two a crash interrupts.
        """
        if self.status == "failed":
            status = "failed"
        self.status = status
        if error:
            self.error = error
        where = f"{self.store_path}/{self.tap}/{self.writer}"
        try:
            self._commit()
        except OSError as exc:
            raise StoreWriteError(f"{where}: final commit failed: {exc}") from exc
        rows = self.counts.rows
        if self._capacity != rows:
            try:
                self._values.resize((rows, self.width))
                for arr in self._labels.values():
                    arr.resize((rows,))
            except OSError as exc:
                raise StoreWriteError(
                    f"{where}: {rows} rows committed, but trimming the arrays to them failed: {exc}"
                ) from exc
            self._capacity = rows


def _fsync_paths(paths: Sequence[Path], *, drop: bool = False) -> None:
    """fsync files or folders (missing ones are skipped: chunks zarr did not write, folders not made
    yet); ``drop``: then tell the kernel their (now clean) pages will not be read again."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            if drop and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _check_name(name: str, what: str) -> None:
    if not name or "/" in name or name.startswith(".") or name.startswith("__") or name != name.strip():
        raise UsageError(f"invalid {what} name {name!r}: use letters, digits, '_' and '-'")


def _require_group(parent, name: str):
    """Open or create a child group; two processes creating it at once both succeed."""
    try:
        return parent[name] if name in parent else parent.create_group(name)
    except Exception:  # lost a creation race: the other process made it
        return parent[name]


def _unique_child(group, name: str) -> str:
    if name not in group:
        return name
    n = 2
    while f"{name}_{n}" in group:
        n += 1
    return f"{name}_{n}"


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


@dataclass
class TraceStream:
    """The committed rows of one (tap, writer) group, read lazily and in bounded chunks."""

    store: TraceStore
    tap: str
    writer: str
    attrs: dict[str, Any]
    rows: int
    width: int
    dtype: str
    chunk_rows: int
    _group: Any = field(repr=False)

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
    def seq_names(self) -> dict[int, str]:
        names = self.commit.get("seq_names") or {}
        return {int(v): str(k) for k, v in names.items()} if isinstance(names, dict) else {}

    def label(self, name: str) -> np.ndarray:
        """One committed label column as numpy (small: 8 bytes a row)."""
        if name not in LABEL_FIELDS:
            raise UsageError(f"unknown label field {name!r}; fields: {', '.join(LABEL_FIELDS)}")
        where = f"{self.store.path}/{self.tap}/{self.writer}/{name}"
        try:
            arr = self._group[name]
        except KeyError as exc:
            raise CorruptStoreError(f"{where}: label array is missing") from exc
        if arr.ndim != 1 or arr.shape[0] < self.rows:
            raise CorruptStoreError(f"{where}: has shape {arr.shape}, expected at least {self.rows} rows")
        try:
            data = np.asarray(arr[: self.rows])
        except Exception as exc:
            raise CorruptStoreError(f"{where}: cannot be read ({type(exc).__name__}: {exc})") from exc
        return data.astype(LABEL_DTYPES[name], copy=False)

    def labels(self, names: Sequence[str] = LABEL_FIELDS) -> dict[str, np.ndarray]:
        return {name: self.label(name) for name in names}

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Raw stored values of rows [start, stop) (uint16 bits for bf16)."""
        stop = self.rows if stop is None else min(stop, self.rows)
        start = max(0, start)
        if start >= stop:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        try:
            return np.asarray(self._group["values"][start:stop])
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.store.path}/{self.tap}/{self.writer}/values: rows {start}..{stop} cannot be read "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def read_float32(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return decode_values(self.read(start, stop), self.dtype)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Raw values of arbitrary row indices (sorted internally; for small samples)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        if rows.min() < 0 or rows.max() >= self.rows:
            raise UsageError(f"row index out of range 0..{self.rows - 1}")
        try:
            return np.asarray(self._group["values"].get_orthogonal_selection((rows, slice(None))))
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.store.path}/{self.tap}/{self.writer}/values: cannot be read ({type(exc).__name__}: {exc})"
            ) from exc

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
            path = self.store.path / self.tap / self.writer / "values" / "c" / str(index) / "0"
            count = self.chunk_rows * self.width
            try:
                with open(path, "rb") as fh:
                    data = np.fromfile(fh, dtype=self._raw_dtype, count=count)
            except FileNotFoundError:
                data = np.zeros(count, dtype=self._raw_dtype)  # never written: the fill value
            except OSError as exc:
                raise CorruptStoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
            if data.size != count:
                raise CorruptStoreError(
                    f"{path}: chunk holds {data.size} values, expected {count} (truncated file?)"
                )
            return data.reshape(self.chunk_rows, self.width)[: stop - start].astype(VALUE_DTYPES[self.dtype], copy=False)
        return self.read(start, stop)

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

    def _rows_out(self, rows: np.ndarray, out: np.ndarray | None, dest: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
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
        from the chunk files: one ``preadv`` per run of consecutive rows of a chunk, into one buffer
        when their destinations are consecutive too, else one buffer per row. Copies from the page
        cache run several times faster into a 64-byte aligned ``out``.
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
        chunk_bytes = cr * row_bytes
        chunk = rows // cr
        # Runs: consecutive rows of one chunk. ``scattered`` counts destination breaks, so a run
        # whose destinations are consecutive has the same count at both ends.
        breaks = (np.flatnonzero((np.diff(rows) != 1) | (np.diff(chunk) != 0)) + 1).tolist()
        scattered = np.concatenate(([0], np.cumsum(np.diff(dest) != 1))).tolist()
        rows_l, dest_l, chunk_l = rows.tolist(), dest.tolist(), chunk.tolist()
        flat = out.data.cast("B")
        prefix = self._values_dir
        own = files is None
        files = ChunkFiles(limit=4) if files is None else files
        try:
            for a, b in zip([0, *breaks], [*breaks, n], strict=True):
                c = chunk_l[a]
                path = f"{prefix}/c/{c}/0"
                fd = files.open(path, chunk_bytes)
                if fd is None:  # never written: the fill value
                    out[dest[a:b]] = 0
                    continue
                offset = (rows_l[a] - c * cr) * row_bytes
                if scattered[b - 1] == scattered[a]:
                    d0 = dest_l[a] * row_bytes
                    self._pread(fd, path, [flat[d0 : d0 + (b - a) * row_bytes]], offset, (b - a) * row_bytes)
                    continue
                for k in range(a, b, _IOV_MAX):
                    k1 = min(b, k + _IOV_MAX)
                    buffers = [flat[d * row_bytes : (d + 1) * row_bytes] for d in dest_l[k:k1]]
                    self._pread(fd, path, buffers, offset + (k - a) * row_bytes, (k1 - k) * row_bytes)
        finally:
            if own:
                files.close()
        if self._raw_dtype.byteorder not in ("=", "|", "<" if sys.byteorder == "little" else ">"):
            out[dest] = out[dest].byteswap()
        return out

    @staticmethod
    def _pread(fd: int, path: str, buffers: list[memoryview], offset: int, size: int) -> None:
        try:
            got = os.preadv(fd, buffers, offset)
        except OSError as exc:
            raise CorruptStoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
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
        cached = self.__dict__.get("_raw_chunks_cache")
        if cached is None:
            cached = False
            if self.store._zip is None:
                try:
                    meta = self._group["values"].metadata
                    codecs = [c.to_dict() for c in meta.codecs]
                    encoding = meta.chunk_key_encoding.to_dict()
                    cached = (
                        len(codecs) == 1
                        and codecs[0].get("name") == "bytes"
                        and encoding.get("name") == "default"
                        and (encoding.get("configuration") or {}).get("separator", "/") == "/"
                    )
                    endian = (codecs[0].get("configuration") or {}).get("endian", "little") if codecs else "little"
                    self.__dict__["_raw_dtype"] = VALUE_DTYPES[self.dtype].newbyteorder("<" if endian == "little" else ">")
                except Exception:  # noqa: BLE001  (unknown metadata layout: use zarr)
                    cached = False
            self.__dict__["_raw_chunks_cache"] = cached
        return cached

    @property
    def _raw_dtype(self) -> np.dtype:
        return self.__dict__["_raw_dtype"]

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


_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


class ChunkFiles:
    """Open uncompressed chunk files for :meth:`TraceStream.read_chunk`, the least recently used
    closed beyond ``limit``. Not thread-safe: one per reading thread; close it (or use ``with``)."""

    def __init__(self, limit: int = 64) -> None:
        from collections import OrderedDict  # noqa: PLC0415

        self.limit = max(1, int(limit))
        self._fds: OrderedDict[str, int] = OrderedDict()

    def open(self, path: str, size: int) -> int | None:
        """File descriptor of ``path`` (None if it does not exist); refuses a file under ``size`` bytes."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptStoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        try:
            actual = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise CorruptStoreError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        if actual < size:
            os.close(fd)
            raise CorruptStoreError(f"{path}: chunk holds {actual} bytes, expected {size} (truncated file?)")
        self._fds[path] = fd
        while len(self._fds) > self.limit:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> ChunkFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be gone already
            self.close()


class TraceStore:
    """A trace store opened for reading: a folder or a ``.zarr.zip`` file. Validates on open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        zarr = _zarr()
        if not os.path.lexists(self.path):
            raise StoreNotFoundError(f"{self.path}: no such trace store")
        try:
            if self.path.is_file() and zipfile.is_zipfile(self.path):
                from zarr.storage import ZipStore  # noqa: PLC0415

                self._zip = ZipStore(str(self.path), mode="r")
                root = zarr.open_group(self._zip, mode="r")
            elif self.path.is_dir():
                self._zip = None
                if not (self.path / "zarr.json").is_file():
                    raise NotATraceStoreError(f"{self.path}: not a zarr v3 store (no zarr.json at its top)")
                root = zarr.open_group(str(self.path), mode="r")
            else:
                raise NotATraceStoreError(f"{self.path}: not a trace store (neither a folder nor a .zarr.zip file)")
        except StoreError:
            raise
        except PermissionError as exc:
            raise StoreError(f"{self.path}: permission denied reading the store") from exc
        except OSError as exc:
            raise CorruptStoreError(f"{self.path}: cannot be read ({exc.strerror or exc})") from exc
        except Exception as exc:
            raise NotATraceStoreError(
                f"{self.path}/zarr.json: not a readable zarr v3 group ({type(exc).__name__}: {exc})"
            ) from exc
        self._root = root
        attrs = _as_dict(root.attrs, f"{self.path}/zarr.json: attributes")
        header = attrs.get("tracediff")
        if not isinstance(header, dict):
            raise NotATraceStoreError(f"{self.path}/zarr.json: no 'tracediff' attribute: this zarr is not a trace store")
        fmt = header.get("format")
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise CorruptStoreError(f"{self.path}/zarr.json: field tracediff.format is {fmt!r}, expected an integer")
        if fmt > FORMAT:
            raise FormatVersionError(
                f"{self.path}/zarr.json: tracediff.format is {fmt}, newer than this tracediff reads ({FORMAT}); "
                f"upgrade tracediff"
            )
        if fmt < 1:
            raise CorruptStoreError(f"{self.path}/zarr.json: tracediff.format {fmt} is not a known format")
        self.format = fmt
        self.version = str(header.get("version", ""))
        self.source = attrs.get("source") if isinstance(attrs.get("source"), dict) else {}
        self.meta = attrs.get("meta") if isinstance(attrs.get("meta"), dict) else {}
        self.streams: dict[str, list[TraceStream]] = self._scan()

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scan(self) -> dict[str, list[TraceStream]]:
        out: dict[str, list[TraceStream]] = {}
        try:
            taps = sorted(self._root.group_keys())
        except Exception as exc:
            raise CorruptStoreError(f"{self.path}: cannot list taps ({type(exc).__name__}: {exc})") from exc
        for tap in taps:
            try:
                tap_group = self._root[tap]
                writers = sorted(tap_group.group_keys())
            except Exception as exc:
                raise CorruptStoreError(f"{self.path}/{tap}: cannot be read ({type(exc).__name__}: {exc})") from exc
            streams = [self._open_stream(tap, tap_group, w) for w in writers]
            out[tap] = [s for s in streams if s is not None]
        return out

    def _open_stream(self, tap: str, tap_group, writer: str) -> TraceStream | None:
        where = f"{self.path}/{tap}/{writer}"
        try:
            group = tap_group[writer]
        except Exception as exc:
            raise CorruptStoreError(f"{where}/zarr.json: cannot be read ({type(exc).__name__}: {exc})") from exc
        attrs = _as_dict(group.attrs, f"{where}/zarr.json: attributes")
        commit = attrs.get("commit")
        if not isinstance(commit, dict):
            raise CorruptStoreError(f"{where}/zarr.json: field 'commit' is missing or not an object")
        rows = commit.get("rows")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise CorruptStoreError(f"{where}/zarr.json: field commit.rows is {rows!r}, expected a count >= 0")
        dtype = attrs.get("dtype")
        if dtype not in VALUE_DTYPES:
            raise CorruptStoreError(
                f"{where}/zarr.json: field dtype is {dtype!r}; expected one of {', '.join(VALUE_DTYPES)}"
            )
        width = attrs.get("width")
        if not isinstance(width, int) or isinstance(width, bool) or width <= 0:
            raise CorruptStoreError(f"{where}/zarr.json: field width is {width!r}, expected a positive integer")
        try:
            values = group["values"]
        except Exception as exc:
            raise CorruptStoreError(f"{where}/values: array is missing or unreadable ({exc})") from exc
        if values.ndim != 2 or values.shape[1] != width or values.shape[0] < rows:
            raise CorruptStoreError(
                f"{where}/values: shape {values.shape} does not hold {rows} committed rows of width {width}"
            )
        if values.dtype != VALUE_DTYPES[dtype]:
            raise CorruptStoreError(
                f"{where}/values: stored dtype {values.dtype} does not match dtype attribute {dtype!r}"
            )
        for name in LABEL_FIELDS:
            try:
                arr = group[name]
            except Exception as exc:
                raise CorruptStoreError(f"{where}/{name}: label array is missing ({exc})") from exc
            if arr.ndim != 1 or arr.shape[0] < rows:
                raise CorruptStoreError(f"{where}/{name}: shape {arr.shape} holds fewer than {rows} committed rows")
        segment_size = attrs.get("segment_size")
        if segment_size is not None and (not isinstance(segment_size, int) or segment_size <= 0):
            raise CorruptStoreError(f"{where}/zarr.json: field segment_size is {segment_size!r}")
        return TraceStream(
            store=self,
            tap=tap,
            writer=writer,
            attrs=attrs,
            rows=rows,
            width=width,
            dtype=dtype,
            chunk_rows=int(values.chunks[0]),
            _group=group,
        )

    # -- convenience ----------------------------------------------------------------------------
    @property
    def taps(self) -> list[str]:
        return sorted(self.streams)

    def tap_streams(self, tap: str) -> list[TraceStream]:
        if tap not in self.streams:
            known = ", ".join(self.taps) or "none"
            raise UsageError(f"{self.path}: no tap named {tap!r}; taps in this store: {known}")
        return self.streams[tap]

    def rows(self, tap: str) -> int:
        return sum(s.rows for s in self.tap_streams(tap))


def _as_dict(attrs: Any, where: str) -> dict[str, Any]:
    try:
        return dict(attrs)
    except Exception as exc:
        raise CorruptStoreError(f"{where} cannot be read ({type(exc).__name__}: {exc})") from exc


def open_store(path: str | os.PathLike[str]) -> TraceStore:
    """Open a trace store (folder or ``.zarr.zip``) for reading."""
    return TraceStore(path)


def pack_store(src: str | os.PathLike[str], dest: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Copy a store folder into one uncompressed ``.zarr.zip`` file (to attach to a bug report).

    Only committed rows are meaningful; the zip keeps files as they are (STORED: chunks are already
    compressed or incompressible). Written to a temporary name first, so a failure leaves nothing.
    """
    src, dest = Path(src), Path(dest)
    TraceStore(src).close()  # validate first
    if not src.is_dir():
        raise UsageError(f"{src}: pack takes a store folder")
    if dest.exists() and not overwrite:
        raise StoreExistsError(f"{dest}: already exists; pass --overwrite to replace it")
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for root, _dirs, files in os.walk(src):
                for name in sorted(files):
                    if name.endswith(".partial"):
                        continue
                    full = Path(root) / name
                    zf.write(full, full.relative_to(src).as_posix())
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreWriteError(f"{dest}: cannot write the zip: {exc.strerror or exc}") from exc
    return dest
