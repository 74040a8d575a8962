"""The draft chain inside a vLLM 0.32 server: ``record --adapter vllm --draft-chain`` (docs/draft-chain.md).

Taps an EAGLE-3 draft (``Eagle3LlamaForCausalLM`` and its kin) at the chain points the trainer
adapters tap (:mod:`tracediff.adapters._chain`: the same tap names and ``chain`` attributes), each
row labelled like the fc rows of its drafter call (``SpecDecodeBaseProposer.propose``):

``draft_fc_out``
    ``model.fc``'s output, in ``combine_hidden_states`` (once a drafter call: step 0).
``draft_layer_in``
    ``cat(embed(input ids), hidden state)`` as the first decoder layer reads them before its norms,
    from the draft's ``forward`` arguments (the embedding looked up again through the draft's own
    ``embed_input_ids``, shared with the target or not; ``inputs_embeds`` when vLLM passes them; not
    under a vocab-parallel embedding, whose lookup is a collective: its rows are counted lost then).
``draft_layer_out`` / ``draft_norm_out``
    the draft model's two outputs: vLLM's decoder layer hands ``(mlp output, residual)`` on and the
    final norm adds them (fused norm + residual), returning ``(norm(x), x)``: ``x`` is the last layer's
    output, ``norm(x)`` what goes to ``compute_logits``. A draft with ``norm_output`` returns the
    normed state twice: no ``draft_layer_out`` then.
``draft_logits_topk``
    the draft vocabulary's logits out of its ``logits_processor`` (before ``compute_logits`` spreads
    them over the target vocabulary): top 8 values, draft ids, target ids by the draft's d2t offsets.
    At step 0 vLLM computes them on the sampled rows only (each request's last valid row: its prompt's
    end or past it, where no training row is); the adapter runs the same processor on every row's
    final norm output, so that step 0's logits pair with a trainer's row by row. Under a vocab-parallel
    lm_head (tensor parallel) that would need a collective: the sampled rows are recorded then.

Steps: each call of the draft's ``forward`` in one drafter call is the next step. Step 0 runs on every
row of the call: its rows carry the fc rows' labels. Step k >= 1 runs one row per request: position p + k
(p: the request's last valid row), token_id = the step's input token (the draft's own proposal of step
k - 1), labelled as ``draft_steps`` labels them. A server's step reads its own proposal (chain attribute
``step_inputs = "proposed"``), so compare pairs its steps >= 1 only with another server's.

These hooks run inside vLLM's step, outside the compiled draft model (the hooks sit on the draft's
outer module, which vLLM never compiles): no host sync, nothing recorded while a CUDA graph is being
captured, never a raise into vLLM (a row that cannot be recorded is counted lost).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tracediff.adapters._chain import PROPOSED, chain_attrs, declare_chain_tap, tap_name, topk_row
from tracediff.record.recorder import Recorder

log = logging.getLogger("tracediff")

#: Rows of step 0's logits computed at once (a chunk of ``[rows, draft vocabulary]`` logits).
LOGITS_ROWS = 1024
#: The draft's ``forward`` arguments, in order (``Eagle3LlamaForCausalLM.forward``).
FORWARD_ARGS = ("input_ids", "positions", "hidden_states", "inputs_embeds")


def _capturing(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class VllmChain:
    """The chain taps of one vLLM draft, fed per drafter call by the vLLM adapter: :meth:`begin` with the
    call's fc rows and labels (or why they are lost), :meth:`end` when the call returns."""

    def __init__(self, recorder: Recorder, draft: torch.nn.Module, fc: torch.nn.Module, hidden: int) -> None:
        self.recorder = recorder
        self.hidden = hidden
        owner = getattr(draft, "model", None)
        self.embed = getattr(owner, "embed_input_ids", None) or getattr(draft, "embed_input_ids", None)
        if getattr(getattr(owner, "embed_tokens", None), "tp_size", 1) != 1:
            # a vocab-parallel embedding all-reduces across ranks: called here on one rank, it would hang
            self.embed = None
        self.layer_out = not bool(getattr(owner, "norm_output", False))
        d2t = getattr(draft, "draft_id_to_target_id", None)
        self.d2t = d2t if isinstance(d2t, torch.Tensor) else None
        self.prefix = type(draft).__qualname__
        self.declared: set[str] = set()
        self.logged: set[str] = set()
        self.call: dict[str, Any] | None = None  # the drafter call running now
        recorder.declare("fc_in", chain=chain_attrs("fc_in", 0, PROPOSED))
        disable = getattr(getattr(torch, "compiler", None), "disable", None)

        def keep(fn: Callable[..., None]) -> Callable[..., None]:
            return disable(fn) if disable is not None else fn

        recorder.keep_handle(fc.register_forward_hook(keep(self._on_fc)))
        recorder.keep_handle(draft.register_forward_pre_hook(keep(self._on_forward_in), with_kwargs=True))
        recorder.keep_handle(draft.register_forward_hook(keep(self._on_forward_out)))
        processor = getattr(draft, "logits_processor", None)
        self.processor, self.lm_head = processor, getattr(draft, "lm_head", None)
        # Step 0's logits from every row (vLLM computes them on the sampled rows only): the draft's own
        # logits processor on each row's final norm output, where that is local (no vocab-parallel gather).
        self.dense_logits = isinstance(processor, torch.nn.Module) and isinstance(self.lm_head, torch.nn.Module) \
            and getattr(self.lm_head, "tp_size", 1) == 1
        self.computing = False  # the dense logits running through the processor's hook
        if isinstance(processor, torch.nn.Module):
            recorder.keep_handle(processor.register_forward_hook(keep(self._on_logits)))
        else:
            self._log_once("no-logits", "tracediff: vllm adapter: %s has no logits_processor; draft_logits_topk is not "
                           "recorded", self.prefix)

    # -- the drafter call (host thread, from the vLLM adapter)
    def begin(self, rows: int, labels: dict[str, Any] | None, draft: dict[str, Any] | None) -> None:
        """A drafter call starts: its ``rows`` fc rows and their ``labels``, the per-request context the
        adapter keeps for ``draft_steps`` (``draft``); ``labels`` None: the call's rows are not recorded
        (``draft["lost"]`` says why) and each chain tap counts its rows lost."""
        draft = draft or {}
        if labels is None or "lost" in draft:
            self.call = {"lost": str(draft.get("lost") or "not labelled"), "rows": rows, "n": 0, "step": -1}
            return
        self.call = {"rows": rows, "labels": labels, "n": int(draft.get("n") or 0), "seq": draft.get("seq"),
                     "pos0": draft.get("pos0"), "inputs": draft.get("inputs"), "last": draft.get("last"),
                     "call": draft.get("step"), "step": -1, "step_labels": labels}

    def end(self) -> None:
        self.call = None

    # -- hooks (inside the drafter call)
    def _on_fc(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        self._guard("fc output", lambda call: self._capture(call, "fc_out", "model.fc", output, call["rows"]), ("fc_out",))

    def _on_forward_in(self, _mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        call = self.call
        if call is None:
            return
        call["step"] += 1
        step = call["step"]
        bound = dict(zip(FORWARD_ARGS, args, strict=False)) | kwargs

        def body(call: dict[str, Any]) -> None:
            rows = call["rows"] if step == 0 else call["n"]
            if "lost" not in call and step > 0:
                ids = bound.get("input_ids")
                call["step_labels"] = {
                    "seq": call["seq"], "position": call["pos0"] + step,
                    "token_id": ids[:rows] if isinstance(ids, torch.Tensor) else -1,
                    "next_token_id": -1, "phase": "decode", "step": call["call"], "valid": True}
            hidden, embeds, ids = bound.get("hidden_states"), bound.get("inputs_embeds"), bound.get("input_ids")
            if "lost" in call or not isinstance(hidden, torch.Tensor):
                self._capture(call, "layer_in", "first decoder layer", None, rows)
                return
            if _capturing(hidden):
                return
            if not isinstance(embeds, torch.Tensor):
                embeds = self.embed(ids[:rows]) if self.embed is not None and isinstance(ids, torch.Tensor) else None
            if not isinstance(embeds, torch.Tensor):
                why = ("the draft's embedding is vocab-parallel (tensor parallel): looking it up again would need a "
                       "collective") if self.embed is None else "the draft's forward had no input_ids / inputs_embeds"
                self._capture(dict(call, lost=why), "layer_in", "first decoder layer", None, rows)
                return
            self._capture(call, "layer_in", "first decoder layer", torch.cat([embeds[:rows], hidden[:rows]], -1), rows,
                          fresh=True, dtype=_dtype(hidden))

        self._guard("draft forward input", body, ("layer_in",))

    def _on_forward_out(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        def body(call: dict[str, Any]) -> None:
            rows = call["rows"] if call["step"] == 0 else call["n"]
            normed, last = (output[0], output[1]) if isinstance(output, (tuple, list)) and len(output) > 1 else \
                (output, None)
            if self.layer_out:
                self._capture(call, "layer_out", "last decoder layer (the final norm's residual sum)", last, rows)
            self._capture(call, "norm_out", "model.norm", normed, rows)
            if call["step"] == 0 and self.dense_logits:
                self._dense_logits(call, normed, rows)

        self._guard("draft forward output", body, ("layer_out", "norm_out") if self.layer_out else ("norm_out",))

    def _dense_logits(self, call: dict[str, Any], normed: Any, rows: int) -> None:
        """Step 0's logits' top k at every row of the drafter call, as the trainer's are: the sampled rows
        alone (one a request, at its prompt's end or past it) would pair with no training row."""
        if "lost" in call or not isinstance(normed, torch.Tensor) or normed.dim() != 2 or normed.shape[0] < rows \
                or _capturing(normed):
            self._capture(call, "logits_topk", "lm_head", None, rows)
            return
        parts, dtype = [], "float32"
        self.computing = True
        try:
            for start in range(0, rows, LOGITS_ROWS):
                logits = self.processor(self.lm_head, normed[start:min(start + LOGITS_ROWS, rows)])
                dtype = _dtype(logits)
                parts.append(topk_row(logits, self.d2t))
        finally:
            self.computing = False
        self._capture(call, "logits_topk", "lm_head (its logits processor on every row)",
                      torch.cat(parts) if parts else None, rows, fresh=True, dtype=dtype,
                      top_k=int(parts[0].shape[-1] // 3) if parts else 0,
                      row_layout="values[k], draft ids[k], target ids[k] (draft id + d2t[draft id])",
                      d2t="offsets" if self.d2t is not None else "none")

    def _on_logits(self, _mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        if self.computing:
            return

        def body(call: dict[str, Any]) -> None:
            if "lost" in call and not call["n"] and isinstance(output, torch.Tensor) and output.dim() > 0:
                call["n"] = int(output.shape[0])  # one row per request: what the later steps run on
            if call["step"] == 0 and self.dense_logits:
                return  # recorded from every row with the final norm
            n = call["n"]
            if "lost" in call or not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] < n:
                self._capture(call, "logits_topk", "lm_head", None, n)
                return
            if _capturing(output):
                return
            labels = call["step_labels"]
            if call["step"] == 0:  # the sampled rows: each request's last valid row
                fc, last = call["labels"], call["last"]
                token = fc["token_id"][last] if isinstance(last, torch.Tensor) else -1
                labels = {"seq": call["seq"], "position": call["pos0"], "token_id": token,
                          "next_token_id": call["inputs"], "phase": fc.get("phase"), "step": call["call"],
                          "valid": True}
            self._capture(call, "logits_topk", "lm_head", topk_row(output[:n], self.d2t), n, labels=labels,
                          fresh=True, dtype=_dtype(output), top_k=min(8, output.shape[-1]),
                          row_layout="values[k], draft ids[k], target ids[k] (draft id + d2t[draft id])",
                          d2t="offsets" if self.d2t is not None else "none")

        self._guard("logits", body, ("logits_topk",))

    # -- recording
    def _capture(self, call: dict[str, Any], point: str, where: str, tensor: Any, rows: int, *,
                 labels: dict[str, Any] | None = None, fresh: bool = False, dtype: str | None = None,
                 **attrs: Any) -> None:
        step = max(call["step"], 0)
        name = tap_name(point, step)
        if isinstance(tensor, (tuple, list)):
            tensor = tensor[0] if tensor and isinstance(tensor[0], torch.Tensor) else None
        if "lost" in call:
            self.recorder.count_lost(name, rows, call["lost"])
            return
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[0] < rows:
            self.recorder.count_lost(name, rows, f"the draft's {point} was {tuple(getattr(tensor, 'shape', ()))} where "
                                     f"the step had {rows} rows")
            return
        if _capturing(tensor):
            return
        if name not in self.declared:  # declared on first use: the step count is known only as the draft runs
            declare_chain_tap(self.recorder, name, point, step, hidden=self.hidden, module=f"{self.prefix}.{where}",
                              step_inputs=PROPOSED, compute_dtype=dtype or _dtype(tensor), **attrs)
            self.declared.add(name)
        self.recorder.capture(name, tensor[:rows], labels=labels or call["step_labels"], fresh=fresh)

    def _guard(self, where: str, body: Callable[[dict[str, Any]], None], points: tuple[str, ...]) -> None:
        call = self.call
        if call is None:  # outside a labelled drafter call (warm-up, dummy runs): nothing is recorded
            return
        try:
            body(call)
        except Exception as exc:  # noqa: BLE001  (never raise into vLLM)
            why = f"not recorded after an error: {type(exc).__name__}: {exc}"
            self._log_once(f"error:{where}", "tracediff: vllm adapter: draft chain (%s) %s; serving goes on", where, why)
            step = max(call["step"], 0)
            for point in points:
                rows = call["n"] if step and point != "fc_out" else call["rows"]
                self.recorder.count_lost(tap_name(point, step), call["n"] if point == "logits_topk" else rows, why)

    def _log_once(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            log.warning(fmt, *args)


def attach_vllm_chain(recorder: Recorder, draft: torch.nn.Module, fc: torch.nn.Module) -> VllmChain | None:
    """The chain taps of an EAGLE-3 draft when the recorder asks for them (``record --draft-chain``);
    None otherwise, or when this draft cannot be tapped (logged). Never raises."""
    if not getattr(recorder, "draft_chain", False):
        return None
    try:
        hidden = getattr(fc, "output_size", None) or getattr(fc, "out_features", None) or \
            getattr(getattr(draft, "config", None), "hidden_size", None)
        if not isinstance(hidden, int):
            raise AttributeError("the draft's hidden size (fc output size) is unknown")
        return VllmChain(recorder, draft, fc, hidden)
    except Exception as exc:  # noqa: BLE001
        log.warning("tracediff: vllm adapter: the draft chain of %s is not recorded (%s: %s); serving goes on",
                    type(draft).__qualname__, type(exc).__name__, exc)
        return None
