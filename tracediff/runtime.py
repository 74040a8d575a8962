"""Process-wide settings the ``tracediff`` program makes for itself (never for a process that
imports tracediff as a library: a trainer or a server keeps its own allocator settings)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20
_TRIM_THRESHOLD = 8 << 20


def return_freed_memory() -> bool:
    """Make glibc serve every allocation of 1 MiB or more by its own mmap, so that freeing it gives
    the memory back to the system at once.

    By default glibc raises that threshold (up to 32 MiB) each time a large block is freed, and later
    blocks below it come from the heap, which it rarely returns: compare's plan frees and allocates
    many 10-100 MiB temporaries, and its peak RSS held ~100 MiB of freed heap at 3 x 4096. True when
    the setting was made (glibc on Linux), False elsewhere (nothing changes).

    Setting that threshold also fixes the trim threshold at glibc's 128 KiB: each streaming thread's
    arena then gave its freed top back after every block and page-faulted it in again at the next
    (1.2 M page faults, +50% time of the pass at 8 M narrow rows); up to 8 MiB of free top stays.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
