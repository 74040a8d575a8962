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

This module attaches the hooks and captures; the row labels are read from SGLang's batch by
:mod:`tracediff.adapters.sglang_labels`, the provenance by :mod:`tracediff.adapters.sglang_provenance`.

Runs inside SGLang's forward: hooks read arguments, build small label tensors with a few device ops
(no host sync on GPU) and hand one copy of the rows to the recorder. Nothing here may raise into the
server: a missing attribute (SGLang internals moved) is a logged skip of that capture point. SGLang is
never imported at module level (``tracediff record`` imports this module in every process to read
``WATCH``).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tracediff.adapters._serving import (
    CaptureState,
    activate_from_plugin,
    all_ranks_requested,
    claim_rank,
    command_flags,
)
from tracediff.adapters.sglang_chain import attach_sglang_chain, chain_warnings
from tracediff.adapters.sglang_graphs import GraphReplays, install_replay_wrappers
from tracediff.adapters.sglang_labels import (
    call_argument,
    capturing_graph,
    draft_labels,
    ensure_older_version_rids,
    mode_name,
    pack_aux,
    request_keys,
    request_starts,
    rows_per_request,
    target_labels,
)
from tracediff.adapters.sglang_provenance import (
    draft_provenance,
    mtp_draft_provenance,
    publish_meta,
    server_args,
    sglang_version,
    target_provenance,
)
from tracediff.record.recorder import Recorder
from tracediff.store.row_model import mtp as mtp_row_model

log = logging.getLogger("tracediff")

#: Draft classes by name; other ``*Eagle3*`` modules owning ``model.fc`` are found by their target's
#: logits processor. ``LogitsProcessor`` gives the target's aux hidden states.
DRAFT_CLASSES: tuple[str, ...] = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM", "DeepseekV3ForCausalLMNextN")
WATCH: tuple[str, ...] = ("LogitsProcessor", *DRAFT_CLASSES)

FC_TAP = "fc_in"
FC_RAW_TAP = "fc_in_raw"
AUX_TAP = "aux_hidden"
#: Environment of the SGLang plugin entry point (servers launched without ``tracediff record``).
ENV_STORE = "TRACEDIFF_SGLANG_STORE"
ENV_ALL_RANKS = "TRACEDIFF_SGLANG_ALL_RANKS"


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
        self.replays = GraphReplays(self, AUX_TAP)  # graph replays run no hooks: read from their tensors
        self.replay_wrappers = 0  # graph runner methods wrapped (sglang_graphs)


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
    """The module whose forward applies ``fc`` (``draft.model``), or an MTP head's ``eh_proj``
    (DeepSeek NextN: ``model.eh_proj`` next to ``enorm`` / ``hnorm``), or None."""
    for candidate in (getattr(module, "model", None), module):
        if isinstance(candidate, torch.nn.Module) and _input_projection(candidate) is not None:
            return candidate
    return None


def _input_projection(owner: torch.nn.Module) -> torch.nn.Module | None:
    fc = getattr(owner, "fc", None)
    if isinstance(fc, torch.nn.Module) and _in_features(fc):
        return fc
    proj = getattr(owner, "eh_proj", None)
    if isinstance(proj, torch.nn.Module) and _in_features(proj) and all(
            isinstance(getattr(owner, n, None), torch.nn.Module) for n in ("enorm", "hnorm")):
        return proj
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
    _state.replays.add_target(recorder, AUX_TAP, _record_target_rows)
    _state.replay_wrappers = install_replay_wrappers(lambda: _state.replays)
    owner_ref = weakref.ref(owner) if owner is not None else None
    _state.point(AUX_TAP)["attached"] += 1

    def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        role = mod.__dict__.get(_ROLE)
        if role == "skipped":  # stopped after an error: the rows SGLang computes now are lost, and counted
            _count_lost_target_rows(recorder, args, kwargs)
            return
        if not recorder.enabled or role != "target":
            return
        try:
            _on_target_forward(recorder, args, kwargs, index, owner_ref() if owner_ref is not None else None)
        except Exception as exc:  # noqa: BLE001
            _skip_point(AUX_TAP, f"{type(exc).__name__}: {exc}")
            mod.__dict__[_ROLE] = "skipped"
            _count_lost_target_rows(recorder, args, kwargs)

    recorder.keep_handle(processor.register_forward_pre_hook(pre_hook, with_kwargs=True))
    publish_meta(_state, recorder)
    return True


def _count_lost_target_rows(recorder: Recorder, args: tuple, kwargs: dict) -> None:
    """A target forward whose aux rows the adapter does not record (it stopped after an error):
    its token rows are counted lost, so that the run says so instead of ending 0. Never raises."""
    try:
        input_ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(input_ids, torch.Tensor) and input_ids.numel() and not capturing_graph(input_ids):
            skipped = _state.point(AUX_TAP)["skipped"]
            recorder.count_lost(AUX_TAP, int(input_ids.shape[0]), f"not recorded after an error: {skipped}")
    except Exception:  # noqa: BLE001, S110  (counting is best effort; the server comes first)
        pass


def _on_target_forward(recorder: Recorder, args: tuple, kwargs: dict, aux_index: int,
                       owner: torch.nn.Module | None) -> None:
    input_ids = args[0] if args else kwargs.get("input_ids")
    batch = args[3] if len(args) > 3 else kwargs.get("logits_metadata")
    aux = args[aux_index] if len(args) > aux_index else kwargs.get("aux_hidden_states")
    _record_target_rows(recorder, input_ids, batch, aux, owner)


def _record_target_rows(recorder: Recorder, input_ids: Any, batch: Any, aux: Any, owner: torch.nn.Module | None) -> None:
    """One target forward (hooked, or replayed from a graph: sglang_graphs): the step, the draft's
    first tokens, and the aux rows with their labels."""
    if not isinstance(input_ids, torch.Tensor) or batch is None or not hasattr(batch, "forward_mode"):
        return  # not a model forward (a sampler-only call): nothing to label
    mode = mode_name(batch)
    if mode == "IDLE" or input_ids.numel() == 0 or capturing_graph(input_ids):
        return
    rows = int(input_ids.shape[0])
    counts = rows_per_request(batch, rows, mode)
    with _state.lock:
        _state.step += 1
        step = _state.step
        # x_p of each request's first row: the draft rows of this iteration start there.
        starts = request_starts(counts, input_ids.device)
        _state.last_first_tokens = input_ids.index_select(0, starts) if starts is not None else None
        _state.last_rids = request_keys(batch)
    if aux is None:
        return
    info = _state.point(AUX_TAP)
    if info["skipped"] is not None:
        recorder.count_lost(AUX_TAP, rows, f"not recorded after an error: {info['skipped']}")
        return
    packed = pack_aux(aux)
    if packed is None or packed.shape[0] != rows:
        # SGLang computed aux states this adapter cannot read as one row per token: lost, and counted.
        shape = "not a tensor or a list of tensors" if packed is None else f"{packed.shape[0]} rows"
        recorder.count_lost(AUX_TAP, rows, f"aux_hidden_states held {shape} for {rows} tokens")
        return
    if info["calls"] == 0:
        _first_aux_capture(recorder, packed, owner)
    labels = target_labels(_state, batch, input_ids, counts, rows, mode, step)
    info["calls"] += 1
    info["rows"] += rows
    # A tensor we concatenated is ours (no second copy); one SGLang hands over stays SGLang's.
    fresh = isinstance(aux, (list, tuple)) and len(aux) > 1
    recorder.capture(AUX_TAP, packed, labels=labels, fresh=fresh)


def _first_aux_capture(recorder: Recorder, packed: torch.Tensor, owner: torch.nn.Module | None) -> None:
    target = target_provenance(owner)
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
    publish_meta(_state, recorder)


# ------------------------------------------------------------------------------------------ the draft
def _attach_draft(recorder: Recorder, draft: torch.nn.Module, fc_owner: torch.nn.Module) -> bool:
    if _already_attached(fc_owner, recorder):
        return True
    fc = _input_projection(fc_owner)
    assert fc is not None  # _fc_owner checked it
    in_features = _in_features(fc)
    if in_features is None:
        _skip_point(FC_TAP, f"{type(fc_owner).__qualname__}.fc has no in_features")
        return False
    mtp = fc is getattr(fc_owner, "eh_proj", None)
    # An MTP head's eh_proj takes [enorm(embed) | hnorm(h)]: spec_info.hidden_states is h, half as wide.
    hidden_width = in_features // 2 if mtp else in_features
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
    raw_differs = not mtp and (getattr(fc_owner, "input_norm", None) is not None or
                               getattr(fc_owner, "fc_norm", None) is not None)
    draft_info = mtp_draft_provenance(draft, in_features) if mtp else \
        draft_provenance(_state, draft, fc_owner, in_features, raw_differs)
    _state.draft.update(draft_info)
    _state.draft_module = weakref.ref(draft)
    segment = draft_info.get("target_hidden_size")
    ids = draft_info.get("aux_layer_ids")
    seg_labels = None
    if isinstance(ids, list) and len(ids) == draft_info.get("num_aux_hidden_states"):
        seg_labels = [f"hs{i}" for i in draft_info.get("hf_hidden_states_indices", [])] or None
    size = segment if isinstance(segment, int) and segment > 0 and in_features % segment == 0 else None
    mtp_kw: dict[str, Any] = {}
    if mtp:
        size, seg_labels = hidden_width, ["embed_next", "hidden"]
        mtp_kw = {"row_model": mtp_row_model(final_norm=True),
                  "note": "SGLang's NextN layer: eh_proj(cat(enorm(embed(x_{p+1})), hnorm(h_p))), h_p the target's "
                          "hidden state after its final norm; no position is zeroed"}
    recorder.declare(FC_TAP, segment_size=size, segment_labels=seg_labels,
                     module=f"{type(draft).__qualname__}.model.{'eh_proj' if mtp else 'fc'}",
                     module_class=f"{type(fc).__module__}.{type(fc).__qualname__}", capture="input",
                     in_features=in_features, **mtp_kw)
    if raw_differs:
        recorder.declare(FC_RAW_TAP, segment_size=size, segment_labels=seg_labels, module=f"{type(draft).__qualname__} spec_info.hidden_states",
                         capture="raw_concatenation",
                         note="the target's concatenated aux states before norm_before_fc / fc_norm")
    index = {name: i for i, name in enumerate(params)}
    local = threading.local()
    _state.point(FC_TAP)["attached"] += 1
    if raw_differs:
        _state.point(FC_RAW_TAP)["attached"] += 1
    _state.replays.add_draft(recorder, FC_TAP, FC_RAW_TAP if raw_differs else None, hidden_width, mtp=mtp)
    _state.replay_wrappers = install_replay_wrappers(lambda: _state.replays)

    def owner_pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        local.labels = None
        if not recorder.enabled or _state.point(FC_TAP)["skipped"] is not None:
            return
        try:
            batch = call_argument(args, kwargs, index, "forward_batch")
            hidden = getattr(getattr(batch, "spec_info", None), "hidden_states", None)
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[-1] != hidden_width:
                return  # draft decode: fc is not applied to these rows
            if hidden.shape[0] == 0 or capturing_graph(hidden):
                return
            input_ids = call_argument(args, kwargs, index, "input_ids")
            positions = call_argument(args, kwargs, index, "positions")
            labels = draft_labels(_state, batch, input_ids, positions, int(hidden.shape[0]))
            if not _state.point(FC_TAP)["calls"] and not _state.point(FC_RAW_TAP)["calls"]:
                publish_meta(_state, recorder)
            local.labels = labels
            if chain is not None:
                chain.extend_labels(labels)
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
        tensor = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if not isinstance(tensor, torch.Tensor) or not recorder.enabled:
            return
        if labels is None or _state.point(FC_TAP)["skipped"] is not None:
            # fc ran on rows no draft-extend forward labelled (the owner hook stopped after an error,
            # or SGLang called fc another way): nothing unlabelled is recorded, and the rows are counted lost.
            rows = int(tensor.numel() // max(int(tensor.shape[-1]), 1))
            if rows and not capturing_graph(tensor):
                skipped = _state.point(FC_TAP)["skipped"]
                recorder.count_lost(FC_TAP, rows, f"not recorded after an error: {skipped}" if skipped
                                    else "fc ran outside a draft-extend forward the adapter labelled")
            return
        info = _state.point(FC_TAP)
        info["calls"] += 1
        info["rows"] += int(tensor.numel() // max(int(tensor.shape[-1]), 1))
        recorder.capture(FC_TAP, tensor, labels=labels)

    recorder.keep_handle(fc_owner.register_forward_pre_hook(owner_pre_hook, with_kwargs=True))
    recorder.keep_handle(fc.register_forward_pre_hook(fc_pre_hook, with_kwargs=True))
    # record --draft-chain: its owner pre-hook runs after owner_pre_hook, which hands it each extend's labels
    chain = None if mtp else attach_sglang_chain(recorder, _state, draft, fc_owner, fc)
    publish_meta(_state, recorder)
    return True


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
    ensure_older_version_rids()
    if not _state.exit_hook:
        _state.exit_hook = True
        atexit.register(_report_at_exit)


def capture_summary() -> dict[str, dict[str, Any]]:
    """Per capture point of this process: attached hooks, calls, rows, skip reason."""
    return _state.summary()


def _report_at_exit() -> None:
    for name, info in _state.points.items():
        if info["attached"] and not info["calls"] and info["skipped"] is None:
            log.warning("tracediff: sglang adapter: %s was attached in pid %d but never fired: %s", name, os.getpid(),
                        never_fired_hint(name, _state_args()))


def _state_args() -> dict[str, Any]:
    try:
        return server_args()
    except Exception:  # noqa: BLE001
        return {}


def never_fired_hint(point: str, args: dict[str, Any]) -> str:
    if args.get("cuda_graphs") and not _state.replay_wrappers:
        return "CUDA-graph replay bypasses Python hooks and no graph runner of this SGLang was found; add --disable-cuda-graph"
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
    # Graph replays are recorded from the runners' tensors (sglang_graphs); the flag is named only for
    # the rows that path lost (each such loss says "inside a graph replay").
    lost_in_graphs = {tap: n for tap, n in _graph_losses(taps).items() if n} if graphs else {}
    if not rows.get(AUX_TAP) and not lost_in_graphs.get(AUX_TAP):
        out.append(f"sglang: capture point {AUX_TAP} (the target's packed aux hidden states) never fired: "
                   "did any request reach the server? send one with tracediff send")
    if draft and not rows.get(FC_TAP) and not lost_in_graphs.get(FC_TAP):
        out.append(f"sglang: capture point {FC_TAP} (the EAGLE-3 draft's fc input) never fired: "
                   "no draft-extend forward ran")
    for tap, n in lost_in_graphs.items():
        out.append(f"sglang: {n} rows of {tap} were computed inside CUDA-graph replays whose tensors do not hold "
                   "them: add --disable-cuda-graph to record them")
    out.extend(chain_warnings(taps, graphs))
    if "--disable-radix-cache" not in flag and (rows.get(AUX_TAP) or rows.get(FC_TAP)):
        out.append("sglang: the radix cache was on: prefixes already cached (shared prompts, re-sent sequences) are "
                   "not forwarded again and have no rows; add --disable-radix-cache for full coverage")
    return out


def _graph_losses(taps: Mapping[str, Any]) -> dict[str, int]:
    """Rows per tap that the graph-replay path counted lost (their reason names the graph replay)."""
    out: dict[str, int] = {}
    for tap, info in taps.items():
        for w in info.get("writers") or []:
            if "inside a graph replay" in str(w.get("drop_reason") or ""):
                out[tap] = out.get(tap, 0) + int(w.get("dropped_rows") or 0)
    return out


def sglang_plugin() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: SGLang calls it early in each of its processes.

    Does nothing unless ``TRACEDIFF_SGLANG_STORE`` names a store (created on first use), so that an
    installed tracediff never records by surprise; nor under ``tracediff record``, which activates
    itself. ``TRACEDIFF_SGLANG_ALL_RANKS=1`` records every attention-TP rank. Never raises.
    """
    activate_from_plugin("sglang", "sglang", sglang_version(), ENV_STORE, ENV_ALL_RANKS)
