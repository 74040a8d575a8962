"""The light lint `record` and `import` run as they write: per segment, how many rows are all zeros.

A slot that is all zeros for many rows (vLLM's hidden-state extraction reading unwritten blocks, vllm
#46301) trains a draft that validates fine and accepts nothing (speculators #613); counting it while
the rows are written costs one comparison per value, off the forward path, and turns it into a
warning in the end-of-run summary instead of a surprise a week later. The full checks are
`tracediff lint` (:mod:`tracediff.lint`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def zero_rows(values: np.ndarray, segment_size: int | None) -> list[int]:
    """Per segment of ``values`` [rows, width] (stored form: bf16 as uint16 bits, else floats), the
    rows whose segment is all zeros (+0 or -0). One segment when ``segment_size`` is unknown."""
    rows, width = values.shape
    size = segment_size if segment_size and width % segment_size == 0 else width
    if rows == 0 or width == 0:
        return [0] * (width // size if size else 1)
    # bf16 bits: zero whatever the sign bit
    zero = (values & np.uint16(0x7FFF)) == 0 if values.dtype == np.uint16 else values == 0
    return zero.reshape(rows, width // size, size).all(axis=2).sum(axis=0).tolist()


def zero_row_warnings(where: str, counts: Sequence[int], rows: int, labels: Sequence[str] | None) -> list[str]:
    """One sentence per segment with all-zero rows, naming ``where`` (a writer group) and the segment."""
    out = []
    for i, n in enumerate(counts):
        if n:
            name = f"segment {i} ({labels[i]})" if labels and i < len(labels) else f"segment {i}"
            out.append(f"{where}: {name}: {n} of {rows} rows are all zeros (a slot the producer never filled?); "
                       f"check the data with tracediff lint")
    return out


__all__ = ["zero_row_warnings", "zero_rows"]
