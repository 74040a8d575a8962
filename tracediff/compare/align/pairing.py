"""Token pairing: does every aligned row feed the draft the same input token on both sides?

At the row of position ``p`` the draft reads ``fc(aux(h_p))`` together with the embedding of its
input token ``next_token_id`` = x_{p+1} (DESIGN.md §3). A server that pairs a row with another
token (chunked prefill pairing the last row of a chunk with the sampled token instead of the next
prompt token is the known case) feeds the draft a wrong input even when every hidden state is right.
Labels only: no values are read here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs
from tracediff.compare.rows.gather import in_parallel
from tracediff.compare.rows.index import RowIndex
from tracediff.store import PHASES

#: A pattern names the mismatched rows when at least this share of them has it.
PATTERN_SHARE = 0.9


@dataclass
class TokenPairing:
    """Next-token agreement over the aligned rows."""

    compared: int  # rows where both sides know the next token and both sequences go on
    mismatched: int
    unknown: int  # rows where one side (or both) does not know it (-1): not errors
    # Rows where both know it but a sequence ends at this row on one side (or both) while the
    # other may go on: a shared prefix of two samples, a row an importer dropped, a packed row's
    # next sample. The sequences diverge here; what follows is not the same data, so not compared.
    diverging: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    pattern: str | None = None  # a sentence naming the rows, when one explains them
    pattern_evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lowest(n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` entries of the lowest value of ``dtype``: the start of a per-group maximum (``ufunc.at``
    runs ~20x faster when the values are of the accumulator's own dtype)."""
    return np.full(n, np.iinfo(dtype).min, dtype=dtype)


def _last_in_step(index: RowIndex, steps: np.ndarray) -> np.ndarray:
    """Per row of ``index``: is it its sequence's last row in its step (writer, step, sequence)?
    ``steps``: the index's step column (:meth:`RowIndex.column`)."""
    n = len(index)
    if n == 0:
        return np.zeros(0, dtype=bool)
    keys = np.stack([index.group, steps, index.stream.astype(np.int64)], axis=1)
    _, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    top = _lowest(int(inverse.max()) + 1, index.position.dtype)
    np.maximum.at(top, inverse, index.position)
    return index.position == top[inverse]


def _continues(index: RowIndex) -> np.ndarray:
    """Per row: does its sequence have a later position (the row is not the sequence's last)?"""
    n = len(index)
    if n == 0:
        return np.zeros(0, dtype=bool)
    top = _lowest(int(index.group.max()) + 1, index.position.dtype)
    np.maximum.at(top, index.group, index.position)
    out = np.empty(n, dtype=bool)
    for a in range(0, n, _PAIRING_PIECE):  # a piece at a time: no whole gathered column of group ends
        np.less(index.position[a : a + _PAIRING_PIECE], top[index.group[a : a + _PAIRING_PIECE]], out=out[a : a + _PAIRING_PIECE])
    return out


def check_token_pairing(pairs: RowPairs, reference: RowIndex, candidate: RowIndex) -> TokenPairing:
    """Compare ``next_token_id`` over the aligned rows, and name the pattern of the rows that differ.

    The row right before a token insertion or deletion (``pairs.insertions``) has another next
    token by construction: it is explained by that finding and not compared here; nor is a row that
    is the last of its sequence on either side (``diverging``): its next token belongs to whatever
    follows that sequence (the end of a request, the next turn of a longer sample, the next sample
    of a packed row), which the other side need not share.
    """
    # Per side, its next tokens (read from the store again) and, for its rows, whether their
    # sequence goes on past them (only rows both sides continue past feed a next token both must
    # agree on): the two sides at once.
    (ref_col, ref_on), (cand_col, cand_on) = in_parallel(lambda: (reference.column("next_token_id"), _continues(reference)),
                                                         lambda: (candidate.column("next_token_id"), _continues(candidate)))
    edges = {(i["group"], i["position"] - 1) for i in pairs.insertions}
    bad = np.zeros(len(pairs), dtype=bool)
    compared = unknown = diverging = 0
    for a in range(0, len(pairs), _PAIRING_PIECE):  # a piece of the pairs at a time: no whole gathered columns
        r, c = pairs.reference[a : a + _PAIRING_PIECE], pairs.candidate[a : a + _PAIRING_PIECE]
        ref_next, cand_next = ref_col[r], cand_col[c]
        known = (ref_next >= 0) & (cand_next >= 0)
        if edges:
            known &= ~np.array([(int(g), int(p)) in edges for g, p in zip(candidate.group[c].tolist(),
                                                                          candidate.position[c].tolist(), strict=True)],
                               dtype=bool)
        goes_on = ref_on[r] & cand_on[c]
        agreed = known & goes_on
        compared += int(agreed.sum())
        unknown += int((~known).sum())
        diverging += int((known & ~goes_on).sum())
        np.logical_and(agreed, ref_next != cand_next, out=bad[a : a + _PAIRING_PIECE])
    del ref_on, cand_on
    result = TokenPairing(compared, int(bad.sum()), unknown, diverging)
    if not bad.any():
        return result
    rows = pairs.candidate[bad]
    steps = candidate.column("step")
    for k in np.flatnonzero(bad)[:5].tolist():
        c = int(pairs.candidate[k])
        result.examples.append({
            "seq": candidate.group_keys[int(candidate.group[c])], "position": int(candidate.position[c]),
            "token_id": int(candidate.token_id[c]), "phase": _phase(candidate.phase[c]),
            "step": int(steps[c]),
            "reference_next_token_id": int(ref_col[pairs.reference[k]]), "candidate_next_token_id": int(cand_col[c]),
        })
    del ref_col, cand_col
    result.pattern, result.pattern_evidence = _pattern(pairs, candidate, steps, bad, rows)
    return result


#: Aligned rows :func:`check_token_pairing` compares at a time.
_PAIRING_PIECE = 1 << 20


def _phase(code: Any) -> str:
    code = int(code)
    return PHASES[code] if 0 <= code < len(PHASES) else str(code)


def _pattern(pairs: RowPairs, candidate: RowIndex, steps: np.ndarray, bad: np.ndarray,
             rows: np.ndarray) -> tuple[str | None, dict]:
    last = _last_in_step(candidate, steps)
    cont = _continues(candidate)
    prefill = candidate.phase == PHASES.index("prefill") if "prefill" in PHASES else np.zeros(len(candidate), bool)
    paired = pairs.candidate
    chunk_end = last & cont & prefill  # the last row of a prefill chunk whose sequence goes on
    share = float(chunk_end[rows].mean())
    if share >= PATTERN_SHARE:
        eligible = int(chunk_end[paired].sum())
        gcd = 0
        for p in (candidate.position[rows] + 1).tolist():
            gcd = math.gcd(gcd, int(p))
        chunk = f" (position + 1 is a multiple of {gcd}: a chunk size of {gcd})" if gcd > 1 else ""
        return (f"the last row of each non-final prefill chunk{chunk}: {int(bad.sum())} of the {eligible} such rows; "
                f"the server pairs it with another token (e.g. the sampled one) instead of the next prompt token",
                {"pattern": "chunk_end", "share": share, "eligible_rows": eligible, "chunk_size": gcd or None})
    share_last = float(last[rows].mean())
    if share_last >= PATTERN_SHARE:
        return (f"the last row of a sequence in a step ({int(bad.sum())} rows)",
                {"pattern": "step_end", "share": share_last})
    phases = {_phase(p) for p in candidate.phase[rows].tolist()}
    if len(phases) == 1:
        phase = next(iter(phases))
        total = int((candidate.phase[paired] == candidate.phase[rows[0]]).sum())
        return (f"{phase} rows only ({int(bad.sum())} of {total})", {"pattern": "phase", "phase": phase})
    return None, {}


__all__ = ["TokenPairing", "check_token_pairing"]
