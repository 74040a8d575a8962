"""A tiny DeepSeek-V3 target with one MTP layer, for tests, and the MTP head's input rebuilt from it.

:func:`write_deepseek_mtp` writes a ``config.json`` + ``model.safetensors`` folder that vLLM serves
with ``{"method": "mtp"}`` (``num_nextn_predict_layers`` = 1) and transformers loads as
``DeepseekV3ForCausalLM``: ``model.layers.0-3`` the target (layer 0 dense, the others a shared
expert and 4 routed ones), ``model.layers.4.*`` the MTP layer as DeepSeek ships it (``enorm``,
``hnorm``, ``eh_proj`` ``[H, 2H]``, a decoder block, ``shared_head.norm`` / ``shared_head.head``,
``embed_tokens``). vLLM's CPU MLA accepts only ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64
(``vllm/v1/attention/backends/cpu_mla.py``); every other size is tiny. Two lm_head rows are scaled
up (one the negative of the other) so that the target's greedy choice falls on one of two tokens and
an MTP head sharing that lm_head (vLLM swaps the checkpoint's head for the target's) is accepted
part of the time: verify batches then hold accepted and rejected rows.

:func:`mtp_head_inputs` is the reference: a real transformers forward of the target from the same
checkpoint gives the hidden state of each position before and after its final norm, and the MTP
layer's own ``enorm`` / ``hnorm`` weights and the embedding build ``[enorm(embed(x_{p+1})) |
hnorm(h_p)]`` per position p, as a trainer of the MTP head feeds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

HIDDEN, LAYERS, VOCAB = 128, 4, 256
FAVOURED = (7, 9)
#: The MTP layer's own tensors, next to the decoder block it shares the target's layout with.
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight")


def _config(num_layers: int) -> Any:
    from transformers import DeepseekV3Config  # noqa: PLC0415

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, max_position_embeddings=4096, tie_word_embeddings=False,
        num_nextn_predict_layers=1, rope_scaling=None)


def write_deepseek_mtp(path: str | Path, *, seed: int = 0, favour_scale: float = 40.0) -> Path:
    """Write the checkpoint to ``path`` (created); returns it."""
    from transformers import DeepseekV3ForCausalLM  # noqa: PLC0415

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # One more layer than the target: the MTP layer's decoder block is layer LAYERS of this model
    # (same type as vLLM builds for that index: a MoE layer).
    config = _config(LAYERS + 1)
    full = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norms that are not the identity
        # A final norm far from the identity, as trained models have (weights spread over ~[0.2, 5]):
        # the hidden state before and after it then differ in direction, not only in scale.
        full.model.norm.weight.copy_(torch.exp(0.8 * torch.randn_like(full.model.norm.weight)))
        head = full.lm_head.weight
        a, b = FAVOURED
        head[a] *= favour_scale
        head[b] = -head[a]
    state = {k: v.detach().clone().contiguous() for k, v in full.state_dict().items()}
    out = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{LAYERS}.")}
    gen = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{LAYERS}."
    for key, value in state.items():
        if key.startswith(prefix):
            out[key] = value
    out[prefix + "enorm.weight"] = 1.0 + 0.2 * torch.randn(HIDDEN, generator=gen)
    out[prefix + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(HIDDEN, generator=gen)
    out[prefix + "eh_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / (2 * HIDDEN) ** 0.5
    out[prefix + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen)
    out[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    out[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(_per_expert(out), str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(LAYERS).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["torch_dtype"] = "float32"
    # How transformers' DeepseekV3 routes (sigmoid scores, the correction bias), said the way
    # DeepSeek's own config.json says it, which vLLM reads.
    cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 holds routed experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]); DeepSeek's checkpoints, which vLLM loads, name each: ``experts.{e}.gate_proj.weight`` ..."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj"):
            base, half = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :half].contiguous()
                out[f"{base}{e}.up_proj.weight"] = value[e, half:].contiguous()
        elif key.endswith("experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[key] = value.contiguous()
    return out


def _fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors fused back as transformers 5 holds them."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in state.items():
        match = re.match(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
        if match:
            experts.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = value
        else:
            out[key] = value
    for base, per in experts.items():
        order = sorted(per)
        out[base + "gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order])
        out[base + "down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    return out


def _target(path: Path) -> Any:
    from transformers import DeepseekV3ForCausalLM  # noqa: PLC0415

    weights = load_file(str(path / "model.safetensors"))
    model = DeepseekV3ForCausalLM(_config(LAYERS)).eval()
    target = _fused({k: v for k, v in weights.items() if not k.startswith(f"model.layers.{LAYERS}.")})
    missing, unexpected = model.load_state_dict(target, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{path}: the target's weights do not fit DeepseekV3ForCausalLM: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return model, weights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def greedy_continuation(path: str | Path, sequences: Sequence[Sequence[int]], new_tokens: int = 1) -> list[list[int]]:
    """Each sequence followed by the target's ``new_tokens`` greedy tokens (a transformers forward)."""
    model, _ = _target(Path(path))
    out = []
    with torch.no_grad():
        for ids in sequences:
            ids = list(ids)
            for _ in range(new_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids)
    return out


def target_hidden_states(path: str | Path, sequences: Sequence[Sequence[int]], *,
                         final_norm: str = "post") -> list[torch.Tensor]:
    """Per sequence: the target's last hidden state at every position ``[n, H]`` (float32), taken
    ``final_norm="post"`` (after the target's final norm) or ``"pre"`` (before it), from a
    transformers forward of the checkpoint."""
    if final_norm not in ("pre", "post"):
        raise ValueError(f"final_norm must be 'pre' or 'post', not {final_norm!r}")
    model, _ = _target(Path(path))
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    out: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for ids in sequences:
                captured.clear()
                post = model.model(input_ids=torch.tensor([list(ids)], dtype=torch.long)).last_hidden_state[0]
                out.append((captured[0][0] if final_norm == "pre" else post).float())
    finally:
        hook.remove()
    return out


def mtp_head_inputs(path: str | Path, sequences: Sequence[Sequence[int]], *, final_norm: str = "post",
                    zero_position0: bool = False) -> list[torch.Tensor]:
    """Per sequence of token ids x_0..x_{n-1}: the MTP head's input rows ``[n - 1, 2H]`` (float32),
    row p = ``[enorm(embed(x_{p+1})) | hnorm(h_p)]`` for p = 0..n-2, ``h_p`` the target's last hidden
    state at p taken ``final_norm="post"`` (after the target's final norm) or ``"pre"`` (before it).
    ``zero_position0`` zeroes the embedding half of row 0 (what vLLM's MTP layer feeds)."""
    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    eps = float(_config(LAYERS).rms_norm_eps)
    prefix = f"model.layers.{LAYERS}."
    embed = weights["model.embed_tokens.weight"]
    out: list[torch.Tensor] = []
    for ids, hidden in zip(sequences, target_hidden_states(path, sequences, final_norm=final_norm), strict=True):
        e = embed[torch.tensor(list(ids)[1:], dtype=torch.long)].float()
        if zero_position0:
            e[0] = 0.0
        out.append(torch.cat([_rms_norm(e, weights[prefix + "enorm.weight"], eps),
                              _rms_norm(hidden[:-1], weights[prefix + "hnorm.weight"], eps)], dim=-1))
    return out
