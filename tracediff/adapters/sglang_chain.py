"""The draft chain inside an SGLang 0.5.23 server: ``record --adapter sglang --draft-chain`` (docs/draft-chain.md).

Taps the EAGLE-3 draft ``LlamaForCausalLMEagle3`` (``sglang/srt/models/llama_eagle3.py``) at the chain
points the trainer adapters tap (:mod:`tracediff.adapters._chain`: the same tap names and ``chain``
attributes, ``step_inputs = "proposed"``):

``draft_fc_out``
    ``model.fc``'s output (draft-extend forwards only: SGLang applies ``fc`` where
    ``spec_info.hidden_states`` is ``fc.in_features`` wide).
``draft_layer_in``
    ``cat(embeds, hidden_states)`` as the first decoder layer receives them, before its
    ``input_layernorm`` / ``hidden_norm`` (``LlamaDecoderLayer.forward(positions, embeds, hidden_states,
    forward_batch, residual)``): the embedding of the draft's input token and the fc output (step 0) or
    the hidden state SGLang recycles from the previous draft forward (steps >= 1).
``draft_layer_out`` / ``draft_norm_out``
    the draft's final norm's two outputs: SGLang's decoder layer hands ``(mlp output, residual)`` on and
    ``model.norm(hidden_states, residual)`` adds them and returns ``(norm(x), x)``: ``x`` is the last
    layer's output, ``norm(x)`` what goes to the lm_head.
``draft_logits_topk``
    top 8 of the draft vocabulary's logits: values, draft ids, target ids by SGLang's ``hot_token_id``
    map (``d2t`` + arange; stored as the offsets ``hot_token_id - arange``). At step 0 SGLang's logits
    processor computes the last row of each request only; the adapter applies the draft's lm_head
    (``logit_scale`` and final softcapping as the processor applies them) to every row's final norm
    output, so that step 0's logits pair with a trainer's row by row. A vocab-parallel or quantised
    lm_head cannot be applied so: step 0's logits are then counted lost. Steps >= 1: the processor's
    ``next_token_logits``, one row per decode row.

Steps: the draft-extend forward (after a prefill, ``DRAFT_EXTEND_V2`` after a verify) is step 0, its
rows labelled as the fc rows (:func:`tracediff.adapters.sglang_labels.draft_labels`, handed over by the
sglang adapter). Each draft decode forward that follows (``EAGLEWorkerV2.draft_forward``: ``num_steps -
1`` of them a round) is the next step k: ``bs * topk`` rows, request-major, each a node of the draft
tree (with ``topk == 1`` one row per request); labelled ``seq`` = the request id, ``position`` = the
position SGLang gives the row (its RoPE position), ``token_id`` = the row's input token (a proposal of
step k - 1), ``next_token_id`` = -1, ``phase`` = decode, ``step`` = the scheduler iteration. With
``topk > 1`` several rows of a step share (seq, position) with different tokens; the tap's
``rows_per_request`` attribute says how many.

CUDA graphs: this is a module-hook path. A draft decode forward replayed from a captured graph
(``EAGLEDraftCudaGraphRunner``) runs no hook: the chain's steps >= 1 are then not recorded (nor counted:
nothing runs that could count them); a draft-extend replay records ``fc_in`` through the graph path
(:mod:`tracediff.adapters.sglang_graphs`) but none of the chain's step-0 taps. Each tap says so in its
``graph_replay`` attribute and ``record`` names ``--disable-cuda-graph`` in its summary.

Never raises into SGLang (a row that cannot be recorded is counted lost), records nothing while a CUDA
graph is being captured, never imports SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tracediff.adapters._chain import PROPOSED, chain_attrs, declare_chain_tap, tap_name, topk_row
from tracediff.adapters.sglang_labels import HEALTH_CHECK_PREFIX, capturing_graph, request_keys
from tracediff.adapters.sglang_provenance import server_args
from tracediff.record.recorder import Recorder

log = logging.getLogger("tracediff")

#: Rows of step 0's logits computed at once (a chunk of ``[rows, draft vocabulary]`` logits).
LOGITS_ROWS = 1024
#: ``LlamaDecoderLayer.forward``'s arguments, in order.
LAYER_ARGS = ("positions", "embeds", "hidden_states", "forward_batch", "residual")
#: ``LlamaModel.forward``'s arguments, in order.
OWNER_ARGS = ("input_ids", "positions", "forward_batch", "input_embeds")
GRAPH_NOTE = ("module hooks: forwards replayed from a CUDA graph are not recorded (draft decode: steps >= 1; "
              "draft extend: the step-0 chain taps); --disable-cuda-graph records them")
#: Said in record's summary when the chain was recorded with CUDA graphs on.
GRAPH_WARNING = ("sglang: the draft chain is recorded by module hooks, which CUDA-graph replays do not run: draft "
                 "decode forwards (steps >= 1) and draft extends replayed from a graph have no chain rows (not "
                 "counted); add --disable-cuda-graph to record every step")


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _capturing(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and capturing_graph(tensor)


def _bound(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    return dict(zip(names, args, strict=False)) | kwargs


class SglangChain:
    """The chain taps of one SGLang EAGLE-3 draft. The sglang adapter hands each draft-extend forward's fc
    labels over (:meth:`extend_labels`); draft decode forwards are labelled here from their batch."""

    def __init__(self, recorder: Recorder, state: Any, draft: torch.nn.Module, owner: torch.nn.Module,
                 fc: torch.nn.Module) -> None:
        self.recorder, self.state, self.draft = recorder, state, draft
        self.in_width = int(fc.in_features)
        self.hidden = int(fc.out_features)
        layers = getattr(owner, "layers", None)
        norm = getattr(owner, "norm", None)
        if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not isinstance(norm, torch.nn.Module):
            raise AttributeError(f"{type(owner).__qualname__} has no layers / norm")
        args = server_args()
        self.num_steps = args.get("speculative_num_steps") if isinstance(args.get("speculative_num_steps"), int) \
            else None
        self.topk = args.get("speculative_eagle_topk") if isinstance(args.get("speculative_eagle_topk"), int) else None
        self.prefix = type(draft).__qualname__
        self.processor = getattr(draft, "logits_processor", None)
        self.declared: set[str] = set()
        self.logged: set[str] = set()
        self.pending: dict[str, Any] | None = None  # the fc labels of the draft-extend forward starting now
        self.decode_step = 0
        self.call: dict[str, Any] | None = None  # the draft forward running now
        self.hot: tuple[int, torch.Tensor | None] | None = None
        recorder.declare("fc_in", chain=chain_attrs("fc_in", 0, PROPOSED), graph_replay=GRAPH_NOTE)
        hooks = (
            owner.register_forward_pre_hook(self._on_owner, with_kwargs=True),
            fc.register_forward_hook(self._on_fc),
            layers[0].register_forward_pre_hook(self._on_layer_in, with_kwargs=True),
            norm.register_forward_hook(self._on_norm),
            draft.register_forward_hook(self._on_draft_out),
        )
        for handle in hooks:
            recorder.keep_handle(handle)
        if isinstance(self.processor, torch.nn.Module):
            recorder.keep_handle(self.processor.register_forward_hook(self._on_logits))

    # -- from the sglang adapter (its draft owner pre-hook, which runs before this module's)
    def extend_labels(self, labels: dict[str, Any] | None) -> None:
        """The labels of the fc rows of the draft-extend forward starting now (None: not labelled)."""
        self.pending = labels

    # -- hooks
    def _on_owner(self, _mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pending, self.pending, self.call = self.pending, None, None
        if not self.recorder.enabled:
            return
        try:
            bound = _bound(OWNER_ARGS, args, kwargs)
            batch = bound.get("forward_batch")
            hidden = getattr(getattr(batch, "spec_info", None), "hidden_states", None)
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.shape[0] or _capturing(hidden):
                return
            rows = int(hidden.shape[0])
            if hidden.shape[-1] == self.in_width:  # draft extend: fc runs
                self.decode_step = 0
                self.call = {"step": 0, "rows": rows, "labels": pending} if pending is not None else \
                    {"step": 0, "rows": rows, "lost": "the draft-extend forward's rows were not labelled (fc_in was "
                                                      "not recorded)"}
            elif hidden.shape[-1] == self.hidden:  # draft decode: the recycled hidden state
                self.decode_step += 1
                if self.num_steps is not None and self.num_steps > 1 and self.decode_step > self.num_steps - 1:
                    self.decode_step = 1  # a round whose draft extend ran no hook (replayed from a graph)
                self.call = {"step": self.decode_step, "rows": rows}
                self.call["labels"], self.call["per"] = self._decode_labels(batch, bound, rows)
        except Exception as exc:  # noqa: BLE001  (never raise into SGLang)
            self._log_once("labels", "tracediff: sglang adapter: draft chain labels not read (%s: %s); those rows "
                           "are counted lost, serving goes on", type(exc).__name__, exc)
            if self.call is not None:
                self.call["lost"] = f"not labelled after an error: {type(exc).__name__}: {exc}"

    def _decode_labels(self, batch: Any, bound: dict[str, Any], rows: int) -> tuple[dict[str, Any], int]:
        """One row per request and tree node (request-major, ``rows // batch_size`` a request)."""
        ids, positions = bound.get("input_ids"), bound.get("positions")
        if not isinstance(ids, torch.Tensor) or ids.numel() < rows:
            ids = getattr(batch, "input_ids", None)
        if not isinstance(positions, torch.Tensor) or positions.numel() < rows:
            positions = getattr(batch, "positions", None)
        if not isinstance(ids, torch.Tensor) or not isinstance(positions, torch.Tensor) or ids.numel() < rows \
                or positions.numel() < rows:
            raise ValueError(f"the draft decode forward's input_ids / positions do not hold its {rows} rows")
        bs = getattr(batch, "batch_size", None)
        keys = request_keys(batch)
        if not isinstance(bs, int) or bs <= 0 or rows % bs or keys is None or len(keys) < bs:
            raise ValueError(f"{rows} draft decode rows are not a whole number per request of {bs} requests")
        per = rows // bs
        seq = np.repeat(np.asarray(keys[:bs], dtype=object), per)
        probe = np.fromiter((k.startswith(HEALTH_CHECK_PREFIX) for k in seq), dtype=bool, count=seq.size)
        valid: Any = True if not probe.any() else torch.from_numpy(~probe).to(ids.device)
        return {"seq": seq, "position": positions.reshape(-1)[:rows], "token_id": ids.reshape(-1)[:rows].long(),
                "next_token_id": -1, "phase": "decode", "step": max(int(self.state.step), 0), "valid": valid}, per

    def _on_fc(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        self._guard("fc output", ("fc_out",), lambda call: self._capture(call, "fc_out", "model.fc", output))

    def _on_layer_in(self, _mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        def body(call: dict[str, Any]) -> None:
            bound = _bound(LAYER_ARGS, args, kwargs)
            embeds, hidden = bound.get("embeds"), bound.get("hidden_states")
            rows = call["rows"]
            if not isinstance(embeds, torch.Tensor) or not isinstance(hidden, torch.Tensor) or _capturing(hidden) \
                    or embeds.shape[0] < rows or hidden.shape[0] < rows:
                self._capture(call, "layer_in", "model.layers[0] (embeds, hidden_states)", None)
                return
            self._capture(call, "layer_in", "model.layers[0] (embeds, hidden_states)",
                          torch.cat([embeds[:rows], hidden[:rows]], -1), fresh=True, dtype=_dtype(hidden))

        self._guard("decoder layer input", ("layer_in",), body)

    def _on_norm(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        def body(call: dict[str, Any]) -> None:
            normed, last = (output[0], output[1]) if isinstance(output, (tuple, list)) and len(output) > 1 else \
                (output, None)
            self._capture(call, "layer_out", "last decoder layer (model.norm's residual sum)", last)
            self._capture(call, "norm_out", "model.norm", normed)
            if call["step"] == 0:
                self._dense_logits(call, normed)

        points = ("layer_out", "norm_out", "logits_topk") if self.call is not None and self.call["step"] == 0 else \
            ("layer_out", "norm_out")
        self._guard("final norm", points, body)

    def _on_logits(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        def body(call: dict[str, Any]) -> None:
            if call["step"] == 0:
                return  # recorded from every row with the final norm
            logits = getattr(output, "next_token_logits", output)
            rows = call["rows"]
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] < rows:
                self._capture(call, "logits_topk", "logits_processor (next_token_logits)", None)
                return
            self._capture(call, "logits_topk", "logits_processor (next_token_logits)",
                          topk_row(logits[:rows], self._d2t()), fresh=True, dtype=_dtype(logits),
                          **self._logits_attrs(logits))

        self._guard("logits", ("logits_topk",), body)

    def _on_draft_out(self, _mod: torch.nn.Module, _args: tuple, _output: Any) -> None:
        self.call = None

    # -- logits
    def _d2t(self) -> torch.Tensor | None:
        """SGLang's ``hot_token_id`` (draft id -> target id, set by ``load_weights`` from ``d2t``) as the
        offsets ``topk_row`` reads; None for a draft that predicts target ids."""
        hot = getattr(self.draft, "hot_token_id", None)
        if not isinstance(hot, torch.Tensor):
            return None
        if self.hot is None or self.hot[0] != id(hot):
            self.hot = (id(hot), hot.long() - torch.arange(hot.shape[0], device=hot.device))
        return self.hot[1]

    def _logits_attrs(self, logits: torch.Tensor) -> dict[str, Any]:
        return {"top_k": min(8, int(logits.shape[-1])),
                "row_layout": "values[k], draft ids[k], target ids[k] (draft id + d2t[draft id])",
                "d2t": "offsets (SGLang's hot_token_id - arange)" if self._d2t() is not None else "none"}

    def _dense_logits(self, call: dict[str, Any], normed: Any) -> None:
        """Step 0's top k at every row: the draft's lm_head applied as its logits processor applies it."""
        rows = call["rows"]
        head = getattr(self.draft, "lm_head", None)
        weight = getattr(head, "weight", None)
        vocab = getattr(getattr(self.processor, "config", None), "vocab_size", None)
        if "lost" in call or not isinstance(normed, torch.Tensor) or normed.dim() != 2 or normed.shape[0] < rows \
                or _capturing(normed):
            self._capture(call, "logits_topk", "lm_head", None)
            return
        vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[-1] != normed.shape[-1] \
                or not weight.is_floating_point() or getattr(head, "tp_size", 1) != 1 \
                or (vocab is not None and weight.shape[0] < vocab):
            self.recorder.count_lost(tap_name("logits_topk", 0), rows, "the draft's lm_head is vocab-parallel or "
                                     "quantised: step 0's logits at every row are not computed")
            return
        weight = weight[:vocab] if vocab is not None else weight  # SGLang pads the vocabulary to a multiple of 64
        scale = getattr(self.processor, "logit_scale", None)
        cap = getattr(self.processor, "final_logit_softcapping", None)
        parts = []
        logits = normed[:0]
        for start in range(0, rows, LOGITS_ROWS):
            logits = torch.nn.functional.linear(normed[start:min(start + LOGITS_ROWS, rows)], weight)
            if scale is not None:
                logits = logits * scale
            if cap:
                logits = cap * torch.tanh(logits / cap)
            parts.append(topk_row(logits, self._d2t()))
        self._capture(call, "logits_topk", "lm_head (applied to every row's final norm output)", torch.cat(parts),
                      fresh=True, dtype=_dtype(logits), **self._logits_attrs(logits))

    # -- recording
    def _capture(self, call: dict[str, Any], point: str, where: str, tensor: Any, *, fresh: bool = False,
                 dtype: str | None = None, **attrs: Any) -> None:
        step, rows = call["step"], call["rows"]
        name = tap_name(point, step)
        if "lost" in call:
            self.recorder.count_lost(name, rows, call["lost"])
            return
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[0] < rows:
            self.recorder.count_lost(name, rows, f"the draft's {point} was {tuple(getattr(tensor, 'shape', ()))} "
                                     f"where the forward had {rows} rows")
            return
        if _capturing(tensor):
            return
        if name not in self.declared:  # declared on first use: the step count is known only as the draft runs
            extra: dict[str, Any] = {"rows_per_request": call.get("per"), "topk": self.topk} if step else {}
            declare_chain_tap(self.recorder, name, point, step, hidden=self.hidden, module=f"{self.prefix}.{where}",
                              step_inputs=PROPOSED, compute_dtype=dtype or _dtype(tensor), graph_replay=GRAPH_NOTE,
                              **extra, **attrs)
            self.declared.add(name)
        self.recorder.capture(name, tensor[:rows], labels=call["labels"], fresh=fresh)

    def _guard(self, where: str, points: tuple[str, ...], body: Callable[[dict[str, Any]], None]) -> None:
        call = self.call
        if call is None or not self.recorder.enabled:  # outside a draft forward this chain began
            return
        try:
            body(call)
        except Exception as exc:  # noqa: BLE001  (never raise into SGLang)
            why = f"not recorded after an error: {type(exc).__name__}: {exc}"
            self._log_once(f"error:{where}", "tracediff: sglang adapter: draft chain (%s) %s; serving goes on",
                           where, why)
            for point in points:
                self.recorder.count_lost(tap_name(point, call["step"]), call["rows"], why)

    def _log_once(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            log.warning(fmt, *args)


def attach_sglang_chain(recorder: Recorder, state: Any, draft: torch.nn.Module, owner: torch.nn.Module,
                        fc: torch.nn.Module) -> SglangChain | None:
    """The chain taps of an EAGLE-3 draft when the recorder asks for them (``record --draft-chain``); None
    otherwise, or when this draft cannot be tapped (logged: an MLA draft, a class whose layout moved).
    ``state``: the sglang adapter's process state (its ``step``). Never raises."""
    if not getattr(recorder, "draft_chain", False):
        return None
    try:
        if not isinstance(getattr(fc, "in_features", None), int) or not isinstance(getattr(fc, "out_features", None),
                                                                                  int):
            raise AttributeError("fc is not an nn.Linear")
        return SglangChain(recorder, state, draft, owner, fc)
    except Exception as exc:  # noqa: BLE001
        log.warning("tracediff: sglang adapter: the draft chain of %s is not recorded (%s: %s); serving goes on",
                    type(draft).__qualname__, type(exc).__name__, exc)
        return None


def chain_warnings(taps: Any, graphs: bool) -> list[str]:
    """record's summary: a chain recorded with CUDA graphs on misses every replayed forward."""
    if graphs and any(str(tap).startswith("draft_") for tap in taps):
        return [GRAPH_WARNING]
    return []
