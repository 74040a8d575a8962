"""Row alignment: which candidate row holds the same token of the same sequence as which reference row.

Works on labels only (the row index), never on values; the rows paired under an alignment (and the
label offset that the value-based offset search chose) are :mod:`tracediff.compare.align.rowpairs`'s.
Sequences are matched by their token content (n-gram votes), never by request ids: an engine's
request ids have nothing to do with a trainer's sample ids, a chat template can prepend tokens, a
server can truncate, rows arrive in engine order, and some rows (rejected drafts, generated tokens,
DRAFT_EXTEND padding) have no counterpart at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.argsort import stable_argsort_with_keys
from tracediff.compare.rows.gather import in_parallel
from tracediff.compare.rows.index import RowIndex, index_dtype
from tracediff.compare.rows.kernels import use_vote_kernel, vote_kernels
from tracediff.errors import CompareError

NGRAM = 4
_MAX_HASH_REPEAT = 64  # an n-gram seen more often than this in the reference (padding...) casts no vote
_VOTE_BATCH_ROWS = 1 << 17  # candidate rows whose n-grams are looked up together (a batch per core: their
# temporaries, ~60 bytes a row, on top of the reference table: 8 M narrow rows, the votes peak at 518 MiB
# with 128 k, 537 with 256 k, 573-600 with 512 k, the table itself at 523)
_HASH_PIECE = 1 << 16  # n-gram windows hashed (or values moved in place) at a time: temporaries stay small
_MAX_ALIGNMENTS = 4  # alternative (reference sequence, delta) hypotheses kept per candidate sequence


@dataclass
class SequenceRows:
    """One sequence: its rows ordered by position, one row per position (the first valid one)."""

    key: int
    positions: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray  # index into the RowIndex (int32 below 2**31 rows)
    duplicates: int

    @property
    def size(self) -> int:
        """Its rows (one per position)."""
        return int(self.rows.size)

    def held(self) -> SequenceRows:
        """This sequence with its positions, tokens and rows at hand (itself, here)."""
        return self


class _IndexGroup(SequenceRows):
    """A :class:`SequenceRows` that holds only its rows (or, for index entries ``start..stop`` in order, a
    trainer's sequence, not even those): its positions, tokens and rows are read from the index when
    asked (views for a span, gathers for rows: a caller that reads them often holds them)."""

    def __init__(self, key: int, duplicates: int, index: RowIndex, rows: np.ndarray | None = None,
                 span: tuple[int, int] = (0, 0)) -> None:
        self.key, self.duplicates, self._index, self._rows, self._span = key, duplicates, index, rows, span

    @property
    def rows(self) -> np.ndarray:  # type: ignore[override]
        if self._rows is not None:
            return self._rows
        return np.arange(*self._span, dtype=index_dtype(len(self._index)))

    @property
    def positions(self) -> np.ndarray:  # type: ignore[override]
        if self._rows is not None:
            return self._index.position[self._rows]
        return self._index.position[self._span[0] : self._span[1]]

    @property
    def tokens(self) -> np.ndarray:  # type: ignore[override]
        if self._rows is not None:
            return self._index.token_id[self._rows]
        return self._index.token_id[self._span[0] : self._span[1]]

    @property
    def size(self) -> int:
        return self._span[1] - self._span[0] if self._rows is None else int(self._rows.size)

    def held(self) -> SequenceRows:
        """A :class:`SequenceRows` holding this sequence's positions, tokens and rows (read once: for a
        caller that uses them repeatedly)."""
        return SequenceRows(self.key, self.positions, self.tokens, self.rows, self.duplicates)

    def __repr__(self) -> str:
        return f"_IndexGroup(key={self.key}, rows={self._span if self._rows is None else self._rows.size})"


def end_positions(g: SequenceRows, index: RowIndex) -> tuple[int, int] | None:
    """The first and last position of sequence ``g`` when it is one of ``index``'s own groups (its
    positions, tokens and rows are those of ``index``'s entries ``g.rows``), read without gathering
    the others; None for any other sequence (or an empty one)."""
    if not isinstance(g, _IndexGroup) or g._index is not index or g.size == 0:
        return None
    if g._rows is None:
        return int(index.position[g._span[0]]), int(index.position[g._span[1] - 1])
    return int(index.position[g._rows[0]]), int(index.position[g._rows[-1]])


class _LetGo(SequenceRows):
    """What is kept of a candidate sequence once the pairs are made (:meth:`Alignment.let_go_of_rows`):
    its key, size, duplicates and first position; its rows, positions and tokens are let go."""

    def __init__(self, g: SequenceRows) -> None:
        self.key, self.duplicates, self._size = g.key, g.duplicates, g.size
        self.first_position = int(g.positions[0]) if g.size else 0  # (positions ascend)

    @property
    def size(self) -> int:
        return self._size

    def _gone(self) -> np.ndarray:
        raise RuntimeError(f"candidate sequence {self.key}: its rows were let go once the pairs were made")

    rows = property(_gone)  # type: ignore[assignment]
    positions = property(_gone)  # type: ignore[assignment]
    tokens = property(_gone)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"_LetGo(key={self.key}, size={self._size}, first_position={self.first_position})"


def _groups(index: RowIndex) -> list[SequenceRows]:
    n = len(index)
    every = n > 0 and bool(index.valid.all())  # every row valid (the common case): no row to skip
    valid = None if every else np.flatnonzero(index.valid)
    if n == 0 or (valid is not None and valid.size == 0):
        return []
    group = index.group if valid is None else index.group[valid]
    position = index.position if valid is None else index.position[valid]
    # Rows by (sequence, position, row): one integer key when it fits (Python ints: no wrap-around):
    # int32 (half the sort's memory) when it and every partial sum do (compact positions lie within
    # +-2**28), else int64.
    # ``within``: the order of the valid rows; None when they are in it already (a trainer's rows).
    p_lo = int(position.min())
    span = int(position.max()) - p_lo + 1
    top = (int(group.max()) + 1) * span
    if top < (1 << 62):
        narrow = top < (1 << 30) and position.dtype == np.int32
        key = np.multiply(group, span, dtype=np.int32 if narrow else np.int64)  # the key widens
        key += position
        key -= p_lo
        within = None if bool((key[1:] >= key[:-1]).all()) else stable_argsort(key)
        del key
    else:
        within = np.lexsort((np.arange(group.size), position, group))
    del group, position
    order = valid if within is None else (within if valid is None else valid[within])  # None: every row
    g = index.group if order is None else index.group[order]
    pos = index.position if order is None else index.position[order]
    # The first row of each (sequence, position); the rest are duplicates.
    new_group = np.r_[True, g[1:] != g[:-1]]
    keep = new_group | np.r_[True, pos[1:] != pos[:-1]]
    every_kept = bool(keep.all())
    rows_dtype = index_dtype(n)  # what pairs hold: compact
    kept_group = g if every_kept else g[keep]
    starts = np.flatnonzero(np.r_[True, kept_group[1:] != kept_group[:-1]])
    ends = np.r_[starts[1:], kept_group.size]
    # Duplicates per group: its valid rows minus the ones kept.
    all_starts = np.flatnonzero(new_group)
    dups = np.diff(np.r_[all_starts, g.size]) - (ends - starts)
    bounds = zip(kept_group[starts].tolist(), starts.tolist(), ends.tolist(), dups.tolist(), strict=True)
    if order is None and every_kept:  # every entry, in index order: the index holds it all
        return [_IndexGroup(k, d, index, span=(a, b)) for k, a, b, d in bounds]
    del g, pos, new_group
    if order is None:
        rows = np.flatnonzero(keep).astype(rows_dtype)
    else:
        rows = (order if every_kept else order[keep]).astype(rows_dtype, copy=False)
    # Only the rows are held: positions and tokens are read from the index when asked (8 bytes a
    # row less through the alignment, for a gather per sequence where they are used).
    return [_IndexGroup(k, d, index, rows=rows[a:b]) for k, a, b, d in bounds]


def stable_argsort(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")``, faster for the index's large keys: nothing to sort for keys
    already in order (a trainer's rows), else a sort of the keys with their indices packed beside
    them (:mod:`tracediff.compare.align.argsort`)."""
    return _stable_argsort(key)[0]


def _stable_argsort(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`stable_argsort`, and ``key`` in that order (made on the way: no second gather)."""
    return stable_argsort_with_keys(key)


def _unique_first_counts(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(key, return_index=True, return_counts=True)`` through :func:`stable_argsort`."""
    order, ordered = _stable_argsort(key)
    new = np.r_[True, ordered[1:] != ordered[:-1]] if key.size else np.zeros(0, dtype=bool)
    at = np.flatnonzero(new)
    return ordered[at], order[at], np.diff(np.r_[at, key.size])


def _ngram_ok(tokens: np.ndarray, positions: np.ndarray, n: int, member: np.ndarray | None = None) -> np.ndarray:
    """Which windows of n consecutive rows hold n consecutive positions with known tokens (and, with
    ``member``, the sequence of each row, lie inside one sequence)."""
    count = tokens.size - n + 1
    if count <= 0:
        return np.zeros(0, dtype=bool)
    ok = (positions[n - 1 :] - positions[:count]) == n - 1
    known = tokens >= 0
    for k in range(n):
        ok &= known[k : k + count]
    if member is not None:
        ok &= member[:count] == member[n - 1 :]
    return ok


def _ngram_hashes(
    tokens: np.ndarray, positions: np.ndarray, n: int, member: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Hashes of every window of n consecutive positions with known tokens; and each window's start
    (and, given ``member`` (see :func:`_ngram_ok`), each window's sequence: written over the front of
    ``member``, the caller's scratch)."""
    if tokens.size < n:
        empty = (np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64))
        return (*empty, np.empty(0, dtype=np.int64)) if member is not None else empty
    count = tokens.size - n + 1
    # h = h * mult + (token + 1), wrapping in uint64, window by window: in place, a piece of windows
    # at a time through one small term buffer.
    h = np.zeros(count, dtype=np.uint64)
    term = np.empty(min(count, _HASH_PIECE), dtype=np.uint64)
    mult, one = np.uint64(1_000_003), np.uint64(1)
    with np.errstate(over="ignore"):
        for a in range(0, count, _HASH_PIECE):
            b = min(count, a + _HASH_PIECE)
            part, t = h[a:b], term[: b - a]
            for k in range(n):
                part *= mult
                t[:] = tokens[a + k : b + k]  # as astype(np.uint64): negative ids wrap (their windows are dropped)
                t += one
                part += t
    del term
    ok = _ngram_ok(tokens, positions, n, member)
    if bool(ok.all()):  # every window counts (the common case): no copies
        return (h, positions[:count], member[:count]) if member is not None else (h, positions[:count])
    # The hashes (and sequences) are this function's own: the windows that count are moved to the
    # front in place; the positions are the caller's (a copy).
    if member is not None:
        return kept_in_place(h, ok), positions[:count][ok], kept_in_place(member[:count], ok)
    return kept_in_place(h, ok), positions[:count][ok]


def kept_in_place(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``values[keep]``, written over the front of ``values`` a piece at a time (each kept value
    moves only towards the front, past values already read): a view of ``values``, no whole copy."""
    at = 0
    for a in range(0, keep.size, _HASH_PIECE):
        got = values[a : a + _HASH_PIECE][keep[a : a + _HASH_PIECE]]
        values[at : at + got.size] = got
        at += got.size
    return values[:at]


@dataclass
class SequenceAlignment:
    """Candidate sequence -> ranked hypotheses (reference group, position delta, votes)."""

    candidate_group: int
    hypotheses: list[tuple[int, int, int]]  # (reference group key, delta = cand_pos - ref_pos, votes)

    @property
    def best(self) -> tuple[int, int, int] | None:
        return self.hypotheses[0] if self.hypotheses else None


@dataclass
class Alignment:
    """All sequence alignments plus what the rows looked like."""

    reference: RowIndex
    candidate: RowIndex
    sequences: list[SequenceAlignment]
    by_tokens: bool
    notes: list[str] = field(default_factory=list)
    candidate_duplicates: int = 0
    ref_groups: dict[int, SequenceRows] = field(default_factory=dict, repr=False)
    cand_groups: dict[int, SequenceRows] = field(default_factory=dict, repr=False)

    @property
    def aligned_sequences(self) -> int:
        return sum(1 for s in self.sequences if s.hypotheses)

    def let_go_of_rows(self) -> None:
        """Let go of the candidate sequences' rows (4 bytes a row) once the pairs are made: only their
        first positions are read later (:meth:`first_position`)."""
        self.cand_groups = {k: _LetGo(g) for k, g in self.cand_groups.items()}

    def first_position(self, candidate_group: int) -> int:
        """The first (lowest) position of a candidate sequence."""
        g = self.cand_groups[candidate_group]
        return g.first_position if isinstance(g, _LetGo) else int(g.positions[0])

    def delta_histogram(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.sequences:
            if s.best is not None:
                out[s.best[1]] = out.get(s.best[1], 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def align_sequences(reference: RowIndex, candidate: RowIndex, ngram: int = NGRAM) -> Alignment:
    """Match each candidate sequence to reference sequences by token n-gram votes."""
    ref_list, cand_list = in_parallel(lambda: _groups(reference), lambda: _groups(candidate))
    ref_groups = {g.key: g for g in ref_list}
    cand_groups = {g.key: g for g in cand_list}
    duplicates = sum(g.duplicates for g in cand_groups.values())
    if not ref_groups:
        raise CompareError(f"{reference.store.path}: tap {reference.tap!r} has no valid rows to compare against")
    if not cand_groups:
        raise CompareError(f"{candidate.store.path}: tap {candidate.tap!r} has no valid rows to compare")
    if not (reference.has_tokens and candidate.has_tokens):
        return _align_by_labels(reference, candidate, ref_groups, cand_groups, duplicates)

    tables: dict[int, tuple[np.ndarray, ...]] = {}

    def table(n: int) -> tuple[np.ndarray, ...]:
        if n not in tables:
            tables[n] = ngram_table(list(ref_groups.values()), n)
        return tables[n]

    # Sequences long enough for full n-grams vote together, in one lookup; shorter ones on their own.
    # In batches of about _VOTE_BATCH_ROWS rows: the lookup's temporaries stay bounded. Batches are
    # independent (each candidate sequence is in one): they run on both cores (numpy's sorts,
    # searches and gathers release the GIL), a batch per core at a time.
    whole = [g for g in cand_groups.values() if g.size >= ngram]
    batches: list[list[SequenceRows]] = [[]]
    held = 0
    for g in whole:
        if held >= _VOTE_BATCH_ROWS:
            batches.append([])
            held = 0
        batches[-1].append(g)
        held += int(g.size)
    full = table(ngram) if whole else None
    # (numba is imported once the table is made: its ~110 MiB are not added to the table's peak)
    compiled = vote_kernels() if use_vote_kernel(sum(g.size for g in whole)) else None
    kernel = compiled.batch_votes if compiled is not None else None
    found: dict[int, list[tuple[int, int, int]]] = {}
    for votes in in_parallel(*(functools.partial(_votes_together, b, full, ngram, kernel) for b in batches if b)):
        found.update(votes)
    sequences = []
    for g in cand_groups.values():
        hyps = found.get(g.key, []) if g.size >= ngram else _votes_alone(g, table, ngram)
        if hyps:
            top = hyps[0][2]
            hyps = _same_sample_first([h for h in hyps if h[2] * 10 >= top or h[2] >= 8], g, ref_groups)
        sequences.append(SequenceAlignment(g.key, hyps))
    return Alignment(reference, candidate, sequences, True, [], duplicates, ref_groups, cand_groups)


def ngram_table(groups: list[SequenceRows], n: int) -> tuple[np.ndarray, ...]:
    """The reference's n-grams sorted by hash (ties in sequence order): (hash, owner group, start
    position). A hash's n-grams are found by two sorted searches (:func:`_votes_together`)."""
    top = max((rg.key for rg in groups), default=0) + 1
    keys = np.array([rg.key for rg in groups], dtype=index_dtype(top))
    member = np.repeat(np.arange(keys.size, dtype=index_dtype(keys.size)), [rg.size for rg in groups])
    ref_h, starts, owners = _ngram_hashes(_joined([rg.tokens for rg in groups]),
                                          _joined([rg.positions for rg in groups]), n, member)
    del member
    order, ref_h = _stable_argsort(ref_h)  # (each whole temporary let go as soon as it is used: the table's peak)
    # The two gathers in table order (~0.12 s each at 8 M n-grams, cache misses) on both cores.
    owners, starts = in_parallel(lambda: keys[owners[order]], lambda: starts[order])
    return ref_h, owners, starts


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)``; without a copy when the parts are consecutive pieces of one
    array (a trainer's sequences: views of its index's columns)."""
    if parts:
        base = parts[0].base if parts[0].base is not None else parts[0]
        item = parts[0].itemsize
        if (base.ndim == 1 and base.flags.c_contiguous and all(p.base is base or p is base for p in parts)
                and all(p.ndim == 1 and p.dtype == base.dtype and p.flags.c_contiguous for p in parts)):
            start = (parts[0].__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
            at = start
            for p in parts:
                if p.size and (p.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item != at:
                    break
                at += p.size
            else:
                return base[start:at]
    return np.concatenate(parts)


def _same_sample_first(hyps: list[tuple[int, int, int]], g: SequenceRows,
                       ref_groups: dict[int, SequenceRows]) -> list[tuple[int, int, int]]:
    """Rank first, among the hypotheses with at least half the top votes, a reference sequence that
    ends within the candidate's: the candidate's own sample. Chat data holds conversations whose
    earlier turns are whole prefixes of later samples; a request of the first turn votes as much (or
    one n-gram more, when the reference dropped its last row) for the longer sample that continues
    past it, which would leave its own sample uncovered and pair the longer one's rows twice."""
    if len(hyps) < 2:
        return hyps
    top, last = hyps[0][2], int(g.positions[-1])

    def ends_within(h: tuple[int, int, int]) -> bool:
        return int(ref_groups[h[0]].positions[-1]) + h[1] <= last

    if ends_within(hyps[0]):
        return hyps
    better = [h for h in hyps if 2 * h[2] >= top and ends_within(h)]
    if not better:
        return hyps
    return [better[0]] + [h for h in hyps if h is not better[0]]


def _votes_alone(g: SequenceRows, table: Any, ngram: int) -> list[tuple[int, int, int]]:
    """The ranked hypotheses of one candidate sequence (n-grams of at most its own length)."""
    n = min(ngram, int(g.size))
    h, p = _ngram_hashes(g.tokens, g.positions, n)
    if not h.size:
        return []
    ref_h, ref_owner, ref_start = table(n)[:3]
    lo = np.searchsorted(ref_h, h, side="left")
    hi = np.searchsorted(ref_h, h, side="right")
    return _ranked_votes(lo, hi, p, ref_owner, ref_start)[:_MAX_ALIGNMENTS]


def _votes_together(
    groups: list[SequenceRows], table: tuple[np.ndarray, ...], n: int, kernel: Any = None
) -> dict[int, list[tuple[int, int, int]]]:
    """:func:`_votes_alone` of every sequence at once (each at least n tokens long): one sorted
    lookup of all their n-grams instead of one per sequence, the same hypotheses in the same order.
    Candidate group -> its top hypotheses (sequences with none are left out). ``kernel``: the compiled
    vote counter (:func:`tracediff.compare.rows.fused_votes.batch_votes`: the same hypotheses), or None for
    numpy's searches and sorts."""
    ref_h, ref_owner, ref_start = table[:3]
    lengths = np.array([g.size for g in groups], dtype=np.int64)
    tokens = np.concatenate([g.tokens for g in groups])
    positions = np.concatenate([g.positions for g in groups])
    member = np.repeat(np.arange(len(groups), dtype=np.int64), lengths)
    h, starts, window_group = _ngram_hashes(tokens, positions, n, member)
    if h.size == 0:
        return {}
    if ref_h.size == 0:
        return {}
    # A hash's reference n-grams are lo .. hi - 1: two searches with sorted queries (each binary
    # search starts where the previous one ended). (The packed sort: 2.4-2.9 ms a batch of 131 k
    # hashes against argsort's 4.6-5; equal hashes find the same, in whatever order.)
    order, queries = _stable_argsort(h)
    if kernel is not None:
        del queries
        return _counted(kernel, groups, h, order, starts, window_group, table)
    lo, hi = np.empty(h.size, dtype=np.int64), np.empty(h.size, dtype=np.int64)
    lo[order] = np.searchsorted(ref_h, queries, side="left")
    hi[order] = np.searchsorted(ref_h, queries, side="right")
    del queries, order
    hi -= lo  # each window's count of reference n-grams
    hit = np.flatnonzero((hi > 0) & (hi <= _MAX_HASH_REPEAT))
    if hit.size == 0:
        return {}
    count = hi[hit]
    window = np.repeat(hit, count)
    j = np.repeat(lo[hit] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    cand = window_group[window]
    owner = ref_owner[j].astype(np.int64)
    delta = (starts[window] - ref_start[j]).astype(np.int64)
    # One int64 key per (candidate, owner, delta) when the three fit (Python ints: no wrap-around).
    d_lo, d_span = int(delta.min()), int(delta.max()) - int(delta.min()) + 1
    o_lo, o_span = int(owner.min()), int(owner.max()) - int(owner.min()) + 1
    if len(groups) * o_span * d_span >= (1 << 62):
        return {g.key: _votes_alone(g, lambda _n: table, n) for g in groups}
    key = (cand * o_span + (owner - o_lo)) * d_span + (delta - d_lo)
    uniq, first, votes = _unique_first_counts(key)
    u_delta = uniq % d_span + d_lo
    u_owner = (uniq // d_span) % o_span + o_lo
    u_cand = uniq // (d_span * o_span)
    # Within a candidate: votes, then |delta|, then group, then first vote (as _ranked_votes ranks).
    rank = np.lexsort((first, u_owner, np.abs(u_delta), -votes, u_cand))
    u_cand, u_owner, u_delta, votes = u_cand[rank], u_owner[rank], u_delta[rank], votes[rank]
    starts_of = np.flatnonzero(np.r_[True, u_cand[1:] != u_cand[:-1]])
    keep = np.arange(u_cand.size) - np.repeat(starts_of, np.diff(np.r_[starts_of, u_cand.size])) < _MAX_ALIGNMENTS
    out: dict[int, list[tuple[int, int, int]]] = {}
    for c, o, d, v in zip(u_cand[keep].tolist(), u_owner[keep].tolist(), u_delta[keep].tolist(),
                          votes[keep].tolist(), strict=True):
        out.setdefault(groups[c].key, []).append((o, d, v))
    return out


def _counted(kernel: Any, groups: list[SequenceRows], h: np.ndarray, order: np.ndarray, starts: np.ndarray,
             window_group: np.ndarray, table: tuple[np.ndarray, ...]) -> dict[int, list[tuple[int, int, int]]]:
    """:func:`_votes_together`'s hypotheses counted by the compiled ``kernel``."""
    shape = (len(groups), _MAX_ALIGNMENTS)
    owner, delta, votes = np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape, np.int64)
    kept = np.empty(len(groups), np.int64)
    kernel(h, order, starts, window_group, *table[:3], _MAX_HASH_REPEAT, owner, delta, votes, kept)
    return {groups[c].key: list(zip(owner[c, :k].tolist(), delta[c, :k].tolist(), votes[c, :k].tolist(), strict=True))
            for c, k in zip(np.flatnonzero(kept).tolist(), kept[kept > 0].tolist(), strict=True)}


def _ranked_votes(
    lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ref_owner: np.ndarray, ref_start: np.ndarray
) -> list[tuple[int, int, int]]:
    """Every (reference group, delta) voted for by a candidate n-gram (window i matches reference
    n-grams lo[i]..hi[i]), ranked by votes, then |delta|, then group, then first vote."""
    hit = np.flatnonzero((hi > lo) & (hi - lo <= _MAX_HASH_REPEAT))
    if hit.size == 0:
        return []
    count = (hi - lo)[hit]
    window = np.repeat(hit, count)
    # The reference n-grams of each window, in order: lo[i], lo[i] + 1, ..., hi[i] - 1.
    j = np.repeat(lo[hit] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    owner = ref_owner[j].astype(np.int64)
    delta = (starts[window] - ref_start[j]).astype(np.int64)
    # Bounds as Python ints (np.abs of the most negative int64 is still negative).
    packable = int(owner.min()) >= 0 and int(owner.max()) < (1 << 30)
    packable = packable and int(delta.min()) >= -(1 << 31) and int(delta.max()) < (1 << 31)
    if packable:
        # One int64 key per (owner, delta), ordered like the pair: a 1-d unique is much cheaper.
        uniq_key, first, votes = np.unique((owner << 32) + (delta + (1 << 31)), return_index=True, return_counts=True)
        uniq = np.stack([uniq_key >> 32, (uniq_key & 0xFFFFFFFF) - (1 << 31)], axis=1)
    else:
        uniq, first, votes = np.unique(np.stack([owner, delta], axis=1), axis=0, return_index=True, return_counts=True)
    order = np.lexsort((first, uniq[:, 0], np.abs(uniq[:, 1]), -votes))
    return [(int(uniq[k, 0]), int(uniq[k, 1]), int(votes[k])) for k in order]


def _align_by_labels(
    reference: RowIndex,
    candidate: RowIndex,
    ref_groups: dict[int, SequenceRows],
    cand_groups: dict[int, SequenceRows],
    duplicates: int,
) -> Alignment:
    """Without token ids, fall back to equal sequence keys (or one sequence each) and positions."""
    side = "reference" if not reference.has_tokens else "candidate"
    notes = [f"the {side} rows carry no token ids: rows are aligned by sequence key and position, "
             f"which is only right if both runs used the same sequence keys; record token ids to align by content"]
    by_key = {reference.group_keys[k].split(":")[-1]: k for k in ref_groups}
    sequences = []
    for g in cand_groups.values():
        key = candidate.group_keys[g.key].split(":")[-1]
        if key in by_key:
            sequences.append(SequenceAlignment(g.key, [(by_key[key], 0, int(g.size))]))
        elif len(ref_groups) == 1 and len(cand_groups) == 1:
            sequences.append(SequenceAlignment(g.key, [(next(iter(ref_groups)), 0, int(g.size))]))
        else:
            sequences.append(SequenceAlignment(g.key, []))
    return Alignment(reference, candidate, sequences, False, notes, duplicates, ref_groups, cand_groups)
