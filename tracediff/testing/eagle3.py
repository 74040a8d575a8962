"""EAGLE-3 draft checkpoints for tests: a config.json + model.safetensors folder that SGLang, vLLM,
SpecForge and speculators load.

The layout is the one SpecForge writes and SGLang / vLLM read (``LlamaForCausalLMEagle3``): one
decoder layer ``midlayer.*`` whose attention reads ``cat([norm(embed(x)), norm(h)])`` (q/k/v take
``2 * hidden_size`` inputs), ``fc.weight`` ``[hidden, K * target_hidden]``, ``norm.weight``,
``lm_head.weight`` ``[draft_vocab, hidden]``, and the vocabulary maps ``d2t`` (int64 offsets: draft
id i is target id ``i + d2t[i]``) and ``t2d`` (bool over the target vocabulary). The draft has no
``embed_tokens`` unless asked: the engines then share the target's. Weights are seeded random
(``torch.Generator``; the global RNG is untouched) and small enough that a forward stays finite.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class DraftSpec:
    """What :func:`write_eagle3_draft` wrote: the folder and the config facts tests assert on."""

    path: Path
    aux_layer_ids: list[int]
    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    config: dict[str, Any]


def write_eagle3_draft(
    path: str | Path,
    target_config: Any,
    aux_layer_ids: Sequence[int],
    *,
    where: str = "top",
    draft_vocab_size: int | None = None,
    norm_before_fc: bool = False,
    own_embedding: bool = False,
    naming: str = "midlayer",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    extra_config: dict[str, Any] | None = None,
) -> DraftSpec:
    """Write a one-layer EAGLE-3 draft for ``target_config`` (a transformers config or a dict).

    ``aux_layer_ids`` go where ``where`` says: ``"top"`` (``eagle_aux_hidden_state_layer_ids`` at the
    config's top level, as speculators and vLLM write it), ``"eagle_config"`` (nested, as SGLang
    reads it), ``"both"`` or ``"none"``. ``draft_vocab_size`` below the target's gives a ``d2t`` map
    of the first ids (offsets 0) and a ``t2d`` mask; ``naming="layers.0"`` writes the decoder layer
    as ``layers.0.*`` instead of ``midlayer.*``.
    """
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or 2 * hidden)
    dvocab = int(draft_vocab_size or vocab)
    ids = [int(i) for i in aux_layer_ids]
    k = len(ids)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": dvocab,
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 4096),
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if norm_before_fc:
        config["norm_before_fc"] = True
    if where in ("top", "both"):
        config["eagle_aux_hidden_state_layer_ids"] = ids
    if where in ("eagle_config", "both"):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    elif where not in ("top", "none"):
        raise ValueError(f"where must be top, eagle_config, both or none, got {where!r}")
    config.update(extra_config or {})

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        s = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return torch.empty(n).uniform_(0.5, 1.5, generator=gen).to(dtype)

    layer = "midlayer" if naming == "midlayer" else "layers.0"
    weights: dict[str, torch.Tensor] = {
        f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}.input_layernorm.weight": norm(hidden),
        f"{layer}.hidden_norm.weight": norm(hidden),
        f"{layer}.post_attention_layernorm.weight": norm(hidden),
        "fc.weight": rand(hidden, k * hidden),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(dvocab, hidden),
    }
    if norm_before_fc:
        weights["input_norm.weight"] = norm(k * hidden)
    if own_embedding:
        weights["embed_tokens.weight"] = rand(vocab, hidden, scale=1.0)
    if dvocab != vocab:
        weights["d2t"] = torch.zeros(dvocab, dtype=torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:dvocab] = True
        weights["t2d"] = t2d
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return DraftSpec(path=out, aux_layer_ids=ids, hidden_size=hidden, target_hidden_size=hidden, vocab_size=vocab,
                     draft_vocab_size=dvocab, config=config)


__all__ = ["DraftSpec", "write_eagle3_draft"]
