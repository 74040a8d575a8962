"""The alignment's sorts: the fast paths give numpy's stable results exactly (the pairs, votes and
every report built on them depend on the order of equal keys)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tracediff.compare.align import argsort
from tracediff.compare.align.argsort import stable_argsort_with_keys
from tracediff.compare.align.sequences import (
    SequenceRows,
    _groups,
    _unique_first_counts,
    _votes_alone,
    _votes_together,
    align_sequences,
    ngram_table,
    stable_argsort,
)
from tracediff.compare.rows.index import RowIndex, _sequence_groups, _split_samples
from tracediff.compare.rows.kernels import vote_kernels

keys = st.one_of(
    hnp.arrays(np.int64, st.integers(0, 400), elements=st.integers(-5, 5)),  # many ties
    hnp.arrays(np.int64, st.integers(0, 400), elements=st.integers(-(2**63), 2**63 - 1)),
    hnp.arrays(np.uint64, st.integers(0, 400), elements=st.integers(0, 2**64 - 1)),
    st.integers(0, 300).map(lambda n: np.arange(n, dtype=np.int64) // 3),  # already in order, with ties
)


@settings(max_examples=400, deadline=None)
@given(key=keys)
def test_stable_argsort_is_numpys_stable_argsort(key: np.ndarray) -> None:
    assert np.array_equal(stable_argsort(key), np.argsort(key, kind="stable"))


@settings(max_examples=300, deadline=None)
@given(key=keys)
def test_unique_first_counts_is_numpys_unique(key: np.ndarray) -> None:
    expected = np.unique(key, return_index=True, return_counts=True)
    for got, want in zip(_unique_first_counts(key), expected, strict=True):
        assert np.array_equal(got, want)


packed_keys = st.one_of(
    keys,
    hnp.arrays(np.int32, st.integers(0, 300), elements=st.integers(-(2**31), 2**31 - 1)),
    hnp.arrays(np.int16, st.integers(0, 300), elements=st.integers(-3, 3)),
    hnp.arrays(np.uint32, st.integers(0, 300), elements=st.integers(0, 2**32 - 1)),
    # 64-bit keys equal in their top bits and apart below them (the bits the index takes): the
    # packed sort's runs put back in key order.
    st.tuples(hnp.arrays(np.uint64, st.integers(0, 300), elements=st.integers(0, 3)),
              hnp.arrays(np.uint64, 300, elements=st.integers(0, 2**12))).map(
        lambda t: (t[0] << np.uint64(60)) | t[1][: t[0].size]),
    hnp.arrays(np.int64, st.integers(0, 300), elements=st.sampled_from([-(2**63), 2**63 - 1, -1, 0, 1, 2**62])),
)


@pytest.mark.parametrize("bisect_runs", [0, 256])  # runs out of key order found from an array, by bisection
@settings(max_examples=400, deadline=None)
@given(key=packed_keys)
def test_the_packed_sort_is_numpys_stable_argsort(key: np.ndarray, bisect_runs: int) -> None:
    with pytest.MonkeyPatch.context() as mp:  # the packed sort for arrays of any size
        mp.setattr(argsort, "PACKED_MIN", 2)
        mp.setattr(argsort, "_BISECT_RUNS", bisect_runs)
        order, ordered = stable_argsort_with_keys(key)
    expected = np.argsort(key, kind="stable")
    assert np.array_equal(order, expected)
    assert np.array_equal(ordered, key[expected])
    assert ordered.dtype == key.dtype


@pytest.mark.parametrize("dtype", ["uint64", "int64", "int32"])
def test_millions_of_keys_by_the_packed_sort_sort_like_numpy(dtype: str) -> None:
    """Hashes (the n-gram table: 64 bits, the index's bits taken from their bottom), a row index's
    sort keys (a narrow span: nothing dropped), heavy ties."""
    rng = np.random.default_rng(11)
    n = 1 << 21
    info = np.iinfo(dtype)
    for key in (rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True),
                rng.integers(0, 1 << 20, n).astype(dtype), rng.integers(0, 50, n).astype(dtype)):
        order, ordered = stable_argsort_with_keys(key)
        expected = np.argsort(key, kind="stable")
        assert np.array_equal(order, expected)
        assert np.array_equal(ordered, key[expected])


def test_a_million_random_hashes_sort_like_numpy() -> None:
    rng = np.random.default_rng(5)
    key = rng.integers(0, 2**20, 1_000_000).astype(np.uint64)  # ~1 tie in 2 values
    assert np.array_equal(stable_argsort(key), np.argsort(key, kind="stable"))


@settings(max_examples=300, deadline=None)
@given(seq=hnp.arrays(np.int64, st.integers(1, 200),
                      elements=st.integers(-50, 50) | st.integers(-(2**45), 2**45) | st.integers(0, 2**62)))
def test_one_streams_sequence_groups_are_those_of_the_general_key(seq: np.ndarray) -> None:
    """One stream takes a shortcut; its groups and their order must be what the (stream, seq) key
    gives the same rows when another stream is present (whose rows all sort after stream 0's)."""
    n = seq.size
    one = _sequence_groups(np.zeros(n, dtype=np.int32), seq)
    two = _sequence_groups(np.r_[np.zeros(n, dtype=np.int32), np.ones(1, dtype=np.int32)], np.r_[seq, [0]])
    assert np.array_equal(one[0], two[0][:n])
    assert one[1] == two[1][:-1]


def _split_by_hand(group: np.ndarray, keys: list[str], position: np.ndarray, valid: np.ndarray) -> tuple:
    """What splitting packed samples means, row by row in recorded order: a valid row below its
    sequence's previous valid position starts the next sample; invalid rows stay where they are."""
    ordinal, last, count = [], {}, {}
    for g, p, ok in zip(group.tolist(), position.tolist(), valid.tolist(), strict=True):
        if ok:
            if g in last and p < last[g]:
                count[g] = count.get(g, 0) + 1
            last[g] = p
        ordinal.append(count.get(g, 0))
    pairs = sorted(set(zip(group.tolist(), ordinal, strict=True)))
    dense = {pair: i for i, pair in enumerate(pairs)}
    names = [keys[g] if not count.get(g) else f"{keys[g]}#{k}" for g, k in pairs]
    return [dense[pair] for pair in zip(group.tolist(), ordinal, strict=True)], names, len(count)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 120), groups=st.integers(1, 6), sorted_groups=st.booleans(),
       all_valid=st.booleans(), int32=st.booleans())
def test_packed_samples_split_where_positions_restart(data: st.DataObject, n: int, groups: int, sorted_groups: bool,
                                                        all_valid: bool, int32: bool) -> None:
    """The split of packed rows (sorted or interleaved sequences, all or some rows valid, compact
    or int64 columns) is the row-by-row definition's."""
    drawn = data.draw(st.lists(st.integers(0, groups - 1), min_size=n, max_size=n))
    group = np.unique(drawn, return_inverse=True)[1].astype(np.int64)  # dense ids: every sequence has rows
    if sorted_groups:
        group.sort()
    position = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int64)
    valid = np.ones(n, dtype=bool) if all_valid else np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if int32:
        group, position = group.astype(np.int32), position.astype(np.int32)
    keys = [f"s{k}" for k in range(int(group.max()) + 1)]
    got_group, got_keys, got_split = _split_samples(group, keys, position, valid)
    want_group, want_keys, want_split = _split_by_hand(group, keys, position, valid)
    assert got_group.tolist() == want_group and got_keys == want_keys and got_split == want_split


def _group(key: int, tokens: list[int], start: int) -> SequenceRows:
    n = len(tokens)
    return SequenceRows(key, np.arange(start, start + n, dtype=np.int32), np.array(tokens, dtype=np.int32),
                  np.arange(n, dtype=np.int32), 0)


sequences = st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=90)
                      | st.just([0] * 67) | st.integers(4, 90).map(lambda n: [0] * n), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(refs=sequences, cands=sequences, starts=st.lists(st.integers(-3, 3), min_size=12, max_size=12))
def test_votes_of_many_sequences_at_once_are_each_sequences_own(refs: list[list[int]], cands: list[list[int]],
                                                               starts: list[int]) -> None:
    """The batched n-gram lookup (two sorted searches among the reference hashes) gives every
    candidate sequence the hypotheses its own lookup gives, in the same order; tokens from 4 values
    repeat n-grams past the repeat limit, as padding does."""
    ref_groups = [_group(k, t, starts[k]) for k, t in enumerate(refs)]
    cand_groups = [_group(10 + k, t, starts[6 + k]) for k, t in enumerate(cands)]
    table = ngram_table(ref_groups, 4)
    together = _votes_together(cand_groups, table, 4)
    for g in cand_groups:
        alone = _votes_alone(g, lambda n: ngram_table(ref_groups, n), 4)
        assert together.get(g.key, []) == alone
    # The compiled vote counter: the same hypotheses, in the same order.
    compiled = vote_kernels()
    assert _votes_together(cand_groups, table, 4, compiled.batch_votes) == together


def test_compiled_votes_are_numpys_on_ties_repeats_gaps_and_unknown_tokens() -> None:
    """Larger cases than the property above draws: candidate sequences cut from several reference
    sequences (votes for many groups, at deltas of both signs and equal |delta|), padding n-grams
    past the repeat limit, position gaps, unknown (negative) tokens, and no match at all."""
    rng = np.random.default_rng(11)
    refs = [rng.integers(0, 50, int(rng.integers(4, 400))).tolist() for _ in range(40)]
    # An n-gram 297 times, 65 times (one past _MAX_HASH_REPEAT), 64 times; equal sequences.
    refs += [[7] * 300, [9] * 68, [5] * 67, [1, 2, 3, 4] * 30, [1, 2, 3, 4] * 30]
    ref_groups = [_group(k, t, int(rng.integers(-5, 5))) for k, t in enumerate(refs)]
    cands = []
    for k in range(300):
        parts = []
        for _ in range(int(rng.integers(1, 4))):
            src = refs[int(rng.integers(0, len(refs)))]
            a = int(rng.integers(0, len(src)))
            parts += src[a : a + int(rng.integers(1, 80))]
        parts += rng.integers(0, 50, int(rng.integers(0, 6))).tolist()
        tokens = np.array(parts or [0, 0, 0, 0], dtype=np.int32)
        tokens[rng.random(tokens.size) < 0.02] = -1  # unknown tokens: their windows cast no vote
        positions = np.cumsum(1 + (rng.random(tokens.size) < 0.01)).astype(np.int32) + int(rng.integers(-20, 20))
        cands.append(SequenceRows(1000 + k, positions, tokens, np.arange(tokens.size, dtype=np.int32), 0))
    cands.append(_group(5000, [49, 48, 47, 46, 45], 0))  # (most likely) no match
    table = ngram_table(ref_groups, 4)
    compiled = vote_kernels()
    assert compiled is not None  # numba is a core dependency
    kernel = compiled.batch_votes
    for batch in (cands, cands[:1], cands[100:103]):
        want = _votes_together(batch, table, 4)
        assert _votes_together(batch, table, 4, kernel) == want
    assert sum(len(h) > 1 for h in _votes_together(cands, table, 4).values()) > 50


def test_alignments_of_the_samples_are_the_same_with_the_compiled_votes(monkeypatch) -> None:
    from tracediff.store import open_store

    def hypotheses(candidate: str) -> list:
        ref = RowIndex.load(open_store("samples/train.zarr"), "fc_in")
        cand = RowIndex.load(open_store(f"samples/{candidate}.zarr"), "fc_in")
        return [(s.candidate_group, s.hypotheses) for s in align_sequences(ref, cand).sequences]

    for candidate in ("server_broken", "server_fixed"):
        monkeypatch.setenv("TRACEDIFF_KERNEL", "numpy")
        want = hypotheses(candidate)
        monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
        assert hypotheses(candidate) == want
        assert any(h for _, h in want)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 150), groups=st.integers(1, 5), in_order=st.booleans(),
       all_valid=st.booleans(), repeats=st.booleans())
def test_sequence_rows_are_each_positions_first_valid_row(data: st.DataObject, n: int, groups: int, in_order: bool,
                                                          all_valid: bool, repeats: bool) -> None:
    """``_groups``: each sequence's rows ordered by position, the first valid row of each position kept
    (the others counted as duplicates), whether the index's rows are all valid and already in order
    (a trainer's: its columns are used as they are) or not (an engine's, a padded batch)."""
    group = np.sort(data.draw(hnp.arrays(np.int32, n, elements=st.integers(0, groups - 1))))
    position = np.zeros(n, dtype=np.int32)
    for g in np.unique(group).tolist():
        at = np.flatnonzero(group == g)
        position[at] = np.arange(at.size) // (2 if repeats else 1)
    order = np.arange(n) if in_order else np.array(data.draw(st.permutations(list(range(n)))))
    group, position = group[order], position[order]
    token = data.draw(hnp.arrays(np.int32, n, elements=st.integers(-1, 9)))
    valid = np.ones(n, dtype=bool) if all_valid else data.draw(hnp.arrays(np.bool_, n))
    index = RowIndex(store=None, tap="fc_in", streams=[], offsets=np.array([0, n]), group=group, position=position,
                     token_id=token, phase=np.zeros(n, dtype=np.int8), valid=valid,
                     group_keys=[str(g) for g in range(groups)])
    got = {g.key: g for g in _groups(index)}
    want_keys = sorted({int(group[i]) for i in range(n) if valid[i]})
    assert sorted(got) == want_keys
    for k in want_keys:
        rows = sorted((int(position[i]), i) for i in range(n) if valid[i] and group[i] == k)
        kept = [i for j, (p, i) in enumerate(rows) if j == 0 or rows[j - 1][0] != p]
        g = got[k]
        assert g.rows.tolist() == kept and g.rows.dtype == np.int32
        assert g.positions.tolist() == position[kept].tolist()
        assert g.tokens.tolist() == token[kept].tolist()
        assert g.duplicates == len(rows) - len(kept)


def _index(groups: list[np.ndarray], positions: list[np.ndarray], tokens: list[np.ndarray], streams: int) -> RowIndex:
    n = sum(t.size for t in tokens)
    per = -(-n // streams)
    return RowIndex(store=None, tap="fc_in", streams=[None] * streams,
                    offsets=np.minimum(np.arange(streams + 1) * per, n).astype(np.int64),
                    group=np.concatenate(groups).astype(np.int32), position=np.concatenate(positions).astype(np.int32),
                    token_id=np.concatenate(tokens).astype(np.int32), phase=np.zeros(n, dtype=np.int8),
                    valid=np.ones(n, dtype=bool), group_keys=[str(g) for g in range(len(groups) + 8)])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), sequences=st.integers(1, 6), replicas=st.integers(1, 2), offset=st.integers(-2, 2))
def test_pairs_without_a_repeated_reference_row_are_the_sorted_pairs(
    data: st.DataObject, sequences: int, replicas: int, offset: int
) -> None:
    """``pair_rows``' mask path (no reference row paired twice) gives the arrays and counts of its
    general path (a sort by reference row, writer group and candidate row, duplicates and replicas
    set aside, then candidate order), on engine-ordered candidates over one or two writer groups."""
    import tracediff.compare.align.rowpairs as rowpairs
    import tracediff.compare.align.sequences as align

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lengths = [int(rng.integers(8, 40)) for _ in range(sequences)]
    ref_tokens = [rng.integers(0, 6, n) for n in lengths]
    ref = _index([np.full(n, g) for g, n in enumerate(lengths)], [np.arange(n) for n in lengths], ref_tokens, 1)
    # The candidate: each sequence (or a part of it, shifted) once per replica, rows shuffled.
    groups, positions, tokens = [], [], []
    for _ in range(replicas):
        for g, n in enumerate(lengths):
            a = int(rng.integers(0, n // 2))
            groups.append(np.full(n - a, len(groups)))
            positions.append(np.arange(a, n))
            tokens.append(ref_tokens[g][a:])
    cand = _index(groups, positions, tokens, replicas)
    shuffle = rng.permutation(len(cand))
    cand.group, cand.position, cand.token_id = cand.group[shuffle], cand.position[shuffle], cand.token_id[shuffle]
    alignment = align.align_sequences(ref, cand)
    fast = rowpairs.pair_rows(alignment, offset)
    real = rowpairs._each_once
    rowpairs._each_once = lambda *_a: False  # the general path
    try:
        general = rowpairs.pair_rows(alignment, offset)
    finally:
        rowpairs._each_once = real
    _same_pairs(fast, general)
    if replicas == 1:
        assert fast.replicas == 0 and len(fast) > 0


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 60), dtype=st.sampled_from([np.int32, np.int64]))
def test_joined_pieces_are_their_concatenation(data: st.DataObject, n: int, dtype: type) -> None:
    """``_joined``: consecutive pieces of one array joined without a copy, any other pieces (gaps,
    overlaps, out of order, of another array, of an array of another width) copied; always their
    concatenation."""
    from tracediff.compare.align.sequences import _joined

    base = np.arange(n, dtype=dtype) * 3 - 7
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=6)))
    bounds = [0, *cuts, n]
    parts = [base[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    kind = data.draw(st.sampled_from(["consecutive", "gap", "reversed", "other", "strided"]))
    if kind == "gap" and n > 2:
        parts = [base[: n // 2 - 1], base[n // 2 :]]
    elif kind == "reversed":
        parts = parts[::-1]
    elif kind == "other":
        parts = [*parts, np.arange(3, dtype=dtype)]
    elif kind == "strided":
        parts = [base[::2], base[1::2]]
    got = _joined(parts)
    assert got.dtype == dtype and got.tolist() == np.concatenate(parts).tolist()
    if kind == "consecutive":
        assert got.size == 0 or np.shares_memory(got, base)
    got_copy = np.concatenate(parts)
    assert not np.shares_memory(got_copy, base)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 80), ngram=st.integers(1, 5), piece=st.sampled_from([1, 3, 8, 1 << 16]))
def test_ngram_hashes_a_piece_at_a_time_are_every_windows_hash(data: st.DataObject, n: int, ngram: int,
                                                               piece: int) -> None:
    """``_ngram_hashes`` hashes windows a piece at a time and moves the windows that count to the
    front of its own arrays in place: the hashes, starts and sequences of the windows of ``ngram``
    consecutive positions with known tokens inside one sequence, in window order, as defined."""
    import tracediff.compare.align.sequences as align

    tokens = data.draw(hnp.arrays(np.int32, n, elements=st.integers(-1, 4)))
    positions = np.cumsum(data.draw(hnp.arrays(np.int32, n, elements=st.integers(1, 2)))).astype(np.int32)
    member = np.sort(data.draw(hnp.arrays(np.int64, n, elements=st.integers(0, 3))))
    want = []
    for i in range(n - ngram + 1):
        w = range(i, i + ngram)
        if (positions[i + ngram - 1] - positions[i] == ngram - 1 and all(tokens[k] >= 0 for k in w)
                and member[i] == member[i + ngram - 1]):
            h = 0
            for k in w:
                h = (h * 1_000_003 + int(tokens[k]) + 1) % (1 << 64)
            want.append((h, int(positions[i]), int(member[i])))
    old = align._HASH_PIECE
    align._HASH_PIECE = piece
    try:
        h, starts, owners = align._ngram_hashes(tokens, positions.copy(), ngram, member.copy())
    finally:
        align._HASH_PIECE = old
    assert list(zip(h.tolist(), starts.tolist(), owners.tolist(), strict=True)) == want


def test_a_reference_prefix_is_found_the_same_once_the_candidate_rows_are_let_go() -> None:
    """Once the pairs are made the engine side's sequence rows are let go
    (``Alignment.let_go_of_rows``): the reference-prefix finding, which reads each candidate
    sequence's first position, finds the same prefixes; the rows themselves are gone."""
    import pytest

    from tracediff.compare.align.rowpairs import pair_rows
    from tracediff.compare.align.sequences import align_sequences
    from tracediff.compare.findings.build import _reference_prefix

    rng = np.random.default_rng(11)
    lengths, cut = [30, 41, 25], [3, 3, 5]
    ref_tokens = [rng.integers(0, 50, n) for n in lengths]
    ref = _index([np.full(n, g) for g, n in enumerate(lengths)], [np.arange(n) for n in lengths], ref_tokens, 1)
    # The server never got each sequence's first tokens: its positions start at 0 after them.
    cand = _index([np.full(n - a, g) for g, (n, a) in enumerate(zip(lengths, cut, strict=True))],
                  [np.arange(n - a) for n, a in zip(lengths, cut, strict=True)],
                  [t[a:] for t, a in zip(ref_tokens, cut, strict=True)], 1)
    shuffle = rng.permutation(len(cand))
    cand.group, cand.position, cand.token_id = cand.group[shuffle], cand.position[shuffle], cand.token_id[shuffle]
    alignment = align_sequences(ref, cand)
    pairs = pair_rows(alignment, 0)
    neg = {g: d for g, d in pairs.effective_delta.items() if d < 0}
    assert sorted(neg.values()) == sorted(-a for a in cut)
    held = _reference_prefix(alignment, neg)
    alignment.let_go_of_rows()
    assert _reference_prefix(alignment, neg) == held
    assert held is not None and held["length"] == sorted(set(cut)) and held["sequences"] == len(cut)
    with pytest.raises(RuntimeError, match="let go"):
        _ = next(iter(alignment.cand_groups.values())).rows


def _same_pairs(a, b) -> None:
    for name in ("candidate", "reference"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    for name in ("offset", "unaligned", "duplicates", "replicas", "distinct_reference", "trailing", "insertions"):
        assert getattr(a, name) == getattr(b, name), name
    assert list(a.effective_delta.items()) == list(b.effective_delta.items())  # the same, in the same order
    assert [(k, v.dtype, v.tolist()) for k, v in a.prefix_rows.items()] == \
        [(k, v.dtype, v.tolist()) for k, v in b.prefix_rows.items()]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), sequences=st.integers(1, 8), replicas=st.integers(1, 2), in_order=st.booleans(),
       wide=st.booleans(), tokens=st.booleans())
def test_sequences_paired_together_are_paired_as_one_by_one(
    data: st.DataObject, sequences: int, replicas: int, in_order: bool, wide: bool, tokens: bool
) -> None:
    """``pair_rows``' batched path (sequences of one hypothesis over a reference without gaps, many at
    once) gives the pairs, counts and notes of the loop that takes each sequence on its own, under
    every label offset: candidates with extra tokens in front (prefix rows) or past the reference's
    end (trailing), shifted positions (by labels, some past every reference row), dropped rows, unknown or disagreeing tokens, shared prefixes
    (several hypotheses), references with gaps (those sequences stay on the loop), rows in order (a
    trainer's spans) or shuffled, compact or int64 positions, with or without tokens; in one batch or
    in many run on threads (their notes merged in order)."""
    import tracediff.compare.align.sequences as align
    from tracediff.compare.align.rowpairs import pair_rows

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    base = (1 << 40) if wide else 0
    dtype = np.int64 if wide else np.int32

    def index(groups, positions, toks, streams=1):
        n = sum(t.size for t in toks)
        per = -(-n // streams)
        return RowIndex(store=None, tap="fc_in", streams=[None] * streams,
                        offsets=np.minimum(np.arange(streams + 1) * per, n).astype(np.int64),
                        group=np.concatenate(groups).astype(np.int32),
                        position=np.concatenate(positions).astype(dtype), token_id=np.concatenate(toks).astype(np.int32),
                        phase=np.zeros(n, dtype=np.int8), valid=np.ones(n, dtype=bool),
                        group_keys=[str(g) for g in range(len(groups) + 8)])

    lengths = [int(rng.integers(6, 40)) for _ in range(sequences)]
    ref_tokens = [rng.integers(0, 50, n) for n in lengths]
    if sequences > 1 and rng.random() < 0.5:  # a shared prefix: the second sequence starts as the first
        k = min(lengths[0], lengths[1]) // 2
        ref_tokens[1][:k] = ref_tokens[0][:k]
    ref_pos = []
    for n in lengths:
        p = np.arange(n, dtype=np.int64) + base
        if rng.random() < 0.3:  # a gap in the reference's positions
            p[n // 2 :] += int(rng.integers(1, 4))
        ref_pos.append(p)
    ref = index([np.full(n, g) for g, n in enumerate(lengths)], ref_pos,
                ref_tokens if tokens else [np.full(n, -1) for n in lengths])
    groups, positions, toks = [], [], []
    for _ in range(replicas):
        for g, n in enumerate(lengths):
            a = int(rng.integers(0, n // 2))
            b = n - int(rng.integers(0, 3))
            t = ref_tokens[g][a:b].copy()
            p = ref_pos[g][a:b] + int(rng.integers(-3, 4))  # shifted positions
            if rng.random() < 0.15:  # far from the reference's (by labels: nothing pairs)
                p = p + 1000
            front, back = int(rng.integers(0, 3)), int(rng.integers(0, 3))
            t = np.r_[rng.integers(50, 60, front), t, rng.integers(50, 60, back)]  # extra tokens around
            p = np.r_[p[0] - np.arange(front, 0, -1), p, p[-1] + 1 + np.arange(back)]
            keep = rng.random(t.size) > 0.1  # dropped rows
            keep[: min(6, keep.size)] = True
            t, p = t[keep], p[keep]
            t[rng.random(t.size) < 0.05] = -1  # unknown tokens
            t[rng.random(t.size) < 0.05] = 7  # disagreeing ones
            groups.append(np.full(t.size, len(groups)))
            positions.append(p)
            toks.append(t if tokens else np.full(t.size, -1))
    cand = index(groups, positions, toks, replicas)
    if not in_order:
        shuffle = rng.permutation(len(cand))
        cand.group, cand.position, cand.token_id = cand.group[shuffle], cand.position[shuffle], cand.token_id[shuffle]
    alignment = align.align_sequences(ref, cand)
    import tracediff.compare.align.rowpairs as rowpairs

    default = rowpairs._BATCH_ROWS
    for batch_rows in (default, int(rng.integers(1, 24))):  # few rows a batch: many, paired on the pool's threads
        rowpairs._BATCH_ROWS = batch_rows
        try:
            for offset in (-2, -1, 0, 1, 2):
                _same_pairs(pair_rows(alignment, offset), pair_rows(alignment, offset, batched=False))
        finally:
            rowpairs._BATCH_ROWS = default


def test_the_samples_pairs_are_the_same_paired_together_or_one_by_one() -> None:
    """The shipped samples (a trainer against a server, and the reverse): the same pairs either way."""
    from tracediff.compare.align.rowpairs import pair_rows
    from tracediff.compare.align.sequences import align_sequences
    from tracediff.store import open_store

    for a, b in (("train", "server_broken"), ("server_fixed", "train")):
        alignment = align_sequences(RowIndex.load(open_store(f"samples/{a}.zarr"), "fc_in"),
                                    RowIndex.load(open_store(f"samples/{b}.zarr"), "fc_in"))
        for offset in (-2, -1, 0, 1, 2):
            _same_pairs(pair_rows(alignment, offset), pair_rows(alignment, offset, batched=False))
