"""The streaming pass over aligned rows, and the findings drawn from the plan and its numbers.

Memory: one block of rows per side (about ``block_bytes``), a small cache of reference chunks, and
per-row float32 arrays the size of the row index. Throughput is bound by reading and decoding the
chunks; the per-block kernels are torch reductions over views of one buffer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tracediff.align import RowIndex, RowPairs
from tracediff.results import RowRef, SegmentMetrics
from tracediff.segments import to_float32
from tracediff.store import VALUE_DTYPES

Progress = Callable[[int], None]


class _ChunkReader:
    """Gathers arbitrary rows of a RowIndex through a small LRU cache of decoded chunks."""

    def __init__(self, index: RowIndex, max_chunks: int = 64) -> None:
        self.index = index
        self.cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.max_chunks = max_chunks
        self.bytes_read = 0

    def _chunk(self, stream: int, chunk: int) -> np.ndarray:
        key = (stream, chunk)
        data = self.cache.get(key)
        if data is not None:
            self.cache.move_to_end(key)
            return data
        data = self.index.streams[stream].read_chunk(chunk)
        self.bytes_read += data.nbytes
        self.cache[key] = data
        if len(self.cache) > self.max_chunks:
            self.cache.popitem(last=False)
        return data

    def gather(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Raw values of RowIndex entries ``rows`` into ``out[:len(rows)]``."""
        stream = self.index.stream[rows]
        within = self.index.row[rows]
        n = rows.size
        for s in np.unique(stream):
            sel = np.flatnonzero(stream == s)
            cr = self.index.streams[int(s)].chunk_rows
            chunks = within[sel] // cr
            for c in np.unique(chunks):
                part = sel[chunks == c]
                data = self._chunk(int(s), int(c))
                out[part] = data[within[part] - c * cr]
        return out[:n]


@dataclass
class _Accumulator:
    cand_seg: int
    ref_seg: int
    cos: np.ndarray
    ratio: np.ndarray
    rel_diff: np.ndarray
    max_abs: np.ndarray
    sq_err: float = 0.0
    sq_ref: float = 0.0
    nonfinite_c: int = 0
    nonfinite_r: int = 0


@dataclass
class StreamResult:
    metrics: list[SegmentMetrics]
    nonfinite_candidate: dict[int, tuple[int, int | None]]  # segment -> (rows, first pair index)
    nonfinite_reference: dict[int, tuple[int, int | None]]
    bytes_read: int


def stream_metrics(
    pairs: RowPairs,
    reference: RowIndex,
    candidate: RowIndex,
    matches: list[tuple[int, int]],
    segment_size: int,
    *,
    block_bytes: int = 16 << 20,
    progress: Progress | None = None,
) -> StreamResult:
    """One pass over every aligned row pair: per matched segment pair, every metric of the report."""
    n = len(pairs)
    size = segment_size
    wc = candidate.streams[0].width
    wr = reference.streams[0].width
    kc, kr = wc // size, wr // size
    cdt, rdt = candidate.streams[0].dtype, reference.streams[0].dtype
    block = max(64, min(8192, block_bytes // max(1, (wc + wr) * 4)))
    cand_buf = np.empty((block, wc), dtype=VALUE_DTYPES[cdt])
    ref_buf = np.empty((block, wr), dtype=VALUE_DTYPES[rdt])
    cand_reader = _ChunkReader(candidate, max_chunks=8)
    ref_reader = _ChunkReader(reference, max_chunks=64)
    accs = [
        _Accumulator(i, j, *(np.full(n, np.nan, dtype=np.float32) for _ in range(4)))
        for i, j in matches
    ]
    nf_c = np.zeros(kc, dtype=np.int64)
    nf_r = np.zeros(kr, dtype=np.int64)
    first_c: dict[int, int] = {}
    first_r: dict[int, int] = {}
    for start in range(0, n, block):
        stop = min(n, start + block)
        c = to_float32(cand_reader.gather(pairs.candidate[start:stop], cand_buf), cdt).reshape(stop - start, kc, size)
        r = to_float32(ref_reader.gather(pairs.reference[start:stop], ref_buf), rdt).reshape(stop - start, kr, size)
        fin_c = torch.isfinite(c).all(dim=2)  # [b, kc]
        fin_r = torch.isfinite(r).all(dim=2)
        bad_c = (~fin_c).sum(dim=0).numpy()
        bad_r = (~fin_r).sum(dim=0).numpy()
        nf_c += bad_c
        nf_r += bad_r
        for seg in np.flatnonzero(bad_c):
            first_c.setdefault(int(seg), start + int(torch.nonzero(~fin_c[:, seg])[0, 0]))
        for seg in np.flatnonzero(bad_r):
            first_r.setdefault(int(seg), start + int(torch.nonzero(~fin_r[:, seg])[0, 0]))
        for acc in accs:
            a = c[:, acc.cand_seg]
            b = r[:, acc.ref_seg]
            ok = fin_c[:, acc.cand_seg] & fin_r[:, acc.ref_seg]
            acc.nonfinite_c += int((~fin_c[:, acc.cand_seg]).sum())
            acc.nonfinite_r += int((~fin_r[:, acc.ref_seg]).sum())
            a = torch.where(ok[:, None], a, 0.0)
            b = torch.where(ok[:, None], b, 0.0)
            na = (a * a).sum(dim=1)
            nb = (b * b).sum(dim=1)
            d = a - b
            sq = (d * d).sum(dim=1)
            max_abs = d.abs().amax(dim=1)
            # 1 - cos as half the squared distance of the unit vectors: exact near cos = 1 in fp32.
            ua = a / na.sqrt().clamp_min(1e-30)[:, None]
            ub = b / nb.sqrt().clamp_min(1e-30)[:, None]
            one_minus_cos = 0.5 * ((ua - ub) ** 2).sum(dim=1)
            cos = (1.0 - one_minus_cos).numpy()
            ratio = (na.sqrt() / nb.sqrt().clamp_min(1e-30)).numpy()
            rel = (sq / (na + nb).clamp_min(1e-30)).numpy()
            okn = ok.numpy()
            sl = slice(start, stop)
            acc.cos[sl] = np.where(okn, cos, np.nan)
            acc.ratio[sl] = np.where(okn, ratio, np.nan)
            acc.rel_diff[sl] = np.where(okn, rel, np.nan)
            acc.max_abs[sl] = np.where(okn, max_abs.numpy(), np.nan)
            acc.sq_err += float(sq[ok].double().sum())
            acc.sq_ref += float(nb[ok].double().sum())
        if progress is not None:
            progress(stop - start)
    metrics = [_finish(acc, pairs, reference, candidate) for acc in accs]
    return StreamResult(
        metrics,
        {int(s): (int(nf_c[s]), first_c.get(int(s))) for s in range(kc) if nf_c[s]},
        {int(s): (int(nf_r[s]), first_r.get(int(s))) for s in range(kr) if nf_r[s]},
        cand_reader.bytes_read + ref_reader.bytes_read,
    )


def row_ref(index: RowIndex, i: int) -> RowRef:
    return RowRef(seq=index.group_keys[int(index.group[i])], position=int(index.position[i]),
                  token_id=int(index.token_id[i]))


def _quantile(values: np.ndarray, q: float) -> float:
    finite = values[np.isfinite(values)]
    return float(np.quantile(finite, q)) if finite.size else float("nan")


def _finish(acc: _Accumulator, pairs: RowPairs, reference: RowIndex, candidate: RowIndex) -> SegmentMetrics:
    cos = acc.cos
    finite = np.isfinite(cos)
    rows = int(finite.sum())
    worst_rows = []
    if rows:
        order = np.argsort(np.where(finite, cos, np.inf))[: min(5, rows)]
        for k in order:
            worst_rows.append(
                {
                    "cosine": float(cos[k]),
                    "norm_ratio": float(acc.ratio[k]),
                    "candidate": row_ref(candidate, pairs.candidate[k]).__dict__,
                    "reference": row_ref(reference, pairs.reference[k]).__dict__,
                }
            )
    max_abs_row = None
    max_abs = float("nan")
    if np.isfinite(acc.max_abs).any():
        k = int(np.nanargmax(acc.max_abs))
        max_abs = float(acc.max_abs[k])
        max_abs_row = row_ref(candidate, pairs.candidate[k])
    # Cosine by (reference) position, in at most 64 buckets.
    positions = reference.position[pairs.reference]
    by_pos: list[list[float]] = []
    if rows:
        top = int(positions[finite].max()) + 1
        nb = min(64, top)
        edges = np.linspace(0, top, nb + 1)
        idx = np.clip(np.searchsorted(edges, positions[finite], side="right") - 1, 0, nb - 1)
        sums = np.bincount(idx, weights=cos[finite], minlength=nb)
        counts = np.bincount(idx, minlength=nb)
        by_pos = [[float(edges[b]), float(sums[b] / counts[b]), int(counts[b])] for b in range(nb) if counts[b]]
    ratios = acc.ratio[np.isfinite(acc.ratio) & (acc.ratio > 0)]
    hist = {"edges": [], "counts": []}
    if ratios.size:
        logr = np.log2(ratios)
        lo, hi = float(logr.min()), float(logr.max())
        if hi - lo < 1e-3:
            lo, hi = lo - 0.05, hi + 0.05
        counts_h, edges_h = np.histogram(logr, bins=40, range=(lo, hi))
        hist = {"edges": [float(e) for e in edges_h], "counts": [float(c) for c in counts_h]}
    return SegmentMetrics(
        candidate=acc.cand_seg,
        reference=acc.ref_seg,
        rows=rows,
        cos_mean=float(np.nanmean(cos)) if rows else float("nan"),
        cos_p1=_quantile(cos, 0.01),
        cos_min=float(np.nanmin(cos)) if rows else float("nan"),
        norm_ratio_mean=float(np.nanmean(acc.ratio)) if rows else float("nan"),
        norm_ratio_p1=_quantile(acc.ratio, 0.01),
        norm_ratio_p50=_quantile(acc.ratio, 0.5),
        norm_ratio_p99=_quantile(acc.ratio, 0.99),
        rel_l2=math.sqrt(acc.sq_err / acc.sq_ref) if acc.sq_ref > 0 else float("nan"),
        rel_diff_mean=float(np.nanmean(acc.rel_diff)) if rows else float("nan"),
        rel_diff_max=float(np.nanmax(acc.rel_diff)) if rows else float("nan"),
        max_abs_diff=max_abs,
        max_abs_diff_row=max_abs_row,
        nonfinite_candidate=acc.nonfinite_c,
        nonfinite_reference=acc.nonfinite_r,
        worst_rows=worst_rows,
        cos_by_position=by_pos,
        norm_ratio_hist=hist,
    )
