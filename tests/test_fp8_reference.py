"""An FP8 reference (hs_connectors' FP8HiddenStatesConnector files, imported) against the same rows in
bf16: compare allows e4m3 storage noise on the reference side, says so in its noise line, and still
finds a wrong layer.

Data: a real tiny Llama with massive activations (tests/lint_data.py); the same hidden states written
by vLLM's ExampleHiddenStatesConnector (bf16: the candidate) and hs_connectors' FP8 connector (the
reference), each imported with `tracediff import speculators`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import invoke_tracediff, skip_unless_installed

skip_unless_installed("hs_connectors", reason="hs_connectors is not installed (requirements/frameworks-trainers.sh)")

import lint_data as ld  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.slow  # a model build and one vLLM-venv child (~15 s)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8ref")
    target = ld.build_target(root / "target")
    st, tok = target.stack(), target.tokens()
    wrong = [s.clone() for s in st]
    for i, s in enumerate(wrong):  # the hs4 slot holds hs5: one layer off
        s[:, 1] = target.states[i]["hs5"].to(torch.bfloat16)
    dirs = ld.write_speculators({"fp8": (st, tok, "fp8"), "bf16": (st, tok, "bf16"), "wrong": (wrong, tok, "bf16")},
                                root / "files")
    out = {}
    for name, folder in dirs.items():
        out[name] = root / f"{name}.zarr"
        result = invoke_tracediff("import", "speculators", folder, "-o", out[name], "--layer-ids", "2,4,6")
        assert result.returncode == 0, result.stderr
    return out


def _compare(ref: Path, cand: Path, tmp_path: Path) -> tuple[int, str, dict[str, Any]]:
    js = tmp_path / "report.json"
    result = invoke_tracediff("compare", ref, cand, "--verbose", "--json", js)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, result.stdout, json.loads(js.read_text())


def test_the_import_records_the_fp8_storage(stores) -> None:
    from tracediff.store import TraceStore

    meta = TraceStore(stores["fp8"]).meta
    assert meta["storage_quantisation"]["dtype"] == "float8_e4m3fn"
    assert "storage_quantisation" not in TraceStore(stores["bf16"]).meta


def test_an_fp8_reference_against_the_same_rows_in_bf16_is_a_match_without_warnings(stores, tmp_path) -> None:
    code, text, report = _compare(stores["fp8"], stores["bf16"], tmp_path)
    assert code == 0 and report["verdict"] == "match", text
    assert [f for f in report["findings"] if f["severity"] != "info"] == []
    assert report["plan"]["compute"]["storage"] == {"reference": "float8_e4m3fn"}
    assert all(n["storage_dtype"] == "float8_e4m3fn on the reference" for n in report["plan"]["noise"])
    noise_line = text[text.index("noise model"):]
    assert "float8_e4m3fn on the reference" in " ".join(noise_line.split())


def test_a_wrong_layer_against_an_fp8_reference_is_still_found(stores, tmp_path) -> None:
    code, text, report = _compare(stores["fp8"], stores["wrong"], tmp_path)
    assert code == 1, text
    kinds = {(f["kind"], f["evidence"].get("candidate_segment")) for f in report["findings"] if f["severity"] == "error"}
    assert any(seg == 1 for _kind, seg in kinds), kinds


def test_the_simulated_storage_is_hs_connectors_own_quantisation_bit_for_bit() -> None:
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    from tracediff.compare.plan.storage import round_trip

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 192, generator=gen) * torch.logspace(-4, 2, 192)
    x[:, 7] *= 300  # a massive dimension
    x[3] = 0  # a zero row: the writer's 1e-12 scale floor
    codes, scales = quantize_tensor_to_fp8(x)
    theirs = dequantize_fp8_tensor(codes, scales, torch.float32).numpy()
    assert np.array_equal(round_trip(x.numpy(), "float8_e4m3fn"), theirs)
