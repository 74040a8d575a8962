"""The draft chain: taps along one EAGLE-3 draft forward, in forward order, each step labelled.

What the trainer adapters share for ``record --draft-chain`` (docs/draft-chain.md). An adapter names
its framework's modules (which ``fc``, which decoder layers, which norm and head); this module hooks
them and stores, with every tap, where it sits in the forward::

    chain = {"name": "draft", "point": "layer_out", "order": 3, "step": 0}

so that compare walks both sides' taps in forward order. Tap names: ``draft_<point>`` for step 0,
``draft_<point>_s<step>`` for the later steps of a multi-step draft (``fc_in`` keeps its name: the
fc-input tap every trainer adapter records). The logits are stored as their top k only (values, draft
ids, and the ids the d2t map gives), never the whole vocabulary.

The hooks run inside the trainer's forward: no host synchronisation, never a raise (a failure stops
that tap through ``Recorder.fail``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tracediff.record.recorder import Recorder

CHAIN = "draft"
#: The chain's points in forward order (fc_in is the fc-input tap every trainer adapter declares).
POINTS = ("fc_in", "fc_out", "layer_in", "layer_out", "norm_out", "logits_topk")
#: How many logits a row of ``logits_topk`` keeps.
TOP_K = 8


def tap_name(point: str, step: int) -> str:
    """The tap of ``point`` at draft step ``step`` (``draft_layer_out``, ``draft_layer_out_s1``)."""
    if point == "fc_in":
        return "fc_in"
    return f"{CHAIN}_{point}" + (f"_s{step}" if step else "")


#: How a draft step >= 1 reads its input (the ``step_inputs`` of a tap's chain attribute): a trainer's
#: step s is teacher forced (the data's next token, its hidden state recycled from its own step s-1 at
#: every position), a server's step k reads its own proposal of step k-1. compare pairs steps >= 1 only
#: between sides that read the same.
TEACHER_FORCED, PROPOSED = "teacher_forced", "proposed"


def chain_attrs(point: str, step: int, step_inputs: str = TEACHER_FORCED, **extra: Any) -> dict[str, Any]:
    """The ``chain`` attribute of one tap: where it sits in the draft's forward, how its steps read input."""
    return {"name": CHAIN, "point": point, "order": POINTS.index(point), "step": int(step),
            "step_inputs": step_inputs, **extra}


def declare_chain_tap(recorder: Recorder, name: str, point: str, step: int, *, hidden: int, module: str,
                      compute_dtype: str, step_inputs: str = TEACHER_FORCED, **attrs: Any) -> None:
    """Declare one chain tap (on its first rows: a draft's step count is known only as it runs): its
    width in segments of ``hidden`` (the logits' top k are one row of values and ids), the decoder
    layer input's two halves, where it sits in the forward, the dtype the draft computed it in."""
    recorder.declare(name, segment_size=hidden if point != "logits_topk" else None, module=module,
                     segment_labels=["embedding", "hidden_state"] if point == "layer_in" else None,
                     chain=chain_attrs(point, step, step_inputs), compute_dtype=compute_dtype, **attrs)


class DraftSteps:
    """Which step of a multi-step draft forward is running: reset when ``fc`` runs (once a forward,
    before any decoder layer), advanced each time the first decoder layer is entered."""

    def __init__(self) -> None:
        self.step = -1

    def reset(self) -> None:
        self.step = -1

    def advance(self) -> None:
        self.step += 1


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _hook(recorder: Recorder, where: str, body: Callable[[], None]) -> None:
    if not recorder.enabled:
        return
    try:
        body()
    except Exception as exc:  # noqa: BLE001  (a hook must never raise into the trainer)
        recorder.fail(f"draft chain ({where})", exc)




LayerInput = Callable[[tuple, dict], "torch.Tensor | None"]


def first_argument(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A decoder layer that takes ``cat(embedding, hidden state)`` as its first argument."""
    return args[0] if args else kwargs.get("hidden_states")


def attach_chain(recorder: Recorder, *, fc: torch.nn.Module, first_layer: torch.nn.Module, last_layer: torch.nn.Module,
                 norm: torch.nn.Module, head: torch.nn.Module, hidden: int, d2t: torch.Tensor | None, prefix: str,
                 layer_input: LayerInput = first_argument) -> None:
    """Hook the draft's forward points (the fc input is the adapter's own tap: only its chain
    attribute is added here). ``d2t``: the draft-to-target offsets (``target = draft + d2t[draft]``),
    None when the draft predicts target ids directly. ``layer_input``: the decoder layer's input as
    ``cat(embedding, hidden state)`` from its arguments (every framework's tap holds that layout)."""
    declared: set[str] = set()
    recorder.declare("fc_in", chain=chain_attrs("fc_in", 0))
    steps = DraftSteps()
    disable = getattr(getattr(torch, "compiler", None), "disable", None)

    def keep(fn: Callable[..., None]) -> Callable[..., None]:
        return disable(fn) if disable is not None else fn

    def capture(point: str, module_path: str, tensor: Any, **attrs: Any) -> None:
        tensor = _first_tensor(tensor)
        if tensor is None:
            return
        step = max(steps.step, 0)
        name = tap_name(point, step)
        if name not in declared:  # declared on first use: a draft's step count is known only as it runs
            declare_chain_tap(recorder, name, point, step, hidden=hidden, module=module_path, phase="train",
                              compute_dtype=attrs.pop("compute_dtype", str(tensor.dtype).removeprefix("torch.")), **attrs)
            declared.add(name)
        recorder.capture(name, tensor)

    def on_fc(_mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        steps.reset()
        _hook(recorder, "fc output", lambda: capture("fc_out", f"{prefix}.fc", output))

    def on_layer_in(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        steps.advance()
        _hook(recorder, "decoder layer input",
              lambda: capture("layer_in", f"{prefix}.first decoder layer", layer_input(args, kwargs)))

    def on_layer_out(_mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        _hook(recorder, "decoder layer output", lambda: capture("layer_out", f"{prefix}.last decoder layer", output))

    def on_norm(_mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        _hook(recorder, "final norm", lambda: capture("norm_out", f"{prefix}.norm", output))

    def on_head(_mod: torch.nn.Module, _args: tuple, output: Any) -> None:
        def body() -> None:
            logits = _first_tensor(output)
            if logits is None:
                return
            capture("logits_topk", f"{prefix}.lm_head", topk_row(logits, d2t),
                    compute_dtype=str(logits.dtype).removeprefix("torch."), top_k=min(TOP_K, logits.shape[-1]),
                    row_layout="values[k], draft ids[k], target ids[k] (draft id + d2t[draft id])",
                    d2t="offsets" if d2t is not None else "none")

        _hook(recorder, "logits", body)

    recorder.keep_handle(fc.register_forward_hook(keep(on_fc)))
    recorder.keep_handle(first_layer.register_forward_pre_hook(keep(on_layer_in), with_kwargs=True))
    recorder.keep_handle(last_layer.register_forward_hook(keep(on_layer_out)))
    recorder.keep_handle(norm.register_forward_hook(keep(on_norm)))
    recorder.keep_handle(head.register_forward_hook(keep(on_head)))


def topk_row(logits: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """``[..., 3k]`` float32: the top k logits, their draft ids, and their target ids. Ids are exact
    in float32 up to 2**24 (a vocabulary of 16 M)."""
    k = min(TOP_K, logits.shape[-1])
    values, ids = torch.topk(logits.detach().float(), k, dim=-1)
    target = ids + d2t.to(ids.device)[ids] if d2t is not None else ids
    return torch.cat([values, ids.float(), target.float()], dim=-1)
