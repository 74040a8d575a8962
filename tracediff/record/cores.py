"""Where a recorder's threads run: on the cores the engine did not pin for its model.

A serving engine on CPU pins its model to cores (vLLM's CPU worker binds its OpenMP threads through
``VLLM_CPU_OMP_THREADS_BIND``), and a thread inherits the affinity of the thread that creates it: left
alone, the recorder's writer would compete with the model for the model's own cores. So each recorder
thread calls :func:`place_this_thread` first: the engine's cores are this thread's inherited affinity
(its creator's), the process's main thread's, and what an adapter knows of its engine's binding
(:func:`add_engine_cores_hint`); the thread moves to the machine's other online cores. When none is
free it keeps what it inherited (said once in the log, at info level: an engine that pinned nothing
leaves nothing to avoid). ``TRACEDIFF_WRITER_CORES=2,3`` (or ``2-3``) names the cores instead.
Threads the placed thread creates later (zarr's I/O) inherit its cores.

Linux only (``os.sched_setaffinity``); elsewhere a no-op, said in the placement. The placement goes
into each writer group's attributes as ``threads``. What this module must never do: raise (a failure
leaves the thread where it was, the reason kept in the placement).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("tracediff")

ENV_WRITER_CORES = "TRACEDIFF_WRITER_CORES"
_ONLINE = "/sys/devices/system/cpu/online"

_hints: list[Callable[[], Iterable[int] | None]] = []
_said: set[str] = set()
_lock = threading.Lock()


def add_engine_cores_hint(hint: Callable[[], Iterable[int] | None]) -> None:
    """Register what an adapter knows of its engine's pinned cores (a callable returning core ids, or
    None when it knows nothing); asked each time a recorder thread is placed."""
    with _lock:
        if hint not in _hints:
            _hints.append(hint)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,5"`` (the kernel's list format; spaces also separate) -> ``[0, 1, 2, 3, 5]``; raises
    ValueError on anything else."""
    out: list[int] = []
    for part in text.replace(" ", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad core range {part!r}")
        out.extend(range(first, last + 1))
    if not out:
        raise ValueError("no core named")
    return sorted(set(out))


def online_cores() -> set[int]:
    """The machine's online cores (not this process's affinity, which may already be narrowed)."""
    try:
        with open(_ONLINE) as fh:
            return set(parse_cpu_list(fh.read().strip()))
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def _say_once(key: str, level: int, fmt: str, *args: Any) -> None:
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, fmt, *args)


def _hinted_cores() -> set[int]:
    out: set[int] = set()
    for hint in list(_hints):
        try:
            out |= {int(c) for c in hint() or ()}
        except Exception as exc:  # noqa: BLE001  (a hint is advice: a broken one is ignored)
            _say_once(f"hint:{hint!r}", logging.INFO, "tracediff: an engine-cores hint failed (%s); ignored", exc)
    return out


def place_this_thread(what: str = "writer") -> dict[str, Any]:
    """Move the calling thread (a recorder thread, at its start) off the engine's cores; returns the
    placement for the store: ``{"engine_cores": [...], "writer_cores": [...]}`` plus ``how`` (why these)
    and, where it applies, ``note``. Never raises."""
    if not (hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity") and sys.platform.startswith("linux")):
        return {"engine_cores": None, "writer_cores": None, "how": f"no thread affinity on {sys.platform}: left as is"}
    try:
        inherited = set(os.sched_getaffinity(0))
        engine = set(inherited)
        with contextlib.suppress(OSError):
            engine |= set(os.sched_getaffinity(os.getpid()))  # the main thread's (pid = the thread group)
        engine |= _hinted_cores()
        override = os.environ.get(ENV_WRITER_CORES, "").strip()
        how = "the online cores the engine's threads are not pinned to"
        wanted: set[int] = set()
        if override:
            try:
                wanted = set(parse_cpu_list(override))
                how = f"{ENV_WRITER_CORES}={override}"
            except ValueError as exc:
                _say_once("override", logging.WARNING, "tracediff: %s=%r is no core list (e.g. 2,3 or 2-3): %s; "
                          "ignored", ENV_WRITER_CORES, override, exc)
        if not wanted:
            wanted = online_cores() - engine
        if not wanted:
            _say_once("no-free-core", logging.INFO, "tracediff: no core free of the engine's (%s): the recorder's "
                      "threads stay on the cores they inherited", _text(engine))
            return {"engine_cores": sorted(engine), "writer_cores": sorted(inherited),
                    "how": "no core free of the engine's: kept the inherited cores"}
        try:
            os.sched_setaffinity(threading.get_native_id(), wanted)
        except OSError as exc:  # cores outside this process's cpuset, offline meanwhile
            _say_once(f"set:{sorted(wanted)}", logging.WARNING, "tracediff: cannot move the recorder's %s thread to "
                      "cores %s (%s): it stays on %s", what, _text(wanted), exc.strerror or exc, _text(inherited))
            return {"engine_cores": sorted(engine), "writer_cores": sorted(inherited),
                    "how": f"could not move to {_text(wanted)} ({exc.strerror or exc}): kept the inherited cores"}
        return {"engine_cores": sorted(engine), "writer_cores": sorted(os.sched_getaffinity(0)), "how": how}
    except Exception as exc:  # noqa: BLE001  (placement is an optimisation: the thread runs wherever it is)
        return {"engine_cores": None, "writer_cores": None, "how": f"not placed: {type(exc).__name__}: {exc}"}


def _text(cores: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cores)) or "none"


__all__ = ["ENV_WRITER_CORES", "add_engine_cores_hint", "online_cores", "parse_cpu_list", "place_this_thread"]
