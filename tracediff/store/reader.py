"""Opening a trace store for reading: :class:`TraceStore` validates every metadata document
before zarr sees it, then opens the (tap, writer) groups as :class:`TraceStream`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import zipfile
from typing import Any

import numpy as np

from tracediff.errors import (
    CorruptStoreError,
    FormatVersionError,
    IncompleteStoreError,
    NotATraceStoreError,
    StoreError,
    StoreNotFoundError,
    UsageError,
    first_line,
)
from tracediff.store.files import file_kind, open_plain_file, read_error
from tracediff.store.format import (
    FORMAT,
    LABEL_DTYPES,
    LABEL_FIELDS,
    MAX_METADATA_BYTES,
    PHASES,
    VALUE_DTYPES,
    zarr_module,
)
from tracediff.store.location import Location, remote_error
from tracediff.store.row_model import from_json as row_model_from_json
from tracediff.store.stream import TraceStream
from tracediff.store.validate import check_array_doc, group_attributes, is_int, json_type, short_repr

_CHUNK_KEY = re.compile(r"^(.*)/c(?:/\d+)+$")


#: A label array directly read from local chunk files whose chunks hold at most 1 / this of their
#: decoded bytes is "light" (:attr:`TraceStream.light_labels`): zstd undoes such a chunk in less
#: time than the Python work around it (an open, a read, a close, the column's bounds: ~20 us), so
#: two threads reading light columns at once only hand the GIL to each other (measured at 8 M rows:
#: the phases of two stores 0.08 s one after the other, 0.17 s at once; the positions, compressed to
#: a seventh, 0.37 -> 0.22 s at once). Decides only the order in which a compare reads the columns
#: (:meth:`tracediff.compare.rows.index.RowIndex.light_labels`), never what is read.
LIGHT_LABEL_RATIO = 32


class TraceStore:
    """A trace store opened for reading: a folder, a ``.zarr.zip`` file, or a folder on object
    storage (an fsspec URL: ``s3://bucket/train.zarr``). Validates on open.

    Every metadata document (``zarr.json``) is read and checked here before zarr sees it: node
    types, the commit record against the arrays' shapes, dtypes, chunk shapes, and the codecs
    against :data:`ALLOWED_CODECS`. zarr only ever opens the arrays that passed, by exact path, and
    every chunk file of the committed rows is checked to exist as a plain file (of the exact size
    when uncompressed) before any is read. So a damaged or hostile store fails on open, with one
    :class:`StoreError` naming the file and the field, and never makes a reader run code from the
    store, block on a FIFO, follow a symlink loop or allocate what its metadata claims.

    A store at a URL gets the same checks, made on objects: each ``zarr.json`` is fetched with one
    ranged GET of at most the metadata limit, each array's chunk objects and their sizes come from
    one listing (no request per chunk), and reads fetch whole chunk objects whose sizes are checked
    again, so a dropped connection never passes a short chunk off as data. ``path`` is then the
    :class:`Location` (it prints as the URL without credentials).
    """

    def __init__(self, path: str | os.PathLike[str] | Location, storage_options: dict[str, Any] | None = None) -> None:
        self.location = Location.of(path, storage_options)
        self._zip = None  # zarr's ZipStore of a .zarr.zip store
        self._zipfile: zipfile.ZipFile | None = None
        self._zip_names: dict[str, zipfile.ZipInfo] = {}
        self._remote: Location | None = None  # a store at a URL
        self._prefetched: dict[str, bytes | None] = {}  # zarr.json objects fetched by a listing
        self._objects: dict[str, dict[str, int]] = {}  # array key -> its chunk objects' sizes
        # array key -> (bytes its committed chunks hold, as checked at open; bytes they decode to)
        self._stored: dict[str, tuple[int, int]] = {}
        if self.location.remote:
            self.path: Any = self.location
            self._remote = self.location
            self._open_remote()
            return
        self.path = self.location.local
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
                what = "a file but not a zip archive (or a truncated one)" if stat.S_ISREG(mode) else file_kind(mode)
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

    def _open_remote(self) -> None:
        loc = self.location
        if loc.name.endswith(".zip"):
            raise UsageError(
                f"{loc.display}: a .zarr.zip store is read from a local file; download it, or push the store folder "
                "(tracediff push) and read that URL"
            )
        if self._read_bytes("zarr.json", MAX_METADATA_BYTES) is None:
            try:
                entries = loc.fs.ls(loc.root, detail=False)
            except FileNotFoundError as exc:
                why = first_line(exc) if "bucket" in str(exc).lower() else "no object at this URL"
                raise StoreNotFoundError(f"{loc.display}: no such trace store ({why})") from exc
            except Exception as exc:  # noqa: BLE001
                raise remote_error(loc.display, exc, "listed") from exc
            if not entries:
                raise StoreNotFoundError(f"{loc.display}: no such trace store (no object at this URL)")
            raise NotATraceStoreError(f"{loc.display}: not a zarr v3 store (no zarr.json at its top)")
        self._zstore = loc.zarr_store(read_only=True)
        self._open_root()

    def _open_root(self) -> None:
        doc = self._node_doc("", root=True)
        if doc is None:
            raise NotATraceStoreError(f"{self.path}: not a zarr v3 store (no zarr.json at its top)")
        where = self._display("zarr.json")
        attrs = group_attributes(doc, where, error=NotATraceStoreError)
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
        self.incomplete = _unfinished_push(attrs.get("push"), self.path)
        self.streams: dict[str, list[TraceStream]] = self._scan()

    def require_complete(self) -> None:
        """Raise :class:`IncompleteStoreError` for a store that was not finished being written (a
        push that stopped midway): what it holds is part of a trace, and a compare of it would
        report whatever part that is. ``inspect`` shows it; commands that read its rows refuse it."""
        if self.incomplete:
            raise IncompleteStoreError(f"{self.path}: {self.incomplete}")

    def close(self) -> None:
        # A stream and its store refer to each other, so only the cyclic garbage collector frees
        # them: what a stream holds of the rows goes here, when the store is closed.
        for streams in getattr(self, "streams", {}).values():
            for stream in streams:
                stream.drop_read_ahead()
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
        if self._remote is not None:
            data = self._prefetched.pop(key) if key in self._prefetched else self._remote.read_object(key, limit)
            if data is not None and len(data) > limit:
                raise CorruptStoreError(f"{where}: more than {limit} bytes, more than a trace store's metadata holds")
            return data
        if self._zipfile is not None:
            info = self._zip_names.get(key)
            if info is None:
                return None
            if info.file_size > limit:
                raise CorruptStoreError(f"{where}: {info.file_size} bytes, more than a trace store's metadata holds")
            try:
                return self._zipfile.read(info)
            except Exception as exc:  # noqa: BLE001  (BadZipFile, zlib.error, EOFError...)
                raise CorruptStoreError(
                    f"{where}: cannot be read from the zip ({type(exc).__name__}: {first_line(exc)})"
                ) from exc
        opened = open_plain_file(where)
        if opened is None:
            return None
        fd, size = opened
        try:
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
                    raise CorruptStoreError(
                        f"{where}: more than {limit} bytes, more than a trace store's metadata holds"
                    )
            return b"".join(parts)
        except OSError as exc:
            raise read_error(where, exc) from exc
        finally:
            os.close(fd)

    def _node_doc(self, key: str, *, root: bool = False) -> dict[str, Any] | None:
        """The parsed ``zarr.json`` of node ``key`` ('' = the root), None if it has none."""
        name = f"{key}/zarr.json" if key else "zarr.json"
        where = self._display(name)
        error = NotATraceStoreError if root else CorruptStoreError
        data = self._read_bytes(name, MAX_METADATA_BYTES)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise error(f"{where}: not valid JSON ({first_line(exc)})") from exc
        if not isinstance(doc, dict):
            raise error(f"{where}: holds {json_type(doc)}, expected a JSON object (zarr v3 metadata)")
        if doc.get("zarr_format") != 3:
            raise error(f"{where}: field zarr_format is {doc.get('zarr_format')!r}, expected 3 (a zarr v3 store)")
        if doc.get("node_type") not in ("group", "array"):
            raise error(f"{where}: field node_type is {doc.get('node_type')!r}, expected 'group' or 'array'")
        return doc

    def _children(self, key: str) -> list[str]:
        """Names of the child nodes (folders holding a zarr.json) of group ``key``, sorted."""
        if self._remote is not None:
            # One listing, then every child's zarr.json at once (kept for _node_doc): a folder
            # without one is a writer still creating its group (or killed doing so), no node.
            prefix = f"{key}/" if key else ""
            names = [n for n in self._remote.list_folders(key) if n != "zarr.json"]
            docs = self._remote.read_objects([f"{prefix}{n}/zarr.json" for n in names], limit=MAX_METADATA_BYTES)
            out = []
            for name, doc in zip(names, docs, strict=True):
                if isinstance(doc, FileNotFoundError):
                    continue
                if isinstance(doc, BaseException):
                    raise remote_error(self._display(f"{prefix}{name}/zarr.json"), doc) from doc
                self._prefetched[f"{prefix}{name}/zarr.json"] = doc
                out.append(name)
            return out
        if self._zipfile is not None:
            prefix = f"{key}/" if key else ""
            depth = prefix.count("/") + 1
            return sorted(
                {
                    name[len(prefix) :].split("/")[0]
                    for name in self._zip_names
                    if name.startswith(prefix) and name.endswith("/zarr.json") and name.count("/") == depth
                }
            )
        where = self._display(key)
        try:
            with os.scandir(where) as entries:
                names = sorted(e.name for e in entries if e.name != "zarr.json")
        except OSError as exc:
            raise read_error(where, exc, "listed") from exc
        out = []
        for name in names:
            child = os.path.join(where, name)
            try:
                is_dir = stat.S_ISDIR(os.stat(child).st_mode)
            except FileNotFoundError:  # a dangling link or a file renamed away meanwhile: no node
                continue
            except OSError as exc:  # a symlink loop where a node could be
                raise read_error(child, exc) from exc
            if not is_dir:
                continue
            try:
                os.lstat(os.path.join(child, "zarr.json"))
            except FileNotFoundError:  # a folder that is no zarr node (a writer killed while creating it)
                continue
            except OSError as exc:  # unreadable: never skip a tap or writer silently
                raise read_error(os.path.join(child, "zarr.json"), exc) from exc
            out.append(name)
        return out

    def _chunk_count(self, key: str) -> int:
        """How many chunk entries array ``key`` has under ``c/`` (a bound, found by one listing)."""
        if self._remote is not None:
            prefix = f"{key}/c/"
            return len({name[len(prefix) :].split("/")[0] for name in self._object_sizes(key)})
        if self._zipfile is not None:
            prefix = f"{key}/c/"
            return len({name[len(prefix) :].split("/")[0] for name in self._zip_names if name.startswith(prefix)})
        try:
            return len(os.listdir(self._display(f"{key}/c")))
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise read_error(self._display(key + "/c"), exc, "listed") from exc

    def _check_chunk(self, key: str, raw_size: int | None) -> int:
        """Chunk ``key`` holds committed rows: it must be a plain file, of exactly ``raw_size`` bytes
        when uncompressed, else not empty. Returns its size in bytes."""
        where = self._display(key)
        if self._remote is not None:
            match = _CHUNK_KEY.match(key)
            size = self._object_sizes(match.group(1)).get(key) if match else None
        elif self._zipfile is not None:
            info = self._zip_names.get(key)
            size = None if info is None else info.file_size
        else:
            try:
                st = os.stat(where)
            except FileNotFoundError:
                size = None
            except OSError as exc:
                raise read_error(where, exc) from exc
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptStoreError(f"{where}: is {file_kind(st.st_mode)}, not a chunk file")
                size = st.st_size
        if size is None:
            raise CorruptStoreError(f"{where}: chunk file is missing (deleted?) but holds committed rows")
        if raw_size is not None and size != raw_size:
            raise CorruptStoreError(
                f"{where}: chunk holds {size} bytes, expected {raw_size} (truncated or foreign file?)"
            )
        if size == 0:
            raise CorruptStoreError(f"{where}: chunk file is empty (truncated?)")
        return size

    def _object_sizes(self, key: str) -> dict[str, int]:
        """Array ``key``'s chunk objects (store keys) and their sizes: one listing, kept."""
        sizes = self._objects.get(key)
        if sizes is None:
            assert self._remote is not None
            sizes = self._objects[key] = self._remote.list_sizes(f"{key}/c")
        return sizes

    def _chunk_objects(self, keys: list[str], raw_size: int | None, limit: int) -> list[bytes]:
        """The bytes of chunk objects ``keys`` of a remote store, fetched together, each checked as
        :meth:`_check_chunk` checks a file (present, not empty, exactly ``raw_size`` bytes when
        uncompressed, at most ``limit``): a response cut short is an error, never data."""
        assert self._remote is not None
        out = []
        for key, blob in zip(keys, self._remote.read_objects(keys, limit=limit), strict=True):
            where = self._display(key)
            if isinstance(blob, FileNotFoundError):
                raise CorruptStoreError(f"{where}: chunk object is missing (deleted?) but holds committed rows")
            if isinstance(blob, BaseException):
                raise remote_error(where, blob) from blob
            if raw_size is not None and len(blob) != raw_size:
                size = f"more than {raw_size}" if len(blob) > raw_size else str(len(blob))
                raise CorruptStoreError(
                    f"{where}: chunk holds {size} bytes, expected {raw_size} (truncated or foreign object?)"
                )
            if not blob or len(blob) > limit:
                raise CorruptStoreError(f"{where}: chunk object holds {len(blob)} bytes (truncated or foreign object?)")
            out.append(blob)
        return out

    def _open_array(self, key: str, *, ndim: int, data_type: str, rows: int) -> tuple[Any, dict[str, Any]]:
        """Check array ``key``'s metadata, its committed chunk files, then open it with zarr."""
        where = self._display(f"{key}/zarr.json")
        doc = self._node_doc(key)
        if doc is None:
            raise CorruptStoreError(f"{self._display(key)}: array is missing (no zarr.json)")
        check_array_doc(doc, where, ndim=ndim, data_type=data_type, rows=rows)
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
            stored = sum(self._check_chunk(f"{key}/c/{c}" + "/0" * (ndim - 1), raw_size if codecs == ["bytes"] else None)
                         for c in range(needed))
            self._stored[key] = (stored, needed * raw_size)
        try:
            array = zarr_module().open_array(store=self._zstore, path=key, mode="r", zarr_format=3)
        except Exception as exc:  # noqa: BLE001  (zarr rejects odd metadata with several types)
            if self._remote is not None and not isinstance(exc, (ValueError, TypeError, KeyError)):
                raise remote_error(where, exc) from exc
            raise CorruptStoreError(
                f"{where}: not a readable zarr array ({type(exc).__name__}: {first_line(exc)})"
            ) from exc
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
        if doc is None:  # listed, then gone: a ring dropped that segment meanwhile (tracediff.store.ring)
            return None
        if doc["node_type"] != "group":
            raise CorruptStoreError(f"{meta_file}: field node_type: a writer must be a group")
        attrs = group_attributes(doc, meta_file)
        commit = attrs.get("commit")
        if not isinstance(commit, dict):
            raise CorruptStoreError(f"{meta_file}: field 'commit' is missing or not an object")
        rows = commit.get("rows")
        if not is_int(rows) or rows < 0:
            raise CorruptStoreError(f"{meta_file}: field commit.rows is {rows!r}, expected a count >= 0")
        seq_names = commit.get("seq_names")
        if seq_names is not None and not (isinstance(seq_names, dict) and all(is_int(v) for v in seq_names.values())):
            raise CorruptStoreError(
                f"{meta_file}: field commit.seq_names is {short_repr(seq_names)}, expected an object of name: integer"
            )
        dtype = attrs.get("dtype")
        if not isinstance(dtype, str) or dtype not in VALUE_DTYPES:
            raise CorruptStoreError(
                f"{meta_file}: field dtype is {short_repr(dtype)}; expected one of {', '.join(VALUE_DTYPES)}"
            )
        width = attrs.get("width")
        if not is_int(width) or width <= 0:
            raise CorruptStoreError(f"{meta_file}: field width is {short_repr(width)}, expected a positive integer")
        phases = attrs.get("phases")
        if phases is not None and (
            not isinstance(phases, list)
            or not all(isinstance(p, str) for p in phases)
            or list(phases[: len(PHASES)]) != list(PHASES[: len(phases)])
        ):
            raise CorruptStoreError(
                f"{meta_file}: field phases is {short_repr(phases)}; expected the phase names {list(PHASES)}"
            )
        segment_size = attrs.get("segment_size")
        if segment_size is not None and (not is_int(segment_size) or segment_size <= 0 or width % segment_size):
            raise CorruptStoreError(
                f"{meta_file}: field segment_size is {short_repr(segment_size)}, expected a positive integer that "
                f"divides the width {width}"
            )
        labels = attrs.get("segment_labels")
        if labels is not None:
            if not isinstance(labels, list) or not all(isinstance(x, (str, int)) for x in labels):
                raise CorruptStoreError(
                    f"{meta_file}: field segment_labels is {short_repr(labels)}, expected a list of names"
                )
            if segment_size is not None and len(labels) != width // segment_size:
                raise CorruptStoreError(
                    f"{meta_file}: field segment_labels names {len(labels)} segments but width {width} / segment_size "
                    f"{segment_size} makes {width // segment_size}; fix the attribute or record again"
                )
        row_model = attrs.get("row_model")
        if row_model is not None:
            try:
                slots = len(row_model_from_json(row_model).slots)
            except UsageError as exc:
                raise CorruptStoreError(f"{meta_file}: field {exc}") from None
            if (width // segment_size if segment_size is not None else slots) != slots or width % slots:
                raise CorruptStoreError(
                    f"{meta_file}: field row_model names {slots} slots but the width {width} holds "
                    f"{width // segment_size if segment_size else 'another number of'} segments; fix the attribute "
                    f"or record again"
                )
        if self._remote is not None:  # every array's zarr.json and chunk listing in one round trip each
            arrays_at = [f"{key}/{name}" for name in ("values", *LABEL_FIELDS)]
            docs = self._remote.read_objects([f"{a}/zarr.json" for a in arrays_at], limit=MAX_METADATA_BYTES)
            for array_key, doc in zip(arrays_at, docs, strict=True):
                if isinstance(doc, FileNotFoundError):
                    continue  # reported by _open_array as a missing array
                if isinstance(doc, BaseException):
                    raise remote_error(self._display(f"{array_key}/zarr.json"), doc) from doc
                self._prefetched[f"{array_key}/zarr.json"] = doc
            if rows:
                missing = [a for a in arrays_at if a not in self._objects]
                self._objects.update(
                    zip(missing, self._remote.list_sizes_many([f"{a}/c" for a in missing]), strict=True)
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
                f"{where}/values/zarr.json: field attributes.dtype is {short_repr(stored_as)} but {meta_file} says "
                f"dtype {dtype!r}: the two disagree on how to decode the values"
            )
        arrays = {"values": values}
        direct: dict[str, tuple[str, int]] = {}
        light: set[str] = set()
        for name in LABEL_FIELDS:
            arrays[name], label_doc = self._open_array(
                f"{key}/{name}", ndim=1, data_type=LABEL_DTYPES[name].name, rows=rows
            )
            label_codecs = label_doc["codecs"]
            if self._zip is None and [c["name"] for c in label_codecs] == ["bytes", "zstd"]:
                order = (label_codecs[0].get("configuration") or {}).get("endian", "little")
                label_chunks = label_doc["chunk_grid"]["configuration"]["chunk_shape"]
                direct[name] = ("big" if order == "big" else "little", int(label_chunks[0]))
                stored, decoded = self._stored.get(f"{key}/{name}", (1, 0))
                if self._remote is None and stored * LIGHT_LABEL_RATIO <= decoded:
                    light.add(name)
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
            light_labels=frozenset(light),
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


def open_store(
    location: str | os.PathLike[str] | Location, storage_options: dict[str, Any] | None = None
) -> TraceStore:
    """Open a trace store for reading: a folder, a ``.zarr.zip`` file, or an fsspec URL
    (``s3://bucket/train.zarr``, ``gs://...``, ``https://...``, ``file://...``).

    ``storage_options`` go to fsspec for a URL (``endpoint_url``, ``key``, ``secret``, ``anon``...);
    without them, the standard environment and config files apply (``AWS_*``, ``~/.aws/``).
    """
    return TraceStore(location, storage_options)


def _unfinished_push(push: Any, path: Any) -> str | None:
    """Why a store is incomplete, from the root's ``push`` attribute (``tracediff push`` writes it
    first and removes it last), or None."""
    if not isinstance(push, dict) or push.get("status") != "uploading":
        return None
    src = str(push.get("from") or "LOCAL_STORE")
    host = push.get("host")
    started = push.get("started")
    origin = f"from {host}:{src}" if host else f"from {src}"
    return (
        f"incomplete: a push {origin}{f' started {started}' if started else ''} did not finish, so the store "
        f"holds part of the trace at most; rerun `tracediff push {src} {path}` (it resumes)"
    )
