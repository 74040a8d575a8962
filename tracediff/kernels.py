"""The streaming pass's per-row statistics in one fused loop: every stored value read once.

For a block of row pairs the pass needs, per row, the norm of every segment of both sides and, per
matched segment pair, the norm and the largest absolute value of the difference, the norm of the
difference in units of the reference segment's robust scale, and the norm of the standardised
reference. The reference implementation (:meth:`tracediff.diagnose._Pass.block_metrics`' torch
path) runs about eight eager kernels per pair over float32 copies of the rows: some ten reads and
six writes of every value. :func:`fused_row_stats` widens each stored value (bf16 bits or float32)
once, in a compiled loop, and keeps every sum in float64: the same numbers up to float32 summation
order (tests/test_kernels.py holds it to the torch path).

Compiled by numba (a registry package; ``nogil``: the pass's block threads run it concurrently,
each on its own block, so it is serial inside). Without numba, or for other stored dtypes (float16),
the pass keeps the torch path. Pure computation: no I/O, no allocation beyond two row buffers.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

log = logging.getLogger("tracediff")

#: Stored dtypes the fused loop reads directly (bf16 as its uint16 bits).
FUSED_DTYPES = ("bfloat16", "float32")

_KERNEL: Any = None
_TRIED = False


def _build() -> Any:
    """Compile the kernel (on first use; numba caches it on disk next to this module where it can)."""
    import numba  # noqa: PLC0415

    # Reassociation lets LLVM vectorise the float64 reductions; NaN and Inf keep their meaning (the
    # pass tells non-finite rows by their norms).
    flags = {"reassoc", "contract", "arcp", "nsz"}

    @numba.njit(nogil=True, cache=True, fastmath=flags)
    def widen(src: Any, u32: Any, f32: Any, bf16: bool) -> None:
        if bf16:
            for j in range(src.shape[0]):
                u32[j] = np.uint32(src[j]) << np.uint32(16)
        else:
            for j in range(src.shape[0]):
                f32[j] = src[j]

    @numba.njit(nogil=True, cache=True, fastmath=flags)
    def kernel(craw: Any, rraw: Any, n: int, size: int, c_bf16: bool, r_bf16: bool, seg_c: Any, seg_r: Any,
               means: Any, invs: Any, xc: Any, xr: Any, dn: Any, mx: Any, sn: Any, sd: Any) -> None:
        wc, wr = craw.shape[1], rraw.shape[1]
        cu = np.empty(wc, dtype=np.uint32)
        ru = np.empty(wr, dtype=np.uint32)
        cf = cu.view(np.float32)
        rf = ru.view(np.float32)
        kc, kr, pairs = wc // size, wr // size, seg_c.shape[0]
        for row in range(n):
            widen(craw[row], cu, cf, c_bf16)
            widen(rraw[row], ru, rf, r_bf16)
            for k in range(kc):
                acc = 0.0
                for j in range(k * size, (k + 1) * size):
                    v = np.float64(cf[j])
                    acc += v * v
                xc[row, k] = math.sqrt(acc)
            for k in range(kr):
                acc = 0.0
                for j in range(k * size, (k + 1) * size):
                    v = np.float64(rf[j])
                    acc += v * v
                xr[row, k] = math.sqrt(acc)
            for p in range(pairs):
                c0, r0 = seg_c[p] * size, seg_r[p] * size
                d2 = 0.0
                s2 = 0.0
                z2 = 0.0
                big = np.float32(0.0)
                nan = False
                for j in range(size):
                    a = cf[c0 + j]
                    b = rf[r0 + j]
                    d = a - b
                    ad = abs(d)
                    if ad > big:
                        big = ad
                    elif ad != ad:
                        nan = True
                    dd = np.float64(d)
                    d2 += dd * dd
                    s = dd * np.float64(invs[p, j])
                    s2 += s * s
                    z = (np.float64(b) - np.float64(means[p, j])) * np.float64(invs[p, j])
                    z2 += z * z
                dn[p, row] = math.sqrt(d2)
                mx[p, row] = np.float32(np.nan) if nan else big
                sn[p, row] = math.sqrt(s2)
                sd[p, row] = math.sqrt(z2)

    return kernel


def fused_kernel() -> Any:
    """The compiled kernel, or None where numba is missing (or ``TRACEDIFF_KERNEL=torch``; which
    passes use it at all: :func:`tracediff.diagnose.use_fused_kernel`)."""
    global _KERNEL, _TRIED
    if os.environ.get("TRACEDIFF_KERNEL", "").lower() == "torch":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            _KERNEL = _build()
        except ImportError:
            log.info("tracediff: numba is not installed: the streaming pass uses its torch kernels")
        except Exception as exc:  # a numba that cannot compile here must not stop a compare
            log.warning("tracediff: the fused kernel could not be compiled (%s): using the torch kernels", exc)
    return _KERNEL


def fused_row_stats(craw: np.ndarray, rraw: np.ndarray, n: int, size: int, cdtype: str, rdtype: str,
                    seg_c: np.ndarray, seg_r: np.ndarray, means: np.ndarray, invs: np.ndarray, xc: np.ndarray,
                    xr: np.ndarray, dn: np.ndarray, mx: np.ndarray, sn: np.ndarray, sd: np.ndarray) -> bool:
    """Fill, for rows ``0..n`` of ``craw`` / ``rraw`` (stored values: bf16 as uint16 bits, or
    float32): ``xc [n, kc]``, ``xr [n, kr]`` segment norms and, per pair p of candidate segment
    ``seg_c[p]`` and reference segment ``seg_r[p]`` (reference mean ``means[p]`` and 1 / scale
    ``invs[p]``, float32 [pairs, size]): ``dn``, ``mx``, ``sn``, ``sd`` ``[pairs, >= n]`` (norm and
    max |.| of the difference, norm of the standardised difference, norm of the standardised
    reference). Returns False, computing nothing, when the fused kernel cannot run here."""
    kernel = fused_kernel()
    if kernel is None or cdtype not in FUSED_DTYPES or rdtype not in FUSED_DTYPES:
        return False
    c = craw.view(np.uint16) if cdtype == "bfloat16" else craw
    r = rraw.view(np.uint16) if rdtype == "bfloat16" else rraw
    kernel(c, r, n, size, cdtype == "bfloat16", rdtype == "bfloat16", seg_c, seg_r, means, invs, xc, xr, dn, mx,
           sn, sd)
    return True


__all__ = ["FUSED_DTYPES", "fused_kernel", "fused_row_stats"]
