"""README's cost table, written from measurements so it cannot drift from the tree it describes.

    python benchmarks/readme_costs.py tests   # after .ci/run: take its record (.ci/last-run.json)
    python benchmarks/readme_costs.py demo    # time the demo command from nothing, in a temporary venv
    python benchmarks/readme_costs.py --check # exit 1 when README's table is not what costs.json says

``tests`` and ``demo`` store their figures in ``benchmarks/costs.json`` (committed: the one current
figure per set-up command; earlier figures live in git) and rewrite the table between README's
markers. ``tests/test_readme_figures.py`` checks the table against costs.json and costs.json against
the tree (the number of tests collected now, the commits measured).

``demo`` installs into a temporary venv (about 3.5 GB; it checks for 10 GiB free first) and deletes
it after; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COSTS = ROOT / "benchmarks" / "costs.json"
CI_RUN = ROOT / ".ci" / "run"
LAST_RUN = ROOT / ".ci" / "last-run.json"
BEGIN = "<!-- cost table: written by benchmarks/readme_costs.py from benchmarks/costs.json -->"
END = "<!-- end of cost table -->"
#: The demo as a new user types it, from a fresh clone; ``{venv}`` is ``.venv`` in README.
DEMO_COMMAND = ("python3 -m venv {venv} && {venv}/bin/pip install -q torch==2.13.0 && "
                "{venv}/bin/pip install -q -e . && {venv}/bin/tracediff demo")
_DEMO_RUNS = 5
_FREE_NEEDED = 10 * 2**30


def ci_test_command(ci_run: Path = CI_RUN) -> str:
    """The command ``.ci/run`` runs: its last line."""
    lines = [ln.strip() for ln in ci_run.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[-1]


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, sec = divmod(seconds, 60)
    return f"{minutes} min {sec} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _stamp(record: dict[str, Any]) -> str:
    return f"{record['commit'][:7]}, {record['date']}"


def render_table(costs: dict[str, Any], test_command: str) -> str:
    demo, tests = costs["demo"], costs["tests"]
    demo_cost = (f"{_duration(demo['fresh_seconds'])} from nothing, into a {_gb(demo['disk_bytes'])} `.venv`; "
                 f"`tracediff demo` itself {demo['demo_median_seconds']:.1f} s (median of {demo['runs']}) "
                 f"({_stamp(demo)})")
    skipped = f"{tests['skipped']:,} skipped" if tests["skipped"] else "none skipped"
    setup = tests.get("setup_seconds")
    total = tests["pytest_seconds"] + (setup or 0)
    disk = sum(tests["disk_bytes"].values())
    venvs = ", ".join(f"`{v}` {_gb(n)}" for v, n in sorted(tests["disk_bytes"].items()))
    reruns = len(tests.get("reruns") or [])
    rerun = f" ({reruns} of them on a rerun after failing once)" if reruns else ""
    tests_cost = (f"{_duration(total)} on an installed machine ("
                  + (f"setup {_duration(setup)}, then " if setup is not None else "")
                  + f"{tests['passed']:,} tests passed{rerun}, {skipped}, in {_duration(tests['pytest_seconds'])}); "
                  f"{_gb(disk)} of venvs ({venvs}) ({_stamp(tests)})")
    demo_command = DEMO_COMMAND.format(venv=".venv")
    return "\n".join([
        BEGIN,
        "| what | command | cost (measured) |",
        "|---|---|---|",
        f"| the demo: compares the shipped broken and fixed trace pairs | `{demo_command}` | {demo_cost} |",
        f"| every test, as CI runs them (`.ci/run`) | `{test_command}` | {tests_cost} |",
        END,
    ])


def readme_table(readme: Path = README) -> str:
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{readme}: the cost table's markers are missing ({BEGIN!r} ... {END!r})")
    return text[start:end + len(END)]


def _write_readme(costs: dict[str, Any]) -> None:
    table = render_table(costs, ci_test_command())
    README.write_text(README.read_text().replace(readme_table(), table))


def _load_costs() -> dict[str, Any]:
    return json.loads(COSTS.read_text())


def _save_costs(costs: dict[str, Any]) -> None:
    COSTS.write_text(json.dumps(costs, indent=2, sort_keys=True) + "\n")


#: README's own figure checks: in the run that measures a new test count they fail by design (the table
#: still quotes the last count); they are run again once the table is rewritten from that run.
FIGURE_CHECKS = "tests/test_readme_figures.py"


def take_ci_record(reruns: list[str]) -> dict[str, Any]:
    """``.ci/last-run.json`` as costs.json keeps it; refuses a run that measured uncommitted work, or one
    that failed anywhere but in README's figure checks (see :func:`settle_figure_checks`)."""
    try:
        record = json.loads(LAST_RUN.read_text())
    except OSError:
        raise SystemExit(f"{LAST_RUN}: no record; run .ci/run first (it writes one when the whole suite runs)") from None
    if record.get("dirty") or not record.get("commit"):
        raise SystemExit(f"{LAST_RUN}: the run measured uncommitted changes (field dirty); commit, then rerun .ci/run")
    if reruns:  # tests that failed in the run and pass when run again: said in the table, counted as passed
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *reruns], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"--rerun: {' '.join(reruns)} fail again: the run did not pass")
        record = {**record, "passed": record["passed"] + len(reruns), "failed": record["failed"] - len(reruns),
                  "reruns": list(reruns)}
        if record.get("failed_ids") is not None:
            record["failed_ids"] = [t for t in record["failed_ids"] if t not in reruns]
    failed_ids = record.get("failed_ids")
    only_figures = failed_ids is None or all(t.startswith(FIGURE_CHECKS + "::") or t in reruns for t in failed_ids)
    if record["errors"] or not only_figures or record["passed"] + record["skipped"] + record["failed"] != record["collected"]:
        raise SystemExit(f"{LAST_RUN}: the run did not pass (fields failed/errors/passed); its time is not the suite's")
    return record


def _figure_checks() -> list[str]:
    """The figure checks that fail on the tree as it is now (their node ids)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", FIGURE_CHECKS],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]


def settle_figure_checks(record: dict[str, Any], before: list[str]) -> dict[str, Any]:
    """The record as README quotes it: the run's failures must be exactly the figure checks that fail
    with the old table (``before``); they are counted as passed, and :func:`main` runs them again on
    the new table (restoring the old one if any still fails)."""
    if not record["failed"]:
        return record
    known = record.get("failed_ids")
    if len(before) != record["failed"] or (known is not None and sorted(known) != sorted(before)):
        raise SystemExit(f"{LAST_RUN}: {record['failed']} failed in the run, {len(before)} of README's figure checks "
                         f"fail now ({', '.join(before) or 'none'}): the run's failures are not only the stale figures")
    return {**record, "passed": record["passed"] + record["failed"], "failed": 0, "failed_ids": [],
            "figure_checks_rerun": before}


def disk_bytes(path: Path) -> int:
    """What ``du -s`` counts: allocated blocks, hard links once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def git_commit(root: Path = ROOT) -> dict[str, Any]:
    """The commit a run measured, and whether tracked files differed from it (None: not a git checkout)."""
    def _git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(dirty) if dirty is not None else None}


def demo_record() -> dict[str, Any]:
    at = git_commit()
    if at["dirty"] or not at["commit"]:
        raise SystemExit("the tree has uncommitted changes; commit first so the figure names what it measured")
    with tempfile.TemporaryDirectory(prefix="tracediff-demo-cost-") as tmp:
        if shutil.disk_usage(tmp).free < _FREE_NEEDED:
            raise SystemExit(f"{tmp}: under {_FREE_NEEDED // 2**30} GiB free; the demo's venv needs about 3.5 GB")
        venv = Path(tmp) / "venv"
        started = time.perf_counter()
        subprocess.run(DEMO_COMMAND.format(venv=venv), shell=True, cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        fresh = time.perf_counter() - started
        runs = []
        for _ in range(_DEMO_RUNS):
            started = time.perf_counter()
            subprocess.run([str(venv / "bin" / "tracediff"), "demo"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            runs.append(time.perf_counter() - started)
        disk = disk_bytes(venv)
    return {"commit": at["commit"], "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
            "fresh_seconds": round(fresh, 1), "demo_median_seconds": round(statistics.median(runs), 2),
            "runs": _DEMO_RUNS, "disk_bytes": disk}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("tests", "demo"), help="which figure to take or measure")
    parser.add_argument("--check", action="store_true", help="exit 1 when README's table is not costs.json's")
    parser.add_argument("--rerun", action="append", default=[], metavar="TEST_ID",
                        help="(tests) a test that failed in the run: run it again; if it passes it counts as "
                             "passed and the table says it was rerun")
    args = parser.parse_args(argv)
    if args.check or not args.what:
        expected = render_table(_load_costs(), ci_test_command())
        if readme_table() != expected:
            print("README.md's cost table is not what benchmarks/costs.json says: run "
                  "python benchmarks/readme_costs.py tests (or demo)", file=sys.stderr)
            return 1
        return 0
    costs = _load_costs() if COSTS.exists() else {}
    if args.what == "tests":
        record = take_ci_record(args.rerun)
        stale = _figure_checks() if record["failed"] else []
        old_costs, old_readme = COSTS.read_text() if COSTS.exists() else None, README.read_text()
        costs["tests"] = settle_figure_checks(record, stale)
        _save_costs(costs)
        _write_readme(costs)
        still = _figure_checks() if stale else []
        if still:  # the table did not make them pass: the old figures stay
            if old_costs is not None:
                COSTS.write_text(old_costs)
            README.write_text(old_readme)
            raise SystemExit(f"README's figure checks still fail with the new table: {', '.join(still)}")
    else:
        costs["demo"] = demo_record()
    _save_costs(costs)
    _write_readme(costs)
    print(f"{COSTS.relative_to(ROOT)} and README.md: {args.what} = {json.dumps(costs[args.what], sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
