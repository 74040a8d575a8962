"""The cores vLLM's CPU backend pinned a worker's model to, for the recorder's thread placement
(:mod:`tracediff.record.cores`: the recorder's threads go to the other cores).

vLLM 0.32 (``vllm/utils/ompmultiprocessing.py``, ``OMPProcessManager.configure_omp_envs``) turns
``VLLM_CPU_OMP_THREADS_BIND`` (``auto``, a list per rank such as ``0-3|4-7``, or ``nobind``) into the
OpenMP environment of each worker it starts: ``OMP_PLACES={0,1,2}`` with ``OMP_PROC_BIND=true``, or
``GOMP_CPU_AFFINITY="0 1 2"`` (libgomp preloaded), or ``KMP_AFFINITY=...,proclist=[0,1,2]`` (Intel
OpenMP preloaded). The worker's OpenMP runtime binds its threads when it starts, which may come after
the recorder's writer thread was created: so the environment, not the threads' affinity, says where
the model runs. Torch-free; stdlib only.
"""

from __future__ import annotations

import os
import re

_KMP_PROCLIST = re.compile(r"proclist=\[([0-9,\- ]+)\]")


def engine_cores() -> list[int] | None:
    """The cores this process's OpenMP threads are bound to, from the environment vLLM gave the
    worker; None when it says nothing (``nobind``, not a vLLM CPU worker, a form not understood)."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() == "nobind":
        return None
    places = os.environ.get("OMP_PLACES", "")
    if places and os.environ.get("OMP_PROC_BIND", "").strip().lower() not in ("", "false"):
        cores = _omp_places(places)
        if cores:
            return cores
    gomp = os.environ.get("GOMP_CPU_AFFINITY", "")
    if gomp:
        cores = _id_list(gomp)
        if cores:
            return cores
    match = _KMP_PROCLIST.search(os.environ.get("KMP_AFFINITY", ""))
    return _id_list(match.group(1)) if match else None


def _omp_places(text: str) -> list[int] | None:
    """``{0,1,2},{3}`` or ``{0:4}`` / ``{0:4:2}`` (start:length[:stride]) -> core ids; None for the
    abstract names (``cores``, ``threads``), which name no core."""
    out: set[int] = set()
    for place in re.findall(r"\{([^}]*)\}", text):
        for part in place.split(","):
            part = part.strip()
            if ":" in part:
                try:
                    start, length, *stride = (int(x) for x in part.split(":"))
                except ValueError:
                    return None
                out.update(range(start, start + length * (stride[0] if stride else 1), stride[0] if stride else 1))
            elif part:
                ids = _id_list(part)
                if ids is None:
                    return None
                out.update(ids)
    return sorted(out) or None


def _id_list(text: str) -> list[int] | None:
    """``0 1 2``, ``0,1,2`` or ``0-3`` -> ids; None when it is something else."""
    out: set[int] = set()
    for part in re.split(r"[\s,]+", text.strip()):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out) or None


__all__ = ["engine_cores"]
