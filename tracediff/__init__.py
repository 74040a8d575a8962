"""tracediff: record the fc-input rows an EAGLE-3 draft sees in training and in serving, and say
exactly how they differ.

Public API::

    with tracediff.record("train.zarr", role="trainer") as rec:
        rec.tap(draft.fc, name="fc_in", capture="input", segment_size=H)
        rec.labels(seq=..., position=..., token_id=...)   # optional, per step
        ...

    store = tracediff.open_store("train.zarr")
    values = tracediff.open_values("train.zarr", tap="fc_in")   # dask float32 [rows, width]
    labels = tracediff.open_labels("train.zarr", tap="fc_in")   # numpy, the same rows

Importing this package is cheap (no torch, no numpy) because the injected start-up shim imports it
in every Python process of a recorded command.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``tracediff.record`` is the recording package (:mod:`tracediff.record`), callable as the
    function it always was: ``with tracediff.record("train.zarr", role="trainer") as rec``. Imported
    on first use, so that importing tracediff stays cheap."""
    if name in ("record", "compare"):
        import importlib  # noqa: PLC0415

        return importlib.import_module(f"tracediff.{name}")
    raise AttributeError(f"module 'tracediff' has no attribute {name!r}")


def calibrate(store: Any, model: Any, **kwargs: Any) -> Any:
    """Append calibration rows to a trainer's store: some of its sequences recomputed by ``model``
    (the target, the trainer's weights) in the server's compute dtype (``dtype="bfloat16"``), so that
    compare measures the drift of a correct low-precision run instead of assuming it
    (:func:`tracediff.record.calibration.calibrate`)."""
    from tracediff.record.calibration import calibrate as _calibrate  # noqa: PLC0415

    return _calibrate(store, model, **kwargs)


def open_store(path: Any, storage_options: dict[str, Any] | None = None) -> Any:
    """Open a trace store for reading (:class:`tracediff.store.TraceStore`): a folder, a ``.zarr.zip``
    file or an fsspec URL (``s3://bucket/train.zarr``; ``storage_options`` go to fsspec)."""
    from tracediff.store import TraceStore  # noqa: PLC0415

    return TraceStore(path, storage_options)


def open_values(store: Any, tap: str = "fc_in", writer: str | None = None, *, block_rows: int | None = None) -> Any:
    """The committed rows of a tap as a lazy float32 dask array (:func:`tracediff.interop.open_values`;
    needs dask: ``pip install 'tracediff[dask]'``)."""
    from tracediff.interop import open_values as _open_values  # noqa: PLC0415

    return _open_values(store, tap, writer, block_rows=block_rows)


def open_labels(store: Any, tap: str = "fc_in", writer: str | None = None) -> Any:
    """The labels of the rows :func:`open_values` returns, as numpy (:func:`tracediff.interop.open_labels`)."""
    from tracediff.interop import open_labels as _open_labels  # noqa: PLC0415

    return _open_labels(store, tap, writer)


def sampled(token_ids: Any, rate: float) -> bool:
    """Whether ``record --sample-requests rate`` keeps the request (or trainer sample) whose prompt is
    ``token_ids``: sha256 of the ids as little-endian int64, first 8 bytes as a big-endian integer,
    divided by 2**64, below ``rate`` (:func:`tracediff.record.sampling.sampled`). Run it on the
    dataset side to pick the prompts a sampled server recording holds."""
    from tracediff.record.sampling import sampled as _sampled  # noqa: PLC0415

    return _sampled(token_ids, rate)


def current() -> Any:
    """The recorder active in this process (in-process or injected by `tracediff record`), or None."""
    import sys  # noqa: PLC0415

    if "tracediff.record.recorder" not in sys.modules:
        return None
    return sys.modules["tracediff.record.recorder"].active_recorder()


def labels(**fields: Any) -> None:
    """Give the labels (seq, position, token_id, next_token_id, phase, step, valid) of the next
    capture in this thread. A no-op when nothing records, so scripts may call it unconditionally."""
    rec = current()
    if rec is not None:
        rec.labels(**fields)


__all__ = ["__version__", "calibrate", "current", "labels", "open_labels", "open_store", "open_values", "record", "sampled"]
