"""What vLLM's MTP drafters are fed, for the vLLM adapter (:mod:`tracediff.adapters.vllm`): the MTP
layers of a drafter, the taps an MTP drafter gets, and the provenance of an MTP recording.

vLLM 0.32 drafts with DeepSeek's MTP head through the same proposer as EAGLE
(``SpecDecodeBaseProposer.propose``, ``{"method": "mtp"}``); the drafter (``DeepSeekMTP``) holds
``model.layers[str(i)]`` for i = the target's layer count onwards, each with ``enorm``, ``hnorm`` and
``eh_proj`` (an ``nn.Linear`` of ``2H`` inputs) whose input is ``cat(enorm(embed(x_{p+1})),
hnorm(h_p))`` (``deepseek_mtp.py`` ``DeepSeekMultiTokenPredictorLayer.forward``), ``h_p`` the
target's output hidden state, which vLLM's DeepSeek model returns after its final norm. The layer
zeroes the embedding at position 0 first. Never imports vLLM; never raises into it (the caller
catches).
"""

from __future__ import annotations

from typing import Any

import torch

from tracediff.adapters.vllm_provenance import engine_config, first_attr, target_model, vllm_version
from tracediff.drafts import tensor_sha256
from tracediff.record.recorder import Recorder

#: The two segments of an MTP head's ``eh_proj`` input: ``enorm(embed(x_{p+1}))`` and ``hnorm(h_p)``.
MTP_SEGMENTS = ("embed_next", "hidden")
#: Tap attributes of an MTP ``fc_in`` that say what its rows are beyond the row model. ``zeroed_slots``:
#: vLLM's DeepSeek MTP layer zeroes the embedding before ``enorm`` at position 0
#: (``DeepSeekMultiTokenPredictorLayer.forward``: ``torch.where(positions == 0, 0, inputs_embeds)``),
#: so slot 0 of every position-0 row is all zeros where a trainer (and SGLang) has the embedding of x_1.
MTP_ROW_FACTS: dict[str, Any] = {
    "zeroed_slots": [{"slot": 0, "positions": [0], "engine": "vllm",
                      "why": "vLLM's MTP layer zeroes the embedding at position 0 (deepseek_mtp.py, "
                             "DeepSeekMultiTokenPredictorLayer.forward); trainers and SGLang do not"}],
    "recorded_calls": "the first MTP pass of each drafter call, one row per target row (rejected verify slots "
                      "valid = false); the chained draft steps k >= 1, whose hidden half is the MTP layer's own "
                      "output, are not recorded",
}


def mtp_layer_modules(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The MTP layers of a vLLM MTP drafter (``model.layers[str(i)]`` holding ``enorm``, ``hnorm`` and
    an ``eh_proj`` of ``2H`` inputs), by layer index; empty for any other module."""
    layers = getattr(getattr(module, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleDict):
        return {}
    out: dict[int, torch.nn.Module] = {}
    for key, layer in layers.items():
        proj = getattr(layer, "eh_proj", None)
        if key.isdigit() and isinstance(proj, torch.nn.Module) and all(
                isinstance(getattr(layer, n, None), torch.nn.Module) for n in ("enorm", "hnorm")):
            out[int(key)] = layer
    return dict(sorted(out.items()))


def declare_mtp_taps(recorder: Recorder, draft: torch.nn.Module, eh_proj: torch.nn.Module,
                     layers: dict[int, torch.nn.Module], tap: str, aux_tap: str) -> dict[str, Any]:
    """Declare ``tap``, the MTP head's ``eh_proj`` input ``[enorm(embed(x_{p+1})) | hnorm(h_p)]`` (two
    segments of H), and ``aux_tap``, the target hidden state handed to the drafter; returns the
    drafter's config facts. The row model (which final norm ``h_p`` went through) is declared at the
    first drafter call, once the target is reachable (:func:`mtp_provenance`)."""
    in_features = getattr(eh_proj, "in_features", None)
    size = in_features // 2 if isinstance(in_features, int) and in_features % 2 == 0 else None
    first = next(iter(layers))
    recorder.declare(tap, segment_size=size, segment_labels=list(MTP_SEGMENTS) if size else None,
                     module=f"{type(draft).__qualname__}.model.layers.{first}.eh_proj",
                     module_class=f"{type(eh_proj).__module__}.{type(eh_proj).__qualname__}", capture="input",
                     in_features=in_features, mtp_layers=list(layers), **MTP_ROW_FACTS)
    recorder.declare(aux_tap, segment_size=size, segment_labels=["hidden"] if size else None,
                     module="SpecDecodeBaseProposer.propose(target_hidden_states)", capture="target_hidden_states",
                     note="the target's hidden state vLLM hands the MTP drafter, before its hnorm")
    return mtp_config_facts(draft, layers)


def mtp_config_facts(draft: torch.nn.Module, layers: dict[int, torch.nn.Module]) -> dict[str, Any]:
    """The MTP drafter's config as vLLM read it: sizes, its layer indices, norm eps."""
    config = getattr(draft, "config", None)
    out: dict[str, Any] = {"class": type(draft).__qualname__, "mtp_layers": list(layers)}
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "vocab_size",
                "rms_norm_eps", "_name_or_path", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float, str, bool)) and value != "":
            out[key.lstrip("_")] = value
    if isinstance(out.get("hidden_size"), int):
        out["target_hidden_size"] = out["hidden_size"]
    return out


def mtp_provenance(proposer: Any, runner: Any, draft: Any, info: dict[str, Any],
                   hidden: torch.Tensor | None) -> dict[str, Any]:
    """``meta.vllm`` of an MTP recording: the engine config, and ``mtp``: which hidden state the target
    hands the MTP head (after or before its final norm: from vLLM's code path, checked on the first
    call's rows against the target's final-norm weight), the position-0 zeroing, whose embedding and
    head the MTP layers use."""
    meta: dict[str, Any] = {"vllm_version": vllm_version(), "draft": dict(info), "warnings": []}
    meta.update(engine_config(getattr(proposer, "vllm_config", None)))
    target = target_model(runner)
    meta["target_class"] = type(target).__qualname__ if target is not None else None
    override = callable(getattr(target, "get_mtp_target_hidden_states", None))
    measured = _final_norm_measured(hidden, first_attr(target, ("model.norm", "language_model.model.norm")))
    by_code = "other" if override else "after"
    decided = measured["final_norm"] if measured.get("final_norm") in ("after", "before") else by_code
    if measured.get("final_norm") in ("after", "before") and measured["final_norm"] != by_code:
        meta["warnings"].append(f"the MTP head's hidden half reads as taken {measured['final_norm']} the target's "
                                f"final norm (rms of h / norm weight {measured['rms_over_norm_weight']:.3f}), "
                                f"where vLLM's code path gives {by_code}")
    mtp: dict[str, Any] = {
        "layers": info.get("mtp_layers"),
        "hidden_final_norm": decided,
        "hidden_source": "the target model's output hidden states (propose(target_hidden_states=...), "
                         "gpu_model_runner.propose_draft_token_ids), returned after the final norm "
                         "(deepseek_v2.py DeepseekV2Model.forward: self.norm(hidden_states, residual))"
                         + ("; this target overrides them (get_mtp_target_hidden_states)" if override else ""),
        "hidden_final_norm_measured": measured,
        "embedding_zeroed_at_position0": True,
        "chained_steps_recorded": False,
    }
    mtp.update(_mtp_weights(draft, target))
    meta["mtp"] = mtp
    block = getattr(proposer, "block_size", None)
    if isinstance(block, int):
        meta["draft_kv_block_size"] = block
    return meta


def _final_norm_measured(hidden: torch.Tensor | None, norm: Any) -> dict[str, Any]:
    """Whether rows read as the output of ``norm`` (an RMSNorm with ``weight``): then ``h / weight``
    has RMS 1 in every row. A few hundred rows, once per recording."""
    weight = getattr(norm, "weight", None)
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) or hidden.dim() != 2 or \
            hidden.shape[-1] != weight.shape[-1]:
        return {"final_norm": "unknown", "why": "no final-norm weight of the target's width to test the rows against"}
    with torch.no_grad():
        w = weight.detach().float().reshape(-1)
        keep = w.abs() > 1e-6
        h = hidden[:256].detach().float()[:, keep] / w[keep]
        rms = h.pow(2).mean(-1).sqrt()
        near = float(((rms - 1).abs() < 0.02).float().mean())
        median = float(rms.median())
    verdict = "after" if near >= 0.9 else "before"
    return {"final_norm": verdict, "rms_over_norm_weight": median, "rows_with_rms_1": near,
            "rows": int(h.shape[0])}


def _mtp_weights(draft: Any, target: Any) -> dict[str, Any]:
    """Whether the MTP layers' embedding and head are the target's (vLLM swaps them in) or their own."""
    out: dict[str, Any] = {}
    inner = getattr(draft, "model", None)
    theirs = first_attr(target, ("model.embed_tokens", "embed_tokens", "language_model.model.embed_tokens"))
    mine = getattr(inner, "embed_tokens", None)
    for name, a, b in (("embed_tokens", mine, theirs),):
        wa, wb = getattr(a, "weight", None), getattr(b, "weight", None)
        if isinstance(wa, torch.Tensor):
            shared = isinstance(wb, torch.Tensor) and (a is b or (wa.device == wb.device and
                                                                  wa.data_ptr() == wb.data_ptr()))
            out[f"{name}_from"] = "target" if shared else "draft"
            out[f"{name}_sha256"] = tensor_sha256(wa)
    head = first_attr(target, ("lm_head", "language_model.lm_head"))
    layers = getattr(inner, "layers", None)
    heads = {}
    for key, layer in (layers.items() if isinstance(layers, torch.nn.ModuleDict) else []):
        sh = getattr(getattr(layer, "shared_head", None), "head", None)
        if sh is not None:
            heads[str(key)] = "target" if sh is head else "draft"
    if heads:
        out["shared_head_from"] = heads
    return out
