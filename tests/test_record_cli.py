"""`tracediff record -- CMD` end to end, and every bad input of `record` and `inspect`.

The recorded command is a real script run in a real subprocess tree: it builds the tiny Llama and
a draft, labels its rows with ``tracediff.labels`` (a no-op without tracediff) and saves the fc
inputs it fed; a grandchild started with multiprocessing's spawn does the same as an "engine".
Neither calls tracediff's recorder itself: the injected shim attaches the taps and the exit hooks
close the writers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import HIDDEN, REPO, CliResult, cli_env, invoke_tracediff, read_plain, run_tracediff, stored_bits
from safetensors import safe_open
from safetensors.torch import load_file

from tracediff.store import TraceWriter, create_store, open_store

FC_LAYERS = ["hs1", "hs3", "pre_norm"]

SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import os
    import sys

    import numpy as np
    import torch
    from safetensors.torch import save_file

    import tracediff
    from tracediff.testing.pipelines import run_engine, run_trainer
    from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

    LAYERS = ["hs1", "hs3", "pre_norm"]


    def feed(pipeline, dtype_name):
        dtype = getattr(torch, dtype_name)
        tl = build_tiny_llama(hidden_size=32, num_layers=4, vocab_size=128, seed=0)
        seqs = make_sequences(n_seqs=3, min_len=5, max_len=12, vocab_size=128, seed=4)
        draft = DraftHead(32, 3)
        run = run_trainer if pipeline == "trainer" else run_engine
        batches = run(tl, draft, seqs, LAYERS, dtype=dtype, on_batch=lambda lab: tracediff.labels(**lab),
                      keep_inputs=True)
        fed = {"fc_in": torch.cat([b.fc_input.reshape(-1, 3 * 32) for b in batches])}
        for key in ("seq", "position", "token_id", "next_token_id"):
            fed[key] = torch.from_numpy(np.concatenate([b.labels[key] for b in batches]))
        fed["step"] = torch.cat([torch.full((b.num_rows,), b.labels["step"]) for b in batches])
        save_file(fed, f"{pipeline}.safetensors", metadata={"pid": str(os.getpid())})


    if __name__ == "__main__":
        # The engine process starts first: it imports and records while this one feeds the trainer.
        engine = multiprocessing.get_context("spawn").Process(target=feed, args=("engine", "float32"))
        engine.start()
        feed("trainer", "bfloat16")
        engine.join()
        sys.exit(3 if engine.exitcode == 0 else 10)
    """
)


@dataclass
class Recorded:
    store: Path
    workdir: Path
    result: CliResult


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    workdir = tmp_path_factory.mktemp("record")
    (workdir / "script.py").write_text(SCRIPT)
    store = workdir / "train.zarr"
    result = run_tracediff(
        "record", "--tap", "DraftHead.fc:input", "--segment-size", HIDDEN, "--segment-labels", ",".join(FC_LAYERS),
        "--role", "trainer", "-o", store, "--", sys.executable, "script.py",
        cwd=workdir, timeout=300,
    )  # fmt: skip
    return Recorded(store=store, workdir=workdir, result=result)


def _fed(recorded: Recorded, pipeline: str) -> tuple[str, dict[str, np.ndarray]]:
    """The writer group a process wrote to, and what it fed its draft (saved by the script), as
    the store keeps it (bf16 as its bits)."""
    path = recorded.workdir / f"{pipeline}.safetensors"
    assert path.is_file(), recorded.result.stderr
    with safe_open(path, "pt") as fh:
        pid = fh.metadata()["pid"]
    return f"pid{pid}", {key: stored_bits(t) if key == "fc_in" else t.numpy() for key, t in load_file(path).items()}


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_record_propagates_the_commands_exit_code(recorded: Recorded) -> None:
    assert recorded.result.returncode == 3, recorded.result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["trainer", "engine"])
def test_each_process_of_the_command_writes_its_own_group_bit_for_bit(recorded: Recorded, pipeline: str) -> None:
    groups = read_plain(recorded.store, "fc_in")
    assert len(groups) == 2, f"the script and its spawned grandchild each write a group: {sorted(groups)}"
    writer, fed = _fed(recorded, pipeline)
    group = groups[writer]
    assert group.attrs["dtype"] == ("bfloat16" if pipeline == "trainer" else "float32")
    assert group.values.dtype == fed["fc_in"].dtype
    assert np.array_equal(
        group.values.view(f"u{group.values.itemsize}"), fed["fc_in"].view(f"u{fed['fc_in'].itemsize}")
    )
    for key in ("seq", "position", "token_id", "next_token_id", "step"):
        assert np.array_equal(group.labels[key], fed[key]), key
    assert set(group.phase_names) == ({"train"} if pipeline == "trainer" else {"prefill", "decode"})
    assert (group.attrs["segment_size"], group.attrs["segment_labels"]) == (HIDDEN, FC_LAYERS)
    assert group.attrs["module"] == "DraftHead.fc" and group.attrs["capture"] == "input"
    # Nobody called close(): the interpreter's exit (or multiprocessing's) flushed and committed.
    assert group.commit["status"] == "closed" and group.commit["dropped_rows"] == 0


@pytest.mark.slow
def test_record_prints_a_summary_of_every_group_on_stderr(recorded: Recorded) -> None:
    lines = recorded.result.stderr.splitlines()
    assert f"tracediff: command exited with code 3; store {recorded.store}" in lines
    for pipeline in ("trainer", "engine"):
        writer, fed = _fed(recorded, pipeline)
        rows = len(fed["position"])
        assert any(
            line.startswith(f"tracediff:   fc_in/{writer}: {rows} rows,") and line.endswith("closed") for line in lines
        )
    assert not [line for line in lines if "warning" in line]
    assert recorded.result.stdout == ""


@pytest.mark.slow
def test_store_root_describes_the_recorded_command(recorded: Recorded) -> None:
    root = dict(zarr.open_group(str(recorded.store), mode="r").attrs)
    assert root["tracediff"]["format"] == 1
    assert root["source"]["role"] == "trainer" and root["source"]["argv"] == [sys.executable, "script.py"]
    assert root["meta"]["record"]["taps"] == ["DraftHead.fc:input"]
    shown = invoke_tracediff("inspect", recorded.store)
    assert shown.returncode == 0 and "tap fc_in: " in shown.stdout and "3 x 32 [hs1, hs3, pre_norm]" in shown.stdout


def test_a_command_that_records_nothing_leaves_no_store_and_the_rerun_needs_no_overwrite(tmp_path: Path) -> None:
    store = tmp_path / "empty.zarr"
    for _attempt in range(2):
        result = invoke_tracediff("record", "--tap", "NoSuchClass.fc", "-o", store, "--", sys.executable, "-c", "pass")
        assert result.returncode == 2, result.stderr  # the command exited 0, but no tap fired
        assert "tracediff: no rows were recorded" in result.stderr
        assert "tap 'fc_in' (--tap NoSuchClass.fc) never fired in any process" in result.stderr
        assert f"tracediff: removed {store}: it held no rows" in result.stderr
        assert not store.exists()


# ----------------------------------------------------------------------- rows lost: never exit 0
HEAD_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch


    class Head(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = torch.nn.Linear(width, 4)

        def forward(self, x):
            return self.fc(x)


    width, steps = int(sys.argv[1]), int(sys.argv[2])
    head = Head(width)
    with torch.no_grad():
        for step in range(steps):
            head(torch.full((64, width), float(step)))
    """
)


@pytest.fixture(scope="module")
def python_without_tracediff(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trainer's own environment: a venv that imports torch (this venv's site-packages, put on
    its path by a .pth file) but not tracediff."""
    import torch

    venv = tmp_path_factory.mktemp("trainer-venv")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = cli_env()
    env.pop("PYTHONPATH", None)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (Path(purelib) / "trainer_packages.pth").write_text(f"{Path(torch.__file__).resolve().parents[1]}\n")
    probe = subprocess.run([python, "-c", "import torch\ntry:\n import tracediff\nexcept ImportError:\n pass\n"
                            "else:\n raise SystemExit(3)"], cwd=venv, env=env, capture_output=True, text=True)  # fmt: skip
    if probe.returncode == 3:
        pytest.skip("tracediff is installed (not editable) in the test venv's site-packages: no venv without it")
    assert probe.returncode == 0, probe.stderr
    return python


def _record_from_checkout(*args: object, cwd: Path) -> CliResult:
    """`python -m tracediff ...` importing this checkout's tracediff without PYTHONPATH: the
    command's processes get the shim's folder on theirs and nothing else, as with an installed
    tracediff (an interpreter without tracediff then really cannot import it)."""
    env = cli_env()
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                           "from tracediff.cli import run; sys.argv[0] = 'tracediff'; run()", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def _errors(result: CliResult) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("tracediff: error: ")]


@pytest.mark.slow
def test_a_command_whose_python_cannot_import_tracediff_fails_saying_so(
    python_without_tracediff: Path, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(HEAD_SCRIPT)
    store = tmp_path / "train.zarr"
    result = _record_from_checkout("record", "--tap", "Head.fc:input", "-o", store, "--",
                                   python_without_tracediff, "train.py", 8, 2, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    errors = _errors(result)
    assert len(errors) == 2, result.stderr
    exe = str(python_without_tracediff)
    assert errors[0].startswith(f"tracediff: error: {exe} (pid ") and "cannot import tracediff" in errors[0]
    assert f"{exe} -m pip install tracediff" in errors[0] and f"`{exe} -m tracediff record ...`" in errors[0]
    assert errors[1].endswith("exit code 2, the command itself exited with code 0")
    assert "never fired" not in result.stderr and "Traceback" not in result.stderr
    assert not store.exists()


@pytest.mark.slow
def test_a_helper_in_an_interpreter_without_tracediff_that_never_imports_torch_is_no_failure(
    python_without_tracediff: Path, tmp_path: Path
) -> None:
    """A build step in another interpreter records nothing and loses nothing: the recording of the
    trainer after it decides the exit code."""
    (tmp_path / "train.py").write_text(HEAD_SCRIPT)
    store = tmp_path / "train.zarr"
    # The trainer's interpreter gets this checkout's tracediff after the shim on its PYTHONPATH.
    steps = '"$1" -c "print(\'prepared\')" && PYTHONPATH="$PYTHONPATH:$2" exec "$3" train.py 8 2'
    result = _record_from_checkout("record", "--tap", "Head.fc:input", "-o", store, "--", "sh", "-c", steps, "sh",
                                   python_without_tracediff, REPO, sys.executable, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _errors(result) == [] and "prepared" in result.stdout
    assert f"{python_without_tracediff} (pid " in result.stderr  # the helper's own note, on its stderr
    with open_store(store) as opened:
        assert opened.rows("fc_in") == 128


@pytest.mark.slow
def test_a_recording_that_stops_on_a_full_disk_makes_record_exit_non_zero(tmp_path: Path) -> None:
    """The store on a 256 KiB tmpfs (a private mount namespace: nothing outlives the test), 64 KiB
    a batch: the writer stops on ENOSPC, the trainer goes on and exits 0, and record says which
    group lost how many rows and exits 2, keeping the command's own code in the message."""
    from test_disk_faults import _namespace_prefix  # noqa: PLC0415

    prefix = _namespace_prefix()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    (tmp_path / "train.py").write_text(HEAD_SCRIPT)
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run([*prefix, "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"', "sh",
                           mount, sys.executable, "-m", "tracediff", "record", "--tap", "Head.fc:input",
                           "--chunk-rows", "64", "-o", mount / "train.zarr", "--", sys.executable, "train.py", "256", "40"],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tracediff: error: ")]
    assert len(errors) == 2, proc.stderr
    assert errors[0].startswith("tracediff: error: fc_in/pid") and "No space left on device" in errors[0]
    committed, lost = map(int, re.search(r"after (\d+) committed rows, (\d+) rows lost", errors[0]).groups())
    assert committed % 64 == 0 and lost > 0 and committed + lost == 40 * 64
    assert errors[1].endswith("exit code 2, the command itself exited with code 0")
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ bad input
def _one_line_error(result: CliResult, *names: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tracediff: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert "Traceback" not in result.stderr
    return lines[0]


def _snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file under ``path`` with its bytes (None when absent): 'nothing half-written' is exact."""
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _existing_store(tmp: Path) -> Path:
    return create_store(tmp / "exists.zarr", role="old")


def _not_a_store_folder(tmp: Path) -> Path:
    folder = tmp / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    return folder


def _a_plain_file(tmp: Path) -> Path:
    path = tmp / "notes.txt"
    path.write_text("keep me")
    return path


RecordCase = tuple[list[str], Callable[[Path], Path], list[str]]
RECORD_CASES: dict[str, RecordCase] = {
    # name: (arguments before -o, makes the output path, what the message must name)
    "unknown adapter": (["--adapter", "sglang-typo"], lambda t: t / "s.zarr", ["'sglang-typo'", "known adapters"]),
    "bad tap spec": (["--tap", "Draft Head.fc"], lambda t: t / "s.zarr", ["'Draft Head.fc'"]),
    "bad tap capture": (["--tap", "DraftHead.fc:output@1"], lambda t: t / "s.zarr", ["'DraftHead.fc:output@1'"]),
    "duplicate tap names": (["--tap", "A.fc", "--tap", "B.fc"], lambda t: t / "s.zarr", ["fc_in"]),
    "nothing to record": ([], lambda t: t / "s.zarr", ["--tap"]),
    "bad size": (["--tap", "A.fc", "--max-bytes", "12 parsecs"], lambda t: t / "s.zarr", ["--max-bytes", "12 parsecs"]),
    "unknown phase": (["--tap", "A.fc", "--phases", "train,serving"], lambda t: t / "s.zarr", ["serving"]),
    "file as parent": (["--tap", "A.fc"], lambda t: _a_plain_file(t) / "s.zarr", ["notes.txt/s.zarr", "is a file"]),
    "existing store": (["--tap", "A.fc"], _existing_store, ["exists.zarr", "--overwrite"]),
    "overwrite a folder that is not a store": (
        ["--tap", "A.fc", "--overwrite"],
        _not_a_store_folder,
        ["results", "not a tracediff store"],
    ),
    "overwrite a plain file": (["--tap", "A.fc", "--overwrite"], _a_plain_file, ["notes.txt", "not a tracediff store"]),
    "command not found": (["--tap", "A.fc"], lambda t: t / "s.zarr", ["no-such-program-xyz"]),
}


@pytest.mark.parametrize("case", list(RECORD_CASES))
def test_record_refuses_bad_input_with_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    options, make_output, names = RECORD_CASES[case]
    output = make_output(tmp_path)
    before = _snapshot(output)
    command = ["no-such-program-xyz"] if case == "command not found" else [sys.executable, "-c", "print('ran')"]
    result = invoke_tracediff("record", *options, "-o", output, "--", *command)
    _one_line_error(result, *names)
    assert "ran" not in result.stdout
    assert _snapshot(output) == before


def test_record_refuses_an_output_under_a_read_only_folder() -> None:
    """As a user that file permissions apply to: as root the command runs as nobody (root writes anywhere)."""
    from test_hostile_inputs import _unprivileged  # noqa: PLC0415

    shared = Path(tempfile.mkdtemp(prefix="tracediff-perm-", dir="/tmp"))  # a folder other users may enter
    try:
        shared.chmod(0o755)
        locked = shared / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        with _unprivileged():
            result = invoke_tracediff("record", "--tap", "A.fc", "-o", locked / "s.zarr", "--", "true")
        _one_line_error(result, "locked")
        assert list(locked.iterdir()) == []
    finally:
        shutil.rmtree(shared)


def _future_format(tmp: Path) -> Path:
    store = create_store(tmp / "future.zarr")
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["tracediff"]["format"] = 2
    (store / "zarr.json").write_text(json.dumps(doc))
    return store


def _corrupt_commit_rows(tmp: Path) -> Path:
    store = create_store(tmp / "corrupt.zarr")
    writer = TraceWriter(store, "fc_in", "pid1", width=4, dtype="float32")
    writer.append(np.zeros((3, 4), np.float32), {})
    writer.close()
    meta = store / "fc_in" / "pid1" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["commit"]["rows"] = "three"
    meta.write_text(json.dumps(doc))
    return store


def _plain_zarr(tmp: Path) -> Path:
    zarr.open_group(str(tmp / "plain.zarr"), mode="w", attributes={"owner": "someone else"})
    return tmp / "plain.zarr"


def _junk_zip(tmp: Path) -> Path:
    with zipfile.ZipFile(tmp / "junk.zarr.zip", "w") as zf:
        zf.writestr("readme.txt", "not a store")
    return tmp / "junk.zarr.zip"


def _unreadable_zarr_json(tmp: Path) -> Path:
    store = create_store(tmp / "torn.zarr")
    (store / "zarr.json").write_text('{"zarr_format": 3, "node_')
    return store


INSPECT_CASES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    "missing": (lambda t: t / "missing.zarr", ["missing.zarr", "no such trace store"]),
    "a folder that is not zarr": (_not_a_store_folder, ["results", "zarr.json"]),
    "a plain file": (_a_plain_file, ["notes.txt", "not a trace store"]),
    "a zarr without tracediff attributes": (_plain_zarr, ["plain.zarr", "'tracediff'"]),
    "a future format version": (_future_format, ["future.zarr", "format is 2", "upgrade tracediff"]),
    "corrupt commit.rows": (_corrupt_commit_rows, ["corrupt.zarr/fc_in/pid1/zarr.json", "commit.rows", "'three'"]),
    "unreadable zarr.json": (_unreadable_zarr_json, ["torn.zarr/zarr.json"]),
    "a zip that is not a store": (_junk_zip, ["junk.zarr.zip"]),
}


@pytest.mark.parametrize("case", list(INSPECT_CASES))
def test_inspect_refuses_what_is_not_a_readable_trace_store_with_one_line(tmp_path: Path, case: str) -> None:
    make, names = INSPECT_CASES[case]
    path = make(tmp_path)
    before = _snapshot(path)
    _one_line_error(invoke_tracediff("inspect", path), *names)
    _one_line_error(invoke_tracediff("inspect", "--json", "-", path), *names)
    assert _snapshot(path) == before


def test_pack_refuses_a_folder_that_is_not_a_store_and_writes_no_zip(tmp_path: Path) -> None:
    folder = _not_a_store_folder(tmp_path)
    _one_line_error(invoke_tracediff("pack", folder), "results")
    assert not (tmp_path / "results.zip").exists()


@pytest.mark.slow
def test_errors_are_one_line_from_the_real_entry_point_too(tmp_path: Path) -> None:
    bad_spec = run_tracediff("record", "--tap", "Draft Head.fc", "-o", tmp_path / "s.zarr", "--", "true")
    _one_line_error(bad_spec, "'Draft Head.fc'")
    missing = run_tracediff("inspect", tmp_path / "missing.zarr")
    _one_line_error(missing, "missing.zarr")
    assert sorted(os.listdir(tmp_path)) == []


def test_overwrite_replaces_an_existing_store(tmp_path: Path) -> None:
    store = _existing_store(tmp_path)
    (store / "fc_in" / "stale").mkdir(parents=True)  # stale content of the old recording
    script = tmp_path / "one_step.py"
    script.write_text("import torch\nclass A(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.fc = torch.nn.Linear(4, 2)\nA().fc(torch.ones(3, 4))\n")
    result = invoke_tracediff("record", "--tap", "A.fc", "--overwrite", "--role", "new", "-o", store, "--",
                              sys.executable, script)
    assert result.returncode == 0, result.stderr
    shown = json.loads(invoke_tracediff("inspect", "--json", "-", store).stdout)
    assert shown["source"]["role"] == "new" and shown["taps"]["fc_in"]["rows"] == 3
    assert not (store / "fc_in" / "stale").exists()
    shutil.rmtree(store)
