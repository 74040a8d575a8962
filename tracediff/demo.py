"""The demo: the README's first command, run on the traces shipped in ``samples/``.

A draft was trained on ``cat(hs0, hs3, hs6)`` of a tiny Llama; the server's aux-layer ids make it
feed ``cat(hs3, hs6, hs8_pre_norm)`` (the seed bug, see ``samples/README.md``). The demo
compares the trainer with the broken server and with the fixed one, names the broken server's
layers against the bank, writes the reports and says where they are. It only reads the shipped
stores (``samples/make_samples.py`` made them): no recording, no network, no GPU.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tracediff.compare import CompareOptions, compare_stores
from tracediff.compare.plan.identify import Identification, identify_segments, render_identification
from tracediff.compare.results import Report
from tracediff.errors import ReportWriteError, UsageError
from tracediff.report import write_json, write_report
from tracediff.report.text import fix_lines, render_summary
from tracediff.store import open_store

#: The stores the demo needs, by role, as ``samples/make_samples.py`` names them.
SAMPLE_STORES: dict[str, str] = {
    "train": "train.zarr",
    "broken": "server_broken.zarr",
    "fixed": "server_fixed.zarr",
    "bank": "bank.zarr",
}
#: What the broken pair must show: the seed bug is a shift by one slot, hs0 lost, a new layer fed.
SEED_BUG_KINDS = frozenset({"segment_order", "segment_missing", "segment_extra"})


@dataclass
class DemoResult:
    """What the demo ran and wrote; ``problems`` lists what did not come out as the samples imply."""

    broken: Report
    fixed: Report
    identification: Identification
    files: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when the demo showed what it should (the broken pair mismatching is expected), else 1."""
        return 1 if self.problems else 0


def default_samples_dir() -> Path:
    """``samples/`` next to the package: present when tracediff is installed editable from the repo."""
    import tracediff  # noqa: PLC0415

    return Path(tracediff.__file__).resolve().parent.parent / "samples"


def find_samples(samples: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """The four sample stores by role; :class:`UsageError` naming what is missing and what to do."""
    root = Path(samples) if samples is not None else default_samples_dir()
    hint = ("pass --samples DIR (a folder holding " + ", ".join(SAMPLE_STORES.values()) +
            ", made by samples/make_samples.py), or run from a source checkout installed with pip install -e .")
    if not root.is_dir():
        raise UsageError(f"{root}: no samples folder here; {hint}")
    paths = {role: root / name for role, name in SAMPLE_STORES.items()}
    missing = [p.name for p in paths.values() if not p.is_dir()]
    if missing:
        raise UsageError(f"{root}: missing sample store(s) {', '.join(missing)}; {hint}")
    return paths


def _segment_labels(path: Path, tap: str = "fc_in") -> list[str]:
    store = open_store(path)
    try:
        stream = store.tap_streams(tap)[0]
        return stream.segment_labels or [f"seg{i}" for i in range(stream.width // (stream.segment_size or stream.width))]
    finally:
        store.close()


def _shown(path: Path) -> str:
    """A path as short as it can be while still working from the current folder."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path.resolve()) if rel.startswith("..") else rel


def run_demo(
    out: str | os.PathLike[str],
    samples: str | os.PathLike[str] | None = None,
    *,
    echo: Callable[[str], None] = print,
    color: bool = False,
) -> DemoResult:
    """Run the demo, printing through ``echo`` as it goes; reports go into ``out`` (created)."""
    paths = find_samples(samples)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir}: exists and is not a folder; give --out a folder for the reports")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportWriteError(f"{out_dir}: cannot create the report folder: {exc.strerror or exc}") from exc
    # Short paths where they work from here: the reports and the printed commands show them.
    train, broken, fixed, bank = (Path(_shown(paths[k])) for k in ("train", "broken", "fixed", "bank"))

    trained, served = _segment_labels(train), _segment_labels(broken)
    story = (f"tracediff demo: an EAGLE-3 draft trained on fc input cat({', '.join(trained)}) accepts few "
             f"tokens when served: does the server feed its fc what the trainer did? (traces of a tiny Llama "
             f"in {_shown(train.parent)}/, see its README.md)")
    echo("\n".join(textwrap.wrap(story, width=100, subsequent_indent="  ", break_on_hyphens=False)))
    echo("")

    echo(f"$ tracediff compare {_shown(train)} {_shown(broken)} --bank {_shown(bank)}")
    broken_report = compare_stores(train, broken, CompareOptions(bank=str(bank)))
    echo(render_summary(broken_report, color=color))

    echo(f"$ tracediff compare {_shown(train)} {_shown(fixed)}")
    fixed_report = compare_stores(train, fixed)
    echo(render_summary(fixed_report, color=color))

    echo(f"$ tracediff identify {_shown(broken)} --bank {_shown(bank)}")
    ident = identify_segments(broken, bank)
    echo(render_identification(ident))
    echo("")

    files = {
        "broken_html": out_dir / "broken.html",
        "broken_markdown": out_dir / "broken.md",
        "broken_json": out_dir / "broken.json",
        "fixed_html": out_dir / "fixed.html",
        "fixed_markdown": out_dir / "fixed.md",
        "fixed_json": out_dir / "fixed.json",
        "identify_json": out_dir / "identify.json",
    }
    write_report(broken_report, json_path=files["broken_json"], markdown_path=files["broken_markdown"],
                 html_path=files["broken_html"])
    write_report(fixed_report, json_path=files["fixed_json"], markdown_path=files["fixed_markdown"],
                 html_path=files["fixed_html"])
    write_json(files["identify_json"], ident.to_dict())

    result = DemoResult(broken=broken_report, fixed=fixed_report, identification=ident, files=files)
    result.problems = _problems(result, served)
    echo("reports:")
    for pair, title in (("broken", "trainer vs broken server"), ("fixed", "trainer vs fixed server")):
        echo(f"  {title}:")
        for kind, label in (("html", "HTML"), ("markdown", "Markdown"), ("json", "JSON")):
            echo(f"    {label:<9} {_shown(files[f'{pair}_{kind}'])}")
    echo("  identify (broken server):")
    echo(f"    {'JSON':<9} {_shown(files['identify_json'])}")
    if result.problems:
        for problem in result.problems:
            echo(f"tracediff demo: unexpected: {problem}")
    else:
        done = (f"tracediff demo: the broken server feeds cat({', '.join(served)}): compare found the seed bug, "
                f"the fixed server matches the trainer, identify named every layer.")
        echo("\n".join(textwrap.wrap(done, width=100, subsequent_indent="  ", break_on_hyphens=False)))
    for fix in fix_lines(broken_report):
        line = f"the fix: {fix[:1].lower()}{fix[1:]} ({_shown(fixed)} is the server recorded with that setting.)"
        echo("\n".join(textwrap.wrap(line, width=100, subsequent_indent="  ", break_on_hyphens=False)))
    echo("")
    echo("next, on your own trainer and server:")
    for step, command, doc in NEXT_STEPS:
        echo(f"  {step:<28}{command}")
        echo(f"  {'':<28}({doc})")
    return result


#: What a user runs after the demo: their own two recordings, the same tokens, one compare.
NEXT_STEPS: tuple[tuple[str, str, str], ...] = (
    ("1. record a training step", "tracediff record --adapter speculators -o train.zarr -- python train.py ...",
     "or --adapter specforge, or --tap YourDraft.fc:input; docs/trainers.md"),
    ("2. record the server", "tracediff record --adapter sglang -o server.zarr -- python -m sglang.launch_server ...",
     "or --adapter vllm; docs/sglang.md, docs/vllm.md"),
    ("3. send it the same tokens", "tracediff send train.zarr --url http://127.0.0.1:30000",
     "add --engine vllm for vLLM"),
    ("4. compare", "tracediff compare train.zarr server.zarr --html report.html",
     "add --draft DIR to see what a mismatch costs in accepted tokens"),
)


def _problems(result: DemoResult, served: list[str]) -> list[str]:
    """Where the results differ from what the samples were built to show (a bug in tracediff, or
    samples rebuilt with other choices)."""
    problems = []
    found = {f.kind for f in result.broken.findings if f.severity == "error"}
    if result.broken.verdict != "mismatch" or not found >= SEED_BUG_KINDS:
        problems.append(f"the broken pair should mismatch with {', '.join(sorted(SEED_BUG_KINDS))}; "
                        f"got {result.broken.verdict} with {', '.join(sorted(found)) or 'no errors'}")
    if result.fixed.verdict != "match":
        problems.append(f"the fixed pair should match; got {result.fixed.verdict}")
    for seg in result.identification.segments:
        name = seg.best.label if seg.best is not None else None
        expected = served[seg.segment] if seg.segment < len(served) else None
        if seg.verdict != "match" or name != expected:
            problems.append(f"identify: segment {seg.segment} should be {expected}; got {seg.verdict} {name or ''}".rstrip())
    return problems


__all__ = ["SAMPLE_STORES", "DemoResult", "default_samples_dir", "find_samples", "run_demo"]
