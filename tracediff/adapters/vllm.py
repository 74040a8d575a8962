"""vLLM adapter: what a vLLM engine feeds its EAGLE-3 draft or MTP head, row by row (V1 engine, 0.32).

Capture points, in the process that runs the model (vLLM's Worker; tensor-parallel rank 0 unless
``--all-ranks``):

``aux_hidden``
    the target's concatenated aux hidden states ``[N, K * H]`` as vLLM hands them to the drafter
    (``SpecDecodeBaseProposer.propose(target_hidden_states=...)``): every row of the step, prompt
    rows of a prefill and the 1 + K verify rows per request of a decode step.
``fc_in``
    the input of the draft's ``fc`` (``Eagle3LlamaForCausalLM`` / ``Eagle3Qwen3ForCausalLM`` /
    ``Eagle3DeepseekV2ForCausalLM``: ``model.fc``), inside ``combine_hidden_states``, which vLLM runs
    eagerly in ``propose`` whatever the CUDA-graph or torch.compile mode.
    With an MTP drafter (``{"method": "mtp"}``: ``DeepSeekMTP``), ``fc_in`` is the input of its MTP
    layer's ``eh_proj``, ``[enorm(embed(x_{p+1})) | hnorm(h_p)]``, at the first MTP pass of each
    drafter call (one row per target row; the chained draft steps are not recorded), with the row
    model ``mtp`` and vLLM's position-0 zeroing in its attributes; ``aux_hidden`` is then ``h_p``
    as vLLM hands it over (:mod:`tracediff.adapters.vllm_mtp`).
``fc_in_raw``
    with ``norm_before_fc`` / ``fc_norm``, the concatenation before those norms (the same tensor as
    ``aux_hidden``, kept under the name the SGLang adapter uses for it).
``draft_steps``
    what the draft itself did, one row per request and draft step k: values = its top-4 target ids
    (after ``d2t``; top-1 only with vocab-parallel argmax), ``position`` = the draft position
    (p + k from the request's last valid row p), ``token_id`` = the draft's input token at that step
    (the sampled token, then its own previous draft), ``next_token_id`` = the token it proposed,
    ``phase`` = ``draft_extend`` for k = 0 and ``decode`` after, ``step`` = the drafter call.

Row labels (one per row of ``propose``): ``seq`` = the client's request id (vLLM's engine id is
``cmpl-<id>-<i>-<8 random hex>`` for ``/v1/completions``, ``chatcmpl-<id>-<8 hex>`` for chat,
``<n>-<8 hex>`` for ``LLM.generate``; the id the client sent, ``<id>`` or ``<n>``, is kept),
``position`` = p, ``token_id`` = x_p, ``next_token_id`` = x_{p+1} = the draft's input token at that
row after vLLM's rotation (the sampled token at each request's last valid row), ``phase`` =
``prefill`` for prompt positions, ``verify`` for the verify rows of a decode step (``draft_extend``
for the fc rows), ``step`` = the drafter call in this process, ``valid`` = false for rejected drafts
in padded batches (vLLM feeds all 1 + K verify rows; valid are the first 1 + accepted, from
``num_rejected_tokens_gpu``). The rank is the writer group's ``rank`` attribute.

Provenance (writer ``meta.vllm``, and the canonical ``meta.aux_layers`` compare reads): vLLM
version, the draft config and where its aux ids were read from (top level or ``eagle_config``),
the target's resolved ``aux_hidden_state_layers`` (vLLM sorts and de-duplicates: a warning when that
changed what the config said), norm flags, whether the draft's embedding and lm_head are its own or
the target's, the ``d2t`` map (present, size, sha256, offsets or absolute ids), compile / CUDA-graph
mode, parallel sizes.

This module attaches to the draft and the proposer and captures; the row labels are built by
:mod:`tracediff.adapters.vllm_labels`, the provenance by :mod:`tracediff.adapters.vllm_provenance`.

How it reaches vLLM's processes: ``tracediff record -- CMD`` puts tracediff's sitecustomize shim on
``PYTHONPATH``; vLLM spawns its engine core and workers as fresh interpreters that inherit it, so the
shim activates in each, and the draft class's construction attaches this adapter in the Worker.
(The ``vllm.general_plugins`` entry point, :func:`vllm_plugin`, does the same for servers started
without ``tracediff record``, from ``TRACEDIFF_VLLM_STORE``.) Nothing here may raise into vLLM: a
missing class, method or argument (internals moved) is one logged skip and serving goes on. vLLM
is never imported at module level.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tracediff.adapters._serving import (
    CaptureState,
    activate_from_plugin,
    all_ranks_requested,
    claim_rank,
    command_flags,
)
from tracediff.adapters.vllm_chain import attach_vllm_chain
from tracediff.adapters.vllm_labels import any_sampled, batch_labels
from tracediff.adapters.vllm_mtp import declare_mtp_taps, mtp_layer_modules, mtp_provenance
from tracediff.adapters.vllm_provenance import canonical_aux_layers, draft_config_facts, provenance, vllm_version
from tracediff.record.recorder import Recorder
from tracediff.store.row_model import mtp as mtp_row_model

log = logging.getLogger("tracediff")

DRAFT_CLASSES: tuple[str, ...] = ("Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM", "Eagle3DeepseekV2ForCausalLM")
#: vLLM's MTP drafters whose layers are DeepSeek's (``model.layers[str(i)]`` with ``enorm``, ``hnorm``,
#: ``eh_proj``); attached by that structure, run here: ``DeepSeekMTP`` (``{"method": "mtp"}``).
MTP_CLASSES: tuple[str, ...] = ("DeepSeekMTP", "Glm4MoeMTP", "Glm4MoeLiteMTP")
WATCH: tuple[str, ...] = DRAFT_CLASSES + MTP_CLASSES
#: Where the rows are, as ``module:Class.method``; a version that moved them gets a logged skip.
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids"
DRAFT_MODULES = ("vllm.model_executor.models.llama_eagle3", "vllm.model_executor.models.qwen3_eagle3",
                 "vllm.model_executor.models.deepseek_eagle3", "vllm.model_executor.models.deepseek_mtp")
PROPOSE_ARGS = ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                "token_indices_to_sample", "common_attn_metadata")

FC_TAP = "fc_in"
#: An MTP head's ``eh_proj`` input goes to the same tap as an EAGLE-3 ``fc`` input: the draft's input
#: projection; the tap's row model says which slots a row holds (docs/row-models.md), so a trainer's
#: store tapped on ``eh_proj`` as ``fc_in`` compares without ``--tap``.
MTP_TAP = FC_TAP
FC_RAW_TAP = "fc_in_raw"
AUX_TAP = "aux_hidden"
DRAFT_TAP = "draft_steps"
TOPK = 4  # draft_steps values: the draft's top-k target ids per step (float32 holds ids < 2**24 exactly)
ENV_STORE = "TRACEDIFF_VLLM_STORE"
ENV_ALL_RANKS = "TRACEDIFF_VLLM_ALL_RANKS"
ENV_COMMIT = "TRACEDIFF_VLLM_COMMIT"
#: Seconds a drafter call waits at most for its rows to be committed (``commit = "step"``), or for
#: the writer to come within BACKGROUND_BEHIND batches of the captures (``commit = "background"``).
COMMIT_TIMEOUT = 10.0
#: Batches the writer may be behind in background mode (a drafter call queues 2 + K or 3 + K): what a
#: SIGKILL of the worker can take is bounded by it.
BACKGROUND_BEHIND = 64


# ------------------------------------------------------------------------------------ process state
class _Process(CaptureState):
    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()  # .runner during propose_draft_token_ids, .fc / .draft pending labels
        self.bindings: list[_Binding] = []
        self.patches: list[_Patch] = []


_state = _Process()


def _log_once(key: str, level: int, fmt: str, *args: Any) -> None:
    _state.log_once(key, level, fmt, *args)


def _skip_point(point: str, reason: str) -> None:
    _state.skip(point, reason, "tracediff: vllm adapter: %s not recorded in pid %d: %s (vLLM %s internals moved? "
                "serving goes on)", point, os.getpid(), reason, vllm_version())


# ------------------------------------------------------------------------------------------- attach
def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """Attach to a vLLM EAGLE-3 draft just built (in the Worker); False when ``module`` is not one
    or this rank is not recorded. Never raises."""
    try:
        if not type(module).__module__.startswith("vllm."):
            return False
        owner = getattr(module, "model", None)
        mtp_layers = mtp_layer_modules(module)
        fc = getattr(owner, "fc", None)
        if mtp_layers:
            fcs = [layer.eh_proj for layer in mtp_layers.values()]
        elif isinstance(fc, torch.nn.Module) and hasattr(module, "combine_hidden_states"):
            fcs = [fc]
        else:
            return False
        if any(b.draft() is module and b.recorder is recorder for b in _state.bindings):
            return True
        if not _records_this_rank(recorder):
            return False
        reason = _install_patches()
        if reason is not None:
            _skip_point(MTP_TAP if mtp_layers else FC_TAP, reason)
            _skip_point(AUX_TAP, reason)
            return False
        binding = _Binding(recorder, module, fcs[0], mtp_layers=mtp_layers)
        _state.bindings.append(binding)
        recorder.keep_handle(binding)
        for each in fcs:  # MTP: every layer's eh_proj; the first call of a propose is the one recorded
            recorder.keep_handle(each.register_forward_pre_hook(binding.fc_pre_hook, with_kwargs=True))
        recorder.source.update(framework="vllm", framework_version=vllm_version())
        return True
    except Exception as exc:  # noqa: BLE001  (never raise into the engine)
        _log_once(f"attach:{type(module).__name__}", logging.WARNING,
                  "tracediff: vllm adapter: cannot attach to %s (%s: %s); not recorded, serving goes on",
                  type(module).__qualname__, type(exc).__name__, exc)
        return False


def prepare_in_process() -> None:
    """For ``tracediff.record(..., adapter="vllm")`` in a script: import the draft classes so that a
    draft built later is attached, and say when the engine runs in another process."""
    if "vllm" not in sys.modules:
        log.warning("tracediff: vllm adapter: import vllm before tracediff.record(..., adapter='vllm')")
        return
    for name in DRAFT_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") not in ("0", "false", "False"):
        log.warning("tracediff: vllm adapter: vLLM runs its engine core in another process; an in-process recorder "
                    "cannot reach it: run the script under `tracediff record --adapter vllm -o STORE -- python "
                    "SCRIPT`, or set VLLM_ENABLE_V1_MULTIPROCESSING=0")


class _Patch:
    """``owner.name`` replaced by a wrapper; ``remove()`` puts the original back (if still ours)."""

    def __init__(self, owner: type, name: str, make: Any) -> None:
        self.owner, self.name = owner, name
        self.original = owner.__dict__[name]
        self.wrapper = make(self.original)
        setattr(owner, name, self.wrapper)

    def remove(self) -> None:
        if self.owner.__dict__.get(self.name) is self.wrapper:
            setattr(self.owner, self.name, self.original)


def _resolve(spec: str) -> tuple[type, str]:
    module_name, _, path = spec.partition(":")
    cls_name, _, method = path.rpartition(".")
    module = importlib.import_module(module_name)
    owner = getattr(module, cls_name)
    if not isinstance(owner, type) or not callable(owner.__dict__.get(method)):
        raise AttributeError(f"{module_name}.{cls_name} has no method {method}")
    return owner, method


def _install_patches() -> str | None:
    """Wrap the proposer's ``propose`` and the runner's ``propose_draft_token_ids`` once per process;
    the reason when this vLLM does not have them."""
    with _state.lock:
        if _state.patches:
            return None
        try:
            proposer, propose = _resolve(PROPOSER)
            runner, runner_method = _resolve(RUNNER)
            params = list(inspect.signature(proposer.__dict__[propose]).parameters)
        except Exception as exc:  # noqa: BLE001
            return f"cannot find {PROPOSER} / {RUNNER} ({type(exc).__name__}: {exc})"
        missing = [p for p in PROPOSE_ARGS if p not in params]
        if missing:
            return f"{PROPOSER} has no argument {', '.join(missing)}"
        _state.patches = [_Patch(proposer, propose, _wrap_propose), _Patch(runner, runner_method, _wrap_runner)]
        if not _state.exit_hook:
            _state.exit_hook = True
            atexit.register(_report_at_exit)
        return None


def _wrap_runner(original: Any) -> Any:
    @functools.wraps(original)
    def propose_draft_token_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_state.local, "runner", None)
        _state.local.runner = self
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.local.runner = previous

    return propose_draft_token_ids


def _wrap_propose(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        binding = _binding_for(self)
        if binding is not None:
            binding.before_propose(self, signature, args, kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.local.fc = None
            _state.local.draft = None
            if binding is not None and binding.chain is not None:
                binding.chain.end()
            # step: before vLLM returns this step's tokens, a client that has its response has its rows
            # committed, even if vLLM SIGKILLs this worker right after (default --shutdown-timeout 0).
            # background: the writer overlaps serving, at most BACKGROUND_BEHIND batches behind.
            # Both bounded in time: a writer further behind is said once; a kill then loses rows,
            # which `tracediff record` counts from the recorder's ledger.
            if binding is not None:
                rec = binding.recorder
                caught_up = rec.flush(timeout=COMMIT_TIMEOUT) if binding.commit == "step" else \
                    rec.wait_for_writer(BACKGROUND_BEHIND, timeout=COMMIT_TIMEOUT)
                if not caught_up and not rec.closed:
                    _log_once("commit-timeout", logging.WARNING, "tracediff: vllm adapter: the writer stayed behind "
                              "the drafter for %.0f s (--commit %s); serving goes on", COMMIT_TIMEOUT, binding.commit)

    return propose


def _binding_for(proposer: Any) -> _Binding | None:
    live = [b for b in _state.bindings if b.active()]
    if not live:
        return None
    model = getattr(proposer, "model", None)
    model = getattr(model, "unwrap", lambda: model)() if model is not None else None
    for b in live:
        if b.draft() is model:
            return b
    return live[0] if len(live) == 1 else None


# ------------------------------------------------------------------------------------- one draft
class _Binding:
    """One recorder attached to one draft: declares the taps, labels each ``propose`` call, captures."""

    def __init__(self, recorder: Recorder, draft: torch.nn.Module, fc: torch.nn.Module,
                 mtp_layers: dict[int, torch.nn.Module] | None = None) -> None:
        self.recorder = recorder
        self.draft = weakref.ref(draft)
        self.fc = weakref.ref(fc)
        self.removed = False
        self.published = False
        self.commit = commit_mode()  # read once: propose runs every step
        self.mtp = bool(mtp_layers)
        self.in_tap = MTP_TAP if self.mtp else FC_TAP
        self.instance_patches: list[str] = []
        if self.mtp:
            self.raw_differs = False
            self.info = declare_mtp_taps(recorder, draft, fc, mtp_layers or {}, MTP_TAP, AUX_TAP)
        else:
            self._declare_eagle3(draft, fc)
        self.chain = None if self.mtp else attach_vllm_chain(recorder, draft, fc)  # record --draft-chain
        recorder.declare(DRAFT_TAP, module=f"{type(draft).__qualname__}.compute_logits",
                         capture="draft_top_k_target_ids", top_k=TOPK)
        for point in self._taps() + (DRAFT_TAP,):
            _state.point(point)["attached"] += 1
        for name in ("compute_logits", "get_top_tokens"):
            method = getattr(draft, name, None)
            if callable(method) and name not in draft.__dict__:
                setattr(draft, name, self._wrap_logits(method, name == "get_top_tokens"))
                self.instance_patches.append(name)

    def _taps(self) -> tuple[str, ...]:
        """The taps a drafter call's rows go to (each row counted lost on each when not recorded)."""
        return (self.in_tap, AUX_TAP) + ((FC_RAW_TAP,) if self.raw_differs else ())

    def _declare_eagle3(self, draft: torch.nn.Module, fc: torch.nn.Module) -> None:
        recorder = self.recorder
        owner = draft.model  # type: ignore[attr-defined]
        self.raw_differs = getattr(owner, "input_norm", None) is not None or getattr(owner, "fc_norm", None) is not None
        info = draft_config_facts(draft)
        self.info = info
        in_features = getattr(fc, "input_size", None) or getattr(fc, "in_features", None)
        size = info.get("target_hidden_size")
        size = size if isinstance(size, int) and isinstance(in_features, int) and in_features % size == 0 else None
        ids = info.get("aux_layer_ids")
        labels = [f"hs{i}" for i in sorted(set(ids))] if isinstance(ids, list) and size and \
            len(set(ids)) * size == in_features else None
        kw = {"segment_size": size, "segment_labels": labels}
        recorder.declare(FC_TAP, **kw, module=f"{type(draft).__qualname__}.model.fc",
                         module_class=f"{type(fc).__module__}.{type(fc).__qualname__}", capture="input",
                         in_features=in_features)
        recorder.declare(AUX_TAP, **kw, module="SpecDecodeBaseProposer.propose(target_hidden_states)",
                         capture="target_aux_concatenation")
        if self.raw_differs:
            recorder.declare(FC_RAW_TAP, **kw, module="SpecDecodeBaseProposer.propose(target_hidden_states)",
                             capture="raw_concatenation",
                             note="the target's concatenated aux states before norm_before_fc / fc_norm")

    def active(self) -> bool:
        return not self.removed and not self.recorder.closed and self.draft() is not None

    def remove(self) -> None:  # the recorder closes: a hook handle
        self.removed = True
        draft = self.draft()
        for name in getattr(self, "instance_patches", []):
            if draft is not None and name in draft.__dict__:
                delattr(draft, name)
        with _state.lock:
            if self in _state.bindings:
                _state.bindings.remove(self)
            if not _state.bindings:
                for patch in _state.patches:
                    patch.remove()
                _state.patches = []

    # -- the proposer's call (host thread, inside vLLM's step)
    def before_propose(self, proposer: Any, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        _state.local.fc = None
        hidden: Any = None
        try:
            bound = signature.bind_partial(proposer, *args, **kwargs).arguments
            hidden = bound.get("target_hidden_states")
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] == 0:
                return
            if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
                return  # a copy made now would be baked into a graph
            if not self.recorder.recording_on:  # switched off: nothing labelled or copied, the rows counted skipped
                self._lose(int(hidden.shape[0]), self.recorder.off_reason)
                return
            skipped = _state.point(AUX_TAP)["skipped"]
            if not self.recorder.enabled or skipped is not None:
                # Rows the drafter reads that are not recorded are counted lost: the run then says so.
                self._lose(int(hidden.shape[0]), f"not recorded after an error: {skipped or self.recorder.error}")
                return
            with _state.lock:
                _state.step += 1
                step = _state.step
            runner = getattr(_state.local, "runner", None)
            if not self.published:  # provenance at the first call, sampled or not (not inside a measured load)
                self.published = True
                self.publish(proposer, runner, hidden)
            if not any_sampled(self.recorder.request_sampler(), bound, runner):  # counted skipped, not lost
                self._lose(int(hidden.shape[0]), self.recorder.unsampled_reason)
                return
            labels = batch_labels(_state, bound, runner, step)
            if labels is None:
                self._lose(int(hidden.shape[0]), "a drafter batch whose rows do not match its query_start_loc "
                           "(parallel drafting / extra slots?) cannot be labelled")
                return
            labels.pop("_requests")  # (their prompts were registered by any_sampled above)
            aux_labels = dict(labels)
            fc_labels = dict(labels, phase=labels["fc_phase"])
            aux_labels["phase"] = labels["phase"]
            for lab in (aux_labels, fc_labels):
                lab.pop("fc_phase", None)
                lab.pop("_draft", None)
            rows = int(hidden.shape[0])
            self._count(AUX_TAP, rows)
            self.recorder.capture(AUX_TAP, hidden, labels=aux_labels)
            if self.raw_differs:
                self._count(FC_RAW_TAP, rows)
                self.recorder.capture(FC_RAW_TAP, hidden, labels=fc_labels)
            _state.local.fc = (rows, fc_labels)
            _state.local.draft = labels.get("_draft")
            if self.chain is not None:
                self.chain.begin(rows, fc_labels, labels.get("_draft"))
        except Exception as exc:  # noqa: BLE001
            _skip_point(AUX_TAP, f"{type(exc).__name__}: {exc}")
            _skip_point(self.in_tap, f"{type(exc).__name__}: {exc}")
            if isinstance(hidden, torch.Tensor) and hidden.dim() == 2:
                self._lose(int(hidden.shape[0]), f"not recorded after an error: {type(exc).__name__}: {exc}")

    def _lose(self, rows: int, why: str) -> None:
        """A drafter call whose rows cannot be recorded: its aux / fc rows counted lost now, its draft
        steps as the draft computes them."""
        for tap in self._taps():
            self.recorder.count_lost(tap, rows, why)
        if why in (self.recorder.off_reason, self.recorder.unsampled_reason):  # fired: not "never fired" at exit
            for tap in (*self._taps(), DRAFT_TAP):
                _state.point(tap)["unrecorded"] = _state.point(tap).get("unrecorded", 0) + 1
        _state.local.draft = {"lost": why}
        if self.chain is not None:
            self.chain.begin(rows, None, _state.local.draft)

    def _wrap_logits(self, method: Any, top1_only: bool) -> Any:
        """The draft's ``compute_logits`` / ``get_top_tokens``: record each draft step's top ids."""
        binding = self

        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            ctx = getattr(_state.local, "draft", None)
            if ctx is None or not binding.active():
                return out
            skipped = _state.point(DRAFT_TAP)["skipped"]
            if "lost" in ctx or skipped is not None:
                rows = int(out.shape[0]) if isinstance(out, torch.Tensor) and out.dim() > 0 else 0
                binding.recorder.count_lost(DRAFT_TAP, rows, ctx.get("lost") or f"not recorded after an error: {skipped}")
                return out
            try:
                binding._draft_step(ctx, out, top1_only)
            except Exception as exc:  # noqa: BLE001
                _skip_point(DRAFT_TAP, f"{type(exc).__name__}: {exc}")
                binding.recorder.count_lost(DRAFT_TAP, int(ctx.get("n") or 0),
                                            f"not recorded after an error: {type(exc).__name__}: {exc}")
            return out

        return wrapper

    def _draft_step(self, ctx: dict[str, Any], out: torch.Tensor, top1_only: bool) -> None:
        n = ctx["n"]
        if not isinstance(out, torch.Tensor) or out.shape[0] < n or ctx["k"] >= 64:
            self.recorder.count_lost(DRAFT_TAP, n, f"a draft step's logits had {tuple(getattr(out, 'shape', ()))} rows "
                                     f"for {n} requests")
            return
        out = out[:n]
        if top1_only or out.dim() == 1:
            top = torch.full((n, TOPK), -1, dtype=torch.long, device=out.device)
            top[:, 0] = out.reshape(n).long()
        else:
            top = out.topk(min(TOPK, out.shape[-1]), dim=-1).indices
            if top.shape[1] < TOPK:
                top = torch.cat([top, torch.full((n, TOPK - top.shape[1]), -1, dtype=top.dtype,
                                                 device=top.device)], 1)
        k = ctx["k"]
        labels = {"seq": ctx["seq"], "position": ctx["pos0"] + k, "token_id": ctx["inputs"],
                  "next_token_id": top[:, 0], "phase": "draft_extend" if k == 0 else "decode", "step": ctx["step"],
                  "valid": True}
        self._count(DRAFT_TAP, n)
        self.recorder.capture(DRAFT_TAP, top.to(torch.float32), labels=labels, fresh=True)
        ctx["inputs"] = top[:, 0]
        ctx["k"] = k + 1

    def fc_pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pending = getattr(_state.local, "fc", None)
        _state.local.fc = None
        tap = self.in_tap
        if pending is None or not self.active() or _state.point(tap)["skipped"] is not None:
            # fc outside a labelled propose (warm-up, dummy runs), or an MTP layer's chained calls of
            # the same propose (draft steps k >= 1: their hidden half is the MTP's own output, not
            # the target's, one row per request): nothing unlabelled is recorded
            return
        tensor = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        rows, labels = pending
        # vLLM's first MTP pass may run a batch padded past the drafter call's rows (CUDA-graph sizes):
        # the padding comes last.
        fits = isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and (
            int(tensor.shape[0]) == rows or (self.mtp and int(tensor.shape[0]) > rows))
        if not fits:
            self.recorder.count_lost(tap, rows, f"the {'eh_proj' if self.mtp else 'fc'} input was "
                                     f"{tuple(getattr(tensor, 'shape', ()))} where the drafter call had {rows} rows")
            return
        self._count(tap, rows)
        self.recorder.capture(tap, tensor[:rows], labels=labels)

    @staticmethod
    def _count(point: str, rows: int) -> None:
        info = _state.point(point)
        info["calls"] += 1
        info["rows"] += rows

    def publish(self, proposer: Any, runner: Any, hidden: torch.Tensor | None = None) -> None:
        """Provenance into the writer groups' meta, once the weights are loaded (first call); for an
        MTP drafter also the row model of its tap, from what the target hands it (``hidden``)."""
        draft = self.draft()
        if self.mtp:
            meta = mtp_provenance(proposer, runner, draft, self.info, hidden)
            self.recorder.meta["vllm"] = meta
            final_norm = meta["mtp"]["hidden_final_norm"] != "before"
            self.recorder.declare(MTP_TAP, row_model=mtp_row_model(final_norm=final_norm))
            for warning in meta.get("warnings", []):
                _log_once(f"warn:{warning}", logging.WARNING, "tracediff: vllm adapter: %s", warning)
            return
        meta = provenance(proposer, runner, draft, self.info)
        self.recorder.meta["vllm"] = meta
        canonical = canonical_aux_layers(meta)
        if canonical is not None:
            self.recorder.meta["aux_layers"] = canonical
        for warning in meta.get("warnings", []):
            _log_once(f"warn:{warning}", logging.WARNING, "tracediff: vllm adapter: %s", warning)


# ---------------------------------------------------------------------------------- process facts
def _records_this_rank(recorder: Recorder) -> bool:
    rank, size = _tp_rank()
    claim_rank(recorder, rank, size, "tp")
    if rank in (None, 0) or all_ranks_requested(ENV_ALL_RANKS):
        return True
    _log_once("rank", logging.INFO, "tracediff: vllm adapter: tensor-parallel rank %s not recorded (use --all-ranks)",
              rank)
    return False


def _tp_rank() -> tuple[int | None, int | None]:
    try:
        from vllm.distributed import parallel_state as ps  # noqa: PLC0415

        if ps.model_parallel_is_initialized():
            return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001
        pass
    return None, None


def commit_mode() -> str:
    """``"step"`` (default): each drafter call waits until its rows are committed, so the rows of every
    response a client received survive a SIGKILL of the worker; costs the write time of those rows per
    step. ``"background"``: the writer overlaps serving, at most BACKGROUND_BEHIND batches behind (a
    drafter call waits, at most COMMIT_TIMEOUT, when it is further behind); what it had not written
    when vLLM killed the worker is lost, and counted. From ``tracediff record --commit`` or
    ``TRACEDIFF_VLLM_COMMIT``."""
    mode = ""
    with contextlib.suppress(Exception):
        from tracediff.record.inject import current_config  # noqa: PLC0415

        mode = str(current_config().get("commit") or "")
    mode = mode or os.environ.get(ENV_COMMIT, "")
    return "background" if mode.strip().lower() == "background" else "step"


def _recorded_commit(config: Any) -> str:
    """The commit mode of a recording, from its config (`tracediff record` stores it in the store's
    ``meta.record``; in the recorded processes :func:`commit_mode` reads it)."""
    mode = config.get("commit") if isinstance(config, dict) else None
    return "background" if str(mode or "").strip().lower() == "background" else commit_mode()


def capture_summary() -> dict[str, dict[str, Any]]:
    """Per capture point of this process: attached hooks, calls, rows, skip reason."""
    return _state.summary()


def _report_at_exit() -> None:
    for name, info in _state.points.items():
        if info["attached"] and not info["calls"] and not info.get("unrecorded") and info["skipped"] is None:
            log.warning("tracediff: vllm adapter: %s was attached in pid %d but never fired: no request reached the "
                        "drafter", name, os.getpid())


# ------------------------------------------------------------------------ tracediff record, plugin
def record_warnings(command: Sequence[str], desc: dict[str, Any]) -> list[str]:
    """Warnings for the summary of ``tracediff record --adapter vllm -- CMD``."""
    argv = list(command)
    if not any("vllm" in a for a in argv):
        return []
    flag = command_flags(argv)
    rows = {tap: info.get("rows", 0) for tap, info in desc.get("taps", {}).items()}
    out: list[str] = []
    serving = any(a in ("serve", "vllm.entrypoints.openai.api_server") for a in argv)
    if serving and "--speculative-config" not in flag and "-sc" not in flag:
        out.append("vllm: the server runs no draft: add --speculative-config '{\"method\": \"eagle3\", \"model\": "
                   "DRAFT, \"num_speculative_tokens\": K}'")
        return out
    recorded = rows.get(FC_TAP) or rows.get(MTP_TAP) or rows.get(AUX_TAP)
    if not recorded:
        out.append("vllm: no drafter rows were recorded: did a request reach the server (tracediff send --engine "
                   "vllm)? is the draft an EAGLE-3 draft or an MTP head?")
    if serving and "--no-enable-prefix-caching" not in flag and recorded:
        out.append("vllm: prefix caching was on: prefixes already cached (shared prompts, re-sent sequences) are not "
                   "forwarded again and have no rows; add --no-enable-prefix-caching for full coverage")
    if serving and "--shutdown-timeout" not in flag and _recorded_commit((desc.get("meta") or {}).get("record")) == \
            "background":
        out.append("vllm: without --shutdown-timeout, vLLM kills its worker at once on SIGTERM, and with --commit "
                   "background the rows still in the writer queue then are lost: pass --shutdown-timeout 10")
    return out


def loss_advice(command: Sequence[str], config: dict[str, Any] | None = None) -> str:
    """What avoids losing the rows a worker had queued when vLLM killed it (for `tracediff record`'s
    error line, ``config`` its recording config): a graceful shutdown, or committing every step
    before vLLM returns its tokens."""
    argv = list(command)
    steps = ("record with --commit step (each drafter call's rows are committed before vLLM returns its tokens)"
             if _recorded_commit(config) == "background" else "")
    if "--shutdown-timeout" not in command_flags(argv):
        shutdown = "give the server --shutdown-timeout 10 (vLLM kills its worker at once on SIGTERM without it)"
        return f"{shutdown}, or {steps}" if steps else shutdown
    return steps or "stop the server with SIGTERM and let it end (a SIGKILL loses what the writer holds)"


def vllm_plugin() -> None:
    """Entry point of the ``vllm.general_plugins`` group: vLLM calls it in each of its processes.

    Does nothing unless ``TRACEDIFF_VLLM_STORE`` names a store (created on first use), so that an
    installed tracediff never records by surprise; nor under ``tracediff record``, which activates
    itself. ``TRACEDIFF_VLLM_ALL_RANKS=1`` records every tensor-parallel rank. Never raises.
    """
    activate_from_plugin("vllm", "vllm", vllm_version(), ENV_STORE, ENV_ALL_RANKS)
