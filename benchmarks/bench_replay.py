"""Benchmark `tracediff replay`: a 3 x 4096 EAGLE-3 draft replayed on 10k rows a side.

What it does:
  1. Checks the free disk (the draft is ~0.8 GB in bf16, each store ~0.25 GB), then writes a one-layer
     EAGLE-3 draft of Llama-3-8B's shape (hidden 4096, 32 heads of 128, 8 KV heads, MLP 14336, fc
     3 x 4096 -> 4096, a 32,000-token vocabulary with its own embedding; random bf16 weights) and two
     stores of ``--rows`` rows of width 3 x 4096 bf16 in sequences of ``--seq-len`` (the "server"
     store = the trainer's rows plus bf16-size noise).
  2. Runs ``tracediff replay TRAIN SERVER --draft DRAFT`` in a fresh process with the default
     options (3 steps; step 0 scored at 4,096 evenly spread starts, steps 1-2 from 1,024 of them; the
     checkpoint's bf16; a, b, z replayed, c reused from b when the fix changes nothing). Wall time of
     the whole process (imports and the compare included), its CPU time and peak RSS (``wait4``).
  3. Writes (replaces) the ``## bench_replay`` section of ``--out``; deletes every file it made.

Run:  python benchmarks/bench_replay.py                 (10k rows, writes benchmarks/RESULTS.md)
      python benchmarks/bench_replay.py --rows 2000     (prints only unless --out is given)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_compare import machine  # noqa: E402
from results_md import write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0}


def build(work: Path, rows: int, seq_len: int) -> dict:
    import torch  # noqa: PLC0415

    from tracediff.record.recorder import Recorder  # noqa: PLC0415
    from tracediff.testing.eagle3 import write_eagle3_draft  # noqa: PLC0415

    t0 = time.perf_counter()
    draft = write_eagle3_draft(work / "draft", LLAMA3_8B, [2, 16, 29], dtype=torch.bfloat16, own_embedding=True).path
    width = 3 * LLAMA3_8B["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    scale = torch.empty(width).uniform_(0.2, 5.0, generator=gen)  # uneven dimensions, as trained states are
    n_seqs = -(-rows // seq_len)
    for side in ("train", "server"):
        with Recorder(work / f"{side}.zarr", role=side) as rec:
            rec.declare("fc_in", segment_size=LLAMA3_8B["hidden_size"])
            g = torch.Generator().manual_seed(1)
            for s in range(n_seqs):
                n = min(seq_len, rows - s * seq_len)
                values = torch.randn(n, width, generator=g) * scale
                if side == "server":
                    values = values + torch.randn(n, width, generator=torch.Generator().manual_seed(s)) * scale / 256
                tokens = torch.randint(0, LLAMA3_8B["vocab_size"], (n + 1,), generator=g)
                rec.capture("fc_in", values.to(torch.bfloat16), labels={
                    "seq": f"s{s}", "position": torch.arange(n), "token_id": tokens[:n],
                    "next_token_id": tokens[1:], "step": s, "phase": "train"})
    return {"draft": draft, "build_seconds": time.perf_counter() - t0,
            "draft_bytes": sum(f.stat().st_size for f in draft.iterdir()),
            "store_bytes": sum(f.stat().st_size for f in (work / "train.zarr").rglob("*") if f.is_file())}


def run(work: Path, draft: Path) -> dict:
    cmd = [sys.executable, "-m", "tracediff", "replay", str(work / "train.zarr"), str(work / "server.zarr"),
           "--draft", str(draft), "--json", str(work / "replay.json")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"replay failed ({proc.returncode}): {err.decode()[-2000:]}")
    import json  # noqa: PLC0415
    import resource  # noqa: PLC0415

    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the replay process is our only child
    report = json.loads((work / "replay.json").read_text())["replay"]
    return {"wall": wall, "cpu": children.ru_utime + children.ru_stime, "peak_rss": children.ru_maxrss * 1024,
            "positions": report["positions"], "sequences": report["sequences"],
            "stdout": out.decode()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--seq-len", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/RESULTS.md at 10k rows)")
    args = parser.parse_args(argv)
    free = shutil.disk_usage(args.dir).free
    need = 2 * 1 << 30
    if free < need:
        print(f"bench_replay: {args.dir} has {free / 2**30:.1f} GiB free, needs {need / 2**30:.0f}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tracediff-bench-replay-", dir=args.dir))
    try:
        data = build(work, args.rows, args.seq_len)
        result = run(work, data["draft"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = machine()
    cmd = "python benchmarks/bench_replay.py" + (f" --rows {args.rows}" if args.rows != 10_000 else "")
    text = "\n".join([
        "## bench_replay", "",
        f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {info['cpu']}, {info['cores']} cores, "
        f"torch {info['torch']}): a 3 x 4096 EAGLE-3 draft (Llama-3-8B shape, 32k vocabulary, "
        f"{data['draft_bytes'] / 2**30:.2f} GiB bf16) replayed on {result['positions']} positions a side "
        f"({result['sequences']} sequences of {args.seq_len}; stores of {data['store_bytes'] / 2**30:.2f} GiB each).", "",
        "| | result |", "|---|---|",
        f"| `tracediff replay` wall time (whole process: imports, compare, a, b, z) | {result['wall']:.1f} s |",
        f"| CPU time | {result['cpu']:.1f} s |",
        f"| peak RSS | {result['peak_rss'] / 2**20:,.0f} MiB |",
        "", "Defaults: 3 draft steps; every row's step-0 key computed, step 0 scored at 4,096 evenly spread starts, steps 1-2 from 1,024 of them, z at a quarter; bf16 "
        "(the checkpoint's dtype); (c) reused from (b) (the fix changes nothing on a matching pair).", ""])
    print(text)
    out = args.out if args.out is not None else (HERE / "RESULTS.md" if args.rows == 10_000 else None)
    if out is not None:
        write_section(out, text, "## bench_replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
