"""Tiny target models of several architectures with the statistics of trained LLMs (random weights).

Why this exists: :mod:`tracediff.testing.tiny_llama` gives real transformers forwards, but a
random-weight model lacks properties of real targets that decide how hard a trainer-vs-server
comparison is, so decision thresholds tuned on it would be wrong on real recordings:

* **Massive activations.** From an early layer on, trained LLMs carry 2-3 fixed hidden dimensions
  at 100-1000x the median magnitude on (almost) every token, and the residual stream keeps them to
  the last layer. They dominate any raw cosine: two *different* layers of a real model agree at
  cosine 0.98-0.9995, so a raw cosine cannot tell "same layer, other numerics" from "wrong layer".
  Here persistent forward hooks on the decoder layers from :data:`MASSIVE_LAYER` on add them: they
  are part of the model object, so every forward (trainer, engine, KV-cached or not, a bank
  recording) gets them, and what they add is a function of that token's hidden state only (never
  of the position or an RNG), so a cached decode still reproduces the full forward to fp32 noise.
* **Uneven dimensions and non-unit norm weights.** Trained residual dimensions differ several-fold
  in spread (what per-dimension standardisation is for); RMSNorm weights are redrawn per channel
  as in :func:`~tracediff.testing.tiny_llama.build_tiny_llama`.
* **Server numerics.** :func:`server_model` gives the copy an inference server would run: bf16
  compute everywhere, optionally with fp8 (e4m3) weights in the decoder layers, whose drift from
  the fp32 trainer is several times the bf16 one.

At hidden size 64 the first two properties need help that a 4096-wide model does not (see
:func:`build_tiny_model`): the massive values are re-topped at every layer so that they keep
their ratio to the growing median, and the layers reading the residual get input columns scaled
as training would adapt them, so that the massive dimensions do not drown the others in the norms.

:func:`build_tiny_model` builds Llama, Qwen3 (q/k norms), Mistral (GQA 4:1, sliding-window KV
cache) and DeepSeek-V3 (multi-head latent attention, group-limited routed mixture of experts) from
their real transformers classes into a :class:`TinyModel`, a
:class:`~tracediff.testing.tiny_llama.TinyLlama`, so ``layer_states`` and the pipelines of
:mod:`tracediff.testing.pipelines` (``run_trainer``, ``run_engine``) work on all of them unchanged. No download, CPU only; the global torch RNG is never
touched.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    # transformers is imported where a model is built (seconds at import: test collection stays cheap).
    from transformers import PretrainedConfig, PreTrainedModel

from tracediff.testing.tiny_llama import TinyLlama, instantiate_model, layer_states

__all__ = [
    "ARCHITECTURES",
    "COMPUTES",
    "DEEP_LAYERS",
    "MASSIVE_LAYER",
    "MassiveActivations",
    "TinyModel",
    "build_deep_model",
    "build_tiny_model",
    "sglang_default_layers",
    "server_model",
]

#: The architectures :func:`build_tiny_model` builds.
ARCHITECTURES = ("llama", "qwen3", "mistral", "deepseek_v3")
#: Real EAGLE-3 target depths per architecture: Llama-3.1-8B (32 layers), Qwen3-8B (36), Mistral-Nemo
#: (40), DeepSeek-V3 / Kimi-K2.5 (61).
DEEP_LAYERS = {"llama": 32, "qwen3": 36, "mistral": 40, "deepseek_v3": 61}
#: The server numerics :func:`server_model` imitates.
COMPUTES = ("fp32", "bf16", "fp8")
#: Attention head size of every architecture (query/key/value; DeepSeek's MLA splits it 8 + 8).
HEAD_DIM = 16
#: The decoder layer whose output first carries the massive activations: they show from state
#: ``hs{MASSIVE_LAYER + 1}`` on (HF numbering), as in trained models from layer 1 or 2 on.
MASSIVE_LAYER = 1

# Size of each massive dimension in units of the median |h| of the other dimensions, held at every
# layer from MASSIVE_LAYER on; one negative, as in real models. At hidden size 64 the window is
# narrow: >= 100x the median on any batch of sequences, yet small enough that the other 62
# dimensions still move the raw cosine of adjacent layers below 0.9995.
_MASSIVE_GAINS = (145.0, -140.0)
# Relative token-dependent variation of the massive values (a few %, as in real models).
_MASSIVE_WOBBLE = 0.04
# The calibration batch: the median of a sequence's states varies by ~25% from one sequence to the
# next (attention mixes a sequence-level common part into every token), so calibrate on several.
_CALIBRATION_SHAPE = (16, 24)
# Per-dimension spread of the residual stream, log-uniform in this range, as trained models' uneven
# dimensions. It also makes the median |h| small next to the rms, as in a wide model, which widens
# the window of _MASSIVE_GAINS. Applied to the output rows of the embedding and every writer.
_DIM_SCALE_RANGE = (1 / 5, 5.0)
# Parameters that write the residual stream (names relative to a decoder layer): their output rows
# are dimension -2 (nn.Linear and stacked experts alike).
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
# Parameters of a decoder layer that read its normed input (names relative to the layer): the ones
# whose input columns a trained model adapts to the massive dimensions.
_RESIDUAL_READERS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "q_a_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "mlp.gate.weight",
    "experts.gate_up_proj",
)
# Largest finite float8_e4m3fn value: the absmax scale maps each output channel's largest weight there.
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@dataclass(frozen=True)
class MassiveActivations:
    """Where the massive activations are, how large, and how the model was adapted to them.

    Decoder layer ``layer + i`` adds ``increments[i][j] * (1 + wobble * tanh(p_j . h / rms(h_rest)))``
    to dimension ``dims[j]`` of its output ``h`` (``p_j`` a seeded unit vector over the other
    dimensions, ``h_rest`` those dimensions of ``h``): a large constant plus a small
    token-dependent part, a deterministic function of that token's state. The first layer creates
    them; each later one adds what keeps them at a fixed multiple of the median of the other
    dimensions, which grows with depth. ``dim_spreads[d]`` is the factor residual dimension ``d``
    got; ``reader_scales[i]`` the factor of the other dimensions' input columns in decoder layer
    ``layer + 1 + i`` (see :func:`build_tiny_model`).
    """

    layer: int
    dims: tuple[int, ...]
    increments: tuple[tuple[float, ...], ...]
    wobble: float
    dim_spreads: tuple[float, ...]
    reader_scales: tuple[float, ...]


@dataclass
class TinyModel(TinyLlama):
    """A :class:`TinyLlama` of any architecture in :data:`ARCHITECTURES`, with its massive activations.

    ``massive`` is ``None`` for a plain model (``massive=False``); ``compute`` says which server
    numerics :func:`server_model` gave it (``"fp32"`` for a model as built).
    """

    arch: str = "llama"
    massive: MassiveActivations | None = None
    compute: str = "fp32"


class _MassiveActivationHook:
    """Forward hook adding one layer's share of the massive activations (see :class:`MassiveActivations`).

    A plain object (not a closure) so that ``copy.deepcopy`` of the model copies it with the model.
    Computes in fp32 and returns the layer's dtype, so a bf16 server rounds the sums as it would.
    """

    def __init__(self, dims: torch.Tensor, increments: torch.Tensor, probes: torch.Tensor, wobble: float) -> None:
        self.dims = dims
        self.increments = increments.to(torch.float32)
        # [len(dims), H] unit rows, zero on the massive dimensions: the variation follows the others.
        self.probes = probes.to(torch.float32)
        self.num_rest = probes.shape[-1] - len(dims)
        self.wobble = wobble

    def add(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` with this layer's massive increments added."""
        h = hidden.to(torch.float32)
        dims = self.dims.to(h.device)
        rest_energy = h.pow(2).sum(-1, keepdim=True) - h[..., dims].pow(2).sum(-1, keepdim=True)
        rms_rest = (rest_energy / self.num_rest).clamp_min(1e-24).sqrt()
        variation = torch.tanh(h @ self.probes.to(h.device).T / rms_rest)
        added = self.increments.to(h.device) * (1 + self.wobble * variation)
        return h.index_add(-1, dims, added).to(hidden.dtype)

    def __call__(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (self.add(output[0]), *output[1:])
        return self.add(output)


def _config(
    arch: str, hidden_size: int, num_layers: int, vocab_size: int, every_expert: bool = False
) -> tuple[type[PreTrainedModel], PretrainedConfig]:
    """The model class and a tiny config of ``arch``: head size :data:`HEAD_DIM`, GQA as the architecture has it."""
    from transformers import (  # noqa: PLC0415
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    heads = hidden_size // HEAD_DIM
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(num_key_value_heads=heads // 2, **common)
    if arch == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(
            num_key_value_heads=heads // 2, head_dim=HEAD_DIM, use_sliding_window=False, **common
        )
    if arch == "mistral":
        # GQA 4:1 as Mistral 7B (32:8); a window as long as the positions, so it never cuts
        # attention, but the KV cache runs transformers' sliding-window layers.
        return MistralForCausalLM, MistralConfig(
            num_key_value_heads=max(1, heads // 4), head_dim=HEAD_DIM, sliding_window=4096, **common
        )
    if arch == "deepseek_v3":
        # MLA with compressed q/kv latents and a small decoupled RoPE part; layer 0 dense, the
        # others a shared expert plus 8 routed ones in 2 groups, group-limited as V3 routes: a
        # token takes the group with the best top-2 score sum, then its top 4 (here: all 4) experts.
        # That decision rarely flips under bf16 rounding; plain top-4 of 8 flipped 1-3% of the
        # tokens per layer, each flip moving that token's state by ~30%, which swamped the bf16
        # drift of all other tokens (real MoE servers do flip some routes; this keeps it rare).
        return DeepseekV3ForCausalLM, DeepseekV3Config(
            num_key_value_heads=heads,
            q_lora_rank=hidden_size // 2,
            kv_lora_rank=hidden_size // 2,
            qk_rope_head_dim=HEAD_DIM // 2,
            qk_nope_head_dim=HEAD_DIM // 2,
            v_head_dim=HEAD_DIM,
            moe_intermediate_size=hidden_size // 2,
            n_routed_experts=8,
            num_experts_per_tok=8 if every_expert else 4,
            n_group=1 if every_expert else 2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            **common,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_tiny_model(
    arch: str,
    hidden_size: int = 64,
    num_layers: int = 8,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    massive: bool = True,
    norm_weight_range: tuple[float, float] = (0.5, 2.0),
    every_expert: bool = False,
) -> TinyModel:
    """Build a tiny ``arch`` model (one of :data:`ARCHITECTURES`) with seeded random weights.

    Every RMSNorm weight (Qwen3's q/k norms and DeepSeek's latent norms included) is redrawn
    uniformly in ``norm_weight_range`` per channel. ``hidden_size`` must be a multiple of
    ``2 * HEAD_DIM`` (32). With ``massive=False`` that is all: the plain random model (for
    ``"llama"`` the very weights of :func:`~tracediff.testing.tiny_llama.build_tiny_llama`).

    With ``massive`` (the default), as a trained model, calibrated on seeded tokens at build time
    (:attr:`TinyModel.massive` records the result):

    * each residual dimension gets its own spread, log-uniform in [1/5, 5];
    * two fixed (seeded) dimensions carry ~145x and ~-140x the median |h| of the others on every
      token from decoder layer :data:`MASSIVE_LAYER`'s output on (hooks, see the module docstring);
    * every later layer's residual readers (q/k/v or MLA's down-projections, gate/up, router,
      experts) get the input columns of the other dimensions scaled by how much the massive ones
      inflate the rms in the layer's input norms (~10x at this width), so that the layers still
      do token-dependent work instead of mapping every token to about the same update.

    ``every_expert`` (DeepSeek-V3 only): every token takes every routed expert, weighted by its
    router scores, so that routing is a continuous function of the state (see :func:`build_deep_model`).

    The global torch RNG is left untouched; the same arguments give the same weights.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    if hidden_size < 2 * HEAD_DIM or hidden_size % (2 * HEAD_DIM):
        raise ValueError(f"hidden_size must be a positive multiple of {2 * HEAD_DIM}, got {hidden_size}")
    if massive and num_layers <= MASSIVE_LAYER:
        raise ValueError(f"massive activations need more than {MASSIVE_LAYER} layers, got {num_layers}")
    model_class, config = _config(arch, hidden_size, num_layers, vocab_size, every_expert)
    # Pinned so that results do not depend on what happens to be installed (see tiny_llama).
    config._attn_implementation = "sdpa"
    model = instantiate_model(model_class, config, seed, dtype, norm_weight_range=norm_weight_range)
    tm = TinyModel(
        model=model, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, seed=seed, arch=arch
    )
    if massive:
        _add_massive_activations(tm)
    return tm


def _add_massive_activations(tm: TinyModel) -> None:
    """Give ``tm`` uneven dimensions and massive activations, calibrating layer by layer (see :func:`build_tiny_model`).

    For each decoder layer from :data:`MASSIVE_LAYER` on, on a forward of seeded tokens: scale the
    input columns of its readers (unless it is the first) by the rms inflation its input shows,
    then measure its output and hook the increments that bring the massive dimensions to
    ``_MASSIVE_GAINS`` times the median of the others.
    """
    gen = torch.Generator().manual_seed(tm.seed + 2)
    n, hidden = len(_MASSIVE_GAINS), tm.hidden_size
    dims = torch.randperm(hidden, generator=gen)[:n].sort().values
    rest = torch.ones(hidden, dtype=torch.bool)
    rest[dims] = False
    probes = torch.randn(n, hidden, generator=gen) * rest
    probes /= probes.norm(dim=-1, keepdim=True)
    tokens = torch.randint(0, tm.vocab_size, _CALIBRATION_SHAPE, generator=gen)
    gains = torch.tensor(_MASSIVE_GAINS)
    layers = tm.model.model.layers
    low, high = math.log(_DIM_SCALE_RANGE[0]), math.log(_DIM_SCALE_RANGE[1])
    dim_spreads = torch.empty(hidden).uniform_(low, high, generator=gen).exp()
    _scale_residual_dims(tm.model, dim_spreads)
    increments: list[tuple[float, ...]] = []
    reader_scales: list[float] = []
    layer_input: torch.Tensor | None = None
    for index in range(MASSIVE_LAYER, tm.num_layers):
        if layer_input is not None:
            mean_square_all = layer_input.pow(2).mean(-1)
            mean_square_rest = layer_input[..., rest].pow(2).mean(-1)
            scale = max(1.0, float((mean_square_all / mean_square_rest).sqrt().median()))
            _scale_reader_columns(layers[index], rest, scale)
            reader_scales.append(scale)
        output = _layer_output(tm, index, tokens)
        increment = gains * output[..., rest].abs().median() - output[..., dims].mean((0, 1))
        hook = _MassiveActivationHook(dims, increment, probes, _MASSIVE_WOBBLE)
        # prepend: run before the hooks transformers installs lazily (its hidden-state capture must see them).
        layers[index].register_forward_hook(hook, prepend=True)
        increments.append(tuple(float(v) for v in increment))
        layer_input = hook.add(output)
    tm.massive = MassiveActivations(
        layer=MASSIVE_LAYER,
        dims=tuple(int(d) for d in dims),
        increments=tuple(increments),
        wobble=_MASSIVE_WOBBLE,
        dim_spreads=tuple(float(v) for v in dim_spreads),
        reader_scales=tuple(reader_scales),
    )


class _LayerReachedError(Exception):
    """Raised by :func:`_layer_output`'s hook: the forward has computed what was asked."""


def _layer_output(tm: TinyModel, index: int, tokens: torch.Tensor) -> torch.Tensor:
    """Decoder layer ``index``'s output for ``tokens``, as :func:`layer_states` gives it (``hs{index + 1}``,
    or ``pre_norm`` for the last layer: the output its forward hooks pass on), by a forward that stops
    there. The layers after it cannot change it, and calibrating layer by layer with whole forwards
    cost O(layers^2) (61-layer DeepSeek-V3: 17 s a build, about half of it the layers past the one measured)."""
    got: list[torch.Tensor] = []

    def reached(_module: nn.Module, _args: Any, output: Any) -> None:
        got.append(output[0] if isinstance(output, tuple) else output)
        raise _LayerReachedError

    handle = tm.model.model.layers[index].register_forward_hook(reached)
    try:
        layer_states(tm, tokens)
    except _LayerReachedError:
        pass
    finally:
        handle.remove()
    if not got:
        raise RuntimeError(f"decoder layer {index} did not run in the forward: has the layout changed?")
    return got[0]


@torch.no_grad()
def _scale_residual_dims(model: PreTrainedModel, scales: torch.Tensor) -> None:
    """Give residual dimension ``d`` the spread ``scales[d]``: scale what the embedding and every writer put there."""
    model.model.embed_tokens.weight.mul_(scales)
    for name, param in model.model.layers.named_parameters():
        if name.endswith(_RESIDUAL_WRITERS):
            param.mul_(scales[:, None])


@torch.no_grad()
def _scale_reader_columns(layer: nn.Module, columns: torch.Tensor, scale: float) -> None:
    """Multiply the ``columns`` (input dimensions) of every residual reader of ``layer`` by ``scale``."""
    found = False
    for name, param in layer.named_parameters():
        if name.endswith(_RESIDUAL_READERS):
            param[..., columns] *= scale
            found = True
    if not found:
        raise RuntimeError(f"no residual reader among {type(layer).__name__}'s parameters: has the layout changed?")


def server_model(tl: TinyLlama, compute: str) -> TinyModel:
    """A deep copy of ``tl`` as an inference server would run it; ``tl`` itself is left untouched.

    * ``"fp32"``: an unchanged copy;
    * ``"bf16"``: the whole model in bfloat16, so every layer computes with bf16 rounding;
    * ``"fp8"``: every projection weight of the decoder layers (each ``nn.Linear`` and DeepSeek's
      stacked expert weights; not the router) rounded through ``float8_e4m3fn`` with a
      per-output-channel absmax scale, fake-quantised back, then bf16 as above.

    The hook of the massive activations travels with the copy. States of a bf16 model come out
    bf16; ``run_trainer``/``run_engine`` cast the fc input to their ``dtype`` argument.
    """
    if compute not in COMPUTES:
        raise ValueError(f"unknown compute {compute!r}; choose one of {COMPUTES}")
    model = copy.deepcopy(tl.model)
    if compute == "fp8":
        with torch.no_grad():
            for param in _projection_weights(model.model.layers):
                param.copy_(_fake_quantise_fp8(param))
    if compute != "fp32":
        model = model.to(torch.bfloat16)
    return TinyModel(
        model=model,
        hidden_size=tl.hidden_size,
        num_layers=tl.num_layers,
        vocab_size=tl.vocab_size,
        seed=tl.seed,
        arch=getattr(tl, "arch", "llama"),
        massive=getattr(tl, "massive", None),
        compute=compute,
    )


def _projection_weights(layers: nn.Module) -> list[nn.Parameter]:
    """The weights an fp8 server quantises: each ``nn.Linear`` and stacked expert weight (no norm, no router)."""
    out: list[nn.Parameter] = []
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            out.append(module.weight)
        elif type(module).__name__.endswith("Experts"):
            out.extend(p for p in module.parameters(recurse=False) if p.dim() == 3)
    return out


def _fake_quantise_fp8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded through float8 e4m3 with one absmax scale per output channel (dim -2)."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / _FP8_MAX
    return ((w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale).to(weight.dtype)


def build_deep_model(arch: str, hidden_size: int = 64, seed: int = 0, *, num_layers: int | None = None) -> TinyModel:
    """:func:`build_tiny_model` at a real target's depth (:data:`DEEP_LAYERS`), massive activations
    included: the shape compare's noise model has to work at (drift grows slowly with depth while
    neighbouring layers stay far apart; docs/noise-model.md). Hidden size 64 keeps 61 layers cheap.

    DeepSeek-V3 takes every routed expert on every token (``every_expert``): a random router's
    top-k choice flips under bf16 rounding for 21-27% of the tokens by layer 59 (each flip moving that
    token's state by 20-33%), which trained routers, decisive on most tokens, do not show; keeping the
    router in fp32 does not help (transformers' router already scores in fp32: what flips a route is
    the bf16 rounding of its input). Taking every expert keeps MLA, the shared and routed experts and
    the router's token-dependent weights, with no discrete choice to flip."""
    return build_tiny_model(arch, hidden_size=hidden_size, num_layers=num_layers or DEEP_LAYERS[arch], seed=seed,
                            every_expert=arch == "deepseek_v3")


def sglang_default_layers(num_layers: int) -> list[str]:
    """SGLang's default EAGLE-3 capture ids ``[2, L // 2, L - 3]`` (outputs of those decoder layers)
    as HF hidden_states names (``hs{id + 1}``): the layers a draft reads near the top of the target."""
    return [f"hs{i + 1}" for i in (2, num_layers // 2, num_layers - 3)]
