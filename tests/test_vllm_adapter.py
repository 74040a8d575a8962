"""The vllm adapter: its pure parts here, and a real in-process vLLM engine (tests/vllm_children.py,
run in the vLLM venv) for what must never break the engine: an exception inside the adapter, and a
vLLM whose internals moved."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tracediff.adapters import vllm as adapter
from tracediff.adapters.vllm_labels import client_request_id
from tracediff.adapters.vllm_provenance import canonical_aux_layers
from tracediff.drafts import d2t_facts

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(("engine_id", "client"), [
    ("cmpl-seq-17-0-1a2b3c4d", "seq-17"),      # /v1/completions with request_id "seq-17"
    ("cmpl-abc-2-deadbeef", "abc-2"),          # the third prompt of a batched completion
    ("chatcmpl-run7-0123abcd", "run7"),        # /v1/chat/completions
    ("0-89abcdef", "0"),                       # LLM.generate's counter
    ("my-id", "my-id"),                        # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
])
def test_the_client_request_id_is_recovered_from_vllms_engine_id(engine_id: str, client: str) -> None:
    assert client_request_id(engine_id) == client


def test_d2t_as_offsets_and_as_absolute_ids_are_told_apart() -> None:
    kept = torch.tensor([0, 3, 4, 9, 10, 15])  # the target ids a 6-token draft vocabulary keeps
    offsets = kept - torch.arange(6)
    assert d2t_facts(offsets, vocab=16)["kind"] == "offsets"
    assert d2t_facts(kept, vocab=16)["kind"] == "absolute ids"  # as offsets: 15 + 5 = 20, outside
    assert d2t_facts(torch.zeros(6, dtype=torch.long), vocab=16)["kind"] == "offsets"
    # Every kept id 2 apart: both readings are valid maps; t2d (the kept ids' mask) decides.
    even = torch.arange(0, 12, 2)
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[even] = True
    assert d2t_facts(even - torch.arange(6), vocab=16)["kind"].startswith("absolute ids (probably")
    assert d2t_facts(even - torch.arange(6), vocab=16, t2d=t2d)["kind"] == "offsets"
    assert d2t_facts(even, vocab=16, t2d=t2d)["kind"] == "absolute ids"
    assert d2t_facts(None, vocab=16) == {"present": False}
    a, b = d2t_facts(offsets, 16)["sha256"], d2t_facts(kept, 16)["sha256"]
    assert a != b and len(a) == 64


def test_canonical_aux_layers_follow_what_vllm_resolved() -> None:
    meta = {"aux_hidden_state_layers": [1, 3, 4], "draft": {"aux_layer_ids": [4, 1, 3, 3]}}
    assert canonical_aux_layers(meta) == {"ids": [4, 1, 3, 3], "convention": "vllm", "framework": "vllm",
                                          "field": "eagle_aux_hidden_state_layer_ids", "resolved": [1, 3, 4]}
    raw = canonical_aux_layers({"aux_hidden_state_layers": [5, 2], "draft": {"aux_layer_ids": [5, 2]}})
    assert raw is not None and raw["convention"] == "capture" and raw["ids"] == [5, 2]  # a raw-order path


def test_the_resolved_order_is_what_compare_reads_as_physical_layers() -> None:
    from tracediff.adapters.conventions import aux_layers_from_meta

    meta = {"aux_layers": canonical_aux_layers(
        {"aux_hidden_state_layers": [1, 3, 4], "draft": {"aux_layer_ids": [4, 1, 3, 3]}})}
    found = aux_layers_from_meta(meta)
    assert found is not None and found.physical == [1, 3, 4] and found.framework == "vllm"


def test_record_warnings_name_the_flags_to_add() -> None:
    serve = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    no_draft = adapter.record_warnings(serve, {"taps": {}})
    assert len(no_draft) == 1 and "--speculative-config" in no_draft[0]
    rows = {"taps": {"fc_in": {"rows": 10}, "aux_hidden": {"rows": 10}}}
    warned = adapter.record_warnings([*serve, "--speculative-config", "{}"], rows)
    assert any("--no-enable-prefix-caching" in w for w in warned)
    assert not adapter.record_warnings([*serve, "--speculative-config", "{}", "--no-enable-prefix-caching"], rows)
    assert adapter.record_warnings(["python", "train.py"], rows) == []


def test_the_fix_names_a_cross_engine_numbering_mixup() -> None:
    from tracediff.adapters.conventions import CONVENTIONS, AuxLayers, to_physical
    from tracediff.compare.findings.remedy import propose_fix

    ref = AuxLayers([2, 4, 5], "aux_layers", "capture", [2, 4, 5])
    cand = AuxLayers([1, 3, 4], "aux_layers", "vllm", to_physical([1, 3, 4], CONVENTIONS["vllm"]), framework="vllm")
    fix = propose_fix([], 3, ref, cand, "vllm")
    assert fix.value == [2, 4, 5] and fix.numbering_mixup is not None
    assert fix.numbering_mixup["convention"] == "sglang"
    assert "are the sglang numbering of those layers" in fix.sentence()
    other = AuxLayers([0, 1, 2], "aux_layers", "vllm", [0, 1, 2], framework="vllm")
    assert propose_fix([], 3, ref, other, "vllm").numbering_mixup is None


# ------------------------------------------------------------------------- a real engine, in process
def _inprocess(tmp_path: Path, fault: str) -> tuple[dict, subprocess.CompletedProcess[str], Path]:
    import vllm_harness as h

    python = h.vllm_python()
    tl = h.build_target(tmp_path)
    draft = h.build_draft(tmp_path, "draft", tl, [2, 4, 5], "top")
    store = tmp_path / "server.zarr"
    run = subprocess.run([str(python), str(HERE / "vllm_children.py"), "inprocess", str(store),
                          str(tmp_path / "target"), str(draft), fault],
                         capture_output=True, text=True, timeout=600, env=h.vllm_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return result, run, store


@pytest.mark.slow
def test_an_in_process_recorder_captures_and_removes_its_patches_at_close(tmp_path: Path) -> None:
    from tracediff.store import open_store

    result, run, store = _inprocess(tmp_path, "none")
    assert result["recorded"] == result["plain"]
    assert result["summary"]["fc_in"]["rows"] > 0 and result["summary"]["fc_in"]["skipped"] is None
    assert result["patched"] is False  # closing the recorder put vLLM's methods back
    s = open_store(store)
    assert {t: s.rows(t) for t in s.taps} == {t: result["summary"][t]["rows"]
                                              for t in ("aux_hidden", "fc_in", "draft_steps")}
    assert result["summary"]["draft_steps"]["rows"] > 0


@pytest.mark.slow
def test_an_exception_in_the_adapter_logs_once_and_serving_goes_on(tmp_path: Path) -> None:
    result, run, _ = _inprocess(tmp_path, "labels")
    assert result["recorded"] == result["plain"]  # the engine produced the same tokens
    assert len(result["recorded"]["a"]) == 8
    lines = [line for line in run.stderr.splitlines() if "tracediff: vllm adapter" in line and "not recorded" in line]
    assert len(lines) == 2, lines  # aux_hidden and fc_in, once each, for every step that followed
    assert all("injected fault in the label builder" in line and "serving goes on" in line for line in lines)
    assert result["summary"]["fc_in"]["rows"] == 0


@pytest.mark.slow
def test_a_vllm_whose_internals_moved_gets_a_clear_skip_not_a_crash(tmp_path: Path) -> None:
    result, run, _ = _inprocess(tmp_path, "moved")
    assert result["recorded"] == result["plain"]
    lines = [line for line in run.stderr.splitlines() if "tracediff: vllm adapter" in line]
    assert any("cannot find vllm.v1.spec_decode.no_such_module" in line and "internals moved" in line
               for line in lines), run.stderr[-3000:]
    assert result["patched"] is False


@pytest.mark.slow
def test_vllm_loads_the_plugin_entry_point_gated_by_its_variable(tmp_path: Path) -> None:
    """No `tracediff record`: vLLM's own general-plugins loading records into TRACEDIFF_VLLM_STORE in
    the processes it spawns; without the variable the installed plugin does nothing."""
    import vllm_harness as h

    from tracediff.store import open_store
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    tl = h.build_target(tmp_path)
    draft = h.build_draft(tmp_path, "draft", tl, [2, 4, 5], "top")
    train = tmp_path / "train.zarr"
    h.record_trainer(train, tl, ["hs2", "hs4", "hs5"], make_sequences(n_seqs=2, min_len=6, max_len=9,
                                                                     vocab_size=h.VOCAB, seed=3))
    store = tmp_path / "plugin.zarr"
    env = dict(h.vllm_env(), TRACEDIFF_VLLM_STORE=str(store))
    run = subprocess.run([str(python), str(HERE / "vllm_children.py"), "offline", str(train), str(tmp_path / "target"),
                          str(draft), "2"], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open_store(store) as s:
        assert s.rows("fc_in") > 0 and s.source.get("recorded_by") == ["vllm plugin", "TRACEDIFF_VLLM_STORE"]
        (stream,) = s.tap_streams("fc_in")
        assert sorted(stream.seq_names.values()) == ["0", "1"]
