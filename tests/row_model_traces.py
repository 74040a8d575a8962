"""Draft-input rows of the row models of issue #52, built from real forwards of tiny transformers
models with massive activations (:func:`tracediff.testing.models.build_tiny_model`) and recorded
with tracediff's recorder into real stores.

* MTP (DeepSeek-V3 ``eh_proj``, Qwen3-Next MTP): ``cat(enorm(embed(x_{p+1})), hnorm(h_p))``; the
  head's ``enorm`` / ``hnorm`` are the framework's own RMSNorm classes
  (``DeepseekV3RMSNorm``, ``Qwen3RMSNorm``) with learned-looking weights; ``h_p`` is the last
  layer's output before the final norm (what a trainer feeds) or after it (the bug).
* EAGLE-3 with K slots: ``cat(hs_a, hs_b, ...)`` of chosen layers.

A *fault* rewrites one side's rows the way an engine would get them wrong (post-norm hidden state,
an embedding scale, a rotated target, an embedding of the wrong token); each is applied to the
model's real states, never to constants chosen for the test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import tracediff
from tracediff.store.row_model import RowModel
from tracediff.testing.models import TinyModel
from tracediff.testing.tiny_llama import layer_states

NORMS = {"deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3RMSNorm"),
         "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm")}


class MtpHead(torch.nn.Module):
    """An MTP layer's input projection, with the framework's own RMSNorm class for ``enorm`` / ``hnorm``
    (weights drawn in [0.5, 2], as the target's norms): ``eh_proj(cat(enorm(e), hnorm(h)))``."""

    def __init__(self, arch: str, hidden: int, eps: float, seed: int = 0) -> None:
        super().__init__()
        import importlib  # noqa: PLC0415

        module, name = NORMS[arch]
        norm_class = getattr(importlib.import_module(module), name)
        self.enorm, self.hnorm = norm_class(hidden, eps=eps), norm_class(hidden, eps=eps)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for norm in (self.enorm, self.hnorm):
                norm.weight.copy_(0.5 + 1.5 * torch.rand(hidden, generator=g))
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.requires_grad_(False)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))


def _labels(i: int, seq: Sequence[int], positions: Sequence[int]) -> dict:
    pos = list(positions)
    return {"seq": [i] * len(pos), "position": pos, "token_id": [seq[p] for p in pos],
            "next_token_id": [seq[p + 1] if p + 1 < len(seq) else -1 for p in pos], "phase": "train", "step": i}


def record_mtp(path: Path, model: TinyModel, seqs: Sequence[Sequence[int]], row_model: RowModel, *,
               post_norm: bool = False, embed_offset: int = 1, embed_scale: float | torch.Tensor = 1.0,
               rotation: torch.Tensor | None = None, meta: dict | None = None) -> Path:
    """Record the MTP head's input (tap ``fc_in``) for every position that has a next token.

    ``post_norm``: ``h`` after the target's final norm; ``embed_offset``: the embedding of
    ``x_{p+offset}`` (1 is right); ``embed_scale``: a factor on the embedding before ``enorm`` (the
    embedding normaliser); ``rotation``: the target's hidden states are ``h Q`` (a rotated target)."""
    hidden = model.hidden_size
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
    head = MtpHead(model.arch, hidden, eps)
    embed = model.model.model.embed_tokens
    with tracediff.record(path, role=path.stem, meta=meta or {}, on_full="block") as rec:
        rec.tap(head.eh_proj, "fc_in", row_model=row_model)
        with torch.no_grad():
            for i, seq in enumerate(seqs):
                ids = torch.tensor(list(seq))
                states, _ = layer_states(model, ids)
                h = states[f"hs{model.num_layers}" if post_norm else "pre_norm"][0]
                # Rows p = 0..T-2 (those with a next token); the embedding of x_{p+offset}, clamped
                # into the sequence (a wrong offset takes a neighbour's token, as an engine would).
                rows = torch.arange(0, len(seq) - 1)
                e = embed(ids[(rows + embed_offset).clamp(0, len(seq) - 1)]) * embed_scale
                if rotation is not None:
                    h = h @ rotation
                rec.labels(**_labels(i, seq, rows.tolist()))
                head(e, h[rows])
    return path


def record_eagle3(path: Path, model: TinyModel, seqs: Sequence[Sequence[int]], layers: Sequence[str],
                  row_model: RowModel | None, *, rotation: torch.Tensor | None = None,
                  fault: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                  meta: dict | None = None) -> Path:
    """Record an EAGLE-3 ``fc`` input ``cat(states[l] for l in layers)`` (tap ``fc_in``);
    ``rotation``: every state is ``h Q``; ``fault``: rewrites the states before they are picked."""
    hidden = model.hidden_size
    fc = torch.nn.Linear(len(layers) * hidden, hidden, bias=False).requires_grad_(False)
    with tracediff.record(path, role=path.stem, meta=meta or {}, on_full="block") as rec:
        rec.tap(fc, "fc_in", segment_size=hidden, segment_labels=list(layers), row_model=row_model)
        with torch.no_grad():
            for i, seq in enumerate(seqs):
                states, _ = layer_states(model, torch.tensor(list(seq)))
                states = {k: v[0] for k, v in states.items()}
                if fault is not None:
                    states = fault(states)
                if rotation is not None:
                    states = {k: v @ rotation for k, v in states.items()}
                rec.labels(**_labels(i, seq, range(len(seq))))
                fc(torch.cat([states[name] for name in layers], dim=-1))
    return path


def random_rotation(hidden: int, seed: int = 0) -> torch.Tensor:
    """A random orthogonal ``Q`` (QR of a Gaussian matrix, signs fixed): a QuaRot-style rotation."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(hidden, hidden, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


def gemma_scale(hidden: int) -> float:
    """Gemma's embedding normaliser, sqrt(hidden size)."""
    return math.sqrt(hidden)
