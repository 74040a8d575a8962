"""Row labels of the vLLM adapter's captures, from the arguments of one drafter call
(``SpecDecodeBaseProposer.propose``) and the model runner's batch: the client's request id as the
sequence key, positions, tokens, the draft's input tokens, phases, validity of padded verify rows.

Runs inside vLLM's step, called by :mod:`tracediff.adapters.vllm`: no host sync on GPU beyond what
vLLM's own CPU-side metadata holds. ``state`` is that module's per-process state (its log-once set).
Never imports vLLM.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

_COMPLETION_ID = re.compile(r"^cmpl-(?P<id>.+)-(?P<i>\d+)$")
_CHAT_ID = re.compile(r"^chatcmpl-(?P<id>.+)$")
_RANDOM_SUFFIX = re.compile(r"^(?P<id>.+)-[0-9a-f]{8}$")


def client_request_id(engine_id: str) -> str:
    """The id a client gave (``request_id`` / ``X-Request-Id``, or ``LLM.generate``'s prompt index)
    from vLLM's engine request id; other ids are kept whole."""
    text = str(engine_id)
    m = _RANDOM_SUFFIX.match(text)
    base = m.group("id") if m else text
    m = _COMPLETION_ID.match(base)
    if m:
        return m.group("id") if m.group("i") == "0" else f"{m.group('id')}-{m.group('i')}"
    m = _CHAT_ID.match(base)
    return m.group("id") if m else base


def batch_labels(state: Any, bound: dict[str, Any], runner: Any, step: int) -> dict[str, Any] | None:
    """Row labels of one ``propose`` call, from its arguments and the runner's batch (no host sync
    on GPU beyond what vLLM's own CPU-side metadata holds)."""
    tok = bound["target_token_ids"]
    pos = bound["target_positions"]
    cad = bound["common_attn_metadata"]
    nxt_req = bound["next_token_ids"]
    rejected = bound.get("num_rejected_tokens_gpu")
    rows = int(tok.shape[0])
    qsl = getattr(cad, "query_start_loc_cpu", None)
    if not isinstance(qsl, torch.Tensor) or qsl.numel() < 2 or int(qsl[-1]) != rows:
        state.log_once("qsl", logging.WARNING, "tracediff: vllm adapter: a drafter batch whose rows do not match its "
                  "query_start_loc (parallel drafting / extra slots?) is not recorded")
        return None
    counts = (qsl[1:] - qsl[:-1]).tolist()
    num_reqs = len(counts)
    req_ids = list(getattr(getattr(runner, "input_batch", None), "req_ids", None) or [])[:num_reqs]
    if len(req_ids) != num_reqs:
        state.log_once("no-runner", logging.WARNING, "tracediff: vllm adapter: the model runner's request ids are not "
                  "reachable (vLLM internals moved?); rows are keyed by batch slot, not request id")
        req_ids = [f"slot{i}" for i in range(num_reqs)]
    device = tok.device
    tok = tok.reshape(-1).long()
    if pos.dim() == 2:  # M-RoPE: [3, N], the first row is the text position
        pos = pos[0]
    pos = pos.reshape(-1).long()
    count_t = torch.tensor(counts, dtype=torch.long, device=device)
    req_index = torch.repeat_interleave(torch.arange(num_reqs, device=device), count_t)
    starts = torch.cumsum(count_t, 0) - count_t
    local = torch.arange(rows, device=device) - starts[req_index]
    if rejected is not None:
        keep = count_t - rejected.reshape(-1)[:num_reqs].long().to(device)
        valid: Any = local < keep[req_index]
        last = (starts + keep - 1).clamp(min=0)
    else:
        valid = True
        last = starts + count_t - 1
    sample = bound.get("token_indices_to_sample")
    if isinstance(sample, torch.Tensor) and sample.numel() == num_reqs:
        last = sample.reshape(-1).long().to(device)
    nxt = torch.full_like(tok, -1)
    nxt[:-1] = tok[1:]
    nxt[last] = nxt_req.reshape(-1)[:num_reqs].long().to(device)
    prompt = [len(getattr((getattr(runner, "requests", None) or {}).get(r), "prompt_token_ids", None) or ())
              for r in req_ids]
    prompt_t = torch.tensor(prompt, dtype=torch.long, device=device)[req_index]
    in_prompt = pos < prompt_t
    later = 6 if rejected is not None else 5  # PHASES: verify / decode
    phase = torch.where(in_prompt, torch.full_like(pos, 2), torch.full_like(pos, later)).to(torch.int8)
    if not any(prompt):
        phase = torch.zeros_like(phase)
    clients = [client_request_id(r) for r in req_ids]
    seq = np.repeat(np.array(clients, dtype=object), counts)
    draft = {"seq": np.array(clients, dtype=object), "pos0": pos[last], "inputs": nxt[last], "k": 0, "step": step,
             "n": num_reqs, "last": last}
    return {"seq": seq, "position": pos, "token_id": tok, "next_token_id": nxt, "valid": valid, "step": step,
            "phase": phase, "fc_phase": "draft_extend", "_draft": draft, "_requests": (clients, req_ids)}


def register_prompts(sampler: Any, runner: Any, requests: tuple[list[str], list[str]]) -> None:
    """Request sampling (``--sample-requests``): each request of this drafter call decided once from
    its prompt's token ids (the model runner's ``requests[engine id].prompt_token_ids``), keyed by
    the client id its rows carry as ``seq``; the decisions of requests the runner no longer holds
    (finished) are freed. A request whose prompt is not reachable (prompt embeddings) is decided batch
    by batch by its rows' own token ids in the recorder (:meth:`RequestSampler.row_mask`): not whole."""
    if sampler is None:
        return
    clients, req_ids = requests
    states = getattr(runner, "requests", None) or {}
    for client, engine_id in zip(clients, req_ids, strict=False):
        if sampler.decided(client) is None:
            prompt = getattr(states.get(engine_id), "prompt_token_ids", None)
            if prompt is not None:
                sampler.prompt(client, prompt)
    if len(sampler) > len(clients):
        sampler.forget([client_request_id(r) for r in states] or clients)


def any_sampled(sampler: Any, bound: dict[str, Any], runner: Any) -> bool:
    """Request sampling: whether a request of this drafter call may be chosen. False only when every
    one is decided, from its registered prompt, as not chosen: the call's rows then need neither
    labels nor a copy (what a server with ``--sample-requests 0.01`` does on 99% of its steps)."""
    qsl = getattr(bound.get("common_attn_metadata"), "query_start_loc_cpu", None)
    if sampler is None or not isinstance(qsl, torch.Tensor) or qsl.numel() < 2:
        return True
    engine_ids = list(getattr(getattr(runner, "input_batch", None), "req_ids", None) or [])[: qsl.numel() - 1]
    if len(engine_ids) != qsl.numel() - 1:
        return True
    clients = [client_request_id(r) for r in engine_ids]
    register_prompts(sampler, runner, (clients, engine_ids))
    return any(sampler.decided(c) is not False for c in clients)
