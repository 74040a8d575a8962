"""Trace store, format 1: the zarr v3 layout every other part of tracediff reads or writes.

Layout (documented for plain zarr + numpy readers in ``docs/format.md``)::

    STORE.zarr/                      root group; attrs: tracediff, source, meta
      <tap>/                         one group per tap (attrs empty: created race-free by any writer)
        <writer>/                    one group per writing process; attrs: see WriterAttrs
          values      [row, feature]  bf16 kept as raw uint16 bits, else the tensor's dtype
          seq, position, token_id, next_token_id, step   [row] int64 (-1 = unknown)
          phase       [row] int8 (index into PHASES)
          valid       [row] bool

Every array carries zarr v3 ``dimension_names`` (VALUES_DIMS, LABEL_DIMS) and ``values`` the CF
``coordinates`` attribute naming the label arrays, so xarray opens a writer group as a Dataset with
the labels as coordinates.

Commit protocol: a batch's chunks are written first, past the arrays' recorded shapes (each chunk
file is replaced atomically by zarr's LocalStore), then every array's shape is set to the new row
count, then the writer group's ``commit`` attribute is rewritten (also atomically) with it. tracediff
only trusts ``commit.rows``: rows past it (a batch killed halfway) are invisible. A SIGKILL
therefore loses at most the batch in flight, never a torn one; and since no shape ever covers a row
before its data is on disk, a reader that trusts the shapes (xarray) sees no unwritten rows either.
Several processes write one store without locks because each owns its ``<tap>/<writer>`` group.

This module never imports torch: the recorder converts tensors to numpy before calling it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import stat
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

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
    first_line,
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
# zarr v3 dimension names of the arrays; xarray reads them as the variables' dimensions.
VALUES_DIMS: tuple[str, str] = ("row", "feature")
LABEL_DIMS: tuple[str] = ("row",)
# CF ``coordinates`` attribute of ``values``: xarray (decode_coords, on by default) makes these
# arrays coordinates of the values instead of data variables of their own.
VALUES_COORDINATES = " ".join(LABEL_FIELDS)


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
        check_replaceable(path, overwrite)
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


def check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse to replace an existing ``path`` unless ``overwrite`` and it is a trace store (or a
    folder holding nothing but zarr's temporary files), never an unrelated file or folder."""
    if not overwrite:
        raise StoreExistsError(f"{path}: already exists; pass --overwrite (overwrite=True) to replace it")
    # A plain file is never a store folder (packed .zip stores are refused above): keep it too.
    # A folder holding only zarr's temporary files is a store killed while its root zarr.json
    # was being written: as good as empty.
    if not path.is_dir() or (
        any(not (p.name.endswith(".partial") and p.is_file()) for p in path.iterdir())
        and not _looks_like_trace_store(path)
    ):
        raise StoreExistsError(f"{path}: exists and is not a tracediff store; refusing to delete it, choose another path")


def replace_store(built: Path, dest: Path) -> None:
    """Move the finished store ``built`` to ``dest`` (same folder, so renames are atomic), replacing
    a store already there only now: until this point ``dest`` holds the old store or nothing."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
    os.replace(built, dest)
    if old is not None:
        _remove_tree(old)


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


def remove_store(path: str | os.PathLike[str]) -> None:
    """Delete a trace store folder (only a trace store: an unrelated folder raises)."""
    path = Path(path)
    check_replaceable(path, overwrite=True)
    _remove_tree(path)


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
            self.writer = _unique_child(tap_group, writer, self.store_path / tap)
            _check_name(self.writer, "writer")
            # The arrays are created first, each at its folder, and the group's zarr.json (which
            # carries the commit record) last: until then the folder is not a zarr group and
            # readers skip it, so a process killed halfway through never leaves a writer group
            # with missing arrays (TraceStore would refuse the whole store). zarr.json holds no
            # paths, so these arrays are the group's members once it exists.
            folder = self.store_path / tap / self.writer
            store_dtype = VALUE_DTYPES[dtype]
            self._values = zarr.create_array(
                str(folder / "values"),
                shape=(0, self.width),
                chunks=(self.chunk_rows, self.width),
                dtype=store_dtype,
                compressors=_compressors(compressor, store_dtype.itemsize),
                fill_value=0,
                config={"write_empty_chunks": True},
                attributes={"dtype": dtype, "coordinates": VALUES_COORDINATES},
                dimension_names=VALUES_DIMS,
            )
            self._labels = {
                name: zarr.create_array(
                    str(folder / name),
                    shape=(0,),
                    chunks=(DEFAULT_LABEL_CHUNK_ROWS,),
                    dtype=LABEL_DTYPES[name],
                    # Labels compress ~10x (positions count up, ids repeat) and are small: zstd
                    # (not blosc, whose multiprocessing lock misbehaves in spawned children).
                    compressors=[_zstd()],
                    fill_value=LABEL_FILL[name],
                    config={"write_empty_chunks": True},
                    dimension_names=LABEL_DIMS,
                )
                for name in LABEL_FIELDS
            }
            self._group = tap_group.create_group(self.writer, attributes=self._attrs())
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

    @property
    def _arrays(self) -> list[Any]:
        return [self._values, *self._labels.values()]

    def _set_rows(self, rows: int) -> None:
        """Record ``rows`` as every array's length (each zarr.json rewritten atomically). Called
        once the rows' chunks are on disk, so the shapes never cover a row that holds no data:
        what xarray and other readers of the shapes see is always written rows (shrinking also
        deletes the chunks past ``rows``)."""
        changed = [arr for arr in self._arrays if arr.shape[0] != rows]
        if changed:
            self._resized = True
            _run_all([arr.async_array.resize((rows, *arr.shape[1:])) for arr in changed])

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
        before = (self.counts.rows, self.counts.batches, self.counts.bytes)
        try:
            # Values: start writes at a chunk boundary (the tail kept from the last batch in memory is
            # rewritten with the new rows) and end at the array's end, so every chunk written is
            # whole and zarr never reads one back to merge it.
            if self._tail is not None and self._tail_rows:
                block = np.concatenate([self._tail, values])
                block_start = start - self._tail_rows
            else:
                block = values
                block_start = start
            # The chunks go past the recorded shapes (through views whose shape says ``stop``);
            # only then do the shapes, and last the commit record, include the new rows.
            _run_all([
                _rows_view(self._values, stop).setitem(slice(block_start, stop), block),
                *(_rows_view(self._labels[name], stop).setitem(slice(start, stop), column)
                  for name, column in columns.items()),
            ])
            tail_rows = stop % self.chunk_rows
            self._tail = block[len(block) - tail_rows :].copy() if tail_rows else None
            self._tail_rows = tail_rows
            self._set_rows(stop)
            self.counts.rows = stop
            self.counts.batches += 1
            self.counts.bytes += int(values.nbytes)
            self._commit(block_start)
        except OSError as exc:
            # Not committed (the commit record itself may be what failed): count the batch out again.
            self.counts.rows, self.counts.batches, self.counts.bytes = before
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError):  # shapes back to the committed rows (close retries)
                self._set_rows(self.counts.rows)
            self._discard_uncommitted()  # a full disk: give back what the failed batch took
            raise StoreWriteError(
                f"{self.store_path}/{self.tap}/{self.writer}: write of rows {start}..{stop} failed: {exc}"
            ) from exc

    def _discard_uncommitted(self) -> None:
        """Best effort: delete the chunk files that hold no committed row (what a failed batch wrote
        past ``commit.rows``). They are not data, and on a full disk the space they hold is what the
        final commit record (``status: failed``) needs. Chunks with committed rows are kept."""
        base = self.store_path / self.tap / self.writer
        rows = self.counts.rows
        for name, chunk_rows in (("values", self.chunk_rows), *((n, DEFAULT_LABEL_CHUNK_ROWS) for n in LABEL_FIELDS)):
            folder = base / name / "c"
            try:
                entries = os.listdir(folder)
            except OSError:
                continue
            for entry in entries:
                if entry.isdigit() and int(entry) * chunk_rows >= rows:
                    with contextlib.suppress(OSError):
                        _remove_tree(folder / entry)

    def record_drop(self, rows: int, batches: int = 1, *, skipped: bool = False) -> None:
        """Count rows not written (queue full or error: dropped; sampling limits: skipped)."""
        if skipped:
            self.counts.skipped_rows += rows
            self.counts.skipped_batches += batches
        else:
            self.counts.dropped_rows += rows
            self.counts.dropped_batches += batches

    def close(self, status: str = "closed", error: str = "") -> None:
        """Write the final commit record, then trim the arrays to the committed rows (needed only
        after a failed batch: normally every shape already says ``commit.rows``).

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
        try:
            self._set_rows(rows)
        except OSError as exc:
            raise StoreWriteError(
                f"{where}: {rows} rows committed, but trimming the arrays to them failed: {exc}"
            ) from exc


def _rows_view(array: Any, rows: int) -> Any:
    """``array``'s async twin (same store, codecs and config) with a shape of ``rows`` rows, held in
    memory only: it writes chunks past the array's recorded shape without rewriting its zarr.json."""
    if array.shape[0] == rows:
        return array.async_array
    metadata = array.metadata.update_shape((rows, *array.shape[1:]))
    return _zarr().AsyncArray(metadata=metadata, store_path=array.store_path, config=array.config)


def _run_all(coroutines: Sequence[Any]) -> None:
    """Run zarr coroutines together on zarr's event loop, in one round trip from this thread (each
    sync call costs ~1.5 ms here, and a batch touches eight arrays). All finish before the first
    error, if any, is raised: nothing still writes when the caller handles it."""
    import asyncio  # noqa: PLC0415

    from zarr.core.sync import sync  # noqa: PLC0415  (what zarr's own synchronous Array uses)

    async def together() -> list[Any]:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    for result in sync(together()):
        if isinstance(result, BaseException):
            raise result


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


def _unique_child(group, name: str, folder: Path) -> str:
    """``name``, or ``name_2``, ``name_3``...: the first that is neither a group nor a folder left
    by a writer killed while creating its group (arrays there, no group zarr.json yet)."""

    def taken(candidate: str) -> bool:
        return candidate in group or os.path.lexists(folder / candidate)

    if not taken(name):
        return name
    n = 2
    while taken(f"{name}_{n}"):
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
    _group: Any = field(repr=False)  # array name -> zarr array, opened by exact path after validation
    _values_raw: bool = field(default=False, repr=False)  # values chunks hold plain bytes (no codec)
    _values_endian: str = field(default="little", repr=False)
    #: label name -> (byte order, chunk rows) for label arrays read straight from their zstd chunk
    #: files (a folder store whose label codecs are exactly bytes + zstd); others go through zarr.
    _label_direct: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)

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
        arr = self._group.get(name)
        if arr is None:
            raise CorruptStoreError(f"{where}: label array is missing")
        if arr.ndim != 1 or arr.shape[0] < self.rows:
            raise CorruptStoreError(f"{where}: has shape {arr.shape}, expected at least {self.rows} rows")
        if self.rows == 0:
            return np.empty(0, dtype=LABEL_DTYPES[name])
        direct = self._label_direct.get(name)
        if direct is not None and direct[1] == arr.chunks[0]:
            data = self._read_label_direct(name, *direct)
        else:
            data = self._read_array(name, np.arange(0, -(-self.rows // arr.chunks[0])), lambda a: a[: self.rows])
        if data.shape != (self.rows,) or data.dtype != LABEL_DTYPES[name]:
            raise CorruptStoreError(f"{where}: read {data.shape} {data.dtype}, expected ({self.rows},) {LABEL_DTYPES[name]}")
        return data

    def labels(self, names: Sequence[str] = LABEL_FIELDS) -> dict[str, np.ndarray]:
        return {name: self.label(name) for name in names}

    def _read_label_direct(self, name: str, endian: str, chunk_rows: int) -> np.ndarray:
        """One label column decoded straight from its zstd chunk files (zarr's per-chunk machinery
        costs ~0.65 ms a chunk; this, the file read and the decompression). The same checks as
        through zarr: every chunk a plain file, each decoding to exactly one chunk of the dtype."""
        from numcodecs import Zstd  # noqa: PLC0415

        dtype = LABEL_DTYPES[name].newbyteorder("<" if endian == "little" else ">")
        expect = chunk_rows * dtype.itemsize
        out = np.empty(-(-self.rows // chunk_rows) * chunk_rows, dtype=LABEL_DTYPES[name])
        codec = Zstd()
        folder = os.fspath(self.store.path / self.tap / self.writer / name / "c")
        for index in range(out.shape[0] // chunk_rows):
            path = f"{folder}/{index}"
            fd = _open_plain_file(path)
            if fd is None:
                raise CorruptStoreError(f"{path}: chunk file is missing (deleted?) but holds committed rows")
            try:
                size = os.fstat(fd).st_size
                if size == 0 or size > _MAX_CHUNK_BYTES:
                    raise CorruptStoreError(f"{path}: chunk file holds {size} bytes (truncated or foreign file?)")
                blob = os.pread(fd, size, 0)
            except OSError as exc:
                raise _read_error(path, exc) from exc
            finally:
                os.close(fd)
            try:
                raw = codec.decode(blob)
            except Exception as exc:  # noqa: BLE001  (the codec raises several types for a bad frame)
                raise CorruptStoreError(f"{path}: chunk cannot be decoded ({type(exc).__name__}: {first_line(exc)})") from exc
            if len(raw) != expect:
                raise CorruptStoreError(f"{path}: chunk cannot be decoded to {expect} bytes (it holds {len(raw)})")
            out[index * chunk_rows:(index + 1) * chunk_rows] = np.frombuffer(raw, dtype=dtype)
        return out[: self.rows]

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
            bad, cause = self._failing_chunk(arr, chunks, exc)
            where = self.store._display(self._chunk_key(name, bad))
            if isinstance(cause, OSError):
                raise _read_error(where, cause) from exc
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

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Raw stored values of rows [start, stop) (uint16 bits for bf16)."""
        stop = self.rows if stop is None else min(stop, self.rows)
        start = max(0, start)
        if start >= stop:
            return np.empty((0, self.width), dtype=VALUE_DTYPES[self.dtype])
        chunks = np.arange(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1)
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
            path = os.fspath(self.store.path / self.tap / self.writer / "values" / "c" / str(index) / "0")
            count = self.chunk_rows * self.width
            fd = _open_chunk_file(path, count * self._raw_dtype.itemsize)
            try:
                data = np.empty(count, dtype=self._raw_dtype)
                self._pread(fd, path, [data.data.cast("B")], 0, data.nbytes)
            finally:
                os.close(fd)
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
            raise _read_error(path, exc) from exc
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
        return self._values_raw and self.store._zip is None

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


_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)

# What a reader accepts on disk is what TraceWriter writes, checked before zarr touches a byte of
# data: no codec that could run code from a file (zarr v2's pickle and object codecs), no vlen or
# sharding codec, no metadata that makes a reader allocate more than a chunk file can hold.
ALLOWED_CODECS = frozenset({"bytes", "blosc", "zstd"})
_MAX_CHUNK_BYTES = 0x7FFFF000  # the most one read() returns on Linux; blosc holds less
_MAX_METADATA_BYTES = 64 << 20  # a zarr.json larger than this is not one tracediff wrote


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def _open_plain_file(path: str) -> int | None:
    """Open ``path`` for reading without ever blocking (a FIFO would wait forever for a writer);
    None when it does not exist; :class:`CorruptStoreError` when it cannot be read or is not a
    plain file (symlink loop, folder, FIFO, socket, device)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _read_error(path, exc) from exc
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise _read_error(path, exc) from exc
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptStoreError(f"{path}: is {_file_kind(mode)}, not a file")
    return fd


def _open_chunk_file(path: str, size: int) -> int:
    """File descriptor of an uncompressed chunk file of exactly ``size`` bytes. A missing chunk is
    corruption, never the fill value: the writer writes every chunk of the rows it commits."""
    fd = _open_plain_file(path)
    if fd is None:
        raise CorruptStoreError(f"{path}: chunk file is missing (deleted?) but holds committed rows")
    actual = os.fstat(fd).st_size
    if actual != size:
        os.close(fd)
        raise CorruptStoreError(f"{path}: chunk holds {actual} bytes, expected {size} (truncated or foreign file?)")
    return fd


def _read_error(where: str, exc: OSError, verb: str = "read") -> StoreError:
    """The error for a file of the store that the OS will not read: a permission problem is not
    damage (:class:`StoreError`), anything else is (:class:`CorruptStoreError`)."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, PermissionError):
        return StoreError(f"{where}: cannot be {verb} ({reason}): check the permissions")
    return CorruptStoreError(f"{where}: cannot be {verb} ({reason})")


class ChunkFiles:
    """Open uncompressed chunk files for :meth:`TraceStream.read_chunk`, the least recently used
    closed beyond ``limit``. Not thread-safe: one per reading thread; close it (or use ``with``)."""

    def __init__(self, limit: int = 64) -> None:
        from collections import OrderedDict  # noqa: PLC0415

        self.limit = max(1, int(limit))
        self._fds: OrderedDict[str, int] = OrderedDict()

    def open(self, path: str, size: int) -> int:
        """File descriptor of chunk file ``path``, which must be a plain file of exactly ``size`` bytes
        (:class:`CorruptStoreError` otherwise: missing, truncated, a FIFO, a folder...)."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = _open_chunk_file(path, size)
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
    """A trace store opened for reading: a folder or a ``.zarr.zip`` file. Validates on open.

    Every metadata document (``zarr.json``) is read and checked here before zarr sees it: node
    types, the commit record against the arrays' shapes, dtypes, chunk shapes, and the codecs
    against :data:`ALLOWED_CODECS`. zarr only ever opens the arrays that passed, by exact path, and
    every chunk file of the committed rows is checked to exist as a plain file (of the exact size
    when uncompressed) before any is read. So a damaged or hostile store fails on open, with one
    :class:`StoreError` naming the file and the field, and never makes a reader run code from the
    store, block on a FIFO, follow a symlink loop or allocate what its metadata claims.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._zip = None  # zarr's ZipStore of a .zarr.zip store
        self._zipfile: zipfile.ZipFile | None = None
        self._zip_names: dict[str, zipfile.ZipInfo] = {}
        if not os.path.lexists(self.path):
            raise StoreNotFoundError(f"{self.path}: no such trace store")
        try:
            mode = os.stat(self.path).st_mode
        except OSError as exc:
            raise NotATraceStoreError(f"{self.path}: cannot be opened ({exc.strerror or exc})") from exc
        try:
            if stat.S_ISDIR(mode):
                from zarr.storage import LocalStore  # noqa: PLC0415

                self._zstore: Any = LocalStore(str(self.path), read_only=True)
            elif stat.S_ISREG(mode) and zipfile.is_zipfile(self.path):
                from zarr.storage import ZipStore  # noqa: PLC0415

                self._zipfile = zipfile.ZipFile(self.path)
                self._zip_names = {info.filename: info for info in self._zipfile.infolist()}
                self._zip = ZipStore(str(self.path), mode="r")
                self._zstore = self._zip
            else:
                what = "a file but not a zip archive (or a truncated one)" if stat.S_ISREG(mode) else _file_kind(mode)
                raise NotATraceStoreError(
                    f"{self.path}: not a trace store (neither a folder nor a .zarr.zip file: it is {what})"
                )
        except StoreError:
            self.close()
            raise
        except PermissionError as exc:
            self.close()
            raise StoreError(f"{self.path}: permission denied reading the store") from exc
        except Exception as exc:  # noqa: BLE001  (zipfile and zarr raise several types for a bad file)
            self.close()
            raise CorruptStoreError(f"{self.path}: cannot be read ({type(exc).__name__}: {first_line(exc)})") from exc
        try:
            self._open_root()
        except BaseException:
            self.close()
            raise

    def _open_root(self) -> None:
        doc = self._node_doc("", root=True)
        if doc is None:
            raise NotATraceStoreError(f"{self.path}: not a zarr v3 store (no zarr.json at its top)")
        where = self._display("zarr.json")
        attrs = _group_attributes(doc, where, error=NotATraceStoreError)
        header = attrs.get("tracediff")
        if not isinstance(header, dict):
            raise NotATraceStoreError(f"{where}: no 'tracediff' attribute: this zarr is not a trace store")
        fmt = header.get("format")
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise CorruptStoreError(f"{where}: field tracediff.format is {fmt!r}, expected an integer")
        if fmt > FORMAT:
            raise FormatVersionError(
                f"{where}: tracediff.format is {fmt}, newer than this tracediff reads ({FORMAT}); upgrade tracediff"
            )
        if fmt < 1:
            raise CorruptStoreError(f"{where}: tracediff.format {fmt} is not a known format")
        self.format = fmt
        self.version = str(header.get("version", ""))
        self.source = attrs.get("source") if isinstance(attrs.get("source"), dict) else {}
        self.meta = attrs.get("meta") if isinstance(attrs.get("meta"), dict) else {}
        self.streams: dict[str, list[TraceStream]] = self._scan()

    def close(self) -> None:
        if self._zip is not None:
            with contextlib.suppress(AttributeError):  # zarr's ZipStore fails to close if it never opened
                self._zip.close()
            self._zip = None
        if self._zipfile is not None:
            self._zipfile.close()
            self._zipfile = None

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading metadata and checking chunk files, for a folder or a zip ------------------------
    def _display(self, key: str) -> str:
        return f"{self.path}/{key}" if key else str(self.path)

    def _read_bytes(self, key: str, limit: int) -> bytes | None:
        """The bytes of store key ``key`` (None if absent), refusing more than ``limit`` bytes."""
        where = self._display(key)
        if self._zipfile is not None:
            info = self._zip_names.get(key)
            if info is None:
                return None
            if info.file_size > limit:
                raise CorruptStoreError(f"{where}: {info.file_size} bytes, more than a trace store's metadata holds")
            try:
                return self._zipfile.read(info)
            except Exception as exc:  # noqa: BLE001  (BadZipFile, zlib.error, EOFError...)
                raise CorruptStoreError(f"{where}: cannot be read from the zip ({type(exc).__name__}: {first_line(exc)})") from exc
        fd = _open_plain_file(where)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CorruptStoreError(f"{where}: {size} bytes, more than a trace store's metadata holds")
            parts, got = [], 0
            while got <= size:  # read to the end (a file can grow while it is read)
                part = os.read(fd, max(size - got, 0) + 1)
                if not part:
                    break
                parts.append(part)
                got += len(part)
                if got > limit:
                    raise CorruptStoreError(f"{where}: more than {limit} bytes, more than a trace store's metadata holds")
            return b"".join(parts)
        except OSError as exc:
            raise _read_error(where, exc) from exc
        finally:
            os.close(fd)

    def _node_doc(self, key: str, *, root: bool = False) -> dict[str, Any] | None:
        """The parsed ``zarr.json`` of node ``key`` ('' = the root), None if it has none."""
        name = f"{key}/zarr.json" if key else "zarr.json"
        where = self._display(name)
        error = NotATraceStoreError if root else CorruptStoreError
        data = self._read_bytes(name, _MAX_METADATA_BYTES)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise error(f"{where}: not valid JSON ({first_line(exc)})") from exc
        if not isinstance(doc, dict):
            raise error(f"{where}: holds {_json_type(doc)}, expected a JSON object (zarr v3 metadata)")
        if doc.get("zarr_format") != 3:
            raise error(f"{where}: field zarr_format is {doc.get('zarr_format')!r}, expected 3 (a zarr v3 store)")
        if doc.get("node_type") not in ("group", "array"):
            raise error(f"{where}: field node_type is {doc.get('node_type')!r}, expected 'group' or 'array'")
        return doc

    def _children(self, key: str) -> list[str]:
        """Names of the child nodes (folders holding a zarr.json) of group ``key``, sorted."""
        if self._zipfile is not None:
            prefix = f"{key}/" if key else ""
            depth = prefix.count("/") + 1
            return sorted({
                name[len(prefix):].split("/")[0] for name in self._zip_names
                if name.startswith(prefix) and name.endswith("/zarr.json") and name.count("/") == depth
            })
        where = self._display(key)
        try:
            with os.scandir(where) as entries:
                names = sorted(e.name for e in entries if e.name != "zarr.json")
        except OSError as exc:
            raise _read_error(where, exc, "listed") from exc
        out = []
        for name in names:
            child = os.path.join(where, name)
            try:
                is_dir = stat.S_ISDIR(os.stat(child).st_mode)
            except FileNotFoundError:  # a dangling link or a file renamed away meanwhile: no node
                continue
            except OSError as exc:  # a symlink loop where a node could be
                raise _read_error(child, exc) from exc
            if not is_dir:
                continue
            try:
                os.lstat(os.path.join(child, "zarr.json"))
            except FileNotFoundError:  # a folder that is no zarr node (a writer killed while creating it)
                continue
            except OSError as exc:  # unreadable: never skip a tap or writer silently
                raise _read_error(os.path.join(child, "zarr.json"), exc) from exc
            out.append(name)
        return out

    def _chunk_count(self, key: str) -> int:
        """How many chunk entries array ``key`` has under ``c/`` (a bound, found by one listing)."""
        if self._zipfile is not None:
            prefix = f"{key}/c/"
            return len({name[len(prefix):].split("/")[0] for name in self._zip_names if name.startswith(prefix)})
        try:
            return len(os.listdir(self._display(f"{key}/c")))
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise _read_error(self._display(key + '/c'), exc, "listed") from exc

    def _check_chunk(self, key: str, raw_size: int | None) -> None:
        """Chunk ``key`` holds committed rows: it must be a plain file, of exactly ``raw_size`` bytes
        when uncompressed, else not empty."""
        where = self._display(key)
        if self._zipfile is not None:
            info = self._zip_names.get(key)
            size = None if info is None else info.file_size
        else:
            try:
                st = os.stat(where)
            except FileNotFoundError:
                size = None
            except OSError as exc:
                raise _read_error(where, exc) from exc
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptStoreError(f"{where}: is {_file_kind(st.st_mode)}, not a chunk file")
                size = st.st_size
        if size is None:
            raise CorruptStoreError(f"{where}: chunk file is missing (deleted?) but holds committed rows")
        if raw_size is not None and size != raw_size:
            raise CorruptStoreError(f"{where}: chunk holds {size} bytes, expected {raw_size} (truncated or foreign file?)")
        if size == 0:
            raise CorruptStoreError(f"{where}: chunk file is empty (truncated?)")

    def _open_array(self, key: str, *, ndim: int, data_type: str, rows: int) -> tuple[Any, dict[str, Any]]:
        """Check array ``key``'s metadata, its committed chunk files, then open it with zarr."""
        where = self._display(f"{key}/zarr.json")
        doc = self._node_doc(key)
        if doc is None:
            raise CorruptStoreError(f"{self._display(key)}: array is missing (no zarr.json)")
        _check_array_doc(doc, where, ndim=ndim, data_type=data_type, rows=rows)
        chunk_rows = doc["chunk_grid"]["configuration"]["chunk_shape"][0]
        needed = -(-rows // chunk_rows)
        if needed:
            found = self._chunk_count(key)
            if found < needed:
                raise CorruptStoreError(
                    f"{self._display(key + '/c')}: {found} chunk(s) for the {rows} committed rows (field "
                    f"commit.rows), which need {needed}: chunk files are missing or the commit record is wrong"
                )
            codecs = [c["name"] for c in doc["codecs"]]
            raw_size = math.prod(doc["chunk_grid"]["configuration"]["chunk_shape"]) * np.dtype(data_type).itemsize
            for c in range(needed):
                self._check_chunk(f"{key}/c/{c}" + "/0" * (ndim - 1), raw_size if codecs == ["bytes"] else None)
        try:
            array = _zarr().open_array(store=self._zstore, path=key, mode="r", zarr_format=3)
        except Exception as exc:  # noqa: BLE001  (zarr rejects odd metadata with several types)
            raise CorruptStoreError(f"{where}: not a readable zarr array ({type(exc).__name__}: {first_line(exc)})") from exc
        return array, doc

    # -- the tree ---------------------------------------------------------------------------------
    def _scan(self) -> dict[str, list[TraceStream]]:
        out: dict[str, list[TraceStream]] = {}
        for tap in self._children(""):
            doc = self._node_doc(tap)
            if doc is None or doc["node_type"] != "group":
                raise CorruptStoreError(f"{self._display(tap + '/zarr.json')}: field node_type: a tap must be a group")
            streams = [self._open_stream(tap, writer) for writer in self._children(tap)]
            out[tap] = [s for s in streams if s is not None]
        return out

    def _open_stream(self, tap: str, writer: str) -> TraceStream | None:
        key = f"{tap}/{writer}"
        where = self._display(key)
        meta_file = f"{where}/zarr.json"
        doc = self._node_doc(key)
        if doc is None or doc["node_type"] != "group":
            raise CorruptStoreError(f"{meta_file}: field node_type: a writer must be a group")
        attrs = _group_attributes(doc, meta_file)
        commit = attrs.get("commit")
        if not isinstance(commit, dict):
            raise CorruptStoreError(f"{meta_file}: field 'commit' is missing or not an object")
        rows = commit.get("rows")
        if not _is_int(rows) or rows < 0:
            raise CorruptStoreError(f"{meta_file}: field commit.rows is {rows!r}, expected a count >= 0")
        seq_names = commit.get("seq_names")
        if seq_names is not None and not (
            isinstance(seq_names, dict) and all(_is_int(v) for v in seq_names.values())
        ):
            raise CorruptStoreError(
                f"{meta_file}: field commit.seq_names is {_short_repr(seq_names)}, expected an object of name: integer"
            )
        dtype = attrs.get("dtype")
        if not isinstance(dtype, str) or dtype not in VALUE_DTYPES:
            raise CorruptStoreError(
                f"{meta_file}: field dtype is {_short_repr(dtype)}; expected one of {', '.join(VALUE_DTYPES)}"
            )
        width = attrs.get("width")
        if not _is_int(width) or width <= 0:
            raise CorruptStoreError(f"{meta_file}: field width is {_short_repr(width)}, expected a positive integer")
        phases = attrs.get("phases")
        if phases is not None and (
            not isinstance(phases, list) or not all(isinstance(p, str) for p in phases)
            or list(phases[: len(PHASES)]) != list(PHASES[: len(phases)])
        ):
            raise CorruptStoreError(
                f"{meta_file}: field phases is {_short_repr(phases)}; expected the phase names {list(PHASES)}"
            )
        segment_size = attrs.get("segment_size")
        if segment_size is not None and (not _is_int(segment_size) or segment_size <= 0 or width % segment_size):
            raise CorruptStoreError(
                f"{meta_file}: field segment_size is {_short_repr(segment_size)}, expected a positive integer that "
                f"divides the width {width}"
            )
        labels = attrs.get("segment_labels")
        if labels is not None:
            if not isinstance(labels, list) or not all(isinstance(x, (str, int)) for x in labels):
                raise CorruptStoreError(f"{meta_file}: field segment_labels is {_short_repr(labels)}, expected a list of names")
            if segment_size is not None and len(labels) != width // segment_size:
                raise CorruptStoreError(
                    f"{meta_file}: field segment_labels names {len(labels)} segments but width {width} / segment_size "
                    f"{segment_size} makes {width // segment_size}; fix the attribute or record again"
                )
        values, values_doc = self._open_array(f"{key}/values", ndim=2, data_type=VALUE_DTYPES[dtype].name, rows=rows)
        shape = values_doc["shape"]
        chunk_shape = values_doc["chunk_grid"]["configuration"]["chunk_shape"]
        if shape[1] != width or chunk_shape[1] != width:
            raise CorruptStoreError(
                f"{where}/values/zarr.json: field shape {shape} (chunks {chunk_shape}) does not hold rows of width "
                f"{width} (field width of {meta_file})"
            )
        stored_as = (values_doc.get("attributes") or {}).get("dtype", dtype)
        if stored_as != dtype:
            raise CorruptStoreError(
                f"{where}/values/zarr.json: field attributes.dtype is {_short_repr(stored_as)} but {meta_file} says "
                f"dtype {dtype!r}: the two disagree on how to decode the values"
            )
        arrays = {"values": values}
        direct: dict[str, tuple[str, int]] = {}
        for name in LABEL_FIELDS:
            arrays[name], label_doc = self._open_array(f"{key}/{name}", ndim=1, data_type=LABEL_DTYPES[name].name,
                                                       rows=rows)
            label_codecs = label_doc["codecs"]
            if self._zip is None and [c["name"] for c in label_codecs] == ["bytes", "zstd"]:
                order = (label_codecs[0].get("configuration") or {}).get("endian", "little")
                label_chunks = label_doc["chunk_grid"]["configuration"]["chunk_shape"]
                direct[name] = ("big" if order == "big" else "little", int(label_chunks[0]))
        codecs = values_doc["codecs"]
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        return TraceStream(
            store=self,
            tap=tap,
            writer=writer,
            attrs=attrs,
            rows=rows,
            width=width,
            dtype=dtype,
            chunk_rows=int(chunk_shape[0]),
            _group=arrays,
            _values_raw=[c["name"] for c in codecs] == ["bytes"],
            _values_endian="big" if endian == "big" else "little",
            _label_direct=direct,
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


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _group_attributes(doc: dict[str, Any], where: str, error: type[StoreError] = CorruptStoreError) -> dict[str, Any]:
    if doc["node_type"] != "group":
        raise error(f"{where}: field node_type is 'array', expected a group")
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise error(f"{where}: field attributes is {_json_type(attrs)}, expected an object")
    return attrs


def _check_array_doc(doc: dict[str, Any], where: str, *, ndim: int, data_type: str, rows: int) -> None:
    """An array's zarr.json must be what TraceWriter writes: ``ndim`` dimensions of ``data_type``,
    regular chunks of at most _MAX_CHUNK_BYTES, default chunk keys, ALLOWED_CODECS only, at least
    ``rows`` rows, ``dimension_names`` (when present) one string or null per dimension."""
    if doc["node_type"] != "array":
        raise CorruptStoreError(f"{where}: field node_type is 'group', expected an array")
    shape = doc.get("shape")
    if not isinstance(shape, list) or len(shape) != ndim or not all(_is_int(n) and n >= 0 for n in shape):
        raise CorruptStoreError(f"{where}: field shape is {_short_repr(shape)}, expected {ndim} dimension(s) of size >= 0")
    if shape[0] < rows:
        raise CorruptStoreError(
            f"{where}: field shape {shape} holds fewer than the {rows} committed rows (field commit.rows)"
        )
    if doc.get("data_type") != data_type:
        raise CorruptStoreError(f"{where}: field data_type is {_short_repr(doc.get('data_type'))}, expected {data_type!r}")
    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = config.get("chunk_shape") if isinstance(config, dict) else None
    if (
        not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(chunks, list)
        or len(chunks) != ndim or not all(_is_int(n) and n > 0 for n in chunks)
    ):
        raise CorruptStoreError(f"{where}: field chunk_grid is {_short_repr(grid)}, expected regular chunks of {ndim} sizes > 0")
    if math.prod(chunks) * np.dtype(data_type).itemsize > _MAX_CHUNK_BYTES:
        raise CorruptStoreError(f"{where}: field chunk_grid: chunks of {chunks} {data_type} are larger than any chunk "
                                f"tracediff writes ({_MAX_CHUNK_BYTES} bytes)")
    encoding = doc.get("chunk_key_encoding")
    config = encoding.get("configuration") if isinstance(encoding, dict) else None
    separator = (config or {}).get("separator", "/") if isinstance(config, (dict, type(None))) else None
    if not isinstance(encoding, dict) or encoding.get("name") != "default" or separator != "/":
        raise CorruptStoreError(f"{where}: field chunk_key_encoding is {_short_repr(encoding)}, expected default with '/'")
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        raise CorruptStoreError(f"{where}: field codecs is {_short_repr(codecs)}, expected a list of codecs")
    for codec in codecs:
        if not isinstance(codec.get("name"), str) or codec["name"] not in ALLOWED_CODECS:
            raise CorruptStoreError(
                f"{where}: field codecs names codec {_short_repr(codec.get('name'))}, which tracediff never writes "
                f"(allowed: {', '.join(sorted(ALLOWED_CODECS))}); refusing to decode it"
            )
        if not isinstance(codec.get("configuration", {}), dict):
            raise CorruptStoreError(f"{where}: field codecs: codec {codec['name']!r} has a configuration that is not an object")
    if codecs[0]["name"] != "bytes" or any(c["name"] == "bytes" for c in codecs[1:]):
        raise CorruptStoreError(f"{where}: field codecs must start with the one 'bytes' codec, got {[c['name'] for c in codecs]}")
    # Optional: stores written before the writer named its dimensions have none. zarr itself takes
    # any iterable of strings (a string, an object's keys) and checks the length only later.
    names = doc.get("dimension_names")
    if names is not None and (
        not isinstance(names, list) or len(names) != ndim or not all(n is None or isinstance(n, str) for n in names)
    ):
        raise CorruptStoreError(
            f"{where}: field dimension_names is {_short_repr(names)}, expected a list of {ndim} name(s) "
            "(strings or null), one per dimension"
        )
    if doc.get("storage_transformers") not in (None, []):
        raise CorruptStoreError(f"{where}: field storage_transformers is {_short_repr(doc['storage_transformers'])}, expected none")
    if not isinstance(doc.get("attributes", {}), dict):
        raise CorruptStoreError(f"{where}: field attributes is {_json_type(doc['attributes'])}, expected an object")


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
