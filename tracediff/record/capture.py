"""The capture path of :class:`tracediff.record.recorder.Recorder`: what runs on the host's thread
inside a forward hook (pick the rows, reserve queue room, one copy off the forward path, resolve
the labels, enqueue). Never raises into the host; never blocks longer than ``block_timeout``."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tracediff.record.ledger import OFFERED
from tracediff.record.parts import (
    LABEL_KEYS,
    TORCH_TO_STORE,
    Batch,
    DefaultLabels,
    TapState,
    label_array,
    label_rows,
    labels_fit,
)
from tracediff.record.sampling import RequestSampler
from tracediff.store import (
    PHASES,
    phase_code,
)

log = logging.getLogger("tracediff")
_SAMPLER_LOCK = threading.Lock()


def _host(value: Any) -> Any:
    """A label as numpy (host tensors only reach here: device labels are host copies by now)."""
    return value.numpy() if isinstance(value, torch.Tensor) else value


class CapturePath:
    """The host-thread half of a :class:`~tracediff.record.recorder.Recorder` (a mixin: the state it
    reads is the Recorder's)."""

    def _capture(self, name: str, tensor: torch.Tensor, labels: Mapping[str, Any] | None, fresh: bool) -> None:
        state = self._taps.get(name) or self.declare(name)
        state.calls += 1
        if not isinstance(tensor, torch.Tensor):
            self._warn_tap(state, "type", f"tap {name!r}: got {type(tensor).__name__}, not a tensor; skipped")
            return
        if tensor.dim() == 0 or tensor.shape[-1] == 0:
            self._warn_tap(state, "shape", f"tap {name!r}: tensor of shape {tuple(tensor.shape)} has no rows; skipped")
            return
        if tensor.dtype not in TORCH_TO_STORE:
            self._warn_tap(state, "dtype", f"tap {name!r}: dtype {tensor.dtype} is not a float type; skipped")
            return
        if tensor.is_meta:
            self._warn_tap(state, "meta", f"tap {name!r}: tensor on the meta device holds no data; skipped")
            return
        width = int(tensor.shape[-1])
        dtype = TORCH_TO_STORE[tensor.dtype]
        if state.width is None:
            state.width, state.dtype = width, dtype
        elif (width, dtype) != (state.width, state.dtype):
            self._warn_tap(
                state,
                f"layout{width}{dtype}",
                f"tap {name!r}: got width {width} {dtype} after {state.width} {state.dtype}; rows of the new "
                f"layout are skipped (record them under another tap name)",
            )
            return
        rows = tensor.numel() // width
        if rows == 0:
            return  # nothing to record (an empty batch); the layout above is still learnt
        self._account(name, OFFERED, rows)
        self._tls.offered = rows  # what capture() counts as lost should this call raise from here on
        step = self._explicit_step if self._explicit_step is not None else state.calls - 1
        label_fields = self._resolve_labels(state, tensor, labels, rows, step)
        phase = label_fields.get("phase")
        nbytes = rows * width * tensor.element_size()

        if not self.limits.wants_step(step) or not self._wants_phase(phase):
            self._add_skip(state, rows)
            self._tls.offered = 0
            return
        if self.limits.samples_requests:
            picked = self._sample_requests(state, tensor, label_fields, rows, width)
            if picked is None:
                self._tls.offered = 0
                return
            tensor, label_fields, cut, kept = picked
            fresh = fresh or cut
            if kept < rows:
                self._tls.offered = rows = kept
                nbytes = rows * width * tensor.element_size()
        take = rows
        if self.limits.max_rows is not None:
            take = min(take, self.limits.max_rows - state.rows_queued)
        # --ring: a budget the writer keeps (tracediff.store.ring), not a cap; local stores only
        if self.limits.max_bytes is not None and not (self.limits.ring and not self.location.remote):
            take = min(take, (self.limits.max_bytes - state.bytes_queued) // (width * tensor.element_size()))
        if take <= 0:
            self._add_skip(state, rows)
            self._tls.offered = 0
            return
        if take < rows:
            self._add_skip(state, rows - take, batches=0)
            self._tls.offered = take
            nbytes = take * width * tensor.element_size()
            # Scalar labels (0-d arrays: a step or seq given once for the batch) apply to every row.
            label_fields = {
                k: (v[:take] if isinstance(v, (np.ndarray, torch.Tensor, DefaultLabels)) and v.ndim else v)
                for k, v in label_fields.items()
            }

        # The queue's budget counts the memory a copy really holds: pooled buffers are a power of two.
        held = nbytes
        if not fresh and tensor.device.type in ("cpu", "cuda"):
            held = self._pool.bucket_numel(take * width) * tensor.element_size()
        reason = self._reserve(held)
        if reason:
            self._note_drop_reason(state, reason)
            self._add_drop(state, take)
            return
        try:
            flat = tensor.detach().reshape(rows, width)[:take]
            data, event, pooled = self._copy_off_path(flat, fresh)
            with self._cond:
                self._queue.put_nowait(Batch(name, data, take, width, label_fields, event, held, pooled))
                self._enqueued += 1
        except queue.Full:  # another host thread filled the last slot first
            self._release(held)
            self._note_drop_reason(state, f"the queue held its {self._queue.maxsize} batches")
            self._add_drop(state, take)
            return
        except BaseException:
            self._release(held)
            raise
        state.rows_queued += take
        state.bytes_queued += nbytes

    def request_sampler(self) -> RequestSampler | None:
        """The recorder's request decisions (``--sample-requests`` / ``--max-requests``), None when it
        records every request. An adapter that knows each row's request registers its prompt here
        (:meth:`RequestSampler.prompt`) before the capture, and frees the requests that ended."""
        if not self.limits.samples_requests:
            return None
        sampler = getattr(self, "_request_sampler", None)
        if sampler is None:
            with _SAMPLER_LOCK:
                sampler = getattr(self, "_request_sampler", None)
                if sampler is None:
                    sampler = RequestSampler(self.limits.sample_requests, self.limits.max_requests)
                    self._request_sampler = sampler
        return sampler

    def _sample_requests(self, state: TapState, tensor: torch.Tensor, fields: dict[str, Any], rows: int,
                         width: int) -> tuple[torch.Tensor, dict[str, Any], bool, int] | None:
        """The rows of the requests chosen (:mod:`tracediff.record.sampling`); the others counted as
        skipped (left out on purpose). None: no row of this batch is kept. A batch cut in part is
        one copy of the kept rows (it replaces the usual copy off the forward path)."""
        sampler = self.request_sampler()
        assert sampler is not None
        labels = {k: v.array() if isinstance(v, DefaultLabels) else v for k, v in fields.items()}
        seq, token = labels.get("seq"), labels.get("token_id")
        pinned = [v for v in (seq, token) if isinstance(v, torch.Tensor) and v.is_pinned()]
        if not (isinstance(seq, torch.Tensor) and seq.is_pinned()) and sampler.decides(_host(seq)):
            # Every request decided from its registered prompt (a server): its token ids are not read,
            # so a device-side copy of them is not waited for (no host sync on the forward path).
            mask = sampler.row_mask(_host(seq), None)
        else:
            if pinned:
                torch.cuda.current_stream().synchronize()  # labels copied asynchronously from the device
            mask = sampler.row_mask(_host(seq), _host(token))
        if mask is None or bool(mask.all()):
            return tensor, fields, False, rows
        kept = int(mask.sum())
        if kept == 0:
            self._add_skip(state, rows)
            return None
        self._add_skip(state, rows - kept, batches=0)
        index = np.flatnonzero(mask)
        flat = tensor.detach().reshape(rows, width)
        picked = flat.index_select(0, torch.from_numpy(index).to(flat.device, non_blocking=True))
        cut: dict[str, Any] = {}
        for key, value in labels.items():
            if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim and value.shape[0] == rows:
                cut[key] = value[index] if isinstance(value, np.ndarray) else value[torch.from_numpy(index)]
            else:
                cut[key] = value
        return picked, cut, True, kept

    def _note_drop_reason(self, state: TapState, why: str) -> None:
        """The first reason a tap dropped rows (in its outcome and its ledger: once, a file write)."""
        if why and not state.drop_reason:
            state.drop_reason = why
            if self._ledger is not None:
                self._ledger.set_reason(state.name, why)

    def _wants_phase(self, phase: Any) -> bool:
        if self.limits.phases is None:
            return True
        if phase is None:
            return "unknown" in self.limits.phases
        if isinstance(phase, np.ndarray):
            return any(PHASES[int(c)] in self.limits.phases for c in np.unique(phase))
        return PHASES[phase_code(phase)] in self.limits.phases

    def _reserve(self, nbytes: int) -> str:
        """Account ``nbytes`` against the queue budget; drop or wait (bounded) when it is spent. Returns
        "" when the batch may be queued, else why not (the queue full of bytes or of batches)."""
        deadline = None
        with self._cond:
            while True:
                fits = self._queued_bytes + nbytes <= self.max_queue_bytes or self._queued_bytes == 0
                if fits and not self._queue.full():
                    self._queued_bytes += nbytes
                    return ""
                why = (f"the queue held its {self._queue.maxsize} batches" if fits else
                       f"the queue held {self._queued_bytes:,} of its {self.max_queue_bytes:,} bytes")
                if self.on_full == "drop" or not self.enabled:
                    return why if self.enabled else "the recorder was closing"
                now = time.monotonic()
                deadline = deadline or now + self.block_timeout
                if now >= deadline:
                    self._log_once("block-timeout", "tracediff: writer behind for %.1fs; dropping a batch", self.block_timeout)
                    return f"{why} for {self.block_timeout:g} s"
                self._cond.wait(deadline - now)

    def _release(self, nbytes: int, done: bool = False) -> None:
        with self._cond:
            self._queued_bytes -= nbytes
            if done:
                self._done += 1
            self._cond.notify_all()

    def _copy_off_path(self, flat: torch.Tensor, fresh: bool) -> tuple[torch.Tensor, Any, bool]:
        """The one copy on the forward path: async into a pooled pinned buffer for CUDA, into a pooled
        plain buffer on CPU. Returns (host data, event or None, whether the data is a pooled buffer).
        The view written through is dropped at once: a queued batch keeps only the pooled buffer."""
        if flat.device.type == "cuda":
            base = self._pool.get(flat.numel(), flat.dtype, pinned=True)
            base[: flat.numel()].view(flat.shape).copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))
            return base, event, True
        if flat.device.type != "cpu":
            return flat.to("cpu"), None, False
        if fresh and flat.is_contiguous():
            return flat, None, False
        base = self._pool.get(flat.numel(), flat.dtype, pinned=False)
        base[: flat.numel()].view(flat.shape).copy_(flat)
        return base, None, True

    def _resolve_labels(
        self,
        state: TapState,
        tensor: torch.Tensor,
        provided: Mapping[str, Any] | None,
        rows: int,
        step: int,
    ) -> dict[str, Any]:
        """Labels for this batch: the provider's, else this thread's ``labels()`` (once per tap),
        else defaults (one sequence per leading index, positions 0..T-1). Arrays are flattened to
        ``rows`` entries; host copies only (label tensors are small)."""
        fields: dict[str, Any] = {}
        pending = getattr(self._tls, "labels", None)
        if pending is not None and pending[0] != state.label_generation:
            generation, values, labelled_by = pending
            if labels_fit(values, rows):
                state.label_generation = generation
                fields.update(values)
                if "labelled_by" not in state.attrs:
                    # Before the batch is queued: the writer group's attributes are taken from
                    # state.attrs when its first batch is written.
                    state.attrs["labelled_by"] = labelled_by or {"how": "tracediff.labels"}
            else:
                self._warn_tap(
                    state,
                    "labels-size",
                    f"tap {state.name!r}: labels given for {label_rows(values)} rows but the tensor has {rows}; "
                    f"using default labels",
                )
        if provided:
            if labels_fit(provided, rows):
                fields.update({k: v for k, v in provided.items() if v is not None})
            else:
                self._warn_tap(state, "provider-size", f"tap {state.name!r}: label provider gave the wrong row count")
        out: dict[str, Any] = {}
        for key, value in fields.items():
            if key not in LABEL_KEYS or value is None:
                continue
            out[key] = label_array(key, value, rows)
        if "seq" not in out or "position" not in out:
            lead = tensor.shape[0] if tensor.dim() >= 3 else 1
            per = rows // max(lead, 1)
            if "seq" not in out:
                out["seq"] = DefaultLabels("seq", state.next_seq, lead, per, rows)
                state.next_seq += lead
            if "position" not in out:
                out["position"] = DefaultLabels("position", 0, lead, per, rows)
        out.setdefault("step", np.int64(step))
        return out
