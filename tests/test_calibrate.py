"""tracediff calibrate: calibration rows recomputed by the trainer's own target in the server's dtype,
and the noise model's reading of what each side recorded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracediff
from tracediff.compare.plan.noise import (
    CALIBRATION_TAP,
    decide_compute_dtype,
    neighbour_distances,
    recorded_compute_dtype,
)
from tracediff.testing.models import build_tiny_model, server_model
from tracediff.testing.pipelines import run_trainer
from tracediff.testing.tiny_llama import DraftHead, layer_states, make_sequences

L = 12
LAYERS = ["hs2", "hs6", "hs10"]


def _trainer_store(path: Path, tm, meta: dict | None = None) -> Path:
    draft = DraftHead(tm.hidden_size, len(LAYERS))
    meta = {"aux_layers": {"ids": [2, 6, 10], "convention": "capture"}, "num_hidden_layers": L} if meta is None else meta
    with tracediff.record(path, role="trainer", meta=meta) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=tm.hidden_size)
        run_trainer(tm, draft, make_sequences(n_seqs=3, min_len=10, max_len=16, seed=1), LAYERS, dtype=torch.float32,
                    on_batch=lambda lab: rec.labels(**lab))
    return path


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("qwen3", hidden_size=64, num_layers=L)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _cli_all([list(args)])[0]


def _cli_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Each ``tracediff`` command line in its own process, all at once (each imports torch and
    transformers: most of its time), once all have ended."""
    procs = [subprocess.Popen([sys.executable, "-m", "tracediff", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in commands]
    streams = [proc.communicate(timeout=300) for proc in procs]  # (each waits: its return code is known after)
    return [subprocess.CompletedProcess(proc.args, proc.returncode, *got) for proc, got in zip(procs, streams, strict=True)]


def test_calibration_rows_are_the_target_recomputed_in_bf16(tiny, tmp_path):
    store = _trainer_store(tmp_path / "train.zarr", tiny)
    done = tracediff.calibrate(store, tiny.model, dtype="bfloat16", sequences=2)
    assert done["rows"] > 0 and done["sequences"] == 2 and done["layers"] == [2, 6, 10]
    with tracediff.open_store(store) as st:
        (stream,) = st.tap_streams(CALIBRATION_TAP)
        assert stream.dtype == "float32" and stream.width == 3 * 64 and stream.segment_size == 64
        assert stream.attrs["calibrates"] == "fc_in" and stream.attrs["compute_dtype"] == "bfloat16"
        lab = stream.labels(("seq", "position", "token_id"))
        values = tracediff.open_values(st, CALIBRATION_TAP).compute()
    names = stream.seq_names
    bf16 = server_model(tiny, "bf16")
    for seq in np.unique(lab["seq"]).tolist():
        rows = np.flatnonzero(lab["seq"] == seq)
        assert lab["position"][rows].tolist() == list(range(rows.size))
        states, _ = layer_states(bf16, torch.as_tensor(lab["token_id"][rows]))
        expected = torch.cat([states[n][0].float() for n in LAYERS], dim=-1)
        assert torch.allclose(torch.from_numpy(np.asarray(values[rows])), expected, rtol=0, atol=1e-5), names[seq]
    # A second calibration of the same store is refused, and the rows already there stay.
    with pytest.raises(tracediff.errors.StoreExistsError):
        tracediff.calibrate(store, tiny.model)
    assert tracediff.open_store(store).rows(CALIBRATION_TAP) == done["rows"]


# Slow: a calibrate process that loads a model (~10 s on two cores).
@pytest.mark.slow
def test_cli_calibrates_from_a_safetensors_folder(tmp_path):
    tm = build_tiny_model("llama", hidden_size=64, num_layers=L, massive=False)
    folder = tmp_path / "target"
    tm.model.save_pretrained(folder, safe_serialization=True)
    store = _trainer_store(tmp_path / "train.zarr", tm)
    out = _cli("calibrate", str(store), "--model", str(folder), "--sequences", "1")
    assert out.returncode == 0, out.stderr
    assert "calibration rows of 1 sequences" in out.stdout and str(store) in out.stdout
    assert tracediff.open_store(store).rows(CALIBRATION_TAP) > 0


# Slow: several calibrate processes (~15 s on two cores).
@pytest.mark.slow
def test_cli_errors_are_one_line_naming_the_file(tiny, tmp_path):
    tm = build_tiny_model("llama", hidden_size=64, num_layers=L, massive=False)
    folder = tmp_path / "target"
    tm.model.save_pretrained(folder, safe_serialization=True)
    bare = _trainer_store(tmp_path / "bare.zarr", tm, meta={})
    cases = [
        (["calibrate", str(tmp_path / "missing.zarr"), "--model", str(folder)], "missing.zarr"),
        (["calibrate", str(bare), "--model", str(folder)], "records no aux layers"),
        (["calibrate", str(bare), "--model", str(folder), "--layers", "2,6,40"], "outside the model"),
        (["calibrate", str(bare), "--model", str(tmp_path), "--layers", "2,6,10"], "no config.json"),
        (["calibrate", str(bare), "--model", str(folder), "--server-dtype", "int4"], "--server-dtype 'int4'"),
    ]
    for out, (args, text) in zip(_cli_all([args for args, _text in cases]), cases, strict=True):
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and text in lines[0], (args, out.stderr)
    assert CALIBRATION_TAP not in tracediff.open_store(bare).taps


def test_compute_dtype_is_what_the_engines_record_never_the_storage_dtype():
    server = {"store": {"server_args": {"dtype": "bfloat16"}}, "writer": {}, "tap": {"dtype": "float32"}}
    vllm = {"store": {"dtype": "torch.float16"}, "writer": {}, "tap": {}}
    stored_only = {"store": {}, "writer": {}, "tap": {"dtype": "float32"}}
    assert recorded_compute_dtype(server) == ("bfloat16", "store.server_args.dtype")
    assert recorded_compute_dtype(vllm) == ("float16", "store.dtype")
    assert recorded_compute_dtype(stored_only) == (None, "")
    trainer = {"store": {"compute_dtype": "float32"}, "writer": {}, "tap": {"dtype": "float32"}}
    decided = decide_compute_dtype(trainer, server)
    assert (decided.dtype, decided.source) == ("bfloat16", "recorded")
    # A side that records nothing counts as bfloat16, whatever it stored.
    assert decide_compute_dtype(trainer, stored_only).dtype == "bfloat16"
    assert decide_compute_dtype(trainer, stored_only).source == "assumed"
    assert recorded_compute_dtype({"store": {"server_args": {"dtype": "auto"}}}) == (None, "")


def test_neighbour_distance_is_the_reference_layers_distance_per_sqrt_of_their_spacing():
    distances = {(1, 0): 0.8, (0, 1): 0.8, (2, 1): 0.6, (1, 2): 0.6, (2, 0): 1.2, (0, 2): 1.2}
    out = neighbour_distances(lambda k, j: distances[(k, j)], [3, 19, 34])
    assert out[2][0] == pytest.approx(0.6 / 15**0.5) and out[2][1] == [2, 1]
    assert out[0][0] == pytest.approx(min(0.8 / 4, 1.2 / 31**0.5))
    assert neighbour_distances(lambda k, j: 1.0, [None, 5, 5]) == [None, None, None]
