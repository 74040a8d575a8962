"""Benchmark the cost of recording on a live server: vLLM's OpenAI server (the CPU build) with an
EAGLE-3 draft, under one fixed load, with recording off, on for every row, and sampled by request.

Served: a random-weight Llama target (8 layers x 512, 4 heads, float32) and a one-layer EAGLE-3 draft
reading three of its layers, both written to a temporary folder; ``--num-speculative-tokens 3``. Load:
``--requests`` completions (prompts of ``--prompt-len`` random token ids, the same prompts in every
configuration, ``--max-tokens`` new tokens each, ``ignore_eos``, greedy), streamed, ``--concurrency``
at a time (a closed loop: a request starts when one ends), after two warm-up requests.

Configurations (a fresh server each, recorded by the vLLM venv's ``tracediff``; all of them once per round, in turn, for ``--rounds`` rounds,
so that a slower minute of this shared VM falls on every configuration alike):

* ``off``: the server alone (no tracediff in its processes);
* ``every row``: ``tracediff record --adapter vllm -o STORE -- <server>``;
* ``sampled 1%``: the same with ``--sample-requests 0.01`` (whole requests chosen by a hash of their
  prompt; the others pass the hooks without a copy);
* ``switched off``: the same with ``--start-off`` (hooks installed, recording off: the floor of an
  always-installed recorder).

A configuration whose option this tracediff lacks is left out and said so. Measured per run: output
tokens per second (completion tokens over the time from the first request sent to the last one
done), inter-token latency (the gaps between a stream's consecutive chunks, every stream's gaps
together: p50 and p99; a chunk may carry several tokens when drafts are accepted), and what the store
holds. The ratio to ``off`` is taken round by round (the runs next to each other), then its median.

Run:  python benchmarks/bench_serve_record.py                (3 rounds; writes '## bench_serve_record')
      python benchmarks/bench_serve_record.py --rounds 1 --requests 16 --no-write
Needs: .venv-vllm (bash requirements/frameworks-vllm.sh) or TRACEDIFF_VLLM_PYTHON; about 1.5 GB free.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from results_md import RESULTS, write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTION = "## bench_serve_record"
HIDDEN, LAYERS, VOCAB = 512, 8, 4096
AUX = [1, 4, 7]
NEED_FREE = 1.5e9


def vllm_python() -> Path:
    python = Path(os.environ.get("TRACEDIFF_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    if not python.is_file():
        sys.exit(f"bench_serve_record: {python} missing: bash requirements/frameworks-vllm.sh installs vLLM")
    return python


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEDIFF_CONFIG", "VIRTUAL_ENV")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
    return env


def build_models(root: Path) -> tuple[Path, Path]:
    from tracediff.testing.eagle3 import write_eagle3_draft
    from tracediff.testing.tiny_llama import build_tiny_llama

    tl = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)
    tl.model.save_pretrained(root / "target")
    draft = write_eagle3_draft(root / "draft", tl.config, AUX, where="top", seed=3)
    return root / "target", draft.path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(python: Path, target: Path, draft: Path, port: int, concurrency: int) -> list[str]:
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--skip-tokenizer-init",
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
            "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
            "--shutdown-timeout", "10", "--speculative-config", spec]


def record_options() -> str:
    done = subprocess.run([str(vllm_python().parent / "tracediff"), "record", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    return done.stdout


CONFIGS: list[tuple[str, list[str] | None]] = [
    ("off", None),
    ("every row", []),
    ("every row, background", ["--commit", "background"]),
    ("sampled 1%", ["--sample-requests", "0.01"]),
    ("sampled 1%, background", ["--sample-requests", "0.01", "--commit", "background"]),
    ("switched off", ["--start-off"]),
]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM to the process we started (record forwards it), SIGKILL to its session after 180 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None


def one_request(url: str, prompt: list[int], max_tokens: int) -> tuple[int, list[float]]:
    """One streamed completion: (completion tokens, arrival times of its chunks)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    arrivals: list[float] = []
    tokens = usage = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = int(chunk["usage"].get("completion_tokens") or 0)
            for choice in chunk.get("choices") or []:
                got = len(choice.get("token_ids") or [])
                if got:
                    tokens += got
                    arrivals.append(time.perf_counter())
    return usage or tokens, arrivals


def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, Any]:
    """Every prompt sent, ``concurrency`` at a time; tokens/s and chunk gaps."""
    todo = list(prompts)
    lock = threading.Lock()
    tokens: list[int] = []
    gaps: list[float] = []
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop(0)
            try:
                n, arrivals = one_request(url, prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001  (counted and reported; the run is then void)
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                tokens.append(n)
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    gaps.sort()

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3 if gaps else float("nan")

    return {"tokens": sum(tokens), "wall_s": wall, "tok_s": sum(tokens) / wall, "itl_p50_ms": pct(0.50),
            "itl_p99_ms": pct(0.99), "requests": len(tokens), "errors": errors}


def store_facts(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"rows": 0, "bytes": 0, "requests": 0}
    from tracediff.store import open_store

    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    store = open_store(path)
    try:
        rows = store.rows("fc_in") if "fc_in" in store.taps else 0
        seqs: set[Any] = set()
        if rows:
            for stream in store.tap_streams("fc_in"):
                seqs.update(int(s) for s in set(stream.labels(("seq",))["seq"].tolist()))
    finally:
        store.close()
    return {"rows": int(rows), "bytes": size, "requests": len(seqs)}


def run_one(name: str, extra: list[str] | None, models: tuple[Path, Path], work: Path, prompts: list[list[int]],
            args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = work / "store.zarr"
    shutil.rmtree(store, ignore_errors=True)
    cmd = serve_command(vllm_python(), *models, port, args.concurrency)
    if extra is not None:
        cmd = [str(vllm_python().parent / "tracediff"), "record", "--adapter", "vllm", "-o", str(store), "--overwrite",
               *extra, "--", *cmd]
    log = work / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True,
                                cwd=work)
    try:
        wait_healthy(url, proc, log)
        load(url, prompts[:2], 8, 2)  # warm-up
        result = load(url, prompts, args.max_tokens, args.concurrency)
    finally:
        code = stop(proc)
    result.update(store_facts(store), name=name, exit=code)
    if code:  # why, from record's own lines (the log goes with the work folder)
        said = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("tracediff:")]
        print(f"{name}: exit {code}:\n" + "\n".join(said[-8:]), file=sys.stderr, flush=True)
    shutil.rmtree(store, ignore_errors=True)
    if result["errors"]:
        raise RuntimeError(f"{name}: {len(result['errors'])} requests failed: {result['errors'][0]}\n"
                           f"{log.read_text()[-3000:]}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-write", action="store_true", help="print only; RESULTS.md unchanged")
    ap.add_argument("--only", default="", help="comma-separated configuration names (with --no-write): these alone")
    args = ap.parse_args()
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < NEED_FREE:
        sys.exit(f"bench_serve_record: {free / 1e9:.1f} GB free in {tempfile.gettempdir()}, needs {NEED_FREE / 1e9:.1f}")
    options = record_options()
    configs = [(n, e) for n, e in CONFIGS if e is None or all(o in options for o in e if o.startswith("--"))]
    left_out = [n for n, _ in CONFIGS if n not in dict(configs)]
    if args.only:
        if not args.no_write:
            sys.exit("bench_serve_record: --only measures a part of the table: give --no-write too")
        wanted = {n.strip() for n in args.only.split(",")}
        configs = [(n, e) for n, e in configs if n in wanted or n == "off"]  # off: the ratios' base
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in configs}
    with tempfile.TemporaryDirectory(prefix="bench_serve_record.") as tmp:
        work = Path(tmp)
        models = build_models(work)
        for r in range(args.rounds):
            for name, extra in configs:
                res = run_one(name, extra, models, work, prompts, args)
                runs[name].append(res)
                print(f"round {r + 1} {name:>12}: {res['tok_s']:7.1f} tok/s  ITL p50 {res['itl_p50_ms']:6.1f} ms  "
                      f"p99 {res['itl_p99_ms']:7.1f} ms  store {res['rows']} rows / {res['requests']} requests  "
                      f"exit {res['exit']}", flush=True)
    text = report(runs, left_out, args)
    print(text)
    if not args.no_write:
        write_section(RESULTS, text, SECTION)
        print(f"wrote {SECTION} of {RESULTS}")


def report(runs: dict[str, list[dict[str, Any]]], left_out: list[str], args: argparse.Namespace) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    vllm = subprocess.run([str(vllm_python()), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, cwd="/").stdout.strip() or "?"
    off = runs.get("off") or []
    lines = [
        SECTION, "",
        f"{time.strftime('%Y-%m-%d')}, commit {commit}, vllm-cpu {vllm}, {platform.machine()} "
        f"{os.cpu_count()} cores; 1-minute load average {os.getloadavg()[0]:.2f} at the end (the VM is shared).",
        f"Load: {args.requests} streamed completions, {args.concurrency} at a time, prompts of {args.prompt_len} "
        f"token ids, {args.max_tokens} new tokens each; target Llama {LAYERS} x {HIDDEN} float32, EAGLE-3 draft of "
        f"layers {AUX}, 3 speculative tokens; each configuration a fresh server, {args.rounds} rounds interleaved.",
        "",
        "| configuration | output tok/s (median) | vs off (median of per-round ratios) | ITL p50 ms | ITL p99 ms "
        "| rows recorded (median) | requests recorded / sent | exit codes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        each = ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        ratios = [r["tok_s"] / o["tok_s"] for r, o in zip(rs, off, strict=False)] if off else []
        lines.append(
            f"| {name} | {statistics.median(r['tok_s'] for r in rs):.1f} ({each}) "
            f"| {statistics.median(ratios) if ratios else float('nan'):.3f}x | {statistics.median(r['itl_p50_ms'] for r in rs):.1f} "
            f"| {statistics.median(r['itl_p99_ms'] for r in rs):.1f} | {int(statistics.median(r['rows'] for r in rs))} "
            f"| {int(statistics.median(r['requests'] for r in rs))} / {args.requests} "
            f"| {', '.join(str(r['exit']) for r in rs)} |")
    if left_out:
        lines += ["", f"Left out (this tracediff's record has no such option): {', '.join(left_out)}."]
    lines += ["", "Recorded requests count the fc_in tap's sequences, the two warm-up requests included; a sampled run records the requests whose "
              "prompt hash falls under the rate (the same prompts every run)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
