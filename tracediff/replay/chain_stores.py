"""The two trace stores `replay --against-chain` hands to compare's chain walk: the replayed chain,
and a copy of the server's, both labelled so that a replayed row pairs with the server's row of the
same (sequence, position, input token).

Compare aligns rows by token content (n-grams of consecutive positions). A step k >= 1 of a server
is one row per drafter call (position p + k from the call's last row p): its positions are sparse
and no n-gram of them exists, so those rows would pair with nothing. In both copies each step-k row
therefore gets, for its (sequence, position, token) triple, a dense position (its rank among the
server's rows of that step in that sequence) and a token id unique to the triple: content alignment
then pairs exactly the rows of the same triple, and nothing else. Step 0 and the fc input keep their
recorded labels. Values are copied bit for bit (a bf16 store stays bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.store import create_store
from tracediff.store.writer import TraceWriter

#: Writer-group attributes the writer sets itself (never copied from the server's tap).
OWN_ATTRS = ("tap", "dtype", "width", "commit")
Taps = dict[tuple[int, int], tuple[str, dict[str, Any]]]


@dataclass
class TapRows:
    """One tap's rows gathered in blocks: values in the store dtype ``dtype``, labels with the
    sequence key as a string (``seq``) and position, token_id, next_token_id, phase, step arrays."""

    dtype: str = "float32"
    values: list[np.ndarray] = field(default_factory=list)
    labels: list[dict[str, Any]] = field(default_factory=list)

    def add(self, values: np.ndarray, labels: dict[str, Any]) -> None:
        if values.shape[0]:
            self.values.append(values)
            self.labels.append(labels)

    @property
    def rows(self) -> int:
        return sum(v.shape[0] for v in self.values)


def server_rows(store: Any, taps: Taps, sequences: set[str] | None = None) -> dict[str, TapRows]:
    """Every chain tap of the server (the fc input too), its valid rows as recorded (of ``sequences``
    only, when given)."""
    out: dict[str, TapRows] = {}
    for tap, _chain in taps.values():
        for stream in store.tap_streams(tap):
            if not stream.rows:
                continue
            rows = out.setdefault(tap, TapRows(stream.dtype))
            if stream.dtype != rows.dtype:
                rows.dtype = "float32"  # writers of two dtypes: decoded alike (never in one recording)
            labels = stream.labels()
            keep = np.flatnonzero(labels["valid"].astype(bool))
            names = stream.seq_names
            values = stream.read()[keep]
            if rows.dtype == "float32" and stream.dtype != "float32":
                from tracediff.store import decode_values  # noqa: PLC0415

                values = decode_values(values, stream.dtype)
            block = {name: labels[name][keep] for name in ("position", "token_id", "next_token_id", "phase", "step")}
            block["seq"] = np.array([names.get(int(c), str(int(c))) for c in labels["seq"][keep]], dtype=object)
            if sequences is not None:
                mine = np.array([str(k) in sequences for k in block["seq"]], dtype=bool)
                values, block = values[mine], {name: column[mine] for name, column in block.items()}
            rows.add(values, block)
    return out


def pairing_keys(served: dict[str, TapRows], taps: Taps) -> dict[tuple[int, str, int, int], tuple[int, int]]:
    """(step, sequence, position, token) of every server row of a step k >= 1 -> (dense position,
    unique token id): the labels both copies carry for that row (see the module docstring)."""
    triples: set[tuple[int, str, int, int]] = set()
    for (step, _order), (tap, _chain) in taps.items():
        if step < 1 or tap not in served:
            continue
        for block in served[tap].labels:
            triples.update((step, str(s), int(p), int(t)) for s, p, t in
                           zip(block["seq"], block["position"], block["token_id"], strict=True))
    out: dict[tuple[int, str, int, int], tuple[int, int]] = {}
    rank: dict[tuple[int, str], int] = {}
    for uid, key in enumerate(sorted(triples)):
        at = rank.get(key[:2], 0)
        out[key] = (at, uid)
        rank[key[:2]] = at + 1
    return out


def write_store(path: Path, store: Any, taps: Taps, rows: dict[str, TapRows], role: str,
                keys: dict[tuple[int, str, int, int], tuple[int, int]], attrs: dict[str, dict[str, Any]] | None = None) -> None:
    """``rows`` as a trace store at ``path``: the server's meta, each tap with the server's attributes
    (updated by ``attrs[tap]``), step k >= 1 rows under their pairing labels ``keys``."""
    create_store(path, role=role, meta=dict(store.meta), source={"role": role, "framework": "tracediff replay"})
    step_of = {tap: step for (step, _order), (tap, _chain) in taps.items()}
    for tap, tap_rows in rows.items():
        if not tap_rows.rows:
            continue
        tap_attrs = {k: v for k, v in store.tap_streams(tap)[0].attrs.items() if k not in OWN_ATTRS}
        tap_attrs.update((attrs or {}).get(tap, {}))
        values = np.concatenate(tap_rows.values)
        writer = TraceWriter(path, tap, role, width=int(values.shape[1]), dtype=tap_rows.dtype, attrs=tap_attrs)
        try:
            columns: dict[str, list[np.ndarray]] = {}
            for block in tap_rows.labels:
                n = len(block["position"])
                seq = np.broadcast_to(np.asarray(block["seq"], dtype=object), (n,))
                labels = {name: np.asarray(block[name]).astype(np.int64) for name in
                          ("position", "token_id", "next_token_id", "phase", "step")}
                step = step_of.get(tap, 0)
                if step >= 1:
                    dense = [keys[(step, str(s), int(p), int(t))] for s, p, t in
                             zip(seq, labels["position"], labels["token_id"], strict=True)]
                    labels["position"] = np.array([d[0] for d in dense], dtype=np.int64)
                    labels["token_id"] = np.array([d[1] for d in dense], dtype=np.int64)
                    labels["next_token_id"] = np.full(n, -1, dtype=np.int64)
                labels["seq"] = np.array([writer.seq_id(str(s)) for s in seq], dtype=np.int64)
                for name, column in labels.items():
                    columns.setdefault(name, []).append(column)
            joined = {name: np.concatenate(parts) for name, parts in columns.items()}
            joined["valid"] = np.ones(values.shape[0], dtype=bool)
            writer.append(values, joined)
        finally:
            writer.close()


__all__ = ["OWN_ATTRS", "TapRows", "pairing_keys", "server_rows", "write_store"]
