"""Format 1 of the trace store: its layout, label fields, value dtypes and codecs (what both
the writer and the reader hold to). The layout and commit protocol are described in
:mod:`tracediff.store`."""

from __future__ import annotations

import math
import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracediff.errors import (
    UsageError,
)

FORMAT = 1
PHASES: tuple[str, ...] = (
    "unknown",
    "train",
    "prefill",
    "extend",
    "draft_extend",
    "decode",
    "verify",
    "idle",
)
LABEL_FIELDS: tuple[str, ...] = ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
_INT_LABELS = ("seq", "position", "token_id", "next_token_id", "step")
LABEL_DTYPES: dict[str, np.dtype] = {
    **{name: np.dtype("int64") for name in _INT_LABELS},
    "phase": np.dtype("int8"),
    "valid": np.dtype("bool"),
}
LABEL_FILL: dict[str, Any] = {**{name: -1 for name in _INT_LABELS}, "phase": 0, "valid": True}

# Logical dtype name -> numpy dtype used on disk. bfloat16 has no numpy dtype: its 16 bits are kept
# verbatim as uint16 so that a round trip is bit-exact.
VALUE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("uint16"),
    "float16": np.dtype("float16"),
    "float32": np.dtype("float32"),
    "float64": np.dtype("float64"),
}
COMPRESSORS = ("none", "lz4", "zstd")
# 1024 rows (benchmarks/RESULTS.md, ## bench_record): 4x fewer files and fsyncs a batch than 256, at
# 1.7x torch.save's speed in that run; 4096 was no faster within the noise, and holds a 4x larger tail in memory
# and makes a reader's row samples pull 4x the bytes.
DEFAULT_CHUNK_ROWS = 1024
DEFAULT_LABEL_CHUNK_ROWS = 4096
DEFAULT_COMPRESSOR = "none"
# zarr v3 dimension names of the arrays; xarray reads them as the variables' dimensions.
VALUES_DIMS: tuple[str, str] = ("row", "feature")
LABEL_DIMS: tuple[str] = ("row",)
# CF ``coordinates`` attribute of ``values``: xarray (decode_coords, on by default) makes these
# arrays coordinates of the values instead of data variables of their own.
VALUES_COORDINATES = " ".join(LABEL_FIELDS)


def phase_code(phase: str | int | None) -> int:
    """Code of a phase name in :data:`PHASES` (``None`` -> unknown)."""
    if phase is None:
        return 0
    if isinstance(phase, (int, np.integer)):
        if not 0 <= int(phase) < len(PHASES):
            raise UsageError(f"phase code {phase} is out of range 0..{len(PHASES) - 1}")
        return int(phase)
    name = str(phase).lower()
    if name not in PHASES:
        raise UsageError(f"unknown phase {phase!r}; known phases: {', '.join(PHASES)}")
    return PHASES.index(name)


def decode_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values -> float32 (bf16 bits are widened exactly: bf16 is the top half of fp32)."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def encode_bfloat16(values_f32: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), for tests and importers without torch."""
    bits = np.ascontiguousarray(values_f32, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values_f32)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def default_source(role: str, framework: str = "", framework_version: str = "") -> dict[str, Any]:
    """Provenance of the process that writes: who, where, when, with what command line."""
    return {
        "role": role,
        "framework": framework,
        "framework_version": framework_version,
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": now_iso(),
        # One id per recording: two recordings by one process within a second are two, a copy of one
        # (a .zarr.zip) is one (compare's same_recording).
        "recording": uuid.uuid4().hex,
        "python": sys.version.split()[0],
    }


def zarr_module():
    import zarr  # noqa: PLC0415  (imported lazily: the injected shim must stay cheap)

    return zarr


def group_document(attributes: Mapping[str, Any]) -> bytes:
    """A group's ``zarr.json``, byte for byte as zarr writes it: what a writer creates with one
    create-if-absent write (a file linked into place, a conditional PUT) instead of zarr's
    check-then-write, so that processes creating the same group at once all succeed."""
    from zarr.core.buffer import default_buffer_prototype  # noqa: PLC0415
    from zarr.core.group import GroupMetadata  # noqa: PLC0415

    docs = GroupMetadata(attributes=dict(attributes)).to_buffer_dict(default_buffer_prototype())
    return docs["zarr.json"].to_bytes()


def codecs_for(name: str, itemsize: int):
    if name == "none":
        return None
    from zarr.codecs import BloscCodec  # noqa: PLC0415

    _thread_local_blosc_mutex()
    if name == "lz4":
        return [BloscCodec(cname="lz4", clevel=1, shuffle="bitshuffle", typesize=itemsize)]
    if name == "zstd":
        return [BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle", typesize=itemsize)]
    raise UsageError(f"unknown compressor {name!r}; choose one of {', '.join(COMPRESSORS)}")


def zstd_codec():
    from zarr.codecs import ZstdCodec  # noqa: PLC0415

    return ZstdCodec(level=1)


def _thread_local_blosc_mutex() -> None:
    """numcodecs' blosc creates a *multiprocessing* Lock on first use. Inside a process started by
    multiprocessing (SGLang's schedulers), that semaphore's finaliser fails at exit and prints a
    traceback into the host's log. A process-local lock guards the same (per-process) blosc state."""
    import threading  # noqa: PLC0415

    try:
        import numcodecs.blosc as blosc  # noqa: PLC0415

        if not getattr(blosc, "_MUTEX_IS_INIT", True):
            blosc._MUTEX = threading.Lock()
            blosc._MUTEX_IS_INIT = True
    except (ImportError, AttributeError):  # another numcodecs: keep its own behaviour
        pass


def jsonable(obj: Any) -> Any:
    """Best-effort conversion of metadata to JSON types (numpy scalars, tuples, paths, dtypes)."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, bool)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else str(value)
    return str(obj)


# What a reader accepts on disk is what TraceWriter writes, checked before zarr touches a byte of
# data: no codec that could run code from a file (zarr v2's pickle and object codecs), no vlen or
# sharding codec, no metadata that makes a reader allocate more than a chunk file can hold.
ALLOWED_CODECS = frozenset({"bytes", "blosc", "zstd"})
MAX_CHUNK_BYTES = 0x7FFFF000  # the most one read() returns on Linux; blosc holds less
MAX_METADATA_BYTES = 64 << 20  # a zarr.json larger than this is not one tracediff wrote
