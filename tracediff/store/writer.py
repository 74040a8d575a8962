"""Writing a trace store: creating and replacing stores, and :class:`TraceWriter`, one process's
writer group with the commit protocol of :mod:`tracediff.store`."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff import __version__
from tracediff.errors import (
    NotATraceStoreError,
    StoreExistsError,
    StoreWriteError,
    UsageError,
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

if TYPE_CHECKING:
    from tracediff.store.location import Location


def create_store(
    path: str | os.PathLike[str],
    *,
    role: str = "",
    meta: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    join: bool = False,
) -> Path | Location:
    """Create an empty trace store (the root group and its attributes).

    Refuses an existing path unless ``overwrite``; then only a trace store (or an empty folder) is
    replaced, never an unrelated directory. ``join``: a trace store already there is kept (several
    recordings adding their writer groups to one store). A URL is created by
    :func:`tracediff.store.remote_writer.create_remote_store` (and a Location returned).
    """
    from tracediff.store.location import Location  # noqa: PLC0415

    location = Location.of(path)
    if location.remote:
        from tracediff.store.remote_writer import create_remote_store  # noqa: PLC0415

        return create_remote_store(location, role=role, meta=meta, source=source, overwrite=overwrite, join=join)
    path = Path(location.local)
    if join and looks_like_trace_store(path):
        return path
    if str(path).endswith(".zip"):
        raise UsageError(f"{path}: a .zarr.zip store is read-only; record into a folder and pack it")
    if join:
        # Another process joining the same store may be creating it right now (its folder made,
        # its root not yet linked into place): join it unless what is there is something else.
        if path.exists() and (not path.is_dir() or not as_good_as_empty(path)):
            if looks_like_trace_store(path):  # created since we looked
                return path
            raise StoreExistsError(
                f"{path}: exists and is not a tracediff store; refusing to add to it, choose another path"
            )
    elif path.exists():
        check_replaceable(path, overwrite)
        _remove_tree(path)
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StoreWriteError(f"{path}: cannot create the store: {blocker} is a file, not a folder")
    attrs = {
        "tracediff": {"format": FORMAT, "version": __version__},
        "source": dict(source) if source is not None else default_source(role),
        "meta": jsonable(dict(meta or {})),
    }
    ours = group_document(attrs)
    try:
        # Created if absent (a complete file linked into place): of processes creating the store
        # at once, one wins and, with join, the others add to its store. The source (host, pid,
        # time) makes this process's root document its own: reading it back says who won.
        there = _create_if_absent(path, ours)
    except OSError as exc:
        raise StoreWriteError(f"{path}: cannot create the store: {exc.strerror or exc}") from exc
    if there != ours:
        if join and looks_like_trace_store(path):
            return path
        raise StoreExistsError(f"{path}: was created by another process meanwhile; choose another path")
    return path


def as_good_as_empty(path: Path) -> bool:
    """A folder holding nothing, or only zarr's temporary files (``*.partial``): a store whose root
    is being written (or was killed while being written)."""
    return all(p.name.endswith(".partial") and p.is_file() for p in path.iterdir())


def _create_if_absent(folder: Path, document: bytes) -> bytes:
    """Create ``folder/zarr.json`` holding ``document`` unless it exists, and return what it holds
    then. zarr's LocalStore writes it as a temporary file linked into place (``os.link`` fails on
    an existing file): atomic on local and network filesystems, so a process that loses the race
    reads the winner's whole document, never a part of it."""
    from zarr.core.buffer import default_buffer_prototype  # noqa: PLC0415
    from zarr.storage import LocalStore  # noqa: PLC0415

    store = LocalStore(folder)
    run_all([store.set_if_not_exists("zarr.json", default_buffer_prototype().buffer.from_bytes(document))])
    return (folder / "zarr.json").read_bytes()


def check_replaceable(path: Path, overwrite: bool) -> None:
    """Refuse to replace an existing ``path`` unless ``overwrite`` and it is a trace store (or a
    folder holding nothing but zarr's temporary files), never an unrelated file or folder."""
    if not overwrite:
        raise StoreExistsError(f"{path}: already exists; pass --overwrite to replace it")
    # A plain file is never a store folder (packed .zip stores are refused above): keep it too.
    # A folder holding only zarr's temporary files is a store killed while its root zarr.json
    # was being written: as good as empty.
    if not path.is_dir() or (not as_good_as_empty(path) and not looks_like_trace_store(path)):
        raise StoreExistsError(
            f"{path}: exists and is not a tracediff store; refusing to delete it, choose another path"
        )


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
    zarr = zarr_module()
    group = zarr.open_group(str(path), mode="r+")
    attrs = dict(group.attrs)
    merged = dict(attrs.get("meta") or {})
    merged.update(jsonable(dict(meta)))
    attrs["meta"] = merged
    group.attrs.put(attrs)


def looks_like_trace_store(path: Path) -> bool:
    try:
        doc = json.loads((path / "zarr.json").read_text())
        return "tracediff" in doc.get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return False


def remove_store(path: str | os.PathLike[str]) -> None:
    """Delete a trace store folder (only a trace store: an unrelated folder raises), or the store
    at a URL."""
    from tracediff.store.location import Location  # noqa: PLC0415

    location = Location.of(path)
    if location.remote:
        from tracediff.store.remote_writer import remove_remote_store  # noqa: PLC0415

        remove_remote_store(location)
        return
    path = Path(location.local)
    check_replaceable(path, overwrite=True)
    _remove_tree(path)


def _remove_tree(path: Path) -> None:
    import shutil  # noqa: PLC0415

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


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
        check_name(tap, "tap")
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
        self._extra_attrs = jsonable(dict(attrs or {}))
        self._tail_rows = 0  # rows at the end that do not fill a whole values chunk yet
        self._tail: np.ndarray | None = None
        self._resized = False  # array metadata rewritten since the last durable commit
        self._label_chunk_rows = DEFAULT_LABEL_CHUNK_ROWS
        self._label_tails: dict[str, np.ndarray] = {}  # direct path: label rows past the last full chunk
        self._label_codecs: dict[str, Any] = {}  # direct path: each label array's zstd, as zarr runs it
        self._folders: set[Path] = set()  # direct path: chunk folders known to exist
        self._writeback_min_bytes: float = _WRITEBACK_MIN_BYTES
        zarr = zarr_module()
        try:
            root = zarr.open_group(str(self.store_path), mode="r+")
        except Exception as exc:  # zarr raises several types for a missing/odd root
            raise NotATraceStoreError(f"{self.store_path}: cannot open as a trace store to append: {exc}") from exc
        if "tracediff" not in root.attrs:
            raise NotATraceStoreError(f"{self.store_path}: not a tracediff store (no 'tracediff' root attribute)")
        try:
            # The tap group is shared by every writer of the store: created if absent (whoever comes
            # first), then opened. zarr's own open-or-create checks, then creates, and fails when
            # another process creates the group in between (issue #24).
            _create_if_absent(self.store_path / tap, group_document({}))
            tap_group = zarr.open_group(str(self.store_path / tap), mode="r+")
            self.writer = _reserve_writer_folder(self.store_path / tap, writer)
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
                compressors=codecs_for(compressor, store_dtype.itemsize),
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
                    compressors=[zstd_codec()],
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
        self._direct = self._can_write_chunks_directly()

    def _can_write_chunks_directly(self) -> bool:
        """Whether this writer writes its chunk files itself instead of through zarr (see
        :meth:`_write_chunks_directly`): only for the layout whose bytes it knows, a local folder,
        raw little-endian values and zstd labels exactly as created above. Anything else (a
        compressor, another zarr that lays chunks out differently) keeps zarr's write path."""
        from zarr.codecs import BytesCodec, ZstdCodec  # noqa: PLC0415
        from zarr.storage import LocalStore  # noqa: PLC0415

        if self.compressor != "none" or sys.byteorder != "little":
            return False
        arrays = self._arrays
        if not all(isinstance(arr.store_path.store, LocalStore) for arr in arrays):
            return False
        if any(getattr(arr.metadata.chunk_key_encoding, "separator", None) != "/" for arr in arrays):
            return False
        if tuple(self._values.metadata.codecs) != (BytesCodec(endian="little"),):
            return False
        try:
            from numcodecs import Zstd  # noqa: PLC0415
        except ImportError:
            return False
        for name, arr in self._labels.items():
            codecs = tuple(arr.metadata.codecs)
            if len(codecs) != 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], ZstdCodec):
                return False
            if codecs[0].endian not in (None, BytesCodec(endian="little").endian):
                return False
            self._label_codecs[name] = Zstd(level=codecs[1].level, checksum=codecs[1].checksum)
        return True

    # -- attributes / commit record -------------------------------------------------------------
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
                    "seq_names": {name: idx for name, idx in self.seq_names.items()},
                    "updated": now_iso(),
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
            run_all([arr.async_array.resize((rows, *arr.shape[1:])) for arr in changed])

    def append(self, values: np.ndarray, labels: Mapping[str, np.ndarray]) -> None:
        """Write one batch of rows and commit it. ``values`` is [rows, width] in the store dtype."""
        if self.status != "recording":
            raise StoreWriteError(f"{self.store_path}/{self.tap}/{self.writer}: writer is {self.status}")
        rows = int(values.shape[0])
        # Labels are checked before any I/O: a rejected batch must leave neither chunks nor the
        # in-memory tail behind (the tail is rewritten into the next batch's first chunk).
        columns = batch_columns(values, labels, self.tap, self.width, self.dtype)
        if rows == 0:
            return
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
            # The chunks go past the recorded shapes (as files, or through zarr views whose shape
            # says ``stop``); only then do the shapes, and last the commit record, include the rows.
            if self._direct:
                label_tails = self._write_chunks_directly(block_start, block, stop, columns)
            else:
                run_all(
                    [
                        rows_view(self._values, stop).setitem(slice(block_start, stop), block),
                        *(
                            rows_view(self._labels[name], stop).setitem(slice(start, stop), column)
                            for name, column in columns.items()
                        ),
                    ]
                )
                label_tails = {}
            self._label_tails = label_tails
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

    def _write_chunks_directly(
        self, block_start: int, block: np.ndarray, stop: int, columns: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Write a batch's chunk files as zarr would, without zarr: ``block`` (values from the chunk
        boundary ``block_start``, the kept tail first) and each label column (the batch's rows, up
        to ``stop``) behind its own kept tail. Every chunk is whole: a last, partial one is padded
        with the fill value, as zarr writes it, and is rewritten whole by the next batch. Each file
        is replaced atomically (``_put_chunk``), so a chunk that already holds committed rows holds
        them, old file or new, at any moment. Returns the label tails the next batch starts from.

        zarr's codec pipeline allocates a fill-valued chunk and copies into it for every chunk, and
        merges label chunks by reading them back; here a full values chunk goes from the batch to
        the file untouched. A writer that is not durable still writes its large values chunks back
        and drops their pages now: on a VM whose fresh memory is slow (see benchmarks/RESULTS.md)
        reusing the same page-cache pages for the next batch is what makes writing fast, and the
        recording does not evict the host's own page cache. A durable writer does the same in
        :meth:`_commit`, with the rest of what a durable commit needs."""
        base = self.store_path / self.tap / self.writer
        cr = self.chunk_rows
        written = []
        for first in range(block_start, stop, cr):
            piece = block[first - block_start : first - block_start + cr]
            if piece.shape[0] < cr:
                piece = _padded(piece, cr, 0)
            written.append(self._put(base / "values" / "c" / str(first // cr), "0", piece))
        lr = self._label_chunk_rows
        tails: dict[str, np.ndarray] = {}
        for name, column in columns.items():
            tail = self._label_tails.get(name)
            if tail is not None and tail.shape[0]:
                column = np.concatenate([tail, column])
            column_start = stop - column.shape[0]
            for first in range(column_start, stop, lr):
                piece = column[first - column_start : first - column_start + lr]
                if piece.shape[0] < lr:
                    piece = _padded(piece, lr, LABEL_FILL[name])
                encoded = self._label_codecs[name].encode(np.ascontiguousarray(piece))
                self._put(base / name / "c", str(first // lr), encoded)
            tail_rows = stop % lr
            tails[name] = column[column.shape[0] - tail_rows :].copy()
        if not self.durable and cr * self.width * block.itemsize >= self._writeback_min_bytes:
            _fsync_paths(written, drop=True)
        return tails

    def _put(self, folder: Path, name: str, data: Any) -> Path:
        if folder not in self._folders:
            folder.mkdir(parents=True, exist_ok=True)
            self._folders.add(folder)
        path = folder / name
        _put_chunk(path, data)
        return path

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


# A writer that is not durable writes back and drops the pages of values chunks at least this large
# at every batch (smaller ones: the fsyncs would cost more than the fresh pages).
_WRITEBACK_MIN_BYTES = 1 << 20


def _padded(piece: np.ndarray, rows: int, fill: Any) -> np.ndarray:
    """``piece`` followed by ``fill`` up to ``rows`` rows: a chunk at the array's end, as zarr writes it."""
    out = np.full((rows, *piece.shape[1:]), fill, dtype=piece.dtype)
    out[: piece.shape[0]] = piece
    return out


def _put_chunk(path: Path, data: Any) -> None:
    """Replace the file ``path`` by ``data`` atomically, as zarr's LocalStore does: a temporary file
    of the same name pattern (``<name>.<hex>.partial``) in the same folder, then a rename over it.
    A failed write removes its temporary file (on a full disk it holds the space the final commit
    record needs). Every chunk file the direct path writes goes through here."""
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")
    view = memoryview(data if isinstance(data, (bytes, bytearray)) else np.ascontiguousarray(data)).cast("B")
    try:
        with open(tmp, "wb") as fh:
            fh.write(view)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


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


def _reserve_writer_folder(tap_folder: Path, name: str) -> str:
    """Make the folder of a new writer group and return its name: ``name``, or ``name_2``,
    ``name_3``... when taken by another writer (a group, or the folder a writer killed while
    creating its group left). ``os.mkdir`` fails on an existing folder, so two processes that
    want one name (process ids repeat across the hosts of a shared filesystem) get two."""
    check_name(name, "writer")
    candidate, n = name, 2
    while True:
        try:
            os.mkdir(tap_folder / candidate)
            return candidate
        except FileExistsError:
            candidate = f"{name}_{n}"
            n += 1
