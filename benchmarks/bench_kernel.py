"""Benchmark the streaming pass's per-row statistics: the fused kernel (tracediff/kernels.py) against
the torch kernels it replaces (the sub-block loop of tracediff/diagnose.py), in one process, on the
same rows, one thread each.

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
import torch

from tracediff.kernels import fused_kernel, fused_row_stats


def _torch_loop(c: torch.Tensor, r: torch.Tensor, k: int, size: int, out: dict, sub: int) -> None:
    """The torch kernels of the pass, as tracediff/diagnose.py runs them (reused buffers, sub-blocks)."""
    n = c.shape[0]
    cf, rf, d = torch.empty(sub, k * size), torch.empty(sub, k * size), torch.empty(sub, size)
    mean, inv = torch.zeros(size), torch.ones(size)
    norm = torch.linalg.vector_norm
    for s0 in range(0, n, sub):
        b = min(n, s0 + sub) - s0
        cf[:b].copy_(c[s0 : s0 + b])
        rf[:b].copy_(r[s0 : s0 + b])
        c3, r3 = cf[:b].view(b, k, size), rf[:b].view(b, k, size)
        norm(c3, 2, dim=2, out=out["xc"][s0 : s0 + b])
        norm(r3, 2, dim=2, out=out["xr"][s0 : s0 + b])
        for p in range(k):
            dd = d[:b]
            torch.sub(c3[:, p], r3[:, p], out=dd)
            norm(dd, 2, dim=1, out=out["dn"][p, s0 : s0 + b])
            torch.abs(dd, out=dd)
            torch.amax(dd, dim=1, out=out["mx"][p, s0 : s0 + b])
            torch.mul(dd, inv, out=dd)
            norm(dd, 2, dim=1, out=out["sn"][p, s0 : s0 + b])
            torch.sub(r3[:, p], mean, out=dd)
            torch.mul(dd, inv, out=dd)
            norm(dd, 2, dim=1, out=out["sd"][p, s0 : s0 + b])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if fused_kernel() is None:
        raise SystemExit("numba is not installed: pip install numba")
    torch.set_num_threads(1)
    n, k, size = args.rows, args.segments, args.size
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(n, k * size, generator=gen).to(torch.bfloat16)
    r = (c.float() + 0.01 * torch.randn(n, k * size, generator=gen)).to(torch.bfloat16)
    craw = c.view(torch.int16).numpy().view(np.uint16)
    rraw = r.view(torch.int16).numpy().view(np.uint16)
    seg = np.arange(k, dtype=np.int64)
    means, invs = np.zeros((k, size), np.float32), np.ones((k, size), np.float32)
    fused = {"xc": np.zeros((n, k), np.float32), "xr": np.zeros((n, k), np.float32),
             **{name: np.zeros((k, n), np.float32) for name in ("dn", "mx", "sn", "sd")}}
    ref = {"xc": torch.empty(n, k), "xr": torch.empty(n, k), **{name: torch.empty(k, n) for name in ("dn", "mx", "sn", "sd")}}
    sub = max(16, min(n, (2 << 20) // ((2 * k * size) * 4)))
    gb = (craw.nbytes + rraw.nbytes) / 1e9

    def run_fused() -> None:
        fused_row_stats(craw, rraw, n, size, "bfloat16", "bfloat16", seg, seg, means, invs, fused["xc"], fused["xr"],
                        fused["dn"], fused["mx"], fused["sn"], fused["sd"])

    def run_torch() -> None:
        _torch_loop(c, r, k, size, ref, sub)

    times = {}
    for name, fn in (("fused", run_fused), ("torch", run_torch)):
        fn()
        start = time.process_time()
        for _ in range(args.repeat):
            fn()
        times[name] = (time.process_time() - start) / args.repeat
    for name in ("dn", "sn", "sd"):
        np.testing.assert_allclose(fused[name], ref[name].numpy(), rtol=1e-5)
    print(f"{n} rows of {k} x {size} bf16 a side ({gb:.3f} GB both sides), one thread, CPU seconds, "
          f"mean of {args.repeat}:")
    for name in ("fused", "torch"):
        print(f"  {name:5s}  {times[name] * 1e3:8.1f} ms  {gb / times[name]:6.2f} GB/s")
    print(f"  fused / torch: {times['torch'] / times['fused']:.2f}x")


if __name__ == "__main__":
    main()
