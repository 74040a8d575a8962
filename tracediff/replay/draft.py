"""An EAGLE-3 draft loaded from its checkpoint folder, and its forward, for replay.

The folder is what the trainers write and the engines load: ``config.json`` and ``*.safetensors``
(never a pickle). Both namings are read: SGLang / SpecForge (``midlayer.*``, ``fc.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional ``embed_tokens.weight``) and
speculators (``layers.0.*`` and the same others; a ``model.`` prefix is dropped). A draft without
its own ``embed_tokens`` takes the target's (``--target DIR``: its safetensors'
``model.embed_tokens.weight``), as every engine does.

The forward is the one SGLang, vLLM and SpecForge run for a Llama-layout EAGLE-3 draft: ``fc`` of
the aux concatenation (after ``input_norm`` when ``norm_before_fc`` and the rows are raw), one decoder
layer whose attention reads ``cat([input_layernorm(embed(x)), hidden_norm(h)])``, the final norm, the
lm_head over the draft vocabulary, and ``d2t`` (target id = draft id + ``d2t[id]``). Multi-step
drafting feeds the layer's pre-norm output back (post-norm with ``norm_output``), with the
training-time-test attention: step k at start p attends to the step-0 keys of positions 0..p and its
own keys of steps 1..k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from tracediff.drafts import d2t_kind, read_json_config, tensor_sha256
from tracediff.errors import UsageError

_LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer.")


@dataclass
class DraftCheckpoint:
    """What was loaded, and from where: the facts replay reports and checks against provenance."""

    path: str
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    vocab_size: int
    draft_vocab_size: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_before_fc: bool
    norm_before_residual: bool
    norm_output: bool
    embed_from: str  # "draft" | "target" | "missing"
    d2t: dict[str, Any] = field(default_factory=dict)
    naming: str = ""
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _load_weights(folder: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    from safetensors.torch import load_file  # noqa: PLC0415

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pt = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(pt)}: convert them to safetensors; tracediff never unpickles)" if pt else ""
        raise UsageError(f"{folder}: no *.safetensors file{hint}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"{f}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    return weights, [f.name for f in files]


def _config(folder: Path) -> dict[str, Any]:
    cfg = read_json_config(folder / "config.json", "draft")
    # speculators nests the transformer config
    inner = cfg.get("transformer_layer_config")
    if isinstance(inner, dict):
        cfg = {**inner, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
    return cfg


def _target_embedding(target_dir: Path | None) -> torch.Tensor | None:
    if target_dir is None:
        return None
    weights, _ = _load_weights(target_dir)
    for name in ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight",
                 "language_model.model.embed_tokens.weight"):
        if name in weights:
            return weights[name]
    raise UsageError(f"{target_dir}: no model.embed_tokens.weight in its safetensors (the draft needs the target's "
                     f"embedding)")


class Eagle3Draft(torch.nn.Module):
    """The forward of a Llama-layout EAGLE-3 draft (float32 on CPU by default)."""

    def __init__(self, folder: str | Path, target_dir: str | Path | None = None, *,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        folder = Path(folder)
        cfg = _config(folder)
        weights, files = _load_weights(folder)
        w = {}
        for name, t in weights.items():
            key = name[len("model."):] if name.startswith("model.") and not name.startswith("model.layers") else name
            w[key] = t
        prefix = next((p for p in _LAYER_PREFIXES if any(k.startswith(p) for k in w)), None)
        if prefix is None:
            raise UsageError(f"{folder}: no decoder layer in its weights (expected midlayer.* or layers.0.*)")
        layer = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
        if any(k.startswith(("layers.1.", "model.layers.1.")) for k in w):
            raise UsageError(f"{folder}: a draft with more than one decoder layer is not supported by replay")

        def need(d: dict[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
            if key not in d:
                raise UsageError(f"{folder}: weight {where}{key} is missing")
            return d[key].to(dtype)

        hidden = int(cfg.get("hidden_size") or need(w, "fc.weight", "").shape[0])
        self.fc_weight = need(w, "fc.weight", "")
        target_hidden = int(cfg.get("target_hidden_size") or hidden)
        in_features = int(self.fc_weight.shape[1])
        if in_features % target_hidden:
            raise UsageError(f"{folder}: fc.weight takes {in_features} inputs, not a multiple of target_hidden_size "
                             f"{target_hidden}")
        heads = int(cfg.get("num_attention_heads") or 0)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
        if not heads or not head_dim:
            raise UsageError(f"{folder}/config.json: num_attention_heads / head_dim missing")
        self.q = need(layer, "self_attn.q_proj.weight", prefix)
        self.k = need(layer, "self_attn.k_proj.weight", prefix)
        self.v = need(layer, "self_attn.v_proj.weight", prefix)
        self.o = need(layer, "self_attn.o_proj.weight", prefix)
        self.gate = need(layer, "mlp.gate_proj.weight", prefix)
        self.up = need(layer, "mlp.up_proj.weight", prefix)
        self.down = need(layer, "mlp.down_proj.weight", prefix)
        self.ln_in = need(layer, "input_layernorm.weight", prefix)
        self.ln_hidden = need(layer, "hidden_norm.weight", prefix)
        self.ln_post = need(layer, "post_attention_layernorm.weight", prefix)
        self.norm = need(w, "norm.weight", "")
        self.lm_head = need(w, "lm_head.weight", "")
        self.input_norm = w["input_norm.weight"].to(dtype) if "input_norm.weight" in w else None
        self.eps = float(cfg.get("rms_norm_eps") or 1e-6)
        eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        self.norm_before_fc = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))) or (
            self.input_norm is not None)
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.norm_output = bool(cfg.get("norm_output", False))
        vocab = int(cfg.get("vocab_size") or 0)
        dvocab = int(self.lm_head.shape[0])
        if "embed_tokens.weight" in w:
            self.embed = w["embed_tokens.weight"].to(dtype)
            embed_from = "draft"
        else:
            emb = _target_embedding(Path(target_dir) if target_dir is not None else None)
            self.embed = emb.to(dtype) if emb is not None else None
            embed_from = "target" if emb is not None else "missing"
        vocab = vocab or (int(self.embed.shape[0]) if self.embed is not None else dvocab)
        d2t = w.get("d2t")
        d2t_info: dict[str, Any] = {"present": d2t is not None}
        if d2t is not None:
            d2t = d2t.long().reshape(-1)
            if d2t.numel() != dvocab:
                raise UsageError(f"{folder}: d2t has {d2t.numel()} entries, lm_head {dvocab} rows")
            d2t_info.update({"size": int(d2t.numel()), "sha256": tensor_sha256(d2t),
                             "kind": d2t_kind(d2t, vocab, w.get("t2d"))})
        elif dvocab != vocab:
            raise UsageError(f"{folder}: the draft vocabulary ({dvocab}) is smaller than the target's ({vocab}) but "
                             f"there is no d2t map")
        self.d2t = d2t
        self.vocab = vocab
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.inv_freq = _inv_freq(cfg, head_dim)
        self.info = DraftCheckpoint(
            path=str(folder), hidden_size=hidden, target_hidden_size=target_hidden,
            num_aux=in_features // target_hidden, vocab_size=vocab, draft_vocab_size=dvocab, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, norm_before_fc=self.norm_before_fc,
            norm_before_residual=self.norm_before_residual, norm_output=self.norm_output, embed_from=embed_from,
            d2t=d2t_info, naming=prefix.rstrip("."), files=files)

    # ------------------------------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * weight

    def project(self, fc_in: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """``fc`` of the recorded fc input rows (``raw``: rows from before ``input_norm``)."""
        x = fc_in.to(self.fc_weight.dtype)
        if raw and self.input_norm is not None:
            x = self._rms(x, self.input_norm)
        return x @ self.fc_weight.T

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            raise UsageError(f"{self.info.path}: the draft has no embed_tokens; pass --target TARGET_DIR (the target "
                             f"model's folder) for its embedding")
        if int(ids.max()) >= self.embed.shape[0] or int(ids.min()) < 0:
            raise UsageError(f"token id {int(ids.max())} is outside the embedding ({self.embed.shape[0]} rows): the "
                             f"trace was recorded with another tokenizer")
        return self.embed[ids]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [N, D/2]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        cos = torch.cat([cos, cos], -1)[:, None, :]
        sin = torch.cat([sin, sin], -1)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
             keys: list[torch.Tensor], values: list[torch.Tensor], step: int,
             starts: torch.Tensor | None = None, query: torch.Tensor | None = None,
             block: int = 1024, taps: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step over this step's input rows.

        Step 0 takes every row of a sequence (row p is start p) and appends every row's key/value, but
        runs the rest of the layer (attention, MLP, norm, lm_head) only for the rows ``query`` (default
        all): the rows to score. A later step takes the starts ``starts`` (row indices of step 0), each
        attending to the step-0 keys of rows 0..start and its own keys of steps 1..k. ``hidden`` is
        ``fc``'s output at step 0 and the previous step's fed-back state later. Returns (logits over the
        draft vocabulary, fed-back state) of the query rows. ``taps``, when given, receives the query
        rows' points of the draft chain (docs/draft-chain.md): ``layer_in`` (``cat(embed(token), hidden
        state)``), ``layer_out`` (the decoder layer's output), ``norm_out`` (the final norm's)."""
        n = hidden.shape[0]
        emb = self._rms(self.embed_ids(ids), self.ln_in)
        h_norm = self._rms(hidden, self.ln_hidden)
        x = torch.cat([emb, h_norm], -1)
        k = self._rope((x @ self.k.T).view(n, self.kv_heads, self.head_dim), positions)
        v = (x @ self.v.T).view(n, self.kv_heads, self.head_dim)
        keys.append(k)
        values.append(v)
        qi = torch.arange(n) if query is None else query.reshape(-1).long()
        m = qi.numel()
        xq, hq = x[qi], hidden[qi]
        residual = h_norm[qi] if self.norm_before_residual else hq
        q = self._rope((xq @ self.q.T).view(m, self.heads, self.head_dim), positions[qi])
        kk = torch.cat(keys, 0).transpose(0, 1)  # [kv, n0 + step * n, D]
        vv = torch.cat(values, 0).transpose(0, 1)
        rep = self.heads // self.kv_heads
        if rep > 1:
            kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
        n0 = keys[0].shape[0]
        start_rows = qi if starts is None else starts.reshape(-1).long()[qi]
        out = torch.empty(m, self.heads, self.head_dim, dtype=q.dtype)
        scale = 1.0 / math.sqrt(self.head_dim)
        for first in range(0, m, block):
            last = min(m, first + block)
            rows = start_rows[first:last]
            allowed = [torch.arange(n0)[None, :] <= rows[:, None]]  # step-0 keys of rows 0..start
            own = torch.arange(n)[None, :] == qi[first:last][:, None]
            allowed += [own] * step  # its own keys of steps 1..k
            mask = torch.cat(allowed, 1)
            att = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), kk, vv, attn_mask=mask[None],
                                                 scale=scale)
            out[first:last] = att.transpose(0, 1)
        h = residual + out.reshape(m, -1) @ self.o.T
        residual = h
        h2 = self._rms(h, self.ln_post)
        h = residual + (F.silu(h2 @ self.gate.T) * (h2 @ self.up.T)) @ self.down.T
        normed = self._rms(h, self.norm)
        logits = normed @ self.lm_head.T
        if taps is not None:
            taps.update(layer_in=torch.cat([self.embed_ids(ids[qi]), hq], -1), layer_out=h, norm_out=normed)
        return logits, (normed if self.norm_output else h)


def replay_dtype(name: str, folder: str | Path) -> torch.dtype:
    """The dtype replay runs a checkpoint in (``--replay-dtype``; auto: its fc weight's, bf16 / fp16 as bf16)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name != "auto":
        raise UsageError(f"--replay-dtype {name!r}: auto, float32 or bfloat16")
    from safetensors import safe_open  # noqa: PLC0415

    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                if key.endswith("fc.weight"):
                    return torch.bfloat16 if st.get_slice(key).get_dtype() in ("BF16", "F16") else torch.float32
    return torch.float32


def _inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"
    if kind == "default":
        return inv
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, scaled)
    if kind == "linear":
        return inv / float(scaling["factor"])
    raise UsageError(f"rope scaling {kind!r} of the draft config is not supported by replay (default, linear, llama3)")


__all__ = ["DraftCheckpoint", "Eagle3Draft", "replay_dtype"]
