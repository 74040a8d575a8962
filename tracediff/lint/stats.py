"""Per-slot statistics of a stream of rows, in one pass and bounded memory.

:class:`SlotStats` takes blocks of rows ``[n, slots, H]`` (float32) with their sample ids, positions
and tokens, and keeps per slot: defect counts (all-zero, constant, non-finite rows; identical rows at
two positions of one sample with other tokens) with a few examples each, where they came from (writer
group or sample), the per-row RMS moments, the per-dimension mean square (the slot's profile: its
massive dimensions), and, given the final norm's weight, how many rows have ``rms(x / w) = 1`` (what
the final norm's output has). Memory: ``slots x H`` floats, plus 8 bytes a slot per sample (its hash,
for duplicated samples) and per sample with defects; never a row index.

Pure numpy, no framework, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Examples kept per (defect, slot).
EXAMPLES = 5
#: Log-spaced bins of |rms(x / w) - 1| (1e-6 .. 10), for the share of rows within any tolerance.
_UNIT_BINS = np.concatenate([[0.0], np.logspace(-6, 1, 71), [np.inf]])
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: Values handled at a time inside one block (its uint64 hashing temporaries: 16 bytes a value).
_STEP_VALUES = 1 << 20


def _row_hash_keys(width: int) -> np.ndarray:
    """Odd 64-bit multipliers, one per value of a row: sum(bits * key) mod 2^64 identifies a row's bytes."""
    return np.random.default_rng(0x7D1F).integers(1, 2**63, size=width, dtype=np.uint64) | np.uint64(1)


@dataclass
class SlotStats:
    """Running statistics of ``slots`` slots of ``width`` values each (see the module docstring)."""

    slots: int
    width: int
    norm_weight: np.ndarray | None = None  # the target's final norm weight [width], for the unit-RMS test
    rows: np.ndarray = field(init=False)
    counts: dict[str, np.ndarray] = field(init=False)
    examples: dict[tuple[str, int], list[dict[str, Any]]] = field(init=False)
    where: dict[tuple[str, int], dict[str, int]] = field(init=False)  # (defect, slot) -> group -> rows
    per_sample: dict[tuple[str, int], dict[int, int]] = field(init=False)  # (defect, slot) -> sample -> rows
    sample_rows: dict[int, int] = field(init=False)
    sample_hash: dict[int, np.ndarray] = field(init=False)  # sample -> [slots] uint64, order-independent
    sample_tokens: dict[int, int] = field(init=False)  # sample -> hash of its (position, token) pairs
    names: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        s = self.slots
        self.rows = np.zeros(s, dtype=np.int64)
        self.counts = {k: np.zeros(s, dtype=np.int64) for k in ("zero", "constant", "nonfinite", "duplicate")}
        self.examples = defaultdict(list)
        self.where = defaultdict(lambda: defaultdict(int))
        self.per_sample = defaultdict(lambda: defaultdict(int))
        self.sample_rows = defaultdict(int)
        self.sample_hash = {}
        self.sample_tokens = defaultdict(int)
        self.names = {}
        self.group_rows: dict[str, int] = defaultdict(int)
        self.good = np.zeros(s, dtype=np.int64)  # rows with data: finite, not zero, not constant
        self.rms_sum = np.zeros(s)
        self.rms_sq = np.zeros(s)
        self.dim_sq = np.zeros((s, self.width))
        self.unit_hist = np.zeros((s, len(_UNIT_BINS) - 1), dtype=np.int64)
        self._keys = _row_hash_keys(self.width)
        if self.norm_weight is not None:
            w = np.asarray(self.norm_weight, dtype=np.float32).reshape(-1)
            self._inv_w = np.where(w != 0, 1.0 / np.where(w != 0, w, 1), 0).astype(np.float32)
            self._inv_n = 1.0 / max(int((w != 0).sum()), 1)

    # ---------------------------------------------------------------------------------------- adding
    def add(self, values: np.ndarray, seq: np.ndarray, position: np.ndarray, token: np.ndarray, group: str,
            names: dict[int, str] | None = None) -> None:
        """One block of rows: ``values`` [n, slots, width] float32, labels [n] each; ``group`` names
        where they came from (a writer group, a file); ``names`` sample id -> display name."""
        n = values.shape[0]
        if n == 0:
            return
        if names:
            self.names.update(names)
        self.rows += n
        self.group_rows[group] += n
        masks = np.empty((4, n, self.slots), dtype=bool)  # finite, zero, constant, good
        hashes = np.empty((n, self.slots), dtype=np.uint64)
        step = max(1, _STEP_VALUES // max(self.slots * self.width, 1))
        for a in range(0, n, step):  # the temporaries of a step stay near _STEP_VALUES values
            self._add_step(values[a : a + step], masks[:, a : a + step], hashes[a : a + step])
        finite, zero, constant, good = masks
        for kind, mask in (("zero", zero), ("constant", constant), ("nonfinite", ~finite)):
            self._note(kind, mask, seq, position, group)
        self._samples(hashes, seq, position, token)
        self._duplicates(hashes, good, seq, position, token, group)

    def _add_step(self, values: np.ndarray, masks: np.ndarray, hashes: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=np.float32)
        # Two passes screen every row (its sum and its sum of squares); the exact tests run only on
        # the rows they flag: a non-finite sum (any NaN or Inf), no energy (zeros, or values so small
        # their squares underflow), or a variance within float32 rounding of zero (a constant row).
        sq = np.einsum("nsh,nsh->ns", values, values).astype(np.float64)
        total = values.sum(axis=2, dtype=np.float64)
        mean = total / self.width
        var = sq / self.width - mean**2
        flagged = ~np.isfinite(sq) | ~np.isfinite(total) | (sq == 0) | (var <= 1e-6 * np.abs(sq / self.width))
        finite = np.ones(flagged.shape, dtype=bool)
        zero = np.zeros(flagged.shape, dtype=bool)
        constant = np.zeros(flagged.shape, dtype=bool)
        if flagged.any():
            rows, slots = np.nonzero(flagged)
            v = values[rows, slots]
            f = np.isfinite(v).all(axis=1)
            hi, lo = v.max(axis=1), v.min(axis=1)
            finite[rows, slots] = f
            zero[rows, slots] = f & (hi == 0) & (lo == 0)
            constant[rows, slots] = f & (hi == lo) & ~((hi == 0) & (lo == 0))
        good = finite & ~zero & ~constant
        masks[0], masks[1], masks[2], masks[3] = finite, zero, constant, good
        hashes[:] = self._hash(values)
        clean = values if good.all() else np.where(good[:, :, None], values, np.float32(0))
        ms = np.where(good, sq, 0.0) / self.width
        self.good += good.sum(axis=0)
        self.rms_sum += np.sqrt(ms).sum(axis=0)
        self.rms_sq += ms.sum(axis=0)
        self.dim_sq += np.einsum("nsh,nsh->sh", clean, clean).astype(np.float64)
        if self.norm_weight is not None:
            scaled = clean * self._inv_w
            r = np.sqrt(np.einsum("nsh,nsh->ns", scaled, scaled).astype(np.float64) * self._inv_n)
            dev = np.abs(r - 1.0)
            for s in range(self.slots):
                self.unit_hist[s] += np.histogram(dev[good[:, s], s], bins=_UNIT_BINS)[0]

    def _hash(self, values: np.ndarray) -> np.ndarray:
        """[n, slots] uint64: sum(word * key) mod 2^64 over each row's bytes read as 64-bit words (two
        float32 values a word; an odd width's last value alone)."""
        n, s, h = values.shape
        bits = values.view(np.uint32)
        if h % 2:
            tail = bits[:, :, -1].astype(np.uint64) * self._keys[-1]
            bits = np.ascontiguousarray(bits[:, :, :-1])
        else:
            tail = np.uint64(0)
        words = bits.view(np.uint64)
        return (words * self._keys[: words.shape[2]]).sum(axis=2, dtype=np.uint64) + tail

    def _note(self, kind: str, mask: np.ndarray, seq: np.ndarray, position: np.ndarray, group: str) -> None:
        hit = mask.sum(axis=0)
        if not hit.any():
            return
        self.counts[kind] += hit
        for s in np.flatnonzero(hit):
            rows = np.flatnonzero(mask[:, s])
            self.where[(kind, int(s))][group] += len(rows)
            ids, per = np.unique(seq[rows], return_counts=True)
            book = self.per_sample[(kind, int(s))]
            for i, c in zip(ids.tolist(), per.tolist(), strict=True):
                book[i] += c
            room = EXAMPLES - len(self.examples[(kind, int(s))])
            for r in rows[: max(room, 0)]:
                self.examples[(kind, int(s))].append(
                    {"sample": int(seq[r]), "position": int(position[r]), "group": group})

    def _samples(self, hashes: np.ndarray, seq: np.ndarray, position: np.ndarray, token: np.ndarray) -> None:
        """Order-independent per-sample hashes: sum over rows of row hash x odd(position)."""
        ids, inverse, per = np.unique(seq, return_inverse=True, return_counts=True)
        odd = (position.astype(np.uint64) * _GOLDEN) | np.uint64(1)
        contrib = hashes * odd[:, None]
        acc = np.zeros((len(ids), self.slots), dtype=np.uint64)
        np.add.at(acc, inverse, contrib)
        tok = np.zeros(len(ids), dtype=np.uint64)
        np.add.at(tok, inverse, (token.astype(np.uint64) + np.uint64(1)) * odd)
        for i, sid in enumerate(ids.tolist()):
            if sid in self.sample_hash:
                self.sample_hash[sid] = self.sample_hash[sid] + acc[i]
            else:
                self.sample_hash[sid] = acc[i].copy()
            self.sample_tokens[sid] = int(np.uint64(self.sample_tokens[sid]) + tok[i])
            self.sample_rows[sid] += int(per[i])

    def _duplicates(self, hashes: np.ndarray, good: np.ndarray, seq: np.ndarray, position: np.ndarray,
                    token: np.ndarray, group: str) -> None:
        """Rows of one sample (within this block) identical to another of its rows of another token (or
        an unknown one): an embedding slot repeats a token's row, no slot repeats another token's."""
        mask = np.zeros_like(good)
        for s in range(self.slots):
            rows = np.flatnonzero(good[:, s])
            if len(rows) < 2:
                continue
            order = rows[np.lexsort((hashes[rows, s], seq[rows]))]
            same = (seq[order][1:] == seq[order][:-1]) & (hashes[order, s][1:] == hashes[order, s][:-1])
            if not same.any():
                continue
            # Each run of equal (sample, hash): the rows whose token differs from the run's first row.
            start = np.concatenate([[True], ~same])
            first = order[np.maximum.accumulate(np.where(start, np.arange(len(order)), 0))]
            tok, tok_first = token[order], token[first]
            dup = ~start & ((tok != tok_first) | (tok < 0))
            mask[order[dup], s] = True
        self._note("duplicate", mask, seq, position, group)

    # -------------------------------------------------------------------------------------- results
    def dim_rms(self) -> np.ndarray:
        """[slots, width] RMS of each dimension over the rows with data."""
        return np.sqrt(self.dim_sq / np.maximum(self.good, 1)[:, None])

    def rms_moments(self, s: int) -> tuple[float | None, float | None]:
        n = int(self.good[s])
        if n == 0:
            return None, None
        mean = self.rms_sum[s] / n
        var = max(self.rms_sq[s] / n - mean**2, 0.0)
        return float(mean), float(np.sqrt(var) / mean) if mean > 0 else None

    def unit_share(self, s: int, tolerance: float) -> float | None:
        """Share of slot ``s``'s rows with data whose |rms(x / w) - 1| < ``tolerance`` (None: no weight)."""
        if self.norm_weight is None or self.good[s] == 0:
            return None
        edges = _UNIT_BINS[1:]
        return float(self.unit_hist[s][edges <= tolerance * 1.0001].sum() / self.good[s])


def massive_dimensions(dim_rms: np.ndarray, ratio: float) -> tuple[list[int], float | None]:
    """Dimensions whose RMS is at least ``ratio`` x the median dimension's, and the largest ratio."""
    positive = dim_rms[dim_rms > 0]
    if positive.size == 0:
        return [], None
    median = float(np.median(positive))
    if median <= 0:
        return [], None
    return np.flatnonzero(dim_rms >= ratio * median).tolist(), float(dim_rms.max() / median)


def profile_distance(a: np.ndarray, b: np.ndarray) -> float:
    """RMS of the log ratio of two per-dimension RMS profiles (level and shape): 0 for the same state."""
    keep = (a > 0) & (b > 0)
    if not keep.any():
        return float("inf")
    return float(np.sqrt(np.mean((np.log(a[keep]) - np.log(b[keep])) ** 2)))


__all__ = ["EXAMPLES", "SlotStats", "massive_dimensions", "profile_distance"]
