"""Teacher-forced multi-step drafting over one sequence, and the accuracy / accept-length numbers in
the trainers' and the engines' definitions.

Row p holds the target state of token x_p; the draft's step-0 input token there is x_{p+1} (as the
side recorded it) and its step-0 prediction is for x_{p+2}. Step k from start p reads x_{p+1+k}
(the sequence's own token: the engine's draft token whenever every earlier step was right), sits at
position p + k, and predicts x_{p+2+k}.

Definitions (``../../shared/FRAMEWORKS.md``, "Draft quality metrics"):

* ``acc[k]``: top-1 accuracy of step k over every start with a label (SpecForge's
  ``per_position_acc``, speculators' ``full_acc_k``);
* ``cond_acc[k]``: accuracy of step k over the starts whose steps 0..k-1 were all right
  (speculators' ``cond_acc_k``);
* ``accept_specforge`` = sum_k prod_{j<=k} acc[j] (SpecForge's simulated accept length, no bonus);
* ``accept_engine`` = 1 + the mean number of leading right steps per start (what engines report:
  accepted drafts + the bonus token), over starts whose K labels are all known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

BUCKETS = (0, 16, 64, 256, 1024)


@dataclass
class Tally:
    """Mergeable counts over sequences: divide at the end."""

    steps: int
    right: np.ndarray = field(default=None)  # type: ignore[assignment]  [K] right predictions per step
    known: np.ndarray = field(default=None)  # type: ignore[assignment]  [K] starts with a label per step
    leading: np.ndarray = field(default=None)  # type: ignore[assignment]  [K+1] full-window starts by leading run
    bucket_right: np.ndarray = field(default=None)  # type: ignore[assignment]
    bucket_known: np.ndarray = field(default=None)  # type: ignore[assignment]
    sequences: int = 0

    def __post_init__(self) -> None:
        k = self.steps
        self.right = np.zeros(k, np.int64) if self.right is None else self.right
        self.known = np.zeros(k, np.int64) if self.known is None else self.known
        self.leading = np.zeros(k + 1, np.int64) if self.leading is None else self.leading
        self.bucket_right = np.zeros(len(BUCKETS), np.int64) if self.bucket_right is None else self.bucket_right
        self.bucket_known = np.zeros(len(BUCKETS), np.int64) if self.bucket_known is None else self.bucket_known

    def add(self, correct: np.ndarray, known: np.ndarray, positions: np.ndarray, *, every_start: bool = False) -> None:
        """``correct``/``known`` [n, K] for the starts at ``positions``. Accept lengths count the starts
        whose K labels are all known; ``every_start`` counts every start with a step-0 label, its run
        ending where the labels do (what an engine that stopped at the end of the output accepted)."""
        self.sequences += 1
        self.right += (correct & known).sum(0)
        self.known += known.sum(0)
        full = known[:, 0] if every_start else known.all(1)
        if full.any():
            run = np.cumprod(correct[full], axis=1).sum(1)
            self.leading += np.bincount(run, minlength=self.steps + 1)
        bucket = np.searchsorted(np.asarray(BUCKETS), positions, side="right") - 1
        k0 = known[:, 0]
        self.bucket_right += np.bincount(bucket[k0], weights=correct[k0, 0], minlength=len(BUCKETS)).astype(np.int64)
        self.bucket_known += np.bincount(bucket[k0], minlength=len(BUCKETS))

    def summary(self) -> dict[str, Any]:
        acc = [float(r / n) if n else None for r, n in zip(self.right, self.known, strict=True)]
        starts = int(self.leading.sum())
        at_least = np.cumsum(self.leading[::-1])[::-1]  # starts with a leading run >= k
        cond = [float(at_least[k + 1] / at_least[k]) if at_least[k] else None for k in range(self.steps)]
        prod, specforge = 1.0, 0.0
        for a in acc:
            if a is None:
                break
            prod *= a
            specforge += prod
        runs = np.arange(self.steps + 1)
        engine = float(1 + (self.leading * runs).sum() / starts) if starts else None
        se = None
        if starts > 1:
            mean = engine - 1
            var = float((self.leading * (runs - mean) ** 2).sum() / (starts - 1))
            se = (var / starts) ** 0.5
        buckets = []
        for i, lo in enumerate(BUCKETS):
            hi = BUCKETS[i + 1] if i + 1 < len(BUCKETS) else None
            n = int(self.bucket_known[i])
            if n:
                buckets.append({"positions": f"{lo}-{hi - 1}" if hi else f"{lo}+", "rows": n,
                                "acc": float(self.bucket_right[i] / n)})
        return {"sequences": self.sequences, "starts": int(self.known[0]) if self.steps else 0,
                "full_window_starts": starts, "acc": acc, "cond_acc": cond,
                "accept_specforge": specforge if acc and acc[0] is not None else None,
                "accept_engine": engine, "accept_engine_se": se, "acc_by_position": buckets}


@torch.no_grad()
def draft_sequence(draft: Any, fc_rows: torch.Tensor, first_ids: torch.Tensor, tokens: torch.Tensor,
                   steps: int, *, raw: bool = False, score: torch.Tensor | None = None,
                   starts: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-forced ``steps``-step drafting from the rows of one sequence.

    ``fc_rows`` [n, W]: the side's fc input at positions 0..n-1; ``first_ids`` [n]: the side's step-0
    input token per row (-1 unknown); ``tokens`` [m]: the sequence's tokens x_0..x_{m-1} (labels and
    later inputs). Every row's step-0 key is computed (later rows attend to it); step 0 is scored at
    the rows ``score`` (default all) and steps >= 1 run from the rows ``starts`` (default ``score``;
    must be a subset of it). Returns (correct [n, K], known [n, K], predictions [n, K] in target ids);
    rows not run are unknown."""
    n = int(fc_rows.shape[0])
    m = int(tokens.numel())
    p = torch.arange(n)
    scored = p if score is None else score.reshape(-1).long()
    sel = scored if starts is None else starts.reshape(-1).long()
    correct = np.zeros((n, steps), dtype=bool)
    known = np.zeros((n, steps), dtype=bool)
    preds = np.full((n, steps), -1, dtype=np.int64)
    if scored.numel() == 0:
        return correct, known, preds
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    ids = torch.where(first_ids >= 0, first_ids, torch.zeros_like(first_ids)).long()
    logits, hidden = draft.step(draft.project(fc_rows, raw=raw), ids, p, keys, values, 0, query=scored)
    out_rows = scored
    for k in range(steps):
        if k > 0:
            if sel.numel() == 0:
                break
            if out_rows is not sel:
                where = torch.searchsorted(out_rows, sel)
                hidden = hidden[where]
                out_rows = sel
            at = sel + 1 + k
            usable = at < m
            ids = torch.where(usable, tokens[at.clamp(max=m - 1)], torch.zeros_like(at)).long()
            logits, hidden = draft.step(hidden, ids, sel + k, keys, values, k, starts=sel)
        else:
            usable = first_ids[scored] >= 0
        rows = out_rows
        pred = draft.to_target_ids(logits.argmax(-1))
        label_at = rows + 2 + k
        label = tokens[label_at.clamp(max=m - 1)]
        ok = (usable & (label_at < m)).numpy()
        r = rows.numpy()
        if k > 0:
            ok &= known[r, k - 1]
        known[r, k] = ok
        correct[r, k] = ok & (pred == label).numpy()
        preds[r, k] = pred.numpy()
    return correct, known, preds


__all__ = ["BUCKETS", "Tally", "draft_sequence"]
