"""A trace store's committed rows as a dask array, for analyses tracediff does not ship.

:func:`open_values` validates the store with :class:`tracediff.store.TraceStore` (the strict reader:
nothing is decoded before every metadata document and committed chunk file has been checked), then
returns the values of one tap as a lazy ``float32`` dask array: bf16 bits widened exactly, committed
rows only (``commit.rows``, never what a writer killed halfway left past it), every writer group of
the tap one after another unless ``writer`` picks one. :func:`open_labels` returns the per-row labels
of the same rows, in the same order, as numpy.

Blocks are read through the store's own reader, so a chunk damaged after opening is a
:class:`~tracediff.errors.CorruptStoreError` naming it when computed, as in ``compare``. The arrays
pickle (for dask's process and distributed schedulers): a worker reopens the store by its path.

Imports dask only when called; ``tracediff`` itself stays cheap to import.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.errors import StoreError, UsageError
from tracediff.store import LABEL_FIELDS, TraceStore, TraceStream, decode_values

if TYPE_CHECKING:
    import dask.array

# Default dask block: whole store chunks adding up to about this many bytes of float32. dask's
# guidance is blocks of ~100 MiB; smaller keeps a threaded compute's memory low on small machines.
BLOCK_BYTES = 64 << 20


def open_values(
    store: str | os.PathLike[str] | TraceStore,
    tap: str = "fc_in",
    writer: str | None = None,
    *,
    block_rows: int | None = None,
) -> dask.array.Array:
    """The committed rows of ``tap`` as a lazy ``[rows, width]`` float32 dask array.

    ``store``: a store folder, a ``.zarr.zip`` file or an open :class:`TraceStore`. ``writer``: one
    writer group (``"rank0"``, ``"pid1234"``); by default every writer group of the tap, concatenated
    in the order of :attr:`TraceStore.streams` (sorted names; :func:`open_labels` has a ``writer``
    column saying which rows came from which). ``block_rows``: rows per dask block, a multiple of the
    store's chunk rows (default: about 64 MiB of float32 per block).

    Raises :class:`~tracediff.errors.UsageError` (dask not installed, unknown tap or writer, writers
    of different widths, a bad ``block_rows``) or a :class:`~tracediff.errors.StoreError` (missing,
    foreign or damaged store), each one line naming the file and the field.
    """
    da = _dask_array()
    streams = _streams(store, tap, writer)
    widths = sorted({s.width for s in streams})
    if len(widths) > 1:
        listed = ", ".join(f"{s.writer}: {s.width}" for s in streams)
        raise UsageError(
            f"{_where(streams[0])}: the writer groups hold rows of different widths ({listed}); "
            "pass writer= to open one of them"
        )
    parts = [_stream_values(da, s, block_rows) for s in streams]
    return parts[0] if len(parts) == 1 else da.concatenate(parts, axis=0)


def open_labels(
    store: str | os.PathLike[str] | TraceStore,
    tap: str = "fc_in",
    writer: str | None = None,
) -> dict[str, np.ndarray]:
    """The labels of the rows :func:`open_values` returns (same rows, same order), as numpy.

    Keys: the label fields (``seq``, ``position``, ``token_id``, ``next_token_id``, ``step``,
    ``phase``: an index into :data:`tracediff.store.PHASES`, ``valid``) and ``writer``, the writer
    group each row came from. String sequence keys are stored as small integers per writer group:
    each group's ``commit.seq_names`` (:attr:`TraceStream.seq_names`) maps them back.
    """
    streams = _streams(store, tap, writer)
    out = {name: np.concatenate([s.label(name) for s in streams]) for name in LABEL_FIELDS}
    out["writer"] = np.concatenate([np.full(s.rows, s.writer) for s in streams]).astype(str)
    return out


# -- internals ---------------------------------------------------------------------------------------
def _dask_array() -> Any:
    try:
        import dask.array as da  # noqa: PLC0415
    except ImportError as exc:
        raise UsageError(
            f"tracediff.open_values needs dask, which is not installed here ({exc}): "
            "pip install 'tracediff[dask]' (or 'dask[array]')"
        ) from exc
    return da


def _open(store: str | os.PathLike[str] | TraceStore) -> TraceStore:
    if isinstance(store, TraceStore):
        return store
    if not isinstance(store, (str, os.PathLike)):
        raise UsageError(f"store must be a path or a TraceStore, got {type(store).__name__}")
    return TraceStore(store)


def _streams(store: str | os.PathLike[str] | TraceStore, tap: str, writer: str | None) -> list[TraceStream]:
    opened = _open(store)
    streams = opened.tap_streams(tap)  # UsageError naming the store and its taps
    if writer is not None:
        chosen = [s for s in streams if s.writer == writer]
        if not chosen:
            known = ", ".join(s.writer for s in streams) or "none"
            raise UsageError(
                f"{opened.path}/{tap}: no writer group named {writer!r}; writer groups of this tap: {known}"
            )
        return chosen
    if not streams:
        raise UsageError(f"{opened.path}/{tap}: the tap has no writer group (nothing was recorded)")
    return streams


def _where(stream: TraceStream) -> str:
    return f"{stream.store.path}/{stream.tap}"


def _stream_values(da: Any, stream: TraceStream, block_rows: int | None) -> Any:
    cr = stream.chunk_rows
    if block_rows is None:
        block_rows = cr * max(1, BLOCK_BYTES // max(1, cr * stream.width * 4))
    elif isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows <= 0 or block_rows % cr:
        raise UsageError(
            f"{_where(stream)}/{stream.writer}: block_rows={block_rows!r} must be a positive multiple of the "
            f"store's chunk rows ({cr}, field chunk_grid of values/zarr.json)"
        )
    source = _CommittedValues(stream)
    name = "tracediff-values-" + _token(source.token, block_rows)
    return da.from_array(
        source, chunks=(block_rows, stream.width), name=name, fancy=False, meta=np.empty((0, 0), np.float32)
    )


def _token(*parts: Any) -> str:
    from dask.base import tokenize  # noqa: PLC0415

    return tokenize(*parts)


class _CommittedValues:
    """Array-like view of one writer group's committed rows, decoded to float32: what dask slices.

    Reads whole store chunks through :meth:`TraceStream.read_chunk` (straight from the chunk files
    of an uncompressed folder store), decoding each into the block as it arrives. Thread-safe: no
    state is shared between reads."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, stream: TraceStream) -> None:
        self.stream = stream
        self.shape = (stream.rows, stream.width)

    @property
    def token(self) -> tuple[Any, ...]:
        s = self.stream
        return (_store_key(s.store), s.tap, s.writer, s.rows, s.width, s.dtype, str(s.commit.get("updated")))

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        return self.token

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        s = self.stream
        return _reopen, (_store_key(s.store), s.tap, s.writer, s.rows)

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        rows = key[0] if key else slice(None)
        rest = key[1:]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            return self._read(0, self.shape[0])[key]
        start, stop, _ = rows.indices(self.shape[0])
        block = self._read(start, max(start, stop))
        return block[(slice(None), *rest)] if rest else block

    def _read(self, start: int, stop: int) -> np.ndarray:
        s = self.stream
        out = np.empty((stop - start, s.width), dtype=np.float32)
        cr = s.chunk_rows
        row = start
        while row < stop:
            index = row // cr
            raw = s.read_chunk(index)  # the chunk's committed rows
            lo, hi = row - index * cr, min(stop, (index + 1) * cr) - index * cr
            out[row - start : row - start + hi - lo] = decode_values(raw[lo:hi], s.dtype)
            row += hi - lo
        return out


def _store_key(store: TraceStore) -> Any:
    """What a worker reopens: the folder's path, or the URL's Location (it keeps its storage options)."""
    return store.location if store.location.remote else os.fspath(store.path)


@lru_cache(maxsize=16)
def _reopened_store(path: Any) -> TraceStore:
    """One validated TraceStore per path in a worker process (opening checks every chunk file)."""
    return TraceStore(path)


def _reopen(path: str, tap: str, writer: str, rows: int) -> _CommittedValues:
    """Unpickling a :class:`_CommittedValues`: the same writer group's first ``rows`` rows."""
    stream = next((s for s in _reopened_store(path).tap_streams(tap) if s.writer == writer), None)
    if stream is None or stream.rows < rows:
        have = "no such writer group" if stream is None else f"{stream.rows} committed rows"
        raise StoreError(f"{path}/{tap}/{writer}: opened with {rows} committed rows, now {have}: the store was replaced")
    source = _CommittedValues(stream)
    source.shape = (rows, stream.width)
    return source


__all__ = ["open_labels", "open_values"]
