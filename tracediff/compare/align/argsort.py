"""A stable argsort of large integer keys by sorting values, not indices.

numpy's argsort of 8 M 64-bit keys takes ~1.9 s here, its sort of the same values ~0.3 s. Each key's
index is packed into the low bits of a 64-bit word under the key's order-preserving top bits, the
words are sorted, and the indices read back out: equal keys come out in index order (a stable
sort) for free. Where the key has more bits than the word has room for, only its top bits are
packed; keys that differ only below them (random collisions of the top bits: a handful among
millions of hashes) are put in order afterwards, run by run. The result is ``np.argsort(key,
kind="stable")``, exactly.
"""

from __future__ import annotations

import bisect

import numpy as np

#: Keys from which the packed sort is used (below it numpy's argsort costs little).
PACKED_MIN = 1 << 15
_BISECT_RUNS = 256  # steps down of the key from which runs are found from an array of every key's top bits
_PIECE = 1 << 16  # indices packed at a time (a small temporary, not an [n] int64 range)


def stable_argsort_with_keys(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.argsort(key, kind="stable")`` and ``key`` in that order. Integer keys of
    :data:`PACKED_MIN` or more by the packed sort; others by numpy's (unstable, vectorised) argsort,
    then only the runs of equal keys put back in index order."""
    n = key.size
    if n < 2 or bool((key[1:] >= key[:-1]).all()):
        return np.arange(n), key
    if key.dtype.kind in "iu" and key.dtype.itemsize <= 8 and n >= PACKED_MIN:
        return _packed(key)
    order = np.argsort(key)
    ordered = key[order]
    _ties_in_index_order(order, ordered)
    return order, ordered


def _unsigned(key: np.ndarray) -> np.ndarray:
    """``key`` mapped to uint64 preserving its order (a new array, or ``key`` itself viewed)."""
    if key.dtype.kind == "u":
        return key.astype(np.uint64, copy=False)
    wide = key if key.dtype.itemsize == 8 else key.astype(np.int64)
    return wide.view(np.uint64) ^ np.uint64(1 << 63)  # (the sign bit flipped: order kept)


def _packed(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = key.size
    room = max(1, (n - 1).bit_length())  # low bits for the index
    u = _unsigned(key)
    low = u.min()
    bits = int(u.max() - low).bit_length()  # the keys' span, from the smallest
    drop = max(0, bits - (64 - room))  # the key's low bits that do not fit beside the index
    if u is key:  # (uint64 keys: the caller's array, left as it is)
        packed = u - low
    else:  # a mapped copy of our own
        packed = u
        packed -= low
    del u
    if drop:
        packed >>= np.uint64(drop)
    packed <<= np.uint64(room)
    piece = np.arange(min(n, _PIECE), dtype=np.uint64)
    for a in range(0, n, _PIECE):
        b = min(n, a + _PIECE)
        packed[a:b] |= piece[: b - a]
        piece += np.uint64(_PIECE)
    packed.sort()
    packed &= np.uint64((1 << room) - 1)
    order = packed.view(np.int64)
    ordered = key[order]
    if drop and not bool((ordered[1:] >= ordered[:-1]).all()):
        _runs_in_key_order(order, ordered, int(low), drop)
    return order, ordered


def _runs_in_key_order(order: np.ndarray, ordered: np.ndarray, low: int, drop: int) -> None:
    """Keys equal in their packed top bits came out in index order whatever their low bits: each
    such run holding a step down of the key is sorted by (key, index), in place. Runs are found by
    bisection (no array of every key's top bits: at 8 M keys that would be 64 MiB at the
    alignment's peak); there are a handful among millions of hashes."""
    signed = ordered.dtype.kind == "i"

    def top(x: np.integer) -> int:
        return (int(x) + (1 << 63 if signed else 0) - low) >> drop

    down = np.flatnonzero(ordered[1:] < ordered[:-1])
    if down.size > _BISECT_RUNS:  # keys clustered under a wide span: every key's top bits, then
        tops = _unsigned(ordered) - np.uint64(low)
        tops >>= np.uint64(drop)
        bad = np.unique(tops[down])
        lo, hi = np.searchsorted(tops, bad, side="left"), np.searchsorted(tops, bad, side="right")
        del tops
    else:
        lo_, hi_ = [], []
        for i in down.tolist():
            if hi_ and i < hi_[-1]:
                continue  # (in the run just found)
            v = top(ordered[i])
            lo_.append(bisect.bisect_left(ordered, v, hi=i, key=top))
            hi_.append(bisect.bisect_right(ordered, v, lo=i, key=top))
        lo, hi = np.array(lo_), np.array(hi_)
    inside = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)])
    run = np.repeat(np.arange(lo.size), hi - lo)
    fix = np.lexsort((order[inside], ordered[inside], run))
    order[inside] = order[inside][fix]
    ordered[inside] = ordered[inside][fix]


def _ties_in_index_order(order: np.ndarray, ordered: np.ndarray) -> None:
    """Within each run of equal keys ``ordered`` (``key[order]``), put ``order`` in index order."""
    tied = ordered[1:] == ordered[:-1]
    if tied.any():  # (tied keys are equal: ``ordered`` stays key[order] as they are put back)
        inside = np.flatnonzero(np.r_[tied, False] | np.r_[False, tied])
        run = np.cumsum(np.r_[True, ~tied])[inside]
        order[inside] = order[inside][np.lexsort((order[inside], run))]
