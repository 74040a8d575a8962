"""Benchmark the streaming pass's per-row statistics: the fused kernel (tracediff/compare/rows/kernels.py) against
the numpy kernels of the pass (:func:`tracediff.compare.rows.kernels.numpy_row_stats`, its reference
implementation, run a sub-block at a time as the pass runs it), in one process, on the same rows,
one thread each.

Rows: ``--rows`` row pairs of ``--segments`` x ``--size`` bf16 values per side (the candidate is the
reference plus 1% noise, rounded to bf16 again), every candidate segment paired with its reference
segment. Each kernel runs once to warm up (numba compiles or loads its cache), then ``--repeat``
times; the figure is CPU seconds (``time.process_time``: the VM is shared, wall time is not
comparable between runs) and GB/s of stored input (both sides). Nothing is written to disk.

Run:  python benchmarks/bench_kernel.py                 (2048 rows of 3 x 4096)
      python benchmarks/bench_kernel.py --size 64 --rows 65536
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tracediff.compare.plan.segments import to_float32
from tracediff.compare.rows.kernels import fused_kernel, fused_row_stats, numpy_row_stats


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _numpy_loop(craw: np.ndarray, rraw: np.ndarray, k: int, size: int, out: dict, sub: int) -> None:
    """The numpy kernels of the pass as tracediff/compare/stream/blocks.py runs them: widened a sub-block at a time
    into reused buffers."""
    n = craw.shape[0]
    d = np.empty((sub, size), np.float32)
    mean, inv = np.zeros(size, np.float32), np.ones(size, np.float32)
    for s0 in range(0, n, sub):
        b = min(n, s0 + sub) - s0
        c3 = to_float32(craw[s0 : s0 + b], "bfloat16").reshape(b, k, size)
        r3 = to_float32(rraw[s0 : s0 + b], "bfloat16").reshape(b, k, size)
        pairs = [(c3[:, p], r3[:, p], out["dn"][p, s0 : s0 + b], out["mx"][p, s0 : s0 + b],
                  out["sn"][p, s0 : s0 + b], out["sd"][p, s0 : s0 + b], mean, inv) for p in range(k)]
        numpy_row_stats(c3, r3, out["xc"][s0 : s0 + b], out["xr"][s0 : s0 + b], pairs, d[:b])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if fused_kernel() is None:
        raise SystemExit("numba is not installed: pip install numba")
    n, k, size = args.rows, args.segments, args.size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, k * size), dtype=np.float32)
    craw = _bf16(x)
    rraw = _bf16(to_float32(craw, "bfloat16") + 0.01 * rng.standard_normal((n, k * size), dtype=np.float32))
    seg = np.arange(k, dtype=np.int64)
    means, invs = np.zeros((k, size), np.float32), np.ones((k, size), np.float32)

    def outputs() -> dict:
        return {"xc": np.zeros((n, k), np.float32), "xr": np.zeros((n, k), np.float32),
                **{name: np.zeros((k, n), np.float32) for name in ("dn", "mx", "sn", "sd")}}

    fused, ref = outputs(), outputs()
    sub = max(16, min(n, (2 << 20) // ((2 * k * size) * 4)))
    gb = (craw.nbytes + rraw.nbytes) / 1e9

    def run_fused() -> None:
        fused_row_stats(craw, rraw, n, size, "bfloat16", "bfloat16", seg, seg, means, invs, fused["xc"], fused["xr"],
                        fused["dn"], fused["mx"], fused["sn"], fused["sd"])

    def run_numpy() -> None:
        _numpy_loop(craw, rraw, k, size, ref, sub)

    times = {}
    for name, fn in (("fused", run_fused), ("numpy", run_numpy)):
        fn()
        start = time.process_time()
        for _ in range(args.repeat):
            fn()
        times[name] = (time.process_time() - start) / args.repeat
    for name in ("dn", "sn", "sd"):
        np.testing.assert_allclose(fused[name], ref[name], rtol=1e-5)
    print(f"{n} rows of {k} x {size} bf16 a side ({gb:.3f} GB both sides), one thread, CPU seconds, "
          f"mean of {args.repeat}:")
    for name in ("fused", "numpy"):
        print(f"  {name:5s}  {times[name] * 1e3:8.1f} ms  {gb / times[name]:6.2f} GB/s")
    print(f"  fused / numpy: {times['numpy'] / times['fused']:.2f}x")


if __name__ == "__main__":
    main()
