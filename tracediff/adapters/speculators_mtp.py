"""speculators adapter, MTP heads: the rows speculators 0.9's ``MTPDraftModel`` feeds its MTP layer.

``MTPDraftModel.forward(input_ids, hidden_states, ..., position_ids)`` (``models/mtp/core.py``) runs
the MTP layer once per speculative step; step 0 feeds ``mtp_layers[0].input_proj`` with
``cat(token_layernorm(embed(input_ids[t + 1])), hidden_layernorm(hidden_states[t]))`` for
t < valid_len = seq_len - steps - 1 (``models/mtp/model_definitions.py`` ``MTPLayerMixin.forward``);
the later steps feed the layer's own output as the hidden half. Tap ``fc_in`` = that input at step 0
only (as the vLLM and SGLang adapters record an MTP head's first pass), row t labelled position p =
``position_ids[t]`` (no shift: the hidden state of x_p and the embedding of x_{p+1}), ``token_id`` =
x_p, ``next_token_id`` = x_{p+1}; ``valid`` is false where x_{p+1} starts another packed document
(its position does not follow). ``hidden_states`` is speculators' ``verifier_last_hidden_states``: the
verifier's last state *before* its final norm (its datagen's last layer, which speculators' EAGLE-3 loss
passes through ``verifier_norm``): the row model ``mtp`` with ``final_norm`` false.

Runs inside the training step: labels are built on the batch's device with no host sync; never raises
into the trainer.
"""

from __future__ import annotations

from typing import Any

import torch

from tracediff.adapters._fc import argument, framework_version
from tracediff.record.recorder import Recorder
from tracediff.store.row_model import mtp

FRAMEWORK = "speculators"
TAP = "fc_in"
MTP_CLASS = "MTPDraftModel"
SEGMENTS = ("embed_next", "hidden")


def is_mtp_draft(module: torch.nn.Module) -> bool:
    """speculators' ``MTPDraftModel`` (in the instance's MRO)."""
    return any(k.__name__ == MTP_CLASS and k.__module__.split(".")[0] == FRAMEWORK for k in type(module).__mro__)


def row_labels(args: tuple, kwargs: dict, steps: int, seq_base: torch.Tensor) -> tuple[dict[str, Any] | None,
                                                                                        torch.Tensor]:
    """Labels of the step-0 rows of one ``MTPDraftModel.forward`` call (None when it runs no step),
    and the next sequence base (documents counted on the device)."""
    ids = argument(args, kwargs, "input_ids", 0)
    positions = argument(args, kwargs, "position_ids", 3)
    ids = ids.detach().long()
    batch, seq_len = ids.shape
    effective = min(steps, max(0, seq_len - 2))
    valid_len = seq_len - effective - 1
    if valid_len <= 0 or effective == 0:
        return None, seq_base
    if positions is None:
        positions = torch.arange(seq_len, device=ids.device).expand(batch, -1)
    positions = positions.detach().long().to(ids.device)
    if positions.dim() == 3:  # Qwen3.5 M-RoPE [3, batch, seq]: the text positions first
        positions = positions[0]
    positions = positions.expand(batch, -1)
    pos = positions[:, :valid_len]
    follows = positions[:, 1:valid_len + 1] == pos + 1  # x_{p+1} is the same document's next token
    restart = torch.ones_like(pos, dtype=torch.bool)
    restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    base = seq_base.to(ids.device)
    seq = base + torch.cumsum(restart.reshape(-1).long(), 0) - 1
    labels = {"seq": seq, "position": pos.reshape(-1), "token_id": ids[:, :valid_len].reshape(-1),
              "next_token_id": ids[:, 1:valid_len + 1].reshape(-1), "valid": follows.reshape(-1),
              "rows": batch * valid_len}
    return labels, seq[-1] + 1


def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """Tap ``module.mtp_layers[0].input_proj`` at step 0 of each forward, labelled from its arguments."""
    layers = getattr(module, "mtp_layers", None)
    proj = getattr(layers[0], "input_proj", None) if isinstance(layers, torch.nn.ModuleList) and len(layers) else None
    if not isinstance(proj, torch.nn.Linear) or proj.in_features % 2:
        return False
    marks = module.__dict__.setdefault("_tracediff_speculators", set())
    if id(recorder) in marks:
        return True
    marks.add(id(recorder))
    hidden = proj.in_features // 2
    config = module.config
    steps = int(getattr(config, "num_speculative_steps", 1) or 1)
    version = framework_version(FRAMEWORK)
    layer_config = getattr(config, "transformer_layer_config", None)
    recorder.meta.update({
        "framework": FRAMEWORK, "framework_version": version,
        "model": {"class": f"{type(module).__module__}.{type(module).__qualname__}"}, "hidden_size": hidden,
        "mtp": {"num_speculative_steps": steps, "model_type": getattr(layer_config, "model_type", None),
                "hidden_final_norm": "before",
                "hidden_source": "verifier_last_hidden_states (models/mtp/data.py shift_batch_mtp): the last "
                                 "datagen hidden state, before the verifier's final norm",
                "recorded_steps": "step 0 only: later steps feed the MTP layer's own output as the hidden half"},
    })
    if not recorder.source.get("framework"):
        recorder.source.update(framework=FRAMEWORK, framework_version=version)
    recorder.declare(TAP, segment_size=hidden, segment_labels=list(SEGMENTS), row_model=mtp(final_norm=False),
                     module=f"{type(module).__qualname__}.mtp_layers.0.input_proj",
                     module_class=f"{type(proj).__module__}.{type(proj).__qualname__}", capture="input",
                     in_features=proj.in_features, phase="train")
    state: dict[str, Any] = {"seq": None, "pending": None}

    def label_rows(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        state["pending"] = None
        if not recorder.enabled:
            return
        try:
            ids = argument(args, kwargs, "input_ids", 0)
            if state["seq"] is None:
                state["seq"] = torch.zeros((), dtype=torch.long, device=ids.device)
            state["pending"], state["seq"] = row_labels(args, kwargs, steps, state["seq"])
        except Exception as exc:  # noqa: BLE001  (never raise into the trainer)
            recorder.fail(f"speculators MTP labels ({type(mod).__qualname__}.forward)", exc)

    def step0_input(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        labels, state["pending"] = state["pending"], None  # later steps of the same forward: not recorded
        if labels is None or not recorder.enabled:
            return
        try:
            tensor = args[0] if args else kwargs.get("input")
            rows = labels.pop("rows")
            recorder.capture(TAP, tensor.reshape(-1, tensor.shape[-1])[:rows], labels=dict(labels, phase="train"))
        except Exception as exc:  # noqa: BLE001
            recorder.fail(f"tap {TAP!r} ({type(module).__qualname__}.mtp_layers.0.input_proj)", exc)

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    hooks = [disable(h) if disable is not None else h for h in (label_rows, step0_input)]
    recorder.keep_handle(module.register_forward_pre_hook(hooks[0], with_kwargs=True))
    recorder.keep_handle(proj.register_forward_pre_hook(hooks[1], with_kwargs=True))
    return True
