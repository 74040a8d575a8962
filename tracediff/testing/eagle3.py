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





def greedy_sequences(tl: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                     repetition_penalty: float = 1.0) -> list[list[int]]:
    """Each prompt continued greedily by the target ``tl`` (a TinyLlama): sequences a draft can learn
    (random tokens cannot be predicted), as greedy serving produces them. A random-weight target falls
    into short loops a draft learns from the tokens alone; ``repetition_penalty`` > 1 (HF's) keeps the
    continuation a function of the target's state, which the draft then has to read from its fc input."""
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for idx in by_length.values():  # one batched generate per prompt length: no padding
            ids = torch.tensor([list(prompts[i]) for i in idx])
            gen = tl.model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                                    pad_token_id=0, attention_mask=torch.ones_like(ids),
                                    repetition_penalty=repetition_penalty)
            for row, i in enumerate(idx):
                out[i] = gen[row].tolist()
    return out


_TRAINABLE = ("fc_weight", "q", "k", "v", "o", "gate", "up", "down", "ln_in", "ln_hidden", "ln_post", "norm",
              "lm_head")
_SAVE_NAMES = {"fc_weight": "fc.weight", "q": "{L}.self_attn.q_proj.weight", "k": "{L}.self_attn.k_proj.weight",
               "v": "{L}.self_attn.v_proj.weight", "o": "{L}.self_attn.o_proj.weight",
               "gate": "{L}.mlp.gate_proj.weight", "up": "{L}.mlp.up_proj.weight", "down": "{L}.mlp.down_proj.weight",
               "ln_in": "{L}.input_layernorm.weight", "ln_hidden": "{L}.hidden_norm.weight",
               "ln_post": "{L}.post_attention_layernorm.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}


def train_eagle3_draft(path: str | Path, tl: Any, layers: Sequence[str], sequences: Sequence[Sequence[int]], *,
                       aux_layer_ids: Sequence[int], steps: int = 300, ttt: int = 2, lr: float = 3e-3,
                       seed: int = 0, draft_vocab_size: int | None = None, where: str = "top") -> DraftSpec:
    """Write a draft to ``path`` and train it for ``steps`` Adam steps on the target's fc rows
    (``cat`` of ``layers`` of :func:`~tracediff.testing.tiny_llama.layer_states`) of ``sequences``,
    with ``ttt`` training-time-test steps (each step's loss on x_{p+2+k}), as the trainers do; then
    save the trained weights over it. With ``draft_vocab_size`` the draft keeps the most frequent
    target tokens of ``sequences`` (d2t offsets, t2d mask), as SpecForge builds its vocabulary."""
    from collections import Counter

    from tracediff.replay.draft import Eagle3Draft
    from tracediff.testing.tiny_llama import layer_states

    spec = write_eagle3_draft(path, tl.config, aux_layer_ids, where=where, seed=seed,
                              draft_vocab_size=draft_vocab_size, own_embedding=True)
    keep = None
    if draft_vocab_size is not None:
        counts = Counter(t for s in sequences for t in s)
        ordered = [t for t, _ in counts.most_common()] + [t for t in range(spec.vocab_size) if t not in counts]
        keep = torch.tensor(sorted(ordered[:draft_vocab_size]))
    draft = Eagle3Draft(spec.path)
    with torch.no_grad():
        draft.embed = tl.model.model.embed_tokens.weight.detach().clone().float()
        if keep is not None:
            draft.d2t = keep - torch.arange(keep.numel())
    params = [getattr(draft, n).requires_grad_(True) for n in _TRAINABLE]
    opt = torch.optim.Adam(params, lr=lr)
    rows = []
    with torch.no_grad():
        for s in sequences:
            states, _ = layer_states(tl, torch.tensor(list(s)))
            rows.append((torch.cat([states[n][0] for n in layers], -1).float(), torch.tensor(list(s))))
    to_draft = None
    if keep is not None:
        to_draft = torch.full((spec.vocab_size,), -1, dtype=torch.long)
        to_draft[keep] = torch.arange(keep.numel())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        fc, tokens = rows[int(torch.randint(len(rows), (1,), generator=gen))]
        n = tokens.numel()
        p = torch.arange(n)
        hidden = draft.project(fc)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        loss = torch.zeros(())
        for k in range(ttt):
            at = p + 1 + k
            ok = p + 2 + k < n
            ids = tokens[at.clamp(max=n - 1)]
            logits, hidden = draft.step(hidden, ids, p + k, keys, values, k)
            labels = tokens[(p + 2 + k).clamp(max=n - 1)]
            if to_draft is not None:
                labels = to_draft[labels]
                ok = ok & (labels >= 0)
            if ok.any():
                loss = loss + torch.nn.functional.cross_entropy(logits[ok], labels[ok].clamp(min=0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    layer = "midlayer"
    weights = {_SAVE_NAMES[n].format(L=layer): getattr(draft, n).detach().contiguous() for n in _TRAINABLE}
    weights["embed_tokens.weight"] = draft.embed.detach().contiguous()
    if keep is not None:
        weights["d2t"] = (keep - torch.arange(keep.numel())).contiguous()
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[keep] = True
        weights["t2d"] = t2d
    save_file(weights, str(spec.path / "model.safetensors"))
    return spec


def with_absolute_d2t(src: str | Path, dst: str | Path) -> Path:
    """A copy of draft ``src`` whose ``d2t`` holds the target ids themselves instead of offsets (the
    converter bug): every engine then maps draft id i to i + id_i."""
    import shutil

    from safetensors.torch import load_file

    out = Path(dst)
    if out.resolve() != Path(src).resolve():
        shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    d2t = weights["d2t"]
    weights["d2t"] = (d2t + torch.arange(d2t.numel())).contiguous()
    save_file(weights, str(out / "model.safetensors"))
    return out
__all__ = ["DraftSpec", "greedy_sequences", "train_eagle3_draft", "with_absolute_d2t", "write_eagle3_draft"]
