"""The alignment's n-gram vote counting, compiled by numba (see :mod:`tracediff.compare.align`, which
imports this module only for large alignments: importing it imports numba).

:func:`batch_votes` gives the same hypotheses as :func:`tracediff.compare.align._votes_together`'s numpy
path (integers only: the same numbers, not merely close ones). The numpy path looks each window's
hash up by two binary searches over the reference table, then repeats, gathers and sorts every vote
of the batch to count them; here the lookup walks the sorted hashes and the table together (each
search starts where the previous one ended and gallops), and each candidate sequence's votes are
counted in a small hash map of its own, in cache: no temporary of the batch's size beyond two.
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
    the earlier first vote (as :func:`tracediff.compare.align._ranked_votes` ranks)."""
    if votes[s] != votes[b]:
        return votes[s] > votes[b]
    if abs(delta[s]) != abs(delta[b]):
        return abs(delta[s]) < abs(delta[b])
    if owner[s] != owner[b]:
        return owner[s] < owner[b]
    return first[s] < first[b]


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
    lo = np.empty(m, dtype=np.int64)
    count = np.empty(m, dtype=np.int64)
    # A window found once (nearly all): its reference n-gram's group and start, read here in table
    # order (the table is walked forwards) and written at the window, whose arrays are the batch's
    # size: no read of the table out of order.
    own = np.empty(m, dtype=np.int64)
    at = np.empty(m, dtype=np.int64)
    a = 0
    for k in range(m):
        w = order[k]
        q = h[w]
        a = _bound(ref_h, q, a, False)
        c = _bound(ref_h, q, a, True) - a
        lo[w] = a
        count[w] = c
        if c == 1:
            own[w] = ref_owner[a]
            at[w] = ref_start[a]
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
            size = 16
            while size < 2 * total:
                size *= 2
            mask = size - 1
            used = np.zeros(size, dtype=np.bool_)
            owner = np.empty(size, dtype=np.int64)
            delta = np.empty(size, dtype=np.int64)
            votes = np.zeros(size, dtype=np.int64)
            first = np.empty(size, dtype=np.int64)
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
                    s = ((o * 1_000_003) ^ (d * 0x9E3779B1)) & mask
                    while used[s] and (owner[s] != o or delta[s] != d):
                        s = (s + 1) & mask
                    if not used[s]:
                        used[s] = True
                        owner[s], delta[s], first[s] = o, d, seen
                    votes[s] += 1
                    seen += 1
            for t in range(top):
                best = -1
                for s in range(size):
                    if used[s] and (best < 0 or _better(votes, delta, owner, first, s, best)):
                        best = s
                if best < 0:
                    break
                out_owner[g, t], out_delta[g, t], out_votes[g, t] = owner[best], delta[best], votes[best]
                used[best] = False
                out_n[g] = t + 1
        w = e

