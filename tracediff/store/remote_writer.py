"""Recording straight to object storage (``record -o s3://...``): creating a store at a URL and
:class:`RemoteTraceWriter`, one process's writer group written through zarr's FsspecStore.

The commit protocol of :mod:`tracediff.store` holds unchanged because an object PUT is atomic (a
reader sees the old object or the new one, never part of one): a batch's chunk objects first,
past the arrays' recorded shapes, then each array's ``zarr.json`` with the new row count, then the
writer group's ``zarr.json`` with the commit record. A writer killed mid-upload leaves at most
chunk objects past ``commit.rows``, which readers never look at. There is no fsync on object
storage: a PUT that returned is stored (``durable`` changes nothing here). What object stores do
not all promise (read-after-write and listing consistency) is in ``docs/remote.md``.

Kept apart from :mod:`tracediff.store.writer`'s local path, which writes files and tunes for disks.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracediff import __version__
from tracediff.errors import NotATraceStoreError, StoreError, StoreExistsError, StoreWriteError, UsageError
from tracediff.store.batches import WriterCounts, _check_name, _rows_view, _run_all, batch_columns
from tracediff.store.format import (
    _MAX_METADATA_BYTES,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    DEFAULT_LABEL_CHUNK_ROWS,
    FORMAT,
    LABEL_DIMS,
    LABEL_DTYPES,
    LABEL_FIELDS,
    LABEL_FILL,
    VALUE_DTYPES,
    VALUES_COORDINATES,
    VALUES_DIMS,
    _compressors,
    _jsonable,
    _now_iso,
    _zarr,
    _zstd,
    default_source,
    group_document,
)
from tracediff.store.location import Location, remote_error


def store_exists(loc: Location) -> bool:
    """Whether a trace store (a root ``zarr.json`` with the ``tracediff`` attribute) is at ``loc``."""
    data = loc.read_object("zarr.json", _MAX_METADATA_BYTES)
    if data is None:
        return False
    try:
        return "tracediff" in (json.loads(data).get("attributes") or {})
    except (ValueError, AttributeError):
        return False


def create_remote_store(
    loc: Location,
    *,
    role: str = "",
    meta: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    join: bool = False,
) -> Location:
    """Create an empty trace store at URL ``loc`` (its root ``zarr.json``).

    ``join``: a trace store already there is kept as it is, for several processes or nodes that
    record into one store, each adding its own writer groups. Otherwise an existing store is
    refused unless ``overwrite`` (then deleted); objects there that are no trace store always are.
    """
    if loc.name.endswith(".zip"):
        raise UsageError(f"{loc.display}: a .zarr.zip store is read-only; record into a folder URL")
    exists = store_exists(loc)
    if exists and join:
        return loc
    if exists:
        if not overwrite:
            raise StoreExistsError(f"{loc.display}: already exists; pass --overwrite (overwrite=True) to replace it")
        remove_remote_store(loc)
    else:
        try:
            present = loc.fs.ls(loc.root, detail=False)
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise StoreWriteError(
                    f"{loc.display}: cannot create the store ({exc}); create the bucket first"
                ) from exc
            present = []
        except Exception as exc:  # noqa: BLE001
            raise remote_error(loc.display, exc, "listed") from exc
        if present:
            if join and store_exists(loc):  # another node created it since we looked
                return loc
            raise StoreExistsError(
                f"{loc.display}: holds objects that are no tracediff store; refusing to delete them, choose another URL"
            )
    attrs = {
        "tracediff": {"format": FORMAT, "version": __version__},
        "source": dict(source) if source is not None else default_source(role),
        "meta": _jsonable(dict(meta or {})),
    }
    # One create-if-absent write of the root zarr.json, never zarr's mode="w" (it first deletes
    # everything under the prefix: another node's groups included). Of nodes creating the store at
    # once, one wins and the others join it (or, without join, are told it was taken).
    if not loc.create_object("zarr.json", group_document(attrs)):
        if join and store_exists(loc):
            return loc
        if join:
            raise StoreExistsError(
                f"{loc.where('zarr.json')}: appeared meanwhile and is no tracediff store's root; choose another URL"
            )
        raise StoreExistsError(f"{loc.display}: was created by another process meanwhile; choose another URL")
    return loc


def remove_remote_store(loc: Location) -> None:
    """Delete the trace store at URL ``loc`` (refused when what is there is no trace store)."""
    if not store_exists(loc):
        raise StoreExistsError(f"{loc.display}: is not a tracediff store; refusing to delete it")
    loc.delete_all()


def default_writer_name(rank: int | None, pid: int) -> str:
    """A writer name unique across the nodes recording into one remote store: the host is part of
    it (process ids repeat from machine to machine)."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()).strip("-_") or "host"
    return f"{host}-rank{rank}-pid{pid}" if rank is not None else f"{host}-pid{pid}"


class RemoteTraceWriter:
    """:class:`~tracediff.store.TraceWriter` for a store at a URL: the same methods and commit
    record, written as objects. Not thread-safe: one writer thread owns it."""

    def __init__(
        self,
        store: Location,
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
        self.location = store
        self.store_path = store
        self.tap = tap
        self.width = int(width)
        self.dtype = dtype
        self.chunk_rows = int(chunk_rows)
        self.durable = durable  # nothing to fsync: a PUT that returned is stored
        self.compressor = compressor
        self.counts = WriterCounts()
        self.seq_names: dict[str, int] = {}
        self.status = "recording"
        self.error = ""
        self._extra_attrs = _jsonable(dict(attrs or {}))
        self._tail: np.ndarray | None = None
        self._tail_rows = 0
        zarr = _zarr()
        if not store_exists(store):
            raise NotATraceStoreError(f"{store.display}: no trace store there to append to (no root zarr.json)")
        taken = set(store.list_folders(tap))
        name = writer
        n = 2
        while name in taken:  # a group of this name, or the folder of a writer killed creating it
            name = f"{writer}_{n}"
            n += 1
        _check_name(name, "writer")
        self.writer = name
        prefix = f"{tap}/{name}"
        try:
            # Arrays first, the writer group's zarr.json (with the commit record) last: until then
            # readers skip the folder, as for a local store. The tap group is shared: whichever
            # writer comes first creates it, with a create-if-absent PUT, and one that finds it
            # there (or being written) opens it. zarr's own open-or-create checks, then creates,
            # and fails when another process creates the group in between (issue #24).
            # Each node is created through a store rooted at it: zarr would otherwise write the
            # missing parents' zarr.json, the writer group's among them, before the arrays exist.
            store.create_object(f"{tap}/zarr.json", group_document({}))
            tap_group = zarr.open_group(store=(store / tap).zarr_store(read_only=False), mode="r+")
            store_dtype = VALUE_DTYPES[dtype]
            self._values = zarr.create_array(
                store=(store / f"{prefix}/values").zarr_store(read_only=False),
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
                label: zarr.create_array(
                    store=(store / f"{prefix}/{label}").zarr_store(read_only=False),
                    shape=(0,),
                    chunks=(DEFAULT_LABEL_CHUNK_ROWS,),
                    dtype=LABEL_DTYPES[label],
                    compressors=[_zstd()],
                    fill_value=LABEL_FILL[label],
                    config={"write_empty_chunks": True},
                    dimension_names=LABEL_DIMS,
                )
                for label in LABEL_FIELDS
            }
            self._group = tap_group.create_group(name, attributes=self._attrs())
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001  (s3fs, botocore and aiohttp raise many types)
            raise StoreWriteError(f"{store.display}/{prefix}: cannot create writer group: {exc}") from exc

    @property
    def _where(self) -> str:
        return f"{self.location.display}/{self.tap}/{self.writer}"

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
                    "seq_names": dict(self.seq_names),
                    "updated": _now_iso(),
                },
            }
        )
        return attrs

    def seq_id(self, key: Any) -> int:
        if isinstance(key, (int, np.integer)):
            return int(key)
        name = str(key)
        if name not in self.seq_names:
            self.seq_names[name] = len(self.seq_names)
        return self.seq_names[name]

    def _set_rows(self, rows: int) -> None:
        arrays = [self._values, *self._labels.values()]
        changed = [arr for arr in arrays if arr.shape[0] != rows]
        if changed:
            _run_all([arr.async_array.resize((rows, *arr.shape[1:])) for arr in changed])

    def append(self, values: np.ndarray, labels: Mapping[str, np.ndarray]) -> None:
        """Upload one batch of rows and commit it: chunk objects, then shapes, then the commit record."""
        if self.status != "recording":
            raise StoreWriteError(f"{self._where}: writer is {self.status}")
        rows = int(values.shape[0])
        columns = batch_columns(values, labels, self.tap, self.width, self.dtype)
        if rows == 0:
            return
        start = self.counts.rows
        stop = start + rows
        if self._tail is not None and self._tail_rows:
            block, block_start = np.concatenate([self._tail, values]), start - self._tail_rows
        else:
            block, block_start = values, start
        before = (self.counts.rows, self.counts.batches, self.counts.bytes)
        try:
            # Whole chunks only (the tail of the last batch is sent again with the new rows): no
            # chunk object is ever read back to be merged.
            _run_all(
                [
                    _rows_view(self._values, stop).setitem(slice(block_start, stop), block),
                    *(
                        _rows_view(self._labels[name], stop).setitem(slice(start, stop), column)
                        for name, column in columns.items()
                    ),
                ]
            )
            tail_rows = stop % self.chunk_rows
            self._tail = block[len(block) - tail_rows :].copy() if tail_rows else None
            self._tail_rows = tail_rows
            self._set_rows(stop)
            self.counts.rows = stop
            self.counts.batches += 1
            self.counts.bytes += int(values.nbytes)
            self._group.attrs.put(self._attrs())
        except Exception as exc:  # noqa: BLE001  (a network or object-store failure, whatever its type)
            self.counts.rows, self.counts.batches, self.counts.bytes = before
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):  # shapes back to the committed rows
                self._set_rows(self.counts.rows)
            raise StoreWriteError(f"{self._where}: upload of rows {start}..{stop} failed: {exc}") from exc

    def record_drop(self, rows: int, batches: int = 1, *, skipped: bool = False) -> None:
        if skipped:
            self.counts.skipped_rows += rows
            self.counts.skipped_batches += batches
        else:
            self.counts.dropped_rows += rows
            self.counts.dropped_batches += batches

    def close(self, status: str = "closed", error: str = "") -> None:
        """Write the final commit record, then trim the shapes to the committed rows."""
        if self.status == "failed":
            status = "failed"
        self.status = status
        if error:
            self.error = error
        try:
            self._group.attrs.put(self._attrs())
        except Exception as exc:  # noqa: BLE001
            raise StoreWriteError(f"{self._where}: final commit failed: {exc}") from exc
        try:
            self._set_rows(self.counts.rows)
        except Exception as exc:  # noqa: BLE001
            raise StoreWriteError(
                f"{self._where}: {self.counts.rows} rows committed, but trimming the arrays to them failed: {exc}"
            ) from exc
