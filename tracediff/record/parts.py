"""The recorder's parts that hold no thread: a tap's state, a captured batch on its way to the
writer, the pool of host buffers copies land in, and the pure helpers that pick a hook's tensor and
turn labels into per-row arrays."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from tracediff.errors import UsageError
from tracediff.store import (
    phase_code,
)

TORCH_TO_STORE = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}
LABEL_KEYS = ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
LabelProvider = Callable[..., "Mapping[str, Any] | None"]


@dataclass
class TapState:
    """One named tap in this process: its declaration and running counts (host-thread side)."""

    name: str
    segment_size: int | None = None
    segment_labels: list[str] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    rows_queued: int = 0
    bytes_queued: int = 0
    dropped_rows: int = 0
    dropped_batches: int = 0
    skipped_rows: int = 0
    skipped_batches: int = 0
    rows_settled: int = 0  # rows of queued batches the writer has committed or counted as dropped
    drop_reason: str = ""  # why the queue refused this tap's first dropped batch
    width: int | None = None
    dtype: str | None = None
    next_seq: int = 0
    label_generation: int = -1
    warned: set[str] = field(default_factory=set)
    error: str | None = None  # why this tap stopped recording (its hook or labels failed)


@dataclass(frozen=True)
class DefaultLabels:
    """``seq`` or ``position`` labels nobody gave (one sequence per leading index, positions
    0..per-1). The writer thread builds the arrays: off the forward path, and a batch waiting in the
    queue holds no label arrays of its own."""

    field: str
    first: int  # first sequence key (seq)
    lead: int
    per: int
    rows: int  # rows kept: fewer than lead * per when a sampling limit cut the batch
    ndim: int = 1

    def __getitem__(self, cut: slice) -> DefaultLabels:
        return replace(self, rows=len(range(self.rows)[cut]))

    def array(self) -> np.ndarray:
        if self.field == "seq":
            full = np.repeat(np.arange(self.first, self.first + self.lead, dtype=np.int64), self.per)
        else:
            full = np.tile(np.arange(self.per, dtype=np.int64), self.lead)
        return full[: self.rows]


@dataclass
class Batch:
    """One queued capture: its host buffer, small Python objects, and the labels the host gave.
    The [rows, width] view of the buffer is made by the writer thread."""

    tap: str
    data: torch.Tensor  # a pooled 1-D buffer (pinned when copied from a device) or the captured tensor
    rows: int
    width: int
    labels: dict[str, Any]
    event: Any  # torch.cuda.Event or None
    nbytes: int  # what it holds against the queue's budget
    pooled: bool  # ``data`` goes back to the pool once written

    @property
    def values(self) -> torch.Tensor:
        """The rows, [rows, width] (made by the writer thread)."""
        if self.pooled:
            return self.data[: self.rows * self.width].view(self.rows, self.width)
        return self.data.reshape(self.rows, self.width)


class HostPool:
    """Reuses host buffers: pinned ones for device-to-host copies (pinning memory is slow) and plain
    ones for CPU captures (a fresh 48 MiB tensor costs page faults on every step; on a VM that returns
    freed memory to its host they run at 0.1-0.3 GB/s). Buffers are bucketed by size (powers of two,
    so servers whose steps differ in rows reuse them too) and the pool keeps at most ``max_bytes``
    (the recorder's ``max_queue_bytes``: buffers in flight are bounded by the queue's budget, idle ones
    by this)."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self._free: dict[tuple[int, torch.dtype, bool], list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._max = max_bytes

    @staticmethod
    def bucket_numel(numel: int) -> int:
        return max(1 << 12, 1 << (numel - 1).bit_length())

    def get(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements; give this same tensor back to :meth:`put`."""
        key = (self.bucket_numel(numel), dtype, pinned)
        with self._lock:
            bucket = self._free.get(key)
            if bucket:
                buf = bucket.pop()
                self._bytes -= buf.nbytes
                return buf
        # A buffer made under inference_mode would be an inference tensor, which no later capture
        # outside it may write into (an eval loop, then training): pool buffers are always normal.
        with torch.inference_mode(False):
            return torch.empty(key[0], dtype=dtype, pin_memory=pinned)

    def put(self, buf: torch.Tensor, pinned: bool) -> None:
        with self._lock:
            if self._bytes + buf.nbytes <= self._max:
                self._free.setdefault((buf.numel(), buf.dtype, pinned), []).append(buf)
                self._bytes += buf.nbytes




# ---------------------------------------------------------------------- small pure helpers
def input_slot(module: torch.nn.Module, arg: int | str) -> tuple[int | None, str | None]:
    """Where input ``arg`` arrives: its position and its keyword, from ``module.forward``'s signature
    (``forward(hidden_states, ...)`` may be called either way). None where the signature cannot say
    (``*args`` forwards, builtins)."""
    index = arg if isinstance(arg, int) else None
    keyword = arg if isinstance(arg, str) else None
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return index, keyword
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if isinstance(arg, int) and arg < len(positional) and positional[arg].kind == positional[arg].POSITIONAL_OR_KEYWORD:
        keyword = positional[arg].name
    elif isinstance(arg, str):
        index = next((i for i, p in enumerate(positional) if p.name == arg and p.kind == p.POSITIONAL_OR_KEYWORD), None)
    return index, keyword


def pick_input(args: tuple, kwargs: dict, arg: int | str, index: int | None, keyword: str | None) -> Any:
    """The tapped input of one call: by position, else by keyword (see :func:`input_slot`)."""
    if index is not None and index < len(args):
        return args[index]
    if keyword is not None and keyword in kwargs:
        return kwargs[keyword]
    if isinstance(arg, int) and keyword is None and not args:
        # Keywords only and no signature to name them: the first tensor keyword.
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return value
    raise UsageError(f"input {arg!r} not found among {len(args)} positional and {sorted(kwargs)} keyword arguments")


def pick_output(output: Any) -> Any:
    """The module's output tensor: itself, else the first tensor of a tuple / list or of a mapping
    (a ``ModelOutput`` or a dict, in insertion order)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor):
                return value
    if isinstance(output, Mapping):
        for value in output.values():
            if isinstance(value, torch.Tensor):
                return value
    raise UsageError(f"module output of type {type(output).__name__} holds no tensor to capture")


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (torch's messages span several), for the log and the store."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def label_rows(values: Mapping[str, Any]) -> int | None:
    for value in values.values():
        n = numel(value)
        if n is not None and n != 1:
            return n
    return None


def labels_fit(values: Mapping[str, Any], rows: int) -> bool:
    for value in values.values():
        n = numel(value)
        if n is not None and n not in (1, rows):
            return False
    return True


def numel(value: Any) -> int | None:
    if value is None or isinstance(value, (str, bytes, int, float, np.generic)):
        return None
    if isinstance(value, torch.Tensor):
        return value.numel()
    return int(np.asarray(value).size)


def label_array(key: str, value: Any, rows: int) -> Any:
    """One label field as a flat host numpy array of ``rows`` entries (or a numpy scalar)."""
    if key == "phase":
        if isinstance(value, (str, int, np.integer)):
            return np.int8(phase_code(value))
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        arr = arr.reshape(-1)
        if arr.dtype.kind in "OUS":
            return np.array([phase_code(str(x)) for x in arr], dtype=np.int8)
        return arr.astype(np.int8)
    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
        # No sync on the forward path: copy asynchronously; the batch's CUDA event (recorded after
        # this copy was queued) is waited for by the writer before it reads the labels.
        flat = value.detach().reshape(-1)
        if flat.numel() == 1 and rows != 1:
            flat = flat.expand(rows)
        host = torch.empty(flat.shape, dtype=torch.bool if key == "valid" else torch.int64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        return host
    if isinstance(value, torch.Tensor):
        arr = value.detach().to("cpu").numpy().reshape(-1)
    elif isinstance(value, (str, bytes)):
        return np.array([value] * rows, dtype=object) if key == "seq" else bad_label(key, value)
    elif np.isscalar(value):
        return np.asarray(value).astype(np.bool_ if key == "valid" else np.int64)
    else:
        arr = np.asarray(value).reshape(-1)
    if arr.size == 1 and rows != 1:
        arr = np.repeat(arr, rows)
    if key == "seq" and arr.dtype.kind in "OUS":
        return arr.astype(object)
    if key == "valid":
        return arr.astype(np.bool_)
    return arr.astype(np.int64)


def bad_label(key: str, value: Any) -> Any:
    raise UsageError(f"label {key!r} must be numeric, got {value!r}")
