"""Benchmark `tracediff lint`: rows per second and peak memory on offline data of real width.

Data: speculators' offline layout, ``hs_<i>.safetensors`` with ``hidden_states [T, 4, H]`` (three aux
layers and the last layer) and ``token_ids [T]``, Llama-3.1-8B width (H = 4096), in bf16 and in
hs_connectors' FP8 (float8_e4m3fn + one scale per token, quantised with its own
``quantize_tensor_to_fp8``), and the bf16 files imported into a trace store. Random values (what is
timed is the reading and the per-slot statistics, which do not depend on the values). Timed: the whole
command in a fresh process (``tracediff lint DIR --json FILE``, interpreter start-up included), its
peak RSS from the kernel (``ru_maxrss`` of the child), and rows / s and GB / s of stored data.

Run:  python benchmarks/bench_lint.py               (prints, and writes '## bench_lint' of RESULTS.md)
      python benchmarks/bench_lint.py --no-write --files 4
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import RESULTS, write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTION = "## bench_lint"
SLOTS = 4


def write_files(folder: Path, files: int, tokens: int, hidden: int, fp8: bool) -> int:
    """``files`` offline files; returns their total size in bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for i in range(files):
        hs = torch.randn(tokens, SLOTS, hidden, generator=gen).to(torch.bfloat16)
        tensors = {"hidden_states": hs, "token_ids": torch.randint(0, 128000, (tokens,), generator=gen)}
        if fp8:
            from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

            tensors["hidden_states"], tensors[SCALES_KEY] = quantize_tensor_to_fp8(hs)
        path = folder / f"hs_{i}.safetensors"
        save_file(tensors, str(path))
        total += path.stat().st_size
    return total


def timed(argv: list[str], expect: int = 0) -> tuple[float, float]:
    """Seconds and peak RSS (MiB, that process's own, from wait4) of one fresh ``tracediff`` process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tracediff", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    assert proc.returncode == expect, err[-2000:]
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = args.files * args.tokens
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sizes = {"bf16": write_files(root / "bf16", args.files, args.tokens, args.hidden, fp8=False),
                 "fp8": write_files(root / "fp8", args.files, args.tokens, args.hidden, fp8=True)}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-m", "tracediff", "import", "speculators", str(root / "bf16"), "-o",
                        str(root / "store.zarr")], check=True, capture_output=True, env=env)
        sizes["store"] = (rows - args.files) * (SLOTS - 1) * args.hidden * 2  # fc_in: the aux slots, bf16
        for name, what in (("bf16", "speculators files, bf16"), ("fp8", "hs_connectors FP8 files (+ scales)"),
                           ("store", "trace store (tap fc_in, 3 slots)")):
            target = root / ("store.zarr" if name == "store" else name)
            seconds, peak = timed(["lint", str(target), "--json", str(root / f"{name}.json"), "--no-progress"])
            n = rows - (args.files if name == "store" else 0)  # fc_in drops each sample's last row
            table.append(f"| {what} | {sizes[name] / 1e9:.2f} GB | {n} | {seconds:.2f} s | {n / seconds:,.0f} | "
                         f"{sizes[name] / 1e9 / seconds:.2f} | {peak:,.0f} MiB |")
    lines = [
        SECTION, "",
        f"`python benchmarks/bench_lint.py` on {platform.machine()} ({os.cpu_count()} CPUs), Python "
        f"{platform.python_version()}: {args.files} files of {args.tokens} tokens x {SLOTS} slots x {args.hidden}"
        f"{' (Llama-3.1-8B width)' if args.hidden == 4096 else ''}, random values; one fresh `tracediff lint DIR --json FILE` process each (start-up "
        f"included; no --target or --bank); peak RSS of that process. 1-minute load average "
        f"{os.getloadavg()[0]:.1f} at the end (the VM is shared: seconds vary with it).", "",
        "| data | stored | rows | time | rows/s | GB/s | peak RSS |", "|---|---|---|---|---|---|---|", *table, "",
        "Memory is bounded by one file (or one store chunk) and its per-step temporaries: a 100 k-sample data set "
        "takes the same peak, plus 8 bytes a slot per sample for the duplicate check.", "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(RESULTS, text, SECTION)


if __name__ == "__main__":
    main()
