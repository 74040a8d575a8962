"""A tap's ``zeroed_slots`` attribute: rows in which the engine itself zeroes a slot (vLLM's MTP layer
zeroes the embedding at position 0). Compare leaves those rows out of the pairing and the light lint
does not count them as a slot left unfilled; without the attribute the same zeros are a finding.

The rows are the MTP head inputs of a real forward of the tiny DeepSeek-V3 + MTP checkpoint
(:mod:`tracediff.testing.deepseek_mtp`): the trainer's as a trainer computes them, the engine's with
the embedding half of position 0 zeroed, as vLLM feeds it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tracediff as td
from tracediff.store import open_store
from tracediff.store.row_model import mtp

SEQS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35]]
ZEROED = [{"slot": 0, "positions": [0], "engine": "vllm", "why": "vLLM's MTP layer zeroes the embedding at position 0"}]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    from tracediff.testing.deepseek_mtp import mtp_head_inputs, write_deepseek_mtp

    path = write_deepseek_mtp(tmp_path_factory.mktemp("zeroed") / "target")
    return {"trainer": mtp_head_inputs(path, SEQS), "engine": mtp_head_inputs(path, SEQS, zero_position0=True)}


def _store(path: Path, values: list, role: str, **attrs: object) -> Path:
    with td.record(path, role=role, on_full="block") as rec:
        rec.declare("fc_in", segment_size=128, segment_labels=["embed_next", "hidden"], row_model=mtp(final_norm=True),
                    **attrs)
        for i, (ids, v) in enumerate(zip(SEQS, values, strict=True)):
            n = len(ids) - 1
            rec.capture("fc_in", v, labels={"seq": np.array([str(i)] * n, dtype=object), "position": np.arange(n),
                                            "token_id": np.array(ids[:-1]), "next_token_id": np.array(ids[1:]),
                                            "phase": "train", "step": i, "valid": True})
    return path


def _compare(ref: Path, cand: Path, out: Path) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(ref), str(cand), "--json", str(out)],
                            capture_output=True, text=True, timeout=180)
    return result.returncode, json.loads(out.read_text())


def test_declared_zeroed_rows_are_left_out_of_compare_and_of_the_light_lint(tmp_path: Path, rows) -> None:
    ref = _store(tmp_path / "train.zarr", rows["trainer"], "trainer")
    cand = _store(tmp_path / "server.zarr", rows["engine"], "server", zeroed_slots=ZEROED)
    code, report = _compare(ref, cand, tmp_path / "r.json")
    assert code == 0 and report["verdict"] == "match", report["findings"]
    with open_store(cand) as st:
        (stream,) = st.tap_streams("fc_in")
        assert stream.attrs["row_checks"]["zero_rows"] == [0, 0]  # the zeroed rows are declared


def test_the_same_zeros_undeclared_are_a_finding_on_the_embedding_slot(tmp_path: Path, rows) -> None:
    ref = _store(tmp_path / "train.zarr", rows["trainer"], "trainer")
    cand = _store(tmp_path / "server.zarr", rows["engine"], "server")
    code, report = _compare(ref, cand, tmp_path / "r.json")
    assert code == 1 and report["verdict"] == "mismatch"
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert errors and all("segment 1" not in f["message"] for f in errors), errors
    with open_store(cand) as st:
        (stream,) = st.tap_streams("fc_in")
        assert stream.attrs["row_checks"]["zero_rows"] == [len(SEQS), 0]
