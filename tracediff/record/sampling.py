"""Request sampling (``--sample-requests RATE``, ``--max-requests N``): which requests a recording
keeps, whole, chosen by a pure function of their prompt's token ids.

:func:`sampled` is the rule, public (``tracediff.sampled``) so that a trainer or a data pipeline
picks the same prompts a server recorded: the prompt's token ids as little-endian int64, their
sha256, its first 8 bytes read as a big-endian unsigned integer ``h``; the prompt is chosen when
``h / 2**64 < rate``. A rate of 1 chooses every prompt.

:class:`RequestSampler` is what a recorder holds: a decision per request key, made once (from the
prompt an adapter registered, or from the rows' own token ids) and cached by key so that a
request's decode rows follow its prefill's choice; :meth:`RequestSampler.forget` frees the keys of
requests that ended. Runs on the host's thread inside a forward: a dict lookup per distinct key of
a batch, one sha256 per new request; never raises into the host (the capture path catches).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

#: The rule in words, stored in every writer group recorded with sampling (``limits.sample_rule``).
SAMPLE_RULE = ("sha256 of the prompt token ids as little-endian int64; first 8 bytes as a big-endian unsigned "
               "integer h; chosen when h / 2**64 < rate (tracediff.sampled)")


def prompt_hash(token_ids: Any) -> float:
    """The prompt's position in [0, 1) under :data:`SAMPLE_RULE` (the same bytes whatever the
    container: a list, a numpy array or a torch tensor of ints)."""
    if hasattr(token_ids, "detach"):  # a torch tensor, without importing torch
        token_ids = token_ids.detach().to("cpu").numpy()
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8").reshape(-1))
    digest = hashlib.sha256(ids.tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sampled(token_ids: Any, rate: float) -> bool:
    """Whether a recording with ``--sample-requests rate`` keeps the request (or trainer sample)
    whose prompt is ``token_ids`` (see the module docstring for the rule)."""
    check_rate(rate)
    return rate >= 1.0 or prompt_hash(token_ids) < rate


def check_rate(rate: Any) -> float:
    """``rate`` as a float in (0, 1]; ValueError otherwise (the CLI and Limits say it as a usage error)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"the sampling rate must be a number with 0 < rate <= 1, got {rate!r}")
    return float(rate)


class RequestSampler:
    """The decisions of one recorder: ``rate`` (None: every request) and ``max_requests`` (None: no
    cap; otherwise the first N requests chosen are kept whole, later ones are not)."""

    def __init__(self, rate: float | None, max_requests: int | None) -> None:
        self.rate = None if rate is None else check_rate(rate)
        self.max_requests = max_requests
        self.chosen = 0  # requests chosen so far (what max_requests caps)
        self._decided: dict[Any, bool] = {}
        self._lock = threading.Lock()

    def _choose(self, token_ids: Any, count: bool = True) -> bool:
        keep = self.rate is None or sampled(token_ids, self.rate)
        if keep and count and self.max_requests is not None:
            if self.chosen >= self.max_requests:
                return False
            self.chosen += 1
        return keep

    def prompt(self, key: Any, token_ids: Any) -> bool:
        """Decide request ``key`` from its prompt (once: a later call returns the first decision)."""
        with self._lock:
            known = self._decided.get(key)
            if known is None:
                known = self._decided[key] = self._choose(token_ids)
            return known

    def decided(self, key: Any) -> bool | None:
        return self._decided.get(key)

    def forget(self, live: Iterable[Any]) -> None:
        """Free the decisions of every request not in ``live`` (the requests still running)."""
        keep = set(live)
        with self._lock:
            for key in [k for k in self._decided if k not in keep]:
                del self._decided[key]

    def __len__(self) -> int:
        return len(self._decided)

    def decides(self, seq: Any) -> bool:
        """Whether every key of ``seq`` (a batch's labels) has its decision already (registered
        prompts): then :meth:`row_mask` needs no token ids."""
        if seq is None:
            return True
        keys = np.asarray(seq).reshape(-1)
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else keys
        return all(key in self._decided for key in keys[starts].tolist())

    def row_mask(self, seq: Any, token_id: Any) -> np.ndarray | None:
        """Which rows of a batch to keep, from their ``seq`` labels (one per row, or one for all) and
        ``token_id`` labels: a request registered with :meth:`prompt` keeps its decision; rows of an
        unregistered key are decided by the known token ids (>= 0) of that key's rows in this batch,
        in row order (a trainer sample: its own tokens, docs/recording.md), neither cached (trainers
        reuse batch-local sample keys) nor counted against ``max_requests``. None: keep every row (no
        ``seq`` labels to decide by)."""
        if seq is None:
            return None
        keys = np.asarray(seq).reshape(-1)
        tokens = None if token_id is None else np.asarray(token_id).reshape(-1)
        if keys.size == 1 and tokens is not None and tokens.size > 1:
            keys = np.repeat(keys, tokens.size)
        if keys.size == 0:
            return np.ones(0, dtype=bool)
        # A request's rows come in runs (a server's batch is request by request): one decision a run,
        # no sort (np.unique over a server batch's string keys cost 2 ms for 8,192 rows; this 0.08).
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        lengths = np.diff(np.r_[starts, keys.size])
        decisions: dict[Any, bool] = {}
        keep = np.empty(starts.size, dtype=bool)
        for i, key in enumerate(keys[starts].tolist()):
            known = decisions.get(key)
            if known is None:
                known = self._decided.get(key)
            if known is None:
                # The key's known token ids (-1: unknown, e.g. a trainer's first row) in row order;
                # none at all: the empty prompt's decision (the same for every such row).
                own = tokens[keys == key] if tokens is not None and tokens.size == keys.size else np.zeros(0)
                known = self._choose(own[own >= 0], count=False)
            decisions[key] = keep[i] = known
        return np.repeat(keep, lengths)
