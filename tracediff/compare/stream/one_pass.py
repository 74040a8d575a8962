"""The streaming pass over aligned rows: every aligned row pair measured once, in blocks
(:mod:`tracediff.compare.stream.blocks`: the work on one block), on the threads of this process or on a
cluster (:mod:`tracediff.compare.stream.cluster`), and the pass's metrics made of the blocks' results.

:class:`_Merger` adds the results in block order whatever order they finish in, so threads of this
process and tasks on a cluster give the same bits. Memory beyond the blocks' own: per-row float32
arrays of the pass's pairs (in memory, or past a size in a temporary file:
:mod:`tracediff.compare.stream.rowcolumns`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.plan.decide import ProfileRequest
from tracediff.compare.rows.gather import usable_cpus
from tracediff.compare.rows.index import RowIndex
from tracediff.compare.stream.blocks import BlockResult, BlockSpec, PassPlan, pass_plan, run_blocks
from tracediff.compare.stream.metrics import (
    Accumulator,
    BlockReduction,
    FinishJob,
    PositionBuckets,
    StreamResult,
    finish_pairs,
    profile_of,
    reduce_block,
)
from tracediff.compare.stream.rowcolumns import COLUMNS, COSINE, NORM_RATIO, STD_ERROR, RowColumns
from tracediff.errors import CompareError

Progress = Callable[[int], None]

class BlockRunner(Protocol):
    """Runs the blocks of a pass somewhere else (:class:`tracediff.compare.stream.cluster.DaskRunner`): each
    spec through :func:`run_blocks` on ``plan``, each result handed to ``add`` (in any order) on the
    calling thread. Raises :class:`tracediff.errors.CompareError` when a block cannot be run."""

    def run(self, plan: PassPlan, specs: Iterable[BlockSpec], blocks: int, add: Callable[[BlockResult], None]) -> None: ...


class _Merger:
    """The pass's totals. Each block's per-row metrics go straight into the per-row arrays (exact
    in any order); its sums are added in block order whatever order blocks finish in, so the totals
    are the same bits as one thread adding block after block."""

    def __init__(self, accs: list[Accumulator], columns: RowColumns, kc: int, kr: int, profiles: int, buckets: int,
                 blocks: int, progress: Progress | None) -> None:
        self.accs, self.columns, self.blocks, self.progress = accs, columns, blocks, progress
        self.nf_c = np.zeros(kc, dtype=np.int64)
        self.nf_r = np.zeros(kr, dtype=np.int64)
        self.first_c: dict[int, int] = {}
        self.first_r: dict[int, int] = {}
        self.profile_sums = [np.zeros((8, buckets)) for _ in range(profiles)]
        self.profile_den = [np.zeros(2) for _ in range(profiles)]
        self.bytes_read = 0
        self.next = 0
        self.pending: dict[int, BlockResult] = {}
        self.reduced: dict[int, list[BlockReduction]] = {}  # per block, per pair

    def add(self, res: BlockResult) -> None:
        if not self.next <= res.number < self.blocks or res.number in self.pending:
            raise CompareError(f"streaming pass: block {res.number} arrived twice or was never asked for")
        rm = res.row_metrics
        if rm is not None:
            for p in range(len(self.accs)):
                for column, k in ((COSINE, 0), (NORM_RATIO, 1), (STD_ERROR, 4)):
                    self.columns.write(p, column, res.start, rm[k, :, p])
            # rel_diff and max |diff| reduce to a few numbers at once; they are folded in block order.
            self.reduced[res.number] = [reduce_block(res.start, rm[2, :, p], rm[3, :, p])
                                        for p in range(len(self.accs))]
            res.row_metrics = None  # a held block keeps only its sums
        self.bytes_read += res.bytes_read
        self.pending[res.number] = res
        while self.next in self.pending:
            self._merge(self.pending.pop(self.next))
            self.next += 1
        if self.progress is not None:
            self.progress(res.stop - res.start)

    def _merge(self, res: BlockResult) -> None:
        self.nf_c += res.bad_c
        self.nf_r += res.bad_r
        for s, k in res.first_c.items():
            self.first_c.setdefault(s, k)
        for s, k in res.first_r.items():
            self.first_r.setdefault(s, k)
        reduced = self.reduced.pop(res.number, None)
        for p, acc in enumerate(self.accs):
            if reduced is not None:
                acc.add_block(reduced[p])
            acc.nonfinite_c += int(res.pair_bad_c[p])
            acc.nonfinite_r += int(res.pair_bad_r[p])
            acc.sq_err += float(res.sq_err[p])
            acc.sq_ref += float(res.sq_ref[p])
            acc.std_num += float(res.std_num[p])
            acc.std_den += float(res.std_den[p])
        for q in range(len(self.profile_sums)):
            self.profile_sums[q] += res.profile_sums[q]
            self.profile_den[q] += res.profile_den[q]

    def check_complete(self) -> None:
        if self.next != self.blocks:
            raise CompareError(f"streaming pass: {self.blocks - self.next} of {self.blocks} blocks never arrived")


def _read_column(columns: RowColumns, pair: int, name: str) -> np.ndarray:
    return columns.read(pair, COLUMNS.index(name))


def stream_metrics(
    pairs: RowPairs,
    reference: RowIndex,
    candidate: RowIndex,
    matches: list[tuple[int, int]],
    segment_size: int,
    scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
    *,
    limits: list[tuple[float, float]] | None = None,
    profiles: list[ProfileRequest] | None = None,
    block_bytes: int = 16 << 20,
    progress: Progress | None = None,
    workers: int | None = None,
    runner: BlockRunner | None = None,
) -> StreamResult:
    """One pass over every aligned row pair: per matched segment pair, every metric of the report.

    ``scales`` holds, per match, the reference segment's robust (mean, scale) from the plan sample
    (:class:`tracediff.compare.plan.segments.SegmentScales`); without it, every dimension counts at scale 1.
    ``limits``, per match, the (numerics budget, drift limit) the findings hold it to
    (:func:`tracediff.compare.plan.decide.pair_limits`), carried into its metrics. ``profiles`` are pairs measured per position only
    (:func:`tracediff.compare.plan.decide.profile_requests`).

    ``workers`` threads (default: the CPUs this process may run on) each take whole blocks; for compressed
    stores, one (they share a cache of decoded chunks). With ``runner``, the blocks run there (a
    cluster) instead. Results do not depend on the thread count nor on where blocks run: every block
    is the same function of the plan and its rows, and the totals merge in block order.
    """
    n = len(pairs)
    buckets = PositionBuckets.of(reference.position, pairs.reference)
    plan = pass_plan(pairs, reference, candidate, matches, segment_size, scales, profiles, block_bytes, buckets)
    kc, kr = plan.candidate_width // segment_size, plan.reference_width // segment_size
    # Per-row metrics in memory, or past RowColumns' size in an unlinked temporary file (each pair's
    # read back for its metrics, its subset search and its profiles).
    columns = RowColumns(len(matches), n)
    accs = [Accumulator(i, j) for i, j in matches]
    if limits is None:
        limits = [(float("nan"), float("nan")) for _ in matches]
    profiles = list(plan.profiles)
    spans = [(start, min(n, start + plan.block)) for start in range(0, n, plan.block)]
    merger = _Merger(accs, columns, kc, kr, len(profiles), buckets.count, len(spans), progress)
    try:
        if runner is not None:
            specs = (BlockSpec.of(pairs, reference, candidate, buckets, b, start, stop)
                     for b, (start, stop) in enumerate(spans))
            runner.run(plan, specs, len(spans), merger.add)
        else:
            direct = all(s.reads_rows_directly for s in (*candidate.streams, *reference.streams))
            if workers is None:
                workers = usable_cpus() if direct else 1
            workers = max(1, min(int(workers), len(spans)))
            # Each spec is made on the thread that runs it: slicing the index is part of the block's work.
            lazy = [functools.partial(BlockSpec.of, pairs, reference, candidate, buckets, b, start, stop)
                    for b, (start, stop) in enumerate(spans)]
            for res in run_blocks(plan, reference.streams, candidate.streams, lazy, workers):  # type: ignore[arg-type]
                merger.add(res)
        merger.check_complete()
        # Per pair, its columns (held arrays in memory, fresh reads from the file), a column per core
        # at a time; the per-row errors made of the numerators are written back to the file (in
        # memory, made in place). Pairs are independent: their own columns, their own rows of the file.
        metrics = finish_pairs([
            FinishJob(acc, functools.partial(_read_column, columns, p), lim,
                      functools.partial(columns.write, p, STD_ERROR, 0) if columns.spilled else None)
            for p, (acc, lim) in enumerate(zip(accs, limits, strict=True))], pairs, reference, candidate, buckets,
            usable_cpus())
    except BaseException:
        columns.close()
        raise
    nf_c, nf_r = merger.nf_c, merger.nf_r
    keys = [(acc.cand_seg, acc.ref_seg) for acc in accs]
    return StreamResult(
        metrics,
        {int(s): (int(nf_c[s]), merger.first_c.get(int(s))) for s in range(kc) if nf_c[s]},
        {int(s): (int(nf_r[s]), merger.first_r.get(int(s))) for s in range(kr) if nf_r[s]},
        merger.bytes_read,
        columns.mapping(keys, STD_ERROR),
        row_cosines=columns.mapping(keys, COSINE),
        row_norm_ratios=columns.mapping(keys, NORM_RATIO),
        limits={(acc.cand_seg, acc.ref_seg): lim for acc, lim in zip(accs, limits, strict=True)},
        buckets=buckets,
        profiles=[profile_of(r, merger.profile_sums[q], merger.profile_den[q], buckets) for q, r in enumerate(profiles)],
    )

