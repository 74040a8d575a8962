"""The rows an alignment pairs: candidate row <-> reference row, under a label offset.

Each candidate sequence's rows are paired with the reference sequence of its best hypothesis (then
the others) at position ``p - delta + offset``, where its token agrees; a reference row pairs once per
candidate writer group (a retry is a duplicate, another rank a replica). Labels only, no values.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.sequences import (
    NGRAM,
    Alignment,
    SequenceAlignment,
    SequenceRows,
    end_positions,
    kept_in_place,
)
from tracediff.compare.rows.gather import usable_cpus
from tracediff.compare.rows.index import COMPACT_BOUND, index_dtype
from tracediff.store import PHASES


@dataclass
class RowPairs:
    """Candidate row i <-> reference row j, both as indices into their RowIndex (int32 below 2**31
    rows a side)."""

    candidate: np.ndarray
    reference: np.ndarray
    offset: int
    unaligned: int  # valid candidate rows without a counterpart
    duplicates: int  # candidate rows whose reference row their writer already paired (retries)
    prefix_rows: dict[int, np.ndarray]  # candidate group -> rows before the aligned region (extra tokens)
    effective_delta: dict[int, int]  # candidate group -> delta after the offset
    replicas: int = 0  # pairs whose reference row another writer group pairs too (tensor-parallel ranks)
    # Tokens the candidate has inside a sequence that the reference lacks (or lacks where the
    # reference has some): {"group", "position", "length", "tokens", "kind": "insertion"|"deletion"}.
    insertions: list[dict] = field(default_factory=list)
    distinct_reference: int = -1  # distinct reference rows paired, when pair_rows counted them
    trailing: int = 0  # unaligned candidate rows past the end of the reference sequence they align with
    # Per pair, a key from the content of its reference row (its sequence's tokens, its position),
    # whatever store or writer group holds it: samples drawn by it are the same rows however a side's
    # rows are split across stores (:func:`content_keys`); None where the reference has no token ids.
    content_keys: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.candidate.size)

    @property
    def reference_rows(self) -> int:
        """Distinct reference rows paired (replicated writer groups pair one row several times)."""
        if self.distinct_reference >= 0:
            return self.distinct_reference
        return int(np.unique(self.reference).size)


def _shifted(positions: np.ndarray, delta: int, offset: int) -> np.ndarray:
    """``positions - delta + offset`` as int64 arithmetic gives it: compact (int32) positions stay
    int32 when the result fits (:data:`~tracediff.compare.rows.index.COMPACT_BOUND`), else widen first."""
    if positions.dtype == np.int32 and abs(delta) + abs(offset) <= 2 * COMPACT_BOUND:
        return positions - delta + offset
    return positions.astype(np.int64, copy=False) - delta + offset


def _find_positions(positions: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index into sorted, distinct ``positions`` of each wanted position (clipped), and whether it
    is there. Positions without gaps (the common case) need no search."""
    n = positions.size
    if n and int(positions[-1]) - int(positions[0]) == n - 1:
        idx = wanted - positions[0]
        found = (idx >= 0) & (idx < n)
        return np.minimum(np.maximum(idx, 0), n - 1), found
    idx = np.searchsorted(positions, wanted)
    idx_c = np.minimum(idx, max(n - 1, 0))
    return idx_c, (idx < n) & (positions[idx_c] == wanted)


def pair_rows(alignment: Alignment, offset: int = 0, candidate_groups: Sequence[int] | None = None, *,
              batched: bool = True) -> RowPairs:
    """Pair rows under the alignment: candidate position p <-> reference position p - delta + offset.

    ``offset`` is the label offset: 0 when rows are labelled with the token whose forward produced
    them; the offset search tries -2..2. A hypothesis is used for a row only if the row's token agrees
    with the reference token at p - delta (rows without a token take the best hypothesis).

    Sequences with one hypothesis whose reference sequence has no gap in its positions (nearly all)
    are paired many at a time (:func:`_pair_batch`); the others, or every one with ``batched=False``
    (the reference path, for tests), one by one (:func:`_pair_sequence`). The same pairs, counts and
    notes either way. Then :func:`_made_pairs` sets duplicates aside and puts the pairs in candidate
    order.
    """
    wanted = set(candidate_groups) if candidate_groups is not None else None
    written = _Written.for_pairs(alignment, wanted)
    tally = _Tally()
    # Sequences waiting to be paired together. Batches write disjoint candidate rows of ``slot``: they
    # run on the cores (numpy's gathers release the GIL), and their notes are merged in batch order
    # before any later sequence's, so the notes come out in the order one by one gives.
    batch: list[tuple[SequenceAlignment, tuple[int, int]]] = []
    batch_rows = 0
    running: list[Any] = []  # futures of the batches sent off, in order
    # Two threads at most: each batch holds ~a dozen temporaries of its rows (the alignment's peak).
    every = written.slot is not None
    cpus = usable_cpus()
    pool = (ThreadPoolExecutor(min(2, cpus), thread_name_prefix="tracediff-pairs")
            if every and batched and len(alignment.candidate) > _BATCH_ROWS and cpus > 1 else None)

    def flush() -> None:
        nonlocal batch, batch_rows
        if batch:
            slot = written.slot
            assert slot is not None
            if pool is not None:
                running.append(pool.submit(_pair_batch, alignment, offset, batch, slot))
            else:
                tally.merge(_pair_batch(alignment, offset, batch, slot))
            batch, batch_rows = [], 0

    def settle() -> None:
        """Every batch sent off paired, its notes merged (in order)."""
        flush()
        for future in running:
            tally.merge(future.result())
        running.clear()

    try:
        for seq in alignment.sequences:
            if wanted is not None and seq.candidate_group not in wanted:
                continue
            ends = _batch_ends(alignment, seq) if batched and every else None
            if ends is not None:
                batch.append((seq, ends))
                batch_rows += alignment.cand_groups[seq.candidate_group].size
                if batch_rows >= _BATCH_ROWS:
                    flush()
                continue
            settle()
            _pair_sequence(alignment, seq, offset, written, tally)
        settle()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return cut_diverged_generations(_made_pairs(alignment, offset, written, tally), alignment)


#: Phases of rows whose token the engine generated (its own choice), not the prompt's.
GENERATED_PHASES = frozenset(PHASES.index(p) for p in ("draft_extend", "decode", "verify"))


def cut_diverged_generations(pairs: RowPairs, alignment: Alignment) -> RowPairs:
    """An insertion or deletion at a candidate row the engine generated (phase decode, verify or
    draft_extend: its token is the engine's own choice, not the prompt's) is where two generations
    diverge (another draft or numerics flipping a near tie), never a template difference (when every
    prompt row of the sequence is paired: an unpaired prompt row is a template's tokens): from
    there on, the rows of that sequence pair only by chance with shifted rows of another context.
    They are left unpaired (counted unaligned), the insertion is kept marked ``generated``, and the
    sequence's later insertions (artefacts of that chance pairing) are dropped."""
    cand = alignment.candidate
    cuts: dict[int, int] = {}
    for ins in pairs.insertions:
        g = alignment.cand_groups.get(ins["group"])
        if g is None or ins["group"] in cuts:
            continue
        at = int(np.searchsorted(g.positions, ins["position"]))
        if at >= g.size or int(cand.phase[g.rows[at]]) not in GENERATED_PHASES:
            continue
        # Every prompt row of the sequence paired: the tokens part in what the engine generated. A
        # prompt row left unpaired is a template's tokens, whichever later row the boundary fell on
        # (repeated tokens let the alignment place it a few positions late).
        prompt = ~np.isin(cand.phase[g.rows], list(GENERATED_PHASES))
        if np.isin(g.rows[prompt], pairs.candidate).all():
            cuts[int(ins["group"])] = int(ins["position"])
    if not cuts:
        return pairs
    groups = np.asarray(cand.group[pairs.candidate], dtype=np.int64)
    position = np.asarray(cand.position[pairs.candidate], dtype=np.int64)
    limit = np.full(max(len(cand.group_keys), 1), np.iinfo(np.int64).max, dtype=np.int64)
    for group, at in cuts.items():
        limit[group] = at
    drop = position >= limit[groups]
    kept: list[dict] = []
    for ins in pairs.insertions:
        at = cuts.get(int(ins["group"]))
        if at is None:
            kept.append(ins)
        elif int(ins["position"]) == at and not any(k is ins for k in kept):
            kept.append({**ins, "generated": True})
    pairs.candidate, pairs.reference = pairs.candidate[~drop], pairs.reference[~drop]
    pairs.unaligned += int(drop.sum())
    pairs.insertions = kept
    pairs.distinct_reference = -1
    return pairs


@dataclass
class _Written:
    """Where the pairs are written. Every sequence: each pair at its candidate row (each pairs at most
    once) in ``slot``, one column as long as the candidate, -1 where unpaired, so the pairs come out in
    candidate order without a sort. A few sequences (the offset search): into two buffers as large as
    their rows. Either way no list of small arrays left behind in the allocator's heap, no
    concatenation. :meth:`take` hands the buffers over (whoever takes them lets them go)."""

    slot: np.ndarray | None
    cand: np.ndarray
    ref: np.ndarray

    @classmethod
    def for_pairs(cls, alignment: Alignment, wanted: set[int] | None) -> _Written:
        n_cand, n_ref = len(alignment.candidate), len(alignment.reference)
        slot = np.full(n_cand, -1, dtype=index_dtype(n_ref)) if wanted is None else None
        room = 0 if wanted is None else sum(alignment.cand_groups[k].size for k in wanted if k in alignment.cand_groups)
        return cls(slot, np.empty(room, dtype=index_dtype(n_cand)), np.empty(room, dtype=index_dtype(n_ref)))

    def take(self) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        out = (self.slot, self.cand, self.ref)
        del self.slot, self.cand, self.ref
        return out


@dataclass
class _Tally:
    """What pairing the sequences counts and notes, merged in sequence order: the pairs written so far
    (``held``), candidate rows left unpaired (of them, past the reference sequence's end), insertions,
    prefixes and each sequence's effective delta."""

    held: int = 0
    unaligned: int = 0
    trailing: int = 0
    insertions: list[dict] = field(default_factory=list)
    prefix_rows: dict[int, np.ndarray] = field(default_factory=dict)
    effective: dict[int, int] = field(default_factory=dict)

    def merge(self, got: tuple[int, int, int, dict[int, int], dict[int, np.ndarray]]) -> None:
        u, t, n, eff, prefix = got
        self.unaligned, self.trailing, self.held = self.unaligned + u, self.trailing + t, self.held + n
        self.effective.update(eff)
        self.prefix_rows.update(prefix)


def _batch_ends(alignment: Alignment, seq: SequenceAlignment) -> tuple[int, int] | None:
    """The reference sequence's first and last positions where ``seq`` can be paired in a batch (one
    hypothesis, a reference sequence without a gap, sums that stay in int64), else None."""
    if len(seq.hypotheses) != 1:
        return None
    cg = alignment.cand_groups[seq.candidate_group]
    rg = alignment.ref_groups[seq.hypotheses[0][0]]
    ends = end_positions(rg, alignment.reference)
    if (ends is not None and ends[1] - ends[0] == rg.size - 1
            and abs(ends[0]) + abs(ends[1]) + abs(seq.hypotheses[0][1]) < _SAFE  # (int64 sums below)
            and end_positions(cg, alignment.candidate) is not None):
        return ends
    return None


def _pair_sequence(alignment: Alignment, seq: SequenceAlignment, offset: int, written: _Written, tally: _Tally) -> None:
    """One candidate sequence paired hypothesis by hypothesis, best first, into ``written``."""
    g = alignment.cand_groups[seq.candidate_group].held()
    if not seq.hypotheses:
        tally.unaligned += g.size
        return
    slot = written.slot
    taken = np.zeros(g.size, dtype=bool)
    row_delta = np.zeros(g.size, dtype=np.int64)
    # Reference rows this candidate sequence already paired: each at most once, so a row past
    # the end of the reference's sequence (a server that records one more position than the
    # trainer kept) never re-pairs an earlier reference row under another delta.
    used: dict[int, np.ndarray] = {}
    primary = seq.hypotheses[0][0]
    for h_i, (ref_key, delta, _votes) in enumerate(seq.hypotheses):
        rg = alignment.ref_groups[ref_key].held()
        free = ~taken
        # Token consistency under this hypothesis (label positions, before the offset).
        idx_c, at = _find_positions(rg.positions, _shifted(g.positions, delta, 0))
        agree = at & (rg.tokens[idx_c] == g.tokens)
        unknown = g.tokens < 0
        ok = free & (agree | (unknown & (h_i == 0)) if alignment.by_tokens else free)
        # The value pairing: shift by the label offset.
        vidx_c, vat = _find_positions(rg.positions, _shifted(g.positions, delta, offset))
        seen = used.setdefault(ref_key, np.zeros(rg.size, dtype=bool))
        use = ok & vat & ~seen[vidx_c]
        if h_i > 0 and ref_key != primary:
            # Another reference sequence takes only whole runs of rows (a shared prefix's last
            # row matching a longer sample is where the sequences diverge, not a pairing).
            use &= _runs_of_at_least(use, NGRAM)
        seen[vidx_c[use]] = True
        got = g.rows[use]
        held = tally.held
        if slot is not None:
            slot[got] = rg.rows[vidx_c[use]]
        else:
            written.cand[held : held + got.size] = got
            written.ref[held : held + got.size] = rg.rows[vidx_c[use]]
        tally.held = held + got.size
        taken |= use
        row_delta[use] = delta
        if h_i == 0:
            tally.effective[seq.candidate_group] = delta - offset
    if taken.any():
        # A prefix: candidate rows before the first paired one, in front of the reference's start.
        # Python ints: positions near the int64 limits must not wrap around.
        first = int(np.argmax(taken))  # positions are sorted
        eff = int(row_delta[first]) - offset
        rg0 = alignment.ref_groups[seq.hypotheses[0][0]]
        before = (g.positions < int(g.positions[first])) & (g.positions < int(rg0.positions[0]) + eff) \
            if eff > 0 else np.zeros(g.size, dtype=bool)
        extra = before & ~taken
        if extra.any():
            tally.prefix_rows[seq.candidate_group] = g.rows[extra]
        tally.insertions += _insertions(seq.candidate_group, g, taken, row_delta)
        # Rows past the last position of the reference sequence they align with: the two
        # sequences end differently (coverage), whatever else they are.
        end = int(alignment.ref_groups[primary].positions[-1]) + int(seq.hypotheses[0][1])
        tally.trailing += int((~taken & (g.positions > end)).sum())
    tally.unaligned += int((~taken).sum())


def _made_pairs(alignment: Alignment, offset: int, written: _Written, tally: _Tally) -> RowPairs:
    """The pairs written, one candidate row per reference row and writer group, in candidate order."""
    n_cand, n_ref = len(alignment.candidate), len(alignment.reference)
    held, unaligned, trailing = tally.held, tally.unaligned, tally.trailing
    prefix_rows, effective, insertions = tally.prefix_rows, tally.effective, tally.insertions
    slot, cand_buf, ref_buf = written.take()
    rows_dtype = index_dtype(max(n_cand, n_ref))
    if held == 0:
        cand = ref = np.empty(0, dtype=rows_dtype)
    elif slot is not None:
        cand, ref = _in_candidate_order(slot >= 0, slot, held)
        del slot
        if _each_once(ref, n_ref):
            # No reference row paired twice (the common case): no duplicate or replica to set aside;
            # the same arrays as the sort below gives.
            return RowPairs(cand, ref, offset, unaligned, alignment.candidate_duplicates, prefix_rows, effective, 0,
                            insertions, held, trailing)
    else:
        cand, ref = cand_buf[:held], ref_buf[:held]
    del cand_buf, ref_buf
    # One candidate row per reference row and writer group: a writer that records a row twice (a
    # retry) is a duplicate, set aside; another writer holding the same row (a tensor-parallel rank)
    # is a replica, compared like any row, so a rank that captured something else is seen.
    stream = alignment.candidate.stream_of(cand)
    if n_ref * n_cand < (1 << 62):
        # One unique int64 key: index order is (stream, row) order, and each candidate row is paired
        # at most once, so any sort gives lexsort's order (numpy's vectorised sort, ~3x faster).
        key = np.multiply(ref, n_cand, dtype=np.int64)
        key += cand
        order = np.argsort(key)
        del key
    else:
        order = np.lexsort((cand, stream, ref))
    cand, ref, stream = cand[order], ref[order], stream[order]
    first = np.ones(ref.size, dtype=bool)
    first[1:] = (ref[1:] != ref[:-1]) | (stream[1:] != stream[:-1])
    duplicates = int((~first).sum()) + alignment.candidate_duplicates
    cand, ref = cand[first], ref[first]
    # ``ref`` is sorted here: its distinct rows are counted in one pass, no hash table.
    distinct = int(np.count_nonzero(ref[1:] != ref[:-1])) + 1 if ref.size else 0
    replicas = int(ref.size - distinct)
    # Candidate storage order makes the streaming pass read the candidate sequentially: the index's
    # own order (stream by stream, row by row), and each candidate row appears once.
    order = np.argsort(cand)
    return RowPairs(cand[order], ref[order], offset, unaligned, duplicates, prefix_rows, effective, replicas,
                    insertions, distinct, trailing)


#: Candidate rows :func:`pair_rows` pairs together at most (~40 bytes a row of temporaries).
_BATCH_ROWS = 1 << 18
#: Positions and deltas whose sums the batched pairing makes in int64 stay below this.
_SAFE = 1 << 60


def _pair_batch(alignment: Alignment, offset: int, batch: list[tuple[SequenceAlignment, tuple[int, int]]],
                slot: np.ndarray) -> tuple[int, int, int, dict[int, int], dict[int, np.ndarray]]:
    """:func:`pair_rows`' loop for candidate sequences of one hypothesis each, whose reference sequence
    (first and last position given) has no gap in its positions, all at once: each row's reference
    entry is its position less the delta and the reference's first position, no search. Writes the
    pairs into ``slot`` (only the batch's candidate rows: batches may run concurrently); returns the
    unaligned and trailing rows, the pairs made, and the notes: each sequence's effective delta and
    its prefix rows (in the batch's order)."""
    effective: dict[int, int] = {}
    prefix_rows: dict[int, np.ndarray] = {}
    cand, ref = alignment.candidate, alignment.reference
    groups = [alignment.cand_groups[seq.candidate_group] for seq, _ in batch]
    refs = [alignment.ref_groups[seq.hypotheses[0][0]] for seq, _ in batch]
    sizes = np.array([g.size for g in groups], dtype=np.int64)
    ref_sizes = np.array([r.size for r in refs], dtype=np.int64)
    delta = np.array([seq.hypotheses[0][1] for seq, _ in batch], dtype=np.int64)
    first_ref = np.array([ends[0] for _, ends in batch], dtype=np.int64)
    last_ref = np.array([ends[1] for _, ends in batch], dtype=np.int64)
    rows = np.concatenate([g.rows for g in groups])
    ref_rows = np.concatenate([r.rows for r in refs])
    ref_base = np.cumsum(ref_sizes) - ref_sizes
    member = np.repeat(np.arange(len(batch), dtype=np.int32), sizes)
    pos = cand.position[rows]
    # int32 arithmetic where compact positions and these shifts cannot leave its range, else int64
    # (the same numbers either way).
    shifts = np.abs(np.concatenate([delta + first_ref, last_ref + delta, first_ref + delta - offset]))
    wide = np.int64 if (pos.dtype != np.int32 or int(shifts.max()) + abs(offset) >= COMPACT_BOUND
                        or int(ref_sizes.sum()) >= COMPACT_BOUND) else np.int32
    pos = pos.astype(wide, copy=False)
    delta, first_ref, last_ref, ref_sizes, ref_base = (a.astype(wide) for a in (delta, first_ref, last_ref, ref_sizes,
                                                                                ref_base))
    n_r = ref_sizes[member]
    # The reference entry under the hypothesis (label positions), then under the label offset.
    idx = pos - (delta + first_ref)[member]
    if alignment.by_tokens:
        tok = cand.token_id[rows]
        at = np.clip(idx, 0, n_r - 1)
        at += ref_base[member]
        agree = (idx >= 0) & (idx < n_r) & (ref.token_id[ref_rows[at]] == tok)
        del at
        use = agree | (tok < 0)
        del agree, tok
    else:
        use = np.ones(rows.size, dtype=bool)
    idx += offset
    use &= (idx >= 0) & (idx < n_r)
    del n_r
    got = np.flatnonzero(use)
    slot[rows[got]] = ref_rows[ref_base[member[got]] + idx[got]]
    # Per sequence, the notes pair_rows' loop makes for a sequence with a paired row. A prefix row
    # (the loop: before the first paired row and before the reference's start under the effective
    # delta) is any row of the second kind: such a row is never paired (its entry is below 0), so it
    # lies before every paired one.
    any_paired = np.bincount(member[got], minlength=len(batch)) > 0
    unpaired = ~use
    counted = unpaired & any_paired[member]
    trailing = int(np.count_nonzero(counted & (pos > (last_ref + delta)[member])))
    eff = delta - wide(offset)
    extra = counted & (eff > 0)[member] & (pos < (first_ref + eff)[member])
    with_extra = np.bincount(member[extra], minlength=len(batch)) if extra.any() else None
    extra_rows = rows[extra]
    at_extra = 0
    for k, (seq, _) in enumerate(batch):
        effective[seq.candidate_group] = int(eff[k])
        if with_extra is not None and with_extra[k]:
            prefix_rows[seq.candidate_group] = extra_rows[at_extra : at_extra + with_extra[k]]
            at_extra += int(with_extra[k])
    return int(np.count_nonzero(unpaired)), trailing, int(got.size), effective, prefix_rows


def _each_once(ref: np.ndarray, n_ref: int) -> bool:
    """True when no reference row (an index below ``n_ref``) appears twice in ``ref``."""
    seen = np.zeros(n_ref, dtype=bool)
    seen[ref] = True
    return int(np.count_nonzero(seen)) == ref.size


def _in_candidate_order(present: np.ndarray, slot: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs held in ``slot`` (a reference row at each paired candidate row, ``present`` marks
    them; ``count`` of them) in candidate order: the candidate rows made a piece at a time (no whole
    int64 index array), the reference rows moved to the front of ``slot`` in place (a view of it)."""
    cand = np.empty(count, dtype=index_dtype(present.size))
    at = 0
    for a in range(0, present.size, _MASK_PIECE):
        got = np.flatnonzero(present[a : a + _MASK_PIECE])
        got += a
        cand[at : at + got.size] = got
        at += got.size
    return cand, kept_in_place(slot, present)


#: Candidate rows :func:`_in_candidate_order` turns into indices at a time.
_MASK_PIECE = 1 << 20


def _runs_of_at_least(mask: np.ndarray, n: int) -> np.ndarray:
    """The True entries of ``mask`` that belong to a run of at least ``n`` consecutive True."""
    if not mask.any():
        return mask
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    keep = np.zeros(mask.size, dtype=bool)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        if b - a >= n:
            keep[a:b] = True
    return keep


def _insertions(group: int, g: SequenceRows, taken: np.ndarray, row_delta: np.ndarray) -> list[dict]:
    """Where the pairing delta steps between paired runs of one candidate sequence: tokens inserted
    (the delta grows by the unpaired rows between) or deleted (it shrinks) inside the sequence."""
    out: list[dict] = []
    paired = np.flatnonzero(taken)
    if paired.size < 2:
        return out
    deltas = row_delta[paired]
    for k in np.flatnonzero(np.diff(deltas)).tolist():
        a, b = int(paired[k]), int(paired[k + 1])
        step = int(deltas[k + 1] - deltas[k])
        between = np.arange(a + 1, b)
        if step > 0:
            out.append({"group": group, "kind": "insertion", "position": int(g.positions[a]) + 1, "length": step,
                        "tokens": [int(t) for t in g.tokens[between][:16]]})
        else:
            out.append({"group": group, "kind": "deletion", "position": int(g.positions[b]), "length": -step,
                        "tokens": []})
    return out


def content_keys(pairs: RowPairs, alignment: Any) -> np.ndarray | None:
    """Per pair of ``pairs``, a 64-bit key of what its reference row is: a hash of its sequence's
    token ids and first position, mixed with its own position. The same rows get the same keys
    however the stores, writer groups and row indexes number them. None without reference tokens."""
    import hashlib  # noqa: PLC0415

    reference = alignment.reference
    if not reference.has_tokens or len(pairs) == 0:
        return None
    table = np.zeros(len(reference.group_keys), dtype=np.uint64)
    for key, g in alignment.ref_groups.items():
        digest = hashlib.blake2b(np.asarray(g.tokens, dtype=np.int64).tobytes()
                                 + np.asarray(g.positions[:1], dtype=np.int64).tobytes(), digest_size=8).digest()
        table[key] = np.frombuffer(digest, dtype=np.uint64)[0]
    position = reference.position[pairs.reference].astype(np.uint64)
    with np.errstate(over="ignore"):  # (the sequence hashes are uniform already: one xor keeps them so)
        position *= np.uint64(0x9E3779B97F4A7C15)
    position ^= table[reference.group[pairs.reference]]
    return position


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

