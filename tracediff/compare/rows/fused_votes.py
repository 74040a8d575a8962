"""The alignment's n-gram vote counting, compiled by numba (see :mod:`tracediff.compare.align.sequences`, which
imports this module only for large alignments: importing it imports numba).

:func:`batch_votes` gives the same hypotheses as :func:`tracediff.compare.align.sequences._votes_together`'s numpy
path (integers only: the same numbers, not merely close ones). The numpy path looks each window's
hash up by two binary searches over the reference table, then repeats, gathers and sorts every vote
of the batch to count them; here the lookup walks the sorted hashes and the table together (each
search starts where the previous one ended and gallops; a window found once has its reference group
and start read then), and each candidate sequence's distinct votes are counted in small arrays of
its own, grown as needed: nine temporaries of the batch's size (the hashes in order, each window's
lookup in that order and at its window), no more (~10 MB a batch of 131,072 windows).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _bound(a: Any, q: Any, p: int, upper: bool) -> int:
    """The first index i >= p with a[i] > q (``upper``) or a[i] >= q, for a sorted ``a`` whose entries
    before p are all below that bound: a gallop from p, then a binary search."""
    n = a.shape[0]
    if p >= n or (a[p] > q if upper else a[p] >= q):
        return p
    lo, step, hi = p, 1, p + 1  # a[lo] is below the bound
    while hi < n and (a[hi] <= q if upper else a[hi] < q):
        lo = hi
        step *= 2
        hi = lo + step
    hi = min(hi, n)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[mid] <= q if upper else a[mid] < q:
            lo = mid
        else:
            hi = mid
    return hi


@numba.njit(nogil=True, cache=True)
def _better(votes: Any, delta: Any, owner: Any, first: Any, s: int, b: int) -> bool:
    """Whether vote s ranks before vote b: more votes, then smaller |delta|, then lower group, then
    the earlier first vote (as :func:`tracediff.compare.align.sequences._ranked_votes` ranks)."""
    if votes[s] != votes[b]:
        return votes[s] > votes[b]
    if abs(delta[s]) != abs(delta[b]):
        return abs(delta[s]) < abs(delta[b])
    if owner[s] != owner[b]:
        return owner[s] < owner[b]
    return first[s] < first[b]


@numba.njit(nogil=True, cache=True)
def _slot(o: int, d: int, size: int) -> int:
    """Where a (group, delta) vote starts its probe in an index of ``size`` (a power of two) slots."""
    return ((o * 1_000_003) ^ (d * 0x9E3779B1)) & (size - 1)


@numba.njit(nogil=True, cache=True)
def _grown(a: Any, size: int) -> Any:
    """``a``'s values in a new array of ``size`` entries."""
    out = np.empty(size, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


@numba.njit(nogil=True, cache=True)
def batch_votes(h: Any, order: Any, starts: Any, window_group: Any, ref_h: Any, ref_owner: Any, ref_start: Any,
                max_repeat: int, out_owner: Any, out_delta: Any, out_votes: Any, out_n: Any) -> None:
    """Window w (hash ``h[w]``, start position ``starts[w]``, of candidate sequence ``window_group[w]``,
    nondecreasing) votes for every (reference group, delta = start - reference start) of the
    reference n-grams with its hash (``ref_h`` sorted, with their ``ref_owner`` and ``ref_start``),
    unless more than ``max_repeat`` share it. ``order``: ``h``'s ascending order. Per candidate
    sequence g: its ``out_n[g]`` best (at most ``out_owner.shape[1]``) into ``out_owner[g]``,
    ``out_delta[g]``, ``out_votes[g]``, best first."""
    m = h.shape[0]
    # The walk reads the hashes in ascending order and writes what it finds in that order (a window
    # found once, nearly all: its reference n-gram's group and start, read here in table order, the
    # table walked forwards); then each find is put at its window. Gathered before and scattered
    # after, not inside the walk: its loop waits only on the table's cache misses (-35% of its time
    # at 8 M rows), not also on the batch's arrays read and written out of order.
    queries = np.empty(m, dtype=h.dtype)
    for k in range(m):
        queries[k] = h[order[k]]
    found = np.empty((4, m), dtype=np.int64)  # lo, count, group, start: in the queries' order
    a = 0
    for k in range(m):
        q = queries[k]
        a = _bound(ref_h, q, a, False)
        c = _bound(ref_h, q, a, True) - a
        found[0, k] = a
        found[1, k] = c
        if c == 1:
            found[2, k] = ref_owner[a]
            found[3, k] = ref_start[a]
    lo = np.empty(m, dtype=np.int64)
    count = np.empty(m, dtype=np.int64)
    own = np.empty(m, dtype=np.int64)
    at = np.empty(m, dtype=np.int64)
    for k in range(m):
        w = order[k]
        lo[w] = found[0, k]
        count[w] = found[1, k]
        own[w] = found[2, k]
        at[w] = found[3, k]
    out_n[:] = 0
    top = out_owner.shape[1]
    w = 0
    while w < m:
        g = window_group[w]
        e = w
        total = 0
        while e < m and window_group[e] == g:
            if 0 < count[e] <= max_repeat:
                total += count[e]
            e += 1
        if total:
            # The sequence's distinct (group, delta) votes, in the order first seen, and an
            # open-addressing index over them (entry + 1, 0 empty), both grown by doubling: memory
            # follows the distinct votes (a few, nearly always), not the votes.
            cap, isize, n_e = 16, 32, 0
            owner = np.empty(cap, dtype=np.int64)
            delta = np.empty(cap, dtype=np.int64)
            votes = np.empty(cap, dtype=np.int64)
            first = np.empty(cap, dtype=np.int64)
            index = np.zeros(isize, dtype=np.int64)
            seen = 0
            for x in range(w, e):
                if count[x] <= 0 or count[x] > max_repeat:
                    continue
                for j in range(lo[x], lo[x] + count[x]):
                    if count[x] == 1:
                        o = own[x]
                        d = np.int64(starts[x]) - at[x]
                    else:
                        o = np.int64(ref_owner[j])
                        d = np.int64(starts[x]) - np.int64(ref_start[j])
                    s = _slot(o, d, isize)
                    while index[s] != 0 and (owner[index[s] - 1] != o or delta[index[s] - 1] != d):
                        s = (s + 1) & (isize - 1)
                    if index[s] != 0:
                        votes[index[s] - 1] += 1
                    else:
                        if n_e == cap:
                            cap *= 2
                            owner, delta = _grown(owner, cap), _grown(delta, cap)
                            votes, first = _grown(votes, cap), _grown(first, cap)
                        owner[n_e], delta[n_e], votes[n_e], first[n_e] = o, d, 1, seen
                        index[s] = n_e + 1
                        n_e += 1
                        if 2 * n_e > isize:
                            isize *= 2
                            index = np.zeros(isize, dtype=np.int64)
                            for k in range(n_e):
                                s = _slot(owner[k], delta[k], isize)
                                while index[s] != 0:
                                    s = (s + 1) & (isize - 1)
                                index[s] = k + 1
                    seen += 1
            taken = np.zeros(n_e, dtype=np.bool_)
            for t in range(top):
                best = -1
                for k in range(n_e):
                    if not taken[k] and (best < 0 or _better(votes, delta, owner, first, k, best)):
                        best = k
                if best < 0:
                    break
                out_owner[g, t], out_delta[g, t], out_votes[g, t] = owner[best], delta[best], votes[best]
                taken[best] = True
                out_n[g] = t + 1
        w = e


#: The compiled function an alignment calls (kernels.py asks numba's cache whether it is there).
ENTRY_POINTS = (batch_votes,)


def warm() -> None:
    """Compile (or load from numba's cache) :func:`batch_votes` for the types an alignment calls it
    with (int32 positions and reference groups: the row index's compact columns), on one window: run
    in a child process on a cold cache (see :func:`tracediff.compare.rows.fused.warm`). Positions beyond
    the compact range (int64) compile in the compare's own process, as before."""
    one = np.zeros(1, dtype=np.int64)
    outs = [np.zeros((1, 4), dtype=np.int64) for _ in range(3)]
    batch_votes(np.zeros(1, dtype=np.uint64), one, np.zeros(1, dtype=np.int32), one.copy(), np.zeros(1, dtype=np.uint64),
                np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32), 64, *outs, np.zeros(1, dtype=np.int64))
