"""The recording side: what runs inside a trainer or a server and writes its fc-input rows to a store.

* :mod:`tracediff.record.recorder`: the :class:`~tracediff.record.recorder.Recorder` (forward hooks,
  the capture path, the bounded queue and the writer thread, its outcome);
* :mod:`tracediff.record.tapspec`: ``--tap CLASS.ATTR:input|output`` specifications;
* :mod:`tracediff.record.inject`: ``tracediff record -- CMD`` (the start-up shim's side: environment,
  child processes, their reports);
* :mod:`tracediff.record.limits`: the recorder's bounds (queue bytes, rows, disk);
* :mod:`tracediff.record.switch`: recording switched off and on at runtime (rows skipped, the history);
  :mod:`tracediff.record.control` its controls (the 127.0.0.1 endpoint, SIGUSR1/SIGUSR2, ``--start-off``,
  and the client of ``tracediff control``);
* :mod:`tracediff.record.cores`: the recorder's threads placed off the cores the engine pinned;
* :mod:`tracediff.record.calibration`: calibration rows recomputed by the target in the server's
  compute dtype (``tracediff calibrate``).

Framework knowledge stays in :mod:`tracediff.adapters`; the store format in :mod:`tracediff.store`.

This package is also callable, as ``tracediff.record`` always was: ``tracediff.record(path, ...)`` is
:func:`start`. Importing it imports neither torch nor numpy (the shim imports tracediff in every
process of a recorded command); :func:`start` does.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def start(*args: Any, **kwargs: Any) -> Any:
    """Start a :class:`tracediff.record.recorder.Recorder` (see its docstring); use as a context manager.

    ``adapter="speculators"`` (or any adapter name, comma-separated for several) also attaches that
    framework adapter to the models of this process: those alive now and those built while recording
    (see :func:`tracediff.adapters.attach_in_process`). An unknown adapter or one whose framework is
    not installed raises before the store is created.

    ``sample_requests=RATE``, ``max_requests=N``, ``max_bytes=SIZE`` and ``ring=True`` set those limits
    (:class:`tracediff.record.limits.Limits`; ``ring`` keeps the newest rows within ``max_bytes``).
    """
    from tracediff.record.recorder import Recorder  # noqa: PLC0415

    keep = {k: kwargs.pop(k) for k in ("sample_requests", "max_requests", "ring", "ring_store", "max_bytes") if k in kwargs}
    if keep:  # tracediff.record(..., sample_requests=0.1): the same as Limits(sample_requests=0.1)
        import dataclasses  # noqa: PLC0415

        from tracediff.record.limits import Limits  # noqa: PLC0415

        kwargs["limits"] = dataclasses.replace(kwargs.get("limits") or Limits(), **keep)
    limits = kwargs.get("limits")
    if getattr(limits, "ring", False) and "://" in str(args[0] if args else kwargs.get("path", "")):
        from tracediff.errors import UsageError  # noqa: PLC0415

        raise UsageError("ring=True keeps a local store within max_bytes; a store at a URL cannot be a ring: "
                         "record into a local folder (tracediff push uploads it)")
    adapter = kwargs.get("adapter")
    if adapter:
        from tracediff.adapters import adapter_names, attach_in_process  # noqa: PLC0415

        adapter_names(adapter)
    rec = Recorder(*args, **kwargs)
    if adapter:
        try:
            attach_in_process(rec, adapter)
        except BaseException:
            rec.close()
            raise
    return rec


class _CallableModule(types.ModuleType):
    """``tracediff.record(...)`` calls :func:`start`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return start(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["start"]
