"""What every trace store writer shares (the local :class:`~tracediff.store.writer.TraceWriter`
and the object-store :class:`~tracediff.store.remote_writer.RemoteTraceWriter`): a batch's checks,
the counts a commit record carries, names, and running zarr's coroutines together."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracediff.errors import UsageError
from tracediff.store.format import LABEL_DTYPES, LABEL_FIELDS, LABEL_FILL, VALUE_DTYPES, zarr_module


def batch_columns(values: np.ndarray, labels: Mapping[str, np.ndarray], tap: str, width: int,
                  dtype: str) -> dict[str, np.ndarray]:
    """A batch's label columns in the store's dtypes (missing ones filled), after checking the batch:
    [rows, width] values in the store dtype and one label per row. :class:`UsageError` names the tap
    and what is wrong; nothing has been written yet."""
    rows = int(values.shape[0])
    if values.ndim != 2 or values.shape[1] != width:
        raise UsageError(f"tap {tap!r}: batch of shape {tuple(values.shape)} does not match width {width}")
    if values.dtype != VALUE_DTYPES[dtype]:
        raise UsageError(f"tap {tap!r}: batch dtype {values.dtype} is not the store dtype of {dtype}")
    columns: dict[str, np.ndarray] = {}
    for name in LABEL_FIELDS:
        column = labels.get(name)
        if column is None:
            columns[name] = np.full(rows, LABEL_FILL[name], dtype=LABEL_DTYPES[name])
            continue
        try:
            column = np.asarray(column).astype(LABEL_DTYPES[name], copy=False).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"tap {tap!r}: label {name!r} is not {LABEL_DTYPES[name]}: {exc}") from exc
        if column.shape[0] != rows:
            raise UsageError(f"tap {tap!r}: label {name!r} has {column.shape[0]} entries for {rows} rows")
        columns[name] = column
    return columns


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
    drop_reason: str = ""  # why the first dropped rows were lost (the queue was full, an adapter could not record them)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.__dict__)
        if not out["drop_reason"]:
            del out["drop_reason"]  # nothing dropped: the record stays as it always was
        return out


def rows_view(array: Any, rows: int) -> Any:
    """``array``'s async twin (same store, codecs and config) with a shape of ``rows`` rows, held in
    memory only: it writes chunks past the array's recorded shape without rewriting its zarr.json."""
    if array.shape[0] == rows:
        return array.async_array
    metadata = array.metadata.update_shape((rows, *array.shape[1:]))
    return zarr_module().AsyncArray(metadata=metadata, store_path=array.store_path, config=array.config)


def run_all(coroutines: Sequence[Any]) -> None:
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


def check_name(name: str, what: str) -> None:
    if not name or "/" in name or name.startswith(".") or name.startswith("__") or name != name.strip():
        raise UsageError(f"invalid {what} name {name!r}: use letters, digits, '_' and '-'")
