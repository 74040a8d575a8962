"""Trainer adapters (`--adapter speculators`, `--adapter specforge`) and `tracediff import` on the real
frameworks: their own model classes, data readers and collate functions, tiny random configs, CPU.

What must hold: a recorded training step's rows are exactly the tensors the draft's ``fc`` received;
each row is labelled with its sample, its true position p, x_p and x_{p+1} (speculators feeds fc at
position_ids = p + 1: the trace stores p and says so in meta); the offline files of the same data
import into a reference trace whose fc rows equal the recorded ones, so ``compare`` says "match";
bad input is a one-line error (exit 2) and never runs code from a file.

Install the frameworks with requirements/frameworks-trainers.sh; without them this module is skipped.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env, invoke_tracediff, read_plain, skip_unless_installed

skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")
skip_unless_installed("specforge", reason="specforge is not installed (requirements/frameworks-trainers.sh)")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import tracediff  # noqa: E402
from tracediff.errors import AdapterError  # noqa: E402
from tracediff.store import decode_values  # noqa: E402

TESTS = Path(__file__).resolve().parent
H = tr.HIDDEN


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def _no_compile() -> Any:
    """SpecForge wraps helpers in torch.compile; on a CPU test box that costs ~25 s for nothing."""
    import torch._dynamo  # noqa: PLC0415

    previous = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = previous


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    speculators_dir = tmp_path_factory.mktemp("speculators_data")
    specforge_dir = tmp_path_factory.mktemp("specforge_data")
    tr.write_speculators_data(speculators_dir)
    tr.write_specforge_data(specforge_dir)
    return {"speculators": speculators_dir, "specforge": specforge_dir}


_SCRIPTS = {
    "speculators": """
        folder = Path(sys.argv[1])
        model = tr.build_speculators_draft()
        seen = tr.train_speculators(model, tr.speculators_batches(folder))
    """,
    "specforge": """
        folder = Path(sys.argv[1])
        strategy, _model, draft = tr.build_specforge(folder)
        seen = tr.train_specforge(strategy, draft, tr.specforge_batches(folder))
    """,
}


class _CliRuns:
    """`tracediff record --adapter NAME -- python train.py` for both frameworks, started together (they
    spend most of their time importing) as soon as the module's first test runs; joined on demand."""

    def __init__(self, work: Path, data: dict[str, Path]) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.results: dict[str, tuple[int, str]] = {}
        for name, body in _SCRIPTS.items():
            script = textwrap.dedent(f"""
                import sys
                from pathlib import Path
                sys.path.insert(0, {str(TESTS)!r})
                import trainer_runs as tr
                from safetensors.torch import save_file
            """) + textwrap.dedent(body) + textwrap.dedent("""
                save_file({f"fc{i}": t.contiguous() for i, t in enumerate(seen)}, "seen_" + sys.argv[2] + ".safetensors")
            """)
            (work / f"train_{name}.py").write_text(script)
            cmd = [sys.executable, "-m", "tracediff", "record", "--adapter", name, "--role", "trainer",
                   "-o", str(work / f"{name}.zarr"), "--", sys.executable, f"train_{name}.py", str(data[name]), name]
            self.procs[name] = subprocess.Popen(cmd, cwd=work, env=cli_env(TORCH_COMPILE_DISABLE="1"),
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self, name: str) -> tuple[Path, list[torch.Tensor], str]:
        if name not in self.results:
            _out, err = self.procs[name].communicate(timeout=300)
            self.results[name] = (self.procs[name].returncode, err)
        code, err = self.results[name]
        assert code == 0, err
        seen = load_file(self.work / f"seen_{name}.safetensors")
        return self.work / f"{name}.zarr", [seen[f"fc{i}"] for i in range(len(seen))], err

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def cli_runs(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> Any:
    runs = _CliRuns(tmp_path_factory.mktemp("cli_runs"), data)
    yield runs
    runs.stop()


@pytest.fixture(scope="module")
def speculators_run(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> dict[str, Any]:
    """In process: the draft exists before recording starts (the adapter finds it among live objects)."""
    model = tr.build_speculators_draft()
    batches = tr.speculators_batches(data["speculators"])
    store = tmp_path_factory.mktemp("speculators_rec") / "train.zarr"
    with tracediff.record(store, role="trainer", adapter="speculators") as rec:
        seen = tr.train_speculators(model, batches)
    assert rec.error is None
    return {"store": store, "seen": seen, "batches": batches}


@pytest.fixture(scope="module")
def specforge_run(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> dict[str, Any]:
    """In process: the models are built while recording (the adapter wraps their classes' __init__)."""
    tr.install_cpu_loss()
    import specforge.algorithms.eagle3.model  # noqa: F401, PLC0415  (the classes exist before recording)

    batches = tr.specforge_batches(data["specforge"])
    store = tmp_path_factory.mktemp("specforge_rec") / "train.zarr"
    with tracediff.record(store, role="trainer", adapter="specforge") as rec:
        strategy, _model, draft = tr.build_specforge(data["specforge"])
        seen = tr.train_specforge(strategy, draft, batches)
    assert rec.error is None
    return {"store": store, "seen": seen, "batches": batches}


# ------------------------------------------------------------------------------------------- helpers
def only_group(store: Path, tap: str = "fc_in") -> Any:
    (group,) = read_plain(store, tap).values()
    return group


def as_float32(group: Any) -> np.ndarray:
    return decode_values(group.values, group.attrs["dtype"])


def stored(tensors: list[torch.Tensor]) -> np.ndarray:
    """What the recorded rows must be: the fc inputs, one row per token, in the store's representation."""
    flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors])
    return flat.view(torch.int16).numpy().view(np.uint16) if flat.dtype == torch.bfloat16 else flat.numpy()


def speculators_expected(folder: Path) -> dict[tuple[int, int], tuple[np.ndarray, int, int]]:
    """From the files alone: (sample, true position p) -> (fc row, x_p or -1 on a sample's first row,
    x_{p+1}). speculators' trainer feeds fc the aux slots of positions 0..T-2 of every sample."""
    out = {}
    for s in range(len(tr.SPECULATORS_LENGTHS)):
        f = load_file(folder / "hidden_states" / f"hs_{s}.safetensors")
        hs, tokens = f["hidden_states"].float(), f["token_ids"].tolist()
        for p in range(len(tokens) - 1):
            out[(s, p)] = (hs[p, :-1].reshape(-1).numpy(), tokens[p] if p else -1, tokens[p + 1])
    return out


def specforge_expected(folder: Path) -> dict[tuple[int, int], tuple[np.ndarray, int, int]]:
    """From the files alone: (sample, p) -> (aux row, x_p or -1 at p = 0, x_{p+1} or -1 at the end)."""
    out = {}
    for s in range(len(tr.SPECFORGE_LENGTHS)):
        f = torch.load(folder / "hidden_states" / "rows_0-5000" / f"data_{s}.ckpt", weights_only=True)
        aux, tokens = f["aux_hidden_state"][0].float(), f["input_ids"].tolist()
        for p in range(len(tokens)):
            out[(s, p)] = (aux[p].numpy(), tokens[p] if p else -1, tokens[p + 1] if p + 1 < len(tokens) else -1)
    return out


def valid_rows(group: Any) -> dict[tuple[int, int], tuple[np.ndarray, int, int]]:
    lab, values = group.labels, as_float32(group)
    keep = np.flatnonzero(lab["valid"])
    return {(int(lab["seq"][i]), int(lab["position"][i])): (values[i], int(lab["token_id"][i]),
                                                           int(lab["next_token_id"][i])) for i in keep}


def assert_rows_match(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, (row, token, nxt) in want.items():
        g_row, g_token, g_next = got[key]
        assert np.array_equal(g_row, row), key
        assert (g_token, g_next) == (token, nxt), key


def assert_one_line_error(result: Any) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------- speculators
def test_speculators_training_step_records_exactly_what_fc_received(speculators_run) -> None:
    group = only_group(speculators_run["store"])
    assert group.attrs["dtype"] == "float32" and group.attrs["width"] == 3 * H
    assert group.rows == tr.MAX_LEN * len(speculators_run["batches"])  # padding rows included, marked invalid
    assert np.array_equal(group.values, stored(speculators_run["seen"]))
    assert set(group.phase_names) == {"train"}
    assert group.labels["step"].tolist() == [0] * tr.MAX_LEN + [1] * tr.MAX_LEN


def test_speculators_rows_carry_the_true_position_and_the_offset_is_in_meta(speculators_run, data) -> None:
    group = only_group(speculators_run["store"])
    assert_rows_match(valid_rows(group), speculators_expected(data["speculators"]))
    for batch, start in zip(speculators_run["batches"], (0, tr.MAX_LEN), strict=True):
        rows = slice(start, start + tr.MAX_LEN)
        real = batch["document_ids"][0].numpy() >= 0
        assert np.array_equal(group.labels["valid"][rows], real)
        # The trainer's position_ids are p + 1: the trace keeps p.
        assert np.array_equal(group.labels["position"][rows][real], batch["position_ids"][0].numpy()[real] - 1)
        assert np.array_equal(group.labels["next_token_id"][rows][real], batch["input_ids"][0].numpy()[real])
    meta = group.attrs["meta"]
    assert meta["positions"]["position_offset"] == 1 and "p + 1" in meta["positions"]["framework"]
    assert meta["framework"] == "speculators" and meta["framework_version"] == "0.9.0"
    assert meta["hidden_size"] == H
    assert meta["aux_layer_ids"]["ids"] == tr.SPECULATORS_LAYER_IDS
    assert "top level" in meta["aux_layer_ids"]["read_from"]
    assert group.attrs["segment_size"] == H
    assert group.attrs["segment_labels"] == [f"hs{i}" for i in tr.SPECULATORS_LAYER_IDS]
    assert group.attrs["position_offset"] == 1
    assert group.attrs["source"]["framework"] == "speculators"


def test_speculators_import_equals_the_recorded_training_rows(speculators_run, data, tmp_path) -> None:
    out = tmp_path / "imported.zarr"
    result = invoke_tracediff("import", "speculators", data["speculators"], "-o", out, "--layer-ids", "1,2,3")
    assert result.returncode == 0, result.stderr
    imported = only_group(out)
    # The importer knows x_0, the live trainer does not (shift_batch dropped it): compare the rest.
    want = {k: (row, token if k[1] else -1, nxt) for k, (row, token, nxt) in valid_rows(imported).items()}
    assert_rows_match(valid_rows(only_group(speculators_run["store"])), want)
    assert imported.attrs["dtype"] == "bfloat16"
    assert imported.attrs["segment_labels"] == ["hs1", "hs2", "hs3"]
    assert imported.attrs["meta"]["positions"]["position_offset"] == 1
    bank = only_group(out, "bank")
    assert bank.attrs["width"] == 4 * H and bank.rows == sum(tr.SPECULATORS_LENGTHS)
    assert bank.attrs["segment_labels"] == ["hs1", "hs2", "hs3", "last_layer_pre_norm"]
    hs0 = load_file(data["speculators"] / "hidden_states" / "hs_0.safetensors")["hidden_states"]
    assert np.array_equal(bank.values[: len(hs0)], hs0.reshape(len(hs0), -1).view(torch.int16).numpy().view(np.uint16))
    verdict = invoke_tracediff("compare", out, speculators_run["store"], "--quiet")
    assert verdict.returncode == 0 and verdict.stdout.startswith("match"), verdict.stdout + verdict.stderr


def test_speculators_fp8_files_import_as_the_trainer_reads_them(tmp_path) -> None:
    """FP8 files (hs_connectors' FP8HiddenStatesConnector) come out as speculators' FP8Transfer hands them
    to the trainer: bf16 after the per-token scale."""
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8  # noqa: PLC0415
    from hs_connectors.transfer import FP8Transfer  # noqa: PLC0415

    states = torch.randn(6, 4, H)
    fp8, scales = quantize_tensor_to_fp8(states)
    (tmp_path / "hs").mkdir()
    save_file({"hidden_states": fp8, SCALES_KEY: scales, "token_ids": torch.arange(6)}, str(tmp_path / "hs" / "hs_0.safetensors"))
    assert invoke_tracediff("import", "speculators", tmp_path / "hs", "-o", tmp_path / "s.zarr").returncode == 0
    trainer_sees = FP8Transfer(tmp_path / "hs").get_cached(0)["hidden_states"]  # bf16 [T, 4, H]
    bank = only_group(tmp_path / "s.zarr", "bank")
    assert bank.attrs["dtype"] == "bfloat16"
    assert np.array_equal(bank.values, trainer_sees.reshape(6, -1).view(torch.int16).numpy().view(np.uint16))


def test_speculators_through_tracediff_record(cli_runs, data) -> None:
    store, seen, _err = cli_runs.result("speculators")
    group = only_group(store)
    assert np.array_equal(group.values, stored(seen))
    assert_rows_match(valid_rows(group), speculators_expected(data["speculators"]))
    assert group.attrs["meta"]["positions"]["position_offset"] == 1
    assert group.attrs["source"]["adapter"] == "speculators"


def test_speculators_subclass_with_another_forward_is_skipped_with_a_log(caplog, tmp_path) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel  # noqa: PLC0415

    from tracediff.adapters import speculators as adapter  # noqa: PLC0415

    class RowSamplingDraft(Eagle3DraftModel):  # like speculators' PEagleDraftModel: fc sees a subset of rows
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    model = tr.build_speculators_draft()
    model.__class__ = RowSamplingDraft
    with tracediff.record(tmp_path / "s.zarr") as rec, caplog.at_level(logging.WARNING, logger="tracediff"):
        assert adapter.attach(rec, model) is False
    assert "overrides Eagle3DraftModel.forward" in caplog.text


# ----------------------------------------------------------------------------------------- SpecForge
def test_specforge_training_step_records_exactly_what_fc_received(specforge_run) -> None:
    group = only_group(specforge_run["store"])
    assert group.attrs["dtype"] == "bfloat16" and group.attrs["width"] == 3 * H
    assert np.array_equal(group.values, stored(specforge_run["seen"]))
    assert set(group.phase_names) == {"train"}


def test_specforge_rows_are_labelled_from_the_trainer_forward(specforge_run, data) -> None:
    group = only_group(specforge_run["store"])
    assert_rows_match(valid_rows(group), specforge_expected(data["specforge"]))
    masks = torch.cat([b["attention_mask"].reshape(-1) for b in specforge_run["batches"]]).numpy() != 0
    assert np.array_equal(group.labels["valid"], masks)
    meta = group.attrs["meta"]
    assert meta["framework"] == "specforge" and meta["framework_version"] == "0.2.0"
    assert meta["positions"]["position_offset"] == 0
    aux = meta["aux_layer_ids"]
    assert aux["ids"] == tr.SPECFORGE_LAYER_IDS and "eagle_config" in aux["read_from"]
    assert aux["hf_hidden_states"] == [i + 1 for i in tr.SPECFORGE_LAYER_IDS]
    assert group.attrs["segment_size"] == H
    assert group.attrs["segment_labels"] == [f"hs{i + 1}" for i in tr.SPECFORGE_LAYER_IDS]
    assert meta["trainer"]["ttt_length"] == 2


def test_specforge_import_equals_the_recorded_training_rows(specforge_run, data, tmp_path) -> None:
    out = tmp_path / "imported.zarr"
    result = invoke_tracediff("import", "specforge", data["specforge"] / "hidden_states", "-o", out,
                              "--layer-ids", "0,1,2")
    assert result.returncode == 0, result.stderr
    imported = only_group(out)
    want = {k: (row, token if k[1] else -1, nxt) for k, (row, token, nxt) in valid_rows(imported).items()}
    assert_rows_match(valid_rows(only_group(specforge_run["store"])), want)
    assert imported.attrs["segment_labels"] == ["hs1", "hs2", "hs3"]
    bank = only_group(out, "bank")
    assert bank.attrs["width"] == 4 * H and bank.attrs["segment_labels"][-1] == "final_norm_out"
    verdict = invoke_tracediff("compare", out, specforge_run["store"], "--quiet")
    assert verdict.returncode == 0 and verdict.stdout.startswith("match"), verdict.stdout + verdict.stderr


def test_specforge_gzipped_files_import_like_plain_ones(data, tmp_path) -> None:
    import gzip  # noqa: PLC0415

    folder = tmp_path / "gz"
    folder.mkdir()
    for i in range(len(tr.SPECFORGE_LENGTHS)):
        raw = (data["specforge"] / "hidden_states" / "rows_0-5000" / f"data_{i}.ckpt").read_bytes()
        (folder / f"data_{i}.ckpt.gz").write_bytes(gzip.compress(raw))
    plain, zipped = tmp_path / "plain.zarr", tmp_path / "zipped.zarr"
    assert invoke_tracediff("import", "specforge", data["specforge"], "-o", plain).returncode == 0
    assert invoke_tracediff("import", "specforge", folder, "-o", zipped).returncode == 0
    for tap in ("fc_in", "bank"):
        a, b = only_group(plain, tap), only_group(zipped, tap)
        assert np.array_equal(a.values, b.values)
        assert all(np.array_equal(a.labels[k], b.labels[k]) for k in a.labels)


def test_specforge_through_tracediff_record(cli_runs, data) -> None:
    store, seen, _err = cli_runs.result("specforge")
    group = only_group(store)
    assert np.array_equal(group.values, stored(seen))
    assert_rows_match(valid_rows(group), specforge_expected(data["specforge"]))
    assert group.attrs["source"]["adapter"] == "specforge"


class _Payload:
    """Unpickling this runs a shell command: what a booby-trapped feature file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_specforge_import_refuses_a_pickle_payload(writer, tmp_path) -> None:
    folder, marker = tmp_path / "features", tmp_path / "pwned"
    folder.mkdir()
    payload = {"input_ids": torch.arange(4), "aux_hidden_state": torch.zeros(1, 4, 3 * H), "x": _Payload(marker)}
    if writer == "torch.save":
        torch.save(payload, folder / "data_0.ckpt")
    else:
        (folder / "data_0.ckpt").write_bytes(pickle.dumps(payload))
    result = invoke_tracediff("import", "specforge", folder, "-o", tmp_path / "s.zarr")
    assert_one_line_error(result)
    assert "weights_only=True" in result.stderr
    assert not marker.exists() and not (tmp_path / "s.zarr").exists()


# ---------------------------------------------------------------------------------------- bad input
def _hs_file(path: Path, length: int, hidden: int, slots: int = 4, **extra: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"hidden_states": torch.randn(length, slots, hidden), "token_ids": torch.arange(length)}
    tensors.update(extra)
    save_file({k: v for k, v in tensors.items() if k not in extra or extra[k] is not None}, str(path))


def _two_models(d: Path) -> None:
    _hs_file(d / "hs_0.safetensors", 5, H)
    _hs_file(d / "hs_1.safetensors", 5, 2 * H)  # another model's hidden size


BAD_IMPORTS = {
    "missing folder": (lambda d: None, ["no-such-dir"], "not a folder"),
    "no files": (lambda d: d.mkdir(), [], "no hs_<i>.safetensors"),
    "files of two models": (lambda d: _two_models(d), [], "two different models"),
    "layer ids do not fit": (lambda d: _hs_file(d / "hs_0.safetensors", 5, H), ["--layer-ids", "1,2"], "3 aux"),
    "not safetensors": (lambda d: (d.mkdir(), (d / "hs_0.safetensors").write_text("junk")), [], "not a readable"),
    "missing key": (lambda d: (d.mkdir(), save_file({"hidden_states": torch.zeros(3, 4, H)}, str(d / "hs_0.safetensors"))),
                    [], "token_ids"),
}


@pytest.mark.parametrize("case", BAD_IMPORTS, ids=list(BAD_IMPORTS))
def test_bad_speculators_imports_are_one_line_errors(case, tmp_path) -> None:
    make, extra, words = BAD_IMPORTS[case]
    src = tmp_path / "hs"
    make(src)
    if extra[:1] == ["no-such-dir"]:
        src, extra = tmp_path / "no-such-dir", []
    out = tmp_path / "s.zarr"
    result = invoke_tracediff("import", "speculators", src, "-o", out, *extra)
    assert_one_line_error(result)
    assert words in result.stderr
    assert not out.exists(), "a failed import leaves no store behind"


def test_import_refuses_to_overwrite_without_the_flag(tmp_path) -> None:
    _hs_file(tmp_path / "hs" / "hs_0.safetensors", 5, H)
    assert invoke_tracediff("import", "speculators", tmp_path / "hs", "-o", tmp_path / "s.zarr").returncode == 0
    assert_one_line_error(invoke_tracediff("import", "speculators", tmp_path / "hs", "-o", tmp_path / "s.zarr"))
    again = invoke_tracediff("import", "speculators", tmp_path / "hs", "-o", tmp_path / "s.zarr", "--overwrite")
    assert again.returncode == 0, again.stderr


def test_a_store_of_another_model_on_the_same_tokens_is_a_shape_mismatch(speculators_run, data, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for i in range(len(tr.SPECULATORS_LENGTHS)):  # the same samples through a model twice as wide
        tokens = load_file(data["speculators"] / "hidden_states" / f"hs_{i}.safetensors")["token_ids"]
        save_file({"hidden_states": torch.randn(len(tokens), 4, 2 * H), "token_ids": tokens},
                  str(other / f"hs_{i}.safetensors"))
    assert invoke_tracediff("import", "speculators", other, "-o", tmp_path / "o.zarr").returncode == 0
    result = invoke_tracediff("compare", speculators_run["store"], tmp_path / "o.zarr")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR shape" in result.stdout and "Traceback" not in result.stderr


def test_a_store_of_another_model_on_other_inputs_is_a_one_line_error(speculators_run, specforge_run) -> None:
    assert_one_line_error(invoke_tracediff("compare", speculators_run["store"], specforge_run["store"]))


def test_an_adapter_whose_framework_is_missing_is_a_one_line_error(monkeypatch, tmp_path) -> None:
    import importlib.util  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "specforge" else real(name, *a))
    result = invoke_tracediff("record", "--adapter", "specforge", "-o", tmp_path / "s.zarr", "--", sys.executable, "-c", "0")
    assert_one_line_error(result)
    assert "'specforge'" in result.stderr and "not installed" in result.stderr
    with pytest.raises(AdapterError, match="not installed"):
        tracediff.record(tmp_path / "t.zarr", adapter="specforge")
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "t.zarr").exists()
