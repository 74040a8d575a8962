"""One side's recorded sequences, as replay needs them: per sequence key, the valid rows in position
order (one per position), their fc input values and the draft's input tokens.

A server store holds a request's prompt rows, then the valid verify rows of each decode step (one
per generated position), plus rejected drafts (``valid`` false) and repeated positions: the first
valid row of each position is kept. A sequence is replayed over the positions 0..n-1 it covers
without a gap (the draft attends to every earlier position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.store import TraceStore, decode_values


@dataclass
class SideSequence:
    key: str
    positions: np.ndarray  # 0..n-1
    token_id: np.ndarray  # x_p
    next_token_id: np.ndarray  # the draft's input token x_{p+1} (-1 unknown)
    phase: np.ndarray
    step: np.ndarray
    writer: str
    rows: np.ndarray  # row indices in that writer's stream

    @property
    def length(self) -> int:
        return int(self.positions.size)


class SideRows:
    """The sequences of one store's tap, by key (labels only until :meth:`values` reads a sequence)."""

    def __init__(self, store: TraceStore, tap: str) -> None:
        self.store, self.tap = store, tap
        self.sequences: dict[str, SideSequence] = {}
        self.gaps: dict[str, int] = {}  # key -> first missing position (sequences cut there)
        self._streams = {s.writer: s for s in store.tap_streams(tap)}
        for stream in self._streams.values():
            if not stream.rows:
                continue
            labels = stream.labels()
            names = stream.seq_names
            valid = labels["valid"].astype(bool) & (labels["seq"] >= 0) & (labels["position"] >= 0)
            order = np.lexsort((np.arange(stream.rows), labels["position"], labels["seq"]))
            order = order[valid[order]]
            seqs = labels["seq"][order]
            for code in np.unique(seqs):
                idx = order[seqs == code]
                pos = labels["position"][idx]
                keep = np.concatenate([[True], pos[1:] != pos[:-1]])
                idx, pos = idx[keep], pos[keep]
                key = names.get(int(code), str(int(code)))
                if key in self.sequences:
                    continue  # a replicated writer (another TP rank) of the same request
                n = int(np.argmax(pos != np.arange(pos.size))) if (pos != np.arange(pos.size)).any() else pos.size
                if n < pos.size:
                    self.gaps[key] = n
                if n == 0:
                    continue
                idx = idx[:n]
                self.sequences[key] = SideSequence(
                    key=key, positions=pos[:n], token_id=labels["token_id"][idx],
                    next_token_id=labels["next_token_id"][idx], phase=labels["phase"][idx],
                    step=labels["step"][idx], writer=stream.writer, rows=idx)

    def values(self, seq: SideSequence) -> np.ndarray:
        """float32 rows of one sequence, in position order."""
        stream = self._streams[seq.writer]
        order = np.argsort(seq.rows, kind="stable")
        raw = stream.take(seq.rows[order])
        out = np.empty((seq.rows.size, stream.width), dtype=np.float32)
        out[order] = decode_values(raw, stream.dtype)
        return out

    @property
    def width(self) -> int:
        return next(iter(self._streams.values())).width

    def engine_starts(self, seq: SideSequence) -> np.ndarray:
        """Positions the engine drafted from: the last valid row of each drafter call of this request
        (its ``next_token_id`` is the token the engine had just sampled), bar the last call (its drafts
        were never verified). Server stores only (``step`` labels per drafter call)."""
        if seq.length == 0:
            return np.empty(0, dtype=np.int64)
        steps = seq.step
        last = np.flatnonzero(np.concatenate([steps[1:] != steps[:-1], [True]]))
        return seq.positions[last[:-1]]
