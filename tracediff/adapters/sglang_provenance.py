"""Provenance of an SGLang recording (writer ``meta.sglang``): the SGLang version, the target's
resolved ``layers_to_capture``, the draft config and where its aux layer ids were read from, its
``d2t``, the speculative server args and whether CUDA graphs are on.

Read once per process by :mod:`tracediff.adapters.sglang` (best effort: a field SGLang moved is left
out, never an error). ``state`` is that module's per-process state.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from tracediff.drafts import d2t_facts
from tracediff.record.recorder import Recorder


def target_provenance(owner: torch.nn.Module | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if owner is None:
        return out
    out["class"] = type(owner).__qualname__
    inner = getattr(owner, "model", None)
    ltc = getattr(inner, "layers_to_capture", None)
    if ltc is None:
        ltc = getattr(owner, "layers_to_capture", None)
    if ltc is not None:
        try:
            out["layers_to_capture"] = [int(x) for x in ltc]
        except (TypeError, ValueError):
            out["layers_to_capture"] = str(ltc)
    if hasattr(owner, "capture_aux_hidden_states"):
        out["capture_aux_hidden_states"] = bool(owner.capture_aux_hidden_states)
    config = getattr(owner, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "_name_or_path"):
        value = getattr(config, key, None)
        if isinstance(value, (int, str)) and value != "":
            out[key.lstrip("_")] = value
    if isinstance(out.get("layers_to_capture"), list):
        out["hf_hidden_states_indices"] = sorted(out["layers_to_capture"])
    return out


def mtp_draft_provenance(draft: torch.nn.Module, in_features: int) -> dict[str, Any]:
    """An MTP head (DeepSeek NextN) as SGLang built it: its config's sizes, and where the hidden half
    of its ``eh_proj`` input comes from (read from SGLang 0.5.23's source)."""
    config = getattr(draft, "config", None)
    out: dict[str, Any] = {"class": type(draft).__qualname__, "eh_proj_in_features": in_features, "mtp": True,
                           "target_hidden_size": in_features // 2}
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "vocab_size",
                "_name_or_path", "rms_norm_eps"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float, str, bool)) and value != "":
            out[key.lstrip("_")] = value
    out["hidden_final_norm"] = "after"
    out["hidden_source"] = ("spec_info.hidden_states: the target's hidden states the logits processor keeps, which "
                            "DeepseekV2Model.forward returns after its final norm (srt/models/deepseek_v2.py); "
                            "deepseek_nextn.py concatenates enorm(embed) and hnorm(hidden) with no position masking")
    out["embedding_zeroed_at_position0"] = False
    return out


def draft_provenance(state: Any, draft: torch.nn.Module, fc_owner: torch.nn.Module, in_features: int,
                      raw_differs: bool) -> dict[str, Any]:
    config = getattr(draft, "config", None)
    out: dict[str, Any] = {"class": type(draft).__qualname__, "fc_in_features": in_features,
                           "raw_differs_from_fc_input": raw_differs}
    for key in ("model_type", "hidden_size", "target_hidden_size", "num_hidden_layers", "vocab_size",
                "draft_vocab_size", "_name_or_path", "norm_before_fc", "fc_norm", "use_aux_norm"):
        value = getattr(config, key, None)
        if isinstance(value, (int, str, bool)) and value != "":
            out[key.lstrip("_")] = value
    num_aux = getattr(fc_owner, "num_aux_hidden_states", None)
    hidden_in = getattr(fc_owner, "hidden_size_in", None) or out.get("target_hidden_size") or out.get("hidden_size")
    if isinstance(num_aux, int):
        out["num_aux_hidden_states"] = num_aux
    elif isinstance(hidden_in, int) and hidden_in and in_features % hidden_in == 0:
        out["num_aux_hidden_states"] = in_features // hidden_in
    if isinstance(hidden_in, int):
        out["target_hidden_size"] = hidden_in
    out["norm_before_fc"] = getattr(fc_owner, "input_norm", None) is not None
    out["fc_norm"] = getattr(fc_owner, "fc_norm", None) is not None
    eagle = getattr(config, "eagle_config", None)
    nested = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    top = {k: getattr(config, k) for k in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")
           if isinstance(getattr(config, k, None), (list, tuple))}
    if isinstance(eagle, dict):
        out["eagle_config"] = {k: v for k, v in eagle.items() if isinstance(v, (int, float, str, bool, list))}
    if nested:
        out["aux_layer_ids"] = [int(x) for x in nested]
        out["aux_layer_ids_source"] = "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        out["aux_layer_ids"] = None
        out["aux_layer_ids_source"] = ("none in the draft config's eagle_config: SGLang uses its default "
                                       "[2, L//2, L-3] (capture indices)")
    if top:
        out["top_level_aux_layer_ids"] = {k: [int(x) for x in v] for k, v in top.items()}
        if not nested:
            state.log_once("top-level-ids", logging.WARNING,
                      "tracediff: sglang adapter: the draft config has aux layer ids at its top level (%s) but none "
                      "in eagle_config: SGLang ignores top-level ids and captures its default layers", top)
    if isinstance(out.get("aux_layer_ids"), list):
        # The target's layers_to_capture (what was really captured) is not set yet when the draft is
        # built: the layers come from the rule `tracediff preflight` applies to this target.
        out["hf_hidden_states_indices"] = fed_layers(out["aux_layer_ids"], server_args().get("model_path"),
                                                     sglang_version())
    return out


def fed_layers(ids: list[int], target_dir: Any, version: str | None) -> list[int]:
    """The HF ``hidden_states`` indices SGLang feeds for the draft config's ``ids``, ascending: the rule of
    :mod:`tracediff.adapters.engine_rules` for the target's family (read from ``target_dir``'s
    config.json when it is a local folder; else the Llama rule, SGLang's +1)."""
    from pathlib import Path  # noqa: PLC0415

    from tracediff.adapters.engine_rules import choose_rule, resolve, target_family  # noqa: PLC0415
    from tracediff.drafts import read_json_config  # noqa: PLC0415

    family = "llama"
    try:
        if target_dir and Path(str(target_dir)).is_dir():
            family = target_family(read_json_config(Path(str(target_dir)), "target"))
    except Exception:  # noqa: BLE001  (best effort: the Llama rule)
        family = "llama"
    choice = choose_rule("sglang", family, version, "installed")
    resolved = resolve(choice, {"model_type": "eagle3", "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                       None)
    # SGLang's capture index i is HF hidden_states[i]; one label per configured id, as the fc slots.
    return sorted(int(c) for c in resolved.capture)


def sglang_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("sglang")
    except Exception:  # noqa: BLE001
        return str(getattr(sys.modules.get("sglang"), "__version__", "unknown"))


def server_args() -> dict[str, Any]:
    """The speculative and capture server args, as resolved in this process (best effort)."""
    out: dict[str, Any] = {}
    sources: list[Any] = []
    try:
        from sglang.srt import runtime_context as rc  # noqa: PLC0415

        # The raw args first (they hold the resolved capture mode); the bags fill what is unset there.
        for getter in ("get_server_args", "get_spec", "get_exec"):
            try:
                sources.append(getattr(rc, getter)())
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        pass
    if not sources:
        try:
            from sglang.srt.managers.schedule_batch import global_server_args_dict  # noqa: PLC0415  (older)

            sources.append(type("Args", (), dict(global_server_args_dict)))
        except Exception:  # noqa: BLE001
            pass
    keys = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
            "speculative_num_draft_tokens", "speculative_draft_model_path", "enable_return_aux_hidden_states",
            "aux_hidden_state_capture", "return_aux_hidden_state_layer_ids", "disable_cuda_graph",
            "disable_radix_cache", "chunked_prefill_size", "device", "dtype", "kv_cache_dtype", "tp_size",
            "dp_size", "enable_dp_attention", "attention_backend", "model_path", "enable_piecewise_cuda_graph")
    for key in keys:
        for source in sources:
            try:
                value = getattr(source, key)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(value, (int, float, str, bool)):
                out[key] = value
            elif isinstance(value, (list, tuple)):
                out[key] = [v if isinstance(v, (int, float, str, bool)) else str(v) for v in value]
            elif value is not None:
                out[key] = str(getattr(value, "name", value))
            else:
                out.setdefault(key, None)
                continue  # unset here: a resolved bag may know it
            break
    on_gpu = out.get("device") in ("cuda", "musa", "hip", "npu", "xpu") or (
        out.get("device") is None and torch.cuda.is_available())
    out["cuda_graphs"] = bool(on_gpu and not out.get("disable_cuda_graph", False))
    return out


def publish_meta(state: Any, recorder: Recorder) -> None:
    """Provenance into the writer groups' ``meta`` (set before the first batch is written)."""
    meta: dict[str, Any] = {"sglang_version": sglang_version(), "server_args": server_args()}
    if state.target:
        meta["target"] = dict(state.target)
    if state.draft:
        meta["draft"] = dict(state.draft)
        draft = state.draft_module() if state.draft_module is not None else None
        hot = getattr(draft, "hot_token_id", None)
        if isinstance(hot, torch.Tensor):
            # SGLang keeps d2t as hot_token_id = d2t + arange: the file's map is hot - arange.
            flat = hot.detach().reshape(-1).long().cpu()
            meta["draft"]["d2t"] = d2t_facts(flat - torch.arange(flat.numel()), state.draft.get("vocab_size"))
        elif draft is not None:
            meta["draft"]["d2t"] = {"present": False}
    args = meta["server_args"]
    if args.get("aux_hidden_state_capture") or args.get("enable_return_aux_hidden_states"):
        ids = args.get("return_aux_hidden_state_layer_ids")
        meta["aux_layer_ids"] = ids
        meta["aux_layer_ids_source"] = ("server arg --return-aux-hidden-state-layer-ids" if ids
                                        else "SGLang default [2, L//2, L-3] (capture indices)")
    elif state.draft:
        meta["aux_layer_ids"] = state.draft.get("aux_layer_ids")
        meta["aux_layer_ids_source"] = state.draft.get("aux_layer_ids_source")
    if isinstance(state.target.get("layers_to_capture"), list):
        meta["layers_to_capture"] = state.target["layers_to_capture"]
    from tracediff.preflight import resolution_for_record  # noqa: PLC0415  (light: configs and headers only)

    # What `tracediff preflight` predicts for this draft and target, next to what SGLang captured: the
    # same rules, checked against the engine on every recording.
    predicted = resolution_for_record("sglang", args.get("speculative_draft_model_path"), args.get("model_path"),
                                      meta["sglang_version"], meta.get("layers_to_capture"))
    if predicted is not None:
        meta["preflight"] = predicted
    recorder.meta["sglang"] = meta
    if args.get("cuda_graphs"):
        state.log_once("cuda-graphs", logging.INFO,
                  "tracediff: sglang adapter: CUDA graphs are on; replayed forwards (decode, verify, draft extend) "
                  "run no Python hooks and are recorded from the tensors the graph runners receive and return")
