"""`tracediff lint` on training data made by the real producers from a real model's forward passes.

Data (tests/lint_data.py): a tiny transformers Llama with massive activations; speculators' offline
files written by vLLM's ExampleHiddenStatesConnector (bf16) and hs_connectors' FP8HiddenStatesConnector;
SpecForge's cache written by its LocalFeatureStore; a bank of every hidden state recorded with the hf
adapter; trace stores written by tracediff's importer and writer. Defects are injected into what the
producers are handed, as a broken extraction (vllm #46301) hands them.

What must hold: clean data of each format is clean (exit 0); each defect is found and named by slot
(exit 1); bad input is one line (exit 2); FP8 files are read exactly as hs_connectors' own reader reads
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env, invoke_tracediff, run_tracediff, skip_unless_installed

skip_unless_installed("hs_connectors", "specforge", reason="hs_connectors / specforge not installed "
                      "(requirements/frameworks-trainers.sh)")

import lint_data as ld  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.slow  # one model build, one vLLM-venv child that writes every data set (~20 s)

AUX = ",".join(map(str, ld.AUX_IDS))


def _with(states: list[torch.Tensor], change: Any) -> list[torch.Tensor]:
    out = [s.clone() for s in states]
    for i, s in enumerate(out):
        change(i, s)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lint")
    target = ld.build_target(root / "target")
    st, tok = target.stack(), target.tokens()
    slots = {name: i for i, name in enumerate(ld.SPECULATORS_SLOTS)}

    def zero_slot(i: int, s: torch.Tensor) -> None:
        s[:, slots["hs4"]] = 0

    def zero_rank(i: int, s: torch.Tensor) -> None:  # datagen rank 1 of 2 got samples 4..7
        if i >= 4:
            s.zero_()

    def constant_slot(i: int, s: torch.Tensor) -> None:
        s[:, slots["hs6"]] = 0.5

    def repeated_row(i: int, s: torch.Tensor) -> None:  # a stale block: one row in every position
        s[:, slots["hs2"]] = s[0, slots["hs2"]]

    def post_norm(i: int, s: torch.Tensor) -> None:
        s[:, slots["hs6"]] = target.states[i][f"hs{ld.L}"].to(torch.bfloat16)

    def other_depth(i: int, s: torch.Tensor) -> None:
        s[:, slots["hs4"]] = target.states[i]["hs6"].to(torch.bfloat16)

    def nonfinite(i: int, s: torch.Tensor) -> None:
        if i == 6:
            s[3:5, slots["hs6"], 7] = float("nan")

    dup_states = [s.clone() for s in st]
    dup_tokens = [t.clone() for t in tok]
    dup_states[5], dup_tokens[5] = st[2].clone(), tok[2].flip(0).clone()  # sample 2's states, other tokens
    sets = {
        "clean": (st, tok, "bf16"), "clean_fp8": (st, tok, "fp8"), "fp8_zero_scale": (st, tok, "fp8"),
        "zero_slot": (_with(st, zero_slot), tok, "bf16"), "zero_rank": (_with(st, zero_rank), tok, "fp8"),
        "constant_slot": (_with(st, constant_slot), tok, "bf16"), "repeated_row": (_with(st, repeated_row), tok, "bf16"),
        "post_norm": (_with(st, post_norm), tok, "bf16"), "post_norm_fp8": (_with(st, post_norm), tok, "fp8"), "other_depth": (_with(st, other_depth), tok, "bf16"),
        "duplicated": (dup_states, dup_tokens, "bf16"), "nonfinite": (_with(st, nonfinite), tok, "bf16"),
        "fp8_bad_codes": (st, tok, "fp8"),
    }
    dirs = ld.write_speculators(sets, root / "speculators")
    _zero_one_scale(dirs["fp8_zero_scale"] / "hs_3.safetensors", token=5)
    _bad_codes(dirs["fp8_bad_codes"] / "hs_1.safetensors")
    specforge = {"clean": ld.write_specforge(target, root / "specforge_clean")}
    edit = {i: {"aux_hidden_state": _zero_aux(target, i, slot=1)} for i in range(len(target.seqs))}
    specforge["zero_slot"] = ld.write_specforge(target, root / "specforge_zero", edit=edit)
    bank = ld.record_bank(target, root / "bank.zarr")
    return {"root": root, "target": target, "speculators": dirs, "specforge": specforge, "bank": bank,
            "bank_other": _narrow_bank(root / "bank_other.zarr")}


def _narrow_bank(path: Path) -> Path:
    """A bank of another model (hidden size 32): recorded with the hf adapter from a fresh tiny Llama."""
    import tracediff
    from tracediff.adapters import hf
    from tracediff.testing.tiny_llama import build_tiny_llama, layer_states

    tl = build_tiny_llama(hidden_size=32, num_layers=2, seed=1)
    with tracediff.record(path, role="bank", handle_sigterm=False) as rec, torch.no_grad():
        assert hf.attach(rec, tl.model)
        layer_states(tl, torch.arange(6))
    return path


def _zero_aux(target: ld.TargetData, i: int, slot: int) -> torch.Tensor:
    s = target.states[i]
    parts = [s[n].to(torch.bfloat16) for n in ("hs2", "hs4", "hs6")]
    parts[slot] = torch.zeros_like(parts[slot])
    return torch.cat(parts, dim=-1)[None]


def _zero_one_scale(path: Path, token: int) -> None:
    """A producer that wrote one token's scale as 0 (its codes left as they are)."""
    from safetensors.torch import load_file, save_file

    data = load_file(str(path))
    data["hidden_states_scales"][token] = 0.0
    save_file(data, str(path))


def _bad_codes(path: Path) -> None:
    """Token 2: a NaN code (0x7F); token 4: a third of its values at e4m3's largest magnitude (clipped)."""
    from safetensors.torch import load_file, save_file

    data = load_file(str(path))
    codes = data["hidden_states"].view(torch.uint8).clone()
    codes[2, 0, 0] = 0x7F
    codes[4].view(-1)[::3] = 0x7E
    data["hidden_states"] = codes.view(torch.float8_e4m3fn)
    save_file(data, str(path))


def _lint(path: Path, *extra: Any) -> tuple[int, str, dict[str, Any]]:
    out = path.parent / f"{path.name}.lint.json"
    result = invoke_tracediff("lint", path, "--json", out, *extra)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, result.stdout, json.loads(out.read_text())


def _errors(report: dict[str, Any]) -> list[tuple[str, Any]]:
    return sorted((f["kind"], f["slot"]) for f in report["findings"] if f["severity"] in ("error", "warning"))


# ------------------------------------------------------------------------------------------ clean
@pytest.mark.parametrize("name", ["clean", "clean_fp8"])
def test_clean_speculators_data_is_clean_with_target_and_bank(data, name) -> None:
    code, text, report = _lint(data["speculators"][name], "--target", data["target"].folder, "--bank", data["bank"],
                               "--layer-ids", AUX)
    assert code == 0, text
    assert report["status"] == "clean" and _errors(report) == []
    assert [s["label"] for s in report["slots"]] == ["hs2", "hs4", "hs6", "last_layer_pre_norm"]
    # The profile: massive dimensions from hs2 on, RMS growing with depth, no slot of unit RMS after the norm.
    assert all(s["massive_dims"] for s in report["slots"])
    rms = [s["rms_mean"] for s in report["slots"]]
    assert rms == sorted(rms)
    assert all(s["unit_rms_after_norm"] == 0 for s in report["slots"])
    assert all(s["depth_fit"]["best"] == s["depth_fit"]["claimed"] for s in report["slots"])


def test_clean_fp8_data_says_how_it_is_stored(data) -> None:
    _code, text, report = _lint(data["speculators"]["clean_fp8"])
    assert report["storage"] == "float8_e4m3fn with one float32 scale per token"
    assert report["fp8"]["tokens"] == sum(len(s) for s in data["target"].seqs)
    assert report["fp8"]["zero_scales"] == 0 and "FP8 scales over" in text


def test_clean_specforge_cache_is_clean(data) -> None:
    code, text, report = _lint(data["specforge"]["clean"], "--target", data["target"].folder, "--bank", data["bank"],
                               "--layer-ids", "1,3,5")
    assert code == 0, text
    assert [s["kind"] for s in report["slots"]] == ["aux", "aux", "aux", "post_norm"]
    # SpecForge's hidden_state is the final norm's output, as its slot says: no finding.
    assert report["slots"][3]["unit_rms_after_norm"] == 1.0


def test_without_target_or_bank_lint_says_what_it_cannot_tell(data) -> None:
    code, _text, report = _lint(data["speculators"]["clean"])
    assert code == 0
    infos = [f["message"] for f in report["findings"] if f["kind"] == "cannot_tell"]
    assert any("--target" in m for m in infos) and any("--bank" in m for m in infos)


# ---------------------------------------------------------------------------------------- defects
@pytest.mark.parametrize(("name", "want"), [
    ("zero_slot", [("zero_rows", 1)]),
    ("constant_slot", [("constant_rows", 2)]),
    ("repeated_row", [("duplicate_rows", 0)]),
    ("post_norm", [("other_depth", 2), ("post_norm", 2)]),
    ("other_depth", [("other_depth", 1)]),
])
def test_each_defect_is_found_and_named_by_slot(data, name, want) -> None:
    code, text, report = _lint(data["speculators"][name], "--target", data["target"].folder, "--bank", data["bank"],
                               "--layer-ids", AUX)
    assert code == 1, text
    assert sorted(set(_errors(report))) == want
    label = report["slots"][want[0][1]]["label"]
    assert f"slot {want[0][1]} ({label})" in text


def test_a_post_norm_slot_is_found_through_fp8_rounding(data) -> None:
    """e4m3 storage rounds each value by up to 2^-4: the unit-RMS test allows for it, from the data."""
    code, text, report = _lint(data["speculators"]["post_norm_fp8"], "--target", data["target"].folder,
                               "--layer-ids", AUX)
    assert code == 1, text
    assert _errors(report) == [("post_norm", 2)]
    assert [s["unit_rms_after_norm"] for s in report["slots"]][:2] == [0.0, 0.0]


def test_an_fp8_import_lints_clean_with_its_storage_named(data, tmp_path) -> None:
    store = tmp_path / "fp8.zarr"
    assert invoke_tracediff("import", "speculators", data["speculators"]["clean_fp8"], "-o", store,
                            "--layer-ids", AUX).returncode == 0
    code, text, report = _lint(store, "--target", data["target"].folder, "--bank", data["bank"])
    assert code == 0, text
    assert report["storage"].startswith("bfloat16 (imported from float8_e4m3fn")


def test_zero_rows_of_one_rank_name_the_samples(data) -> None:
    code, text, report = _lint(data["speculators"]["zero_rank"])
    assert code == 1
    zero = [f for f in report["findings"] if f["kind"] == "zero_rows"]
    assert sorted(f["slot"] for f in zero) == [0, 1, 2, 3]
    assert all(f["evidence"]["whole_samples"] == 4 for f in zero)
    assert "hs_4.safetensors..hs_7.safetensors" in text


def test_one_file_is_linted_alone(data) -> None:
    code, text, report = _lint(data["speculators"]["zero_slot"] / "hs_3.safetensors", "--layer-ids", AUX)
    assert code == 1 and report["samples"] == 1
    assert "slot 1 (hs4)" in text and "in 1 sample (hs_3.safetensors); every row of it" in text


def test_duplicated_samples_are_named(data) -> None:
    code, text, report = _lint(data["speculators"]["duplicated"])
    assert code == 1
    (dup,) = [f for f in report["findings"] if f["kind"] == "duplicate_samples"]
    assert dup["severity"] == "error" and dup["slot"] is None
    assert dup["evidence"]["samples"] == ["hs_2.safetensors", "hs_5.safetensors"]


def test_a_zero_fp8_scale_is_named_with_its_token(data) -> None:
    code, text, report = _lint(data["speculators"]["fp8_zero_scale"])
    assert code == 1
    scale = [f for f in report["findings"] if f["kind"] == "fp8_scales"]
    assert len(scale) == 1 and "hs_3.safetensors position 5" in scale[0]["message"]
    # Its row dequantises to zeros in every slot, as the trainer would read it.
    assert sorted(f["slot"] for f in report["findings"] if f["kind"] == "zero_rows") == [0, 1, 2, 3]


def test_non_finite_rows_are_named_with_their_sample_and_position(data) -> None:
    code, text, report = _lint(data["speculators"]["nonfinite"], "--layer-ids", AUX)
    assert code == 1
    (bad,) = [f for f in report["findings"] if f["kind"] == "nonfinite_rows"]
    assert bad["slot"] == 2 and bad["evidence"]["rows"] == 2
    assert [(e["sample"], e["position"]) for e in bad["evidence"]["examples"]] == [("hs_6.safetensors", 3),
                                                                                  ("hs_6.safetensors", 4)]


def test_nan_codes_and_saturated_fp8_values_are_found(data) -> None:
    code, text, report = _lint(data["speculators"]["fp8_bad_codes"])
    assert code == 1
    fp8 = {f["severity"]: f["message"] for f in report["findings"] if f["kind"] == "fp8_scales"}
    assert "NaN codes" in fp8["error"] and "hs_1.safetensors position 2" in fp8["error"]
    assert "448" in fp8["warning"] and "hs_1.safetensors position 4" in fp8["warning"]
    assert report["fp8"]["nan_codes"] == 1 and report["fp8"]["saturated_tokens"] == 1


def test_the_json_result_goes_to_stdout_with_a_dash(data) -> None:
    result = invoke_tracediff("lint", data["speculators"]["clean"], "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "clean"
    assert result.stderr.startswith("tracediff lint: CLEAN")


def test_a_zero_slot_in_specforge_cache_is_named(data) -> None:
    code, text, report = _lint(data["specforge"]["zero_slot"], "--layer-ids", "1,3,5")
    assert code == 1
    assert _errors(report) == [("zero_rows", 1)]
    assert "slot 1 (hs4)" in text


# ------------------------------------------------------------------------------------------ stores
def test_an_imported_store_lints_like_its_files(data, tmp_path) -> None:
    store = tmp_path / "train.zarr"
    assert invoke_tracediff("import", "speculators", data["speculators"]["zero_slot"], "-o", store,
                            "--layer-ids", AUX).returncode == 0
    code, text, report = _lint(store)
    assert code == 1 and report["format"] == "trace store"
    assert _errors(report) == [("zero_rows", 1)] and "slot 1 (hs4)" in text


def test_zero_rows_from_one_writer_group_are_counted_by_group(data, tmp_path) -> None:
    from tracediff.store import PHASES, TraceWriter, create_store, encode_bfloat16

    store = tmp_path / "ranks.zarr"
    create_store(store, role="trainer", meta={"hidden_size": ld.H})
    states = data["target"].stack(("hs2", "hs4", "hs6"))
    for rank in (0, 1):
        attrs = {"segment_size": ld.H, "segment_labels": ["hs2", "hs4", "hs6"], "rank": rank, "world_size": 2,
                 "phases": list(PHASES)}
        writer = TraceWriter(store, "fc_in", f"rank{rank}", width=3 * ld.H, dtype="bfloat16", attrs=attrs)
        for seq in range(rank, len(states), 2):
            rows = states[seq].float().reshape(len(states[seq]), -1).numpy()
            if rank == 1:
                rows = np.zeros_like(rows)
            n = len(rows)
            writer.append(encode_bfloat16(rows), {"seq": np.full(n, seq), "position": np.arange(n),
                                                  "token_id": np.array(data["target"].seqs[seq]),
                                                  "valid": np.ones(n, dtype=bool)})
        writer.close()
    code, text, report = _lint(store)
    assert code == 1
    zero = [f for f in report["findings"] if f["kind"] == "zero_rows"]
    assert [f["slot"] for f in zero] == [0, 1, 2]
    by_group = zero[0]["evidence"]["by_group"]
    assert list(by_group) == ["fc_in/rank1"]
    assert "fc_in/rank0 0 of" in zero[0]["message"]


# ------------------------------------------------------------------------------------------ formats
@pytest.mark.parametrize("name", ["clean", "clean_fp8"])
def test_offline_files_are_read_exactly_as_hs_connectors_reads_them(data, name) -> None:
    """bf16 through FileTransfer, FP8 through FP8Transfer (hs_connectors' own readers), bit for bit."""
    from hs_connectors import FileTransfer, FP8Transfer

    from tracediff.importers import read_speculators_file

    folder = data["speculators"][name]
    reader = FP8Transfer(folder) if name.endswith("fp8") else FileTransfer(folder)
    for i in range(len(data["target"].seqs)):
        theirs = reader.get_cached(i)
        ours = read_speculators_file(folder / f"hs_{i}.safetensors", i)
        assert ours.states.dtype == theirs["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(ours.states.view(torch.int16), theirs["hidden_states"].view(torch.int16))
        assert torch.equal(ours.tokens, theirs["token_ids"])


# ------------------------------------------------------------------------------------- the command
def test_the_command_writes_text_json_and_html_and_exits_1_on_findings(data, tmp_path) -> None:
    html, js = tmp_path / "lint.html", tmp_path / "lint.json"
    result = run_tracediff("lint", data["speculators"]["zero_slot"], "--layer-ids", AUX, "--json", js, "--html", html)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("tracediff lint: FINDINGS")
    assert json.loads(js.read_text())["exit_code"] == 1
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "slot 1 (hs4)" in page


def test_a_long_run_shows_its_progress_on_stderr(data) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tracediff", "lint", str(data["speculators"]["clean"]), "--progress"],
                          env=cli_env(TRACEDIFF_PROGRESS_SECONDS="0.001"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "of 8 files" in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", ["missing", "empty", "bad_target", "bad_layer_ids", "bank_of_another_width"])
def test_bad_input_is_one_line_and_exit_2(data, tmp_path, case) -> None:
    args: list[Any] = {
        "missing": [tmp_path / "nothing"],
        "empty": [tmp_path],
        "bad_target": [data["speculators"]["clean"], "--target", tmp_path],
        "bad_layer_ids": [data["speculators"]["clean"], "--layer-ids", "1,2"],
        "bank_of_another_width": [data["specforge"]["clean"], "--bank", data["bank_other"]],
    }[case]
    result = invoke_tracediff("lint", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
