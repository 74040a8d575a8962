"""The fused kernel of the streaming pass gives the numbers of the per-element formulas (torch here,
an implementation independent of both of the pass's) up to float32 summation order, on every stored
dtype it reads and on rows that are not ordinary (massive dimensions, zeros, NaN, Inf); and a compare
decides the same with it and with the pass's numpy kernels (its reference implementation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tracediff.compare import compare_stores
from tracediff.compare.rows.kernels import fused_kernel, fused_row_stats


def test_the_fused_kernel_is_available():
    # numba is a core dependency (pyproject.toml): a kernel that cannot load here is a defect, not a skip.
    assert fused_kernel() is not None


def _rows(n: int, width: int, dtype: str, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Stored rows (bf16 as uint16 bits) and their float32 values: ordinary values, two massive
    dimensions, and a zero, a NaN and an Inf row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen)
    x[:, 5 % width] *= 300.0
    x[:, (width // 2 + 7) % width] *= -800.0
    x[1] = 0.0
    x[2, 3 % width] = float("nan")
    x[3, width - 1] = float("inf")
    if dtype == "bfloat16":
        b = x.to(torch.bfloat16)
        return b.view(torch.int16).numpy().view(np.uint16).copy(), b.float()
    return x.numpy().copy(), x


def _torch_stats(c: torch.Tensor, r: torch.Tensor, size: int, seg_c, seg_r, means, invs):
    n = c.shape[0]
    c3, r3 = c.view(n, -1, size), r.view(n, -1, size)
    xc, xr = c3.norm(dim=2), r3.norm(dim=2)
    out = []
    for p, (i, j) in enumerate(zip(seg_c, seg_r, strict=True)):
        d = c3[:, i] - r3[:, j]
        out.append((d.norm(dim=1), d.abs().amax(dim=1), (d * invs[p]).norm(dim=1),
                    ((r3[:, j] - means[p]) * invs[p]).norm(dim=1)))
    return xc, xr, out


@pytest.mark.parametrize("cdtype,rdtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                           ("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize("size,seg_c,seg_r", [
    (64, [0, 1, 2, 2], [0, 1, 2, 0]),  # every segment read by a pair, one twice
    (37, [2], [0]),  # segments no pair reads (their norms alone); a size no vector width divides
    (1, [1, 0], [1, 2]),
])
def test_fused_row_stats_equal_the_torch_kernels(cdtype, rdtype, size, seg_c, seg_r):
    n = 40
    craw, c = _rows(n, 3 * size, cdtype, 1)
    rraw, r = _rows(n, 3 * size, rdtype, 2)
    seg_c, seg_r = np.array(seg_c, dtype=np.int64), np.array(seg_r, dtype=np.int64)
    pairs_n = seg_c.size
    gen = torch.Generator().manual_seed(3)
    means = torch.randn(pairs_n, size, generator=gen)
    invs = 1.0 / (0.5 + torch.rand(pairs_n, size, generator=gen))
    xc, xr = np.zeros((n + 8, 3), np.float32), np.zeros((n + 8, 3), np.float32)
    dn, mx, sn, sd = (np.zeros((pairs_n, n + 8), np.float32) for _ in range(4))
    assert fused_row_stats(craw, rraw, n, size, cdtype, rdtype, seg_c, seg_r, means.numpy(), invs.numpy(),
                           xc, xr, dn, mx, sn, sd)
    txc, txr, pairs = _torch_stats(c, r, size, seg_c, seg_r, means, invs)
    close = {"rtol": 2e-6, "atol": 0.0, "equal_nan": True}
    np.testing.assert_allclose(xc[:n], txc.numpy(), **close)
    np.testing.assert_allclose(xr[:n], txr.numpy(), **close)
    for p, (tdn, tmx, tsn, tsd) in enumerate(pairs):
        np.testing.assert_allclose(dn[p, :n], tdn.numpy(), **close)
        np.testing.assert_array_equal(mx[p, :n], tmx.numpy())  # a max of float32 differences: exact
        np.testing.assert_allclose(sn[p, :n], tsn.numpy(), **close)
        np.testing.assert_allclose(sd[p, :n], tsd.numpy(), **close)
    # Rows past n are left alone.
    assert not dn[:, n:].any() and not xc[n:].any()


def test_stored_float16_rows_keep_the_numpy_kernels():
    raw = np.zeros((4, 64), np.float16)
    out = np.zeros((4, 1), np.float32)
    args = (np.array([0]), np.array([0]), np.zeros((1, 64), np.float32), np.ones((1, 64), np.float32))
    assert not fused_row_stats(raw, raw, 4, 64, "float16", "float16", *args, out, out, out.T.copy(), out.T.copy(),
                               out.T.copy(), out.T.copy())


def _summary(report):
    return (report.verdict, [(f.kind, f.severity) for f in report.findings],
            [(m.candidate, m.reference, m.status, m.relation) for m in report.segment_map])


@pytest.mark.parametrize("candidate", ["server_broken", "server_fixed"])
def test_compare_decides_the_same_with_either_kernel(monkeypatch, candidate):
    monkeypatch.setenv("TRACEDIFF_KERNEL", "numpy")
    slow = compare_stores("samples/train.zarr", f"samples/{candidate}.zarr")
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    fast = compare_stores("samples/train.zarr", f"samples/{candidate}.zarr")
    assert _summary(fast) == _summary(slow)
    for a, b in zip(fast.metrics, slow.metrics, strict=True):
        for name in ("cos_mean", "cos_p1", "std_rel_error", "rel_l2", "max_abs_diff", "norm_ratio_p50"):
            va, vb = getattr(a, name), getattr(b, name)
            assert math.isclose(va, vb, rel_tol=1e-5, abs_tol=1e-9) or (math.isnan(va) and math.isnan(vb)), name


def test_subset_findings_are_the_same_with_either_kernel(monkeypatch, tmp_path):
    from subset_traces import record_subset_traces

    traces = record_subset_traces(tmp_path)
    monkeypatch.setenv("TRACEDIFF_KERNEL", "numpy")
    slow = compare_stores(traces["ref"], traces["decode_zeros"])
    monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")
    fast = compare_stores(traces["ref"], traces["decode_zeros"])
    assert _summary(fast) == _summary(slow)
    for a, b in zip(fast.findings, slow.findings, strict=True):
        sa, sb = a.evidence.get("subset") or {}, b.evidence.get("subset") or {}
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], float):
                assert math.isclose(sa[key], sb[key], rel_tol=1e-5), key
            else:
                assert sa[key] == sb[key], key


@pytest.mark.parametrize("pairs", [1, 2, 3])
def test_compiled_closed_forms_are_numpys_bit_for_bit(pairs):
    """The pass's per-row metrics from the norms: the compiled loop and numpy's expressions (the pass
    without numba) give the same bits, sums included (their summation order is numpy's), on ordinary
    rows and on rows whose norms are tiny, huge, zero, NaN or Inf."""
    from tracediff.compare.rows.kernels import numpy_closed_forms

    rng = np.random.default_rng(pairs)
    m, block, k = 1000, 1024, 3
    xc = np.empty((block, k), np.float32)
    xc[:m] = rng.lognormal(0.0, 2.0, (m, k)).astype(np.float32)
    xr = np.empty((block, k), np.float32)
    xr[:m] = (xc[:m] * rng.uniform(0.9, 1.1, (m, k))).astype(np.float32)
    dn, mx, sn, sd = (rng.lognormal(-3.0, 1.0, (pairs, block)).astype(np.float32) for _ in range(4))
    xc[0], xr[1], dn[:, 2] = 0.0, 1e-20, np.inf  # zero, tiny, overflowing
    xc[3], xr[4] = 1e30, np.nan
    sn[:, 5], sd[:, 6] = np.nan, np.inf
    dn[:, 7] = 1e20  # |d|^2 finite in float64, past float32
    fin_c, fin_r = np.isfinite(xc[:m]), np.isfinite(xr[:m])
    fin_c[8, :] = False
    seg_c = np.arange(pairs, dtype=np.int64)[::-1].copy()
    seg_r = np.arange(pairs, dtype=np.int64)
    want = numpy_closed_forms(m, xc[:m], xr[:m], seg_c, seg_r, fin_c, fin_r, dn, mx, sn, sd)

    rows = np.empty((5, m, pairs), np.float32)
    sums = np.empty((4, pairs, m))
    odd = np.empty((m, pairs), bool)
    fused_kernel().closed_forms(m, xc[:m], xr[:m], seg_c, seg_r, fin_c, fin_r, dn, mx, sn, sd, rows, sums, odd)
    cos, ratio, rel, max_abs, sq_err, sq_ref, std_num, std_den, std_metric, odd_rows, odd_pairs = want
    for got, expected in zip(rows, (cos, ratio, rel, max_abs, std_metric), strict=True):
        with np.errstate(over="ignore"):  # (a float64 past float32's range is Inf in both: the kernel writes float32)
            want32 = expected.astype(np.float32)
        assert np.array_equal(got.view(np.uint32), want32.view(np.uint32))
    for got, expected in zip((sums[i].T.sum(axis=0) for i in range(4)), (sq_err, sq_ref, std_num, std_den),
                             strict=True):
        assert got.tobytes() == expected.tobytes()
    got_rows, got_pairs = np.nonzero(odd)
    assert np.array_equal(got_rows, odd_rows) and np.array_equal(got_pairs, odd_pairs)
    assert odd_rows.size >= 3 and np.isnan(cos[:, 0]).sum() >= 5  # the rows that are not ordinary were there


_COLD_CACHE_SCRIPT = r'''
import json, sys
import numpy as np
from tracediff.compare import compare_stores
from tracediff.compare.rows import fused, fused_votes
from tracediff.store import TraceWriter, create_store, decode_values, open_store

# A float32 copy of the shipped training trace: a pass over float32 rows against bf16 ones.
src = open_store("samples/train.zarr")
create_store(sys.argv[1], role="trainer")
for st in src.tap_streams("fc_in"):
    w = TraceWriter(sys.argv[1], "fc_in", st.writer, width=st.width, dtype="float32", chunk_rows=st.chunk_rows)
    chunks = -(-st.rows // st.chunk_rows)
    values = np.concatenate([decode_values(st.read_chunk(c), st.dtype) for c in range(chunks)])[: st.rows]
    w.append(values, st.labels())
    w.close()
verdicts = [compare_stores("samples/train.zarr", "samples/server_broken.zarr").verdict,
            compare_stores(sys.argv[1], "samples/server_fixed.zarr").verdict,
            compare_stores("samples/server_fixed.zarr", sys.argv[1]).verdict]
stats = {f"{m.__name__}.{d.__name__}": [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]
         for m in (fused, fused_votes) for d in m.ENTRY_POINTS}
print(json.dumps({"verdicts": verdicts, "stats": stats}))
'''


@pytest.mark.slow
def test_a_cold_kernel_cache_is_filled_by_a_child_process_and_only_loaded_here(tmp_path):
    """A first compare after an install compiles the kernels in a child process (the compiler's
    memory is not added to the compare's); the compare's own process then loads every kernel it
    calls, for bf16 and float32 rows on either side, from numba's cache: no cache miss."""
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "numba-cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), TRACEDIFF_KERNEL="fused")
    done = subprocess.run([sys.executable, "-c", _COLD_CACHE_SCRIPT, str(tmp_path / "train32.zarr")], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (hits, misses) in result["stats"].items():
        assert misses == 0, f"{name} was compiled in the compare's process"
        assert hits >= 1, f"{name} was not loaded from the cache"
    assert result["verdicts"][0] == compare_stores("samples/train.zarr", "samples/server_broken.zarr").verdict
    assert list(cache.rglob("*.nbi")), "nothing was cached"


def test_a_child_that_cannot_compile_leaves_the_compile_to_this_process(monkeypatch, caplog):
    """No interpreter to start, or a child that fails: logged, nothing raised (the compare's own
    process compiles what it calls, as without the child)."""
    import logging
    import types

    from tracediff.compare.rows import kernels

    caplog.set_level(logging.INFO, logger="tracediff")
    kernels._compile_elsewhere(types.SimpleNamespace(__name__="tracediff.compare.no_such_kernels"))
    assert "compiling tracediff.compare.no_such_kernels in a child process failed (ModuleNotFoundError" in caplog.text
    monkeypatch.setattr(kernels.sys, "executable", "/nonexistent/python3")
    kernels._compile_elsewhere(types.SimpleNamespace(__name__="tracediff.compare.rows.fused"))
    assert "could not compile tracediff.compare.rows.fused in a child process" in caplog.text


def test_a_child_that_compiles_nothing_the_cache_keeps_is_a_warning(tmp_path, monkeypatch, caplog):
    """A child that ran but left numba's index empty (here: its warm() calls nothing) means the cache
    keeps nothing: said once, as a warning naming the module (every compare would compile)."""
    import importlib
    import logging
    import sys

    from tracediff.compare.rows import kernels

    (tmp_path / "tdwarm_probe.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef one(x):\n    return x + 1\n\n"
        "ENTRY_POINTS = (one,)\n\ndef warm():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    probe = importlib.import_module("tdwarm_probe")
    try:
        assert kernels._cold(probe)
        caplog.set_level(logging.INFO, logger="tracediff")
        kernels._compile_elsewhere(probe)
        assert "numba's cache did not keep the compiled tdwarm_probe" in caplog.text
    finally:
        sys.modules.pop("tdwarm_probe", None)


_PRELOAD_SCRIPT = r'''
import json, threading
from tracediff.compare.rows import kernels
kernels.preload_fused_kernel("bfloat16", "float32")
for t in threading.enumerate():
    if t.name == "tracediff-kernel-load":
        t.join()
from tracediff.compare.rows import fused
print(json.dumps({"kernel": [[str(a) for a in sig[:2]] for sig in fused.kernel.signatures],
                  "closed_forms": len(fused.closed_forms.signatures)}))
'''


def test_the_pass_kernel_is_loaded_ahead_for_its_stored_dtypes_only():
    """Before a large pass, a background thread loads the kernel's machine code for the two sides'
    stored dtypes (bf16 bits, float32), and only those, with the closed forms: the pass's first block
    does not wait for numba to set itself up."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PRELOAD_SCRIPT], env=dict(os.environ, TRACEDIFF_KERNEL="fused"),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"kernel": [["array(uint16, 2d, C)", "array(float32, 2d, C)"]], "closed_forms": 1}


_LOAD_ORDER_SCRIPT = r'''
import json, sys, threading
from tracediff.compare import CompareOptions, compare_stores
from tracediff.compare.align import sequences
from tracediff.compare.plan import decide
from tracediff.compare.rows import kernels

events = []
real_reads = decide.plan_reads_compiled


def reads_compiled():
    got = real_reads()
    events.append("compiled read" if got else "python read")
    return got


decide.plan_reads_compiled = reads_compiled
real_load = kernels._load_fused
kernels._load_fused = lambda *a: events.append(f"load on {threading.current_thread().name}") or real_load(*a)
# (TRACEDIFF_KERNEL=fused makes the alignment count its votes by the compiled kernel too, which would
# set numba up before the pass's kernel: small stores' alignments count them in numpy.)
sequences.use_vote_kernel = lambda rows: False
if sys.argv[1] == "votes-first":
    kernels.vote_kernels()  # (numba set up already: the pass's kernel loads beside the plan)
elif sys.argv[1] == "python-reads":
    decide.plan_reads_compiled = lambda: events.append("python read") or False
elif sys.argv[1] == "cold-cache":  # numba's cache taken as empty: a child would compile first (not run here)
    kernels._cold = lambda module: True
    kernels._compile_elsewhere = lambda module: events.append(
        f"compile {module.__name__} on {threading.current_thread().name}")


def stage(name):
    loaded = kernels._COMPILED.get("pass") is not None
    events.append(f"{name} ({'loaded' if loaded else 'not loaded'})")
    if name == "planning: label offset":
        events.append("load thread" if any(t.name == "tracediff-kernel-load" for t in threading.enumerate())
                      else "no load thread")


report = compare_stores("samples/train.zarr", "samples/server_broken.zarr", CompareOptions(stage=stage))
print(json.dumps({"events": events, "report": report.to_dict()}))
'''


def _load_order(how: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LOAD_ORDER_SCRIPT, how], env=dict(os.environ, TRACEDIFF_KERNEL="fused"),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _without_times(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("elapsed_seconds", "timings")}


def test_a_first_load_of_the_kernels_comes_before_the_plan_which_then_reads_by_the_compiled_loop():
    """In a process that has loaded none of the compiled kernels, a compare whose pass uses them loads
    them before its plan, as a stage of its own (numba's setup beside the plan's threads cost more
    than the two in turn), and the plan then reads its samples by the compiled loop; once numba is
    set up (here: the alignment's kernels loaded first), or while a child process fills numba's empty
    cache, the pass's kernel loads on a background thread beside the plan. The report is the same
    either way, and with the plan reading in Python."""
    first = _load_order("fresh")
    events = first["events"]
    loading = events.index("loading compiled kernels (not loaded)")
    offset = events.index("planning: label offset (loaded)")
    assert loading < offset and events[offset + 1] == "no load thread"
    assert events[loading + 1] == "load on MainThread", events
    reads = [e for e in events[offset:] if e.endswith(" read")]
    assert reads and set(reads) == {"compiled read"}, events

    beside = _load_order("votes-first")
    assert not any(e.startswith("loading compiled kernels") for e in beside["events"]), beside["events"]
    assert "load on tracediff-kernel-load" in beside["events"], beside["events"]

    # A first compare after an install: a child fills numba's cache (11-15 s) while the plan runs.
    cold = _load_order("cold-cache")
    events = cold["events"]
    assert events.index("loading compiled kernels (not loaded)") < events.index("load on tracediff-kernel-load")
    assert "load on MainThread" not in events, events
    assert "compile tracediff.compare.rows.fused on tracediff-kernel-load" in events, events

    python = _load_order("python-reads")
    assert {e for e in python["events"] if e.endswith(" read")} == {"python read"}
    for other in (beside, cold, python):
        assert _without_times(other["report"]) == _without_times(first["report"])
