"""One block of the streaming pass: the work on a block of aligned row pairs, a function of the
pass's small :class:`PassPlan` and the block's :class:`BlockSpec` (which stored rows each side reads)
alone, into a :class:`BlockResult` of sums, counts, first indices, per-position sums and the block's
per-row metrics. Threads of this process run it (:func:`run_blocks`), and so do the tasks of a
cluster (:class:`BlockWorker`, :mod:`tracediff.compare.stream.cluster`); :mod:`tracediff.compare.stream.one_pass`
runs the pass and merges the results.

Memory, per worker thread: one block of raw rows for both sides (about ``block_bytes``), a staging
buffer for a side's rows read out of order (at most that side's share of a block), float32 buffers
of a sub-block (about 2 MiB), a part of ~1 MiB of stored rows, and a small cache of decoded chunks
for compressed stores only. Throughput is bound by copying the rows out of the page cache and by
the kernels: rows of uncompressed chunk files are read straight into reused 64-byte aligned
buffers, and every kernel writes into a buffer allocated once. With the compiled kernels
(:mod:`tracediff.compare.rows.fused`), rows of 4 KiB or more a side are read and measured a part at a
time, each part while the cache holds it: copies from the page cache into a block-sized buffer ran
at half the speed of copies into one the cache holds, and the kernel then read the block back from
memory. Else numpy's kernels run a sub-block at a time (they release the GIL and are
single-threaded inside: no OpenMP barrier per kernel). No torch: a compare never imports it.

Besides the matched pairs, a block measures each segment the plan calls wrong against its closest
counterpart (:func:`tracediff.compare.plan.decide.profile_requests`), in per-position buckets only: a handful
of float64 sums per bucket, never a per-row array.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.plan.decide import ProfileRequest
from tracediff.compare.plan.segments import to_float32
from tracediff.compare.rows.gather import ChunkReader, StreamLocation, location_of, reference_files
from tracediff.compare.rows.index import RowIndex
from tracediff.compare.rows.kernels import (
    FUSED_DTYPES,
    dot,
    exact_row_stats,
    fused_kernel,
    fused_row_stats,
    norms,
    numpy_closed_forms,
    numpy_row_stats,
    row_bytes,
    use_fused_kernel,
)
from tracediff.compare.stream.metrics import PositionBuckets
from tracediff.store import VALUE_DTYPES, TraceStream
from tracediff.store.files import aligned_empty


def _widen(src: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Stored rows ``src`` into the float32 buffer ``out`` (bf16 bits widened exactly)."""
    if dtype == "bfloat16":
        np.left_shift(src.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = src


@dataclass
class _Buffers:
    """What one worker thread reuses from block to block: readers (open files), every buffer, and
    the views of a sub-block the kernels read and write (made once: slicing costs as much as a
    small kernel)."""

    cand: ChunkReader
    ref: ChunkReader
    craw: np.ndarray  # [block, wc] stored dtype, 64-byte aligned
    rraw: np.ndarray
    cf: np.ndarray  # [sub, wc] float32
    rf: np.ndarray
    d: np.ndarray  # [sub, size] float32
    xc: np.ndarray  # [block, kc] segment norms
    xr: np.ndarray  # [block, kr]
    dn: np.ndarray  # [pairs, block] norm of the difference
    mx: np.ndarray  # [pairs, block] largest |difference|
    sn: np.ndarray  # [pairs, block] norm of the standardised difference
    sd: np.ndarray  # [pairs, block] norm of the standardised reference
    d2: np.ndarray  # [sub, size] float32 (profiles: the standardised reference)
    pdn: np.ndarray  # [profiles, block] norm of the difference
    psn: np.ndarray  # [profiles, block] norm of the standardised difference
    psd: np.ndarray  # [profiles, block] norm of the standardised reference
    pzc: np.ndarray  # [profiles, block] norm of the standardised candidate (its own scales)
    pzd: np.ndarray  # [profiles, block] dot of the two standardised segments
    cpart: np.ndarray  # [part, wc] stored values (bf16 bits): rows read and measured part by part
    rpart: np.ndarray
    views: dict[tuple[int, int], tuple] = field(default_factory=dict)


@dataclass
class BlockResult:
    """What one block of row pairs adds to the pass: sums, counts and first indices that merge
    exactly (in block order, as one thread would add them), and the per-row metrics of its rows."""

    bad_c: np.ndarray  # [kc] rows with a non-finite candidate segment
    bad_r: np.ndarray
    first_c: dict[int, int]
    first_r: dict[int, int]
    pair_bad_c: np.ndarray  # [pairs]
    pair_bad_r: np.ndarray
    sq_err: np.ndarray  # [pairs] float64
    sq_ref: np.ndarray
    std_num: np.ndarray  # [pairs] float64
    std_den: np.ndarray
    # Per profile: [8, buckets] sums and counts of the raw cosine, standardised cosine, norm ratio and
    # squared standardised error; and [2] the sum and count of the squared standardised reference norm.
    profile_sums: list[np.ndarray] = field(default_factory=list)
    profile_den: list[np.ndarray] = field(default_factory=list)
    # The block's place in the pass, and per row (of the block) and pair the float32 metrics: the
    # client writes cosine, norm ratio and squared standardised error into its per-row arrays, and
    # reduces rel_diff and max abs diff (:func:`tracediff.compare.stream.metrics.reduce_block`).
    number: int = 0
    start: int = 0
    stop: int = 0
    row_metrics: np.ndarray | None = None  # [5, rows, pairs] float32
    bytes_read: int = 0

    @classmethod
    def joined(cls, parts: list[BlockResult]) -> BlockResult:
        """The result of consecutive blocks ``parts`` (in order) as one block's: counts and sums added
        in that order, first indices taken from the first that has one, per-row metrics one after
        the other."""
        head = parts[0]

        def total(name: str) -> np.ndarray:
            out = getattr(head, name).copy()
            for r in parts[1:]:
                out += getattr(r, name)
            return out

        first_c: dict[int, int] = {}
        first_r: dict[int, int] = {}
        for r in parts:
            for s, k in r.first_c.items():
                first_c.setdefault(s, k)
            for s, k in r.first_r.items():
                first_r.setdefault(s, k)
        profile_sums = [sum((r.profile_sums[q] for r in parts[1:]), head.profile_sums[q].copy())
                        for q in range(len(head.profile_sums))]
        profile_den = [sum((r.profile_den[q] for r in parts[1:]), head.profile_den[q].copy())
                       for q in range(len(head.profile_den))]
        rows = None if head.row_metrics is None else np.concatenate([r.row_metrics for r in parts], axis=1)
        return cls(total("bad_c"), total("bad_r"), first_c, first_r, total("pair_bad_c"), total("pair_bad_r"),
                   total("sq_err"), total("sq_ref"), total("std_num"), total("std_den"), profile_sums, profile_den,
                   head.number, head.start, parts[-1].stop, rows, sum(r.bytes_read for r in parts))


@dataclass(frozen=True)
class PassPlan:
    """Everything a block of the pass needs besides its rows: small, picklable, the same for every
    block (a cluster receives it once). Streams are named by their store's location, tap and writer
    (and the committed rows the client saw), so a worker opens them itself."""

    matches: tuple[tuple[int, int], ...]  # (candidate segment, reference segment) per pair
    segment_size: int
    block: int  # rows of a block: bounds a worker's memory (about ``block_bytes`` of raw rows)
    sub: int
    scales: tuple[tuple[np.ndarray, np.ndarray], ...]
    profiles: tuple[ProfileRequest, ...]
    bucket_edges: np.ndarray
    candidate_width: int
    reference_width: int
    candidate_dtype: str
    reference_dtype: str
    candidate_streams: tuple[StreamLocation, ...] = ()
    reference_streams: tuple[StreamLocation, ...] = ()
    # Whether blocks use the fused kernel (tracediff.compare.rows.kernels) where it runs.
    fused: bool = False
    # Whether blocks are read and measured a part at a time (:meth:`_Pass._read_and_measure`): rows of
    # 4 KiB or more a side, the fused kernel, no profiles, chunk files read straight. Such blocks are
    # larger (their rows are never held whole); ``raw_block`` rows are what a worker's buffers of raw
    # rows hold (0: the block), for what is read whole after all.
    parts: bool = False
    raw_block: int = 0


@dataclass(frozen=True)
class BlockSpec:
    """One block of row pairs as a worker reads it: per pair, which stream and stored row each side
    holds it in, and its position bucket. Pairs ``start..stop`` of the pass."""

    number: int
    start: int
    stop: int
    cand_stream: np.ndarray  # int32
    cand_row: np.ndarray  # int64
    ref_stream: np.ndarray
    ref_row: np.ndarray
    buckets: np.ndarray  # int16

    @classmethod
    def of(cls, pairs: RowPairs, reference: RowIndex, candidate: RowIndex, buckets: PositionBuckets,
           number: int, start: int, stop: int) -> BlockSpec:
        c, r = pairs.candidate[start:stop], pairs.reference[start:stop]
        cs, rs = candidate.stream_of(c), reference.stream_of(r)
        return cls(number, start, stop, cs, candidate.row_of(c, cs), rs, reference.row_of(r, rs),
                   buckets.index[start:stop])


#: The most rows of a block, with the compiled kernels and with numpy's (docs/performance.md): each
#: block costs ~1 ms of Python (8 M rows of 3 x 64: the pass 6.8-6.9 s in 8192-row blocks, 6.0 s in
#: 16 MiB ones); numpy's per-row temporaries grow with it (0.5 M such rows: 169 MiB against 127).
_BLOCK_ROWS = (1 << 15, 1 << 13)


def pass_plan(pairs: RowPairs, reference: RowIndex, candidate: RowIndex, matches: list[tuple[int, int]],
              segment_size: int, scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
              profiles: list[ProfileRequest] | None = None, block_bytes: int = 16 << 20,
              buckets: PositionBuckets | None = None) -> PassPlan:
    """The :class:`PassPlan` of :func:`stream_metrics`'s arguments (``buckets``: the pairs' position
    buckets, when already made)."""
    size = segment_size
    wc = candidate.streams[0].width
    wr = reference.streams[0].width
    cdt, rdt = candidate.streams[0].dtype, reference.streams[0].dtype
    raw_row = row_bytes(candidate, reference)
    fused = use_fused_kernel(len(pairs) * raw_row)
    # Rows of a block: ``block_bytes`` of raw rows, at most _BLOCK_ROWS (the block's per-row bookkeeping,
    # ~50 bytes a row and pair with the compiled kernels, stays a few MiB however narrow the rows).
    block = max(64, min(_BLOCK_ROWS[0 if fused else 1], block_bytes // max(1, raw_row)))
    raw_block = block
    parts = (fused and not profiles and cdt in FUSED_DTYPES and rdt in FUSED_DTYPES
             and min(wc * VALUE_DTYPES[cdt].itemsize, wr * VALUE_DTYPES[rdt].itemsize) >= _PART_ROW_BYTES
             and all(s.reads_rows_directly for s in (*candidate.streams, *reference.streams)))
    if parts:  # (each block costs ~1-2 ms of Python, held between two threads: at 3 GiB of 3 x 4096, 16 MiB
        # blocks 0.91-1.07 s of the pass, 64 MiB ones 0.74-0.79)
        block = max(block, min(_BLOCK_ROWS[0], _PARTS_BLOCK * block_bytes // max(1, raw_row)))
    # Sub-blocks of about 2 MiB of float32 rows: small enough to stay in cache between kernels,
    # large enough that the per-kernel dispatch cost stays small.
    sub = max(16, min(block, (2 << 20) // max(1, (wc + wr) * 4)))
    if scales is None:
        scales = [(np.zeros(size, np.float32), np.ones(size, np.float32)) for _ in matches]
    if buckets is None:
        buckets = PositionBuckets.of(reference.position, pairs.reference)
    return PassPlan(tuple((int(i), int(j)) for i, j in matches), size, block, sub, tuple(scales),
                    tuple(profiles or ()), buckets.edges, wc, wr, cdt, rdt,
                    tuple(location_of(s) for s in candidate.streams), tuple(location_of(s) for s in reference.streams),
                    fused, parts, raw_block)


class _Pass:
    """The per-block work of :func:`stream_metrics`: a function of (plan, the block's rows) alone,
    run by threads of this process or by tasks of a cluster (:mod:`tracediff.compare.stream.cluster`).

    A block (:meth:`block_metrics`) is read and measured by parts where it can (:meth:`_read_and_measure`),
    else read whole, or in slices the raw buffers hold (:meth:`_in_slices`); then :meth:`_block`:
    the norms (:meth:`_norms`), which values are finite (:meth:`_finite`), the pairs' metrics
    (:meth:`_pair_metrics`) and the profiles' per-position sums (:meth:`_profile_sums`)."""

    def __init__(self, plan: PassPlan, reference: Sequence[TraceStream], candidate: Sequence[TraceStream]) -> None:
        self.plan = plan
        self.reference, self.candidate = list(reference), list(candidate)
        self.matches = list(plan.matches)
        self.profiles = list(plan.profiles)
        self.buckets = PositionBuckets(plan.bucket_edges, np.empty(0, dtype=np.int16))
        # Per profile: (reference mean, 1 / reference scale, candidate mean, 1 / candidate scale).
        self.profile_scales = [(_f32(r.ref_mean), _inverse(r.ref_scale), _f32(r.cand_mean), _inverse(r.cand_scale))
                               for r in self.profiles]
        self.size, self.block, self.sub = plan.segment_size, plan.block, plan.sub
        self.wc, self.wr = plan.candidate_width, plan.reference_width
        self.kc, self.kr = self.wc // self.size, self.wr // self.size
        self.cdt, self.rdt = plan.candidate_dtype, plan.reference_dtype
        self.seg_c = np.array([i for i, _ in self.matches], dtype=np.int64)
        self.seg_r = np.array([j for _, j in self.matches], dtype=np.int64)
        # Per pair: the reference segment's robust mean and 1 / scale (the plan's, float32).
        self.scales = [(_f32(m), _inverse(s)) for m, s in plan.scales]
        # The same as [pairs, size] arrays, for the fused kernel.
        self.np_means = np.ascontiguousarray(
            np.stack([m for m, _ in self.scales]) if self.scales else np.zeros((0, self.size), np.float32))
        self.np_invs = np.ascontiguousarray(
            np.stack([s for _, s in self.scales]) if self.scales else np.zeros((0, self.size), np.float32))
        # Wide rows (where each run of rows costs one read anyway) are read and measured by one compiled
        # loop a part of ~1 MiB at a time, while the part is in the cache (:meth:`_read_and_measure`);
        # what must be read whole after all goes through buffers of ``raw_block`` rows.
        raw_row = self.wc * VALUE_DTYPES[self.cdt].itemsize + self.wr * VALUE_DTYPES[self.rdt].itemsize
        self.by_parts = plan.parts
        self.raw_block = plan.raw_block or plan.block
        self.part = max(1, min(self.block, _PART_BYTES // raw_row)) if self.by_parts else 0

    def buffers(self) -> _Buffers:
        p, q = len(self.matches), len(self.profiles)
        return _Buffers(
            cand=ChunkReader(self.candidate, max_chunks=8, compiled=self.plan.fused),
            # The reference is read in the candidate's order, across many chunk files at once.
            ref=ChunkReader(self.reference, max_chunks=64, max_files=reference_files(), compiled=self.plan.fused),
            craw=aligned_empty((self.raw_block, self.wc), VALUE_DTYPES[self.cdt]),
            rraw=aligned_empty((self.raw_block, self.wr), VALUE_DTYPES[self.rdt]),
            cf=aligned_empty((self.sub, self.wc), np.float32),
            rf=aligned_empty((self.sub, self.wr), np.float32),
            d=np.empty((self.sub, self.size), np.float32),
            xc=np.empty((self.block, self.kc), np.float32),
            xr=np.empty((self.block, self.kr), np.float32),
            dn=np.empty((p, self.block), np.float32),
            mx=np.empty((p, self.block), np.float32),
            sn=np.empty((p, self.block), np.float32),
            sd=np.empty((p, self.block), np.float32),
            d2=np.empty((self.sub if q else 0, self.size), np.float32),
            pdn=np.empty((q, self.block), np.float32),
            psn=np.empty((q, self.block), np.float32),
            psd=np.empty((q, self.block), np.float32),
            pzc=np.empty((q, self.block), np.float32),
            pzd=np.empty((q, self.block), np.float32),
            cpart=aligned_empty((self.part, self.wc), _stored(self.cdt)),
            rpart=aligned_empty((self.part, self.wr), _stored(self.rdt)),
        )

    def _views(self, w: _Buffers, s0: int, s1: int) -> tuple:
        """Everything the kernels of rows s0..s1 of the block touch, as views."""
        key = (s0, s1)
        views = w.views.get(key)
        if views is not None:
            return views
        b, size = s1 - s0, self.size
        sides = []
        for raw, buf, dtype, k in ((w.craw, w.cf, self.cdt, self.kc), (w.rraw, w.rf, self.rdt, self.kr)):
            src = raw[s0:s1]
            if dtype == "float32":  # used in place
                widen, rows = None, src
            else:
                widen, rows = (buf[:b], src, dtype), buf[:b]
            sides.append((widen, rows.reshape(b, k, size)))
        (cwiden, c3), (rwiden, r3) = sides
        kernels = [
            (c3[:, i], r3[:, j], w.dn[p, s0:s1], w.mx[p, s0:s1],
             w.sn[p, s0:s1], w.sd[p, s0:s1], *self.scales[p])
            for p, (i, j) in enumerate(self.matches)
        ]
        profile_kernels = [
            (c3[:, r.candidate], r3[:, r.reference], w.pdn[q, s0:s1], w.psn[q, s0:s1], w.psd[q, s0:s1],
             w.pzc[q, s0:s1], w.pzd[q, s0:s1], *self.profile_scales[q])
            for q, r in enumerate(self.profiles)
        ]
        views = (cwiden, rwiden, c3, r3, w.xc[s0:s1], w.xr[s0:s1], w.d[:b], kernels, w.d2[:b], profile_kernels)
        if len(w.views) < 4 * (self.block // self.sub + 2):
            w.views[key] = views
        return views

    def run(self, pool: queue.SimpleQueue, spec: BlockSpec | Callable[[], BlockSpec]) -> BlockResult:
        """One block on buffers taken from ``pool`` (``spec`` may be made here, on the thread)."""
        bufs = pool.get()
        try:
            return self.block_metrics(bufs, spec if isinstance(spec, BlockSpec) else spec())
        finally:
            pool.put(bufs)

    def block_metrics(self, w: _Buffers, spec: BlockSpec) -> BlockResult:
        before = w.cand.bytes_read + w.ref.bytes_read
        m = spec.stop - spec.start
        measured = self.by_parts and self._read_and_measure(w, spec, m)
        # (A block larger than the raw buffers that could not be read by parts is measured in slices.)
        res = self._in_slices(w, spec) if not measured and m > self.raw_block else self._block(w, spec, measured)
        res.bytes_read = w.cand.bytes_read + w.ref.bytes_read - before
        return res

    def _in_slices(self, w: _Buffers, spec: BlockSpec) -> BlockResult:
        """A block made to be read by parts that cannot be here (no compiled reads on this worker,
        rows in more chunk files than a reader keeps open, a read that came back short): measured as
        consecutive blocks the raw buffers hold, their results joined."""
        m = spec.stop - spec.start
        return BlockResult.joined([
            self._block(w, BlockSpec(spec.number, spec.start + a, spec.start + b, spec.cand_stream[a:b],
                                     spec.cand_row[a:b], spec.ref_stream[a:b], spec.ref_row[a:b], spec.buckets[a:b]),
                        False)
            for a, b in ((a, min(m, a + self.raw_block)) for a in range(0, m, self.raw_block))])

    def _block(self, w: _Buffers, spec: BlockSpec, measured: bool) -> BlockResult:
        """The block's results; ``measured``: its rows were read and measured by parts already, else
        (at most ``raw_block`` rows) it reads them whole here. In order: each segment's norms and, per
        pair, the norms of the difference; which values are finite; per pair and row the metrics
        (closed forms of the norms); per profile the per-position sums."""
        start, stop = spec.start, spec.stop
        m = stop - start
        read = self._norms(w, spec, measured)
        xc, xr = w.xc[:m], w.xr[:m]
        # A segment with a non-finite value has a non-finite norm; a non-finite norm may also be an
        # overflow of finite values: only those rows are checked value by value.
        fin_c = self._finite(w, spec, read, 0, xc)
        fin_r = self._finite(w, spec, read, 1, xr)
        # (A finite block, nearly all, skips the strided column sums of its [rows, segments] flags.)
        all_c, all_r = bool(fin_c.all()), bool(fin_r.all())
        bad_c = np.zeros(self.kc, dtype=np.intp) if all_c else (~fin_c).sum(axis=0)
        bad_r = np.zeros(self.kr, dtype=np.intp) if all_r else (~fin_r).sum(axis=0)
        row_metrics, sq_err, sq_ref, std_num, std_den = self._pair_metrics(w, spec, read, xc, xr, fin_c, fin_r)
        profile_sums, profile_den = self._profile_sums(w, m, spec.buckets, xc, xr, fin_c, fin_r)
        return BlockResult(
            bad_c, bad_r,
            {int(s): start + int(np.argmax(~fin_c[:, s])) for s in np.flatnonzero(bad_c)},
            {int(s): start + int(np.argmax(~fin_r[:, s])) for s in np.flatnonzero(bad_r)},
            bad_c[self.seg_c] if all_c else (~fin_c[:, self.seg_c]).sum(axis=0),
            bad_r[self.seg_r] if all_r else (~fin_r[:, self.seg_r]).sum(axis=0), sq_err, sq_ref,
            std_num, std_den, profile_sums, profile_den, spec.number, start, stop, row_metrics,
        )

    def _norms(self, w: _Buffers, spec: BlockSpec, measured: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Into the buffers: the norms of every segment and, per matched pair, of the difference (and
        the profiles' norms). One fused loop that reads each stored value once
        (tracediff.compare.rows.kernels), where it runs, on wide rows as they are read; else (and for
        the profiles) numpy kernels a sub-block at a time (its float32 rows stay in cache). Returns
        the block's rows where it read them whole here (empty where they were measured as read: those
        are read again only where a row needs its values, non-finite or extreme norms, rare)."""
        m, size = spec.stop - spec.start, self.size
        read: list[tuple[np.ndarray, np.ndarray]] = []
        fused = measured
        if not measured:
            craw = w.cand.gather_at(spec.cand_stream, spec.cand_row, w.craw)
            rraw = w.ref.gather_at(spec.ref_stream, spec.ref_row, w.rraw)
            read.append((craw, rraw))
            fused = self.plan.fused and fused_row_stats(craw, rraw, m, size, self.cdt, self.rdt, self.seg_c, self.seg_r,
                                                        self.np_means, self.np_invs, w.xc, w.xr, w.dn, w.mx, w.sn, w.sd)
        sub_, mul = np.subtract, np.multiply
        with np.errstate(all="ignore"):
            for s0 in range(0, m, self.sub) if not fused or self.profiles else ():
                cwiden, rwiden, c3, r3, xc, xr, d, kernels, d2, profile_kernels = self._views(w, s0, min(m, s0 + self.sub))
                if cwiden is not None:
                    _widen(cwiden[1], cwiden[2], cwiden[0])
                if rwiden is not None:
                    _widen(rwiden[1], rwiden[2], rwiden[0])
                if not fused:
                    numpy_row_stats(c3, r3, xc, xr, kernels, d)
                # Profiles: the same, plus the standardised cosine (each side in its own scales, as the
                # plan's matrix).
                for a, b, dn, sn, sd, zc, zd, rmean, rinv, cmean, cinv in profile_kernels:
                    sub_(a, b, out=d)
                    norms(d, dn)
                    mul(d, rinv, out=d)
                    norms(d, sn)
                    sub_(b, rmean, out=d2)
                    mul(d2, rinv, out=d2)
                    norms(d2, sd)
                    sub_(a, cmean, out=d)
                    mul(d, cinv, out=d)
                    norms(d, zc)
                    dot(d, d2, zd)
        return read

    def _pair_metrics(self, w: _Buffers, spec: BlockSpec, read: list, xc: np.ndarray, xr: np.ndarray,
                      fin_c: np.ndarray, fin_r: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per pair (columns), per row: closed forms of the norms. 1 - cos = (|d|^2 - (|a|-|b|)^2) /
        (2|a||b|) stays exact near cos = 1. Rows of any other size (tiny, huge or overflowing norms)
        take the per-element formulas on their values. Compiled (one loop, the same bits) where the
        pass uses the compiled kernels, else numpy's expressions. Returns the per-row metrics
        [5, rows, pairs] and per pair the sums of squared errors, of squared reference norms, and the
        standardised error's numerator and denominator."""
        m, size, kc, kr = spec.stop - spec.start, self.size, self.kc, self.kr
        compiled = fused_kernel() if self.plan.fused else None
        if compiled is not None:
            row_metrics = np.empty((5, m, len(self.matches)), dtype=np.float32)
            sums = np.empty((4, len(self.matches), m))  # [m, pairs] column-major, as numpy's expressions give
            odd = np.empty((m, len(self.matches)), dtype=bool)
            compiled.closed_forms(m, xc, xr, self.seg_c, self.seg_r, fin_c, fin_r, w.dn, w.mx, w.sn, w.sd, row_metrics,
                                  sums, odd)
            sq_err, sq_ref, std_num, std_den = (sums[k].T.sum(axis=0) for k in range(4))  # (the same summation)
            cos, ratio, rel, max_abs = row_metrics[0], row_metrics[1], row_metrics[2], row_metrics[3]
            odd_rows, odd_pairs = np.nonzero(odd)
        else:
            cos, ratio, rel, max_abs, sq_err, sq_ref, std_num, std_den, std_metric, odd_rows, odd_pairs = \
                numpy_closed_forms(m, xc, xr, self.seg_c, self.seg_r, fin_c, fin_r, w.dn, w.mx, w.sn, w.sd)
        for p in np.unique(odd_pairs).tolist():
            for rows in self._slices(odd_rows[odd_pairs == p]):
                e_cos, e_ratio, e_rel, e_max, e_sq, e_nb = exact_row_stats(
                    to_float32(self._stored(w, spec, read, 0, rows), self.cdt).reshape(-1, kc, size)[:, self.seg_c[p]],
                    to_float32(self._stored(w, spec, read, 1, rows), self.rdt).reshape(-1, kr, size)[:, self.seg_r[p]],
                )
                cos[rows, p], ratio[rows, p], rel[rows, p], max_abs[rows, p] = e_cos, e_ratio, e_rel, e_max
                sq_err[p] += e_sq
                sq_ref[p] += e_nb
        if compiled is None:
            row_metrics = np.empty((5, m, len(self.matches)), dtype=np.float32)
            row_metrics[0], row_metrics[1], row_metrics[2], row_metrics[3] = cos, ratio, rel, max_abs
            row_metrics[4] = std_metric
        return row_metrics, sq_err, sq_ref, std_num, std_den

    def _profile_sums(self, w: _Buffers, m: int, index: np.ndarray, xc: np.ndarray, xr: np.ndarray,
                      fin_c: np.ndarray, fin_r: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per profile, the block's per-bucket sums (rows whose norms are not ordinary are left out
        of the cosines: a wrong segment's profile needs no last digit)."""
        if not self.profiles:
            return [], []
        sums, dens = [], []
        for q, r in enumerate(self.profiles):
            x = xc[:, r.candidate].astype(np.float64)
            y = xr[:, r.reference].astype(np.float64)
            ok = fin_c[:, r.candidate] & fin_r[:, r.reference]
            dd = w.pdn[q, :m].astype(np.float64) ** 2
            zc = w.pzc[q, :m].astype(np.float64)
            zr = w.psd[q, :m].astype(np.float64)
            zd = w.pzd[q, :m].astype(np.float64)
            sn2 = w.psn[q, :m].astype(np.float64) ** 2
            ordinary_y = (y > 1e-15) & (y < 1e18)
            fast = ok & ordinary_y & (x > 1e-15) & (x < 1e18) & np.isfinite(dd)
            with np.errstate(all="ignore"):
                cos = 1.0 - np.clip((dd - (x - y) ** 2) / (2.0 * x * y), 0.0, 2.0)
                zcos = np.clip(zd / (zc * zr), -1.0, 1.0)
                ratio = x / y
            zok = ok & np.isfinite(zcos) & (zc > 0) & (zr > 0)
            rok = ok & ordinary_y & np.isfinite(ratio)
            eok = ok & np.isfinite(sn2) & np.isfinite(zr)
            out = np.zeros((8, self.buckets.count))
            for k, (values, keep) in enumerate(((cos, fast), (zcos, zok), (ratio, rok), (sn2, eok))):
                out[2 * k], out[2 * k + 1] = self.buckets.sums(index, values, keep)
            sums.append(out)
            dens.append(np.array([float(np.where(eok, zr * zr, 0.0).sum()), float(eok.sum())]))
        return sums, dens

    def _read_and_measure(self, w: _Buffers, spec: BlockSpec, m: int) -> bool:
        """The fused kernel on the block's rows as they are read, a part at a time
        (:func:`tracediff.compare.rows.fused.read_and_measure`): False, having measured nothing that
        counts, where it cannot run here or a read failed (the caller reads the block whole, and so
        raises the store's error)."""
        compiled = fused_kernel()
        if compiled is None:
            return False
        cand = w.cand.runs_at(spec.cand_stream, spec.cand_row)
        ref = w.ref.runs_at(spec.ref_stream, spec.ref_row) if cand is not None else None
        if cand is None or ref is None:
            return False
        failed = compiled.read_and_measure(cand.fds, cand.offsets, cand.dest, cand.lengths, ref.fds, ref.offsets,
                                           ref.dest, ref.lengths, w.cpart, w.rpart, m, self.size, self.seg_c,
                                           self.seg_r, self.np_means, self.np_invs, w.xc, w.xr, w.dn, w.mx, w.sn, w.sd)
        if failed >= 0:
            return False
        w.cand.bytes_read += m * w.cpart.strides[0]
        w.ref.bytes_read += m * w.rpart.strides[0]
        return True

    def _finite(self, w: _Buffers, spec: BlockSpec, read: list, side: int, norms: np.ndarray) -> np.ndarray:
        """Per row and segment of one side (0: the candidate), whether its values are finite: from its
        norm, and for a row with a non-finite norm (overflow or a non-finite value) from its values."""
        fin = np.isfinite(norms)
        if not fin.all():
            dtype, k = (self.cdt, self.kc) if side == 0 else (self.rdt, self.kr)
            for rows in self._slices(np.flatnonzero(~fin.all(axis=1))):
                values = to_float32(self._stored(w, spec, read, side, rows), dtype)
                fin[rows] = np.isfinite(values.reshape(rows.size, k, -1)).all(axis=2)
        return fin

    def _slices(self, rows: np.ndarray) -> list[np.ndarray]:
        """``rows`` in pieces the raw buffers hold."""
        return [rows[a : a + self.raw_block] for a in range(0, rows.size, self.raw_block)]

    @staticmethod
    def _stored(w: _Buffers, spec: BlockSpec, read: list, side: int, rows: np.ndarray) -> np.ndarray:
        """The stored values of the block's rows ``rows`` of one side (0: the candidate): from the block
        read whole (``read``), else read now into that side's raw buffer (at most ``raw_block`` rows)."""
        if read:
            return read[0][side][rows]
        if side == 0:
            return w.cand.gather_at(spec.cand_stream[rows], spec.cand_row[rows], w.craw)
        return w.ref.gather_at(spec.ref_stream[rows], spec.ref_row[rows], w.rraw)


#: Rows of at least this many bytes a side are read and measured a part at a time (one read per run of
#: rows, as the store reads them straight to their places: tracediff.store.stream._DIRECT_ROW_BYTES),
#: parts of about _PART_BYTES (both sides), which the cache holds.
_PART_ROW_BYTES = 4096
_PART_BYTES = 1 << 20
#: Blocks read by parts are this many times ``block_bytes`` of raw rows.
_PARTS_BLOCK = 4


def _stored(dtype: str) -> np.dtype:
    """The array dtype the fused kernel reads stored values of ``dtype`` as (bf16 as its bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else VALUE_DTYPES[dtype]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _inverse(scale: np.ndarray) -> np.ndarray:
    """1 / scale, float32 (the pass multiplies by it)."""
    return np.ascontiguousarray(np.float32(1.0) / np.asarray(scale, dtype=np.float32))


class BlockWorker:
    """One thread's share of a pass run elsewhere: the per-block function and the buffers it reuses
    from block to block (a cluster worker keeps one per thread for the whole compare)."""

    def __init__(self, plan: PassPlan, reference: Sequence[TraceStream], candidate: Sequence[TraceStream]) -> None:
        self._job = _Pass(plan, reference, candidate)
        self._bufs = self._job.buffers()

    def run(self, spec: BlockSpec) -> BlockResult:
        return self._job.block_metrics(self._bufs, spec)

    def close(self) -> None:
        self._bufs.cand.close()
        self._bufs.ref.close()


def run_blocks(plan: PassPlan, reference: Sequence[TraceStream], candidate: Sequence[TraceStream],
               specs: Iterable[BlockSpec], workers: int = 1) -> Iterator[BlockResult]:
    """The results of ``specs`` (in order) on ``workers`` threads of this process (the blocks are the
    parallelism; numpy's kernels are single-threaded)."""
    job = _Pass(plan, reference, candidate)
    pool: queue.SimpleQueue = queue.SimpleQueue()
    made = [job.buffers() for _ in range(max(1, workers))]
    for bufs in made:
        pool.put(bufs)
    try:
        if workers <= 1:
            for spec in specs:
                yield job.run(pool, spec)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="tracediff-stream") as ex:
                futures = [ex.submit(job.run, pool, spec) for spec in specs]
                try:
                    for fut in futures:
                        yield fut.result()
                finally:
                    for fut in futures:
                        fut.cancel()
    finally:
        for bufs in made:
            bufs.cand.close()
            bufs.ref.close()

