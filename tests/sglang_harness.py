"""Running real SGLang 0.5.23 models in this process, on CPU, for the sglang adapter's tests.

The way SGLang's own layer tests do it: a world-1 gloo process group
(``sglang.test.layer_ut_utils.init_single_process_dist``), the real ``ForwardBatch`` dataclass with
the fields the forward reads, and an attention backend given through SGLang's ``forward_context``.
Our backend is a causal SDPA over each request's rows of the batch (no KV cache: every forward here
starts its requests at their first row), which is all the fc input and the aux states depend on.

Imports SGLang: only test modules that ``importorskip("sglang")`` import this.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import Any

import torch

STUBS = Path(__file__).resolve().parent / "sglang_stubs"


def install_import_stubs() -> None:
    """torchvision / vllm stubs on sys.meta_path (SGLang imports them; they must not be installed)."""
    spec = importlib.util.spec_from_file_location("tracediff_sglang_stubs", STUBS / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_initialised = False


def init_sglang() -> None:
    """The world-1 process group SGLang's layers need, once per process."""
    global _initialised
    if _initialised:
        return
    install_import_stubs()
    from sglang.test.layer_ut_utils import init_single_process_dist  # noqa: PLC0415

    # It sets RANK, WORLD_SIZE, MASTER_* in os.environ: keep them out of later tests' child processes.
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    try:
        init_single_process_dist(master_port=free_port())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _initialised = True


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class CausalSDPA:
    """A minimal SGLang attention backend: causal attention within each request's rows."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        rows = q.shape[0]
        qh = q.view(rows, layer.tp_q_head_num, -1).transpose(0, 1)
        kh = k.reshape(rows, layer.tp_k_head_num, -1).transpose(0, 1)
        vh = v.reshape(rows, layer.tp_v_head_num, -1).transpose(0, 1)
        out, start = [], 0
        for n in forward_batch.extend_seq_lens_cpu:
            out.append(torch.nn.functional.scaled_dot_product_attention(
                qh[:, start:start + n], kh[:, start:start + n], vh[:, start:start + n],
                is_causal=True, scale=layer.scaling, enable_gqa=True))
            start += n
        return torch.cat(out, 1).transpose(0, 1).reshape(rows, -1)


def run_model(model: torch.nn.Module, batch: Any) -> Any:
    """``model(input_ids, positions, batch)`` under SGLang's forward context, without grad."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: PLC0415

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=CausalSDPA())):
        return model(batch.input_ids, batch.positions, batch)


def forward_batch(
    mode: str,
    input_ids: torch.Tensor,
    lens: list[int],
    rids: list[str] | None,
    *,
    start_positions: list[int] | None = None,
    spec_info: Any = None,
    capture: str = "FULL",
) -> Any:
    """A real ``ForwardBatch`` for ``len(lens)`` requests whose rows are packed in ``input_ids``."""
    from sglang.srt.model_executor.forward_batch_info import (  # noqa: PLC0415
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    starts = start_positions or [0] * len(lens)
    n = int(input_ids.numel())
    assert sum(lens) == n
    batch = ForwardBatch(
        forward_mode=getattr(ForwardMode, mode),
        batch_size=len(lens),
        input_ids=input_ids,
        req_pool_indices=torch.arange(len(lens)),
        seq_lens=torch.tensor([s + n_ for s, n_ in zip(starts, lens, strict=True)]),
        out_cache_loc=torch.arange(n),
        seq_lens_sum=sum(s + n_ for s, n_ in zip(starts, lens, strict=True)),
    )
    batch.positions = torch.cat([torch.arange(s, s + n_) for s, n_ in zip(starts, lens, strict=True)])
    batch.extend_seq_lens = torch.tensor(lens)
    batch.extend_seq_lens_cpu = list(lens)
    batch.extend_prefix_lens = torch.tensor(starts)
    batch.extend_prefix_lens_cpu = list(starts)
    batch.extend_start_loc = torch.cumsum(torch.tensor([0, *lens[:-1]]), 0)
    batch.capture_hidden_mode = getattr(CaptureHiddenMode, capture)
    batch.rids = rids
    batch.spec_info = spec_info
    return batch


def llama_config(layers: int, hidden: int = 32, vocab: int = 128, **extra: Any) -> Any:
    from transformers import LlamaConfig  # noqa: PLC0415

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def init_params(model: torch.nn.Module, seed: int) -> None:
    """SGLang allocates parameters with torch.empty: give them seeded values (norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
