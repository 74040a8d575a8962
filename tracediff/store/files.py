"""Reading a store's files safely and fast: plain-file checks that never block on a FIFO or follow
what is not a file, and :class:`ChunkFiles`, the open chunk files of the direct read path."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Any

from tracediff.errors import (
    CorruptStoreError,
    StoreError,
)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An empty numpy array whose start is 64-byte aligned: copies from the page cache into a buffer
    that is not (numpy's large allocations start 16 bytes into a page) run several times slower."""
    import numpy as np  # noqa: PLC0415  (this module stays importable without numpy's import cost)

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def open_plain_file(path: str) -> tuple[int, int] | None:
    """Open ``path`` for reading without ever blocking (a FIFO would wait forever for a writer): its
    file descriptor and its size in bytes (from the one ``fstat`` that checks what it is); None when
    it does not exist; :class:`CorruptStoreError` when it cannot be read or is not a plain file
    (symlink loop, folder, FIFO, socket, device)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise read_error(path, exc) from exc
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise read_error(path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptStoreError(f"{path}: is {file_kind(st.st_mode)}, not a file")
    return fd, st.st_size


def open_chunk_file(path: str, size: int) -> int:
    """File descriptor of an uncompressed chunk file of exactly ``size`` bytes. A missing chunk is
    corruption, never the fill value: the writer writes every chunk of the rows it commits."""
    opened = open_plain_file(path)
    if opened is None:
        raise CorruptStoreError(f"{path}: chunk file is missing (deleted?) but holds committed rows")
    fd, actual = opened
    if actual != size:
        os.close(fd)
        raise CorruptStoreError(f"{path}: chunk holds {actual} bytes, expected {size} (truncated or foreign file?)")
    return fd


def read_error(where: str, exc: OSError, verb: str = "read") -> StoreError:
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
        self._scratch = memoryview(b"")
        #: The compiled loop that reads a request's runs of rows
        #: (:func:`tracediff.store.fused_reads.read_runs`), set by the owner where it runs; None: read
        #: run by run in Python (the same bytes, the same errors).
        self.runs_reader: Any = None

    def scratch(self, nbytes: int) -> memoryview:
        """A writable, 64-byte aligned buffer of at least ``nbytes`` bytes, the same one again for
        calls that fit (the reading thread's staging area for rows read out of order)."""
        if len(self._scratch) < nbytes:
            self._scratch = memoryview(aligned_empty((nbytes,), "uint8")).cast("B")
        return self._scratch

    def open(self, path: str, size: int) -> int:
        """File descriptor of chunk file ``path``, which must be a plain file of exactly ``size`` bytes
        (:class:`CorruptStoreError` otherwise: missing, truncated, a FIFO, a folder...)."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = open_chunk_file(path, size)
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


def silence_abandoned_io() -> None:
    """An interrupted command leaves zarr's reads pending on zarr's own IO event loop; when the
    interpreter ends, that loop's tasks are destroyed and asyncio would log "Task was destroyed but
    it is pending!" after the command's one ``tracediff: interrupted`` line. Only zarr's loop is
    quietened, and only once the command has been interrupted: the host program's logging is left
    as it is (``main`` may run inside another program)."""
    import sys  # noqa: PLC0415

    sync = sys.modules.get("zarr.core.sync")
    loop = getattr(sync, "loop", [None])[0] if sync is not None else None
    if loop is not None:
        with contextlib.suppress(Exception):  # a loop already closed: nothing left to log
            loop.set_exception_handler(lambda _loop, _context: None)
