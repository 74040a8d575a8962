"""The alignment's sorts: the fast paths give numpy's stable results exactly (the pairs, votes and
every report built on them depend on the order of equal keys)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tracediff.compare.align import (
    _Group,
    _groups,
    _unique_first_counts,
    _votes_alone,
    _votes_together,
    ngram_table,
    stable_argsort,
)
from tracediff.compare.rows import RowIndex, _sequence_groups, _split_samples

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


def _group(key: int, tokens: list[int], start: int) -> _Group:
    n = len(tokens)
    return _Group(key, np.arange(start, start + n, dtype=np.int32), np.array(tokens, dtype=np.int32),
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
