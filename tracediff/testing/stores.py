"""Small, valid trace stores written with the real :class:`tracediff.store.TraceWriter`, for tests
that corrupt them (hostile inputs, fuzzing) and need an intact twin to compare against.

No torch, no model: a few sequences of random "hidden states", one tap ``fc_in`` (three of the
bank's layers side by side, as an EAGLE-3 fc input) and one tap ``bank`` (every layer), so that the
one store works as the reference and the candidate of ``compare`` and as the store and the bank of
``identify``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tracediff.store import PHASES, TraceWriter, create_store, encode_bfloat16, phase_code

HIDDEN = 16
BANK_LAYERS = 4
FC_LAYERS = (0, 2, 3)  # bank columns the fc input is built from
SEQ_LENGTHS = (20, 17, 23)
CHUNK_ROWS = 16


def write_small_store(
    path: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    compressor: str = "none",
    chunk_rows: int = CHUNK_ROWS,
    seed: int = 0,
    values: str = "random",
    seq_lengths: Sequence[int] = SEQ_LENGTHS,
) -> Path:
    """Write a valid store: taps ``fc_in`` (width 3*HIDDEN) and ``bank`` (width BANK_LAYERS*HIDDEN),
    one writer group each (``pid1``), sequences of ``seq_lengths`` tokens in chunks of ``chunk_rows``.

    ``values``: ``random`` (each layer its own random direction per token), ``nan`` (every value NaN)
    or ``inf`` (every value +inf, alternating sign by row).
    """
    path = Path(path)
    create_store(path, role="test", meta={"aux_layer_ids": [f"hs{j}" for j in FC_LAYERS], "hidden_size": HIDDEN})
    rng = np.random.default_rng(seed)
    total = sum(seq_lengths)
    layers = rng.standard_normal((total, BANK_LAYERS, HIDDEN)).astype(np.float32)
    layers += np.linspace(0.5, 2.0, BANK_LAYERS, dtype=np.float32)[None, :, None]  # layers differ in mean too
    if values == "nan":
        layers[:] = np.nan
    elif values == "inf":
        layers[:] = np.where(np.arange(total)[:, None, None] % 2 == 0, np.inf, -np.inf)
    tokens = rng.integers(0, 1000, size=total)
    labels = {
        "seq": np.concatenate([np.full(n, i) for i, n in enumerate(seq_lengths)]),
        "position": np.concatenate([np.arange(n) for n in seq_lengths]),
        "token_id": tokens,
        "next_token_id": np.concatenate([np.append(t[1:], -1) for t in np.split(tokens, np.cumsum(seq_lengths)[:-1])]),
        "step": np.zeros(total, dtype=np.int64),
        "phase": np.full(total, phase_code("train"), dtype=np.int8),
        "valid": np.ones(total, dtype=bool),
    }
    taps = {
        "fc_in": (layers[:, list(FC_LAYERS)].reshape(total, -1), [f"hs{j}" for j in FC_LAYERS]),
        "bank": (layers.reshape(total, -1), [f"hs{j}" for j in range(BANK_LAYERS)]),
    }
    for tap, (rows, seg_labels) in taps.items():
        attrs = {
            "segment_size": HIDDEN,
            "segment_labels": seg_labels,
            "phases": list(PHASES),
            "module": "tracediff.testing.stores",
            "capture": "input",
        }
        if tap == "bank":
            attrs["segment_info"] = [
                {"hf_index": j, "kind": "embedding" if j == 0 else "layer", "layer": j - 1 if j else None,
                 "text": "embedding" if j == 0 else f"output of layer {j - 1}"}
                for j in range(BANK_LAYERS)
            ]
        writer = TraceWriter(path, tap, "pid1", width=rows.shape[1], dtype=dtype, attrs=attrs,
                             chunk_rows=chunk_rows, compressor=compressor)
        stored = encode_bfloat16(rows) if dtype == "bfloat16" else rows.astype(dtype)
        start = 0
        for n in seq_lengths:  # one batch per sequence, as a trainer writes them
            writer.append(stored[start : start + n], {k: v[start : start + n] for k, v in labels.items()})
            start += n
        writer.close()
    return path
