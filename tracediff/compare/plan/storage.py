"""Quantised storage of a side's rows: what a store records about it, and its rounding, simulated.

A reference imported from FP8 offline files (hs_connectors' FP8HiddenStatesConnector: float8_e4m3fn
values, one absmax / 448 scale per token) holds rows that were rounded to e4m3 before they were
widened back to bf16: a relative step of 2^-3 near the top of each binade, far coarser than bf16's
2^-8. The importer records it in the store's meta (``storage_quantisation``); the noise model's
storage floor then rounds the plan sample the same way (:func:`round_trip`), so that e4m3 noise on
that side is allowed for and named, never taken for drift.

Pure numpy; no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Quantised storage formats: mantissa bits, smallest normal exponent, largest finite value.
FORMATS = {"float8_e4m3fn": (3, -6, 448.0), "float8_e5m2": (2, -14, 57344.0)}


def recorded_storage(meta: dict[str, Any]) -> str | None:
    """The quantised storage one side's collected meta (``{"store", "writer", "tap"}``) records
    (``storage_quantisation.dtype``, writer meta first), or None."""
    for part in ("writer", "store"):
        block = (meta.get(part) or {}).get("storage_quantisation")
        if isinstance(block, dict) and block.get("dtype") in FORMATS:
            return str(block["dtype"])
    return None


def round_trip(rows: np.ndarray, dtype: str) -> np.ndarray:
    """``rows`` [n, W] float32 quantised as the FP8 writers do (one absmax / max-finite scale per row,
    round to nearest even in ``dtype``) and scaled back: what storage in ``dtype`` leaves of them."""
    mantissa, min_exp, top = FORMATS[dtype]
    x = np.asarray(rows, dtype=np.float32)
    finite = np.where(np.isfinite(x), x, 0)
    scale = np.abs(finite).max(axis=1, keepdims=True) / np.float32(top)
    scale = np.maximum(scale, np.float32(1e-12))
    y = finite / scale
    exp = np.floor(np.log2(np.maximum(np.abs(y), np.float32(2.0**min_exp))))
    quantum = np.exp2(exp - mantissa).astype(np.float32)
    q = np.clip(np.rint(y / quantum) * quantum, -top, top) * scale
    return np.where(np.isfinite(x), q, x).astype(np.float32)


__all__ = ["FORMATS", "recorded_storage", "round_trip"]
