"""Benchmark `tracediff compare` against the peer approach (one `.pt` per step, `torch.load`, compare whole).

What it does:
  1. Builds two trace stores of at least ``--gb`` GiB of values each, with ``TraceWriter`` directly:
     a trainer store (sequences in order, one training step = several whole sequences) and an engine
     store (the same tokens, rows interleaved the way a continuous-batching server emits them: chunked
     prefill of newly admitted requests plus one decode row per running request each step). Values are
     the reference values plus small noise (a "match"), drawn from a pool of random bf16 rows so that
     generating them costs little.
  2. Writes the same rows as the peer approach stores them: one ``.pt`` file per step (``torch.save``
     of a dict of tensors: values, seq, position), trainer steps and engine steps.
  3. Warms the page cache (reads every file once), then measures, each in a fresh child process:
     ``compare_stores(reference, candidate)`` end to end, and the peer compare (``torch.load`` of every
     step file of both sides, ``torch.cat``, pair rows by (sequence, position), cosine per row per
     segment). Wall time inside the child (imports excluded), GB/s = bytes of values of both sides /
     time, peak RSS of the child (``os.wait4``'s ``ru_maxrss``).
  4. Writes (replaces) only the ``## bench_compare`` section of ``--out``; deletes every file it made.

Run:  python benchmarks/bench_compare.py            (2 GiB a store, writes benchmarks/RESULTS.md)
      python benchmarks/bench_compare.py --quick    (0.25 GiB, one repeat, prints only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from results_md import write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

GIB = 1 << 30
SEGMENTS = 3
HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# --------------------------------------------------------------------------------------------------
# Data: a trainer and an engine view of the same token sequences
# --------------------------------------------------------------------------------------------------


def _sequences(total_rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Token sequences (lengths 256..2048) adding up to at least ``total_rows`` positions."""
    seqs, rows = [], 0
    while rows < total_rows:
        n = int(rng.integers(256, 2049))
        seqs.append(rng.integers(0, 128_000, size=n, dtype=np.int64))
        rows += n
    return seqs


def _trainer_steps(seqs: list[np.ndarray], step_rows: int = 8192):
    """One training step = consecutive whole sequences, about ``step_rows`` rows."""
    step, batch, rows = 0, [], 0
    for s, toks in enumerate(seqs):
        batch.append((s, np.arange(toks.size, dtype=np.int64)))
        rows += toks.size
        if rows >= step_rows:
            yield step, batch, "train"
            step, batch, rows = step + 1, [], 0
    if batch:
        yield step, batch, "train"


def _engine_steps(seqs: list[np.ndarray], rng: np.random.Generator, max_running: int = 48, chunk: int = 1024):
    """Continuous batching: each step runs up to ``chunk`` prefill tokens (chunked prefill of admitted
    requests, in arrival order) plus one decode row for every request past its prompt."""
    prompt = [max(1, int(t.size * rng.uniform(0.5, 0.9))) for t in seqs]
    waiting = list(range(len(seqs)))
    prefilling: list[int] = []  # admitted, prompt not finished
    decoding: list[int] = []
    done_pos = [0] * len(seqs)  # next position to run
    step = 0
    while waiting or prefilling or decoding:
        while waiting and len(prefilling) + len(decoding) < max_running:
            prefilling.append(waiting.pop(0))
        parts = []
        budget = chunk
        for s in list(prefilling):
            if budget == 0:
                break
            take = min(budget, prompt[s] - done_pos[s])
            parts.append((s, np.arange(done_pos[s], done_pos[s] + take, dtype=np.int64)))
            done_pos[s] += take
            budget -= take
            if done_pos[s] == prompt[s]:
                prefilling.remove(s)
                if done_pos[s] < seqs[s].size:
                    decoding.append(s)
        phase_parts = [(s, p, "prefill") for s, p in parts]
        for s in list(decoding):
            if any(s == q for q, _ in parts):
                continue  # just finished its prefill this step: decodes from the next one
            phase_parts.append((s, np.array([done_pos[s]], dtype=np.int64), "decode"))
            done_pos[s] += 1
            if done_pos[s] == seqs[s].size:
                decoding.remove(s)
        if phase_parts:
            yield step, phase_parts
        step += 1


class _Values:
    """Reference rows drawn from a pool of random rows by a hash of (sequence, position); the candidate
    pool is the reference pool times (1 + 2^-8 noise), rounded to bf16 again: a numerics-level match."""

    def __init__(self, width: int, rng: np.random.Generator, pool_rows: int = 2048) -> None:
        import torch  # noqa: PLC0415

        size = width // SEGMENTS
        scale = np.repeat(np.array([1.0, 4.0, 16.0][:SEGMENTS], dtype=np.float32), size)[: width]
        base = torch.from_numpy(rng.standard_normal((pool_rows, width), dtype=np.float32) * scale)
        noise = torch.from_numpy(rng.standard_normal((pool_rows, width), dtype=np.float32)) * (2.0 ** -8)
        self.ref = base.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        self.cand = (base * (1 + noise)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        self.pool_rows = pool_rows

    def index(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        h = (seq.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (pos.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9))
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
        return (h % np.uint64(self.pool_rows)).astype(np.int64)


def _labels(seqs: list[np.ndarray], parts, seq_ids: np.ndarray, step: int) -> dict[str, np.ndarray]:
    from tracediff.store import phase_code  # noqa: PLC0415

    seq_col, pos_col, tok, nxt, phase = [], [], [], [], []
    for s, pos, ph in parts:
        toks = seqs[s]
        seq_col.append(np.full(pos.size, seq_ids[s], dtype=np.int64))
        pos_col.append(pos)
        tok.append(toks[pos])
        nxt.append(np.where(pos + 1 < toks.size, toks[np.minimum(pos + 1, toks.size - 1)], -1))
        phase.append(np.full(pos.size, phase_code(ph), dtype=np.int8))
    cat = {k: np.concatenate(v) for k, v in
           (("seq", seq_col), ("position", pos_col), ("token_id", tok), ("next_token_id", nxt), ("phase", phase))}
    cat["step"] = np.full(cat["seq"].size, step, dtype=np.int64)
    cat["valid"] = np.ones(cat["seq"].size, dtype=bool)
    return cat


def build(work: Path, gib: float, width: int, seed: int = 0, peer_files: bool = True) -> dict:
    """Both stores and (unless ``peer_files`` is false) both peer folders; returns sizes and counts."""
    import torch  # noqa: PLC0415

    from tracediff.store import TraceWriter, create_store  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    row_bytes = width * 2
    total_rows = -(-int(gib * GIB) // row_bytes)
    seqs = _sequences(total_rows, rng)
    values = _Values(width, rng)
    size = width // SEGMENTS
    labels = [f"hs{i}" for i in (3, 31, 59)][:SEGMENTS]
    # Engine request ids have nothing to do with the trainer's sample ids: alignment is by content.
    engine_ids = rng.permutation(len(seqs)).astype(np.int64) + 100_000
    trainer_ids = np.arange(len(seqs), dtype=np.int64)
    out = {"sequences": len(seqs), "rows": sum(int(t.size) for t in seqs)}

    def write(side: str, steps, ids: np.ndarray, pool: np.ndarray, role: str) -> dict:
        store = work / f"{side}.zarr"
        peer = work / f"peer_{side}"
        if peer_files:
            peer.mkdir()
        create_store(store, role=role, meta={"model": "bench", "hidden_size": size, "aux_layer_ids": [3, 31, 59]})
        writer = TraceWriter(store, "fc_in", "rank0", width=width, dtype="bfloat16",
                             attrs={"segment_size": size, "segment_labels": labels})
        pending: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
        pending_rows = 0
        files = 0

        def flush() -> None:
            nonlocal pending, pending_rows
            if pending:
                vals = np.concatenate([v for v, _ in pending])
                lab = {k: np.concatenate([lab[k] for _, lab in pending]) for k in pending[0][1]}
                writer.append(vals, lab)
            pending, pending_rows = [], 0

        for step, parts in steps:
            lab = _labels(seqs, parts, ids, step)
            tseq = np.concatenate([np.full(p.size, s, dtype=np.int64) for s, p, _ in parts])
            vals = pool[values.index(tseq, lab["position"])]
            pending.append((vals, lab))
            pending_rows += vals.shape[0]
            if pending_rows >= 4096:
                flush()
            # The peer: one pickle per step, as SGLang's dumper writes them. It is given the trainer's
            # sample id on both sides (the request -> sample mapping for free).
            if peer_files:
                torch.save({"values": torch.from_numpy(vals.view(np.int16)).view(torch.bfloat16),
                            "seq": torch.from_numpy(tseq), "position": torch.from_numpy(lab["position"])},
                           peer / f"step_{step:06d}.pt")
            files += 1
        flush()
        writer.close()
        return {"store": str(store), "peer": str(peer), "rows": writer.counts.rows,
                "value_bytes": writer.counts.rows * row_bytes, "store_bytes": _du(store),
                "peer_bytes": _du(peer) if peer_files else 0, "peer_files": files}

    t0 = time.perf_counter()
    trainer = ((step, [(s, p, ph) for s, p in batch]) for step, batch, ph in _trainer_steps(seqs))
    out["reference"] = write("ref", trainer, trainer_ids, values.ref, "trainer")
    out["candidate"] = write("cand", _engine_steps(seqs, rng), engine_ids, values.cand, "server")
    out["build_s"] = time.perf_counter() - t0
    return out


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warm(*paths: Path) -> float:
    """Write back what the build left dirty (the kernel would otherwise flush it during the measured
    runs, on the same two cores), then read every file once so that the measured runs read from the
    page cache."""
    t0 = time.perf_counter()
    os.sync()
    buf = bytearray(8 << 20)
    for root in paths:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# The two measured programs (each runs in its own child process)
# --------------------------------------------------------------------------------------------------


def child_compare(ref: str, cand: str) -> dict:
    # What every compare imports (zarr, the findings) is imported first: the measured call is the
    # work itself. Not torch nor deepdiff: a compare imports neither (issue #27), and importing them
    # here would count ~250 MiB that a compare never holds in its peak RSS. numba is left to the call:
    # a large pass loads it itself (in the background, while the plan runs).
    import zarr  # noqa: PLC0415, F401

    import tracediff.compare.findings.build  # noqa: PLC0415, F401
    from tracediff.compare import compare_stores  # noqa: PLC0415

    try:  # what the tracediff program sets for itself (trees before it have no such module)
        from tracediff.runtime import return_freed_memory  # noqa: PLC0415
    except ImportError:
        pass
    else:
        return_freed_memory()
    t0 = time.perf_counter()
    report = compare_stores(ref, cand)
    dt = time.perf_counter() - t0
    cos = [m.cos_mean for m in report.metrics]
    return {"seconds": dt, "verdict": report.verdict, "pairs": report.plan.pairs,
            "cos_mean": cos, "findings": [f.kind for f in report.findings]}


def child_peer(ref_dir: str, cand_dir: str, segments: int = SEGMENTS) -> dict:
    import torch  # noqa: PLC0415

    t0 = time.perf_counter()

    def load(folder: str):
        vals, seq, pos = [], [], []
        for f in sorted(Path(folder).glob("step_*.pt")):
            d = torch.load(f)
            vals.append(d["values"])
            seq.append(d["seq"])
            pos.append(d["position"])
        v = torch.cat(vals)
        del vals
        return v, torch.cat(seq), torch.cat(pos)

    rv, rs, rp = load(ref_dir)
    cv, cs, cp = load(cand_dir)
    # Pair rows by (sample, position), then cosine per row per segment in float32, in blocks of rows.
    rkey = rs * (1 << 32) + rp
    ckey = cs * (1 << 32) + cp
    rorder = torch.argsort(rkey)
    where = torch.searchsorted(rkey[rorder], ckey)
    ref_row = rorder[where.clamp_max(rkey.numel() - 1)]
    ok = rkey[ref_row] == ckey
    n, width = cv.shape
    cos = torch.empty(n, segments)
    for start in range(0, n, 4096):
        sl = slice(start, min(n, start + 4096))
        a = cv[sl].float().view(-1, segments, width // segments)
        b = rv[ref_row[sl]].float().view(-1, segments, width // segments)
        cos[sl] = torch.nn.functional.cosine_similarity(a, b, dim=2)
    cos = cos[ok]
    dt = time.perf_counter() - t0
    return {"seconds": dt, "pairs": int(ok.sum()), "cos_mean": cos.mean(dim=0).tolist(),
            "cos_min": cos.amin(dim=0).tolist()}


def _vm_hwm() -> int | None:
    """This process's peak resident set (VmHWM), in bytes; None where /proc has none."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_child(kind: str, a: str, b: str, tree: Path = REPO) -> dict:
    """Run one measured program in a fresh interpreter (with the tracediff of source ``tree``); its
    own peak RSS comes from wait4."""
    t0 = time.perf_counter()
    script = tree / "benchmarks" / "bench_compare.py"
    proc = subprocess.Popen([sys.executable, str(script), "--child", kind, a, b], stdout=subprocess.PIPE, cwd=tree)
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    process_seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed with exit code {proc.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    # The child's own high-water mark (VmHWM, read by the child): wait4's ru_maxrss keeps the peak of
    # the process before its exec, i.e. of this driver holding the data it built.
    result["peak_rss_bytes"] = result.pop("vm_hwm_bytes", None) or usage.ru_maxrss * 1024  # Linux: KiB
    result["process_seconds"] = process_seconds
    result["cpu_seconds"] = usage.ru_utime + usage.ru_stime
    return result


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def machine() -> dict:
    import torch  # noqa: PLC0415
    import zarr  # noqa: PLC0415

    def first(path: str, key: str) -> str:
        try:
            with open(path) as fh:
                return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(key)), "")
        except OSError:
            return ""

    cpu = first("/proc/cpuinfo", "model name")
    mem = first("/proc/meminfo", "MemTotal")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "memory": mem, "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "zarr": zarr.__version__, "numpy": np.__version__}


def _median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs)))


def section(args, cmd: str, info: dict, data: dict, ours: list[dict], peer: list[dict], wall: float,
            probe: dict, loads: list[float], base: list[dict] | None = None) -> str:
    both = data["reference"]["value_bytes"] + data["candidate"]["value_bytes"]
    gb = 1e9

    def row(name: str, runs: list[dict], disk: int) -> str:
        t = _median([r["seconds"] for r in runs])
        rss = max(r["peak_rss_bytes"] for r in runs)
        times = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        proc = _median([r["process_seconds"] for r in runs])
        cpu = _median([r["cpu_seconds"] for r in runs])
        return (f"| {name} | {disk / gb:.2f} GB | {t:.2f} s ({times}) | **{both / gb / t:.2f} GB/s** | "
                f"{proc:.2f} s | {cpu:.2f} s | {rss / 2**20:,.0f} MiB |")

    t_ours = _median([r["seconds"] for r in ours])
    t_peer = _median([r["seconds"] for r in peer]) if peer else float("nan")
    rss_ours = max(r["peak_rss_bytes"] for r in ours)
    ok_speed = both / gb / t_ours >= 2.0
    ok_rss = rss_ours < GIB
    ok_peer = t_ours < t_peer if peer else None
    rss_median = _median([r["peak_rss_bytes"] for r in ours])
    per_row = max(0.0, (rss_median - probe["peak_rss_bytes"]) / max(1, data["rows"] - probe["rows"]))
    fixed = rss_median - per_row * data["rows"]
    row_bytes = args.width * 2
    limit_rows = (GIB - fixed) / per_row if per_row > 0 else float("inf")
    m = info
    lines = [
        "## bench_compare",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}. Machine: {m['cpu']}, {m['cores']} cores (torch threads "
        f"{m['torch_threads']}), {m['memory']} RAM, {m['os']}; Python {m['python']}, torch {m['torch']}, "
        f"zarr {m['zarr']}, numpy {m['numpy']}.",
        "",
        f"Command: `{cmd}` (whole run {wall:.0f} s, building the data included). The VM is shared: its "
        f"1-minute load average was {loads[0]:.1f} before the measured runs and {loads[-1]:.1f} after them.",
        "",
        f"Data: two stores of {data['reference']['value_bytes'] / GIB:.2f} GiB and "
        f"{data['candidate']['value_bytes'] / GIB:.2f} GiB of values ({data['rows']:,} rows each, width "
        f"{args.width} bf16 = {SEGMENTS} segments of {args.width // SEGMENTS}, {data['sequences']} sequences of "
        f"256-2048 tokens, uncompressed 256-row chunks, the writer's default). Reference: trainer order (whole "
        f"sequences, one step ~8192 rows). Candidate: engine order (continuous batching of up to 48 requests: "
        f"chunked prefill of 1024 tokens a step plus one decode row per running request; "
        f"{data['candidate']['peer_files']} steps), other request ids, values = reference + 2^-8 relative noise "
        f"rounded to bf16 again (verdict: {ours[0]['verdict']}, {ours[0]['pairs']:,} row pairs). Peer: the same "
        f"rows as one `.pt` per step ({data['reference']['peer_files']} + {data['candidate']['peer_files']} "
        f"files, `torch.save` of bf16 values + sample id + position), every file `torch.load`ed, `torch.cat`, "
        f"rows paired by (sample, position) -- the peer is given the request -> sample mapping for free -- and "
        f"cosine per row per segment in float32 in blocks of 4096 rows.",
        "",
        "Method: page cache warm (every file read once before the runs); each run is a fresh child process; "
        "time = wall time of the call inside the child (`compare_stores(ref, cand)`, or the peer's load + "
        "compare), its modules imported first; GB/s = bytes of values of both sides (the reference's plus the "
        "candidate's) / time, 1 GB = 10^9 bytes; whole process = the child from start to exit (interpreter, "
        "imports, the call), CPU time = its user + system time; peak RSS = the child's `ru_maxrss` from "
        "`wait4`, the largest over the runs. Medians of the runs, every run's time in brackets.",
        "",
        "| approach | on disk (both sides) | time, median (runs) | throughput | whole process | CPU time | peak RSS |",
        "|---|---|---|---|---|---|---|",
        row("`tracediff compare` (`compare_stores`)", ours,
            data["reference"]["store_bytes"] + data["candidate"]["store_bytes"]),
    ]
    if base:
        lines.append(row(f"`tracediff compare` of `{args.against}` ({_revision(args.against)})", base,
                         data["reference"]["store_bytes"] + data["candidate"]["store_bytes"]))
    if peer:
        lines.append(row("peer: `.pt` per step, `torch.load`, compare whole", peer,
                         data["reference"]["peer_bytes"] + data["candidate"]["peer_bytes"]))
    if base:
        t_base = _median([r["seconds"] for r in base])
        lines += ["", f"This tree ({_revision(REPO)}) against `{args.against}`, runs interleaved in the same "
                      f"process tree: time ratio {t_ours / t_base:.2f} (medians), CPU time ratio "
                      f"{_median([r['cpu_seconds'] for r in ours]) / _median([r['cpu_seconds'] for r in base]):.2f}, "
                      f"peak RSS ratio {rss_ours / max(r['peak_rss_bytes'] for r in base):.2f}."]
    lines += [
        "",
        "Targets: at least 2 GB/s from page cache on 2 cores: "
        f"{'met' if ok_speed else 'NOT met'} ({both / gb / t_ours:.2f} GB/s); peak RSS under 1 GB whatever "
        f"the store size: {'met' if ok_rss else 'NOT met'} at this size ({rss_ours / 2**20:,.0f} MiB at most, "
        f"median {rss_median / 2**20:,.0f} MiB; median {probe['peak_rss_bytes'] / 2**20:,.0f} MiB on stores of "
        f"{probe['rows']:,} rows, an eighth the size: "
        + (f"about {per_row:,.0f} bytes a row (row index, pairs, per-row metrics) on top of about "
           f"{fixed / 2**20:,.0f} MiB (interpreter, numpy, zarr, numba's code once the fused kernel is loaded, the plan's 2048-row samples), so 1 GiB would be "
           f"reached near {limit_rows / 1e6:.1f} M rows, {limit_rows * row_bytes / GIB:.0f} GiB a store at this "
           f"width" if per_row > 0 else
           "no growth with the row count above the run-to-run spread of a few tens of MiB; the row index, "
           "pairs and per-row metrics take a few hundred bytes a row")
        + "); faster than the peer: "
        + ("not measured" if ok_peer is None else
           f"{'met' if ok_peer else 'NOT met'} ({t_peer / t_ours:.1f}x faster, "
           f"{max(r['peak_rss_bytes'] for r in peer) / rss_ours:.0f}x less memory)") + ".",
        "",
    ]
    return "\n".join(lines)


def _revision(tree: Path) -> str:
    """The git commit of a source tree (short), or 'unknown'."""
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" + local changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _enough_disk(folder: Path, needed: int) -> bool:
    """Whether ``folder`` (created) has 3x the ``needed`` bytes free; says so when not."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < 3 * needed:
        print(f"bench_compare: {folder} has {free / 1e9:.1f} GB free; this run needs {needed / 1e9:.1f} GB "
              f"and refuses to start with less than 3x that ({3 * needed / 1e9:.1f} GB)", file=sys.stderr)
    return free >= 3 * needed


#: The issue's table: (segment width, GiB of values a store) for 3 x 4096 bf16, and for 3 x 64 the row
#: counts 0.5 / 2 / 8 M (as GiB of 384-byte rows).
MATRIX = [(4096, 0.25), (4096, 1.0), (4096, 3.0),
          (64, 0.5e6 * 384 / GIB), (64, 2e6 * 384 / GIB), (64, 8e6 * 384 / GIB)]
MATRIX_SECTION = "## bench_compare_matrix"


def run_matrix(args: argparse.Namespace, cmd: str) -> int:
    """Every point of :data:`MATRIX`, one after the other (build, warm, tracediff and the peer in the
    same run, delete): time, throughput, rows a second, peak RSS, and the peer's ratio."""
    points = [(w, g) for w, g in MATRIX if args.max_gb is None or g <= args.max_gb]
    if not points:
        print(f"bench_compare: --max-gb {args.max_gb} leaves no point of the matrix (the smallest is "
              f"{min(g for _, g in MATRIX):.2f} GiB a store)", file=sys.stderr)
        return 2
    if not _enough_disk(args.dir, max(int(g * GIB) for _, g in points) * 2 * (1 if args.no_peer else 2)):
        return 2
    rows_out = []
    t_start = time.perf_counter()
    loads = [os.getloadavg()[0]]
    for seg, gib in points:
        work = args.dir / f"bench_compare-matrix-{os.getpid()}"
        work.mkdir()
        try:
            print(f"building 3 x {seg}, {gib:.3g} GiB a store in {work} ...", file=sys.stderr, flush=True)
            data = build(work, gib, 3 * seg, peer_files=not args.no_peer)
            ref, cand = data["reference"], data["candidate"]
            warm(Path(ref["store"]), Path(cand["store"]))
            ours = [run_child("compare", ref["store"], cand["store"]) for _ in range(args.repeat or 1)]
            peer = []
            if not args.no_peer:
                warm(Path(ref["peer"]), Path(cand["peer"]))
                peer = [run_child("peer", ref["peer"], cand["peer"]) for _ in range(args.repeat or 1)]
            t = _median([r["seconds"] for r in ours])
            value_bytes = data["rows"] * 3 * seg * 2 * 2  # both sides, bf16
            row = {"width": f"3 x {seg}", "gib": gib, "rows": data["rows"], "seconds": t,
                   "gbps": value_bytes / t / 1e9, "rows_per_s": data["rows"] / t,
                   "process_seconds": _median([r["process_seconds"] for r in ours]),
                   "rss_mib": max(r["peak_rss_bytes"] for r in ours) / 2**20, "verdict": ours[0]["verdict"]}
            if peer:
                row["peer_seconds"] = _median([r["seconds"] for r in peer])
                row["peer_rss_mib"] = max(r["peak_rss_bytes"] for r in peer) / 2**20
            rows_out.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    loads.append(os.getloadavg()[0])
    info = machine()
    lines = [MATRIX_SECTION, "",
             f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {info.get('cpu', '')}, "
             f"{os.cpu_count()} cores. Tree {_revision(REPO)}. Command: `{cmd}` (whole run "
             f"{time.perf_counter() - t_start:.0f} s; 1-minute load average {loads[0]:.1f} before, {loads[-1]:.1f} after).",
             "",
             "Each point: two stores built as in `## bench_compare` (trainer order vs engine order, values = reference "
             "+ bf16 noise, a match), page cache warm, each measurement a fresh child process; time = the "
             "`compare_stores` call (imports excluded), whole process = interpreter start to exit; GB/s = bf16 values "
             "of both sides / time; the peer is SGLang-style `.pt` step files (`torch.load`, pair, cosine), in the "
             "same run.", "",
             "| rows a side | values a side | compare | throughput | aligned rows/s | whole process | peak RSS "
             "| peer | peer RSS | tracediff vs peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        peer_t = r.get("peer_seconds")
        lines.append(
            f"| {r['rows']:,} of {r['width']} | {r['gib']:.2f} GiB | {r['seconds']:.2f} s | {r['gbps']:.2f} GB/s | "
            f"{r['rows_per_s'] / 1e6:.2f} M | {r['process_seconds']:.2f} s | {r['rss_mib']:.0f} MiB | "
            + (f"{peer_t:.2f} s | {r['peer_rss_mib']:.0f} MiB | {peer_t / r['seconds']:.1f}x |" if peer_t else "- | - | - |"))
    text = "\n".join(lines)
    print(text)
    out = args.out if args.out is not None else HERE / "RESULTS.md"
    write_section(out, text, MATRIX_SECTION)
    print(f"wrote the {MATRIX_SECTION} section of {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=None, help="GiB of values per store (default 2; --quick 0.25)")
    p.add_argument("--width", type=int, default=3 * 2048, help="row width (3 segments), default 6144")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (default benchmarks/RESULTS.md; --quick prints only unless given)")
    p.add_argument("--dir", type=Path, default=HERE / "_data", help="scratch folder (git-ignored)")
    p.add_argument("--repeat", type=int, default=None, help="measured runs of each approach (default 3; --quick 1)")
    p.add_argument("--no-peer", action="store_true", help="skip the peer approach")
    p.add_argument("--against", type=Path, default=None,
                   help="another tracediff source tree (e.g. a git worktree of an older commit): its compare is "
                        "measured on the same stores, interleaved with this tree's, for a same-run ratio")
    p.add_argument("--keep", action="store_true", help="keep the data (for profiling)")
    p.add_argument("--quick", action="store_true", help="small stores, one run: a smoke test")
    p.add_argument("--matrix", action="store_true",
                   help="the issue's table: 3 x 4096 at 0.25 / 1 / 3 GiB and 3 x 64 at 0.5 / 2 / 8 M rows, each with "
                        "the peer; writes the '## bench_compare_matrix' section")
    p.add_argument("--max-gb", type=float, default=None, help="--matrix: skip points larger than this (GiB a store)")
    p.add_argument("--child", nargs=3, metavar=("KIND", "A", "B"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, a, b = args.child
        result = child_compare(a, b) if kind == "compare" else child_peer(a, b)
        result["vm_hwm_bytes"] = _vm_hwm()
        print(json.dumps(result), flush=True)
        return 0
    if args.matrix:
        return run_matrix(args, "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]) if argv is None
                          else " ".join(argv))
    if args.width % SEGMENTS:
        p.error(f"--width must be a multiple of {SEGMENTS}")
    gib = args.gb if args.gb is not None else (0.25 if args.quick else 2.0)
    repeat = args.repeat or (1 if args.quick else 3)
    out = args.out if args.out is not None else (None if args.quick else HERE / "RESULTS.md")
    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]) if argv is None else " ".join(argv)

    if not _enough_disk(args.dir, int(gib * GIB) * 2 * (1 if args.no_peer else 2)):
        return 2
    work = args.dir / f"bench_compare-{os.getpid()}"
    work.mkdir()
    t_start = time.perf_counter()
    try:
        print(f"building {gib:g} GiB a store (+ peer files) in {work} ...", file=sys.stderr, flush=True)
        data = build(work, gib, args.width)
        print(f"  built in {data['build_s']:.0f} s: {data['rows']:,} rows, {data['sequences']} sequences",
              file=sys.stderr, flush=True)
        ref, cand = data["reference"], data["candidate"]
        ours, peer = [], []
        loads = [os.getloadavg()[0]]
        t = warm(Path(ref["store"]), Path(cand["store"]))
        print(f"  stores warmed in {t:.1f} s", file=sys.stderr, flush=True)
        base: list[dict] = []
        for _ in range(repeat):
            ours.append(run_child("compare", ref["store"], cand["store"]))
            r = ours[-1]
            print(f"  compare: {r['seconds']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
                  f"{r['verdict']}, cos {r['cos_mean']}", file=sys.stderr, flush=True)
            if args.against is not None:
                base.append(run_child("compare", ref["store"], cand["store"], tree=args.against))
                r = base[-1]
                print(f"  compare of {args.against}: {r['seconds']:.2f} s, peak RSS "
                      f"{r['peak_rss_bytes'] / 2**20:.0f} MiB, {r['verdict']}", file=sys.stderr, flush=True)
        if not args.no_peer:
            t = warm(Path(ref["peer"]), Path(cand["peer"]))
            print(f"  peer files warmed in {t:.1f} s", file=sys.stderr, flush=True)
            for _ in range(repeat):
                peer.append(run_child("peer", ref["peer"], cand["peer"]))
                r = peer[-1]
                print(f"  peer: {r['seconds']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
                      f"cos {r['cos_mean']}", file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
        # The same compare on stores an eighth the size: how peak RSS grows with the row count.
        probe_dir = work / "probe"
        probe_dir.mkdir()
        small = build(probe_dir, gib / 8, args.width, peer_files=False)
        warm(Path(small["reference"]["store"]), Path(small["candidate"]["store"]))
        probes = [run_child("compare", small["reference"]["store"], small["candidate"]["store"]) for _ in range(repeat)]
        probe = {"rows": small["rows"], "peak_rss_bytes": _median([r["peak_rss_bytes"] for r in probes])}
        print(f"  probe ({gib / 8:g} GiB a store): peak RSS {probe['peak_rss_bytes'] / 2**20:.0f} MiB (median)",
              file=sys.stderr, flush=True)
        text = section(args, cmd, machine(), data, ours, peer, time.perf_counter() - t_start, probe, loads, base)
        print(text)
        if out is not None:
            write_section(out, text, "## bench_compare")
            print(f"wrote the bench_compare section of {out}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
