"""The row index of one side of a compare: every committed row's labels (sequence, position, token,
next token, step, phase, valid) and where it is stored, with the rows grouped into sequences (a
packed trainer row whose positions restart is split into its samples). Built from the stores' label
arrays alone; the values are never read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.errors import UsageError
from tracediff.store import TraceStore, TraceStream
from tracediff.store.stream import compact_int

if TYPE_CHECKING:
    from tracediff.store.storeset import StoreSet

_INDEX_FIELDS = ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
_OPTIONAL_FIELDS = ("step",)  # label sets built in memory may leave these out (0 then)
_INDEX_DTYPES = {"seq": np.int64, "position": np.int64, "token_id": np.int64, "next_token_id": np.int64,
                 "step": np.int64, "phase": np.int8, "valid": np.bool_}
#: An integer column whose values all lie within +-2**28 is held as int32: a sum or difference of up
#: to eight such values (a position shifted by a delta and an offset, two sides' positions) still fits,
#: so the index's arithmetic needs no widening; keys that multiply widen to int64 themselves.
COMPACT_BOUND = 1 << 28


def compact(column: np.ndarray) -> np.ndarray:
    """An integer label column as int32 when its values lie within :data:`COMPACT_BOUND` (real
    labels: positions, token ids, steps, small sequence ids), else as int64. Half the index's memory."""
    return compact_int(column if column.dtype.kind in "iu" else column.astype(np.int64), COMPACT_BOUND)


def index_dtype(count: int) -> type:
    """The dtype of indices below ``count``: int32 when they fit."""
    return np.int32 if count < (1 << 31) else np.int64


def group_dtype(count: int) -> type:
    """The dtype of sequence group ids below ``count``: int16 for up to 32767 sequences (2 bytes an
    index entry), else :func:`index_dtype`'s. Ids are compared and used as indices, never multiplied
    in their own dtype (keys widen to int64 themselves)."""
    return np.int16 if count < (1 << 15) else index_dtype(count)


def _sequence_groups(stream: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Dense id of each row's (stream, seq) pair, and the pairs in id order. One int64 key per pair
    when the ids are small (always, for real traces); exact for any int64 ids otherwise."""
    if seq.size == 0:
        return np.empty(0, dtype=np.int64), []
    if int(stream.max()) == 0 and int(seq.min()) >= 0:
        # One stream: the sequence id alone is the key (no temporaries), in the order the general key
        # gives non-negative ids (negative ones sort after the others there: left to it).
        top = int(seq.max())
        if top < 2 * seq.size:  # dense ids (a trainer's sample numbers): ranks without a sort
            present = np.zeros(top + 1, dtype=bool)
            present[seq] = True
            rank = np.cumsum(present, dtype=np.int32) - np.int32(1)
            return rank[seq], [(0, v) for v in np.flatnonzero(present).tolist()]
        uniq, group = np.unique(seq, return_inverse=True)
        return group.astype(np.int64, copy=False).reshape(-1), [(0, v) for v in uniq.tolist()]
    if int(seq.min()) >= -(1 << 39) and int(seq.max()) < (1 << 39):
        combined = stream.astype(np.int64) * (1 << 40) + (seq.astype(np.int64) & ((1 << 40) - 1))
        uniq, group = np.unique(combined, return_inverse=True)
        pairs = []
        for u in uniq.tolist():
            s_idx, value = u >> 40, u & ((1 << 40) - 1)
            pairs.append((s_idx, value - (1 << 40) if value >= (1 << 39) else value))
        return group.astype(np.int64).reshape(-1), pairs
    uniq, group = np.unique(np.stack([stream.astype(np.int64), seq], axis=1), axis=0, return_inverse=True)
    return group.astype(np.int64).reshape(-1), [(int(a), int(b)) for a, b in uniq.tolist()]


def _split_samples(group: np.ndarray, keys: list[str], position: np.ndarray,
                   valid: np.ndarray) -> tuple[np.ndarray, list[str], int]:
    """Split every sequence whose positions restart into its samples.

    A trainer that packs several samples into one batch row (varlen / padding-free attention) hands
    a recorder the packed row as its sequence key while the positions restart at every sample; an
    engine that recomputes a preempted request restarts it too. Within one sequence, in the order
    its rows were recorded, a valid row whose position is below the previous valid row's starts a
    new sample (invalid rows, such as padding between samples, stay with the sample before them).
    Returns the new dense group of every row, their keys (``key#k`` for sample k of a split
    sequence) and how many sequences were split."""
    if group.size == 0:
        return group, keys, 0
    # Each sequence's rows in recorded order (a trainer's rows: already so).
    order = None
    if not bool((group[1:] >= group[:-1]).all()):
        # numpy's stable sort is a radix sort for 16-bit keys (1.5x faster here)
        order = np.argsort(group.astype(np.int16) if len(keys) < (1 << 15) else group, kind="stable")
    g, v = (group, valid) if order is None else (group[order], valid[order])
    starts = np.zeros(group.size, dtype=bool)
    if bool(v.all()):  # every row valid (the common case): no row to skip
        pos = position if order is None else position[order]
        starts[1:] = (g[1:] == g[:-1]) & (pos[1:] < pos[:-1])
        del pos
    else:
        vrows = np.flatnonzero(v)
        if vrows.size > 1:
            same = g[vrows[1:]] == g[vrows[:-1]]
            pos = position[vrows if order is None else order[vrows]]
            back = pos[1:] < pos[:-1]
            del pos
            starts[vrows[1:][same & back]] = True
    if not starts.any():
        return group, keys, 0
    first = np.r_[True, g[1:] != g[:-1]]
    # Sample ordinal within the sequence: restarts counted from the sequence's first row.
    count = np.cumsum(starts)
    base = np.maximum.accumulate(np.where(first, count - starts, 0))
    ordinal = count - base
    split_groups = np.unique(g[starts])
    n_samples = np.zeros(len(keys), dtype=np.int64)
    np.maximum.at(n_samples, g, ordinal)
    combined = np.empty(group.size, dtype=np.int64)
    width = int(n_samples.max()) + 1
    combined[slice(None) if order is None else order] = g.astype(np.int64) * width + ordinal
    uniq, new_group = np.unique(combined, return_inverse=True)
    new_keys = [keys[u // width] if n_samples[u // width] == 0 else f"{keys[u // width]}#{u % width}"
                for u in uniq.tolist()]
    return new_group.astype(np.int64).reshape(-1), new_keys, int(split_groups.size)


def _without_zeroed_rows(streams: Sequence[TraceStream], offsets: np.ndarray, position: np.ndarray,
                         valid: np.ndarray) -> np.ndarray:
    """``valid``, false also on the rows a stream's ``zeroed_slots`` attribute declares the engine
    zeroed (vLLM's MTP layer zeroes the embedding slot at position 0: the row is not the input a
    trainer computes, and comparing it would report the engine's design as a broken transfer)."""
    out = valid
    for i, s in enumerate(streams):
        declared = s.attrs.get("zeroed_slots") if isinstance(getattr(s, "attrs", None), Mapping) else None
        positions = sorted({int(p) for d in declared or [] if isinstance(d, Mapping)
                            for p in d.get("positions") or [] if isinstance(p, int)})
        if not positions:
            continue
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        hit = np.isin(position[lo:hi], positions)
        if hit.any():
            if out is valid:
                out = np.array(valid, dtype=np.bool_, copy=True)
            out[lo:hi] &= ~hit
    return out


def _column(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """One label column of the index from its streams' parts: integers compacted (:func:`compact`),
    the others in their index dtype."""
    if not parts:
        return np.empty(0, dtype=dtype)
    whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return compact(whole) if dtype is np.int64 else whole.astype(dtype, copy=False)


def _stream_dtype(streams: int) -> type:
    return np.int16 if streams < (1 << 15) else np.int32


def _stream_ids(offsets: np.ndarray, streams: int) -> np.ndarray:
    """Per entry, its stream: stream i holds entries ``offsets[i]..offsets[i + 1]``."""
    return np.repeat(np.arange(streams, dtype=_stream_dtype(streams)), np.diff(offsets))


def stream_names(streams: Sequence[TraceStream]) -> list[str]:
    """Each stream's name in row references: its writer, prefixed by its store's name when the
    streams come from several stores (one trace over many stores), so a row names where it lives."""
    stores: list[Any] = []
    for s in streams:
        if not any(s.store is t for t in stores):
            stores.append(s.store)
    if len(stores) < 2:
        return [s.writer for s in streams]
    short = [Path(str(t.path)).name for t in stores]
    names = short if len(set(short)) == len(short) else [str(t.path) for t in stores]
    return [f"{names[next(k for k, t in enumerate(stores) if s.store is t)]}/{s.writer}" for s in streams]


#: Label columns the compare reads once or twice after the alignment (the token pairing, the subset
#: search): not held by the index, read again from the store when asked (:meth:`RowIndex.column`).
_ASIDE_FIELDS = ("seq", "next_token_id", "step")
_HELD_FIELDS = tuple(k for k in _INDEX_FIELDS if k not in _ASIDE_FIELDS)
_LOADED_FIELDS = (*_HELD_FIELDS, "seq")  # what a load reads: the sequence ids make the groups, then are let go


def _read_label(s: TraceStream, k: str) -> np.ndarray:
    """Label column ``k`` of stream ``s``; integer columns compact as read (TraceStream.label: chunk by
    chunk, no int64 copy of a whole column)."""
    return s.label(k, COMPACT_BOUND) if _INDEX_DTYPES[k] is np.int64 else s.label(k)


@dataclass
class RowIndex:
    """Labels of every committed row of one tap, across its writer groups (one entry per row), in
    storage order: stream by stream, each stream's rows in order (the alignment relies on it: an
    entry's index orders it as (stream, row) does). Which stream and stored row an entry is are
    computed from the streams' row counts (:meth:`stream_of`, :meth:`row_of`); the labels read only
    after the alignment (sequence id, next token, step) are read again when asked
    (:meth:`column`). About 12 bytes an entry."""

    store: TraceStore | StoreSet  # a StoreSet: one trace over several stores
    tap: str
    streams: list[TraceStream]
    offsets: np.ndarray  # int64 [streams + 1]: the first entry of each stream, then the entry count
    # Integer columns are compact (:func:`compact`): int32 when their values allow, else int64.
    group: np.ndarray  # sequence group (stream, seq) -> dense id (:func:`group_dtype`)
    position: np.ndarray
    token_id: np.ndarray
    phase: np.ndarray
    valid: np.ndarray
    group_keys: list[str]
    split_sequences: int = 0  # labelled sequences whose positions restart: split into their samples
    #: Reads one of :data:`_ASIDE_FIELDS` (the store's, or the label sets the index was made of).
    _aside: Any = field(default=None, repr=False)

    @classmethod
    def load(cls, store: TraceStore | StoreSet, tap: str,
             read: Mapping[tuple[int, str], np.ndarray] | None = None) -> RowIndex:
        """The index of ``tap``'s rows. ``read``: label columns read already, by (stream, name)."""
        streams = store.tap_streams(tap)

        def aside(k: str) -> np.ndarray:
            return _column([_read_label(s, k) for s in streams], _INDEX_DTYPES[k])

        done = read or {}
        return cls.from_labels(store, tap, streams, [{k: done[(i, k)] if (i, k) in done else _read_label(s, k)
                                                      for k in _LOADED_FIELDS} for i, s in enumerate(streams)], aside)

    @staticmethod
    def light_labels(store: TraceStore | StoreSet, tap: str) -> dict[tuple[int, str], np.ndarray]:
        """The label columns of ``tap`` a :meth:`load` reads that are light
        (:attr:`TraceStream.light_labels`: read at once with others, they only hand the GIL back
        and forth), by (stream, name): for a caller that loads two indexes at once to read first,
        one after the other, and pass to :meth:`load`."""
        return {(i, k): _read_label(s, k) for i, s in enumerate(store.tap_streams(tap))
                for k in _LOADED_FIELDS if k in s.light_labels}

    @classmethod
    def from_labels(
        cls, store: TraceStore | StoreSet, tap: str, streams: Sequence[TraceStream], labels: Sequence[dict[str, np.ndarray]],
        aside: Any = None,
    ) -> RowIndex:
        """The index of label columns already read: ``labels[i]`` holds stream i's columns
        (:data:`_INDEX_FIELDS`), one entry per row. Any int64 values are accepted. ``aside(name)``
        reads a column of :data:`_ASIDE_FIELDS` later; without it, the ones given here are kept
        for :meth:`column`."""
        if len(labels) != len(streams):
            raise UsageError(f"RowIndex: {len(labels)} label sets for {len(streams)} streams")
        required = _INDEX_FIELDS if aside is None else (*_HELD_FIELDS, "seq")
        cols: dict[str, list[np.ndarray]] = {k: [] for k in required}
        counts = []
        for s, columns in zip(streams, labels, strict=True):
            missing = [k for k in required if k not in columns and k not in _OPTIONAL_FIELDS]
            if missing:
                raise UsageError(f"{store.path}/{tap}/{s.writer}: label columns {missing} are missing")
            n_rows = np.asarray(columns["seq"]).reshape(-1).shape[0]
            arrays = {k: np.asarray(columns[k]).reshape(-1) if k in columns else np.zeros(n_rows, dtype=np.int32)
                      for k in required}
            lengths = {k: a.shape[0] for k, a in arrays.items()}
            if len(set(lengths.values())) != 1:
                raise UsageError(f"{store.path}/{tap}/{s.writer}: label columns differ in length {lengths}")
            for k in required:
                cols[k].append(arrays[k])
            counts.append(lengths["seq"])
        cat: dict[str, np.ndarray] = {  # one stream's columns as they are (no copy when compact already)
            k: _column(v, _INDEX_DTYPES[k]) for k, v in cols.items()
        }
        del cols
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        # Sequence ids are per writer process: (stream, seq) is the key of a sequence.
        stream = _stream_ids(offsets, len(streams))
        group, pairs = _sequence_groups(stream, cat["seq"])
        del stream
        keys = []
        writers = stream_names(streams)
        for s_idx, seq in pairs:
            name = streams[s_idx].seq_names.get(seq, str(seq))
            keys.append(name if len(streams) == 1 else f"{writers[s_idx]}:{name}")
        cat["valid"] = _without_zeroed_rows(streams, offsets, cat["position"], cat["valid"])
        group, keys, split = _split_samples(group, keys, cat["position"], cat["valid"])
        if aside is None:
            kept = {k: cat[k] for k in _ASIDE_FIELDS}

            def aside(k: str) -> np.ndarray:
                return kept[k]

        return cls(
            store=store,
            tap=tap,
            streams=list(streams),
            offsets=offsets,
            group=group.astype(group_dtype(len(keys)), copy=False),
            position=cat["position"],
            token_id=cat["token_id"],
            phase=cat["phase"],
            valid=cat["valid"],
            group_keys=keys,
            split_sequences=split,
            _aside=aside,
        )

    def column(self, name: str) -> np.ndarray:
        """One of the labels the index does not hold (:data:`_ASIDE_FIELDS`: ``seq``,
        ``next_token_id``, ``step``), one entry per index entry, compact: read again from the store
        at each call (hold the result while it is needed)."""
        if name not in _ASIDE_FIELDS:
            raise UsageError(f"RowIndex.column: {name!r} is not one of {', '.join(_ASIDE_FIELDS)} (held as attributes)")
        out = self._aside(name)
        if out.shape[0] != len(self):
            raise UsageError(f"{self.store.path}/{self.tap}: label {name!r} holds {out.shape[0]} rows, the index {len(self)}")
        return out

    @property
    def stream(self) -> np.ndarray:
        """Per entry: which stream holds it (int16; int32 past 32767 streams). Computed at each call."""
        return _stream_ids(self.offsets, len(self.streams))

    def stream_of(self, entries: np.ndarray) -> np.ndarray:
        """Which stream holds each of ``entries`` (indices into the index), as :attr:`stream`."""
        entries = np.asarray(entries)
        dtype = _stream_dtype(len(self.streams))
        if len(self.streams) == 1:
            return np.zeros(entries.shape, dtype=dtype)
        return (np.searchsorted(self.offsets, entries, side="right") - 1).astype(dtype)

    def row_of(self, entries: np.ndarray, streams: np.ndarray | None = None) -> np.ndarray:
        """The stored row of each of ``entries`` within its stream (``streams``: their
        :meth:`stream_of`, when at hand)."""
        entries = np.asarray(entries)
        if len(self.streams) == 1:
            return entries
        return entries - self.offsets[self.stream_of(entries) if streams is None else streams]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def has_tokens(self) -> bool:
        return bool((self.token_id[self.valid] >= 0).any())
