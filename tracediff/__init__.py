"""tracediff: record the fc-input rows an EAGLE-3 draft sees in training and in serving, and say
exactly how they differ.

Public API::

    with tracediff.record("train.zarr", role="trainer") as rec:
        rec.tap(draft.fc, name="fc_in", capture="input", segment_size=H)
        ...

    store = tracediff.open_store("train.zarr")
"""

from __future__ import annotations

__version__ = "0.1.0"

from tracediff.errors import TracediffError  # noqa: E402
from tracediff.store import TraceStore, open_store  # noqa: E402


def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    """Start a :class:`tracediff.recorder.Recorder` (see its docstring); use as a context manager."""
    from tracediff.recorder import Recorder  # noqa: PLC0415  (keeps `import tracediff` torch-free)

    return Recorder(*args, **kwargs)


def current():  # noqa: ANN201
    """The recorder active in this process (in-process or injected by `tracediff record`), or None."""
    from tracediff.recorder import active_recorder  # noqa: PLC0415

    return active_recorder()


def labels(**fields):  # noqa: ANN003, ANN201
    """Give the labels (seq, position, token_id, next_token_id, phase, step) for the next capture in
    this thread. A no-op when nothing records, so scripts may call it unconditionally."""
    rec = current()
    if rec is not None:
        rec.labels(**fields)


__all__ = ["TraceStore", "TracediffError", "__version__", "current", "labels", "open_store", "record"]
