"""Shared fixtures of the record tests: a tiny real Llama, plain-zarr readers, CLI runners, processes.

Everything here is real: stores are zarr folders in ``tmp_path``, the CLI runs as a subprocess (or
through click's runner where only its in-process logic is under test), processes are real
processes. Nothing mocks the store.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ci_record
import numpy as np
import pytest
import skip_gate
import zarr
from click.testing import CliRunner
from reliability_children import wait_for_commit

from tracediff.cli import main as cli_main

HIDDEN = 32
LAYERS = 4
VOCAB = 128
REPO = Path(__file__).resolve().parents[1]


def report_without_paths(report: dict[str, Any]) -> dict[str, Any]:
    """A JSON compare report with the two stores' paths taken out: what must not depend on where they
    live (the commands of its Fix and what-to-record-next boxes name the stores: there they become words)."""
    import shlex  # noqa: PLC0415

    out = json.loads(json.dumps(report))
    words = {shlex.quote(out[side].pop("path")): side.upper() for side in ("reference", "candidate")}
    for box in (out.get("fix"), out.get("record_next")):
        for step in (box or {}).get("steps", []):
            for path, word in sorted(words.items(), key=lambda kv: -len(kv[0])):
                step["commands"] = [c.replace(path, word) for c in step["commands"]]
    return out


# ------------------------------------------------------------------------------- optional frameworks
def skip_unless_installed(*modules: str, reason: str = "") -> None:
    """Skip the calling test module unless every one of ``modules`` is installed, without importing
    them: pytest.importorskip at module level imports the framework while pytest collects, which costs
    seconds a framework (speculators 5 s) in every run, selected or not. The tests import it when they run."""
    import importlib.util  # noqa: PLC0415

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(reason or f"{', '.join(missing)} not installed", allow_module_level=True)


# ---------------------------------------------------------------------------------------- models
@pytest.fixture(scope="session")
def tiny():
    from tracediff.testing.tiny_llama import build_tiny_llama  # noqa: PLC0415  (imports transformers)

    return build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="session")
def seqs() -> list[list[int]]:
    from tracediff.testing.tiny_llama import make_sequences  # noqa: PLC0415

    return make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=VOCAB, seed=1)


# ------------------------------------------------------------------------ plain zarr + numpy reading
@dataclass
class PlainGroup:
    """One ``<tap>/<writer>`` group read with nothing but zarr and numpy (no tracediff code)."""

    attrs: dict[str, Any]
    values: np.ndarray  # stored representation: uint16 bits for bf16
    labels: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return int(self.attrs["commit"]["rows"])

    @property
    def commit(self) -> dict[str, Any]:
        return self.attrs["commit"]

    @property
    def phase_names(self) -> list[str]:
        return [self.attrs["phases"][c] for c in self.labels["phase"]]


def read_plain(store: Path | str, tap: str) -> dict[str, PlainGroup]:
    """Every writer group of ``tap``: committed rows only, as documented in the store format."""
    root = zarr.open_group(str(store), mode="r")
    assert "tracediff" in root.attrs, "a trace store carries a 'tracediff' root attribute"
    out: dict[str, PlainGroup] = {}
    for name in sorted(root[tap].group_keys()):
        group = root[tap][name]
        attrs = dict(group.attrs)
        rows = int(attrs["commit"]["rows"])
        values = group["values"]
        assert values.attrs["dtype"] == attrs["dtype"]
        labels = {
            key: np.asarray(group[key][:rows])
            for key in ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")
        }
        out[name] = PlainGroup(attrs=attrs, values=np.asarray(values[:rows]), labels=labels)
    return out


def stored_bits(tensor) -> np.ndarray:
    """What a tensor must look like on disk: bf16 as its raw 16 bits, other dtypes as themselves."""
    import torch  # noqa: PLC0415

    flat = tensor.detach().reshape(-1, tensor.shape[-1]).contiguous()
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def writer_json(store: Path, tap: str, writer: str) -> dict[str, Any]:
    """The commit record on disk, read as JSON (what a process polls to know a batch is durable)."""
    return json.loads((store / tap / writer / "zarr.json").read_text())["attributes"]["commit"]


# ------------------------------------------------------------------------------------------ the CLI
@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRACEDIFF_CONFIG", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_tracediff(*args: str, cwd: Path | None = None, timeout: float = 120) -> CliResult:
    """``python -m tracediff ARGS`` in a real subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "tracediff", *map(str, args)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def invoke_tracediff(*args: str) -> CliResult:
    """The same command through click's runner, in this process (for error paths: no torch start-up)."""
    result = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False)
    return CliResult(result.exit_code, result.stdout, result.stderr)


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """A command that blocks (a FIFO read with no writer) fails the test instead of stalling the run."""

    def fail(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise TimeoutError(f"still running after {seconds} s: it blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)



# ------------------------------------------------------------------------------ reliability counts
# Reliability tests (crash harness, concurrent writers, full disk, hostile inputs) report what they
# measured: counts of kills by phase, rows written, peak memory. They go into the terminal summary
# of every run (CI logs included) and, when TRACEDIFF_RELIABILITY_OUT names a file, into that JSON
# file, from which docs/reliability.md quotes its numbers.
_RELIABILITY: dict[str, Any] = {}


@pytest.fixture(scope="session")
def reliability_report() -> dict[str, Any]:
    """``reliability_report["crash"] = {...}``: a JSON-able record of what a test measured."""
    return _RELIABILITY


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _RELIABILITY:
        return
    terminalreporter.section("tracediff reliability counts")
    for name, record in sorted(_RELIABILITY.items()):
        terminalreporter.write_line(f"{name}: {json.dumps(record, sort_keys=True)}")
    out = os.environ.get("TRACEDIFF_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(_RELIABILITY, indent=2, sort_keys=True) + "\n")


# -------------------------------------------------------------------------------------- processes
@pytest.fixture(scope="session")
def forkserver() -> Iterator[multiprocessing.context.BaseContext]:
    """Processes forked from a server that has torch and tracediff imported already: a real process
    per run (it can be SIGKILLed) without paying the torch import each time."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zarr", "numcodecs", "tracediff.record.recorder"])
    yield ctx


# ------------------------------------------------------------ bodies of recording child processes
# They live here, not in a test module, so that a forked or spawned child imports only this light
# module (no transformers) to find them; torch is imported inside them for the same reason.
KILL_WIDTH = 256


def kill_batch_sizes(n: int = 2000, seed: int = 0) -> list[int]:
    """Ragged batch sizes (1..300 rows): batches span 0 to 5 chunks of 64 rows."""
    return np.random.default_rng(seed).integers(1, 301, size=n).tolist()


def record_batches_until_killed(store: str, log: str, sizes: list[int]) -> None:
    """Record batch i (every value i + 1) through a real forward hook; log i once it is committed.

    The commit record on disk is the proof a batch is durable, so the child polls it (zarr writes
    it atomically) before logging: the test then knows which batches must have survived a kill.
    """
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    layer = torch.nn.Linear(KILL_WIDTH, 2)
    rec = tracediff.record(store, role="killed", chunk_rows=64, on_full="block")
    rec.tap(layer, "fc_in")
    commit_file = Path(store) / "fc_in" / rec.writer_name / "zarr.json"
    with open(log, "a") as out:
        for i, n in enumerate(sizes):
            rec.labels(seq=i, position=np.arange(n), step=i)
            layer(torch.full((n, KILL_WIDTH), float(i + 1)))
            wait_for_commit(commit_file, i, rec)
            out.write(f"{i}\n")
            out.flush()


def record_then_wait_for_sigterm(store: str, log: str, sizes: list[int]) -> None:
    """Queue every batch, say how far the writer got, then wait for SIGTERM.

    Queuing takes microseconds; writing takes about a second (one chunk file per row), so the
    writer is certainly behind when the test sends the signal."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    layer = torch.nn.Linear(8, 2)
    rec = tracediff.record(store, role="terminated", chunk_rows=1, on_full="block", max_queue_batches=len(sizes) + 1)
    rec.tap(layer, "fc_in")
    for i, n in enumerate(sizes):
        layer(torch.full((n, 8), float(i + 1)))
    commit_file = Path(store) / "fc_in" / rec.writer_name / "zarr.json"
    committed = json.loads(commit_file.read_text())["attributes"]["commit"]["rows"] if commit_file.exists() else 0
    Path(log + ".tmp").write_text(json.dumps({"queued": rec.stats()["fc_in"]["rows"], "committed": committed}))
    os.replace(log + ".tmp", log)  # the test polls for the file: it must appear whole
    time.sleep(60)  # SIGTERM arrives here
    raise SystemExit(99)  # never reached when the signal kills the process


# --------------------------------------------------------------------------------- report schemas
# Every compare / replay / identify JSON document a test produces is validated against the schemas
# tracediff ships (tracediff/schemas/, docs/report-schema.md), so the schemas cannot drift from
# what the code writes:
#
# * files: at each test's teardown, every *.json under this session's temporary folders (tmp_path,
#   tmp_path_factory; zarr stores skipped) that reads as a report by its top-level keys, new or
#   changed since the last look. It covers the CLI run as a subprocess (`--json FILE`) and
#   write_report / write_json in this process;
# * objects: every Report and Identification that compare and identify return in this process (a
#   test may never serialise them), in its state at the test's teardown (after a replay attached).
#
# They are validated strictly: the open vocabularies of the shipped schemas (finding kinds, segment
# statuses, ...; any snake_case name passes there, for forward compatibility) are closed to the
# values the schema lists, so a new finding kind or status fails here until the schema names it.
# A violation fails the test at teardown with the file (or object) and the JSON path. A test that
# writes a report-shaped document on purpose opts out with @pytest.mark.report_schema("off").
SCHEMA_LEVELS = ("strict", "off")
_SCHEMA_COUNTS: dict[str, int] = {}
_PRODUCED: list[tuple[str, str, Any]] = []  # (schema, origin, Report or Identification) not yet checked
_SEEN_FILES: dict[Path, tuple[int, int]] = {}  # path -> (mtime_ns, size) when last validated
_SCAN_LIMIT = 64 << 20  # a report file is far smaller; bigger *.json files are not reports


def report_schema_of(document: Any) -> str | None:
    """``"compare"``, ``"identify"`` or ``"lint"`` when ``document`` is one of those reports by its top-level keys."""
    if not isinstance(document, dict):
        return None
    keys = set(document)
    if document.get("schema") == "tracediff.lint/1":
        return "lint"
    if "findings" in keys and keys & {"plan", "segment_map", "schema_version", "verdict"}:
        return "compare"
    if "bank_tap" in keys or {"bank", "segments"} <= keys:
        return "identify"
    return None


def strict_schema(name: str) -> dict[str, Any]:
    """The shipped schema with its open vocabularies closed (``$defs/future_value`` := false)."""
    from tracediff.schemas import load_schema  # noqa: PLC0415

    schema = load_schema(name)
    assert "future_value" in schema["$defs"], f"{name}: the schema has no $defs/future_value to close"
    schema["$defs"]["future_value"] = False
    return schema


_VALIDATORS: dict[tuple[str, bool], Any] = {}


def report_validator(name: str, *, strict: bool = True) -> Any:
    """A compiled draft 2020-12 validator of schema ``name``, built once per session."""
    key = (name, strict)
    if key not in _VALIDATORS:
        from jsonschema import Draft202012Validator  # noqa: PLC0415

        from tracediff.schemas import load_schema  # noqa: PLC0415

        schema = strict_schema(name) if strict else load_schema(name)
        Draft202012Validator.check_schema(schema)
        _VALIDATORS[key] = Draft202012Validator(schema)
    return _VALIDATORS[key]


def schema_problems(document: Any, name: str, *, strict: bool = True, limit: int = 5) -> list[str]:
    """Why ``document`` is not a valid ``name`` report, one line per violation (deepest first); [] if it is."""
    errors = sorted(report_validator(name, strict=strict).iter_errors(document),
                    key=lambda e: (-len(e.absolute_path), e.json_path))
    return [f"at {e.json_path}: {e.message[:300]}" for e in errors[:limit]]


def _finite_json(document: Any) -> Any:
    """``document`` as its JSON file holds it: non-finite floats as null (tracediff.compare.results._finite)."""
    from tracediff.compare.results import json_safe  # noqa: PLC0415

    return json.loads(json.dumps(json_safe(document), allow_nan=False, default=str))


def _object_document(name: str, obj: Any) -> Any:
    return json.loads(obj.to_json()) if name == "compare" else _finite_json(obj.to_dict())


def _report_files(root: Path) -> Iterator[Path]:
    """*.json under ``root``, not descending into zarr stores (a folder holding zarr.json)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    if any(e.name == "zarr.json" for e in entries):
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _report_files(Path(entry.path))
        elif entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def _check_report_files(root: Path) -> list[str]:
    problems = []
    for path in _report_files(root):
        try:
            stat = path.stat()
        except OSError:
            continue
        stamp = (stat.st_mtime_ns, stat.st_size)
        if _SEEN_FILES.get(path) == stamp or stat.st_size > _SCAN_LIMIT:
            continue
        _SEEN_FILES[path] = stamp
        try:
            text = path.read_bytes()
            document = json.loads(text)
        except (OSError, ValueError):
            continue  # not JSON (or half written): not a report this hook can read
        name = report_schema_of(document)
        if name is None:
            continue
        _SCHEMA_COUNTS[f"{name} files"] = _SCHEMA_COUNTS.get(f"{name} files", 0) + 1
        problems += [f"{path}: not a valid {name} report {p}" for p in strict_json_problems(text)]
        problems += [f"{path}: not a valid {name} report {p}" for p in schema_problems(document, name)]
    return problems


def strict_json_problems(text: bytes | str) -> list[str]:
    """Python's json reads bare NaN and Infinity, which are not JSON (jq, JavaScript and most
    parsers refuse them): a report must write them as null."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"bare {constant} (not JSON; a non-finite float is written as null)")

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        return [f"at the file: {exc}"]
    return []


def _check_produced() -> list[str]:
    problems = []
    while _PRODUCED:
        name, origin, obj = _PRODUCED.pop(0)
        try:
            document = _object_document(name, obj)
        except (TypeError, ValueError) as exc:
            problems.append(f"{origin}: its JSON form cannot be written: {type(exc).__name__}: {exc}")
            continue
        _SCHEMA_COUNTS[f"{name} objects"] = _SCHEMA_COUNTS.get(f"{name} objects", 0) + 1
        problems += [f"{origin}: not a valid {name} report {p}" for p in schema_problems(document, name)]
    return problems


class _ReportSchemaPlugin:
    """Records what compare and identify return in this process, and counts what was validated."""

    #: (module, function, schema): the functions every in-process compare / identify goes through.
    PRODUCERS = (("tracediff.compare.run", "_compare", "compare"), ("tracediff.compare.plan.identify", "_identify", "identify"))

    def __init__(self) -> None:
        self.patched: dict[tuple[str, str], Any] = {}

    def install(self) -> None:
        """Wrap each producer whose module is imported (once per session; checked before every test)."""
        for module_name, attr, schema in self.PRODUCERS:
            module = sys.modules.get(module_name)
            if module is None or (module_name, attr) in self.patched:
                continue
            real = getattr(module, attr)  # an AttributeError here: the producer moved, update PRODUCERS

            def recording(*args: Any, _real: Any = real, _schema: str = schema, **kwargs: Any) -> Any:
                result = _real(*args, **kwargs)
                _PRODUCED.append((_schema, f"{_real.__module__}.{_real.__name__}() result", result))
                return result

            self.patched[(module_name, attr)] = real
            setattr(module, attr, recording)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:  # noqa: ARG002  (before any fixture)
        self.install()

    def pytest_unconfigure(self, config: pytest.Config) -> None:  # noqa: ARG002
        for (module_name, attr), real in self.patched.items():
            setattr(sys.modules[module_name], attr, real)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if _SCHEMA_COUNTS:
            shown = ", ".join(f"{n} {what}" for what, n in sorted(_SCHEMA_COUNTS.items()))
            terminalreporter.write_line(f"tracediff report schemas: validated {shown}")


def pytest_addoption(parser: pytest.Parser) -> None:
    skip_gate.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts a background job (`.ci/run &`, a CI step sent to the
    # background) with SIGINT ignored, and every process it starts inherits that: the tests that
    # interrupt a command would then test nothing. The processes the tests start get the default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    skip_gate.register(config)
    ci_record.register(config)
    config.addinivalue_line(
        "markers", "report_schema(level): how the reports this test produces are validated: 'strict' (default) or "
                   "'off' (a test that writes a report-shaped document on purpose)")
    config.pluginmanager.register(_ReportSchemaPlugin(), "tracediff-report-schemas")


@pytest.fixture(autouse=True)
def _reports_follow_their_schemas(request: pytest.FixtureRequest,
                                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    marker = request.node.get_closest_marker("report_schema")
    level = marker.args[0] if marker and marker.args else "strict"
    assert level in SCHEMA_LEVELS, f"report_schema({level!r}): use one of {SCHEMA_LEVELS}"
    if level == "off":
        _PRODUCED.clear()
        for path in _report_files(tmp_path_factory.getbasetemp()):  # seen: not validated later either
            with contextlib.suppress(OSError):
                stat = path.stat()
                _SEEN_FILES[path] = (stat.st_mtime_ns, stat.st_size)
        return
    problems = _check_produced() + _check_report_files(tmp_path_factory.getbasetemp())
    if problems:
        pytest.fail("reports that do not follow tracediff/schemas (docs/report-schema.md):\n  "
                    + "\n  ".join(problems[:20]), pytrace=False)
