"""SGLang adapter: what an SGLang server feeds its EAGLE-3 draft, row by row.

Two capture points, in every scheduler process (attention-TP rank 0 unless ``--all-ranks``):

``fc_in``
    the input of the EAGLE-3 draft's ``fc`` (``LlamaForCausalLMEagle3``, the Kimi/DeepSeek MLA draft
    ``Eagle3DeepseekV2ForCausalLM``, and any ``*Eagle3*`` draft that owns ``model.fc``). SGLang applies
    ``fc`` only in draft-extend forwards (after a prefill, and ``DRAFT_EXTEND_V2`` after a verify),
    where ``spec_info.hidden_states`` is ``fc.in_features`` wide. When ``norm_before_fc`` or ``fc_norm``
    make the fc input differ from the target's raw concatenation, the raw one is kept too, as
    ``fc_in_raw``.
``aux_hidden``
    the target's packed aux hidden states (``cat`` of the captured layers, ascending layer order), taken
    where the target hands them to its ``LogitsProcessor``: what the server will feed the draft. Works
    in the capture-only mode (``--enable-return-aux-hidden-states``) too, with no draft loaded.

Row labels: ``seq`` = the request id (``forward_batch.rids``; on versions without it, the ids of the
``ScheduleBatch`` requests, else the request-pool slot), ``position`` = p, ``token_id`` = x_p (the
token whose target forward produced the row), ``next_token_id`` = x_{p+1} where known (for draft rows
the draft's own input token: SGLang rotates the draft's ``input_ids`` one to the left), ``phase`` from
the forward mode, ``step`` = the scheduler iteration in this process, ``valid`` = false for the rows of
``DRAFT_EXTEND_V2`` past ``num_accept_tokens`` and for unverified tree rows of ``TARGET_VERIFY``. The
rank is the writer group's ``rank`` attribute.

Provenance (writer ``meta.sglang``): SGLang version, the draft config and where its aux layer ids were
read from, its ``d2t`` (SGLang's ``hot_token_id`` - arange: present, size, sha256, offsets or absolute
ids), the target's resolved ``layers_to_capture``, the speculative server args and whether CUDA
graphs are on (graph replay never runs Python hooks).

Runs inside SGLang's forward: hooks read arguments, build small label tensors with a few device ops
(no host sync on GPU) and hand one copy of the rows to the recorder. Nothing here may raise into the
server: a missing attribute (SGLang internals moved) is a logged skip of that capture point. SGLang is
never imported at module level (``tracediff record`` imports this module in every process to read
``WATCH``).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tracediff.adapters._serving import (
    CaptureState,
    activate_from_plugin,
    all_ranks_requested,
    claim_rank,
    command_flags,
)
from tracediff.drafts import d2t_facts
from tracediff.recorder import Recorder

log = logging.getLogger("tracediff")

#: Draft classes by name; other ``*Eagle3*`` modules owning ``model.fc`` are found by their target's
#: logits processor. ``LogitsProcessor`` gives the target's aux hidden states.
DRAFT_CLASSES: tuple[str, ...] = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
WATCH: tuple[str, ...] = ("LogitsProcessor", *DRAFT_CLASSES)

FC_TAP = "fc_in"
FC_RAW_TAP = "fc_in_raw"
AUX_TAP = "aux_hidden"
#: Environment of the SGLang plugin entry point (servers launched without ``tracediff record``).
ENV_STORE = "TRACEDIFF_SGLANG_STORE"
ENV_ALL_RANKS = "TRACEDIFF_SGLANG_ALL_RANKS"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX

#: ForwardMode name -> store phase, per capture point.
_TARGET_PHASES = {"EXTEND": "prefill", "MIXED": "prefill", "SPLIT_PREFILL": "prefill", "DECODE": "decode",
                  "TARGET_VERIFY": "verify", "PREBUILT": "decode", "DLLM_EXTEND": "extend"}
_DRAFT_PHASES = {"EXTEND": "draft_extend", "MIXED": "draft_extend", "DRAFT_EXTEND": "draft_extend",
                 "DRAFT_EXTEND_V2": "draft_extend", "DECODE": "decode"}


# ------------------------------------------------------------------------------------ process state
class _Process(CaptureState):
    """What the hooks of one process share: the iteration counter, the first token of each request of
    the latest target forward (the draft rows' x_p there), provenance, and which points fired."""

    def __init__(self) -> None:
        super().__init__()
        self.last_rids: list[str] | None = None
        self.last_first_tokens: torch.Tensor | None = None
        self.target: dict[str, Any] = {}
        self.draft: dict[str, Any] = {}
        self.recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
        self.draft_module: weakref.ref[torch.nn.Module] | None = None


_state = _Process()


def _log_once(key: str, level: int, fmt: str, *args: Any) -> None:
    _state.log_once(key, level, fmt, *args)


def _skip_point(point: str, reason: str) -> None:
    """Stop recording one capture point in this process (SGLang internals moved); the server goes on."""
    _state.skip(point, reason, "tracediff: sglang adapter: %s not recorded in pid %d: %s (SGLang internals moved? "
                "the server goes on)", point, os.getpid(), reason)


# ------------------------------------------------------------------------------------------- attach
def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """Attach the capture points that ``module`` offers; False when it offers none (or is skipped).

    ``module`` may be a watched class (a ``LogitsProcessor`` just built inside its model, an EAGLE-3
    draft) or a whole model (a target with ``set_eagle3_layers_to_capture``, a draft), as a test or a
    script holding one would pass it. Never raises.
    """
    try:
        if not _records_this_rank(recorder):
            return False
        _describe_process(recorder)
        names = {k.__name__ for k in type(module).__mro__}
        if "LogitsProcessor" in names and type(module).__module__.startswith("sglang."):
            return _attach_logits_processor(recorder, module, _constructing_owner(module))
        fc_owner = _fc_owner(module)
        if fc_owner is not None and _is_eagle3_draft(module):
            return _attach_draft(recorder, module, fc_owner)
        processor = getattr(module, "logits_processor", None)
        if isinstance(processor, torch.nn.Module) and hasattr(module, "set_eagle3_layers_to_capture"):
            return _attach_logits_processor(recorder, processor, module)
        return False
    except Exception as exc:  # noqa: BLE001  (never raise into the server)
        _log_once(f"attach:{type(module).__name__}", logging.WARNING,
                  "tracediff: sglang adapter: cannot attach to %s (%s: %s); not recorded, the server goes on",
                  type(module).__qualname__, type(exc).__name__, exc)
        return False


_ROLE = "_tracediff_sglang_role"  # "target" | "draft" | "skipped", on a LogitsProcessor
_ATTACHED = "_tracediff_sglang_recorders"


def _already_attached(module: torch.nn.Module, recorder: Recorder) -> bool:
    """Hooks are per recorder (a closed recorder removed its own): attach once per recorder."""
    attached = module.__dict__.get(_ATTACHED)
    return attached is not None and recorder in attached


def _mark_attached(module: torch.nn.Module, recorder: Recorder) -> None:
    module.__dict__.setdefault(_ATTACHED, weakref.WeakSet()).add(recorder)


def _is_eagle3_draft(module: torch.nn.Module) -> bool:
    names = [k.__name__ for k in type(module).__mro__]
    return any(n in DRAFT_CLASSES or "eagle3" in n.lower() for n in names)


def _fc_owner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward applies ``fc`` (``draft.model``), or None."""
    for candidate in (getattr(module, "model", None), module):
        fc = getattr(candidate, "fc", None)
        if isinstance(candidate, torch.nn.Module) and isinstance(fc, torch.nn.Module) and _in_features(fc):
            return candidate
    return None


def _in_features(fc: torch.nn.Module) -> int | None:
    for name in ("in_features", "input_size"):  # nn.Linear; SGLang's ColumnParallelLinear (MLA draft)
        value = getattr(fc, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _constructing_owner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The model whose ``__init__`` is building ``module`` right now (``self`` of the nearest frame
    that is a different ``nn.Module``): a ``LogitsProcessor`` does not know its model otherwise."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and owner is not module and frame.f_code.co_name == "__init__":
            return owner
        frame = frame.f_back
    return None


# ----------------------------------------------------------------------------- the target's aux states
def _attach_logits_processor(recorder: Recorder, processor: torch.nn.Module, owner: torch.nn.Module | None) -> bool:
    if _already_attached(processor, recorder):
        return True
    if processor.__dict__.get(_ROLE) == "draft" or (owner is not None and _is_eagle3_draft(owner)):
        # The draft's own logits processor: its aux is the draft's hidden state for the next draft
        # step, not target data. Drafts other than the named classes get their fc hooked from here.
        processor.__dict__[_ROLE] = "draft"
        fc_owner = _fc_owner(owner) if owner is not None else None
        if owner is not None and fc_owner is not None and not any(n in DRAFT_CLASSES for n in (k.__name__ for k in type(owner).__mro__)):
            return _attach_draft(recorder, owner, fc_owner)
        return False
    params: Mapping[str, Any]
    try:
        params = inspect.signature(type(processor).forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "aux_hidden_states" not in params:
        _skip_point(AUX_TAP, f"{type(processor).__qualname__}.forward has no aux_hidden_states argument")
        return False
    index = list(params).index("aux_hidden_states") - 1  # without self
    processor.__dict__[_ROLE] = "target"
    _mark_attached(processor, recorder)
    owner_ref = weakref.ref(owner) if owner is not None else None
    _state.point(AUX_TAP)["attached"] += 1

    def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.enabled or mod.__dict__.get(_ROLE) != "target":
            return
        try:
            _on_target_forward(recorder, args, kwargs, index, owner_ref() if owner_ref is not None else None)
        except Exception as exc:  # noqa: BLE001
            _skip_point(AUX_TAP, f"{type(exc).__name__}: {exc}")
            mod.__dict__[_ROLE] = "skipped"

    recorder.keep_handle(processor.register_forward_pre_hook(pre_hook, with_kwargs=True))
    _publish_meta(recorder)
    return True


def _on_target_forward(recorder: Recorder, args: tuple, kwargs: dict, aux_index: int,
                       owner: torch.nn.Module | None) -> None:
    input_ids = args[0] if args else kwargs.get("input_ids")
    batch = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
    aux = args[aux_index] if len(args) > aux_index else kwargs.get("aux_hidden_states")
    if not isinstance(input_ids, torch.Tensor) or batch is None or not hasattr(batch, "forward_mode"):
        return  # not a model forward (a sampler-only call): nothing to label
    mode = _mode_name(batch)
    if mode == "IDLE" or input_ids.numel() == 0 or _capturing_graph(input_ids):
        return
    rows = int(input_ids.shape[0])
    counts = _rows_per_request(batch, rows, mode)
    with _state.lock:
        _state.step += 1
        step = _state.step
        # x_p of each request's first row: the draft rows of this iteration start there.
        starts = _starts(counts, input_ids.device)
        _state.last_first_tokens = input_ids.index_select(0, starts) if starts is not None else None
        _state.last_rids = _request_keys(batch)
    if aux is None:
        return
    packed = _pack(aux)
    if packed is None or packed.shape[0] != rows:
        return
    info = _state.point(AUX_TAP)
    if info["skipped"] is not None:
        return
    if info["calls"] == 0:
        _first_aux_capture(recorder, packed, owner)
    labels = _target_labels(batch, input_ids, counts, rows, mode, step)
    info["calls"] += 1
    info["rows"] += rows
    # A tensor we concatenated is ours (no second copy); one SGLang hands over stays SGLang's.
    fresh = isinstance(aux, (list, tuple)) and len(aux) > 1
    recorder.capture(AUX_TAP, packed, labels=labels, fresh=fresh)


def _pack(aux: Any) -> torch.Tensor | None:
    """The packed ``[tokens, K*H]`` tensor SGLang builds (``pack_aux_hidden_states``), one copy at most."""
    if isinstance(aux, torch.Tensor):
        return aux
    if isinstance(aux, (list, tuple)) and aux and all(isinstance(t, torch.Tensor) for t in aux):
        return aux[0] if len(aux) == 1 else torch.cat(list(aux), dim=-1)
    return None


def _target_labels(batch: Any, input_ids: torch.Tensor, counts: list[int] | None, rows: int, mode: str,
                   step: int) -> dict[str, Any]:
    ids = input_ids.reshape(-1).long()
    next_ids = torch.full_like(ids, -1)
    valid: Any = True
    if counts is not None and mode != "TARGET_VERIFY":
        # x_{p+1} is the next row of the same request; unknown (not yet sampled) for its last row.
        next_ids[:-1] = ids[1:]
        ends = _starts(counts, ids.device, ends=True)
        if ends is not None:
            next_ids[ends] = -1
    elif mode == "TARGET_VERIFY" and counts is not None:
        # Rows past each request's first are draft proposals; which are accepted is decided later
        # (the draft's DRAFT_EXTEND_V2 rows carry the accepted ones).
        flags = torch.zeros(rows, dtype=torch.bool, device=ids.device)
        starts = _starts(counts, ids.device)
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
    seq = _seq_labels(batch, counts, rows)
    if seq is not None:
        labels["seq"] = seq
        labels["valid"] = _without_health_checks(labels["valid"], seq, ids.device)
    return labels


def _first_aux_capture(recorder: Recorder, packed: torch.Tensor, owner: torch.nn.Module | None) -> None:
    target = _target_provenance(owner)
    _state.target.update(target)
    ltc = target.get("layers_to_capture")
    hidden = target.get("hidden_size")
    labels = None
    if isinstance(ltc, list) and ltc and packed.shape[-1] == len(ltc) * (hidden or -1):
        labels = [f"hs{i}" for i in sorted(ltc)]  # SGLang capture index == HF hidden_states index
    recorder.declare(
        AUX_TAP,
        segment_size=hidden if isinstance(hidden, int) and hidden > 0 and packed.shape[-1] % hidden == 0 else None,
        segment_labels=labels,
        module=f"{target.get('class', 'target')}.logits_processor(aux_hidden_states)",
        module_class="sglang.srt.layers.logits_processor.LogitsProcessor",
        capture="aux_hidden_states",
        segment_note="SGLang capture index i = the residual stream entering layer i = HF hidden_states[i]; "
                     "segments in ascending layer order",
    )
    _publish_meta(recorder)


def _target_provenance(owner: torch.nn.Module | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if owner is None:
        return out
    out["class"] = type(owner).__qualname__
    inner = getattr(owner, "model", None)
    ltc = getattr(inner, "layers_to_capture", None)
    if ltc is None:
        ltc = getattr(owner, "layers_to_capture", None)
    if ltc is not None:
        try:
            out["layers_to_capture"] = [int(x) for x in ltc]
        except (TypeError, ValueError):
            out["layers_to_capture"] = str(ltc)
    if hasattr(owner, "capture_aux_hidden_states"):
        out["capture_aux_hidden_states"] = bool(owner.capture_aux_hidden_states)
    config = getattr(owner, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "_name_or_path"):
        value = getattr(config, key, None)
        if isinstance(value, (int, str)) and value != "":
            out[key.lstrip("_")] = value
    if isinstance(out.get("layers_to_capture"), list):
        out["hf_hidden_states_indices"] = sorted(out["layers_to_capture"])
    return out


# ------------------------------------------------------------------------------------------ the draft
def _attach_draft(recorder: Recorder, draft: torch.nn.Module, fc_owner: torch.nn.Module) -> bool:
    if _already_attached(fc_owner, recorder):
        return True
    fc = fc_owner.fc
    assert isinstance(fc, torch.nn.Module)  # _fc_owner checked it
    in_features = _in_features(fc)
    if in_features is None:
        _skip_point(FC_TAP, f"{type(fc_owner).__qualname__}.fc has no in_features")
        return False
    try:
        params = list(inspect.signature(type(fc_owner).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    if "forward_batch" not in params:
        _skip_point(FC_TAP, f"{type(fc_owner).__qualname__}.forward has no forward_batch argument")
        return False
    _mark_attached(fc_owner, recorder)
    processor = getattr(draft, "logits_processor", None)
    if isinstance(processor, torch.nn.Module):
        processor.__dict__[_ROLE] = "draft"  # its aux is the draft's own state, not target data
    raw_differs = getattr(fc_owner, "input_norm", None) is not None or getattr(fc_owner, "fc_norm", None) is not None
    draft_info = _draft_provenance(draft, fc_owner, in_features, raw_differs)
    _state.draft.update(draft_info)
    _state.draft_module = weakref.ref(draft)
    segment = draft_info.get("target_hidden_size")
    ids = draft_info.get("aux_layer_ids")
    seg_labels = None
    if isinstance(ids, list) and len(ids) == draft_info.get("num_aux_hidden_states"):
        seg_labels = [f"hs{i}" for i in draft_info.get("hf_hidden_states_indices", [])] or None
    size = segment if isinstance(segment, int) and segment > 0 and in_features % segment == 0 else None
    recorder.declare(FC_TAP, segment_size=size, segment_labels=seg_labels, module=f"{type(draft).__qualname__}.model.fc",
                     module_class=f"{type(fc).__module__}.{type(fc).__qualname__}", capture="input",
                     in_features=in_features)
    if raw_differs:
        recorder.declare(FC_RAW_TAP, segment_size=size, segment_labels=seg_labels, module=f"{type(draft).__qualname__} spec_info.hidden_states",
                         capture="raw_concatenation",
                         note="the target's concatenated aux states before norm_before_fc / fc_norm")
    index = {name: i for i, name in enumerate(params)}
    local = threading.local()
    _state.point(FC_TAP)["attached"] += 1
    if raw_differs:
        _state.point(FC_RAW_TAP)["attached"] += 1

    def owner_pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        local.labels = None
        if not recorder.enabled or _state.point(FC_TAP)["skipped"] is not None:
            return
        try:
            batch = _arg(args, kwargs, index, "forward_batch")
            hidden = getattr(getattr(batch, "spec_info", None), "hidden_states", None)
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[-1] != in_features:
                return  # draft decode: fc is not applied to these rows
            if hidden.shape[0] == 0 or _capturing_graph(hidden):
                return
            input_ids = _arg(args, kwargs, index, "input_ids")
            positions = _arg(args, kwargs, index, "positions")
            labels = _draft_labels(batch, input_ids, positions, int(hidden.shape[0]))
            if not _state.point(FC_TAP)["calls"] and not _state.point(FC_RAW_TAP)["calls"]:
                _publish_meta(recorder)
            local.labels = labels
            if raw_differs:
                info = _state.point(FC_RAW_TAP)
                info["calls"] += 1
                info["rows"] += int(hidden.shape[0])
                recorder.capture(FC_RAW_TAP, hidden, labels=labels)
        except Exception as exc:  # noqa: BLE001
            _skip_point(FC_TAP, f"{type(exc).__name__}: {exc}")

    def fc_pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        labels = getattr(local, "labels", None)
        local.labels = None
        if labels is None or not recorder.enabled or _state.point(FC_TAP)["skipped"] is not None:
            return  # fc ran outside a draft-extend forward we labelled: record nothing unlabelled
        tensor = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if not isinstance(tensor, torch.Tensor):
            return
        info = _state.point(FC_TAP)
        info["calls"] += 1
        info["rows"] += int(tensor.numel() // max(int(tensor.shape[-1]), 1))
        recorder.capture(FC_TAP, tensor, labels=labels)

    recorder.keep_handle(fc_owner.register_forward_pre_hook(owner_pre_hook, with_kwargs=True))
    recorder.keep_handle(fc.register_forward_pre_hook(fc_pre_hook, with_kwargs=True))
    _publish_meta(recorder)
    return True


def _draft_labels(batch: Any, input_ids: Any, positions: Any, rows: int) -> dict[str, Any]:
    """Labels of the draft-extend rows: position p holds the target state of x_p; the draft's input
    token there is x_{p+1} (SGLang rotates ``input_ids`` left by one per request)."""
    mode = _mode_name(batch)
    if not isinstance(input_ids, torch.Tensor) or input_ids.numel() != rows:
        input_ids = getattr(batch, "input_ids", None)
    if not isinstance(positions, torch.Tensor) or positions.numel() != rows:
        positions = getattr(batch, "positions", None)
    counts = _rows_per_request(batch, rows, mode)
    labels: dict[str, Any] = {"phase": _DRAFT_PHASES.get(mode, "draft_extend"), "step": max(_state.step, 0)}
    if isinstance(positions, torch.Tensor) and positions.numel() == rows:
        labels["position"] = positions.reshape(-1)
    valid: Any = True
    if isinstance(input_ids, torch.Tensor) and input_ids.numel() == rows:
        nxt = input_ids.reshape(-1).long()
        tok = torch.full_like(nxt, -1)
        tok[1:] = nxt[:-1]  # x_p of row r is the draft input of row r-1 within a request
        starts = _starts(counts, nxt.device) if counts is not None else None
        if starts is not None:
            tok[starts] = _first_tokens(batch, starts.numel(), nxt)
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
            _log_once("no-accept", logging.WARNING,
                      "tracediff: sglang adapter: DRAFT_EXTEND_V2 without num_accept_tokens; rows past the accepted "
                      "tokens cannot be told apart (all marked valid)")
    labels["valid"] = _mark_padding(valid, counts, rows, input_ids.device if isinstance(input_ids, torch.Tensor) else None)
    seq = _seq_labels(batch, counts, rows)
    if seq is not None:
        labels["seq"] = seq
        labels["valid"] = _without_health_checks(labels["valid"], seq, input_ids.device
                                                 if isinstance(input_ids, torch.Tensor) else None)
    return labels


def _first_tokens(batch: Any, n: int, like: torch.Tensor) -> torch.Tensor:
    """x_p of each request's first draft row: the first token of the same request in the target
    forward that just ran (same batch order), else unknown (-1)."""
    first = _state.last_first_tokens
    rids = _request_keys(batch)
    if first is not None and first.numel() == n and (rids is None or rids == _state.last_rids):
        return first.to(device=like.device, dtype=like.dtype)
    return torch.full((n,), -1, dtype=like.dtype, device=like.device)


def _draft_provenance(draft: torch.nn.Module, fc_owner: torch.nn.Module, in_features: int,
                      raw_differs: bool) -> dict[str, Any]:
    config = getattr(draft, "config", None)
    out: dict[str, Any] = {"class": type(draft).__qualname__, "fc_in_features": in_features,
                           "raw_differs_from_fc_input": raw_differs}
    for key in ("model_type", "hidden_size", "target_hidden_size", "num_hidden_layers", "vocab_size",
                "draft_vocab_size", "_name_or_path", "norm_before_fc", "fc_norm", "use_aux_norm"):
        value = getattr(config, key, None)
        if isinstance(value, (int, str, bool)) and value != "":
            out[key.lstrip("_")] = value
    num_aux = getattr(fc_owner, "num_aux_hidden_states", None)
    hidden_in = getattr(fc_owner, "hidden_size_in", None) or out.get("target_hidden_size") or out.get("hidden_size")
    if isinstance(num_aux, int):
        out["num_aux_hidden_states"] = num_aux
    elif isinstance(hidden_in, int) and hidden_in and in_features % hidden_in == 0:
        out["num_aux_hidden_states"] = in_features // hidden_in
    if isinstance(hidden_in, int):
        out["target_hidden_size"] = hidden_in
    out["norm_before_fc"] = getattr(fc_owner, "input_norm", None) is not None
    out["fc_norm"] = getattr(fc_owner, "fc_norm", None) is not None
    eagle = getattr(config, "eagle_config", None)
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    top = {k: getattr(config, k) for k in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")
           if isinstance(getattr(config, k, None), (list, tuple))}
    if isinstance(eagle, dict):
        out["eagle_config"] = {k: v for k, v in eagle.items() if isinstance(v, (int, float, str, bool, list))}
    if nested:
        out["aux_layer_ids"] = [int(x) for x in nested]
        out["aux_layer_ids_source"] = "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        out["aux_layer_ids"] = None
        out["aux_layer_ids_source"] = ("none in the draft config's eagle_config: SGLang uses its default "
                                       "[2, L//2, L-3] (capture indices)")
    if top:
        out["top_level_aux_layer_ids"] = {k: [int(x) for x in v] for k, v in top.items()}
        if not nested:
            _log_once("top-level-ids", logging.WARNING,
                      "tracediff: sglang adapter: the draft config has aux layer ids at its top level (%s) but none "
                      "in eagle_config: SGLang ignores top-level ids and captures its default layers", top)
    if isinstance(out.get("aux_layer_ids"), list):
        # Llama/Qwen config ids are layer indices j; SGLang captures the state entering layer j+1,
        # HF hidden_states[j+1]. (DeepSeek/Kimi drafts since PR #25454 may differ: see the target's
        # layers_to_capture, which is what was really captured.)
        out["hf_hidden_states_indices"] = sorted(i + 1 for i in out["aux_layer_ids"])
    return out


# ----------------------------------------------------------------------------- batch layout helpers
def _mode_name(batch: Any) -> str:
    mode = getattr(batch, "forward_mode", None)
    name = getattr(mode, "name", None)
    return str(name) if name else str(mode)


def _arg(args: tuple, kwargs: dict, index: dict[str, int], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = index.get(name)
    return args[i] if i is not None and i < len(args) else None


def _rows_per_request(batch: Any, rows: int, mode: str) -> list[int] | None:
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


def _starts(counts: Sequence[int] | None, device: torch.device, *, ends: bool = False) -> torch.Tensor | None:
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


def _request_keys(batch: Any) -> list[str] | None:
    rids = getattr(batch, "rids", None)
    if rids is None:
        rids = getattr(batch, "_tracediff_rids", None)  # set by the init_new wrapper on older versions
    if isinstance(rids, (list, tuple)) and rids:
        return [str(r) for r in rids]
    return None


def _seq_labels(batch: Any, counts: list[int] | None, rows: int) -> np.ndarray | None:
    """One sequence key per row: the request id, repeated over the request's rows."""
    if counts is None:
        return None
    keys = _request_keys(batch)
    if keys is None:
        pool = getattr(batch, "req_pool_indices_cpu", None)
        if pool is None:
            pool = getattr(batch, "req_pool_indices", None)
        if not isinstance(pool, torch.Tensor):
            return None
        _log_once("no-rids", logging.WARNING,
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


def _capturing_graph(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured: a copy made now would be baked into the graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------- process facts
def _records_this_rank(recorder: Recorder) -> bool:
    rank, size = _attention_tp_rank()
    claim_rank(recorder, rank, size, "attn-tp")
    if rank in (None, 0) or _all_ranks():
        return True
    _log_once("rank", logging.INFO, "tracediff: sglang adapter: attention-TP rank %s not recorded (use --all-ranks)",
              rank)
    return False


def _attention_tp_rank() -> tuple[int | None, int | None]:
    try:
        from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415

        parallel = get_parallel()
        return int(parallel.attn_tp_rank), int(parallel.attn_tp_size)
    except Exception:  # noqa: BLE001  (not published: a single process, or another version)
        pass
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size  # noqa: PLC0415

        return int(get_attention_tp_rank()), int(get_attention_tp_size())
    except Exception:  # noqa: BLE001
        pass
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None, None


def _all_ranks() -> bool:
    return all_ranks_requested(ENV_ALL_RANKS)


def _describe_process(recorder: Recorder) -> None:
    if recorder in _state.recorders:
        return
    _state.recorders.add(recorder)
    recorder.source["framework"] = "sglang"
    recorder.source["framework_version"] = sglang_version()
    _ensure_older_version_rids()
    if not _state.exit_hook:
        _state.exit_hook = True
        atexit.register(_report_at_exit)


def sglang_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("sglang")
    except Exception:  # noqa: BLE001
        return str(getattr(sys.modules.get("sglang"), "__version__", "unknown"))


def _server_args() -> dict[str, Any]:
    """The speculative and capture server args, as resolved in this process (best effort)."""
    out: dict[str, Any] = {}
    sources: list[Any] = []
    try:
        from sglang.srt import runtime_context as rc  # noqa: PLC0415

        # The raw args first (they hold the resolved capture mode); the bags fill what is unset there.
        for getter in ("get_server_args", "get_spec", "get_exec"):
            try:
                sources.append(getattr(rc, getter)())
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    if not sources:
        try:
            from sglang.srt.managers.schedule_batch import global_server_args_dict  # noqa: PLC0415  (older)

            sources.append(type("Args", (), dict(global_server_args_dict)))
        except Exception:  # noqa: BLE001
            pass
    keys = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
            "speculative_num_draft_tokens", "speculative_draft_model_path", "enable_return_aux_hidden_states",
            "aux_hidden_state_capture", "return_aux_hidden_state_layer_ids", "disable_cuda_graph",
            "disable_radix_cache", "chunked_prefill_size", "device", "dtype", "kv_cache_dtype", "tp_size",
            "dp_size", "enable_dp_attention", "attention_backend", "model_path", "enable_piecewise_cuda_graph")
    for key in keys:
        for source in sources:
            try:
                value = getattr(source, key)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(value, (int, float, str, bool)):
                out[key] = value
            elif isinstance(value, (list, tuple)):
                out[key] = [v if isinstance(v, (int, float, str, bool)) else str(v) for v in value]
            elif value is not None:
                out[key] = str(getattr(value, "name", value))
            else:
                out.setdefault(key, None)
                continue  # unset here: a resolved bag may know it
            break
    on_gpu = out.get("device") in ("cuda", "musa", "hip", "npu", "xpu") or (
        out.get("device") is None and torch.cuda.is_available())
    out["cuda_graphs"] = bool(on_gpu and not out.get("disable_cuda_graph", False))
    return out


def _publish_meta(recorder: Recorder) -> None:
    """Provenance into the writer groups' ``meta`` (set before the first batch is written)."""
    meta: dict[str, Any] = {"sglang_version": sglang_version(), "server_args": _server_args()}
    if _state.target:
        meta["target"] = dict(_state.target)
    if _state.draft:
        meta["draft"] = dict(_state.draft)
        draft = _state.draft_module() if _state.draft_module is not None else None
        hot = getattr(draft, "hot_token_id", None)
        if isinstance(hot, torch.Tensor):
            # SGLang keeps d2t as hot_token_id = d2t + arange: the file's map is hot - arange.
            flat = hot.detach().reshape(-1).long().cpu()
            meta["draft"]["d2t"] = d2t_facts(flat - torch.arange(flat.numel()), _state.draft.get("vocab_size"))
        elif draft is not None:
            meta["draft"]["d2t"] = {"present": False}
    args = meta["server_args"]
    if args.get("aux_hidden_state_capture") or args.get("enable_return_aux_hidden_states"):
        ids = args.get("return_aux_hidden_state_layer_ids")
        meta["aux_layer_ids"] = ids
        meta["aux_layer_ids_source"] = ("server arg --return-aux-hidden-state-layer-ids" if ids
                                        else "SGLang default [2, L//2, L-3] (capture indices)")
    elif _state.draft:
        meta["aux_layer_ids"] = _state.draft.get("aux_layer_ids")
        meta["aux_layer_ids_source"] = _state.draft.get("aux_layer_ids_source")
    if isinstance(_state.target.get("layers_to_capture"), list):
        meta["layers_to_capture"] = _state.target["layers_to_capture"]
    recorder.meta["sglang"] = meta
    if args.get("cuda_graphs"):
        _log_once("cuda-graphs", logging.WARNING,
                  "tracediff: sglang adapter: CUDA graphs are on; graph replays (decode, verify, draft extend) never "
                  "run Python hooks and are not recorded: add --disable-cuda-graph for full coverage")


# -------------------------------------------------------------------------- older versions, at exit
def _ensure_older_version_rids() -> None:
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


def capture_summary() -> dict[str, dict[str, Any]]:
    """Per capture point of this process: attached hooks, calls, rows, skip reason."""
    return {name: dict(info) for name, info in _state.points.items()}


def _report_at_exit() -> None:
    for name, info in _state.points.items():
        if info["attached"] and not info["calls"] and info["skipped"] is None:
            log.warning("tracediff: sglang adapter: %s was attached in pid %d but never fired: %s", name, os.getpid(),
                        never_fired_hint(name, _state_args()))


def _state_args() -> dict[str, Any]:
    try:
        return _server_args()
    except Exception:  # noqa: BLE001
        return {}


def never_fired_hint(point: str, args: dict[str, Any]) -> str:
    if args.get("cuda_graphs"):
        return "CUDA-graph replay bypasses Python hooks; add --disable-cuda-graph"
    if point == AUX_TAP:
        return ("the target captured no aux hidden states; add --enable-return-aux-hidden-states "
                "--speculative-algorithm EAGLE3 (or run an EAGLE-3 draft)")
    return "no draft-extend forward ran (no request reached the draft?)"


# ------------------------------------------------------------------------ tracediff record, plugin
def record_warnings(command: Sequence[str], desc: dict[str, Any]) -> list[str]:
    """Warnings for the end-of-run summary of ``tracediff record --adapter sglang -- CMD``: capture
    points the server command should have fired but that recorded nothing, with the flag to add."""
    argv = list(command)
    if not any("sglang" in a for a in argv):
        return []
    taps = desc.get("taps", {})
    rows = {tap: info.get("rows", 0) for tap, info in taps.items()}
    flag = command_flags(argv)
    out: list[str] = []
    draft = "--speculative-draft-model-path" in flag
    eagle3 = (flag.get("--speculative-algorithm") or "").upper() in ("EAGLE3",)
    capture_only = "--enable-return-aux-hidden-states" in flag
    on_cpu = flag.get("--device") == "cpu"
    graphs = not on_cpu and "--disable-cuda-graph" not in flag
    if not (eagle3 or capture_only or draft):
        out.append("sglang: the server runs no EAGLE-3 draft and captures no aux hidden states: add "
                   "--speculative-algorithm EAGLE3 with --speculative-draft-model-path, or "
                   "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3")
        return out
    if not rows.get(AUX_TAP):
        hint = "add --disable-cuda-graph (graph replay bypasses Python hooks)" if graphs else (
            "did any request reach the server? send one with tracediff send")
        out.append(f"sglang: capture point {AUX_TAP} (the target's packed aux hidden states) never fired: {hint}")
    if draft and not rows.get(FC_TAP):
        hint = "add --disable-cuda-graph (graph replay bypasses Python hooks)" if graphs else (
            "no draft-extend forward ran")
        out.append(f"sglang: capture point {FC_TAP} (the EAGLE-3 draft's fc input) never fired: {hint}")
    elif draft and graphs:
        out.append("sglang: CUDA graphs were on: decode, verify and draft-extend replays were not recorded; "
                   "add --disable-cuda-graph for full coverage")
    if "--disable-radix-cache" not in flag and (rows.get(AUX_TAP) or rows.get(FC_TAP)):
        out.append("sglang: the radix cache was on: prefixes already cached (shared prompts, re-sent sequences) are "
                   "not forwarded again and have no rows; add --disable-radix-cache for full coverage")
    return out


def sglang_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: SGLang calls it early in each of its processes.

    Does nothing unless ``TRACEDIFF_SGLANG_STORE`` names a store (created on first use), so that an
    installed tracediff never records by surprise; nor under ``tracediff record``, which activates
    itself. ``TRACEDIFF_SGLANG_ALL_RANKS=1`` records every attention-TP rank. Never raises.
    """
    activate_from_plugin("sglang", "sglang", sglang_version(), ENV_STORE, ENV_ALL_RANKS)
