"""The streaming pass's per-row statistics in one fused loop: every stored value read once.

For a block of row pairs the pass needs, per row, the norm of every segment of both sides and, per
matched segment pair, the norm and the largest absolute value of the difference, the norm of the
difference in units of the reference segment's robust scale, and the norm of the standardised
reference. The reference implementation (:meth:`tracediff.compare.stream.blocks._Pass.block_metrics`' numpy
path) runs about eight eager kernels per pair over float32 copies of the rows: some ten reads and
six writes of every value. :func:`fused_row_stats` widens each stored value (bf16 bits or float32)
in registers where its loop reads it, in a compiled loop whose float32 sums LLVM vectorises: the same numbers up to float32
summation order (tests/test_kernels.py holds it to the per-element formulas and a compare's
decisions to the numpy path's).

Compiled by numba (a registry package; ``nogil``: the pass's block threads run it concurrently,
each on its own block, so it is serial inside). Without numba, or for other stored dtypes (float16),
the pass keeps the numpy path. The kernel is pure computation (no I/O, no allocation beyond a flag
per segment); :func:`tracediff.compare.rows.fused.read_and_measure` runs it on wide rows as it reads them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.compare.rows.index import RowIndex
from tracediff.store import VALUE_DTYPES

log = logging.getLogger("tracediff")

#: Stored dtypes the fused loop reads directly (bf16 as its uint16 bits).
FUSED_DTYPES = ("bfloat16", "float32")

_COMPILED: dict[str, Any] = {}  # name -> the loaded kernel, or None where it cannot load
_LOCK = threading.Lock()


def _build(name: str) -> Any:
    """A compiled kernel by name (numba compiles it once and caches it on disk next to its module
    where it can; later processes load it): the pass's fused kernel (:mod:`tracediff.compare.rows.fused`) or
    the alignment's kernels (the module :mod:`tracediff.compare.rows.fused_votes`)."""
    if name == "votes":
        from tracediff.compare.rows import fused_votes  # noqa: PLC0415

        return fused_votes
    if name == "reads":
        from tracediff.store import fused_reads  # noqa: PLC0415

        if not fused_reads.usable():
            raise ImportError("the compiled reads need a 64-bit POSIX process")
        return fused_reads
    from tracediff.compare.rows import fused  # noqa: PLC0415

    return fused


def fused_kernel() -> Any:
    """The pass's compiled kernels (:mod:`tracediff.compare.rows.fused`: ``kernel``, ``closed_forms``), or None
    where numba is missing (or ``TRACEDIFF_KERNEL=numpy``; which passes use them at all:
    :func:`use_fused_kernel`)."""
    return _compiled("pass")


def loaded_fused_kernel() -> Any:
    """:func:`fused_kernel` where this process has loaded it already (a pass used it), else None:
    never imports numba (a compare whose pass ran without it, or on a cluster, stays numpy's)."""
    return _COMPILED.get("pass")


def vote_kernels() -> Any:
    """The alignment's compiled kernels (:mod:`tracediff.compare.rows.fused_votes`: ``batch_votes``), or None
    where numba is missing (or ``TRACEDIFF_KERNEL=numpy``)."""
    return _compiled("votes")


def read_kernel() -> Any:
    """The pass's compiled row reader (:mod:`tracediff.store.fused_reads`: ``read_runs``), or None
    where numba is missing, the process is not a 64-bit POSIX one, or ``TRACEDIFF_KERNEL=numpy``
    (``read_rows`` then reads run by run in Python: the same bytes)."""
    return _compiled("reads")


def _compiled(name: str) -> Any:
    if os.environ.get("TRACEDIFF_KERNEL", "").lower() == "numpy":
        return None
    with _LOCK:  # one compile or cache load, also while preload_fused_kernel's thread is at it
        if name not in _COMPILED:
            _COMPILED[name] = None
            try:
                module = _build(name)
                if _cold(module):
                    _compile_elsewhere(module)
                _COMPILED[name] = module
            except ImportError as exc:
                log.info("tracediff: %s: the %s use numpy kernels", exc,
                         {"votes": "alignment's votes", "reads": "streaming pass's reads"}.get(name, "streaming pass"))
            except Exception as exc:  # a numba that cannot compile here must not stop a compare
                log.warning("tracediff: a compiled kernel could not be loaded (%s): using the numpy kernels", exc)
        return _COMPILED[name]


def _cold(module: Any) -> bool:
    """Whether numba's on-disk cache holds no machine code yet for one of ``module``'s entry points
    (a first compare after an install or an upgrade: the index is empty or of another source). False
    where that cannot be told (no cache here, another numba): the compare compiles, as it would."""
    try:
        return any(not d._cache._cache_file._load_index() for d in module.ENTRY_POINTS)
    except Exception:  # noqa: BLE001  (numba's cache internals: anything unexpected means "compile here")
        return False


def _compile_elsewhere(module: Any) -> None:
    """Fill numba's cache for ``module`` from a child process (``module.warm()``), so that this one
    loads the machine code instead of compiling it: the compiler's memory (~60 MiB that stay with
    the process that compiled, measured at 8 M narrow rows: a first compare peaked at 626 MiB, later
    ones at 562) is the child's, not added to a compare at its peak. A child that fails or runs past
    its time only costs that time: this process then compiles what it calls, as before."""
    if not sys.executable:
        return
    import subprocess  # noqa: PLC0415

    root = str(Path(os.path.abspath(__file__)).parents[3])  # tracediff's parent (this is tracediff/compare/rows/)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log.info("tracediff: compiling %s once, in a child process (numba's cache is empty here)", module.__name__)
    try:
        done = subprocess.run([sys.executable, "-c", f"import {module.__name__} as m; m.warm()"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=_COMPILE_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("tracediff: could not compile %s in a child process (%s): compiling here", module.__name__, exc)
        return
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        log.info("tracediff: compiling %s in a child process failed (%s): compiling here", module.__name__, tail[0])
    elif _cold(module):  # compiled, but nothing kept (a cache numba cannot write to): each compare compiles
        log.warning("tracediff: numba's cache did not keep the compiled %s (is its cache folder writable? "
                    "NUMBA_CACHE_DIR names another): every compare compiles it", module.__name__)


#: The longest a child process may compile a module's kernels (seconds; ~5-15 s on 2 cores).
_COMPILE_SECONDS = 600


def fused_available() -> bool:
    """Whether numba is installed (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def preload_fused_kernel(cdtype: str, rdtype: str, wait: Callable[[], None] | None = None) -> None:
    """Import numba and load the kernel's machine code for these stored dtypes where this process has
    not yet: on a background thread, or with ``wait`` on this one (``wait()`` called first, then
    returning once loaded), unless numba's cache lacks the kernels (:func:`_compiles_first`: a child
    process compiles them for 11-15 s, which the caller need not wait for). A compare calls it once
    it knows its pass will use the kernel (:func:`prepare_kernel` decides which of the two)."""
    if "pass" in _COMPILED or cdtype not in FUSED_DTYPES or rdtype not in FUSED_DTYPES:
        return
    if wait is not None:
        wait()
        if not _compiles_first():
            _load_fused(cdtype == "bfloat16", rdtype == "bfloat16")
            return
    threading.Thread(target=_load_fused, args=(cdtype == "bfloat16", rdtype == "bfloat16"),
                     name="tracediff-kernel-load", daemon=True).start()


def _load_fused(c_bf16: bool, r_bf16: bool) -> None:
    compiled = fused_kernel()
    if compiled is None:
        return
    try:
        compiled.load(c_bf16, r_bf16)
        reads = read_kernel()
        if reads is not None:
            reads.load()
    except Exception as exc:  # noqa: BLE001  (the pass's first call then compiles or loads it, and reports)
        log.info("tracediff: the fused kernel could not be loaded ahead of the pass (%s)", exc)


def fused_row_stats(craw: np.ndarray, rraw: np.ndarray, n: int, size: int, cdtype: str, rdtype: str,
                    seg_c: np.ndarray, seg_r: np.ndarray, means: np.ndarray, invs: np.ndarray, xc: np.ndarray,
                    xr: np.ndarray, dn: np.ndarray, mx: np.ndarray, sn: np.ndarray, sd: np.ndarray) -> bool:
    """Fill, for rows ``0..n`` of ``craw`` / ``rraw`` (stored values: bf16 as uint16 bits, or
    float32): ``xc [n, kc]``, ``xr [n, kr]`` segment norms and, per pair p of candidate segment
    ``seg_c[p]`` and reference segment ``seg_r[p]`` (reference mean ``means[p]`` and 1 / scale
    ``invs[p]``, float32 [pairs, size]): ``dn``, ``mx``, ``sn``, ``sd`` ``[pairs, >= n]`` (norm and
    max |.| of the difference, norm of the standardised difference, norm of the standardised
    reference). Returns False, computing nothing, when the fused kernel cannot run here."""
    compiled = fused_kernel()
    if compiled is None or cdtype not in FUSED_DTYPES or rdtype not in FUSED_DTYPES:
        return False
    c = craw.view(np.uint16) if cdtype == "bfloat16" else craw
    r = rraw.view(np.uint16) if rdtype == "bfloat16" else rraw
    compiled.kernel(c, r, n, size, seg_c, seg_r, means, invs, xc, xr, dn, mx, sn, sd)
    return True


#: Norms are clamped to this before dividing (as the per-element formulas always did).
TINY = 1e-30


# ------------------------------------------------------------ which kernel a pass uses
#: Stored bytes (both sides) from which a pass uses the fused kernel by default: numba's import and
#: the cached kernel's load cost 0.3-0.4 s of wall time and ~0.5 s of CPU in a process (measured
#: here), taken from the plan, which now runs on both cores; the kernel saves ~1.2-2 s of CPU per GB
#: over the numpy kernels (benchmarks/bench_kernel.py; more at narrow rows). Whole compares, fresh
#: processes, medians: below ~1 GiB the numpy kernels finish first (0.25 GiB a side of 3 x 4096:
#: 1.35 vs 1.68 s; 0.5 M rows of 3 x 64: 1.74 vs 2.08 s), above it the fused one (2 M rows of 3 x 64:
#: 4.39 vs 5.06 s). The load comes as soon as the pass's size is known (:func:`prepare_kernel`):
#: before the plan, or beside it where numba is set up already.
FUSED_MIN_BYTES = 1 << 30


def use_fused_kernel(nbytes: int) -> bool:
    """Whether a pass over ``nbytes`` of stored rows uses the fused kernel: ``TRACEDIFF_KERNEL=fused``
    always, ``=numpy`` never; by default from :data:`FUSED_MIN_BYTES` on, where numba is installed
    (a small compare never imports it: its fixed cost stays that of numpy)."""
    forced = _forced_kernel()
    return forced if forced is not None else nbytes >= FUSED_MIN_BYTES and fused_available()


def _forced_kernel() -> bool | None:
    """``TRACEDIFF_KERNEL``: True for ``fused`` (the compiled kernels always), False for ``numpy``
    (never), None otherwise (each caller's size threshold decides)."""
    choice = os.environ.get("TRACEDIFF_KERNEL", "").lower()
    return choice == "fused" if choice in ("fused", "numpy") else None


#: Candidate rows from which the alignment's votes are counted by the compiled kernel by default:
#: numba's import (0.3-0.4 s of wall time) is not paid by a small compare; a pass over this many rows
#: loads numba anyway. At 8 M narrow rows the kernel saves ~1 s of the alignment's CPU (docs/performance.md).
VOTE_KERNEL_MIN_ROWS = 1 << 21


def use_vote_kernel(rows: int) -> bool:
    """Whether an alignment of ``rows`` candidate rows counts its votes by the compiled kernel
    (``TRACEDIFF_KERNEL=fused`` always, ``=numpy`` never, by default from
    :data:`VOTE_KERNEL_MIN_ROWS` on where numba is installed): the same hypotheses either way."""
    forced = _forced_kernel()
    return forced if forced is not None else rows >= VOTE_KERNEL_MIN_ROWS and fused_available()


def prepare_kernel(pairs: int, candidate: RowIndex, reference: RowIndex,
                   loading: Callable[[], None] | None = None) -> None:
    """Load the fused kernel and the compiled reads when a pass over ``pairs`` row pairs of these
    sides will use them (:func:`use_fused_kernel`): at once (calling ``loading`` first) where this
    process has loaded none of tracediff's compiled kernels yet, else on a background thread while
    the plan runs.

    A first load imports numba and sets up its compiler's context: ~0.5 s of Python that holds the
    GIL. Beside the plan's threads, whose reads give the GIL back at every row and then wait for it,
    the two took longer than one after the other (3 GiB of 3 x 4096, fresh processes, 12 runs
    interleaved: 2.42 s against 2.20 s a compare, the plan then reading its samples by the compiled
    loop: :func:`plan_reads_compiled`). Once numba is set up (an alignment that counted its votes
    by the compiled kernel), the rest of the load is short and runs beside the plan; so does a load
    that waits for a child process to fill numba's empty cache first (:func:`preload_fused_kernel`)."""
    if not pairs or not use_fused_kernel(pairs * row_bytes(candidate, reference)):
        return
    cdtype, rdtype = candidate.streams[0].dtype, reference.streams[0].dtype
    first = not any(module is not None for module in _COMPILED.values())
    preload_fused_kernel(cdtype, rdtype, wait=(loading or (lambda: None)) if first else None)


def _compiles_first() -> bool:
    """Whether the pass's kernels are not in numba's cache yet (a first compare after an install or an
    upgrade): a child process compiles them first (:func:`_compile_elsewhere`, 11-15 s on 2 cores),
    which the plan need not wait for. Imports the kernels' modules (numba with them), as a load does."""
    for name in ("pass", "reads"):
        try:
            if _cold(_build(name)):
                return True
        except Exception:  # noqa: BLE001, S112  (no numba, no compiled reads here: the load says so)
            continue
    return False


def plan_reads_compiled() -> bool:
    """Whether reads of sample rows go through the compiled reader: where this process has loaded it
    already (never loads it: a compare whose pass runs without the compiled kernels reads in Python)."""
    return _COMPILED.get("reads") is not None


def row_bytes(candidate: RowIndex, reference: RowIndex) -> int:
    """Stored bytes of one row pair."""
    c, r = candidate.streams[0], reference.streams[0]
    return c.width * VALUE_DTYPES[c.dtype].itemsize + r.width * VALUE_DTYPES[r.dtype].itemsize


# ------------------------------------------------------------ the numpy kernels (the reference)
def norms(x: np.ndarray, out: np.ndarray) -> None:
    """The L2 norms of ``x`` along its last axis into ``out`` (float32 sums of squares)."""
    dot(x, x, out)
    np.sqrt(out, out=out)


def dot(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """Dot products along the last axis into ``out``: ``np.vecdot`` (numpy 2; a third of einsum's
    time here), else einsum."""
    if _VECDOT is not None:
        _VECDOT(x, y, out=out)
    else:
        np.einsum("...h,...h->...", x, y, out=out)


_VECDOT = getattr(np, "vecdot", None)


def numpy_row_stats(c3: np.ndarray, r3: np.ndarray, xc: np.ndarray, xr: np.ndarray, pairs: Sequence[tuple],
                    d: np.ndarray) -> None:
    """The pass's per-row statistics of a sub-block (float32 rows ``c3`` [b, Kc, H], ``r3`` [b, Kr, H]),
    eager numpy kernels into reused buffers (the reference implementation of
    :func:`tracediff.compare.rows.kernels.fused_row_stats`): every segment's norm into ``xc`` / ``xr``, and per
    pair ``(a, b, dn, mx, sn, sd, mean, inv_scale)`` (views of the two segments and of the outputs)
    the norm and largest |value| of the difference and the norms of the standardised difference and
    reference. ``d``: a [b, H] float32 scratch buffer."""
    norms(c3, xc)
    norms(r3, xr)
    for a, b, dn, mx, sn, sd, mean, inv_scale in pairs:
        np.subtract(a, b, out=d)
        norms(d, dn)
        # |d| in place: the norms below square it, and the largest |d| is the max abs diff.
        np.abs(d, out=d)
        np.max(d, axis=1, out=mx)
        # The decision metric: every dimension in units of the reference's robust scale.
        np.multiply(d, inv_scale, out=d)
        norms(d, sn)
        np.subtract(b, mean, out=d)
        np.multiply(d, inv_scale, out=d)
        norms(d, sd)


def numpy_closed_forms(m: int, xc: np.ndarray, xr: np.ndarray, seg_c: np.ndarray, seg_r: np.ndarray, fin_c: np.ndarray,
                       fin_r: np.ndarray, dn: np.ndarray, mx: np.ndarray, sn: np.ndarray, sd: np.ndarray) -> tuple:
    """The pass's per-row metrics of rows ``0..m`` from their norms (``xc`` / ``xr`` [m, k] segment norms,
    ``fin_c`` / ``fin_r`` their finiteness; per pair p ``dn``, ``mx``, ``sn``, ``sd`` [pairs, >= m]), numpy's
    expressions (the reference of :func:`tracediff.compare.rows.fused.closed_forms`): float64 [m, pairs]
    cosine, norm ratio, rel_diff, float32 max |diff| (NaN where the norms are not ordinary); per pair
    the squared error and reference norm of ordinary rows and the standardised error and reference
    of finite ones; the squared standardised error per row (NaN where not finite); and the (row,
    pair) indexes of finite rows whose norms are not ordinary. 1 - cos = (|d|^2 - (|a|-|b|)^2) /
    (2|a||b|) stays exact near cos = 1."""
    ok = fin_c[:, seg_c] & fin_r[:, seg_r]  # [m, pairs]
    x = xc[:, seg_c].astype(np.float64)
    y = xr[:, seg_r].astype(np.float64)
    dd = dn[:, :m].T.astype(np.float64) ** 2
    fast = ok & (x > 1e-15) & (x < 1e18) & (y > 1e-15) & (y < 1e18) & np.isfinite(dd)
    with np.errstate(all="ignore"):
        nb = y * y
        cos = np.where(fast, 1.0 - np.clip((dd - (x - y) ** 2) / (2.0 * x * y), 0.0, 2.0), np.nan)
        ratio = np.where(fast, x / y, np.nan)
        rel = np.where(fast, dd / (x * x + nb), np.nan)
    max_abs = np.where(fast, mx[:, :m].T, np.nan)  # of |d|: +0.0, never -0.0
    # (Every [m, pairs] array here is column-major, as the column gathers above make them: each
    # pair's sum is numpy's pairwise sum of a contiguous column.)
    sq_err = np.where(fast, dd, 0.0).sum(axis=0)
    sq_ref = np.where(fast, nb, 0.0).sum(axis=0)
    sn2 = sn[:, :m].T.astype(np.float64) ** 2
    sd2 = sd[:, :m].T.astype(np.float64) ** 2
    std_ok = ok & np.isfinite(sn2) & np.isfinite(sd2)
    std_num = np.where(std_ok, sn2, 0.0).sum(axis=0)
    std_den = np.where(std_ok, sd2, 0.0).sum(axis=0)
    odd_rows, odd_pairs = np.nonzero(ok & ~fast)
    return (cos, ratio, rel, max_abs, sq_err, sq_ref, std_num, std_den, np.where(std_ok, sn2, np.nan), odd_rows,
            odd_pairs)


def exact_row_stats(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Metrics of finite rows by the per-element formulas, for rows whose norms are not ordinary:
    cosine, norm ratio, rel_diff, max abs diff per row; summed squared error and reference norm."""
    tiny = np.float32(TINY)
    with np.errstate(all="ignore"):
        na = (a * a).sum(axis=1)
        nb = (b * b).sum(axis=1)
        d = a - b
        sq = (d * d).sum(axis=1)
        max_abs = np.abs(d).max(axis=1)
        # 1 - cos as half the squared distance of the unit vectors: exact near cos = 1 in fp32.
        ua = a / np.maximum(np.sqrt(na), tiny)[:, None]
        ub = b / np.maximum(np.sqrt(nb), tiny)[:, None]
        one_minus_cos = np.float32(0.5) * ((ua - ub) ** 2).sum(axis=1)
        cos = np.float32(1.0) - one_minus_cos
        ratio = np.sqrt(na) / np.maximum(np.sqrt(nb), tiny)
        rel = sq / np.maximum(na + nb, tiny)
    return cos, ratio, rel, max_abs, float(sq.astype(np.float64).sum()), float(nb.astype(np.float64).sum())


__all__ = ["FUSED_DTYPES", "FUSED_MIN_BYTES", "VOTE_KERNEL_MIN_ROWS", "prepare_kernel", "row_bytes", "use_fused_kernel",
           "use_vote_kernel", "TINY", "dot", "exact_row_stats", "norms", "numpy_closed_forms", "numpy_row_stats", "fused_available",
           "fused_kernel", "fused_row_stats", "loaded_fused_kernel", "preload_fused_kernel", "vote_kernels"]
