"""Benchmark what a user waits for at the command line: `tracediff --help`, a compare of the shipped
192-row samples, and the demo, each a whole fresh process (interpreter start-up and imports included).

With ``--against REV`` the same commands of another revision run interleaved in the same session
(a git worktree of REV on ``PYTHONPATH``, the same venv), so the ratio is measured under the same
load: this VM is shared and noisy, absolute seconds are not comparable across runs.

Also lists the slowest imports of a compare (``python -X importtime``), which is most of its time.

Run:  python benchmarks/bench_cli.py --against a3e5e1a       (writes the '## bench_cli' section of RESULTS.md)
      python benchmarks/bench_cli.py --repeats 3 --no-write  (prints only)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SAMPLES = REPO / "samples"
SECTION = "## bench_cli"


def _ratio(base: float, mine: float) -> str:
    """This tree's speed against the other tree's, in words that stay true below 1."""
    if mine <= 0 or base <= 0:
        return "n/a"
    return f"{base / mine:.2f}x faster" if base >= mine else f"{mine / base:.2f}x slower"


def _commands(out_dir: Path) -> dict[str, list[str]]:
    return {
        "tracediff --help": ["--help"],
        "tracediff compare train server_fixed -q (192 rows)": ["compare", str(SAMPLES / "train.zarr"),
                                                               str(SAMPLES / "server_fixed.zarr"), "-q"],
        "tracediff compare train server_broken (192 rows, full text)": ["compare", str(SAMPLES / "train.zarr"),
                                                                        str(SAMPLES / "server_broken.zarr")],
        "tracediff demo": ["demo", "--out", str(out_dir)],
    }


def run_once(args: list[str], tree: Path | None) -> float:
    env = dict(os.environ)
    env.pop("TRACEDIFF_CONFIG", None)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tracediff", *args], env=env, capture_output=True, text=True,
                          cwd=tree or REPO, timeout=300)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench_cli: {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return seconds


def slowest_imports(top: int = 8) -> list[tuple[str, float]]:
    """The top-level imports of a compare process that cost the most (cumulative, seconds)."""
    code = ("import sys; sys.argv = ['tracediff', 'compare', sys.argv[1], sys.argv[2], '-q']\n"
            "from tracediff.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, str(SAMPLES / "train.zarr"),
                           str(SAMPLES / "server_fixed.zarr")], capture_output=True, text=True, timeout=300)
    found: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m[2]) <= 1:  # top-level imports only (one space of indent in importtime's tree)
            name = m[3].split(".")[0]
            found[name] = found.get(name, 0.0) + int(m[1]) / 1e6
    return sorted(found.items(), key=lambda kv: -kv[1])[:top]


def _revision(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" + local changes" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="another git revision, run interleaved in the same session")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench_cli-"))
    base_tree: Path | None = None
    try:
        if args.against:
            base_tree = scratch / "base"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), args.against],
                           check=True, capture_output=True)
        trees: list[tuple[str, Path | None]] = [("this tree", None)]
        if base_tree is not None:
            trees.append((args.against, base_tree))
        times: dict[tuple[str, str], list[float]] = {}
        commands = _commands(scratch / "demo")
        for _ in range(args.repeats):  # interleaved: each round runs every command of every tree once
            for name, cmd in commands.items():
                for label, tree in trees:
                    times.setdefault((name, label), []).append(run_once(cmd, tree))
        imports = slowest_imports()
    finally:
        if base_tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                           capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)

    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = ["command", f"this tree ({_revision(REPO)}): median (min)"]
    if args.against:
        head += [f"`{args.against}`: median (min)", "ratio (medians)"]
    lines = [SECTION, "", f"Run {stamp} on {platform.node()} ({os.cpu_count()} CPUs), whole processes, "
             f"{args.repeats} interleaved rounds:", "",
             f"    python benchmarks/bench_cli.py{' --against ' + args.against if args.against else ''}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in commands:
        mine = times[(name, "this tree")]
        row = [f"`{name}`", f"{statistics.median(mine):.2f} s ({min(mine):.2f})"]
        if args.against:
            base = times[(name, args.against)]
            row += [f"{statistics.median(base):.2f} s ({min(base):.2f})", _ratio(statistics.median(base), statistics.median(mine))]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Slowest top-level imports of a compare process (this tree, cumulative): "
              + ", ".join(f"{name} {sec:.2f} s" for name, sec in imports) + "."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(args.out, text, SECTION)


if __name__ == "__main__":
    main()
