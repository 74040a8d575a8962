"""Wide-row traces for tests of the streaming pass (tests/test_pass_parts.py, tests/test_compare_dask.py):
rows of 3 x 1024 bf16 (6 KiB a side, so the pass reads and measures them a part at a time), a
trainer-ordered reference and an engine-ordered candidate in two writer streams."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracediff.store import TraceWriter, create_store
from tracediff.store import encode_bfloat16 as bf16  # float32 -> bf16 bits (round to nearest even)

WIDTH, SEGMENT = 3 * 1024, 1024  # bf16: 6 KiB a row a side


def write_wide_traces(root: Path, seed: int = 0, many_odd: bool = False) -> tuple[Path, Path]:
    """A trainer-ordered reference (one writer) and an engine-ordered candidate (prefill chunks and
    decode steps of many sequences interleaved, split over two writer streams): the candidate's
    values are the reference's with bf16-sized noise, a few dimensions massive; some candidate rows
    hold NaN or Inf, some are scaled to norms too small for the closed forms (measured value by value).
    ``many_odd``: whole sequences so (and others to norms too large), more such rows in a block than
    its raw buffers hold."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 120, size=14)
    seqs = [(s, np.arange(int(n))) for s, n in enumerate(lengths)]
    tokens = {s: rng.integers(0, 50_000, size=int(n)) for s, n in enumerate(lengths)}
    scale = np.ones(WIDTH, np.float32)
    scale[rng.choice(WIDTH, 6, replace=False)] = 400.0  # massive activations
    base = {s: (rng.standard_normal((int(n), WIDTH)) * scale).astype(np.float32) for s, n in enumerate(lengths)}
    if many_odd:  # sequences 5-7 huge on both sides: finite values whose norms float32 cannot hold
        for s in (5, 6, 7):
            base[s] *= np.float32(1e20)

    def labels(parts):
        seq = np.concatenate([np.full(p.size, s, dtype=np.int64) for s, p in parts])
        pos = np.concatenate([p for _, p in parts])
        tok = np.concatenate([tokens[s][p] for s, p in parts])
        return {"seq": seq, "position": pos, "token_id": tok}

    ref, cand = root / "ref.zarr", root / "cand.zarr"
    create_store(ref, role="trainer", meta={"hidden_size": SEGMENT})
    w = TraceWriter(ref, "fc_in", "rank0", width=WIDTH, dtype="bfloat16", chunk_rows=64, compressor="none",
                    attrs={"segment_size": SEGMENT})
    for s, p in seqs:
        w.append(bf16(base[s][p]), labels([(s, p)]))
    w.close()

    # Engine order: each sequence's prefill in chunks, then decode rows, all interleaved.
    pending = {s: 0 for s, _ in seqs}
    steps = []
    while pending:
        batch = []
        for s in rng.permutation(list(pending)).tolist()[:5]:
            at = pending[s]
            step = int(rng.integers(8, 40)) if at == 0 else 1
            batch.append((s, np.arange(at, min(at + step, int(lengths[s])))))
            pending[s] = at + step
            if pending[s] >= lengths[s]:
                del pending[s]
        steps.append(batch)
    create_store(cand, role="server", meta={"hidden_size": SEGMENT})
    writers = [TraceWriter(cand, "fc_in", f"rank{r}", width=WIDTH, dtype="bfloat16", chunk_rows=48, compressor="none",
                           attrs={"segment_size": SEGMENT}) for r in range(2)]
    for k, batch in enumerate(steps):
        values = np.concatenate([base[s][p] for s, p in batch])
        values = values * (1 + np.float32(2.0**-8) * rng.standard_normal(values.shape).astype(np.float32))
        if k in (3, 17):
            values[0, 5] = np.nan if k == 3 else np.inf
        if k in (9, 25):
            values[-1] *= np.float32(1e-19)  # norms under the closed forms' range
        if many_odd:  # every row of sequences 2-4 with a non-finite value, of 8-9 tiny
            seq = np.concatenate([np.full(p.size, s) for s, p in batch])
            values[(seq >= 2) & (seq <= 4), 5] = np.nan
            values[(seq >= 8) & (seq <= 9)] *= np.float32(1e-19)
        writers[k % 2].append(bf16(values), labels(batch))
    for w in writers:
        w.close()
    return ref, cand


