"""SGLang graph replays: the rows of forwards SGLang replays from a captured graph, recorded from the
tensors the graph runner receives and returns.

A replayed forward (target decode / verify in ``DecodeCudaGraphRunner``, the draft's extend in
``EAGLEDraftExtendCudaGraphRunner``, piecewise prefill in ``PrefillCudaGraphRunner``; ``CudaGraphRunner``
and ``replay`` on older versions) runs no Python module hook. Each runner's ``execute`` is wrapped,
once per class, and reads:

``aux_hidden`` (target runners)
    the ``hidden_states`` of the ``LogitsProcessorOutput`` the replay returns: SGLang's packed aux
    concatenation when the target captures aux states, already cut to the batch's real rows by the
    runner (rows past ``forward_batch.input_ids`` are padding and are cut here too). Labelled by the
    hook path's own function, with the replayed ``ForwardBatch``.
``fc_in`` (draft runners)
    ``forward_batch.spec_info.hidden_states`` going into the replay when it is as wide as the draft's
    fc input: the rows the graph copies into its buffer and feeds ``fc``. Labels are read before the
    replay (the runner rebinds ``spec_info`` fields to its padded buffers). With ``norm_before_fc`` /
    ``fc_norm`` the normed fc input stays inside the graph: ``fc_in_raw`` is recorded, ``fc_in``'s
    rows are counted lost.

One path per forward: when the module hooks fired during the wrapped call (an eager fallback, a
piecewise graph that runs the logits processor eagerly), the replay path records nothing. Nothing is
recorded while a graph is being captured. Nothing here may raise into SGLang: a failure stops the
replay path for that tap, logged once, and its rows are counted lost. SGLang is imported only when a
capture point attaches (inside a server it is already loaded).
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tracediff.adapters.sglang_labels import capturing_graph, draft_labels, mode_name
from tracediff.adapters.sglang_provenance import publish_meta, target_provenance
from tracediff.record.recorder import Recorder

log = logging.getLogger("tracediff")

HOOK_PATH = "module_hook"
GRAPH_PATH = "graph_replay"
#: (module, class, method) of the runners whose calls replay a graph; absent ones are skipped.
RUNNERS: tuple[tuple[str, str, str], ...] = (
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner", "execute"),
    ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner", "PrefillCudaGraphRunner", "execute"),
    ("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner", "EAGLEDraftExtendCudaGraphRunner", "execute"),
    ("sglang.srt.model_executor.cuda_graph_runner", "CudaGraphRunner", "replay"),  # older versions
    ("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner", "EAGLEDraftExtendCudaGraphRunner", "replay"),
)
_WRAPPED = "_tracediff_graph_replay"
#: Said with every row the replay path loses, so that `tracediff record` names the flag only for them.
LOST_HINT = "inside a graph replay; --disable-cuda-graph records them from the module hooks"

TargetRows = Callable[[Recorder, torch.Tensor, Any, "torch.Tensor | None", "torch.nn.Module | None"], None]


@dataclass
class _Draft:
    fc_tap: str
    raw_tap: str | None  # set when norm_before_fc / fc_norm make the fc input differ from the raw rows
    width: int  # spec_info.hidden_states width of a draft-extend forward
    exposed: bool = True  # False: the fc input is built inside the graph (an MTP head's eh_proj input)


@dataclass
class GraphReplays:
    """Per process: which recorders read replays, and what the hook path does with target rows."""

    state: Any
    aux_tap: str = "aux_hidden"
    targets: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    drafts: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    target_rows: TargetRows | None = None
    aux_width: int | None = None

    def add_target(self, recorder: Recorder, tap: str, target_rows: TargetRows) -> None:
        self.aux_tap, self.target_rows = tap, target_rows
        self.targets[recorder] = True
        recorder.declare(tap, capture_path=_capture_path("LogitsProcessor forward pre-hook (aux_hidden_states)",
                                                         "hidden_states of the LogitsProcessorOutput a target "
                                                         "graph replay returns"))

    def add_draft(self, recorder: Recorder, fc_tap: str, raw_tap: str | None, width: int, *, mtp: bool = False) -> None:
        """``mtp``: an MTP head, whose ``eh_proj`` input (``cat(enorm(embed), hnorm(h))``) is built inside the graph."""
        self.drafts[recorder] = _Draft(fc_tap, raw_tap, width, exposed=not mtp)
        replay = "forward_batch.spec_info.hidden_states going into a draft-extend graph replay"
        if mtp:
            replay = "not exposed (eh_proj's input is built inside the graph): counted lost"
        elif raw_tap is not None:
            replay = "not exposed (normed inside the graph): counted lost, the raw rows in " + raw_tap
        recorder.declare(fc_tap, capture_path=_capture_path("forward pre-hook of the draft's fc", replay))
        if raw_tap is not None:
            recorder.declare(raw_tap, capture_path=_capture_path(
                "forward pre-hook of the draft's fc owner",
                "forward_batch.spec_info.hidden_states going into a draft-extend graph replay"))


def _capture_path(hook: str, replay: str) -> dict[str, str]:
    return {HOOK_PATH: hook, GRAPH_PATH: replay, "rule": "one path per forward: eager forwards by the module "
            "hooks, replayed forwards (which run no hooks) by the graph runner's tensors"}


_registry: Callable[[], GraphReplays | None] = lambda: None  # noqa: E731  (set by install_replay_wrappers)


def install_replay_wrappers(registry: Callable[[], GraphReplays | None]) -> int:
    """Wrap every graph runner class this SGLang has (once per class); the wrappers find the current
    recorders through ``registry``. Returns how many methods are wrapped now. Never raises."""
    global _registry
    _registry = registry
    wrapped = 0
    for module_name, class_name, method in RUNNERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except Exception:  # noqa: BLE001, S112  (not in this version)
            continue
        original = cls.__dict__.get(method) if cls is not None else None
        if original is None:
            continue
        if not getattr(original, _WRAPPED, False):
            setattr(cls, method, _wrap(original))
        wrapped += 1
    return wrapped


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute(runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        plan = _before(runner, forward_batch)
        output = original(runner, forward_batch, *args, **kwargs)
        if plan is not None:
            _after(plan, output)
        return output

    setattr(execute, _WRAPPED, True)
    return execute


@dataclass
class _Plan:
    replays: GraphReplays
    runner: Any
    batch: Any
    draft: bool
    before: tuple[int, ...]  # the hook path's counters: moved during the call = the hooks recorded it
    captures: list[tuple[Recorder, _Draft, torch.Tensor, dict[str, Any]]] = field(default_factory=list)


def _before(runner: Any, batch: Any) -> _Plan | None:
    replays = _registry()
    if replays is None or not (replays.targets or replays.drafts):
        return None
    draft = False
    try:
        input_ids = getattr(batch, "input_ids", None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.numel() == 0 or capturing_graph(input_ids):
            return None
        draft = bool(getattr(getattr(runner, "model_runner", None), "is_draft_worker", False)) or \
            type(runner).__name__.startswith("EAGLEDraftExtend")
        state = replays.state
        if not draft:
            return _Plan(replays, runner, batch, False, (state.step,)) if replays.targets else None
        hidden = getattr(getattr(batch, "spec_info", None), "hidden_states", None)
        if mode_name(batch) in ("DECODE", "IDLE") or not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] == 0:
            return None
        taps = [(rec, d) for rec, d in list(replays.drafts.items()) if d.width == hidden.shape[-1] and rec.enabled]
        if not taps:
            return None  # draft decode: fc is not applied to these rows
        first = taps[0][1]
        plan = _Plan(replays, runner, batch, True, _draft_counters(state, first))
        if state.point(first.fc_tap)["skipped"] is not None:
            return None  # the hook path counts what it cannot record; this path stops with it
        rows = int(hidden.shape[0])
        labels = draft_labels(state, batch, input_ids, getattr(batch, "positions", None), rows)
        plan.captures = [(rec, d, hidden, labels) for rec, d in taps]
        return plan
    except Exception as exc:  # noqa: BLE001  (never raise into SGLang)
        drafts = list(replays.drafts.values())
        _stop(replays, drafts[0].fc_tap if draft and drafts else replays.aux_tap, exc, batch)
        return None


def _draft_counters(state: Any, draft: _Draft) -> tuple[int, ...]:
    return (state.point(draft.fc_tap)["calls"], state.point(draft.raw_tap)["calls"] if draft.raw_tap else 0)


def _after(plan: _Plan, output: Any) -> None:
    replays = plan.replays
    try:
        if plan.draft:
            if _draft_counters(replays.state, plan.captures[0][1]) == plan.before:
                _record_draft(plan)
        elif replays.state.step == plan.before[0]:
            _record_target(plan, output)
    except Exception as exc:  # noqa: BLE001
        _stop(replays, plan.captures[0][1].fc_tap if plan.draft else replays.aux_tap, exc, plan.batch)


def _record_target(plan: _Plan, output: Any) -> None:
    replays, batch = plan.replays, plan.batch
    input_ids = batch.input_ids
    rows = int(input_ids.shape[0])
    model = getattr(getattr(plan.runner, "model_runner", None), "model", None)
    if replays.aux_width is None:
        facts = target_provenance(model)
        ltc, hidden = facts.get("layers_to_capture"), facts.get("hidden_size")
        if isinstance(ltc, list) and ltc and isinstance(hidden, int):
            replays.aux_width = len(ltc) * hidden
    aux = getattr(output, "hidden_states", None)
    ok = isinstance(aux, torch.Tensor) and aux.dim() == 2 and aux.shape[0] >= rows and \
        replays.aux_width is not None and aux.shape[-1] == replays.aux_width
    info = replays.state.point(replays.aux_tap)
    for recorder in list(replays.targets):
        before = info["rows"]
        # Steps and the draft's first tokens advance as in the hook path, rows or not (after an error there,
        # the rows are counted lost).
        assert replays.target_rows is not None
        replays.target_rows(recorder, input_ids, batch, aux[:rows] if ok else None, model)
        info[f"{GRAPH_PATH}_rows"] = info.get(f"{GRAPH_PATH}_rows", 0) + info["rows"] - before
        if not ok and replays.aux_width is not None and recorder.enabled and info["skipped"] is None:
            shape = "none" if not isinstance(aux, torch.Tensor) else f"shape {tuple(aux.shape)}"
            recorder.count_lost(replays.aux_tap, rows, f"the target's aux states stayed {LOST_HINT} (the replay "
                                f"returned hidden_states {shape}, not [{rows}, {replays.aux_width}])")


def _record_draft(plan: _Plan) -> None:
    state = plan.replays.state
    for recorder, draft, hidden, labels in plan.captures:
        rows = int(hidden.shape[0])
        first = not state.point(draft.fc_tap)["calls"] and not (draft.raw_tap and state.point(draft.raw_tap)["calls"])
        if first:
            publish_meta(state, recorder)
        tap = draft.raw_tap or (draft.fc_tap if draft.exposed else None)
        if tap is not None:
            info = state.point(tap)
            info["calls"] += 1
            info["rows"] += rows
            info[f"{GRAPH_PATH}_rows"] = info.get(f"{GRAPH_PATH}_rows", 0) + rows
            recorder.capture(tap, hidden, labels=labels)
        if draft.raw_tap:
            recorder.count_lost(draft.fc_tap, rows, f"the fc input after norm_before_fc / fc_norm stays {LOST_HINT} "
                                f"({draft.raw_tap} holds the raw rows)")
        elif not draft.exposed:
            recorder.count_lost(draft.fc_tap, rows, f"the eh_proj input cat(enorm(embed), hnorm(h)) stays {LOST_HINT}")


def _stop(replays: GraphReplays, tap: str, exc: BaseException, batch: Any) -> None:
    """The replay path fails for ``tap``: stop it (logged once), count this forward's rows lost."""
    reason = f"{type(exc).__name__}: {exc}"
    replays.state.skip(tap, reason, "tracediff: sglang adapter: %s graph-replay rows not recorded: %s (SGLang "
                       "internals moved? the server goes on)", tap, reason)
    try:
        rows = int(batch.input_ids.shape[0])
        for recorder in list(replays.drafts if tap != replays.aux_tap else replays.targets):
            recorder.count_lost(tap, rows, f"not recorded after an error: {reason}")
    except Exception:  # noqa: BLE001, S110  (counting is best effort)
        pass
