"""Rows read from uncompressed chunk files by one compiled loop, compiled by numba (see
:meth:`tracediff.store.stream.TraceStream.read_rows`, which uses it when the
:class:`~tracediff.store.files.ChunkFiles` it reads through carries it; the streaming pass's readers
do, through :func:`tracediff.compare.rows.kernels.read_kernel`: importing this module imports numba).

:func:`read_runs` does what ``read_rows``' Python loop does, run by run: one ``pread`` per run of
consecutive rows of a chunk file, straight into the output where the run's destinations are
consecutive, else into a small staging buffer whose rows are then copied to their places at once,
while they are still in the cache. Without the GIL (the pass's block threads read concurrently) and
without Python between two reads (~20 us a run, measured at 8 M narrow rows: 78 k runs). It reports
the first run whose ``pread`` did not return the whole run (an error, a file cut short) and stops
there: the caller reads that run again in Python, which raises the store's one-line error.
"""

from __future__ import annotations

import sys
from typing import Any

import numba
import numpy as np
from numba.core import types

#: ``ssize_t pread(int fd, void *buf, size_t count, off_t offset)`` from the C library the process
#: has loaded, the buffer passed as an address (a pointer and a ``size_t`` travel alike on the 64-bit
#: ABIs numba runs on; :func:`usable` says where).
pread = types.ExternalFunction("pread", types.intp(types.int32, types.uintp, types.uintp, types.int64))
#: ``void *memcpy(void *dest, const void *src, size_t n)``, likewise: a staged row copied to its place by
#: the C library's copy (numba's assignment of one byte slice to another copied byte by byte: 1.3 GB/s
#: of staged narrow rows here, where this copies ~3.5).
memcpy = types.ExternalFunction("memcpy", types.uintp(types.uintp, types.uintp, types.uintp))


def usable() -> bool:
    """Whether :func:`read_runs` may run here: a 64-bit POSIX process (``off_t`` of 64 bits)."""
    return sys.maxsize > 2**32 and sys.platform.startswith(("linux", "darwin", "freebsd"))


@numba.njit(nogil=True, cache=True)
def read_runs(fds: Any, offsets: Any, starts: Any, ends: Any, direct: Any, dest: Any, out: Any, stage: Any,
              row_bytes: int) -> int:
    """Run r (rows ``starts[r]..ends[r]`` of the request, ``(ends[r] - starts[r]) * row_bytes`` bytes at
    byte ``offsets[r]`` of file ``fds[r]``) read into ``out`` (a flat uint8 view of the output rows):
    at row ``dest[starts[r]]`` where ``direct[r]`` (its destinations are consecutive), else into
    ``stage`` (at least one run's bytes) and row k of the run copied to row ``dest[k]``. Returns -1,
    or the first run whose read came back short or failed (the runs before it are in place)."""
    base = out.ctypes.data
    staging = stage.ctypes.data
    for r in range(fds.shape[0]):
        a, b = starts[r], ends[r]
        size = (b - a) * row_bytes
        if direct[r]:
            if pread(fds[r], base + dest[a] * row_bytes, size, offsets[r]) != size:
                return r
            continue
        if pread(fds[r], staging, size, offsets[r]) != size:
            return r
        for k in range(a, b):
            memcpy(base + dest[k] * row_bytes, staging + (k - a) * row_bytes, row_bytes)
    return -1


#: The compiled functions (kernels.py asks numba's cache whether they are there).
ENTRY_POINTS = (read_runs,)


def warm() -> None:
    """Compile (or load from numba's cache) :func:`read_runs` for the types ``read_rows`` calls it
    with, on no runs: run in a child process on a cold cache (:func:`tracediff.compare.rows.fused.warm`)."""
    empty = np.zeros(0, dtype=np.int64)
    byte = np.zeros(1, dtype=np.uint8)
    read_runs(np.zeros(0, dtype=np.int32), empty, empty, empty, np.zeros(0, dtype=np.bool_), empty, byte, byte, 1)


def load() -> None:
    """The same as :func:`warm`: the machine code loaded into this process before a pass's first block."""
    warm()
