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

A row is one token position ``p`` of one sequence: ``seq``, ``position = p``, ``token_id = x_p``,
``next_token_id = x_{p+1}`` (-1 for the last position). Two pipelines produce rows:

* :func:`run_trainer`: one full-sequence forward per sequence (no KV cache), like an online
  EAGLE-3 trainer; rows in position order.
* :func:`run_engine`: an inference-server imitation: ragged prefill batches packed into one row
  dimension, per-request KV caches, optional chunked prefill, packed one-token decode steps with
  requests interleaved, admission as others finish; plus knobs to inject the bugs tracediff must
  find (chat-template preamble, labels one token late, arbitrary tensor transforms).

Both call ``on_batch(labels)`` right before each draft call, so a test can forward the labels to a
recorder (``rec.labels(**labels)``) whose hook on ``draft.fc`` then captures the fc input.

Everything runs under ``torch.no_grad()`` and is deterministic for a given seed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
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
    "ENGINE_RID_BASE",
    "Batch",
    "DraftHead",
    "TinyLlama",
    "build_tiny_llama",
    "instantiate_model",
    "layer_states",
    "make_sequences",
    "new_cache",
    "run_engine",
    "run_packed_trainer",
    "run_trainer",
    "select",
    "state_names",
]

#: Request ids the engine gives sequence ``i`` (``ENGINE_RID_BASE + i``). Deliberately different
#: from the trainer's ``0..n-1`` so that compare has to align by token content, never by ids.
ENGINE_RID_BASE = 1000

#: The callback type of ``on_batch``: receives the labels of the rows of the coming draft call.
OnBatch = Callable[[dict[str, Any]], None]
#: The callback type of ``transform``: ``(fc_input, states) -> fc_input``.
Transform = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


# --------------------------------------------------------------------------------------------
# The target model
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The draft stand-in and the data
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The two pipelines
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One draft call as a pipeline made it.

    ``labels`` is exactly what ``on_batch`` received. ``fc_input`` is the tensor handed to the
    draft (after cast and transform), ``[1, rows, k * H]``, kept only when the pipeline ran with
    ``keep_inputs=True`` (benchmarks producing many rows do not want it kept), else ``None``.
    """

    labels: dict[str, Any]
    fc_input: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Rows in this draft call."""
        return len(self.labels["position"])


def _labels(
    seq: Sequence[int],
    positions: Sequence[int],
    tokens: Sequence[int],
    *,
    phase: str,
    step: int,
    label_shift: int = 0,
) -> dict[str, Any]:
    """Labels of rows (one per position), as ``on_batch`` receives them.

    ``token_id`` is ``tokens[p + label_shift]`` (-1 outside the sequence): a non-zero shift
    imitates the "labelled one token late" bug. ``next_token_id`` is ``tokens[p + 1]``, -1 for the
    last position, and is never shifted.
    """
    n = len(tokens)
    pos = np.asarray(positions, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.int64)
    shifted = pos + label_shift
    ok = (shifted >= 0) & (shifted < n)
    token_id = np.where(ok, tok[np.clip(shifted, 0, n - 1)], -1).astype(np.int64)
    has_next = pos + 1 < n
    next_token_id = np.where(has_next, tok[np.clip(pos + 1, 0, n - 1)], -1).astype(np.int64)
    return {
        "seq": np.asarray(seq, dtype=np.int64),
        "position": pos,
        "token_id": token_id,
        "next_token_id": next_token_id,
        "phase": phase,
        "step": int(step),
    }


def _concat_labels(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row-wise concatenation of per-request labels of one packed batch."""
    out: dict[str, Any] = {
        k: np.concatenate([p[k] for p in parts]) for k in ("seq", "position", "token_id", "next_token_id")
    }
    out["phase"] = parts[0]["phase"]
    out["step"] = parts[0]["step"]
    return out


def _call_draft(
    draft: DraftHead,
    states: dict[str, torch.Tensor],
    layers: Sequence[str],
    labels: dict[str, Any],
    *,
    dtype: torch.dtype,
    transform: Transform | None,
    on_batch: OnBatch | None,
    keep_inputs: bool,
) -> Batch:
    """Build the fc input from ``states``, hand the labels over, then call the draft."""
    fc_input = select(states, layers).to(dtype)
    if transform is not None:
        fc_input = transform(fc_input, states)
    if on_batch is not None:
        on_batch(labels)
    draft(fc_input)
    return Batch(labels=labels, fc_input=fc_input if keep_inputs else None)



@torch.no_grad()
def run_packed_trainer(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    samples_per_row: int | Sequence[int] = 3,
    pad_between: int = 0,
    dtype: torch.dtype = torch.float32,
    on_batch: OnBatch | None = None,
) -> list[Batch]:
    """A trainer that packs several samples into one batch row (varlen / padding-free attention).

    Consecutive samples (``samples_per_row`` of them, or a list of counts cycled over the rows) are
    computed each on its own (varlen attention: no token attends across a sample boundary) and
    concatenated into one row ``[1, sum(T_i) + pads, k * H]``. Labels are what a recorder sees from
    such a trainer: ``seq`` = the packed row (not the sample), ``position`` restarting at 0 for each
    sample, ``token_id = x_p``, and ``next_token_id`` read from the packed row shifted by one, as
    SpecForge's shifted ``input_ids`` are: the last row of a sample gets the next sample's first token
    (-1 at the row's end). ``pad_between`` rows of token 0 (zero states, ``valid = False``, position
    0) follow every sample but the row's last. ``phase = "train"``, ``step`` = the row.
    """
    counts = [samples_per_row] if isinstance(samples_per_row, int) else list(samples_per_row)
    if not counts or min(counts) < 1:
        raise ValueError(f"samples_per_row must be >= 1, got {samples_per_row}")
    draft.to(dtype)
    batches: list[Batch] = []
    i = row = 0
    while i < len(seqs):
        group = seqs[i : i + counts[row % len(counts)]]
        i += len(group)
        parts: list[torch.Tensor] = []
        positions: list[int] = []
        tokens: list[int] = []
        valid: list[bool] = []
        for k, seq in enumerate(group):
            states, _ = layer_states(tl, torch.tensor(list(seq), dtype=torch.long))
            parts.append(select(states, layers)[0])
            positions += range(len(seq))
            tokens += list(seq)
            valid += [True] * len(seq)
            if pad_between and k < len(group) - 1:
                parts.append(torch.zeros(pad_between, parts[-1].shape[-1], dtype=parts[-1].dtype))
                positions += [0] * pad_between
                tokens += [0] * pad_between
                valid += [False] * pad_between
        fc_input = torch.cat(parts)[None].to(dtype)
        n = len(tokens)
        labels = {
            "seq": np.full(n, row, dtype=np.int64),
            "position": np.asarray(positions, dtype=np.int64),
            "token_id": np.asarray(tokens, dtype=np.int64),
            "next_token_id": np.asarray(tokens[1:] + [-1], dtype=np.int64),
            "valid": np.asarray(valid, dtype=bool),
            "phase": "train",
            "step": row,
        }
        if on_batch is not None:
            on_batch(labels)
        draft(fc_input)
        batches.append(Batch(labels=labels, fc_input=None))
        row += 1
    return batches


@torch.no_grad()
def run_trainer(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    on_batch: OnBatch | None = None,
    transform: Transform | None = None,
    keep_inputs: bool = False,
) -> list[Batch]:
    """The "training pipeline": one full-sequence forward (no cache) and one draft call per sequence.

    For sequence ``i``: states of all its tokens -> fc input ``[1, T, k * H]`` cast to ``dtype``
    (``draft`` is cast to ``dtype`` in place once, up front, as a trainer casting its draft would)
    -> optional ``transform(fc_input, states)`` -> ``on_batch(labels)`` -> ``draft(fc_input)``.
    Labels: ``seq = i``, ``position = 0..T-1``, ``token_id = x_p``, ``next_token_id = x_{p+1}``
    (-1 for the last), ``phase = "train"``, ``step = i``. Returns one :class:`Batch` per sequence.
    """
    draft.to(dtype)
    batches: list[Batch] = []
    for i, seq in enumerate(seqs):
        ids = torch.tensor(list(seq), dtype=torch.long)
        states, _ = layer_states(tl, ids)
        labels = _labels([i] * len(seq), range(len(seq)), seq, phase="train", step=i)
        batches.append(
            _call_draft(
                draft,
                states,
                layers,
                labels,
                dtype=dtype,
                transform=transform,
                on_batch=on_batch,
                keep_inputs=keep_inputs,
            )
        )
    return batches


@dataclass
class _Request:
    """One request of the engine imitation: its tokens, its KV cache and how far it has got."""

    rid: int
    tokens: list[int]  # prefix + dataset sequence: every one of them becomes a row
    prompt_len: int  # tokens that are prefilled (possibly in chunks); the rest are decoded
    cache: DynamicCache
    done: int = 0  # tokens forwarded so far == the next position

    @property
    def in_prefill(self) -> bool:
        return self.done < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens)


def _prompt_lengths(
    seqs: Sequence[Sequence[int]],
    prefill_len: int | Callable[[int, Sequence[int]], int] | None,
    seed: int,
) -> list[int]:
    """Dataset tokens of each sequence that go in its prompt (the rest is decoded), in ``[1, T]``.

    ``None`` draws them per request between a quarter and three quarters of the sequence (seeded),
    so that a default run has both long prefills and long decodes.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i, seq in enumerate(seqs):
        t = len(seq)
        if prefill_len is None:
            n = int(rng.integers(max(1, t // 4), max(1, (3 * t) // 4) + 1))
        elif callable(prefill_len):
            n = int(prefill_len(i, seq))
        else:
            n = int(prefill_len)
        out.append(min(max(n, 1), t))
    return out


def _forward_parts(tl: TinyLlama, parts: list[tuple[_Request, int, int]]) -> dict[str, torch.Tensor]:
    """Forward each request's token slice with its own cache; pack the rows into ``[1, sum, H]``.

    Computing requests separately and concatenating their rows gives the same numbers as a
    ragged-attention kernel over the packed batch (what SGLang runs), without writing one.
    """
    per_request: list[dict[str, torch.Tensor]] = []
    for req, start, end in parts:
        ids = torch.tensor(req.tokens[start:end], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)
        states, _ = layer_states(tl, ids, past_key_values=req.cache, position_ids=positions, use_cache=True)
        req.done = end
        per_request.append(states)
    return {k: torch.cat([s[k] for s in per_request], dim=1) for k in per_request[0]}


@torch.no_grad()
def run_engine(
    tl: TinyLlama,
    draft: DraftHead,
    seqs: Sequence[Sequence[int]],
    layers: Sequence[str],
    *,
    dtype: torch.dtype = torch.float32,
    prefill_len: int | Callable[[int, Sequence[int]], int] | None = None,
    chunk_size: int | None = None,
    max_running: int = 3,
    prefix_tokens: Sequence[int] | None = None,
    label_shift: int = 0,
    transform: Transform | None = None,
    on_batch: OnBatch | None = None,
    seed: int = 0,
    keep_inputs: bool = False,
) -> list[Batch]:
    """The "inference server": replay ``seqs`` through an engine-like scheduler (teacher forcing).

    Requests (``seq`` label ``1000 + i``, tokens = ``prefix_tokens + seqs[i]``) wait in arrival
    order. Each engine step is, as in SGLang's scheduler, a prefill batch if there is prefill work
    (prefill has priority), else a decode batch:

    * prefill (``phase="prefill"``): first the unfinished prompt of any request whose prefill was
      chunked, then new requests while fewer than ``max_running`` are running; with
      ``chunk_size``, the batch holds at most that many tokens and the request that does not fit
      is chunked (continued next step). The rows of all requests are packed into one row dimension,
      ``[1, sum(T_i), k * H]``, like SGLang packs an extend batch.
    * decode (``phase="decode"``): one token for every running request past its prompt, in
      admission order, packed as ``[1, n_running, k * H]``; the fed token is the sequence's own next
      token (we replay the data, we do not sample), so every position of every request becomes
      exactly one row. Finished requests leave; new ones are admitted by the next prefill.

    Each request has its own ``DynamicCache``; positions run ``0..len(prefix) + T - 1`` (the
    preamble rows are real rows). ``prefill_len`` is how many dataset tokens are in the prompt
    (int, ``callable(i, seq) -> int``, or ``None``: seeded random with ``seed``), clamped to
    ``[1, T]``; the preamble is always prefilled. ``label_shift`` mislabels ``token_id`` as
    ``x_{p + shift}`` (-1 outside the sequence), the "labelled one token late" bug;
    ``transform(fc_input, states)`` rewrites the fc input before the draft sees it (scale a
    segment, inject NaNs...), ``states`` being the packed ``[1, rows, H]`` states of the batch.
    ``step`` labels count engine steps from 0. Rows arrive in engine order, not sorted.
    Returns one :class:`Batch` per engine step; ``draft`` is cast to ``dtype`` in place.
    """
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if any(len(seq) == 0 for seq in seqs):
        raise ValueError("run_engine needs non-empty sequences")
    draft.to(dtype)
    prefix = list(prefix_tokens or [])
    prompt = _prompt_lengths(seqs, prefill_len, seed)
    waiting: deque[_Request] = deque(
        _Request(
            rid=ENGINE_RID_BASE + i,
            tokens=prefix + list(seq),
            prompt_len=len(prefix) + prompt[i],
            cache=new_cache(tl),
        )
        for i, seq in enumerate(seqs)
    )
    running: list[_Request] = []
    batches: list[Batch] = []
    step = 0
    while waiting or running:
        budget = chunk_size if chunk_size is not None else float("inf")
        parts: list[tuple[_Request, int, int]] = []
        for req in running:  # continue chunked prefills first
            if req.in_prefill and budget > 0:
                n = int(min(req.prompt_len - req.done, budget))
                parts.append((req, req.done, req.done + n))
                budget -= n
        while waiting and len(running) < max_running and budget > 0:
            req = waiting.popleft()
            running.append(req)
            n = int(min(req.prompt_len, budget))
            parts.append((req, 0, n))
            budget -= n
        if parts:
            phase = "prefill"
        else:
            phase = "decode"
            parts = [(r, r.done, r.done + 1) for r in running if not r.in_prefill and not r.finished]
            if not parts:  # unreachable: finished requests leave, prefilling ones made a prefill batch
                raise RuntimeError("engine imitation stalled: no prefill and no decode work")
        labels = _concat_labels(
            [
                _labels([r.rid] * (e - s), range(s, e), r.tokens, phase=phase, step=step, label_shift=label_shift)
                for r, s, e in parts
            ]
        )
        states = _forward_parts(tl, parts)
        batches.append(
            _call_draft(
                draft,
                states,
                layers,
                labels,
                dtype=dtype,
                transform=transform,
                on_batch=on_batch,
                keep_inputs=keep_inputs,
            )
        )
        running = [r for r in running if not r.finished]
        step += 1
    return batches
