"""Benchmark `tracediff compare --dask`: the streaming pass on a LocalCluster of 1 vs 2 worker processes.

What it does:
  1. Builds a trainer and an engine store of ``--gb`` GiB of values each with bench_compare.py's own
     generators (imported, not copied), or takes any two store locations (``--reference``,
     ``--candidate``: paths or URLs, with ``--storage-option K=V`` passed to
     ``tracediff.store.open_store(location, storage_options=...)`` on the client and on every worker).
     ``--s3`` pushes the built stores to a bucket of moto's S3 server (a child process on 127.0.0.1)
     and compares the URLs.
  2. Warms the page cache, then per worker count (``--workers 1,2``) starts a LocalCluster of that many
     single-threaded worker processes on 127.0.0.1 (start-up timed apart) and runs
     ``compare_stores(reference, candidate)`` with its pass on the cluster, ``--repeat`` times; the same
     compare in-process (threads) for the baseline, interleaved. Wall time of the compare, GB/s =
     bytes of values of both sides / time, and peak RSS of every worker process (psutil, sampled every
     20 ms while the compare runs; the idle RSS before it for comparison). Every dask report must equal
     the in-process one (verdict, findings, metrics: the pass merges in block order).
  3. Writes (replaces) only the ``## bench_compare_dask`` section of ``--out`` (``--s3``:
     ``## bench_compare_dask_s3``); deletes what it made.

  ``--long-lived N`` measures instead what a long-lived cluster keeps: N compares one after the other
  on one LocalCluster of the largest ``--workers`` count (started once), each worker's RSS after each
  compare (nothing forced: no garbage collection, no malloc_trim) and its peak during it, every report
  checked equal to the first; writes ``## bench_compare_dask_long_lived`` (``--s3``:
  ``## bench_compare_dask_s3_long_lived``). The goal: RSS after compares 2..N within 10% of each other.

Run:  python benchmarks/bench_compare_dask.py               (0.5 GiB a store, writes benchmarks/RESULTS.md)
      python benchmarks/bench_compare_dask.py --quick       (0.1 GiB, one repeat, prints only)
      python benchmarks/bench_compare_dask.py --s3 --gb 0.25   (the stores read from a loopback S3 server)
      python benchmarks/bench_compare_dask.py --s3 --gb 0.25 --workers 2 --long-lived 10   (one cluster, 10 compares)
      python benchmarks/bench_compare_dask.py --reference s3://b/train.zarr --candidate s3://b/server.zarr \\
          --storage-option endpoint_url=http://127.0.0.1:9000 --storage-option anon=true
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTION = "## bench_compare_dask"
SECTION_S3 = "## bench_compare_dask_s3"
SECTION_LONG = "## bench_compare_dask_long_lived"
SECTION_S3_LONG = "## bench_compare_dask_s3_long_lived"
#: Worker RSS after compares 2..N may differ by this much (max / min - 1) and count as flat.
FLAT = 0.10
GIB = 1 << 30


def _bench_compare():
    """bench_compare.py's store generators and helpers (the same data as its benchmark)."""
    sys.path.insert(0, str(HERE))
    import bench_compare  # noqa: PLC0415

    return bench_compare


def _storage_options(pairs: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option {p!r}: expected KEY=VALUE")
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
    return out


class _PeakRSS:
    """Peak resident memory of some processes, sampled on a thread while it runs."""

    def __init__(self, pids: list[int], every: float = 0.02) -> None:
        import psutil  # noqa: PLC0415

        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.peak = {pid: 0 for pid in pids}
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for pid, proc in self.procs.items():
            with contextlib.suppress(Exception):  # a worker that died is reported by the compare
                self.peak[pid] = max(self.peak[pid], proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def __enter__(self) -> _PeakRSS:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _report_key(report) -> str:
    """What must not change between the in-process and the dask pass."""
    d = report.to_dict()
    return json.dumps({"verdict": d["verdict"], "findings": d["findings"], "metrics": d["metrics"],
                       "profiles": d.get("position_profiles")}, sort_keys=True, default=str)


def run(ref: str, cand: str, value_bytes: int, worker_counts: list[int], repeat: int,
        storage_options: dict[str, object]) -> dict:
    import distributed  # noqa: PLC0415

    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.compare.stream.cluster import DaskRunner  # noqa: PLC0415

    stages: dict[str, float] = {}

    def stage(name: str) -> None:
        stages[name] = time.perf_counter()

    def opts(**kw) -> CompareOptions:
        return CompareOptions(storage_options=storage_options or None, stage=stage, **kw)

    def pass_seconds() -> float:
        """The streaming pass alone: from the stage that starts it to the next one."""
        return stages["localising"] - stages["comparing rows"]

    compare_stores(ref, cand, opts())  # imports and first-touch costs out of the measured runs
    results: dict = {"inprocess": [], "dask": {}}
    baseline_key = None
    for n in worker_counts:
        t0 = time.perf_counter()
        cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL)
        try:
            with DaskRunner(cluster.scheduler_address, storage_options=storage_options) as runner:
                client = runner.start()
                client.wait_for_workers(n)
                pids = list(client.run(os.getpid).values())
                start_s = time.perf_counter() - t0
                runs = []
                for k in range(repeat + 1):  # the first run warms the workers (imports, buffers): not counted
                    t = time.perf_counter()
                    local = compare_stores(ref, cand, opts())
                    local_s = time.perf_counter() - t
                    local_pass = pass_seconds()
                    with _PeakRSS(pids) as mem:
                        idle = dict(mem.peak)
                        t = time.perf_counter()
                        report = compare_stores(ref, cand, opts(runner=runner))
                        dask_s = time.perf_counter() - t
                    dask_pass = pass_seconds()
                    key = _report_key(report)
                    baseline_key = baseline_key or _report_key(local)
                    same = key == baseline_key == _report_key(local)
                    if not same:
                        raise SystemExit(f"bench_compare_dask: the report on {n} workers differs from the in-process one")
                    print(f"  {n} worker(s){' (warm-up)' if k == 0 else ''}: {dask_s:.2f} s (pass {dask_pass:.2f} s, "
                          f"{value_bytes / dask_pass / 1e9:.2f} GB/s), in-process {local_s:.2f} s (pass "
                          f"{local_pass:.2f} s), worker peak RSS "
                          f"{', '.join(f'{v / 2**20:.0f}' for v in mem.peak.values())} MiB, same report",
                          file=sys.stderr, flush=True)
                    if k:
                        runs.append({"seconds": dask_s, "pass_seconds": dask_pass, "peak_rss": list(mem.peak.values()),
                                     "idle_rss": list(idle.values()), "pairs": report.plan.pairs,
                                     "verdict": report.verdict})
                        results["inprocess"].append((local_s, local_pass))
                results["dask"][n] = {"start_s": start_s, "runs": runs}
        finally:
            cluster.close()
    return results


def section(cmd: str, info: dict, data: dict, results: dict, value_bytes: int, wall: float) -> str:
    med = statistics.median
    lines = [
        SECTION, "",
        f"Command: `{cmd}`  ",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['mem_gib']:.0f} GiB; Python {platform.python_version()}, "
        f"torch {info['torch']}, zarr {info['zarr']}, distributed {info['distributed']}; load average "
        f"{os.getloadavg()[0]:.2f} at the end; whole run {wall:.0f} s.  ",
        f"Stores: {data['what']}; {value_bytes / 1e9:.2f} GB of values on both sides together, "
        f"{data['pairs']:,} aligned row pairs.",
        "",
        "`compare_stores` end to end (plan on the client, streaming pass as block tasks on a LocalCluster of N "
        "single-threaded worker processes on 127.0.0.1, the page cache warm), median of the measured runs after "
        "one warm-up run; throughput = bytes of values of both sides / wall time (streaming pass = its stage alone, the rest is the plan, localisation and findings on the client); worker memory = peak RSS of "
        "each worker process while the compare runs (psutil, every 20 ms), and before it (idle: interpreter, "
        "torch, the previous compare's buffers). In-process = the same compare with the pass on this "
        "process's threads (torch's thread count), run between the dask runs. Every dask report was checked "
        "equal to the in-process one (verdict, findings, metrics, profiles).",
        "",
        "| pass on | cluster start | compare | throughput | streaming pass | pass throughput | worker peak RSS | "
        "worker idle RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    inproc = med(x[0] for x in results["inprocess"])
    inproc_pass = med(x[1] for x in results["inprocess"])
    lines.append(f"| this process (threads) | - | {inproc:.2f} s | {value_bytes / inproc / 1e9:.2f} GB/s | "
                 f"{inproc_pass:.2f} s | {value_bytes / inproc_pass / 1e9:.2f} GB/s | - | - |")
    for n, r in results["dask"].items():
        s = med(x["seconds"] for x in r["runs"])
        ps = med(x["pass_seconds"] for x in r["runs"])
        peak = max(max(x["peak_rss"]) for x in r["runs"])
        idle = max(max(x["idle_rss"]) for x in r["runs"])
        lines.append(f"| {n} dask worker{'s' if n > 1 else ''} | {r['start_s']:.1f} s | {s:.2f} s | "
                     f"{value_bytes / s / 1e9:.2f} GB/s | {ps:.2f} s | {value_bytes / ps / 1e9:.2f} GB/s | "
                     f"{peak / 2**20:.0f} MiB | {idle / 2**20:.0f} MiB |")
    counts = list(results["dask"])
    if len(counts) >= 2:
        a = med(x["pass_seconds"] for x in results["dask"][counts[0]]["runs"])
        b = med(x["pass_seconds"] for x in results["dask"][counts[-1]]["runs"])
        lines += ["", f"Streaming pass on {counts[-1]} workers vs {counts[0]}: {a / b:.2f}x the throughput."]
    lines += [
        "",
        f"A worker's memory is the interpreter with torch plus, by construction, one block of raw rows of both "
        f"sides (16 MiB by default), the float32 sub-block buffers and the per-row metrics of the task it runs: "
        f"workers read their rows straight from the stores and never hold the trace (measured here at one store "
        f"size). On this shared {info['cores']}-core VM the client (plan: labels, alignment, sample) and the "
        f"workers share the cores with other jobs, so runs vary by 2x and 2 workers cannot double the pass. Stores at URLs: "
        f"`--s3` (a loopback moto server) or `--reference URL --candidate URL --storage-option K=V`.",
    ]
    return "\n".join(lines) + "\n"


def run_long_lived(ref: str, cand: str, compares: int, workers: int, storage_options: dict[str, object]) -> dict:
    """``compares`` compares on one LocalCluster of ``workers`` processes: per compare its time, each
    worker's peak RSS during it and its RSS once it returned (the runner has released the compare)."""
    import distributed  # noqa: PLC0415
    import psutil  # noqa: PLC0415

    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415
    from tracediff.compare.stream.cluster import DaskRunner  # noqa: PLC0415

    load_start = os.getloadavg()[0]
    cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                       dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL)
    runs: list[dict] = []
    try:
        with DaskRunner(cluster.scheduler_address, storage_options=storage_options) as runner:
            client = runner.start()
            client.wait_for_workers(workers)
            pids = sorted(client.run(os.getpid).values())
            procs = [psutil.Process(pid) for pid in pids]
            idle = [p.memory_info().rss for p in procs]
            first = None
            for k in range(compares):
                with _PeakRSS(pids) as mem:
                    t = time.perf_counter()
                    report = compare_stores(ref, cand, CompareOptions(storage_options=storage_options or None,
                                                                      runner=runner))
                    seconds = time.perf_counter() - t
                after = [p.memory_info().rss for p in procs]
                key = _report_key(report)
                first = first or key
                if key != first:
                    raise SystemExit(f"bench_compare_dask: compare {k + 1} on the long-lived cluster gave another report")
                runs.append({"seconds": seconds, "peak": [mem.peak[pid] for pid in pids], "after": after})
                print(f"  compare {k + 1}/{compares}: {seconds:.1f} s, worker RSS after "
                      f"{', '.join(f'{v / 2**20:.0f}' for v in after)} MiB (peak "
                      f"{', '.join(f'{v / 2**20:.0f}' for v in runs[-1]['peak'])} MiB)", file=sys.stderr, flush=True)
    finally:
        cluster.close()
    return {"workers": workers, "idle": idle, "runs": runs, "load_start": load_start}


def _spread(values: list[int]) -> float:
    return max(values) / min(values) - 1 if values and min(values) > 0 else float("nan")


def section_long_lived(cmd: str, info: dict, data: dict, res: dict, wall: float, heading: str) -> str:
    mib = 2**20
    n = res["workers"]
    runs = res["runs"]
    cols = [f"worker {w + 1} RSS after" for w in range(n)] + [f"worker {w + 1} peak" for w in range(n)]
    lines = [
        heading, "",
        f"Command: `{cmd}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}; tracediff {_bench_compare()._revision(REPO)}.  ",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['mem_gib']:.0f} GiB; Python {platform.python_version()}, "
        f"torch {info['torch']}, zarr {info['zarr']}, distributed {info['distributed']}; load average "
        f"{res['load_start']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; whole run {wall:.0f} s.  ",
        f"Stores: {data['what']}; {data['pairs']:,} aligned row pairs.",
        "",
        f"{len(runs)} compares one after the other on one LocalCluster of {n} single-threaded worker processes on "
        "127.0.0.1 (started once, as a team running compare in CI against one cluster would), each "
        "`compare_stores` with its streaming pass on it. RSS of each worker process (psutil) once the compare "
        "returned, with nothing forced (no garbage collection, no malloc_trim), and its peak during the compare "
        "(every 20 ms). Every report was checked equal to the first.",
        "",
        "| compare | time | " + " | ".join(cols) + " |",
        "|---" * (2 + len(cols)) + "|",
        "| before the first (idle) | - | " + " | ".join(f"{v / mib:.0f} MiB" for v in res["idle"]) + " |"
        + " - |" * n,
    ]
    for k, r in enumerate(runs):
        lines.append(f"| {k + 1} | {r['seconds']:.1f} s | " + " | ".join(f"{v / mib:.0f} MiB" for v in r["after"])
                     + " | " + " | ".join(f"{v / mib:.0f} MiB" for v in r["peak"]) + " |")
    later = runs[1:]
    after = max((_spread([r["after"][w] for r in later]) for w in range(n)), default=float("nan"))
    peak = max((_spread([r["peak"][w] for r in later]) for w in range(n)), default=float("nan"))
    verdict = "flat" if after <= FLAT else "NOT flat"
    lines += [
        "",
        f"From compare 2 to {len(runs)}: worker RSS after a compare within {after:.1%} (max / min - 1, the larger "
        f"of the workers), peak within {peak:.1%}: {verdict} by the goal of {FLAT:.0%}.",
    ]
    return "\n".join(lines) + "\n"


def _machine() -> dict:
    import distributed  # noqa: PLC0415
    import psutil  # noqa: PLC0415

    info = _bench_compare().machine()
    info.setdefault("cores", os.cpu_count())
    info["mem_gib"] = psutil.virtual_memory().total / GIB
    info["distributed"] = distributed.__version__
    return info


@contextlib.contextmanager
def _moto_server():
    """moto's S3 server (``moto_server``, from moto[server]) as a child process on a free port of
    127.0.0.1, with dummy credentials in this process's environment (inherited by the workers);
    yields its endpoint and stops it (by its pid) at the end."""
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if proc.poll() is not None:
                raise SystemExit(f"moto_server exited with {proc.returncode}: pip install 'moto[server]'")
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _push_both(ref: str, cand: str, options: dict) -> tuple[str, str, float]:
    import s3fs  # noqa: PLC0415

    from tracediff.store.push import push_store  # noqa: PLC0415

    bucket = f"bench-{os.getpid()}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    t0 = time.perf_counter()
    urls = []
    for local in (ref, cand):
        url = f"s3://{bucket}/{Path(local).name}"
        print(f"  pushing {local} to {url} ...", file=sys.stderr, flush=True)
        push_store(local, url, storage_options=options)
        urls.append(url)
    return urls[0], urls[1], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=None, help="GiB of values per built store (default 0.5; --quick 0.1)")
    p.add_argument("--width", type=int, default=3 * 2048, help="row width of built stores (3 segments), default 6144")
    p.add_argument("--workers", default="1,2", help="worker counts to measure, comma-separated (default 1,2)")
    p.add_argument("--repeat", type=int, default=None, help="measured runs per worker count (default 3; --quick 1)")
    p.add_argument("--reference", help="an existing reference store location (path or URL): nothing is built")
    p.add_argument("--candidate", help="an existing candidate store location (path or URL), with --reference")
    p.add_argument("--storage-option", action="append", default=[], metavar="K=V",
                   help="passed to tracediff.store.open_store(location, storage_options=...) on the client and "
                        "the workers (repeat for several)")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (default benchmarks/RESULTS.md; --quick prints only unless given)")
    p.add_argument("--dir", type=Path, default=HERE / "_data", help="scratch folder (git-ignored)")
    p.add_argument("--quick", action="store_true", help="small stores, one run: a smoke test")
    p.add_argument("--long-lived", type=int, default=0, metavar="N",
                   help="instead: N compares on one LocalCluster of the largest --workers count, worker RSS after each "
                        f"(writes '{SECTION_LONG}', with --s3 '{SECTION_S3_LONG}')")
    p.add_argument("--s3", action="store_true",
                   help="push the built stores to a bucket of moto's S3 server started on 127.0.0.1 (a child "
                        "process, stopped at the end) and compare the URLs: workers read the bucket; writes the "
                        f"'{SECTION_S3}' section")
    args = p.parse_args(argv)
    if args.s3 and args.reference:
        p.error("--s3 pushes the stores it builds: give no --reference/--candidate")
    if bool(args.reference) != bool(args.candidate):
        p.error("--reference and --candidate go together")
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        p.error("--workers: positive counts, e.g. 1,2")
    if args.long_lived < 0:
        p.error("--long-lived N: a number of compares")
    gib = args.gb if args.gb is not None else (0.1 if args.quick else 0.5)
    repeat = args.repeat or (1 if args.quick else 3)
    out = args.out if args.out is not None else (None if args.quick else HERE / "RESULTS.md")
    cmd = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]) if argv is None else " ".join(argv)
    options = _storage_options(args.storage_option)
    bc = _bench_compare()
    t_start = time.perf_counter()
    work = None
    cleanup = contextlib.ExitStack()
    try:
        if args.reference:
            ref, cand = args.reference, args.candidate
            data = {"what": f"{ref} and {cand}"}
        else:
            if not bc._enough_disk(args.dir, int(gib * GIB) * 2):
                return 2
            work = args.dir / f"bench_compare_dask-{os.getpid()}"
            work.mkdir()
            print(f"building {gib:g} GiB a store in {work} ...", file=sys.stderr, flush=True)
            built = bc.build(work, gib, args.width, peer_files=False)
            ref, cand = built["reference"]["store"], built["candidate"]["store"]
            data = {"what": f"bench_compare.py's trainer and engine stores, {gib:g} GiB of bf16 values each, width "
                            f"{args.width} (3 segments), {built['sequences']} sequences, uncompressed"}
            t = bc.warm(Path(ref), Path(cand))
            print(f"  built in {built['build_s']:.0f} s, warmed in {t:.1f} s", file=sys.stderr, flush=True)
            if args.s3:
                moto = cleanup.enter_context(_moto_server())
                options = {**options, "endpoint_url": moto}
                ref, cand, seconds = _push_both(ref, cand, options)
                data["what"] += (f"; pushed to a bucket of moto's S3 server on {moto} (a child process; "
                                 f"push took {seconds:.1f} s) and read from there by the client and every worker")
        from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415

        probe = compare_stores(ref, cand, CompareOptions(storage_options=options or None))
        value_bytes = sum(side.rows * side.width * (2 if side.dtype == "bfloat16" else 4)
                          for side in (probe.reference, probe.candidate))
        data["pairs"] = probe.plan.pairs
        if args.long_lived:
            heading = SECTION_S3_LONG if args.s3 else SECTION_LONG
            res = run_long_lived(ref, cand, args.long_lived, max(counts), options)
            text = section_long_lived(cmd, _machine(), data, res, time.perf_counter() - t_start, heading)
        else:
            results = run(ref, cand, value_bytes, counts, repeat, options)
            text = section(cmd, _machine(), data, results, value_bytes, time.perf_counter() - t_start)
            heading = SECTION_S3 if args.s3 else SECTION
            if args.s3:
                text = text.replace(SECTION, SECTION_S3, 1)
        print(text)
        if out is not None:
            bc.write_section(out, text, heading)
            print(f"wrote the {heading} section of {out}", file=sys.stderr)
    finally:
        cleanup.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())

