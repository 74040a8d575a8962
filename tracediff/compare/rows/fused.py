"""The fused kernel of the streaming pass, compiled by numba (see :mod:`tracediff.compare.rows.kernels`, which
imports this module only when a pass uses it: importing it imports numba).

Module-level functions, so that numba's on-disk cache (``cache=True``, next to this file where it is
writable) is found again by the next process: functions defined inside another function were
compiled afresh by every process (1-3 s each, measured), which made the kernel look slower end to
end than it is.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

# (numba's cache of read_and_measure is keyed to this file only: a change to pread's declaration
# there must come with a change here.)
from tracediff.store.fused_reads import pread, usable

# Reassociation lets LLVM vectorise the float32 reductions; NaN and Inf keep their meaning (the pass
# tells non-finite rows by their norms).
flags = {"reassoc", "contract", "arcp", "nsz"}


@intrinsic
def _widen(typingctx: Any, value: Any) -> Any:
    """A stored value as float32, decided by its type when compiled (no test in the loop): uint16 bf16
    bits widened exactly (shifted into the top half of a float32's bits), a float32 as itself."""
    if value == types.uint16:
        def bits(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return types.float32(types.uint16), bits
    if value == types.float32:
        def same(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return args[0]

        return types.float32(types.float32), same
    return None


@intrinsic
def _abs_bits(typingctx: Any, value: Any) -> Any:
    """The int32 bits of the float32 ``value`` with the sign bit cleared: ordered as the magnitudes
    are (every NaN above Inf), so a signed 32-bit max of them is the largest |value|."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))

    return types.int32(types.float32), codegen


@intrinsic
def _f32_of_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the int32 ``bits`` (a register move: numba has no scalar view)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(nogil=True, cache=True, fastmath=flags)
def kernel(craw: Any, rraw: Any, n: int, size: int, seg_c: Any, seg_r: Any, means: Any, invs: Any, xc: Any, xr: Any,
           dn: Any, mx: Any, sn: Any, sd: Any) -> None:
    # Each stored value is widened where a loop reads it, in registers (no widened copy of the row
    # written and read again, nor a stored difference read by a second loop: with them, the kernel
    # took 1.7x this time at 3 x 64, 1.2x at 3 x 4096; benchmarks/bench_kernel.py), by the rows'
    # dtype (uint16: bf16 bits), so the loop holds no branch and LLVM vectorises it 8 floats wide.
    # The largest |difference| is a signed 32-bit max over the difference's bits with the sign bit
    # cleared (a float max with NaN semantics LLVM does not vectorise; an unsigned or 64-bit one
    # it does only half as wide): the bits of |NaN| exceed those of Inf, so a NaN difference comes
    # out as NaN.
    kc, kr, pairs = craw.shape[1] // size, rraw.shape[1] // size, seg_c.shape[0]
    # Segments no pair reads still need their norms (a missing or extra segment's).
    c_alone = np.ones(kc, dtype=np.bool_)
    r_alone = np.ones(kr, dtype=np.bool_)
    for p in range(pairs):
        c_alone[seg_c[p]] = False
        r_alone[seg_r[p]] = False
    for row in range(n):
        cr = craw[row]
        rr = rraw[row]
        for k in range(kc):
            if c_alone[k]:
                seg = cr[k * size : (k + 1) * size]
                acc = np.float32(0.0)
                for j in range(size):
                    x = _widen(seg[j])
                    acc += x * x
                xc[row, k] = np.sqrt(acc)
        for k in range(kr):
            if r_alone[k]:
                seg = rr[k * size : (k + 1) * size]
                acc = np.float32(0.0)
                for j in range(size):
                    y = _widen(seg[j])
                    acc += y * y
                xr[row, k] = np.sqrt(acc)
        for p in range(pairs):
            a = cr[seg_c[p] * size : (seg_c[p] + 1) * size]
            b = rr[seg_r[p] * size : (seg_r[p] + 1) * size]
            mean, inv = means[p], invs[p]
            a2 = np.float32(0.0)
            b2 = np.float32(0.0)
            d2 = np.float32(0.0)
            s2 = np.float32(0.0)
            z2 = np.float32(0.0)
            top = np.int32(0)
            for j in range(size):
                x = _widen(a[j])
                y = _widen(b[j])
                a2 += x * x
                b2 += y * y
                d = x - y
                d2 += d * d
                v = _abs_bits(d)
                top = v if v > top else top
                s = d * inv[j]
                s2 += s * s
                z = (y - mean[j]) * inv[j]
                z2 += z * z
            xc[row, seg_c[p]] = np.sqrt(a2)
            xr[row, seg_r[p]] = np.sqrt(b2)
            dn[p, row] = np.sqrt(d2)
            mx[p, row] = _f32_of_bits(top)
            sn[p, row] = np.sqrt(s2)
            sd[p, row] = np.sqrt(z2)


@numba.njit(nogil=True, cache=True)
def _read_part(fds: Any, offsets: Any, dest: Any, lengths: Any, r: int, s0: int, s1: int, buf: Any) -> int:
    """Rows ``s0..s1`` of a block into ``buf``'s first rows, from the block's runs (in destination
    order, run ``r`` the first not yet wholly read): the index of the first run not wholly read
    afterwards, or -1 when a read came back short or failed."""
    row_bytes = buf.shape[1] * buf.itemsize
    base = buf.ctypes.data
    while r < fds.shape[0] and dest[r] < s1:
        a = max(dest[r], s0)
        b = min(dest[r] + lengths[r], s1)
        size = (b - a) * row_bytes
        if pread(fds[r], base + (a - s0) * row_bytes, size, offsets[r] + (a - dest[r]) * row_bytes) != size:
            return -1
        if dest[r] + lengths[r] > s1:  # the run goes on into the next part
            break
        r += 1
    return r


@numba.njit(nogil=True, cache=True)
def read_and_measure(c_fds: Any, c_offsets: Any, c_dest: Any, c_lengths: Any, r_fds: Any, r_offsets: Any, r_dest: Any,
                     r_lengths: Any, cbuf: Any, rbuf: Any, n: int, size: int, seg_c: Any, seg_r: Any, means: Any,
                     invs: Any, xc: Any, xr: Any, dn: Any, mx: Any, sn: Any, sd: Any) -> int:
    """:func:`kernel` on rows ``0..n`` of a block read part by part: the rows of each side come from
    runs (run k: ``lengths[k]`` consecutive stored rows at byte ``offsets[k]`` of file ``fds[k]``, for
    the block's rows ``dest[k]..dest[k] + lengths[k]``; runs in destination order, covering ``0..n``),
    read ``cbuf.shape[0]`` rows at a time into ``cbuf`` / ``rbuf`` (stored values, small enough to stay
    in the cache), each part measured while its rows are there. The same numbers as reading the
    whole block and calling :func:`kernel` on it (each row's are its own), without writing a block of
    rows to memory and reading it back (the copies from the page cache run ~2x as fast into a
    buffer the cache holds). Returns -1, or the first row of the part whose read came back short or
    failed (rows before it are measured; the caller reads the block again, which raises the store's
    error)."""
    part = cbuf.shape[0]
    ci = 0
    ri = 0
    for s0 in range(0, n, part):
        s1 = min(n, s0 + part)
        ci = _read_part(c_fds, c_offsets, c_dest, c_lengths, ci, s0, s1, cbuf)
        if ci < 0:
            return s0
        ri = _read_part(r_fds, r_offsets, r_dest, r_lengths, ri, s0, s1, rbuf)
        if ri < 0:
            return s0
        kernel(cbuf, rbuf, s1 - s0, size, seg_c, seg_r, means, invs, xc[s0:s1], xr[s0:s1], dn[:, s0:s1], mx[:, s0:s1],
               sn[:, s0:s1], sd[:, s0:s1])
    return -1


@numba.njit(nogil=True, cache=True)
def closed_forms(m: int, xc: Any, xr: Any, seg_c: Any, seg_r: Any, fin_c: Any, fin_r: Any, dn: Any, mx: Any, sn: Any,
                 sd: Any, rows: Any, sums: Any, odd: Any) -> None:
    """The pass's per-row metrics of rows ``0..m`` from the norms: :func:`tracediff.compare.rows.kernels.
    numpy_closed_forms`' expressions, element by element in float64 and in the same order (the same
    bits; no fastmath here). Per row i and pair p: ``rows[:, i, p]`` (float32) cosine, norm ratio,
    rel_diff, max |diff| (NaN where the norms are not ordinary) and the squared standardised error
    (NaN where not finite); ``sums[:, p, i]`` (float64, 0 where left out) the squared error and
    reference norm of ordinary rows and the standardised error and reference of finite ones;
    ``odd[i, p]``: finite rows whose norms are not ordinary (the caller takes them value by value)."""
    nan = np.float64(np.nan)
    for i in range(m):
        for p in range(seg_c.shape[0]):
            ok = fin_c[i, seg_c[p]] and fin_r[i, seg_r[p]]
            x = np.float64(xc[i, seg_c[p]])
            y = np.float64(xr[i, seg_r[p]])
            d = np.float64(dn[p, i])
            dd = d * d
            fast = ok and x > 1e-15 and x < 1e18 and y > 1e-15 and y < 1e18 and np.isfinite(dd)
            nb = y * y
            if fast:
                v = (dd - (x - y) * (x - y)) / (2.0 * x * y)
                if not np.isnan(v):  # numpy's clip: max then min, NaN kept
                    v = v if v > 0.0 else 0.0
                    v = v if v < 2.0 else 2.0
                rows[0, i, p] = 1.0 - v
                rows[1, i, p] = x / y
                rows[2, i, p] = dd / (x * x + nb)
                rows[3, i, p] = mx[p, i]
                sums[0, p, i] = dd
                sums[1, p, i] = nb
            else:
                rows[0, i, p] = nan
                rows[1, i, p] = nan
                rows[2, i, p] = nan
                rows[3, i, p] = nan
                sums[0, p, i] = 0.0
                sums[1, p, i] = 0.0
            s = np.float64(sn[p, i])
            z = np.float64(sd[p, i])
            s2 = s * s
            z2 = z * z
            if ok and np.isfinite(s2) and np.isfinite(z2):
                rows[4, i, p] = s2
                sums[2, p, i] = s2
                sums[3, p, i] = z2
            else:
                rows[4, i, p] = nan
                sums[2, p, i] = 0.0
                sums[3, p, i] = 0.0
            odd[i, p] = ok and not fast


@numba.njit(nogil=True, cache=True)
def bucket_sums(index: Any, values: Any, keep: Any, every: bool, square: bool, total: Any, counts: Any) -> None:
    """:meth:`tracediff.compare.stream.metrics.PositionBuckets.sums` in one loop: per row ``i`` kept
    (``every``, or ``keep[i]``), its value (squared in float64 with ``square``) added to
    ``total[index[i]]`` and one to ``counts[index[i]]``. Each bucket's values are added one after the
    other in row order, in float64 (no fastmath here): ``np.add.at``'s and ``np.bincount``'s bits (a
    NaN sum is NaN, its sign bit aside: the callers add finite values only)."""
    for i in range(index.shape[0]):
        if every or keep[i]:
            b = index[i]
            v = np.float64(values[i])
            total[b] += v * v if square else v
            counts[b] += 1


#: The compiled functions a pass calls (kernels.py asks numba's cache whether they are there);
#: :func:`read_and_measure` where the compiled reads run (:func:`tracediff.store.fused_reads.usable`).
ENTRY_POINTS = (kernel, closed_forms, bucket_sums, read_and_measure) if usable() else (kernel, closed_forms, bucket_sums)


def warm() -> None:
    """Compile (or load from numba's cache) :func:`kernel` and :func:`read_and_measure` for every pair
    of stored dtypes a pass reads (bf16 bits, float32) and :func:`closed_forms`, on a few values: the
    types a pass calls them with, so that a pass afterwards loads each from the cache. Run in a child
    process on a cold cache (:func:`tracediff.compare.rows.kernels.fused_kernel`): compiling keeps ~60 MiB
    of the compiler's memory in the process that compiles, which a compare at its peak cannot spare."""
    for c_bf16 in (True, False):
        for r_bf16 in (True, False):
            load(c_bf16, r_bf16)


def load(c_bf16: bool, r_bf16: bool) -> None:
    """Compile or load :func:`kernel` and (where the compiled reads run) :func:`read_and_measure` for
    one pair of stored dtypes (bf16 bits or float32 a side), :func:`closed_forms` and
    :func:`bucket_sums` (float32 values: the finish's per-row columns), by calling them
    on a few values (no rows to read) of the types a pass calls them with."""
    n, size = 2, 4
    seg = np.zeros(1, dtype=np.int64)

    def f32(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    cdt, rdt = (np.uint16 if c_bf16 else np.float32), (np.uint16 if r_bf16 else np.float32)
    kernel(np.zeros((n, size), cdt), np.zeros((n, size), rdt), n, size, seg, seg, f32(1, size), f32(1, size),
           f32(n, 1), f32(n, 1), f32(1, n), f32(1, n), f32(1, n), f32(1, n))
    if usable():
        runs = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(0, dtype=np.int64))
        read_and_measure(*runs, *runs, np.zeros((1, size), cdt), np.zeros((1, size), rdt), 0, size, seg, seg,
                         f32(1, size), f32(1, size), f32(n, 1), f32(n, 1), f32(1, n), f32(1, n), f32(1, n), f32(1, n))
    fin = np.ones((n, 1), dtype=np.bool_)
    closed_forms(n, f32(n, 1), f32(n, 1), seg, seg, fin, fin, f32(1, n), f32(1, n), f32(1, n), f32(1, n),
                 f32(5, n, 1), np.zeros((4, 1, n)), np.zeros((n, 1), dtype=np.bool_))
    bucket_sums(np.zeros(n, dtype=np.int16), f32(n), np.ones(n, dtype=np.bool_), True, False, np.zeros(1),
                np.zeros(1, dtype=np.int64))
