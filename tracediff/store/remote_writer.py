"""Recording straight to object storage (``record -o s3://...``): creating a store at a URL and
:class:`RemoteTraceWriter`, one process's writer group written through zarr's FsspecStore.

The commit protocol of :mod:`tracediff.store` holds unchanged because an object PUT is atomic (a
reader sees the old object or the new one, never part of one): a batch's chunk objects first,
past the arrays' recorded shapes, then each array's ``zarr.json`` with the new row count, then the
writer group's ``zarr.json`` with the commit record. A writer killed mid-upload leaves at most
chunk objects past ``commit.rows``, which readers never look at. There is no fsync on object
storage: a PUT that returned is stored (``durable`` changes nothing here). What object stores do
not all promise (read-after-write and listing consistency) is in ``docs/remote.md``.

An endpoint that goes away for a while (a restart, a network partition) costs no row: every
object operation of a batch is idempotent (the same bytes PUT again), so a batch whose upload
failed on the way is sent again, whole, with backoff, for up to ``retry_seconds``; the rows that
arrive meanwhile wait in the recorder's bounded queue. Past that (or on a refusal no retry mends:
credentials, permissions, a missing bucket) the writer stops for good and says how many rows it
committed; the recorder counts the rest as lost.

Kept apart from :mod:`tracediff.store.writer`'s local path, which writes files and tunes for disks.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tracediff import __version__
from tracediff.errors import (
    NotATraceStoreError,
    RemoteStoreError,
    StoreError,
    StoreExistsError,
    StoreWriteError,
    TracediffError,
    UsageError,
    first_line,
)
from tracediff.store.batches import WriterCounts, batch_columns, check_name, rows_view, run_all
from tracediff.store.format import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_COMPRESSOR,
    DEFAULT_LABEL_CHUNK_ROWS,
    FORMAT,
    LABEL_DIMS,
    LABEL_DTYPES,
    LABEL_FIELDS,
    LABEL_FILL,
    MAX_METADATA_BYTES,
    VALUE_DTYPES,
    VALUES_COORDINATES,
    VALUES_DIMS,
    codecs_for,
    default_source,
    group_document,
    jsonable,
    now_iso,
    zarr_module,
    zstd_codec,
)
from tracediff.store.location import Location, remote_error

log = logging.getLogger("tracediff")

#: Seconds a writer at a URL keeps sending again a batch whose upload failed on the way (endpoint
#: unreachable, connection reset, timeout, 5xx) before it stops for good (``record --retry-seconds``).
DEFAULT_RETRY_SECONDS = 60.0
_BACKOFF_FIRST = 0.25
_BACKOFF_MAX = 5.0
# What retrying cannot mend: a refusal (credentials, permissions, a missing bucket: s3fs maps S3's
# AccessDenied and NoSuchBucket to the built-ins), a bad argument or a bug of ours.
_PERMANENT = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError, TypeError, ValueError,
              AttributeError, LookupError, AssertionError, MemoryError, NotImplementedError)
_PERMANENT_NAMES = ("NoCredentialsError", "PartialCredentialsError", "ParamValidationError", "NoRegionError")


def transient_failure(exc: BaseException) -> bool:
    """Whether an object-store operation that raised ``exc`` may succeed if sent again: anything
    but a refusal or a bug (connection refused or reset, timeouts, throttling and 5xx answers, and
    whatever else a network failure raises in s3fs, aiohttp or botocore, are all worth a retry)."""
    seen: BaseException | None = exc
    for _ in range(8):  # our own errors wrap the library's (``raise ... from exc``)
        if seen is None:
            return True
        if isinstance(seen, RemoteStoreError):
            seen = seen.__cause__
            continue
        if isinstance(seen, (TracediffError, *_PERMANENT)) or type(seen).__name__ in _PERMANENT_NAMES:
            return False
        seen = seen.__cause__
    return True


def store_exists(loc: Location) -> bool:
    """Whether a trace store (a root ``zarr.json`` with the ``tracediff`` attribute) is at ``loc``."""
    data = loc.read_object("zarr.json", MAX_METADATA_BYTES)
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
            raise StoreExistsError(f"{loc.display}: already exists; pass --overwrite to replace it")
        remove_remote_store(loc)
    else:
        try:
            present = loc.fs.ls(loc.root, detail=False)
        except FileNotFoundError as exc:
            # s3fs: "The specified bucket does not exist"; a prefix with nothing under it is the
            # same error, naming the path (whose bucket may well be called "my-bucket").
            if any(why in str(exc).lower() for why in ("bucket does not exist", "nosuchbucket")):
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
        "meta": jsonable(dict(meta or {})),
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
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
    ) -> None:
        if dtype not in VALUE_DTYPES:
            raise UsageError(f"tap {tap!r}: unsupported value dtype {dtype!r}; supported: {', '.join(VALUE_DTYPES)}")
        if width <= 0:
            raise UsageError(f"tap {tap!r}: width must be positive, got {width}")
        if chunk_rows <= 0:
            raise UsageError(f"chunk_rows must be positive, got {chunk_rows}")
        if not retry_seconds >= 0:
            raise UsageError(f"retry_seconds must be 0 or more, got {retry_seconds}")
        check_name(tap, "tap")
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
        self._extra_attrs = jsonable(dict(attrs or {}))
        self._tail: np.ndarray | None = None
        self._tail_rows = 0
        self.retry_seconds = float(retry_seconds)
        #: A time (``time.monotonic()``) after which no retry starts: set by a recorder that is
        #: closing, so that its close ends within its timeout whatever the endpoint does.
        self.give_up_at: float | None = None
        self._unreachable = False  # retries were spent: the final commit gets one try, not another round
        self.writer = writer
        self._named = False
        try:
            self._retrying("creating its writer group", self._create)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001  (s3fs, botocore and aiohttp raise many types)
            raise StoreWriteError(f"{store.display}/{tap}/{self.writer}: cannot create writer group: {exc}") from exc

    def _create(self, attempt: int) -> None:
        """Create the writer group, or finish creating it after a failure on the way (``attempt`` >
        0): its name is kept once chosen, and what a failed attempt wrote (or wrote without hearing
        back) is written again."""
        zarr, store, tap = zarr_module(), self.location, self.tap
        if not self._named:
            if not store_exists(store):
                raise NotATraceStoreError(f"{store.display}: no trace store there to append to (no root zarr.json)")
            taken = set(store.list_folders(tap))
            name, n = self.writer, 2
            while name in taken:  # a group of this name, or the folder of a writer killed creating it
                name = f"{self.writer}_{n}"
                n += 1
            check_name(name, "writer")
            self.writer, self._named = name, True
        prefix = f"{tap}/{self.writer}"
        again = attempt > 0  # the arrays are this writer's own: one half made is made again
        # Arrays first, the writer group's zarr.json (with the commit record) last: until then
        # readers skip the folder, as for a local store. The tap group is shared: whichever writer
        # comes first creates it, with a create-if-absent PUT, and one that finds it there (or
        # being written) goes on. zarr's own open-or-create checks, then creates, and fails when
        # another process creates the group in between (issue #24). Each node is created through a
        # store rooted at it: zarr would otherwise write the missing parents' zarr.json, the
        # writer group's among them, before the arrays exist.
        store.create_object(f"{tap}/zarr.json", group_document({}))
        store_dtype = VALUE_DTYPES[self.dtype]
        self._values = zarr.create_array(
            store=(store / f"{prefix}/values").zarr_store(read_only=False),
            shape=(0, self.width),
            chunks=(self.chunk_rows, self.width),
            dtype=store_dtype,
            compressors=codecs_for(self.compressor, store_dtype.itemsize),
            fill_value=0,
            config={"write_empty_chunks": True},
            attributes={"dtype": self.dtype, "coordinates": VALUES_COORDINATES},
            dimension_names=VALUES_DIMS,
            overwrite=again,
        )
        self._labels = {
            label: zarr.create_array(
                store=(store / f"{prefix}/{label}").zarr_store(read_only=False),
                shape=(0,),
                chunks=(DEFAULT_LABEL_CHUNK_ROWS,),
                dtype=LABEL_DTYPES[label],
                compressors=[zstd_codec()],
                fill_value=LABEL_FILL[label],
                config={"write_empty_chunks": True},
                dimension_names=LABEL_DIMS,
                overwrite=again,
            )
            for label in LABEL_FIELDS
        }
        # The group's zarr.json as one plain PUT (the same bytes again on a retry: zarr's create
        # would refuse a group that a lost answer hid from us), then opened for its commit records.
        store.fs.pipe_file(store.object_path(f"{prefix}/zarr.json"), group_document(self._attrs()))
        self._group = zarr.open_group(store=(store / prefix).zarr_store(read_only=False), mode="r+")

    def _retrying(self, what: str, attempt: Callable[[int], None]) -> None:
        """``attempt(n)`` for n = 0, 1, ... until it returns. A failure that may go away by itself
        (:func:`transient_failure`) is tried again with backoff until ``retry_seconds`` have passed
        since the first, or :attr:`give_up_at`; anything else, or the last failure, is raised. One
        line is logged when retries begin and one when they succeed: an outage is two lines, not
        one a request."""
        started = time.monotonic()
        delay, tries = _BACKOFF_FIRST, 0
        while True:
            try:
                attempt(tries)
            except Exception as exc:
                now = time.monotonic()
                limit = started + self.retry_seconds
                if self.give_up_at is not None:
                    limit = min(limit, self.give_up_at)
                if not transient_failure(exc):
                    raise
                if now + delay > limit:
                    self._unreachable = True
                    raise
                if tries == 0:
                    log.warning("tracediff: %s: %s failed (%s: %s); sending it again for up to %.0f s (the host "
                                "goes on, new rows wait in the queue)", self._where, what, type(exc).__name__,
                                first_line(exc), limit - now)
                time.sleep(delay)
                delay, tries = min(2 * delay, _BACKOFF_MAX), tries + 1
                continue
            if tries:
                log.warning("tracediff: %s: %s went through after %d retries in %.1f s; recording goes on",
                            self._where, what, tries, time.monotonic() - started)
            return

    @property
    def _where(self) -> str:
        return f"{self.location.display}/{self.tap}/{self.writer}"

    def note_attr(self, name: str, value: Any) -> None:
        """Set a writer-group attribute (JSON) that the next commit record writes with it, e.g. the
        recorder's running row checks (``row_checks``)."""
        self._extra_attrs[name] = jsonable(value)

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
                    "updated": now_iso(),
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
            run_all([arr.async_array.resize((rows, *arr.shape[1:])) for arr in changed])

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

        def upload(attempt: int) -> None:
            # Whole chunks only (the tail of the last batch is sent again with the new rows): no
            # chunk object is ever read back to be merged. Sent again whole after a failure: every
            # PUT here writes the same bytes to the same key.
            run_all(
                [
                    rows_view(self._values, stop).setitem(slice(block_start, stop), block),
                    *(
                        rows_view(self._labels[name], stop).setitem(slice(start, stop), column)
                        for name, column in columns.items()
                    ),
                ]
            )
            self._set_rows(stop)
            self.counts.rows, self.counts.batches = stop, before[1] + 1
            self.counts.bytes = before[2] + int(values.nbytes)
            try:
                self._group.attrs.put(self._attrs())
            except BaseException:
                self.counts.rows, self.counts.batches, self.counts.bytes = before
                raise

        try:
            self._retrying(f"the upload of rows {start}..{stop}", upload)
        except Exception as exc:  # noqa: BLE001  (a network or object-store failure, whatever its type)
            # Shapes past the committed rows are allowed (readers trust commit.rows); the final
            # commit trims them when the store can be reached again.
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {first_line(exc)}"
            raise StoreWriteError(f"{self._where}: upload of rows {start}..{stop} failed: {first_line(exc)}") from exc
        tail_rows = stop % self.chunk_rows
        self._tail = block[len(block) - tail_rows :].copy() if tail_rows else None
        self._tail_rows = tail_rows

    def record_drop(self, rows: int, batches: int = 1, *, skipped: bool = False) -> None:
        if skipped:
            self.counts.skipped_rows += rows
            self.counts.skipped_batches += batches
        else:
            self.counts.dropped_rows += rows
            self.counts.dropped_batches += batches

    def close(self, status: str = "closed", error: str = "") -> None:
        """Write the final commit record (retried as a batch is, or tried once when the store was
        already out of reach for the whole retry time), then trim the shapes to the committed rows."""
        if self.status == "failed":
            status = "failed"
        self.status = status
        if error:
            self.error = error
        try:
            if self._unreachable:
                self._group.attrs.put(self._attrs())
            else:
                self._retrying("the final commit record", lambda attempt: self._group.attrs.put(self._attrs()))
        except Exception as exc:  # noqa: BLE001
            raise StoreWriteError(f"{self._where}: final commit failed: {first_line(exc)}") from exc
        try:
            self._set_rows(self.counts.rows)
        except Exception as exc:  # noqa: BLE001
            raise StoreWriteError(
                f"{self._where}: {self.counts.rows} rows committed, but trimming the arrays to them failed: "
                f"{first_line(exc)}"
            ) from exc
