"""Hostile and broken inputs: every command refuses them with one line, exit code 2, and no output file.

Each case starts from a real store written by the real writer (``tracediff.testing.stores``: taps
``fc_in`` and ``bank``) and damages it the way disks, crashes, hand edits and attackers do. Every
command that reads that kind of store runs on it: ``inspect`` (text and ``--json``), ``compare`` with
the damaged store as the reference and as the candidate (writing ``--json``, ``--markdown`` and
``--html`` reports), and ``identify`` with it as the store and as the bank (``--json``). What must
hold for each run:

- exit code 2, nothing on stdout, exactly one line on stderr, no traceback;
- the line names the file at fault (the store, and the file inside it) and the field;
- no report file exists afterwards, not even half of one, and no temporary file is left;
- nothing hangs (a FIFO where a chunk should be), nothing allocates what metadata claims.

``import`` gets the same treatment for broken and hostile trainer files.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CliResult, invoke_tracediff, no_hang, run_tracediff
from safetensors.torch import save_file

from tracediff.compare import compare_stores
from tracediff.store import TraceStore, pack_store
from tracediff.testing.stores import HIDDEN, write_small_store

WRITER = "pid1"
COMMANDS = ("inspect", "inspect_json", "compare_reference", "compare_candidate", "identify_store", "identify_bank")
STORE_ONLY = ("compare_reference", "compare_candidate", "identify_store", "identify_bank")


# ----------------------------------------------------------------------------------- the good stores
@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Intact stores: uncompressed float32 (the raw read path) and lz4 bfloat16 (zarr's read path)."""
    root = tmp_path_factory.mktemp("bases")
    out = {
        "raw": write_small_store(root / "raw.zarr"),
        "lz4": write_small_store(root / "lz4.zarr", dtype="bfloat16", compressor="lz4"),
    }
    for name in ("nan", "inf"):
        out[name] = write_small_store(root / f"{name}.zarr", values=name)
    return out


# ------------------------------------------------------------------------------------- damage helpers
def _edit_json(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _group(store: Path, tap: str) -> Path:
    return store / tap / WRITER


def _attrs(store: Path, tap: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    _edit_json(_group(store, tap) / "zarr.json", lambda d: edit(d["attributes"]))


def _array(store: Path, tap: str, name: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    _edit_json(_group(store, tap) / name / "zarr.json", edit)


def _chunk(store: Path, tap: str, name: str = "values", index: int = 1) -> Path:
    base = _group(store, tap) / name / "c" / str(index)
    return base / "0" if name == "values" else base


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(4, len(data), 3):  # past blosc's/zstd's magic: the frame parses, its contents do not
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _unix_socket(path: Path) -> None:
    """A socket file where a file should be (bound in a short folder: socket paths are limited)."""
    path.unlink()
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.path.join(short, "s"))
            os.rename(os.path.join(short, "s"), path)
        finally:
            sock.close()


def _symlink_loop(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    os.symlink(path.name, path)  # points at itself


def _replace_with_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "0").write_bytes(b"\0" * 16)


def _set_commit(store: Path, tap: str, **fields: Any) -> None:
    _attrs(store, tap, lambda a: a["commit"].update(fields))


def _no_taps(store: Path, tap: str) -> None:
    shutil.rmtree(store / "fc_in")
    shutil.rmtree(store / "bank")


def _zero_rows(store: Path, tap: str) -> None:
    for t in ("fc_in", "bank"):
        _set_commit(store, t, rows=0)


def _root(store: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    _edit_json(store / "zarr.json", edit)


def _packed(store: Path) -> Path:
    zipped = pack_store(store, store.with_name(store.name + ".zip"))
    shutil.rmtree(store)
    return zipped


def _zip_truncated(store: Path, tap: str) -> Path:
    zipped = _packed(store)
    _truncate(zipped, 0.6)
    return zipped


def _zip_member_damaged(store: Path, tap: str) -> Path:
    """A packed store whose values chunk member is garbage (compressed store: decoding fails)."""
    _flip(_chunk(store, tap))
    return _packed(store)


def _zip_v2(store: Path, tap: str) -> Path:
    """A zip holding a zarr v2 group (no zarr.json) that carries tracediff's attributes."""
    zipped = store.with_name(store.name + ".zip")
    shutil.rmtree(store)
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr(".zgroup", json.dumps({"zarr_format": 2}))
        zf.writestr(".zattrs", json.dumps({"tracediff": {"format": 1}}))
    return zipped


def _plain_zarr(store: Path, tap: str) -> None:
    _root(store, lambda d: d.update(attributes={"owner": "someone else"}))


def _regular_file(store: Path, tap: str) -> None:
    shutil.rmtree(store)
    store.write_bytes(os.urandom(4096))


def _store_symlink_loop(store: Path, tap: str) -> None:
    _symlink_loop(store)


def _values_missing(store: Path, tap: str) -> None:
    shutil.rmtree(_group(store, tap) / "values")


# ------------------------------------------------------------------------------------------ the cases
@dataclass
class Case:
    """A way to damage a store: ``damage(store, tap)`` changes the copy in place (the writer group of
    ``tap``, or the whole store) and may return the path to give the commands instead."""

    damage: Callable[[Path, str], Path | None]
    names: list[str]  # what the one line must name; {tap} is the damaged tap
    base: str = "raw"
    commands: tuple[str, ...] = COMMANDS
    subprocess: bool = False  # compare as candidate through a real `python -m tracediff`, not click's runner


G = "{tap}/pid1"
CASES: dict[str, Case] = {
    # -- values chunks, uncompressed (read straight from the files)
    "values chunk truncated": Case(lambda s, t: _truncate(_chunk(s, t)), [f"{G}/values/c/1/0", "bytes"],
                                   subprocess=True),
    "values chunk longer than a chunk": Case(
        lambda s, t: _chunk(s, t).write_bytes(_chunk(s, t).read_bytes() + b"\0" * 8), [f"{G}/values/c/1/0", "bytes"]),
    "values chunk empty": Case(lambda s, t: _chunk(s, t).write_bytes(b""), [f"{G}/values/c/1/0", "bytes"]),
    "values chunk deleted": Case(lambda s, t: _chunk(s, t).unlink(), [f"{G}/values/c", "missing"]),
    "values chunk is a FIFO": Case(lambda s, t: _fifo(_chunk(s, t)), [f"{G}/values/c/1/0", "FIFO"], subprocess=True),
    "values chunk is a socket": Case(lambda s, t: _unix_socket(_chunk(s, t)), [f"{G}/values/c/1/0", "socket"]),
    "values chunk is a symlink loop": Case(lambda s, t: _symlink_loop(_chunk(s, t)),
                                           [f"{G}/values/c/1/0", "symbolic links"]),
    "values chunk is a folder": Case(lambda s, t: _replace_with_folder(_chunk(s, t)), [f"{G}/values/c/1/0", "folder"]),
    "values chunk folder is a symlink loop": Case(lambda s, t: _symlink_loop(_group(s, t) / "values" / "c"),
                                                  [f"{G}/values/c", "symbolic links"]),
    # -- values chunks, compressed (decoded by zarr): a bad frame is only found by decoding it
    "compressed values chunk garbage": Case(lambda s, t: _flip(_chunk(s, t)), [f"{G}/values/c/1/0", "decoded"],
                                            base="lz4", commands=STORE_ONLY),
    "compressed values chunk truncated": Case(lambda s, t: _truncate(_chunk(s, t)), [f"{G}/values/c/1/0", "decoded"],
                                              base="lz4", commands=STORE_ONLY),
    "compressed values chunk is a FIFO": Case(lambda s, t: _fifo(_chunk(s, t)), [f"{G}/values/c/1/0", "FIFO"],
                                              base="lz4"),
    # -- label chunks (zstd, decoded by zarr; inspect reads them too)
    "label chunk truncated": Case(lambda s, t: _truncate(_chunk(s, t, "seq", 0)), [f"{G}/seq/c/0", "decoded"]),
    "label chunk garbage": Case(lambda s, t: _flip(_chunk(s, t, "token_id", 0)), [f"{G}/token_id/c/0", "decoded"]),
    "label chunk deleted": Case(lambda s, t: _chunk(s, t, "position", 0).unlink(), [f"{G}/position/c", "missing"]),
    "label chunk is a FIFO": Case(lambda s, t: _fifo(_chunk(s, t, "valid", 0)), [f"{G}/valid/c/0", "FIFO"]),
    "label chunk is a symlink loop": Case(lambda s, t: _symlink_loop(_chunk(s, t, "phase", 0)),
                                          [f"{G}/phase/c/0", "symbolic links"]),
    # -- arrays' metadata
    "values missing": Case(_values_missing, [f"{G}/values", "missing"]),
    "values dtype attribute disagrees with the group's": Case(
        lambda s, t: _array(s, t, "values", lambda d: d["attributes"].update(dtype="float16")),
        [f"{G}/values/zarr.json", "attributes.dtype", "'float16'"]),
    "values stored as another dtype": Case(lambda s, t: _array(s, t, "values", lambda d: d.update(data_type="int32")),
                                           [f"{G}/values/zarr.json", "data_type", "'int32'"]),
    "values shape negative": Case(lambda s, t: _array(s, t, "values", lambda d: d.update(shape=[-5, d["shape"][1]])),
                                  [f"{G}/values/zarr.json", "shape"]),
    "values shape not a list": Case(lambda s, t: _array(s, t, "values", lambda d: d.update(shape="60x48")),
                                    [f"{G}/values/zarr.json", "shape"]),
    "values chunk shape huge": Case(
        lambda s, t: _array(s, t, "values", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[10**15, 48])),
        [f"{G}/values/zarr.json", "chunk_grid"]),
    "values codec that is not allowed": Case(
        lambda s, t: _array(s, t, "values", lambda d: d["codecs"].append({"name": "gzip", "configuration": {"level": 1}})),
        [f"{G}/values/zarr.json", "codecs", "'gzip'"]),
    "label array is 2-d": Case(lambda s, t: _array(s, t, "seq", lambda d: d.update(shape=[d["shape"][0], 2])),
                               [f"{G}/seq/zarr.json", "shape"]),
    "label array of another dtype": Case(lambda s, t: _array(s, t, "token_id", lambda d: d.update(data_type="float64")),
                                         [f"{G}/token_id/zarr.json", "data_type", "'float64'"]),
    "label array shorter than commit.rows": Case(lambda s, t: _array(s, t, "position", lambda d: d.update(shape=[30])),
                                                 [f"{G}/position/zarr.json", "shape", "commit.rows"]),
    "array zarr.json is a list": Case(lambda s, t: (_group(s, t) / "seq" / "zarr.json").write_text("[]"),
                                      [f"{G}/seq/zarr.json", "a list"]),
    "array zarr.json is a FIFO": Case(lambda s, t: _fifo(_group(s, t) / "step" / "zarr.json"),
                                      [f"{G}/step/zarr.json", "FIFO"]),
    # -- the writer group's attributes and commit record
    "commit.rows beyond the arrays": Case(lambda s, t: _set_commit(s, t, rows=61), [f"{G}/values/zarr.json", "commit.rows"]),
    "commit.rows huge (10**15)": Case(
        lambda s, t: (_set_commit(s, t, rows=10**15),
                      _array(s, t, "values", lambda d: d.update(shape=[10**15, d["shape"][1]])),
                      [_array(s, t, n, lambda d: d.update(shape=[10**15]))
                       for n in ("seq", "position", "token_id", "next_token_id", "step", "phase", "valid")]),
        [f"{G}/values/c", "commit.rows"], subprocess=True),
    "width huge (10**15)": Case(
        lambda s, t: (_attrs(s, t, lambda a: a.update(width=10**15, segment_size=None, segment_labels=None)),
                      _array(s, t, "values", lambda d: (d.update(shape=[d["shape"][0], 10**15]),
                                                        d["chunk_grid"]["configuration"].update(chunk_shape=[16, 10**15])))),
        [f"{G}/values/zarr.json", "chunk_grid"]),
    "commit.rows negative": Case(lambda s, t: _set_commit(s, t, rows=-1), [f"{G}/zarr.json", "commit.rows", "-1"]),
    "commit.rows not an integer": Case(lambda s, t: _set_commit(s, t, rows=59.5), [f"{G}/zarr.json", "commit.rows", "59.5"]),
    "commit.rows a boolean": Case(lambda s, t: _set_commit(s, t, rows=True), [f"{G}/zarr.json", "commit.rows", "True"]),
    "commit record missing": Case(lambda s, t: _attrs(s, t, lambda a: a.pop("commit")), [f"{G}/zarr.json", "'commit'"]),
    "seq_names malformed": Case(lambda s, t: _set_commit(s, t, seq_names={"req-1": "zero"}),
                                [f"{G}/zarr.json", "commit.seq_names"]),
    "seq_names a list": Case(lambda s, t: _set_commit(s, t, seq_names=["req-1"]), [f"{G}/zarr.json", "commit.seq_names"]),
    "phases malformed": Case(lambda s, t: _attrs(s, t, lambda a: a.update(phases="train")), [f"{G}/zarr.json", "phases"]),
    "phases in another order": Case(lambda s, t: _attrs(s, t, lambda a: a.update(phases=["train", "unknown"])),
                                    [f"{G}/zarr.json", "phases"]),
    "dtype unknown": Case(lambda s, t: _attrs(s, t, lambda a: a.update(dtype="bfloat17")), [f"{G}/zarr.json", "dtype", "'bfloat17'"]),
    "width disagrees with the values": Case(lambda s, t: _attrs(s, t, lambda a: a.update(width=40, segment_size=8, segment_labels=None)),
                                            [f"{G}/values/zarr.json", "width"]),
    "segment labels inconsistent with the width": Case(lambda s, t: _attrs(s, t, lambda a: a.update(segment_labels=["a", "b"])),
                                                       [f"{G}/zarr.json", "segment_labels"]),
    "segment_size does not divide the width": Case(lambda s, t: _attrs(s, t, lambda a: a.update(segment_size=HIDDEN + 1)),
                                                   [f"{G}/zarr.json", "segment_size"]),
    "segment labels not a list": Case(lambda s, t: _attrs(s, t, lambda a: a.update(segment_labels={"0": "hs0"})),
                                      [f"{G}/zarr.json", "segment_labels"]),
    "writer zarr.json is a list": Case(lambda s, t: (_group(s, t) / "zarr.json").write_text("[1, 2]"),
                                       [f"{G}/zarr.json", "a list"]),
    "writer attributes null": Case(lambda s, t: _edit_json(_group(s, t) / "zarr.json", lambda d: d.update(attributes=None)),
                                   [f"{G}/zarr.json", "attributes", "null"]),
    "writer zarr.json is a FIFO": Case(lambda s, t: _fifo(_group(s, t) / "zarr.json"), [f"{G}/zarr.json", "FIFO"]),
    "writer is an array": Case(lambda s, t: _edit_json(_group(s, t) / "zarr.json", lambda d: d.update(node_type="array")),
                               [f"{G}/zarr.json", "node_type"]),
    "tap folder is a symlink loop": Case(lambda s, t: _symlink_loop(s / t), ["{tap}", "symbolic links"]),
    # -- the root
    "a zarr that is not a trace store": Case(_plain_zarr, ["zarr.json", "'tracediff'"]),
    "format version from the future": Case(lambda s, t: _root(s, lambda d: d["attributes"]["tracediff"].update(format=2)),
                                           ["zarr.json", "tracediff.format", "upgrade tracediff"]),
    "format version not a number": Case(lambda s, t: _root(s, lambda d: d["attributes"]["tracediff"].update(format="1")),
                                        ["zarr.json", "tracediff.format"]),
    "root zarr.json is a list": Case(lambda s, t: (s / "zarr.json").write_text("[]"), ["zarr.json", "a list"]),
    "root attributes null": Case(lambda s, t: _root(s, lambda d: d.update(attributes=None)), ["zarr.json", "attributes"]),
    "root zarr.json is zarr v2": Case(lambda s, t: _root(s, lambda d: d.update(zarr_format=2)), ["zarr.json", "zarr_format"]),
    "root zarr.json not UTF-8": Case(lambda s, t: (s / "zarr.json").write_bytes(b"\xff\xfe{\x00"), ["zarr.json", "JSON"]),
    "store path is a regular file": Case(_regular_file, ["bad.zarr", "not a trace store"]),
    "store path is a symlink loop": Case(_store_symlink_loop, ["bad.zarr", "symbolic links"]),
    "zip store truncated": Case(_zip_truncated, ["bad.zarr.zip", "not a trace store"]),
    "zip store of zarr v2": Case(_zip_v2, ["bad.zarr.zip", "zarr.json"]),
    "zip store with a damaged chunk": Case(_zip_member_damaged, ["bad.zarr.zip/{tap}/pid1/values/c/1/0", "decoded"],
                                           base="lz4", commands=STORE_ONLY),
    # -- valid stores with nothing to compare (inspect shows them: it is not run on them here)
    "empty store (no taps)": Case(_no_taps, ["bad.zarr"], commands=STORE_ONLY),
    "a tap with zero committed rows": Case(_zero_rows, ["bad.zarr", "rows"], commands=STORE_ONLY),
    "values all NaN": Case(lambda s, t: None, ["bad.zarr", "values", "NaN or Inf"], base="nan", commands=STORE_ONLY,
                           subprocess=True),
    "values all Inf": Case(lambda s, t: None, ["bad.zarr", "values", "NaN or Inf"], base="inf", commands=STORE_ONLY),
}


# ------------------------------------------------------------------------------------------- running
@dataclass
class Outcome:
    command: str
    args: list[str]
    result: CliResult
    outputs: list[Path] = field(default_factory=list)


def _make_bad(bases: dict[str, Path], case: Case, tmp: Path, tap: str) -> Path:
    store = tmp / "bad.zarr"
    shutil.copytree(bases[case.base], store)
    returned = case.damage(store, tap)
    return returned if isinstance(returned, Path) else store


def _run(command: str, bad: Path, good: Path, out: Path, real: bool) -> Outcome:
    reports = [out / "report.json", out / "report.md", out / "report.html"]
    if command == "inspect":
        args, outputs = ["inspect", bad], []
    elif command == "inspect_json":
        args, outputs = ["inspect", "--json", "-", bad], []
    elif command in ("compare_reference", "compare_candidate"):
        pair = [bad, good] if command == "compare_reference" else [good, bad]
        args = ["compare", *pair, "--json", reports[0], "--markdown", reports[1], "--html", reports[2]]
        outputs = reports
    elif command == "identify_store":
        args, outputs = ["identify", bad, "--bank", good, "--json", reports[0]], reports[:1]
    else:
        args, outputs = ["identify", good, "--bank", bad, "--json", reports[0]], reports[:1]
    result = run_tracediff(*args, timeout=60) if real else invoke_tracediff(*args)
    return Outcome(command, [str(a) for a in args], result, outputs)


def _assert_refused(outcome: Outcome, names: list[str], out: Path) -> str:
    r = outcome.result
    context = f"{outcome.args}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert r.returncode == 2, context
    assert r.stdout == "", context
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, context
    assert lines[0].startswith("tracediff: error: "), context
    assert "Traceback" not in r.stderr, context
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not any(p.exists() for p in outcome.outputs), context
    assert list(out.iterdir()) == [], f"temporary files left behind: {list(out.iterdir())}"
    return lines[0]


_COUNTS: dict[str, Any] = {"store_cases": 0, "import_cases": 0, "permission_cases": 0, "commands_run": 0,
                           "subprocess_runs": 0, "all_exit_2": True}


@pytest.fixture(scope="module", autouse=True)
def _report_counts(reliability_report: dict[str, Any]) -> Any:
    yield
    reliability_report["hostile_inputs"] = dict(_COUNTS)


@pytest.mark.parametrize("name", list(CASES))
def test_every_command_refuses_a_damaged_store_with_one_line(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    case = CASES[name]
    _COUNTS["store_cases"] += 1
    for command in case.commands:
        tap = "bank" if command == "identify_bank" else "fc_in"
        work = tmp_path / command
        work.mkdir()
        bad = _make_bad(bases, case, work, tap)
        out = work / "out"
        out.mkdir()
        # A few cases go through the real entry point: no traceback reaches a real user either.
        real = case.subprocess and command == "compare_candidate"
        with no_hang():
            outcome = _run(command, bad, bases["raw"], out, real)
        _COUNTS["commands_run"] += 1
        _COUNTS["subprocess_runs"] += int(real)
        try:
            _assert_refused(outcome, [n.format(tap=tap) for n in case.names], out)
        except AssertionError:
            _COUNTS["all_exit_2"] = False
            raise


def test_the_matrix_is_at_least_thirty_cases_wide() -> None:
    assert len(CASES) >= 30 and len(IMPORT_CASES) >= 10


def test_an_intact_copy_passes_every_command(bases: dict[str, Path], tmp_path: Path) -> None:
    """The control: the same commands on undamaged copies succeed, so each refusal above is the damage's."""
    for base in ("raw", "lz4"):
        for command in COMMANDS:
            out = tmp_path / f"{base}-{command}"
            out.mkdir()
            store = out.parent / f"{base}-{command}.zarr"
            shutil.copytree(bases[base], store)
            outcome = _run(command, store, bases["raw"], out, real=False)
            assert outcome.result.returncode == 0, (outcome.args, outcome.result.stderr)
            assert all(p.exists() for p in outcome.outputs)


# -------------------------------------------------------------------------------------- permissions
@contextlib.contextmanager
def _unprivileged() -> Iterator[None]:
    """Run as a user that file permissions apply to: as root, drop the effective uid to nobody
    (root reads everything, so chmod alone would prove nothing) and take it back after."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


UNREADABLE = {
    # what is made unreadable -> what the line names
    "fc_in/pid1/values/c": "fc_in/pid1/values/c",
    "fc_in/pid1/seq/c/0": "fc_in/pid1/seq/c/0",
    "fc_in": "fc_in/zarr.json",  # a tap that cannot be read must not silently vanish
    "zarr.json": "zarr.json",
}


@pytest.mark.parametrize("target", list(UNREADABLE))
def test_an_unreadable_part_of_a_store_is_one_line_naming_it(bases: dict[str, Path], target: str) -> None:
    shared = Path(tempfile.mkdtemp(prefix="tracediff-perm-", dir="/tmp"))  # a folder other users may enter
    try:
        shared.chmod(0o755)
        store = shared / "bad.zarr"
        shutil.copytree(bases["raw"], store)
        for path in (store, *store.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        good = shared / "good.zarr"
        shutil.copytree(store, good)
        commands = (["inspect", store], ["compare", good, store], ["identify", store, "--bank", good])
        for args in commands:  # lazy imports happen now: the interpreter's own files may be root's only
            assert invoke_tracediff(*args).returncode == 0
        with _unprivileged():  # the control: as that user, the intact store reads
            control = invoke_tracediff("compare", good, store, "-q")
        assert control.returncode == 0, control.stderr
        (store / target).chmod(0)
        empty = shared / "out"
        empty.mkdir()
        _COUNTS["permission_cases"] += 1
        for args in commands:
            with no_hang(), _unprivileged():
                result = invoke_tracediff(*args)
            _COUNTS["commands_run"] += 1
            _COUNTS["all_exit_2"] &= result.returncode == 2
            line = _assert_refused(Outcome(args[0], [str(a) for a in args], result), [UNREADABLE[target]], empty)
            assert "Permission denied" in line and "bad.zarr" in line, line
    finally:
        for path in (shared, *shared.rglob("*")):
            with contextlib.suppress(OSError):
                path.chmod(0o755)
        shutil.rmtree(shared, ignore_errors=True)


# --------------------------------------------------------------------------------- non-finite values
def test_rows_of_inf_are_a_nonfinite_finding_naming_the_rows(bases: dict[str, Path], tmp_path: Path) -> None:
    """Some rows all Inf, the rest intact: compare still decides the wiring from the finite rows and
    reports the non-finite rows as findings (exit 1), with the report files written."""
    store = tmp_path / "some_inf.zarr"
    shutil.copytree(bases["raw"], store)
    chunk = _chunk(store, "fc_in", index=0)
    values = np.fromfile(chunk, dtype=np.float32).reshape(16, -1)
    values[3:6] = np.inf
    values[7] = -np.inf
    values.tofile(chunk)
    out = tmp_path / "report.json"
    result = invoke_tracediff("compare", bases["raw"], store, "--json", out)
    assert result.returncode == 1, result.stderr
    doc = json.loads(out.read_text())
    nonfinite = [f for f in doc["findings"] if f["kind"] == "nonfinite"]
    assert len(nonfinite) == 3 and {f["evidence"]["side"] for f in nonfinite} == {"candidate"}
    assert all(f["evidence"]["rows"] == 4 and "NaN or Inf in 4 of 60" in f["message"] for f in nonfinite)
    assert [m["status"] for m in doc["segment_map"]] == ["same", "same", "same"]
    assert not {"segment_missing", "segment_extra"} & {f["kind"] for f in doc["findings"]}


# ------------------------------------------------------------------------------------------- import
def _safetensors(path: Path, length: int = 5) -> bytes:
    save_file({"hidden_states": torch.randn(length, 4, HIDDEN), "token_ids": torch.arange(length)}, str(path))
    return path.read_bytes()


def _header(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    header, body = _header(_safetensors(path))
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


class _Payload:
    """Unpickling this runs a shell command: a booby-trapped feature file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _pickle_as(path: Path) -> None:
    path.write_bytes(pickle.dumps({"input_ids": torch.arange(4), "x": _Payload(path.parent / "pwned")}, protocol=2))


def _torch_zip_truncated(path: Path) -> None:
    torch.save({"input_ids": torch.arange(4), "aux_hidden_state": torch.zeros(1, 4, 3 * HIDDEN)}, path)
    _truncate(path, 0.5)


ImportCase = tuple[str, str, Callable[[Path], None], list[str]]
IMPORT_CASES: dict[str, ImportCase] = {
    # name: (format, file name, writes the file, what the line names besides the file)
    "safetensors truncated": ("speculators", "hs_0.safetensors", lambda p: (_safetensors(p), _truncate(p)),
                              ["safetensors"]),
    "safetensors header length huge": ("speculators", "hs_0.safetensors",
                                       lambda p: p.write_bytes(struct.pack("<Q", 2**62) + b"{}"), ["safetensors"]),
    "safetensors header not JSON": ("speculators", "hs_0.safetensors",
                                    lambda p: p.write_bytes(struct.pack("<Q", 8) + b"{not js}"), ["safetensors"]),
    "safetensors dtype unknown": ("speculators", "hs_0.safetensors",
                                  lambda p: _with_header(p, lambda h: h["hidden_states"].update(dtype="Q9")), ["safetensors"]),
    "safetensors offsets disagree with the shape": (
        "speculators", "hs_0.safetensors",
        lambda p: _with_header(p, lambda h: h["hidden_states"].update(shape=[50, 4, HIDDEN])), ["safetensors"]),
    "safetensors empty file": ("speculators", "hs_0.safetensors", lambda p: p.write_bytes(b""), ["safetensors"]),
    "safetensors holding a pickle": ("speculators", "hs_0.safetensors", _pickle_as, ["safetensors"]),
    "ckpt holding a pickle": ("specforge", "data_0.ckpt", _pickle_as, ["weights_only=True"]),
    "pt holding a pickle": ("specforge", "data_0.pt", _pickle_as, ["weights_only=True"]),
    "bin holding a pickle": ("specforge", "pytorch_model.bin", _pickle_as, ["weights_only=True"]),
    "ckpt.gz not gzip": ("specforge", "data_0.ckpt.gz", lambda p: p.write_bytes(b"not gzip at all"), ["weights_only=True"]),
    "ckpt empty file": ("specforge", "data_0.ckpt", lambda p: p.write_bytes(b""), ["weights_only=True"]),
    "ckpt truncated": ("specforge", "data_0.ckpt", _torch_zip_truncated, ["weights_only=True"]),
    "ckpt is a folder": ("specforge", "data_0.ckpt", lambda p: p.mkdir(), ["no .ckpt"]),
    "safetensors is a folder": ("speculators", "hs_0.safetensors", lambda p: p.mkdir(), ["no hs_<i>.safetensors"]),
}


@pytest.mark.parametrize("name", list(IMPORT_CASES))
def test_import_refuses_a_broken_or_hostile_file_with_one_line(tmp_path: Path, name: str) -> None:
    fmt, filename, write, words = IMPORT_CASES[name]
    src = tmp_path / "src"
    src.mkdir()
    target = src / filename
    write(target)
    out_store = tmp_path / "imported.zarr"
    # The specforge importer takes a single file too (any name): then it is given the file itself.
    arg = target if fmt == "specforge" and not filename.endswith((".ckpt", ".ckpt.gz")) else src
    result = invoke_tracediff("import", fmt, arg, "-o", out_store)
    _COUNTS["import_cases"] += 1
    _COUNTS["commands_run"] += 1
    lines = result.stderr.strip().splitlines()
    if result.returncode != 2:
        _COUNTS["all_exit_2"] = False
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert (filename if target.is_file() else "src") in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not out_store.exists(), "a refused import leaves no store behind"
    assert not (src / "pwned").exists(), "the pickle payload ran"


def test_library_refusals_are_tracediff_errors(bases: dict[str, Path], tmp_path: Path) -> None:
    """The same refusals through the library raise the documented classes (StoreError subclasses)."""
    from tracediff.errors import CorruptStoreError, StoreError

    for i, (name, cls, match) in enumerate([("values chunk truncated", CorruptStoreError, "values/c/1/0"),
                                            ("values codec that is not allowed", StoreError, "gzip")]):
        (tmp_path / str(i)).mkdir()
        bad = _make_bad(bases, CASES[name], tmp_path / str(i), "fc_in")
        with pytest.raises(cls, match=match):
            compare_stores(bases["raw"], bad)


def test_a_failed_import_over_an_existing_store_keeps_the_old_store_whole(tmp_path: Path) -> None:
    """The importer builds its store under a hidden name beside the target and moves it there only
    once every file is in: a file that breaks halfway (after a good one was written) leaves the
    store that --overwrite was to replace exactly as it was, and no half-built folder."""
    src = tmp_path / "src"
    src.mkdir()
    _safetensors(src / "hs_0.safetensors", length=6)
    out_store = tmp_path / "imported.zarr"
    first = invoke_tracediff("import", "speculators", src, "-o", out_store)
    assert first.returncode == 0, first.stderr
    with TraceStore(out_store) as opened:
        before = {tap: opened.rows(tap) for tap in opened.taps}
    _safetensors(src / "hs_1.safetensors", length=7)
    _truncate(src / "hs_1.safetensors")

    again = invoke_tracediff("import", "speculators", src, "-o", out_store, "--overwrite")
    assert again.returncode == 2 and "hs_1.safetensors" in again.stderr, again.stderr
    with TraceStore(out_store) as opened:
        assert {tap: opened.rows(tap) for tap in opened.taps} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported.zarr", "src"]

    (src / "hs_1.safetensors").unlink()
    _safetensors(src / "hs_1.safetensors", length=7)
    replaced = invoke_tracediff("import", "speculators", src, "-o", out_store, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    with TraceStore(out_store) as opened:
        assert opened.rows("bank") == before["bank"] + 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported.zarr", "src"]
