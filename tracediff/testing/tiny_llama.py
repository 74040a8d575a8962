"""Realistic EAGLE-3 fc-input traces from a tiny, real transformers Llama (random weights, no download).

Why this exists: tracediff's tests, benchmarks and shipped samples need rows that look like what a
trainer and an inference server really feed an EAGLE-3 draft's ``fc`` layer, with the same failure
modes, without a GPU or a checkpoint. Mocked tensors would not have the properties compare relies on
(adjacent layers correlate at cosine ~0.8-0.95, norms grow with depth, pre- vs post-final-norm
differ in scale and direction, KV-cached decode reproduces the full forward only up to fp32 noise),
so every state here comes from a real ``transformers.LlamaForCausalLM`` forward.

Layer naming follows Hugging Face's ``output_hidden_states`` numbering (FRAMEWORKS.md):

* ``"hs0"``: the embedding output;
* ``"hs{i}"`` for ``1 <= i < L``: the output of decoder layer ``i - 1``;
* ``"hs{L}"``: what HF returns last, i.e. the final layer's output AFTER ``model.model.norm``;
* ``"pre_norm"``: the final layer's output BEFORE the final norm (``norm(pre_norm) == hs{L}``),
  which HF does not return and SGLang-style servers capture instead.

This module holds the target model (:func:`build_tiny_llama`, :func:`layer_states`), the draft
stand-in (:class:`DraftHead`) and the data (:func:`make_sequences`); the trainer-like and
engine-like runs that turn them into labelled rows are in :mod:`tracediff.testing.pipelines`.

Everything is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    # transformers costs seconds to import: the functions that build or run a model import it, so
    # importing this module (every test module does, at collection) stays cheap.
    from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

__all__ = [
    "DraftHead",
    "TinyLlama",
    "build_tiny_llama",
    "instantiate_model",
    "layer_states",
    "make_sequences",
    "new_cache",
    "select",
    "state_names",
]


@dataclass
class TinyLlama:
    """A tiny random-weight Llama target model and the facts the helpers need about it.

    ``model`` is in eval mode; its dtype is the one given to :func:`build_tiny_llama` (fp32 by
    default, so that cached and uncached forwards agree to ~1e-6). Any Hugging Face decoder-only
    causal LM with the Llama layout (``model.model.embed_tokens``, ``.layers``, ``.norm``) works
    here; :mod:`tracediff.testing.models` builds other architectures into this class.
    """

    model: PreTrainedModel
    hidden_size: int
    num_layers: int
    vocab_size: int = 512
    seed: int = 0

    @property
    def config(self) -> PretrainedConfig:
        """The model's config, e.g. a ``LlamaConfig`` (handy to build a ``DynamicCache(config=...)``)."""
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's parameters (states come out in this dtype)."""
        return self.model.model.embed_tokens.weight.dtype

    def state_names(self) -> list[str]:
        """Every key :func:`layer_states` returns, in depth order: ``hs0..hs{L}``, then ``pre_norm``."""
        return state_names(self.num_layers)


def state_names(num_layers: int) -> list[str]:
    """The state keys of a model with ``num_layers`` decoder layers (see the module docstring)."""
    return [f"hs{i}" for i in range(num_layers + 1)] + ["pre_norm"]


def build_tiny_llama(
    hidden_size: int = 64,
    num_layers: int = 8,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    norm_weight_range: tuple[float, float] = (0.5, 2.0),
) -> TinyLlama:
    """Build a tiny ``LlamaForCausalLM`` from a config with seeded random weights (no download).

    Every RMSNorm weight (per layer input/post-attention norms and the final norm) is redrawn
    uniformly in ``norm_weight_range`` per channel: HF initialises them to ones, which would make
    the final norm a pure rescale, so pre-norm and post-norm states would differ only in scale and
    a swapped pre/post-norm tap would be undetectable by direction. Trained models have far from
    unit norm weights; non-unit weights make the two differ in scale AND direction (cosine ~0.95).

    The global torch RNG is left untouched (the build runs under ``fork_rng``), so building a model
    in a test does not change the random numbers of the code around it.
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    if hidden_size % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 (4 attention heads), got {hidden_size}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    # sdpa is HF's default on CPU; pinned so that results do not depend on what happens to be
    # installed (flash/flex kernels would change the numerics of cached vs uncached forwards).
    config._attn_implementation = "sdpa"
    model = instantiate_model(LlamaForCausalLM, config, seed, dtype, norm_weight_range=norm_weight_range)
    return TinyLlama(model=model, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, seed=seed)


def instantiate_model(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    seed: int,
    dtype: torch.dtype,
    *,
    norm_weight_range: tuple[float, float],
) -> PreTrainedModel:
    """``model_class(config)`` with seeded random weights, every RMSNorm weight redrawn, eval mode.

    Each RMSNorm weight is redrawn uniformly in ``norm_weight_range`` per channel (see
    :func:`build_tiny_llama` for why). Runs under ``fork_rng``: the global torch RNG is untouched.
    """
    low, high = norm_weight_range
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    weight = module.weight
                    weight.copy_(torch.empty(weight.shape).uniform_(low, high, generator=gen))
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def new_cache(tl: TinyLlama) -> DynamicCache:
    """An empty KV cache for ``tl``'s model (one per request, as an engine keeps one per request)."""
    from transformers import DynamicCache  # noqa: PLC0415

    try:
        return DynamicCache(config=tl.config)
    except TypeError:  # transformers 4.x before DynamicCache took a config
        return DynamicCache()


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """``[T]`` -> ``[1, T]``; ``[B, T]`` unchanged (HF wants a batch dimension)."""
    return t.unsqueeze(0) if t.dim() == 1 else t


@torch.no_grad()
def layer_states(
    tl: TinyLlama,
    input_ids: torch.Tensor,
    past_key_values: DynamicCache | None = None,
    position_ids: torch.Tensor | None = None,
    use_cache: bool = False,
) -> tuple[dict[str, torch.Tensor], DynamicCache | None]:
    """Every hidden state of the target for ``input_ids`` (``[B, T]`` or ``[T]``).

    Returns ``(states, past)``: ``states`` maps ``"hs0".."hs{L}"`` (HF numbering, ``hs{L}``
    post-final-norm as HF gives it) and ``"pre_norm"`` to ``[B, T, H]`` tensors; ``past`` is the KV
    cache after this forward (``None`` when no cache was given and ``use_cache`` is false).

    A given ``past_key_values`` is extended in place with these tokens (transformers 5 updates any
    cache it is handed); ``use_cache=True`` without one starts a fresh ``DynamicCache``. When
    ``position_ids`` is ``None``, transformers numbers the tokens from the cache length, which is
    right for continuing one sequence. Runs the base ``LlamaModel`` only (no ``lm_head``): the
    logits are not needed for fc inputs.
    """
    ids = _as_2d(input_ids)
    if position_ids is not None:
        position_ids = _as_2d(position_ids)
    if use_cache and past_key_values is None:
        past_key_values = new_cache(tl)
    captured: list[torch.Tensor] = []

    def _capture_pre_norm(_module: nn.Module, _args: Any, output: Any) -> None:
        # LlamaDecoderLayer returns a tensor in transformers 5; older versions (and some other
        # decoder layers) return a tuple whose first element is the hidden states.
        captured.append(output[0] if isinstance(output, tuple) else output)

    handle = tl.model.model.layers[-1].register_forward_hook(_capture_pre_norm)
    try:
        out = tl.model.model(
            input_ids=ids,
            position_ids=position_ids,
            past_key_values=past_key_values,
            # Always an explicit bool: None would fall back to config.use_cache (True) and make
            # transformers allocate a cache nobody asked for.
            use_cache=bool(use_cache or past_key_values is not None),
            output_hidden_states=True,
        )
    finally:
        handle.remove()
    hidden = out.hidden_states
    if len(hidden) != tl.num_layers + 1 or len(captured) != 1:
        raise RuntimeError(
            f"expected {tl.num_layers + 1} hidden states and one pre-norm capture, got {len(hidden)} "
            f"and {len(captured)}: has the transformers Llama layout changed?"
        )
    states = {f"hs{i}": h for i, h in enumerate(hidden)}
    states["pre_norm"] = captured[0]
    return states, past_key_values


def select(states: dict[str, torch.Tensor], layers: Sequence[str]) -> torch.Tensor:
    """The EAGLE-3 fc input: ``cat([states[n] for n in layers], -1)``, in the order given.

    The order matters (it is what the draft learned), so it is kept as given, never sorted.
    """
    missing = [n for n in layers if n not in states]
    if missing:
        raise KeyError(f"unknown state(s) {missing}; available: {list(states)}")
    if not layers:
        raise ValueError("select needs at least one layer name")
    return torch.cat([states[n] for n in layers], dim=-1)


class DraftHead(nn.Module):
    """Stand-in for an EAGLE-3 draft: only its ``fc = nn.Linear(k * H, H)`` layer.

    tracediff taps ``draft.fc``'s input, so nothing else of the draft matters here. ``bias=False``
    mirrors SGLang's and SpecForge's default EAGLE-3 ``fc``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_segments: int = 3,
        *,
        bias: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_segments = num_segments
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc = nn.Linear(num_segments * hidden_size, hidden_size, bias=bias, dtype=dtype)
        self.requires_grad_(False)
        self.eval()

    def forward(self, fc_input: torch.Tensor) -> torch.Tensor:
        """``fc(fc_input)``: ``[..., k * H] -> [..., H]``."""
        return self.fc(fc_input)


def make_sequences(
    n_seqs: int = 4,
    min_len: int = 12,
    max_len: int = 40,
    vocab_size: int = 512,
    seed: int = 0,
) -> list[list[int]]:
    """``n_seqs`` random token sequences of varied lengths in ``[min_len, max_len]``.

    Lengths are spread evenly over the range (then shuffled) rather than drawn independently, so
    that even a handful of sequences has really different lengths: ragged batches and sequences
    that finish at different times are the point of the engine imitation.
    """
    if not 2 <= min_len <= max_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = np.random.default_rng(seed)
    lengths = np.linspace(min_len, max_len, num=n_seqs).round().astype(np.int64)
    rng.shuffle(lengths)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]
