"""`tracediff preflight`: what each engine will feed a draft, predicted from configs, checked against
the engines' own resolution code.

Every draft here is a real folder (config.json + a safetensors file written by
``tracediff.testing.eagle3.write_eagle3_draft``) and every target a real transformers config saved
with ``save_pretrained``. Where SGLang 0.5.23 (this venv) or vLLM 0.32 (its own venv, a subprocess)
is installed, the same folders go through the engine's own code (``tests/preflight_sglang.py``,
``tests/preflight_vllm_child.py``) and preflight must have predicted exactly what it resolved.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import invoke_tracediff
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, Qwen3Config

from tracediff.adapters.engine_rules import RULES, installed_version, parse_version
from tracediff.errors import UsageError
from tracediff.preflight import run_preflight
from tracediff.store.writer import create_store
from tracediff.testing.eagle3 import write_eagle3_draft

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# ------------------------------------------------------------------------------------------ models
def _llama(layers: int = 8) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _qwen3(layers: int = 12) -> Qwen3Config:
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def _deepseek_v3(layers: int = 61) -> DeepseekV3Config:
    """Kimi-K2 / DeepSeek-V3 shape: 61 layers, MLA (q/kv LoRA ranks), routed experts; tiny widths."""
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=32,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def _gpt_oss(layers: int = 8) -> GptOssConfig:
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


TARGETS = {"llama": _llama, "qwen3": _qwen3, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}


def _pair(root: Path, target: str, ids: list[int], where: str, **draft_kw: Any) -> tuple[Path, Path]:
    cfg = TARGETS[target]()
    tdir = root / f"target_{target}"
    if not (tdir / "config.json").is_file():
        cfg.save_pretrained(tdir)
    ddir = root / f"draft_{target}_{where}_{'_'.join(map(str, ids))}"
    write_eagle3_draft(ddir, cfg, ids, where=where, **draft_kw)
    return tdir, ddir


# Draft configs of item 3 of issue #49, and gpt-oss's own rule: (name, target, ids, where the ids are written).
CASES = [
    ("top_level_ids", "llama", [1, 3, 5], "top"),
    ("nested_ids", "llama", [1, 3, 5], "eagle_config"),
    ("missing_ids", "llama", [1, 3, 5], "none"),
    ("embedding_slot_sglang", "llama", [-1, 2, 4], "eagle_config"),
    ("embedding_slot_vllm", "llama", [0, 3, 5], "top"),
    ("unsorted_ids", "qwen3", [5, 1, 3], "both"),
    ("qwen3_nested", "qwen3", [1, 5, 9], "eagle_config"),
    ("qwen3_missing", "qwen3", [1, 5, 9], "none"),
    ("deepseek_nested", "deepseek_v3", [2, 30, 58], "eagle_config"),
    ("deepseek_top", "deepseek_v3", [2, 30, 58], "top"),
    ("deepseek_first_id_one", "deepseek_v3", [1, 29, 57], "eagle_config"),
    ("deepseek_missing", "deepseek_v3", [2, 30, 58], "none"),
    ("deepseek_unsorted", "deepseek_v3", [58, 2, 30], "both"),
    ("gpt_oss_last_layer", "gpt_oss", [1, 3, 8], "eagle_config"),
    ("gpt_oss_plus_one", "gpt_oss", [1, 3, 5], "eagle_config"),
]


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("preflight_cases")
    return {name: _pair(root, target, ids, where) for name, target, ids, where in CASES}


def _engine(pf: Any, name: str) -> Any:
    return next(v.resolution for v in pf.engines if v.resolution.framework == name)


# ------------------------------------------------------------------------------------------ engines' own code
@pytest.fixture(scope="module")
def sglang_resolved(case_dirs: dict[str, tuple[Path, Path]]) -> dict[str, dict[str, Any]]:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed in this venv: its own resolution cannot be run")
    version = installed_version("sglang")
    if parse_version(version) != (0, 5, 23):
        pytest.skip(f"sglang {version} installed; these checks drive 0.5.23's internal functions")
    sys.path.insert(0, str(TESTS))
    from preflight_sglang import sglang_resolution  # noqa: PLC0415

    return {name: sglang_resolution(t, d) for name, (t, d) in case_dirs.items()}


@pytest.fixture(scope="module")
def vllm_resolved(case_dirs: dict[str, tuple[Path, Path]]) -> dict[str, dict[str, Any]]:
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"vLLM is not installed ({python} missing): bash requirements/frameworks-vllm.sh installs it")
    names = list(case_dirs)
    pairs = [[str(case_dirs[n][0]), str(case_dirs[n][1])] for n in names]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(python), str(TESTS / "preflight_vllm_child.py"), json.dumps(pairs)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(TESTS))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return dict(zip(names, json.loads(lines[-1][len("RESULT "):]), strict=True))


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sglang_captures_what_preflight_predicted(name: str, case_dirs: dict, sglang_resolved: dict) -> None:
    engine = sglang_resolved[name]
    target, draft = case_dirs[name]
    res = _engine(run_preflight(draft, target, ("sglang",), versions={"sglang": "0.5.23"}), "sglang")
    assert res.ids == engine["ids"]  # the ids SGLang read (None: none, defaults used)
    assert res.capture == engine["layers_to_capture"]  # its capture indices, in its order
    # SGLang's layer loop passes layer i its input for i in 0..L-1, ascending: what is fed, in order;
    # gpt-oss's also captures end_layer = L (sglang/srt/models/gpt_oss.py GptOssModel.forward).
    loop = range(engine["num_layers"] + (engine["class"] == "GptOssForCausalLM"))
    assert res.physical == [i for i in loop if i in engine["layers_to_capture"]]
    assert res.missing == [c for c in engine["layers_to_capture"] if c not in loop]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_vllm_captures_what_preflight_predicted(name: str, case_dirs: dict, vllm_resolved: dict) -> None:
    engine = vllm_resolved[name]
    target, draft = case_dirs[name]
    res = _engine(run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"}), "vllm")
    assert res.ids == (engine["ids"] if engine["from_config"] else None)
    assert res.capture == engine["ids"]
    # vLLM's loop captures the input of layer idx for idx in 0..L-1, then end_layer = L, ascending.
    loop = range(engine["num_layers"] + 1)
    assert res.physical == [i for i in loop if i in engine["aux_hidden_state_layers"]]
    assert res.missing == [c for c in engine["aux_hidden_state_layers"] if c not in loop]


def test_a_fix_preflight_proposes_is_what_sglang_then_captures(tmp_path: Path, sglang_resolved: dict) -> None:
    """The issue's case on SGLang 0.5.23's own code: the proposed ids, written into the draft, make
    SGLang capture the trainer's layers."""
    from preflight_sglang import sglang_resolution  # noqa: PLC0415

    target, draft = _pair(tmp_path, "deepseek_v3", [2, 30, 58], "eagle_config")
    pf = run_preflight(draft, target, ("sglang",), trainer_layers=[0, 3, 31], versions={"sglang": "0.5.23"})
    fix = pf.engines[0].fix
    assert fix is not None and fix["ids"] is not None
    _, fixed = _pair(tmp_path, "deepseek_v3", fix["ids"], "eagle_config")
    assert sglang_resolution(target, fixed)["layers_to_capture"] == [0, 3, 31]
    assert run_preflight(fixed, target, ("sglang",), trainer_layers=[0, 3, 31],
                         versions={"sglang": "0.5.23"}).exit_code == 0


def test_a_gpt_oss_fix_reaching_the_last_layer_is_what_sglang_then_captures(tmp_path: Path,
                                                                              sglang_resolved: dict) -> None:
    """gpt-oss takes ids raw when the largest is L: the trainer's [2, 4, 8] (the last layer before the
    norm) is settable there, and SGLang's own code then captures it."""
    from preflight_sglang import sglang_resolution  # noqa: PLC0415

    target, draft = _pair(tmp_path, "gpt_oss", [1, 3, 5], "eagle_config")
    pf = run_preflight(draft, target, ("sglang",), trainer_layers=[2, 4, 8], versions={"sglang": "0.5.23"})
    fix = pf.engines[0].fix
    assert fix is not None and fix["ids"] == [2, 4, 8]
    _, fixed = _pair(tmp_path, "gpt_oss", fix["ids"], "eagle_config")
    assert sglang_resolution(target, fixed)["layers_to_capture"] == [2, 4, 8]


# ------------------------------------------------------------------------------------------ the case
def _trainer_store(path: Path, physical: list[int]) -> Path:
    create_store(path, role="trainer", meta={"aux_layers": {"ids": physical, "convention": "hf",
                                                             "framework": "speculators"}})
    return path


def test_kimi_deepseek_case_sglang_before_pr_25454_feeds_l3_l31_l59_and_the_fix_is_minus1_2_30(tmp_path: Path) -> None:
    """Issue #49's case: 61-layer DeepSeek-V3 target, draft config [2, 30, 58], a trainer that fed
    cat(emb, L3, L31). An SGLang that adds 1 on the DeepSeek path (before PR #25454) feeds
    cat(L3, L31, L59); the fix is [-1, 2, 30] in SGLang's own field."""
    target, draft = _pair(tmp_path, "deepseek_v3", [2, 30, 58], "eagle_config")
    store = _trainer_store(tmp_path / "train.zarr", [0, 3, 31])
    pf = run_preflight(draft, target, ("sglang",), trainer=str(store), versions={"sglang": "0.5.5"})
    view = pf.engines[0]
    assert view.resolution.rule == "sglang.deepseek_plus_one"
    assert view.resolution.physical == [3, 31, 59]
    assert view.verdict == "different"
    assert view.fix == {"field": "eagle_config.eagle_aux_hidden_state_layer_ids (nested in the draft's config.json)",
                        "ids": [-1, 2, 30], "problems": []}
    assert pf.exit_code == 1
    assert any("older than 0.5.23" in c.message for c in pf.checks if c.kind == "version")


def test_kimi_deepseek_case_on_sglang_0_5_23_takes_ids_raw(tmp_path: Path) -> None:
    """The same case on SGLang 0.5.23 (PR #25454: raw unless the first id is 1): it feeds
    cat(L2, L30, L58), and the fix is [0, 3, 31]."""
    target, draft = _pair(tmp_path, "deepseek_v3", [2, 30, 58], "eagle_config")
    pf = run_preflight(draft, target, ("sglang",), trainer_layers=[0, 3, 31], versions={"sglang": "0.5.23"})
    view = pf.engines[0]
    assert view.resolution.rule == "sglang.deepseek_first_id_one"
    assert view.resolution.physical == [2, 30, 58]
    assert view.fix is not None and view.fix["ids"] == [0, 3, 31]


def test_cli_prints_the_case_and_its_fix_and_exits_1(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "deepseek_v3", [2, 30, 58], "eagle_config")
    store = _trainer_store(tmp_path / "train.zarr", [0, 3, 31])
    out = tmp_path / "pf.json"
    r = invoke_tracediff("preflight", str(draft), "--target", str(target), "--engine", "sglang",
                         "--trainer", str(store), "--engine-version", "sglang=0.5.5", "--json", str(out))
    assert r.returncode == 1, r.stderr
    assert "feeds cat(L3, L31, L59)" in r.stdout
    assert "= [-1, 2, 30]" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "different" and doc["exit_code"] == 1
    assert doc["engines"][0]["fix"]["ids"] == [-1, 2, 30]
    assert doc["trainer"]["physical"] == [0, 3, 31]


# ------------------------------------------------------------------------------------------ defaults
def test_a_draft_without_ids_names_each_engines_default_layers(tmp_path: Path) -> None:
    """The Llama-3.3-70B shape of vllm #50170: 80 layers, no ids -> both engines capture (2, 40, 77)."""
    target, draft = _pair(tmp_path, "llama", [1, 2, 3], "none")
    cfg = _llama(80)
    cfg.save_pretrained(target)
    pf = run_preflight(draft, target, ("sglang", "vllm"), versions={"sglang": "0.5.23", "vllm": "0.32.0"})
    for view in pf.engines:
        assert view.resolution.ids is None and view.resolution.ids_from == "default"
        assert view.resolution.physical == [2, 40, 77]
    defaults = [c for c in pf.checks if c.kind == "default_layers"]
    assert {c.evidence["engine"] for c in defaults} == {"sglang", "vllm"}
    assert all("[2, 40, 77]" in c.message for c in defaults)


def test_specforge_trainer_default_matches_sglangs_default_on_llama(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 2, 3], "none")
    pf = run_preflight(draft, target, ("sglang",), trainer="specforge",
                       versions={"sglang": "0.5.23", "specforge": "0.2.0"})
    assert pf.trainer.physical == [2, 4, 5]  # SpecForge [1, L//2-1, L-4] + SGLang's +1, L = 8
    assert pf.engines[0].verdict == "same" and pf.exit_code == 0


def test_top_level_ids_are_ignored_by_sglang_and_said_so(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "top")
    pf = run_preflight(draft, target, ("sglang", "vllm"), trainer="speculators",
                       versions={"sglang": "0.5.23", "vllm": "0.32.0", "speculators": "0.9.0"})
    sg, vl = pf.engines
    assert sg.resolution.ignored == {"eagle_aux_hidden_state_layer_ids (top level)": [1, 3, 5]}
    assert sg.verdict == "different" and vl.verdict == "same"
    assert sg.fix is not None and sg.fix["ids"] == [0, 2, 4]  # output of layer k: physical - 1
    assert any(c.kind == "ignored_ids" and c.severity == "error" for c in pf.checks)


def test_same_layers_everywhere_exits_0(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both")
    # vLLM reads the top level (input of layer k), SGLang the nested ids (output of layer k): write each
    # engine's numbering of HF hidden_states [2, 4, 6].
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    (draft / "config.json").write_text(json.dumps(cfg))
    r = invoke_tracediff("preflight", str(draft), "--target", str(target), "--trainer-layers", "2,4,6",
                         "--engine-version", "sglang=0.5.23", "--engine-version", "vllm=0.32.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("verdict: same (exit 0)")


# ------------------------------------------------------------------------------------------ weights and vocab
def test_fc_width_that_is_not_target_hidden_times_k_is_a_difference(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3]  # fc.weight was written for 3 slots
    (draft / "config.json").write_text(json.dumps(cfg))
    pf = run_preflight(draft, target, ("sglang",), versions={"sglang": "0.5.23"})
    shape = [c for c in pf.checks if c.kind == "fc_shape"]
    assert shape and shape[0].severity == "error" and shape[0].evidence["fc_shape"] == [64, 192]


def test_d2t_of_absolute_ids_is_a_difference_and_offsets_are_not(tmp_path: Path) -> None:
    from tracediff.testing.eagle3 import with_absolute_d2t  # noqa: PLC0415

    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both", draft_vocab_size=64)
    pf = run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"})
    assert pf.draft.d2t["kind"] == "offsets"
    assert not [c for c in pf.checks if c.kind == "d2t"]
    absolute = with_absolute_d2t(draft, tmp_path / "absolute")
    pf = run_preflight(absolute, target, ("vllm",), versions={"vllm": "0.32.0"})
    assert pf.draft.d2t["kind"] != "offsets"
    assert [c for c in pf.checks if c.kind == "d2t" and c.severity == "error"]


def test_a_small_draft_vocabulary_without_d2t_is_a_difference(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both", draft_vocab_size=64)
    weights = {k: v for k, v in load_file(draft / "model.safetensors").items() if k not in ("d2t", "t2d")}
    save_file(weights, str(draft / "model.safetensors"))
    pf = run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"})
    assert [c for c in pf.checks if c.kind == "vocab" and c.severity == "error"]


def test_ids_past_the_targets_depth_leave_a_slot_unfilled(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 12], "eagle_config")  # an 8-layer target
    pf = run_preflight(draft, target, ("sglang", "vllm"), versions={"sglang": "0.5.23", "vllm": "0.32.0"})
    sg, vl = (v.resolution for v in pf.engines)
    assert sg.missing == [13] and vl.missing == [12]
    assert pf.exit_code == 1


def test_vllm_deepseek_fails_on_the_embedding_id(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "deepseek_v3", [0, 30, 58], "top")
    pf = run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"})
    assert pf.engines[0].resolution.error and "id 0" in pf.engines[0].resolution.error
    assert pf.exit_code == 1


# ------------------------------------------------------------------------------------------ versions
def test_an_unknown_engine_version_is_a_warning_naming_the_rule_assumed(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both")
    pf = run_preflight(draft, target, ("vllm",))
    res = pf.engines[0].resolution
    if res.version_from == "installed":
        pytest.skip("vLLM is installed in this venv: its version is known")
    assert res.version is None
    assert any(c.kind == "version" and "version unknown" in c.message for c in pf.checks)


def test_the_installed_engine_version_is_named(tmp_path: Path) -> None:
    version = installed_version("sglang")
    if version is None:
        pytest.skip("SGLang is not installed in this venv")
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both")
    res = run_preflight(draft, target, ("sglang",)).engines[0].resolution
    assert (res.version, res.version_from) == (version, "installed")


def test_every_rule_names_its_versions_and_source_file() -> None:
    for rule in RULES:
        assert rule.versions and rule.read_from
        assert ".py" in rule.source, rule.name


# ------------------------------------------------------------------------------------------ CLI and errors
def test_help_states_the_exit_codes() -> None:
    r = invoke_tracediff("preflight", "--help")
    assert r.returncode == 0
    for code in ("0 ", "1 ", "2 ", "130", "143"):
        assert f"  {code}" in r.stdout
    assert "Exit codes:" in r.stdout


@pytest.mark.parametrize("breakage, field", [
    ("missing", "config.json not found"),
    ("not_json", "not valid JSON"),
    ("ids_not_ints", "field eagle_config.eagle_aux_hidden_state_layer_ids"),
    ("bad_safetensors", "header"),
])
def test_bad_draft_input_is_one_error_line_and_exit_2(tmp_path: Path, breakage: str, field: str) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "eagle_config")
    if breakage == "missing":
        (draft / "config.json").unlink()
    elif breakage == "not_json":
        (draft / "config.json").write_text("{not json")
    elif breakage == "ids_not_ints":
        cfg = json.loads((draft / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ["2", "4"]
        (draft / "config.json").write_text(json.dumps(cfg))
    else:
        (draft / "model.safetensors").write_bytes(b"\xff" * 4)
    r = invoke_tracediff("preflight", str(draft), "--target", str(target))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tracediff: error: {draft}"), r.stderr
    assert field in lines[0]


def test_a_target_without_a_layer_count_is_bad_input(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "eagle_config")
    cfg = json.loads((target / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="field num_hidden_layers"):
        run_preflight(draft, target)


def test_a_trainer_that_is_no_store_is_bad_input(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "eagle_config")
    r = invoke_tracediff("preflight", str(draft), "--target", str(target), "--trainer", str(tmp_path / "nope"))
    assert r.returncode == 2 and "--trainer" in r.stderr


# ------------------------------------------------------------------------------------------ trainers' own drafts
@pytest.fixture(scope="module")
def trainer_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """A draft saved by speculators' own Eagle3DraftModel and one by SpecForge's LlamaForCausalLMEagle3
    (tests/trainer_runs.py builds them as the trainer tests do), with a 6-layer Llama target."""
    missing = [m for m in ("speculators", "specforge") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: cannot build the trainers' own drafts")
    sys.path.insert(0, str(TESTS))
    from trainer_runs import HIDDEN, VOCAB, build_specforge, build_speculators_draft  # noqa: PLC0415

    root = tmp_path_factory.mktemp("trainer_drafts")
    target = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)
    target.architectures = ["LlamaForCausalLM"]
    target.save_pretrained(root / "target")
    build_speculators_draft().save_pretrained(root / "speculators")
    _, _, draft = build_specforge(root)
    draft.save_pretrained(root / "specforge")
    return {name: (root / "target", root / name) for name in ("speculators", "specforge")}


def test_a_speculators_draft_is_read_as_vllm_reads_it_and_sglang_cannot_load_it(trainer_drafts: dict) -> None:
    target, draft = trainer_drafts["speculators"]
    pf = run_preflight(draft, target, versions={"sglang": "0.5.23", "vllm": "0.32.0", "speculators": "0.9.0"})
    assert pf.trainer.source == "speculators"  # detected from the config's format
    assert pf.trainer.physical == [1, 2, 3]
    sg, vl = pf.engines
    assert vl.resolution.ids == [1, 2, 3] and vl.verdict == "same"
    assert sg.resolution.error and "model_type" in sg.resolution.error
    assert pf.draft.hidden_size == 32 and pf.draft.fc_shape == [32, 96]
    if importlib.util.find_spec("sglang") is not None:
        from preflight_sglang import sglang_resolution  # noqa: PLC0415

        with pytest.raises(ValueError, match="model_type"):
            sglang_resolution(target, draft)


def test_a_specforge_draft_is_what_sglang_feeds_and_vllm_reads_otherwise(trainer_drafts: dict) -> None:
    target, draft = trainer_drafts["specforge"]
    pf = run_preflight(draft, target, trainer="specforge",
                       versions={"sglang": "0.5.23", "vllm": "0.32.0", "specforge": "0.2.0"})
    assert pf.trainer.physical == [1, 2, 3]  # SpecForge [0, 1, 2] through SGLang's +1
    sg, vl = pf.engines
    assert sg.verdict == "same"
    assert vl.resolution.physical == [0, 1, 2] and vl.verdict == "different"
    assert vl.fix is not None and vl.fix["ids"] == [1, 2, 3]
    assert pf.draft.d2t["kind"] == "offsets"


@pytest.mark.slow  # vLLM's and SGLang's imports: ~25 s
def test_the_trainers_drafts_resolve_in_the_engines_as_predicted(trainer_drafts: dict) -> None:
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"vLLM is not installed ({python} missing)")
    names = list(trainer_drafts)
    pairs = [[str(trainer_drafts[n][0]), str(trainer_drafts[n][1])] for n in names]
    proc = subprocess.run([str(python), str(TESTS / "preflight_vllm_child.py"), json.dumps(pairs)],
                          capture_output=True, text=True, timeout=600, cwd=str(TESTS),
                          env={"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                               "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    for name, engine in zip(names, json.loads(lines[-1][len("RESULT "):]), strict=True):
        target, draft = trainer_drafts[name]
        res = _engine(run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"}), "vllm")
        assert res.capture == engine["ids"] and res.physical == engine["aux_hidden_state_layers"], name
    if importlib.util.find_spec("sglang") is not None:
        from preflight_sglang import sglang_resolution  # noqa: PLC0415

        target, draft = trainer_drafts["specforge"]
        res = _engine(run_preflight(draft, target, ("sglang",), versions={"sglang": "0.5.23"}), "sglang")
        assert res.capture == sglang_resolution(target, draft)["layers_to_capture"]


# ------------------------------------------------------------------------------------------ record
def test_a_recording_stores_the_prediction_and_whether_the_engine_agreed(case_dirs: dict, sglang_resolved: dict,
                                                                          vllm_resolved: dict) -> None:
    """What the serving adapters store as ``meta.<engine>.preflight``: the same resolution, and
    ``agrees`` against the capture indices the engine resolved (here: the engines' own code)."""
    from tracediff.preflight import resolution_for_record  # noqa: PLC0415

    target, draft = case_dirs["deepseek_nested"]
    sg = resolution_for_record("sglang", draft, target, "0.5.23", sglang_resolved["deepseek_nested"]["layers_to_capture"])
    assert sg is not None and sg["agrees"] and sg["physical"] == [2, 30, 58] and sg["rule"] == "sglang.deepseek_first_id_one"
    vl = resolution_for_record("vllm", draft, target, "0.32.0", vllm_resolved["deepseek_nested"]["aux_hidden_state_layers"])
    assert vl is not None and vl["agrees"] and vl["ids_from"] == "eagle_config.eagle_aux_hidden_state_layer_ids"
    old = resolution_for_record("sglang", draft, target, "0.5.23", [3, 31, 59])  # an engine that added 1
    assert old is not None and old["agrees"] is False
    assert any("engine_rules.py" in e for e in old["errors"])


def test_a_recording_from_hub_ids_stores_no_prediction(case_dirs: dict) -> None:
    from tracediff.preflight import resolution_for_record  # noqa: PLC0415

    target, _ = case_dirs["nested_ids"]
    assert resolution_for_record("vllm", "org/some-draft", target, "0.32.0", [1, 3, 5]) is None
    assert resolution_for_record("vllm", None, None, "unknown") is None


@pytest.mark.slow  # a real vLLM engine in process: ~30 s
def test_a_real_vllm_recording_stores_the_prediction_and_it_agrees(tmp_path: Path) -> None:
    """tests/vllm_children.py's in-process recording (a tiny Llama target, a draft with top-level ids
    [2, 4, 5]): the store's ``meta.vllm.preflight`` is preflight's prediction, and it agrees with the
    layers vLLM resolved."""
    sys.path.insert(0, str(TESTS))
    import vllm_harness as h  # noqa: PLC0415

    python = h.vllm_python()
    tl = h.build_target(tmp_path)
    draft = h.build_draft(tmp_path, "draft", tl, [2, 4, 5], "top")
    store = tmp_path / "server.zarr"
    run = subprocess.run([str(python), str(TESTS / "vllm_children.py"), "inprocess", str(store),
                          str(tmp_path / "target"), str(draft), "none"],
                         capture_output=True, text=True, timeout=600, env=h.vllm_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metas = [json.loads(p.read_text())["attributes"]["meta"] for p in (store / "fc_in").glob("*/zarr.json")]
    assert metas
    for meta in metas:
        predicted = meta["vllm"]["preflight"]
        assert predicted["agrees"] is True and predicted["errors"] == []
        assert predicted["physical"] == meta["vllm"]["aux_hidden_state_layers"] == [2, 4, 5]


# ------------------------------------------------------------------------------------------ compare's Fix box
def _aux(physical: list[int], ids: list[int], convention: str, framework: str) -> Any:
    from tracediff.adapters.conventions import AuxLayers  # noqa: PLC0415

    return AuxLayers(ids, "aux_layers", convention, physical, framework=framework)


def test_compares_fix_uses_the_rule_the_recording_stored_for_a_deepseek_target() -> None:
    """Issue #49's case in compare: the reference fed [0, 3, 31]; an SGLang candidate on a DeepSeek
    target recorded rule sglang.deepseek_first_id_one: the Fix box says [0, 3, 31] (0.5.23 reads ids
    raw), as preflight does, not the Llama numbering's [-1, 2, 30]."""
    from tracediff.adapters.engine_rules import recorded_rule  # noqa: PLC0415
    from tracediff.compare.findings.remedy import propose_fix  # noqa: PLC0415

    ref = _aux([0, 3, 31], [0, 3, 31], "hf", "speculators")
    cand = _aux([2, 30, 58], [2, 30, 58], "sglang_deepseek", "sglang")
    meta = {"store": {}, "writer": {"sglang": {"preflight": {"rule": "sglang.deepseek_first_id_one"}}}, "tap": {}}
    rule = recorded_rule(meta, "sglang")
    assert rule is not None and rule.name == "sglang.deepseek_first_id_one"
    fix = propose_fix([], 3, ref, cand, "sglang", num_layers=61, engine_rule=rule)
    assert fix.value == [0, 3, 31] and fix.config_can_fix and fix.convention == "sglang_deepseek"
    older = recorded_rule({"writer": {"sglang": {"preflight": {"rule": "sglang.deepseek_plus_one"}}}}, "sglang")
    assert propose_fix([], 3, ref, cand, "sglang", num_layers=61, engine_rule=older).value == [-1, 2, 30]
    # A recording without the block: the engine's generic numbering, as before.
    assert recorded_rule({"writer": {"sglang": {}}}, "sglang") is None
    assert propose_fix([], 3, ref, cand, "sglang", num_layers=61).value == [-1, 2, 30]


def test_compares_fix_says_when_sglangs_deepseek_path_cannot_take_the_layers() -> None:
    """Layers starting at layer 1's input: raw ids would start with 1, which SGLang's DeepSeek path
    reads +1: no config value; the Fix box says so instead of proposing [1, ...]."""
    from tracediff.adapters.engine_rules import rule_named  # noqa: PLC0415
    from tracediff.compare.findings.remedy import propose_fix  # noqa: PLC0415

    ref = _aux([1, 30, 58], [1, 30, 58], "hf", "speculators")
    cand = _aux([2, 30, 58], [2, 30, 58], "sglang_deepseek", "sglang")
    fix = propose_fix([], 3, ref, cand, "sglang", num_layers=61, engine_rule=rule_named("sglang.deepseek_first_id_one"))
    assert fix.value is None and not fix.config_can_fix
    assert any("adds 1" in r for r in fix.reasons)


# ------------------------------------------------------------------------------------------ property
_ENGINE_RULES = [r.name for r in RULES if r.framework in ("sglang", "vllm")]


@given(rule_name=st.sampled_from(_ENGINE_RULES), depth=st.integers(6, 96), data=st.data())
@settings(max_examples=300, deadline=None)
def test_a_proposed_fix_resolves_to_the_wanted_layers(rule_name: str, depth: int, data: st.DataObject) -> None:
    """Whatever the layers and the rule: ids preflight proposes, written where that engine reads them,
    resolve to exactly those layers, or preflight says why no ids can."""
    from tracediff.adapters.engine_rules import RuleChoice, config_field, fix_ids, resolve, rule_named  # noqa: PLC0415

    rule = rule_named(rule_name)
    assert rule is not None
    wanted = sorted(data.draw(st.sets(st.integers(0, depth), min_size=1, max_size=4)))
    ids, problems = fix_ids(rule, list(wanted), depth)
    if ids is None:
        assert problems
        return
    draft: dict[str, Any] = {"model_type": "llama"}
    if config_field(rule).startswith("eagle_aux"):
        draft["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        draft["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    res = resolve(RuleChoice(rule, rule.read_from, "given"), draft, depth)
    assert res.physical == wanted and res.missing == [] and res.error is None, (ids, res)


def test_a_layer_listed_twice_is_a_difference(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, "llama", [3, 3, 5], "both")
    pf = run_preflight(draft, target, ("sglang", "vllm"), versions={"sglang": "0.5.23", "vllm": "0.32.0"})
    for view in pf.engines:
        assert view.resolution.error and "twice" in view.resolution.error
        assert view.resolution.physical == ([4, 6] if view.resolution.framework == "sglang" else [3, 5])
    assert pf.exit_code == 1


def test_the_sglang_adapter_labels_a_deepseek_targets_slots_by_the_same_rule(case_dirs: dict) -> None:
    """The SGLang adapter labels the fc slots (hs<i>) before the target has captured anything: from the
    rule preflight applies, so a DeepSeek target on 0.5.23 gets hs2/hs30/hs58, a Llama target +1."""
    from tracediff.adapters.sglang_provenance import fed_layers  # noqa: PLC0415

    ds_target, _ = case_dirs["deepseek_nested"]
    llama_target, _ = case_dirs["nested_ids"]
    assert fed_layers([2, 30, 58], ds_target, "0.5.23") == [2, 30, 58]
    assert fed_layers([1, 29, 57], ds_target, "0.5.23") == [2, 30, 58]
    assert fed_layers([2, 30, 58], ds_target, "0.5.5") == [3, 31, 59]
    assert fed_layers([1, 3, 5], llama_target, "0.5.23") == [2, 4, 6]
    assert fed_layers([5, 1, 3], "org/hub-model", "0.5.23") == [2, 4, 6]  # no local config: the Llama rule


def test_without_a_target_a_draft_without_ids_cannot_be_told_and_exits_1(tmp_path: Path) -> None:
    _, draft = _pair(tmp_path, "llama", [1, 2, 3], "none")
    r = invoke_tracediff("preflight", str(draft), "--engine-version", "sglang=0.5.23", "--engine-version",
                         "vllm=0.32.0")
    assert r.returncode == 1
    assert "verdict: unknown (exit 1)" in r.stdout and "give --target" in r.stdout
    assert "no --target" in r.stdout  # the family assumed is said


def test_the_pre_25454_fix_on_sglang_0_5_23_leaves_the_embedding_slot_unfilled(tmp_path: Path,
                                                                                  sglang_resolved: dict) -> None:
    """[-1, 2, 30], the fix for an SGLang that adds 1, written for SGLang 0.5.23's DeepSeek path: it
    takes the ids raw, -1 matches no layer, and the slot is never written; preflight says so, as
    SGLang's own code shows."""
    from preflight_sglang import sglang_resolution  # noqa: PLC0415

    target, draft = _pair(tmp_path, "deepseek_v3", [-1, 2, 30], "eagle_config")
    assert sglang_resolution(target, draft)["layers_to_capture"] == [-1, 2, 30]
    pf = run_preflight(draft, target, ("sglang",), trainer_layers=[0, 3, 31], versions={"sglang": "0.5.23"})
    res = pf.engines[0].resolution
    assert res.missing == [-1] and res.physical == [2, 30]
    assert pf.engines[0].fix is not None and pf.engines[0].fix["ids"] == [0, 3, 31]
    assert any(c.kind == "missing_slot" for c in pf.checks)


def test_a_draft_that_turns_aux_states_off_is_a_difference_on_sglang(tmp_path: Path, sglang_resolved: dict) -> None:
    from preflight_sglang import sglang_resolution  # noqa: PLC0415

    cfg = _llama()
    target = tmp_path / "target"
    cfg.save_pretrained(target)
    draft = write_eagle3_draft(tmp_path / "draft", cfg, [1, 3, 5], where="eagle_config", extra_config={
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": False}}).path
    assert sglang_resolution(target, draft)["use_aux_hidden_state"] is False
    pf = run_preflight(draft, target, ("sglang",), versions={"sglang": "0.5.23"})
    assert "use_aux_hidden_state is false" in (pf.engines[0].resolution.error or "")
    assert pf.exit_code == 1


def test_a_draft_with_only_a_pickle_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` is a pickle: preflight reads no such file (here one that would fail to
    unpickle) and says the fc width cannot be checked."""
    target, draft = _pair(tmp_path, "llama", [1, 3, 5], "both")
    (draft / "model.safetensors").unlink()
    (draft / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle anyone should load")
    pf = run_preflight(draft, target, ("vllm",), versions={"vllm": "0.32.0"})
    assert pf.draft.fc_shape is None and pf.draft.files == []
    assert [c for c in pf.checks if c.kind == "fc_shape" and c.severity == "warning"]
