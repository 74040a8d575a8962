"""The sglang adapter's edges that need no SGLang: the end-of-run warnings of `tracediff record`,
`--all-ranks`, the plugin entry point's gate, and an adapter whose framework is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, invoke_tracediff, run_tracediff

from tracediff.adapters import sglang as adapter

SERVER = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--host", "127.0.0.1"]
CAPTURE_ONLY = [*SERVER, "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
WITH_DRAFT = [*SERVER, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d"]


def desc(**rows: int) -> dict:
    return {"taps": {tap: {"rows": n, "writers": []} for tap, n in rows.items()}}


def test_on_gpu_the_cuda_graph_flag_is_named_only_for_rows_lost_inside_graph_replays() -> None:
    # Graph replays are recorded from the runners' tensors: a point that never fired is not the graphs' doing.
    (warning, *_) = adapter.record_warnings(WITH_DRAFT, desc(aux_hidden=120))
    assert "fc_in (the EAGLE-3 draft's fc input) never fired" in warning
    assert not any("--disable-cuda-graph" in w for w in adapter.record_warnings(WITH_DRAFT, desc(aux_hidden=120)))
    lost = {"rows": 12, "dropped_rows": 8, "drop_reason": "the fc input after norm_before_fc / fc_norm stays inside "
            "a graph replay; --disable-cuda-graph records them from the module hooks"}
    taps = {"aux_hidden": {"rows": 120, "writers": []}, "fc_in": {"rows": 12, "writers": [lost]}}
    warnings = adapter.record_warnings(WITH_DRAFT, {"taps": taps})
    assert [w for w in warnings if "--disable-cuda-graph" in w] == [
        "sglang: 8 rows of fc_in were computed inside CUDA-graph replays whose tensors do not hold them: add "
        "--disable-cuda-graph to record them"]
    assert adapter.record_warnings([*WITH_DRAFT, "--device", "cpu"], {"taps": taps}) == [
        w for w in adapter.record_warnings([*WITH_DRAFT, "--device", "cpu"], {"taps": taps}) if "radix" in w]


def test_capture_only_mode_that_recorded_nothing_on_cpu_asks_for_requests() -> None:
    warnings = adapter.record_warnings([*CAPTURE_ONLY, "--device", "cpu"], desc())
    assert len(warnings) == 1 and "aux_hidden" in warnings[0] and "tracediff send" in warnings[0]


def test_a_server_without_eagle3_or_aux_capture_is_told_what_to_add() -> None:
    (warning,) = adapter.record_warnings(SERVER, desc())
    assert "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3" in warning


def test_the_radix_cache_is_named_when_rows_were_recorded_with_it_on() -> None:
    warnings = adapter.record_warnings([*CAPTURE_ONLY, "--device", "cpu"], desc(aux_hidden=52))
    assert warnings == [w for w in warnings if "--disable-radix-cache" in w] and len(warnings) == 1
    assert adapter.record_warnings([*CAPTURE_ONLY, "--device", "cpu", "--disable-radix-cache"],
                                   desc(aux_hidden=52)) == []


def test_commands_that_are_not_sglang_get_no_sglang_warnings() -> None:
    assert adapter.record_warnings(["python", "train.py"], desc()) == []


def test_an_adapter_whose_framework_is_missing_is_a_one_line_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    result = invoke_tracediff("record", "--adapter", "sglang", "-o", tmp_path / "s.zarr", "--",
                              sys.executable, "-c", "pass")
    assert result.returncode == 2
    assert result.stderr == ("tracediff: error: adapter 'sglang' needs the Python package 'sglang', which is not "
                             "installed here\n")
    assert not (tmp_path / "s.zarr").exists()


def test_all_ranks_reaches_every_recorded_process(tmp_path: Path) -> None:
    show = ("import json, os, torch; torch.nn.Linear(2, 2)(torch.ones(1, 2)); "  # one row: a run that records
            "print(json.loads(os.environ['TRACEDIFF_CONFIG'])['all_ranks'])")     # none exits 2
    result = run_tracediff("record", "--all-ranks", "--tap", "Linear:input", "-o", tmp_path / "s.zarr", "--",
                           sys.executable, "-c", show)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def _plugin(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = ("from tracediff.adapters.sglang import sglang_plugin; sglang_plugin(); "
            "from tracediff.record.inject import current_config; import json; print(json.dumps(current_config()))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=cli_env(**env), cwd=tmp_path)


def test_the_plugin_entry_point_does_nothing_unless_its_variable_names_a_store(tmp_path: Path) -> None:
    result = _plugin(tmp_path)
    assert result.returncode == 0 and json.loads(result.stdout) == {}
    assert os.listdir(tmp_path) == []


def test_the_plugin_entry_point_creates_the_store_and_activates_the_adapter(tmp_path: Path) -> None:
    store = tmp_path / "server.zarr"
    result = _plugin(tmp_path, TRACEDIFF_SGLANG_STORE=str(store), TRACEDIFF_SGLANG_ALL_RANKS="1")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["adapters"] == ["sglang"] and config["store"] == str(store) and config["all_ranks"] is True
    assert (store / "zarr.json").is_file()
    again = _plugin(tmp_path, TRACEDIFF_SGLANG_STORE=str(store))  # another process of the same server
    assert again.returncode == 0 and json.loads(again.stdout)["store"] == str(store)
