"""SpecForge adapter: the rows an EAGLE-3 draft trained with SpecForge (sgl-project) feeds ``fc``.

Tap ``fc_in`` = the input of the draft's ``fc`` (``LlamaForCausalLMEagle3.fc``, [B, T, 3*H]), which
``project_hidden_states`` calls once per training step. Row labels come from the arguments of
``OnlineEagle3Model.forward`` (SpecForge 0.2: ``input_ids, attention_mask, target, loss_mask,
hidden_states, past_key_values, position_ids``). SpecForge hands it ``input_ids`` already shifted
left by one (``TargetHead.preprocess``: ``input_ids[b, p] = x_{p+1}``, zero at the end) while
``hidden_states[b, p]`` is the target's state for token ``x_p`` at position ``p``. So:

- ``position = p`` (``position_ids`` when given, else ``0..T-1``: no offset, meta says 0);
- ``token_id = x_p = input_ids[b, p-1]`` (unknown, -1, at ``p = 0``, whose token the shift dropped);
- ``next_token_id = x_{p+1} = input_ids[b, p]`` where row ``p+1`` is real, else -1;
- ``valid = attention_mask[b, p] != 0``; one sequence per batch row, counted across steps.

A draft called directly (``LlamaForCausalLMEagle3.forward(hidden_states, inputs_embeds, ...)``) gets
positions ``0..T-1`` and unknown tokens: that forward receives no token ids.

The hooks run inside the training step: label tensors are built on the batch's device, no host
synchronisation; the fc hook is kept out of ``torch.compile``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from tracediff.adapters._chain import attach_chain
from tracediff.adapters._fc import argument, framework_version, hf_labels, previous_in_row, tap_fc_input
from tracediff.record.recorder import Recorder

FRAMEWORK = "specforge"
TAP = "fc_in"
POSITION_OFFSET = 0
WATCH: tuple[str, ...] = ("LlamaForCausalLMEagle3", "OnlineEagle3Model", "Eagle3DraftModel")
_DRAFT_BASE = "Eagle3DraftModel"
_TRAINER = "OnlineEagle3Model"

log = logging.getLogger("tracediff")
# One running sequence count per recorder, shared by its drafts and trainer models.
_SEQ: weakref.WeakKeyDictionary[Recorder, dict[str, int]] = weakref.WeakKeyDictionary()


def _has_base(module: torch.nn.Module, name: str) -> bool:
    return any(k.__name__ == name and k.__module__.split(".")[0] == FRAMEWORK for k in type(module).__mro__)


def aux_layer_ids(config: Any) -> dict[str, Any]:
    """The draft config's aux layer ids, and where they were read from.

    SpecForge (like SGLang) reads them only from the nested ``eagle_config`` dict. They are SGLang
    config ids: for Llama/Qwen targets SGLang captures the output of layer j for id j, which is HF
    ``hidden_states[j+1]`` (DeepSeek/Kimi targets take the ids raw: ``hf_hidden_states`` assumes
    the former). Ids at the top level are recorded but ignored, as SpecForge ignores them.
    """
    nested = getattr(config, "eagle_config", None)
    if nested is not None and not isinstance(nested, dict):
        nested = getattr(nested, "__dict__", {})
    ids = (nested or {}).get("eagle_aux_hidden_state_layer_ids")
    out: dict[str, Any] = {
        "convention": "sglang config id j = output of layer j = HF hidden_states[j+1] (Llama/Qwen targets)"
    }
    if ids is None:
        out.update(ids=None, hf_hidden_states=None,
                   read_from="not set in the draft config's eagle_config; SpecForge then uses the run's "
                             "aux_hidden_state_layer_ids or [1, L//2-1, L-4] from the target")
    else:
        ids = [int(i) for i in ids]
        out.update(ids=ids, hf_hidden_states=[i + 1 for i in ids],
                   read_from="eagle_config.eagle_aux_hidden_state_layer_ids (nested) in the draft config")
    top = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if top is not None:
        out["top_level_ids_ignored"] = [int(i) for i in top]
    return out


def _draft_config(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("model_type", "hidden_size", "target_hidden_size", "num_hidden_layers", "vocab_size",
                "draft_vocab_size", "fc_norm", "norm_output", "rms_norm_eps"):
        value = getattr(config, key, None)
        if value is not None:
            out[key] = value
    arch = getattr(config, "architectures", None)
    if arch:
        out["architectures"] = list(arch)
    return out


def _trainer_row_labels(args: tuple, kwargs: dict, seq_base: int) -> dict[str, torch.Tensor] | None:
    """Labels of the fc rows of one ``OnlineEagle3Model.forward`` call (see the module docstring)."""
    ids = argument(args, kwargs, "input_ids", 0)
    mask = argument(args, kwargs, "attention_mask", 1)
    positions = argument(args, kwargs, "position_ids", 6)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    ids = ids.detach().long()
    batch, length = ids.shape
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        valid = mask.detach().to(ids.device) != 0
    else:
        valid = torch.ones_like(ids, dtype=torch.bool)
    if isinstance(positions, torch.Tensor) and positions.shape[-1] == length:
        positions = positions.detach().long().to(ids.device)
        if positions.dim() == 3:  # [axes, batch, seq] (multi-axis rope): the first axis is the text position
            positions = positions[0]
        positions = positions.reshape(-1, length).expand(batch, length)
    else:
        positions = torch.arange(length, device=ids.device).expand(batch, length)
    minus = torch.full_like(ids, -1)
    next_real = torch.zeros_like(valid)
    next_real[:, :-1] = valid[:, 1:]
    return {
        "seq": (torch.arange(batch, device=ids.device) + seq_base)[:, None].expand(batch, length),
        "position": torch.where(valid, positions, minus),
        "token_id": previous_in_row(ids, valid),
        "next_token_id": torch.where(valid & next_real, ids, minus),
        "valid": valid,
    }


def _draft_row_labels(args: tuple, kwargs: dict, seq_base: int) -> dict[str, torch.Tensor] | None:
    """Labels of a direct ``LlamaForCausalLMEagle3.forward(hidden_states, inputs_embeds, attention_mask)``."""
    hidden = argument(args, kwargs, "hidden_states", 0)
    mask = argument(args, kwargs, "attention_mask", 2)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return None
    batch, length = hidden.shape[:2]
    device = hidden.device
    positions = torch.arange(length, device=device).expand(batch, length)
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (batch, length):
        valid = mask.detach().to(device) != 0
    else:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    return {
        "seq": (torch.arange(batch, device=device) + seq_base)[:, None].expand(batch, length),
        "position": torch.where(valid, positions, torch.full_like(positions, -1)),
        "valid": valid,
    }


def _label_hook(recorder: Recorder, state: dict[str, int], build: Any, where: str) -> Any:
    def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.enabled:
            return
        try:
            if getattr(mod, "attention_backend", None) == "usp":
                recorder.meta.setdefault("labels_note", "usp sequence parallelism: rows keep default labels")
                return
            labels = build(args, kwargs, state["seq"])
            if labels is not None:
                state["seq"] += int(labels["seq"].shape[0])
                by = {"class": f"{type(mod).__module__}.{type(mod).__qualname__}", "how": "adapter specforge"}
                recorder.labels(phase="train", labelled_by=by, **labels)
        except Exception as exc:  # noqa: BLE001  (never raise into the trainer)
            recorder.fail(f"specforge labels ({where})", exc)

    return pre_hook


def _attach_draft(recorder: Recorder, draft: torch.nn.Module, state: dict[str, int]) -> bool:
    fc = getattr(draft, "fc", None)
    if not _has_base(draft, _DRAFT_BASE) or not isinstance(fc, torch.nn.Linear):
        return False
    marks = draft.__dict__.setdefault("_tracediff_specforge", set())
    if id(recorder) in marks:
        return True
    config = draft.config
    hidden = int(getattr(config, "target_hidden_size", None) or getattr(config, "hidden_size", 0) or 0)
    if not hidden or fc.in_features % hidden:
        log.warning("tracediff: specforge adapter: %s.fc takes %d features, not a multiple of the target hidden "
                    "size %s; not recorded", type(draft).__qualname__, fc.in_features, hidden)
        return False
    marks.add(id(recorder))
    aux = aux_layer_ids(config)
    version = framework_version(FRAMEWORK)
    recorder.meta.update(
        {
            "framework": FRAMEWORK,
            "framework_version": version,
            "model": {"class": f"{type(draft).__module__}.{type(draft).__qualname__}"},
            "hidden_size": hidden,
            "aux_layer_ids": aux,
            "draft_config": _draft_config(config),
            "positions": {
                "position_offset": POSITION_OFFSET,
                "stored": "the true position p of the hidden state (its token is x_p)",
                "framework": "SpecForge feeds fc the target's state for x_p at position p, with input_ids shifted "
                             "left by one (x_{p+1} at row p)",
            },
        }
    )
    if not recorder.source.get("framework"):
        recorder.source.update(framework=FRAMEWORK, framework_version=version)
    module_path = f"{type(draft).__qualname__}.fc"
    slots = fc.in_features // hidden
    recorder.declare(
        TAP,
        segment_size=hidden,
        segment_labels=hf_labels(aux["hf_hidden_states"], slots),
        module=module_path,
        module_class=f"{type(fc).__module__}.{type(fc).__qualname__}",
        capture="input",
        in_features=fc.in_features,
        fc_input="fc_norm per aux state, then fc" if getattr(draft, "fc_norm", None) is not None else
                 "project_hidden_states' argument, unchanged",
        phase="train",
        position_offset=POSITION_OFFSET,
    )
    where = f"{type(draft).__qualname__}.forward"
    recorder.keep_handle(draft.register_forward_pre_hook(
        _label_hook(recorder, state, _draft_row_labels, where), with_kwargs=True))
    tap_fc_input(recorder, fc, TAP, module_path=module_path)
    if recorder.draft_chain:
        _attach_chain(recorder, draft, hidden)
    return True


def _midlayer_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """SpecForge's decoder layer takes the embedding and the hidden state apart (``input_emb``,
    ``hidden_states``) and concatenates them after its own norms: the chain stores them
    concatenated as they come, ``cat(embedding, hidden state)`` like every framework's tap."""
    emb = kwargs.get("input_emb", args[0] if args else None)
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    if not isinstance(emb, torch.Tensor) or not isinstance(hidden, torch.Tensor):
        return None
    return torch.cat([emb, hidden], dim=-1)


def _attach_chain(recorder: Recorder, draft: torch.nn.Module, hidden: int) -> None:
    """``record --draft-chain``: SpecForge 0.2's training step projects once (``fc``), then per TTT
    step runs ``midlayer`` (``backbone``) and ``compute_logits`` (``norm`` when ``norm_output``,
    then ``lm_head``); ``d2t`` holds offsets."""
    parts = [getattr(draft, name, None) for name in ("midlayer", "norm", "lm_head")]
    if any(not isinstance(p, torch.nn.Module) for p in parts):
        log.warning("tracediff: specforge adapter: %s has no midlayer / norm / lm_head; no draft chain recorded",
                    type(draft).__qualname__)
        return
    d2t = getattr(draft, "d2t", None)
    attach_chain(recorder, fc=draft.fc, first_layer=parts[0], last_layer=parts[0], norm=parts[1], head=parts[2],
                 hidden=hidden, d2t=d2t if isinstance(d2t, torch.Tensor) else None,
                 prefix=type(draft).__qualname__, layer_input=_midlayer_input)


def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """A SpecForge EAGLE-3 draft: tap its fc input. ``OnlineEagle3Model``: also label the rows from
    its forward's arguments (and tap its draft if that was built before recording started)."""
    state = _SEQ.setdefault(recorder, {"seq": 0})
    if _has_base(module, _DRAFT_BASE):
        return _attach_draft(recorder, module, state)
    if not _has_base(module, _TRAINER):
        return False
    draft = getattr(module, "draft_model", None)
    if not isinstance(draft, torch.nn.Module) or not _attach_draft(recorder, draft, state):
        return False
    marks = module.__dict__.setdefault("_tracediff_specforge", set())
    if id(recorder) not in marks:
        marks.add(id(recorder))
        recorder.meta["trainer"] = {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "ttt_length": getattr(module, "length", None),
            "attention_backend": getattr(module, "attention_backend", None),
            "input_ids": "shifted left by one before the forward (TargetHead.preprocess)",
        }
        where = f"{type(module).__qualname__}.forward"
        recorder.keep_handle(module.register_forward_pre_hook(
            _label_hook(recorder, state, _trainer_row_labels, where), with_kwargs=True))
    return True
