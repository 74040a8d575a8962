"""speculators adapter: the rows an EAGLE-3 draft trained with speculators (vllm-project) feeds ``fc``.

Tap ``fc_in`` = the input of ``Eagle3DraftModel.fc`` ([1, packed_len, K*H]: the K aux hidden states of
the verifier, concatenated). Row labels come from the arguments of ``Eagle3DraftModel.forward``
(speculators 0.9: ``hidden_states, input_ids, document_ids, loss_mask, position_ids``), as the
trainer's collate function builds them after ``shift_batch``:

- row r of a packed document holds ``g_p``, the verifier's state for token ``x_p``;
- ``input_ids[r] = x_{p+1}`` (the draft's input token at that row), ``position_ids[r] = p + 1``;
- ``document_ids[r]`` is the document's index in the pack, -1 on padding rows.

So the trace stores the *true* position ``p = position_ids - 1`` (meta ``positions.position_offset``
= 1 says so), ``token_id = x_p`` (the previous row's input id in the same document; unknown, -1, on
a document's first row, whose ``x_0`` the shift dropped), ``next_token_id = x_{p+1}`` and
``valid = False`` on padding rows. Sequence ids count documents across steps.

The hooks run inside the training step: label tensors are built on the batch's device with no
host synchronisation; the fc hook is kept out of ``torch.compile`` (see ``_fc.tap_fc_input``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tracediff.adapters import speculators_mtp
from tracediff.adapters._chain import attach_chain
from tracediff.adapters._fc import argument, framework_version, hf_labels, previous_in_row, tap_fc_input
from tracediff.record.recorder import Recorder

FRAMEWORK = "speculators"
TAP = "fc_in"
POSITION_OFFSET = 1
WATCH: tuple[str, ...] = ("Eagle3DraftModel", "MTPDraftModel")  # MTP heads: tracediff.adapters.speculators_mtp
_DRAFT_CLASS = "Eagle3DraftModel"

log = logging.getLogger("tracediff")


def _draft_base(module: torch.nn.Module) -> type | None:
    """speculators' ``Eagle3DraftModel`` in the instance's MRO (SpecForge has a class of that name too)."""
    for klass in type(module).__mro__:
        if klass.__name__ == _DRAFT_CLASS and klass.__module__.split(".")[0] == FRAMEWORK:
            return klass
    return None


def aux_layer_ids(config: Any) -> dict[str, Any]:
    """The draft config's aux layer ids, and where they were read from.

    speculators keeps them at the top level (``eagle_aux_hidden_state_layer_ids``), in vLLM's
    numbering: id i is the output of layer i-1, which is HF ``hidden_states[i]`` (0 = embeddings).
    """
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    out: dict[str, Any] = {"convention": "vllm: id i = output of layer i-1 = HF hidden_states[i]"}
    if ids is None:
        out.update(ids=None, hf_hidden_states=None,
                   read_from="not set in the draft config (top-level eagle_aux_hidden_state_layer_ids); "
                             "speculators then resolves [2, L//2, L-3] from the verifier")
    else:
        ids = [int(i) for i in ids]
        out.update(ids=ids, hf_hidden_states=list(ids),
                   read_from="eagle_aux_hidden_state_layer_ids at the top level of the speculators draft config")
    nested = getattr(config, "eagle_config", None)
    if nested:
        out["nested_eagle_config"] = nested  # not read by speculators; recorded because SGLang reads it
    return out


def _draft_config(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm",
                "norm_before_residual", "norm_output", "embed_requires_grad"):
        value = getattr(config, key, None)
        if value is not None:
            out[key] = value
    layer = getattr(config, "transformer_layer_config", None)
    if layer is not None:
        out["transformer_layer_config"] = {
            k: getattr(layer, k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
            if getattr(layer, k, None) is not None
        }
    verifier = getattr(getattr(config, "speculators_config", None), "verifier", None)
    if verifier is not None:
        out["verifier"] = {"name_or_path": getattr(verifier, "name_or_path", None),
                           "architectures": list(getattr(verifier, "architectures", None) or [])}
    return out


def _fc_input_note(config: Any) -> str:
    if getattr(config, "norm_before_fc", False):
        return "input_norm(hidden_states): one RMSNorm over the concatenated aux states (norm_before_fc)"
    if getattr(config, "fc_norm", False):
        return "cat(RMSNorm(h_a), RMSNorm(h_b), ...): one RMSNorm per aux state (fc_norm)"
    return "the forward's hidden_states argument, unchanged"


def row_labels(args: tuple, kwargs: dict, seq_base: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Labels of the fc rows of one ``Eagle3DraftModel.forward`` call, and the next sequence base.

    ``seq_base`` is a 0-d tensor on the batch's device (a running document count that never has to
    be read back to the host)."""
    ids = argument(args, kwargs, "input_ids", 1)
    docs = argument(args, kwargs, "document_ids", 2)
    positions = argument(args, kwargs, "position_ids", 4)
    ids = ids.detach().reshape(-1).long()
    n = ids.numel()
    if n == 0:
        return {}, seq_base
    docs = docs.detach().reshape(-1).long().to(ids.device) if docs is not None else torch.zeros_like(ids)
    if positions is None:  # the model's own default: position_ids = 1 + arange(n)
        positions = torch.arange(1, n + 1, device=ids.device)
    positions = positions.detach().reshape(-1).long().to(ids.device)
    valid = docs >= 0
    minus = torch.full_like(ids, -1)
    same_doc = torch.zeros_like(valid)
    same_doc[1:] = (docs[1:] == docs[:-1]) & valid[1:]
    base = seq_base.to(ids.device)
    labels = {
        "seq": torch.where(valid, base + docs, minus),
        "position": torch.where(valid, positions - POSITION_OFFSET, minus),
        "token_id": previous_in_row(ids, same_doc),
        "next_token_id": torch.where(valid, ids, minus),
        "valid": valid,
    }
    return labels, base + docs.max().clamp(min=-1) + 1


def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """Tap ``module.fc`` (its input) and label its rows from ``module.forward``'s arguments; an MTP
    head (``MTPDraftModel``): :func:`tracediff.adapters.speculators_mtp.attach`."""
    if speculators_mtp.is_mtp_draft(module):
        return speculators_mtp.attach(recorder, module)
    base = _draft_base(module)
    fc = getattr(module, "fc", None)
    if base is None or not isinstance(fc, torch.nn.Linear):
        return False
    marks = module.__dict__.setdefault("_tracediff_speculators", set())
    if id(recorder) in marks:
        return True
    if type(module).forward is not base.forward:  # type: ignore[attr-defined]
        log.warning("tracediff: speculators adapter: %s overrides Eagle3DraftModel.forward (its fc rows are not "
                    "the packed sequence); not recorded", type(module).__qualname__)
        return False
    marks.add(id(recorder))
    config = module.config
    aux = aux_layer_ids(config)
    hidden = int(getattr(module, "hidden_size", 0) or 0)
    slots = fc.in_features // hidden if hidden and fc.in_features % hidden == 0 else None
    version = framework_version(FRAMEWORK)
    positions = {
        "position_offset": POSITION_OFFSET,
        "stored": "the true position p of the hidden state (its token is x_p)",
        "framework": "speculators passes position_ids = p + 1 with input_ids = x_{p+1} at the row of g_p "
                     "(shift_batch); the stored position is position_ids - 1",
    }
    recorder.meta.update(
        {
            "framework": FRAMEWORK,
            "framework_version": version,
            "model": {"class": f"{type(module).__module__}.{type(module).__qualname__}"},
            "hidden_size": hidden or None,
            "aux_layer_ids": aux,
            "draft_config": _draft_config(config),
            "positions": positions,
        }
    )
    if not recorder.source.get("framework"):
        recorder.source.update(framework=FRAMEWORK, framework_version=version)
    module_path = f"{type(module).__qualname__}.fc"
    recorder.declare(
        TAP,
        segment_size=hidden if slots else None,
        segment_labels=hf_labels(aux["hf_hidden_states"], slots or 0),
        module=module_path,
        module_class=f"{type(fc).__module__}.{type(fc).__qualname__}",
        capture="input",
        in_features=fc.in_features,
        fc_input=_fc_input_note(config),
        phase="train",
        position_offset=POSITION_OFFSET,
    )
    state: dict[str, Any] = {"seq": None}

    def label_rows(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.enabled:
            return
        try:
            ids = argument(args, kwargs, "input_ids", 1)
            if state["seq"] is None:
                state["seq"] = torch.zeros((), dtype=torch.long, device=ids.device)
            labels, state["seq"] = row_labels(args, kwargs, state["seq"])
            by = {"class": f"{type(mod).__module__}.{type(mod).__qualname__}", "how": "adapter speculators"}
            recorder.labels(phase="train", labelled_by=by, **labels)
        except Exception as exc:  # noqa: BLE001  (never raise into the trainer)
            recorder.fail(f"speculators labels ({type(mod).__qualname__}.forward)", exc)

    recorder.keep_handle(module.register_forward_pre_hook(label_rows, with_kwargs=True))
    tap_fc_input(recorder, fc, TAP, module_path=module_path)
    if recorder.draft_chain:
        _attach_chain(recorder, module, hidden)
    return True


def _attach_chain(recorder: Recorder, module: torch.nn.Module, hidden: int) -> None:
    """``record --draft-chain``: speculators' forward runs ``fc`` once, then per TTT step the decoder
    layers (``module.layers``), ``module.norm`` and ``module.lm_head``; ``d2t`` holds offsets."""
    layers = getattr(module, "layers", None)
    parts = [getattr(module, name, None) for name in ("norm", "lm_head")]
    if not layers or any(not isinstance(p, torch.nn.Module) for p in parts):
        log.warning("tracediff: speculators adapter: %s has no layers / norm / lm_head; no draft chain recorded",
                    type(module).__qualname__)
        return
    d2t = getattr(module, "d2t", None)
    attach_chain(recorder, fc=module.fc, first_layer=layers[0], last_layer=layers[-1], norm=parts[0],
                 head=parts[1], hidden=hidden, d2t=d2t if isinstance(d2t, torch.Tensor) else None,
                 prefix=type(module).__qualname__)
