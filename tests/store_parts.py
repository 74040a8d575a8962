"""Split one recorded trace over several stores, as several record processes (one per node or
replica) would have written it: the real TraceWriter, the same writer groups, rows in their order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tracediff.store import TraceWriter, create_store, open_store

Transform = Callable[[int, np.ndarray], np.ndarray]  # (part, stored rows) -> stored rows


def split_store(src: Path, dests: Sequence[Path], tap: str = "fc_in", transform: Transform | None = None) -> list[Path]:
    """Write ``src``'s ``tap`` rows into ``dests``: sequence ``s`` of each writer group goes to
    store ``s % len(dests)``; root meta and source are copied. ``transform`` may change a part's
    stored values (a replica that captured something else)."""
    store = open_store(src)
    try:
        for dest in dests:
            create_store(dest, role=str(store.source.get("role", "")), meta=store.meta, source=store.source)
        for st in store.tap_streams(tap):
            values, labels = st.read(), st.labels()
            attrs = {k: v for k, v in st.attrs.items() if k not in ("commit", "tap", "dtype", "width")}
            part = labels["seq"] % len(dests)
            for i, dest in enumerate(dests):
                keep = part == i
                rows = values[keep]
                if transform is not None:
                    rows = transform(i, rows.copy())
                writer = TraceWriter(dest, tap, st.writer, width=st.width, dtype=st.dtype, attrs=attrs,
                                     chunk_rows=st.chunk_rows, compressor="none")
                writer.append(rows, {k: a[keep] for k, a in labels.items()})
                writer.close()
    finally:
        store.close()
    return list(dests)
