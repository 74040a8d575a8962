"""The streaming pass's per-row metrics: per matched segment pair, each aligned row's cosine, norm
ratio and standardised error (float32), what the exact quantiles, the worst rows and the subset search
read after the pass.

Held in memory for a small compare; past :data:`SPILL_BYTES`, in an unlinked temporary file (gone
when the compare ends or its process dies, however it dies): the pass writes each block's rows
there, and the metrics of one pair at a time, the subset search and the profiles read a pair's
column back when they need it. The page cache holds the file, not the process: a compare of tens of
millions of rows keeps its peak memory to one pair's columns. The numbers are the same bits either
way. No room for the file (``TMPDIR`` full, read-only, no preallocation): the columns stay in
memory, with a warning.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy as np

from tracediff.errors import CompareError

log = logging.getLogger("tracediff")

#: Per-row metrics of this many bytes or more (12 bytes a row a pair) go to a temporary file.
SPILL_BYTES = 64 << 20
#: The columns of a pair, in order.
COLUMNS = ("cosine", "norm_ratio", "std_error")
COSINE, NORM_RATIO, STD_ERROR = range(3)


def _spill_file(size: int) -> IO[bytes] | None:
    """An unlinked temporary file with ``size`` bytes allocated (so that a full disk shows now, not in
    the middle of the pass), or None where that cannot be had."""
    f = None
    try:
        f = tempfile.TemporaryFile(prefix="tracediff-rows-")  # noqa: SIM115  (held by RowColumns, closed there)
        allocate = getattr(os, "posix_fallocate", None)  # not on macOS: a full disk then shows on a write
        if allocate is not None:
            allocate(f.fileno(), 0, size)
        return f
    except OSError as exc:  # no room, no temporary directory, a filesystem without preallocation
        if f is not None:
            f.close()
        log.warning("tracediff compare: keeping %d MiB of per-row metrics in memory: no temporary file in %s (%s)",
                    size >> 20, tempfile.gettempdir(), getattr(exc, "strerror", None) or exc)
        return None


class RowColumns:
    """Per matched pair, the three per-row metric columns of the pass (:data:`COLUMNS`), each
    ``rows`` float32 values."""

    def __init__(self, pairs: int, rows: int, spill_bytes: int | None = None) -> None:
        self.pairs, self.rows = pairs, rows
        size = pairs * len(COLUMNS) * rows * 4
        limit = SPILL_BYTES if spill_bytes is None else spill_bytes
        self._file = _spill_file(size) if size and size >= limit else None
        # In the file, rows hold zeros until written: every block writes its rows of every pair
        # (stream._Merger), and the pass checks that every block came.
        self._memory = None if self._file is not None else np.full((pairs, len(COLUMNS), rows), np.nan, np.float32)

    @property
    def spilled(self) -> bool:
        """Whether the columns live in a temporary file."""
        return self._file is not None

    def _offset(self, pair: int, column: int, start: int) -> int:
        return ((pair * len(COLUMNS) + column) * self.rows + start) * 4

    def _pwrite(self, data: np.ndarray, offset: int) -> None:
        view = memoryview(data).cast("B")
        assert self._file is not None
        while view:
            try:
                done = os.pwrite(self._file.fileno(), view, offset)
            except OSError as exc:
                raise CompareError(
                    f"{tempfile.gettempdir()}: cannot write the pass's per-row metrics to a temporary file "
                    f"({exc.strerror or exc}); free space there or set TMPDIR to a folder with room") from exc
            view, offset = view[done:], offset + done

    def write(self, pair: int, column: int, start: int, values: np.ndarray) -> None:
        """Rows ``start..start + len(values)`` of one column of one pair."""
        if self._memory is not None:
            self._memory[pair, column, start : start + values.shape[0]] = values
            return
        self._pwrite(np.ascontiguousarray(values, dtype=np.float32), self._offset(pair, column, start))

    def read(self, pair: int, column: int) -> np.ndarray:
        """One column of one pair, every row: the held array itself in memory (writes to it are
        kept), else a fresh array read from the file (write it back with :meth:`write`)."""
        if self._memory is not None:
            return self._memory[pair, column]
        out = np.empty(self.rows, dtype=np.float32)
        view, offset = memoryview(out).cast("B"), self._offset(pair, column, 0)
        assert self._file is not None
        while view:
            try:
                done = os.preadv(self._file.fileno(), [view], offset)
            except OSError as exc:
                raise CompareError(f"{tempfile.gettempdir()}: cannot read back the pass's per-row metrics "
                                   f"({exc.strerror or exc})") from exc
            if done <= 0:
                raise CompareError(f"{tempfile.gettempdir()}: the pass's per-row metrics file ended early")
            view, offset = view[done:], offset + done
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def mapping(self, keys: list[tuple[int, int]], column: int) -> ColumnMap:
        """Pair key -> that pair's ``column`` (keys in pair order), each read when looked up."""
        return ColumnMap(self, {k: p for p, k in enumerate(keys)}, column)


class ColumnMap(Mapping):
    """A read-only mapping of segment pair -> one per-row column, read from :class:`RowColumns` on
    each lookup (hold the array while it is needed)."""

    def __init__(self, columns: RowColumns, pairs: dict[Any, int], column: int) -> None:
        self._columns, self._pairs, self._column = columns, pairs, column

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._columns.read(self._pairs[key], self._column)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)
