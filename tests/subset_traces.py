"""Tiny real recordings for the report tests: an fp32 trainer, a clean bf16 engine (a match whose
errors are not zero) and an engine that feeds zeros in segments 1 and 2 on decode rows (two
``segment_subset`` findings). About 5 s on two cores."""

from __future__ import annotations

from pathlib import Path

import torch

import tracediff
from tracediff.testing.models import build_tiny_model, server_model
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, make_sequences

LAYERS = ["hs2", "hs4", "hs6"]
HIDDEN = 64


def _zeros_on_decode(x: torch.Tensor, states) -> torch.Tensor:
    if x.shape[1] > 3:  # prefill batches hold >= 6 rows here
        return x
    x = x.clone()
    x[..., HIDDEN:] = 0
    return x


def record_subset_traces(root: Path) -> dict[str, Path]:
    """``ref`` (fp32 trainer), ``clean`` (bf16 engine) and ``decode_zeros`` stores under ``root``."""
    trainer = build_tiny_model("llama", hidden_size=HIDDEN, num_layers=8)
    bf16 = server_model(trainer, "bf16")
    seqs = make_sequences(n_seqs=4, min_len=24, max_len=34, seed=5)
    out: dict[str, Path] = {}
    for name, runner, model, dtype, kw in (
        ("ref", run_trainer, trainer, torch.float32, {}),
        ("clean", run_engine, bf16, torch.bfloat16, {"max_running": 3}),
        ("decode_zeros", run_engine, bf16, torch.bfloat16,
         {"transform": _zeros_on_decode, "max_running": 3, "prefill_len": lambda i, seq: 8}),
    ):
        draft = DraftHead(HIDDEN, 3)
        path = root / f"{name}.zarr"
        with tracediff.record(path, role=name, on_full="block") as rec:
            rec.tap(draft.fc, "fc_in", segment_size=HIDDEN)
            runner(model, draft, seqs, LAYERS, dtype=dtype, on_batch=lambda lab, rec=rec: rec.labels(**lab), **kw)
        assert rec.error is None
        out[name] = path
    return out
