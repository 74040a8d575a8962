"""Row labels of the SGLang adapter's captures, read from SGLang's ``ForwardBatch`` (and the
``LogitsMetadata`` the target hands its logits processor): sequence keys, positions, tokens, next
tokens, phases, validity.

Runs inside SGLang's forward, called by the hooks of :mod:`tracediff.adapters.sglang`: host-side
lists only, a few device ops, never a device sync on GPU. ``state`` is that module's per-process
state (the iteration counter, the first tokens of the latest target forward, the log-once set).
Never imports SGLang.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX


#: ForwardMode name -> store phase, per capture point.
_TARGET_PHASES = {"EXTEND": "prefill", "MIXED": "prefill", "SPLIT_PREFILL": "prefill", "DECODE": "decode",
                  "TARGET_VERIFY": "verify", "PREBUILT": "decode", "DLLM_EXTEND": "extend"}
_DRAFT_PHASES = {"EXTEND": "draft_extend", "MIXED": "draft_extend", "DRAFT_EXTEND": "draft_extend",
                 "DRAFT_EXTEND_V2": "draft_extend", "DECODE": "decode"}


def pack_aux(aux: Any) -> torch.Tensor | None:
    """The packed ``[tokens, K*H]`` tensor SGLang builds (``pack_aux_hidden_states``), one copy at most."""
    if isinstance(aux, torch.Tensor):
        return aux
    if isinstance(aux, (list, tuple)) and aux and all(isinstance(t, torch.Tensor) for t in aux):
        return aux[0] if len(aux) == 1 else torch.cat(list(aux), dim=-1)
    return None


def target_labels(state: Any, batch: Any, input_ids: torch.Tensor, counts: list[int] | None, rows: int, mode: str,
                   step: int) -> dict[str, Any]:
    ids = input_ids.reshape(-1).long()
    next_ids = torch.full_like(ids, -1)
    valid: Any = True
    if counts is not None and mode != "TARGET_VERIFY":
        # x_{p+1} is the next row of the same request; unknown (not yet sampled) for its last row.
        next_ids[:-1] = ids[1:]
        ends = request_starts(counts, ids.device, ends=True)
        if ends is not None:
            next_ids[ends] = -1
    elif mode == "TARGET_VERIFY" and counts is not None:
        # Rows past each request's first are draft proposals; which are accepted is decided later
        # (the draft's DRAFT_EXTEND_V2 rows carry the accepted ones).
        flags = torch.zeros(rows, dtype=torch.bool, device=ids.device)
        starts = request_starts(counts, ids.device)
        if starts is not None:
            flags[starts] = True
        valid = flags
    labels: dict[str, Any] = {
        "token_id": ids,
        "next_token_id": next_ids,
        "phase": _TARGET_PHASES.get(mode, "unknown"),
        "step": step,
        "valid": _mark_padding(valid, counts, rows, ids.device),
    }
    positions = getattr(batch, "positions", None)
    if isinstance(positions, torch.Tensor) and positions.numel() == rows:
        labels["position"] = positions.reshape(-1)
    seq = _seq_labels(state, batch, counts, rows)
    if seq is not None:
        labels["seq"] = seq
        labels["valid"] = _without_health_checks(labels["valid"], seq, ids.device)
    return labels


def draft_labels(state: Any, batch: Any, input_ids: Any, positions: Any, rows: int) -> dict[str, Any]:
    """Labels of the draft-extend rows: position p holds the target state of x_p; the draft's input
    token there is x_{p+1} (SGLang rotates ``input_ids`` left by one per request)."""
    mode = mode_name(batch)
    if not isinstance(input_ids, torch.Tensor) or input_ids.numel() != rows:
        input_ids = getattr(batch, "input_ids", None)
    if not isinstance(positions, torch.Tensor) or positions.numel() != rows:
        positions = getattr(batch, "positions", None)
    counts = rows_per_request(batch, rows, mode)
    labels: dict[str, Any] = {"phase": _DRAFT_PHASES.get(mode, "draft_extend"), "step": max(state.step, 0)}
    if isinstance(positions, torch.Tensor) and positions.numel() == rows:
        labels["position"] = positions.reshape(-1)
    valid: Any = True
    if isinstance(input_ids, torch.Tensor) and input_ids.numel() == rows:
        nxt = input_ids.reshape(-1).long()
        tok = torch.full_like(nxt, -1)
        tok[1:] = nxt[:-1]  # x_p of row r is the draft input of row r-1 within a request
        starts = request_starts(counts, nxt.device) if counts is not None else None
        if starts is not None:
            tok[starts] = _first_tokens(state, batch, starts.numel(), nxt)
        labels["token_id"] = tok
        labels["next_token_id"] = nxt
    if mode == "DRAFT_EXTEND_V2":
        accept = getattr(batch.spec_info, "num_accept_tokens", None)
        if isinstance(accept, torch.Tensor) and counts is not None and len(set(counts)) == 1 and counts[0] > 0:
            width = counts[0]
            bs = len(counts)
            idx = torch.arange(width, device=accept.device).expand(bs, width)
            valid = (idx < accept.reshape(-1)[:bs, None].to(idx.dtype)).reshape(-1)
        else:
            state.log_once("no-accept", logging.WARNING,
                      "tracediff: sglang adapter: DRAFT_EXTEND_V2 without num_accept_tokens; rows past the accepted "
                      "tokens cannot be told apart (all marked valid)")
    labels["valid"] = _mark_padding(valid, counts, rows, input_ids.device if isinstance(input_ids, torch.Tensor) else None)
    seq = _seq_labels(state, batch, counts, rows)
    if seq is not None:
        labels["seq"] = seq
        labels["valid"] = _without_health_checks(labels["valid"], seq, input_ids.device
                                                 if isinstance(input_ids, torch.Tensor) else None)
    return labels


def _first_tokens(state: Any, batch: Any, n: int, like: torch.Tensor) -> torch.Tensor:
    """x_p of each request's first draft row: the first token of the same request in the target
    forward that just ran (same batch order), else unknown (-1)."""
    first = state.last_first_tokens
    rids = request_keys(batch)
    if first is not None and first.numel() == n and (rids is None or rids == state.last_rids):
        return first.to(device=like.device, dtype=like.dtype)
    return torch.full((n,), -1, dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------- batch layout helpers
def mode_name(batch: Any) -> str:
    mode = getattr(batch, "forward_mode", None)
    name = getattr(mode, "name", None)
    return str(name) if name else str(mode)


def call_argument(args: tuple, kwargs: dict, index: dict[str, int], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = index.get(name)
    return args[i] if i is not None and i < len(args) else None


def rows_per_request(batch: Any, rows: int, mode: str) -> list[int] | None:
    """Rows of each request, in order (host lists only: never a device sync)."""
    bs = getattr(batch, "batch_size", None)
    for name in ("extend_seq_lens_cpu", "extend_lens"):
        value = getattr(batch, name, None)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            value = value.tolist()
        if isinstance(value, (list, tuple)) and value and all(isinstance(x, (int, np.integer)) for x in value):
            counts = [int(x) for x in value]
            if sum(counts) <= rows and mode not in ("DECODE", "TARGET_VERIFY"):
                return counts
    if isinstance(bs, int) and bs > 0:
        if mode == "DECODE":
            return [1] * min(bs, rows)
        spec = getattr(batch, "spec_info", None)
        per = getattr(spec, "num_tokens_per_req", None) or getattr(spec, "draft_token_num", None)
        if isinstance(per, int) and per > 0 and per * bs <= rows:
            return [per] * bs
        if rows % bs == 0:
            return [rows // bs] * bs
    return None


def request_starts(counts: Sequence[int] | None, device: torch.device, *, ends: bool = False) -> torch.Tensor | None:
    if not counts:
        return None
    offsets = np.cumsum([0, *counts[:-1]]) if not ends else np.cumsum(counts) - 1
    keep = np.asarray(counts) > 0
    return torch.as_tensor(offsets[keep], dtype=torch.long).to(device, non_blocking=True)


def _mark_padding(valid: Any, counts: list[int] | None, rows: int, device: Any) -> Any:
    """Rows past the requests (graph / DP padding) carry no data."""
    total = sum(counts) if counts is not None else rows
    if total >= rows:
        return valid
    flags = valid.clone() if isinstance(valid, torch.Tensor) else torch.full((rows,), bool(valid), device=device)
    flags[total:] = False
    return flags


def request_keys(batch: Any) -> list[str] | None:
    rids = getattr(batch, "rids", None)
    if rids is None:
        rids = getattr(batch, "_tracediff_rids", None)  # set by the init_new wrapper on older versions
    if isinstance(rids, (list, tuple)) and rids:
        return [str(r) for r in rids]
    return None


def _seq_labels(state: Any, batch: Any, counts: list[int] | None, rows: int) -> np.ndarray | None:
    """One sequence key per row: the request id, repeated over the request's rows."""
    if counts is None:
        return None
    keys = request_keys(batch)
    if keys is None:
        pool = getattr(batch, "req_pool_indices_cpu", None)
        if pool is None:
            pool = getattr(batch, "req_pool_indices", None)
        if not isinstance(pool, torch.Tensor):
            return None
        state.log_once("no-rids", logging.WARNING,
                  "tracediff: sglang adapter: this SGLang gives no request ids to the forward; sequences are keyed "
                  "by request-pool slot (slots are reused: compare aligns by token content)")
        keys = [f"pool{int(i)}" for i in pool.reshape(-1).tolist()]  # a sync, on old versions only
    if len(keys) < len(counts):
        return None
    seq = np.repeat(np.asarray(keys[: len(counts)], dtype=object), counts)
    if seq.size < rows:
        seq = np.concatenate([seq, np.full(rows - seq.size, "<padding>", dtype=object)])
    return seq


def _without_health_checks(valid: Any, seq: np.ndarray, device: Any) -> Any:
    """Rows of SGLang's own /health probes (rid ``HEALTH_CHECK...``) are not user data: invalid."""
    probe = np.fromiter((str(k).startswith(HEALTH_CHECK_PREFIX) for k in seq), dtype=bool, count=seq.size)
    if not probe.any():
        return valid
    keep = torch.from_numpy(~probe).to(device) if device is not None else torch.from_numpy(~probe)
    return keep & valid if isinstance(valid, torch.Tensor) else (keep if valid else torch.zeros_like(keep))


def capturing_graph(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured: a copy made now would be baked into the graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------ older versions: request ids
def ensure_older_version_rids() -> None:
    """SGLang versions whose ForwardBatch has no ``rids``: note each batch's request ids as it is
    built from the ScheduleBatch (``init_new``), so rows are keyed by request id all the same."""
    try:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        return
    fields = getattr(ForwardBatch, "__dataclass_fields__", {})
    if "rids" in fields or getattr(ForwardBatch, "_tracediff_rids_wrapped", False):
        return
    wrap_init_new_for_rids(ForwardBatch)


def wrap_init_new_for_rids(cls: Any) -> bool:
    """Wrap ``cls.init_new(batch, ...)`` to keep ``[req.rid for req in batch.reqs]`` on the result."""
    original = cls.__dict__.get("init_new")
    func = getattr(original, "__func__", None)
    if func is None:
        return False

    def init_new(klass: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = func(klass, batch, *args, **kwargs)
        with contextlib.suppress(Exception):  # labels only: never fail the batch
            result._tracediff_rids = [str(r.rid) for r in getattr(batch, "reqs", None) or []]
        return result

    cls.init_new = classmethod(init_new)
    cls._tracediff_rids_wrapped = True
    return True
