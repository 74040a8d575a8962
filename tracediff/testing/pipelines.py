"""The trainer-like and engine-like runs that turn a tiny real model's states into labelled fc-input
rows, as a trainer and an inference server really feed an EAGLE-3 draft's ``fc``.

A row is one token position ``p`` of one sequence: ``seq``, ``position = p``, ``token_id = x_p``,
``next_token_id = x_{p+1}`` (-1 for the last position). The pipelines:

* :func:`run_trainer`: one full-sequence forward per sequence (no KV cache), like an online
  EAGLE-3 trainer; rows in position order.
* :func:`run_packed_trainer`: a trainer packing several samples into one batch row (varlen
  attention), positions restarting at each sample.
* :func:`run_engine`: an inference-server imitation: ragged prefill batches packed into one row
  dimension, per-request KV caches, optional chunked prefill, packed one-token decode steps with
  requests interleaved, admission as others finish; plus knobs to inject the bugs tracediff must
  find (chat-template preamble, labels one token late, arbitrary tensor transforms).

Each calls ``on_batch(labels)`` right before each draft call, so a test can forward the labels to a
recorder (``rec.labels(**labels)``) whose hook on ``draft.fc`` then captures the fc input. The model,
the draft stand-in and the data come from :mod:`tracediff.testing.tiny_llama` (or
:mod:`tracediff.testing.models` for other architectures).

Everything runs under ``torch.no_grad()`` and is deterministic for a given seed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tracediff.testing.tiny_llama import DraftHead, TinyLlama, layer_states, new_cache, select

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = [
    "ENGINE_RID_BASE",
    "Batch",
    "run_engine",
    "run_packed_trainer",
    "run_trainer",
]


#: Request ids the engine gives sequence ``i`` (``ENGINE_RID_BASE + i``). Deliberately different
#: from the trainer's ``0..n-1`` so that compare has to align by token content, never by ids.
ENGINE_RID_BASE = 1000

#: The callback type of ``on_batch``: receives the labels of the rows of the coming draft call.
OnBatch = Callable[[dict[str, Any]], None]
#: The callback type of ``transform``: ``(fc_input, states) -> fc_input``.
Transform = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class Batch:
    """One draft call as a pipeline made it.

    ``labels`` is exactly what ``on_batch`` received. ``fc_input`` is the tensor handed to the
    draft (after cast and transform), ``[1, rows, k * H]``, kept only when the pipeline ran with
    ``keep_inputs=True`` (benchmarks producing many rows do not want it kept), else ``None``.
    """

    labels: dict[str, Any]
    fc_input: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Rows in this draft call."""
        return len(self.labels["position"])


def _labels(
    seq: Sequence[int],
    positions: Sequence[int],
    tokens: Sequence[int],
    *,
    phase: str,
    step: int,
    label_shift: int = 0,
) -> dict[str, Any]:
    """Labels of rows (one per position), as ``on_batch`` receives them.

    ``token_id`` is ``tokens[p + label_shift]`` (-1 outside the sequence): a non-zero shift
    imitates the "labelled one token late" bug. ``next_token_id`` is ``tokens[p + 1]``, -1 for the
    last position, and is never shifted.
    """
    n = len(tokens)
    pos = np.asarray(positions, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.int64)
    shifted = pos + label_shift
    ok = (shifted >= 0) & (shifted < n)
    token_id = np.where(ok, tok[np.clip(shifted, 0, n - 1)], -1).astype(np.int64)
    has_next = pos + 1 < n
    next_token_id = np.where(has_next, tok[np.clip(pos + 1, 0, n - 1)], -1).astype(np.int64)
    return {
        "seq": np.asarray(seq, dtype=np.int64),
        "position": pos,
        "token_id": token_id,
        "next_token_id": next_token_id,
        "phase": phase,
        "step": int(step),
    }


def _concat_labels(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row-wise concatenation of per-request labels of one packed batch."""
    out: dict[str, Any] = {
        k: np.concatenate([p[k] for p in parts]) for k in ("seq", "position", "token_id", "next_token_id")
    }
    out["phase"] = parts[0]["phase"]
    out["step"] = parts[0]["step"]
    return out


def _call_draft(
    draft: DraftHead,
    states: dict[str, torch.Tensor],
    layers: Sequence[str],
    labels: dict[str, Any],
    *,
    dtype: torch.dtype,
    transform: Transform | None,
    on_batch: OnBatch | None,
    keep_inputs: bool,
) -> Batch:
    """Build the fc input from ``states``, hand the labels over, then call the draft."""
    fc_input = select(states, layers).to(dtype)
    if transform is not None:
        fc_input = transform(fc_input, states)
    if on_batch is not None:
        on_batch(labels)
    draft(fc_input)
    return Batch(labels=labels, fc_input=fc_input if keep_inputs else None)


@torch.no_grad()
def run_packed_trainer(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    samples_per_row: int | Sequence[int] = 3,
    pad_between: int = 0,
    dtype: torch.dtype = torch.float32,
    on_batch: OnBatch | None = None,
) -> list[Batch]:
    """A trainer that packs several samples into one batch row (varlen / padding-free attention).

    Consecutive samples (``samples_per_row`` of them, or a list of counts cycled over the rows) are
    computed each on its own (varlen attention: no token attends across a sample boundary) and
    concatenated into one row ``[1, sum(T_i) + pads, k * H]``. Labels are what a recorder sees from
    such a trainer: ``seq`` = the packed row (not the sample), ``position`` restarting at 0 for each
    sample, ``token_id = x_p``, and ``next_token_id`` read from the packed row shifted by one, as
    SpecForge's shifted ``input_ids`` are: the last row of a sample gets the next sample's first token
    (-1 at the row's end). ``pad_between`` rows of token 0 (zero states, ``valid = False``, position
    0) follow every sample but the row's last. ``phase = "train"``, ``step`` = the row.
    """
    counts = [samples_per_row] if isinstance(samples_per_row, int) else list(samples_per_row)
    if not counts or min(counts) < 1:
        raise ValueError(f"samples_per_row must be >= 1, got {samples_per_row}")
    draft.to(dtype)
    batches: list[Batch] = []
    i = row = 0
    while i < len(seqs):
        group = seqs[i : i + counts[row % len(counts)]]
        i += len(group)
        parts: list[torch.Tensor] = []
        positions: list[int] = []
        tokens: list[int] = []
        valid: list[bool] = []
        for k, seq in enumerate(group):
            states, _ = layer_states(tl, torch.tensor(list(seq), dtype=torch.long))
            parts.append(select(states, layers)[0])
            positions += range(len(seq))
            tokens += list(seq)
            valid += [True] * len(seq)
            if pad_between and k < len(group) - 1:
                parts.append(torch.zeros(pad_between, parts[-1].shape[-1], dtype=parts[-1].dtype))
                positions += [0] * pad_between
                tokens += [0] * pad_between
                valid += [False] * pad_between
        fc_input = torch.cat(parts)[None].to(dtype)
        n = len(tokens)
        labels = {
            "seq": np.full(n, row, dtype=np.int64),
            "position": np.asarray(positions, dtype=np.int64),
            "token_id": np.asarray(tokens, dtype=np.int64),
            "next_token_id": np.asarray(tokens[1:] + [-1], dtype=np.int64),
            "valid": np.asarray(valid, dtype=bool),
            "phase": "train",
            "step": row,
        }
        if on_batch is not None:
            on_batch(labels)
        draft(fc_input)
        batches.append(Batch(labels=labels, fc_input=None))
        row += 1
    return batches


@torch.no_grad()
def run_trainer(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    on_batch: OnBatch | None = None,
    transform: Transform | None = None,
    keep_inputs: bool = False,
) -> list[Batch]:
    """The "training pipeline": one full-sequence forward (no cache) and one draft call per sequence.

    For sequence ``i``: states of all its tokens -> fc input ``[1, T, k * H]`` cast to ``dtype``
    (``draft`` is cast to ``dtype`` in place once, up front, as a trainer casting its draft would)
    -> optional ``transform(fc_input, states)`` -> ``on_batch(labels)`` -> ``draft(fc_input)``.
    Labels: ``seq = i``, ``position = 0..T-1``, ``token_id = x_p``, ``next_token_id = x_{p+1}``
    (-1 for the last), ``phase = "train"``, ``step = i``. Returns one :class:`Batch` per sequence.
    """
    draft.to(dtype)
    batches: list[Batch] = []
    for i, seq in enumerate(seqs):
        ids = torch.tensor(list(seq), dtype=torch.long)
        states, _ = layer_states(tl, ids)
        labels = _labels([i] * len(seq), range(len(seq)), seq, phase="train", step=i)
        batches.append(
            _call_draft(
                draft,
                states,
                layers,
                labels,
                dtype=dtype,
                transform=transform,
                on_batch=on_batch,
                keep_inputs=keep_inputs,
            )
        )
    return batches


@dataclass
class _Request:
    """One request of the engine imitation: its tokens, its KV cache and how far it has got."""

    rid: int
    tokens: list[int]  # prefix + dataset sequence: every one of them becomes a row
    prompt_len: int  # tokens that are prefilled (possibly in chunks); the rest are decoded
    cache: DynamicCache
    done: int = 0  # tokens forwarded so far == the next position

    @property
    def in_prefill(self) -> bool:
        return self.done < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens)


def _prompt_lengths(
    seqs: Sequence[Sequence[int]],
    prefill_len: int | Callable[[int, Sequence[int]], int] | None,
    seed: int,
) -> list[int]:
    """Dataset tokens of each sequence that go in its prompt (the rest is decoded), in ``[1, T]``.

    ``None`` draws them per request between a quarter and three quarters of the sequence (seeded),
    so that a default run has both long prefills and long decodes.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i, seq in enumerate(seqs):
        t = len(seq)
        if prefill_len is None:
            n = int(rng.integers(max(1, t // 4), max(1, (3 * t) // 4) + 1))
        elif callable(prefill_len):
            n = int(prefill_len(i, seq))
        else:
            n = int(prefill_len)
        out.append(min(max(n, 1), t))
    return out


def _forward_parts(tl: TinyLlama, parts: list[tuple[_Request, int, int]]) -> dict[str, torch.Tensor]:
    """Forward each request's token slice with its own cache; pack the rows into ``[1, sum, H]``.

    Computing requests separately and concatenating their rows gives the same numbers as a
    ragged-attention kernel over the packed batch (what SGLang runs), without writing one.
    """
    per_request: list[dict[str, torch.Tensor]] = []
    for req, start, end in parts:
        ids = torch.tensor(req.tokens[start:end], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)
        states, _ = layer_states(tl, ids, past_key_values=req.cache, position_ids=positions, use_cache=True)
        req.done = end
        per_request.append(states)
    return {k: torch.cat([s[k] for s in per_request], dim=1) for k in per_request[0]}


@torch.no_grad()
def run_engine(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    prefill_len: int | Callable[[int, Sequence[int]], int] | None = None,
    chunk_size: int | None = None,
    max_running: int = 3,
    prefix_tokens: Sequence[int] | None = None,
    label_shift: int = 0,
    transform: Transform | None = None,
    on_batch: OnBatch | None = None,
    seed: int = 0,
    keep_inputs: bool = False,
    also: Sequence[tuple[DraftHead, Sequence[str], OnBatch | None]] = (),
) -> list[Batch]:
    """The "inference server": replay ``seqs`` through an engine-like scheduler (teacher forcing).

    Requests (``seq`` label ``1000 + i``, tokens = ``prefix_tokens + seqs[i]``) wait in arrival
    order. Each engine step is, as in SGLang's scheduler, a prefill batch if there is prefill work
    (prefill has priority), else a decode batch:

    * prefill (``phase="prefill"``): first the unfinished prompt of any request whose prefill was
      chunked, then new requests while fewer than ``max_running`` are running; with
      ``chunk_size``, the batch holds at most that many tokens and the request that does not fit
      is chunked (continued next step). The rows of all requests are packed into one row dimension,
      ``[1, sum(T_i), k * H]``, like SGLang packs an extend batch.
    * decode (``phase="decode"``): one token for every running request past its prompt, in
      admission order, packed as ``[1, n_running, k * H]``; the fed token is the sequence's own next
      token (we replay the data, we do not sample), so every position of every request becomes
      exactly one row. Finished requests leave; new ones are admitted by the next prefill.

    Each request has its own ``DynamicCache``; positions run ``0..len(prefix) + T - 1`` (the
    preamble rows are real rows). ``prefill_len`` is how many dataset tokens are in the prompt
    (int, ``callable(i, seq) -> int``, or ``None``: seeded random with ``seed``), clamped to
    ``[1, T]``; the preamble is always prefilled. ``label_shift`` mislabels ``token_id`` as
    ``x_{p + shift}`` (-1 outside the sequence), the "labelled one token late" bug;
    ``transform(fc_input, states)`` rewrites the fc input before the draft sees it (scale a
    segment, inject NaNs...), ``states`` being the packed ``[1, rows, H]`` states of the batch.
    ``step`` labels count engine steps from 0. Rows arrive in engine order, not sorted.
    Returns one :class:`Batch` per engine step; ``draft`` is cast to ``dtype`` in place.

    ``also``: more ``(draft, layers, on_batch)`` fed by the same engine steps, each its own
    ``layers`` of the same states, after ``draft`` (what servers configured alike but for their
    capture layers would each record: one run of the target instead of one per layer choice).
    """
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if any(len(seq) == 0 for seq in seqs):
        raise ValueError("run_engine needs non-empty sequences")
    draft.to(dtype)
    for other, _layers, _on_batch in also:
        other.to(dtype)
    prefix = list(prefix_tokens or [])
    prompt = _prompt_lengths(seqs, prefill_len, seed)
    waiting: deque[_Request] = deque(
        _Request(
            rid=ENGINE_RID_BASE + i,
            tokens=prefix + list(seq),
            prompt_len=len(prefix) + prompt[i],
            cache=new_cache(tl),
        )
        for i, seq in enumerate(seqs)
    )
    running: list[_Request] = []
    batches: list[Batch] = []
    step = 0
    while waiting or running:
        budget = chunk_size if chunk_size is not None else float("inf")
        parts: list[tuple[_Request, int, int]] = []
        for req in running:  # continue chunked prefills first
            if req.in_prefill and budget > 0:
                n = int(min(req.prompt_len - req.done, budget))
                parts.append((req, req.done, req.done + n))
                budget -= n
        while waiting and len(running) < max_running and budget > 0:
            req = waiting.popleft()
            running.append(req)
            n = int(min(req.prompt_len, budget))
            parts.append((req, 0, n))
            budget -= n
        if parts:
            phase = "prefill"
        else:
            phase = "decode"
            parts = [(r, r.done, r.done + 1) for r in running if not r.in_prefill and not r.finished]
            if not parts:  # unreachable: finished requests leave, prefilling ones made a prefill batch
                raise RuntimeError("engine imitation stalled: no prefill and no decode work")
        labels = _concat_labels(
            [
                _labels([r.rid] * (e - s), range(s, e), r.tokens, phase=phase, step=step, label_shift=label_shift)
                for r, s, e in parts
            ]
        )
        states = _forward_parts(tl, parts)
        batches.append(
            _call_draft(
                draft,
                states,
                layers,
                labels,
                dtype=dtype,
                transform=transform,
                on_batch=on_batch,
                keep_inputs=keep_inputs,
            )
        )
        for other, other_layers, other_on_batch in also:
            _call_draft(other, states, other_layers, labels, dtype=dtype, transform=transform, on_batch=other_on_batch,
                        keep_inputs=False)
        running = [r for r in running if not r.finished]
        step += 1
    return batches
