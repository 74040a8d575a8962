"""The JSON Schemas of tracediff's reports: shipped in the package, valid draft 2020-12, true of every
report the commands write, and strict enough that a broken report fails.

The reports are real: compare and identify on the shipped samples (the seed bug with a bank, its
fix, the broken server's layers against the hf bank and against the trainer's own store), and a
replay of a draft on two stores recorded here from a tiny Llama. conftest.py validates every report
any test writes the same way (strictly, at teardown); the last tests prove that hook fires.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_tracediff, schema_problems, strict_json_problems, strict_schema

from tracediff.compare.results import FINDING_KINDS, SEVERITIES
from tracediff.demo import default_samples_dir
from tracediff.schemas import SCHEMAS, load_schema

SAMPLES = default_samples_dir()
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"

#: Objects whose every field this version writes is named in the schema (checked on the real reports
#: below with unevaluatedProperties: false; the shipped schema leaves objects open for additions).
CLOSED = {
    "compare": ("", "side", "aux_layers", "plan", "token_pairing", "segment_match", "transform_fit", "segment_metrics",
                "worst_row", "row_ref", "finding", "fix", "replay", "replay_score", "draft_checkpoint", "d2t",
                "provenance", "evidence_segment_order", "evidence_segment_missing", "evidence_segment_extra",
                "evidence_config", "evidence_coverage", "evidence_replay", "evidence_draft_vocabulary",
                "evidence_value", "evidence_token_pairing", "cause", "fix_box", "record_next", "box_step",
                "config_change"),
    "identify": ("", "layer_name", "segment_identity"),
}


def closed_schema(name: str) -> dict[str, Any]:
    """The strict schema with the objects of :data:`CLOSED` closed to the fields it names."""
    schema = strict_schema(name)
    for key in CLOSED[name]:
        (schema["$defs"][key] if key else schema)["unevaluatedProperties"] = False
    return schema


def problems(document: Any, name: str, schema: dict[str, Any] | None = None) -> list[str]:
    if schema is None:
        return schema_problems(document, name)
    from jsonschema import Draft202012Validator  # noqa: PLC0415

    return [f"at {e.json_path}: {e.message[:200]}" for e in Draft202012Validator(schema).iter_errors(document)]


# ------------------------------------------------------------------------------------- the files
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_schema_is_package_data_and_valid_draft_2020_12(name: str) -> None:
    from importlib import resources  # noqa: PLC0415

    from jsonschema import Draft202012Validator  # noqa: PLC0415

    schema = load_schema(name)
    assert schema["$schema"] == DRAFT_2020_12
    Draft202012Validator.check_schema(schema)
    shipped = resources.files("tracediff.schemas").joinpath(SCHEMAS[name])
    assert shipped.is_file() and json.loads(shipped.read_text()) == schema
    assert (REPO / "tracediff" / "schemas" / SCHEMAS[name]).is_file()


def test_an_unknown_schema_name_says_which_exist() -> None:
    with pytest.raises(ValueError, match="known: compare, identify"):
        load_schema("report")


def test_a_non_editable_install_ships_the_schemas(tmp_path: Path) -> None:
    """pip installs the package data: load_schema works from an installed copy, not only the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    for folder in ("tracediff", "hooks"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(src)], capture_output=True, text=True,
                             timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import tracediff.schemas as s; "
              "assert s.__file__.startswith(sys.argv[1]), s.__file__; "
              "print(sorted((n, load['$schema']) for n in s.SCHEMAS for load in [s.load_schema(n)]))")
    run = subprocess.run([sys.executable, "-c", script, str(site)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(sorted((n, DRAFT_2020_12) for n in SCHEMAS))


def test_the_vocabularies_cover_the_code() -> None:
    from tracediff.compare.plan.transforms import KINDS, SLOT_KINDS  # noqa: PLC0415

    defs = load_schema("compare")["$defs"]

    def known(key: str) -> set[str]:
        return set(defs[key]["anyOf"][0]["enum"])

    assert set(FINDING_KINDS) <= known("finding_kind")
    assert set(KINDS) | set(SLOT_KINDS) == known("transform_kind")
    assert set(defs["finding"]["properties"]["severity"]["enum"]) == set(SEVERITIES)
    assert load_schema("compare")["properties"]["schema_version"] == {"const": 1}
    documented = {r["if"]["properties"]["kind"]["const"] for r in defs["finding_evidence"]["allOf"]
                  if "const" in r["if"]["properties"]["kind"]}
    assert documented <= known("finding_kind")


# ------------------------------------------------------------------------------ real reports
@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> (schema, JSON document) of the reports the commands write on the samples."""
    root = tmp_path_factory.mktemp("schema_reports")
    runs = {
        "compare_broken_with_bank": ("compare", ["compare", SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr",
                                                 "--bank", SAMPLES / "bank.zarr"], 1),
        "compare_fixed": ("compare", ["compare", SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr"], 0),
        # one recording on both sides: a match that cannot say anything, so it says what to record next
        "compare_same_recording": ("compare", ["compare", SAMPLES / "train.zarr", SAMPLES / "train.zarr"], 0),
        "identify_hf_bank": ("identify", ["identify", SAMPLES / "server_broken.zarr", "--bank",
                                          SAMPLES / "bank.zarr"], 0),
        "identify_trainer_bank": ("identify", ["identify", SAMPLES / "server_broken.zarr", "--bank",
                                               SAMPLES / "train.zarr"], 1),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (schema, args, code) in runs.items():
        path = root / f"{name}.json"
        result = run_tracediff(*args, "--json", path)
        assert result.returncode == code, result.stdout + result.stderr
        out[name] = {"schema": schema, "document": json.loads(path.read_text()), "text": path.read_text()}
    return out


@pytest.fixture(scope="module")
def replay_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tracediff replay of a (random) draft on a trainer store and a server store fed the wrong layers
    with the same request ids, the server having loaded a copy whose d2t holds absolute ids."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415
    from tracediff.testing.eagle3 import with_absolute_d2t, write_eagle3_draft  # noqa: PLC0415
    from tracediff.testing.pipelines import run_trainer  # noqa: PLC0415
    from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences  # noqa: PLC0415

    root = tmp_path_factory.mktemp("schema_replay")
    h, vocab = 32, 128
    tl = build_tiny_llama(hidden_size=h, num_layers=4, vocab_size=vocab, seed=0)
    seqs = make_sequences(n_seqs=3, min_len=8, max_len=16, vocab_size=vocab, seed=1)
    for name, layers in (("train", ["hs0", "hs2", "hs3"]), ("server", ["hs2", "hs3", "hs4"])):
        ids = [int(x[2:]) for x in layers]
        with tracediff.record(root / f"{name}.zarr", role=name, handle_sigterm=False,
                              meta={"aux_layers": {"ids": ids, "convention": "capture"}}) as rec:
            head = DraftHead(h, len(layers))
            rec.tap(head.fc, "fc_in", segment_size=h, segment_labels=layers)
            run_trainer(tl, head, seqs, layers, dtype=torch.float32, on_batch=lambda labels, r=rec: r.labels(**labels))
    draft = write_eagle3_draft(root / "draft", tl.model.config, [0, 2, 3], draft_vocab_size=96,
                               own_embedding=True).path
    served = with_absolute_d2t(draft, root / "draft_abs")
    path = root / "replay.json"
    result = run_tracediff("replay", root / "train.zarr", root / "server.zarr", "--draft", draft, "--server-draft",
                           served, "--steps", "2", "--json", path)
    assert result.returncode == 1, result.stdout + result.stderr
    return {"schema": "compare", "document": json.loads(path.read_text()), "text": path.read_text()}


def _all(reports: dict[str, dict[str, Any]], replay_report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {**reports, "replay": replay_report}


@pytest.mark.parametrize("strictness", ["shipped", "strict", "closed"])
def test_the_reports_of_the_samples_and_a_replay_follow_their_schemas(reports, replay_report, strictness) -> None:
    for name, report in _all(reports, replay_report).items():
        schema = {"shipped": load_schema(report["schema"]), "strict": strict_schema(report["schema"]),
                  "closed": closed_schema(report["schema"])}[strictness]
        assert problems(report["document"], report["schema"], schema) == [], name
        assert strict_json_problems(report["text"]) == [], name


def test_the_reports_exercise_the_payloads_that_matter(reports, replay_report) -> None:
    """The validation above means something only if these reports carry the kinds it describes."""
    broken = reports["compare_broken_with_bank"]["document"]
    kinds = {f["kind"] for f in broken["findings"]}
    assert {"segment_order", "segment_missing", "segment_extra", "config"} <= kinds
    assert any("fix" in f["evidence"] for f in broken["findings"])
    assert broken["verdict"] == "mismatch" and reports["compare_fixed"]["document"]["verdict"] == "match"
    # The grouping by cause, the Fix box and the what-to-record-next box are there to validate.
    assert [c["kind"] for c in broken["causes"]] == ["segment_order"]
    assert broken["fix"]["config_can_fix"] and broken["fix"]["steps"][-1]["commands"]
    assert any("changes" in f["evidence"] for f in broken["findings"] if f["kind"] == "config")
    assert reports["compare_fixed"]["document"]["fix"] is None
    assert reports["compare_same_recording"]["document"]["record_next"]["steps"]
    replay = replay_report["document"]
    assert replay["replay"]["b_server"] is not None and replay["replay"]["provenance"]
    assert {"replay", "draft_vocabulary"} <= {f["kind"] for f in replay["findings"]}
    verdicts = [s["verdict"] for s in reports["identify_hf_bank"]["document"]["segments"]]
    assert verdicts == ["match"] * 3
    assert "none" in [s["verdict"] for s in reports["identify_trainer_bank"]["document"]["segments"]]


# ------------------------------------------------------------------------------ broken reports
def _broken(document: dict[str, Any], edit: Any) -> dict[str, Any]:
    doc = copy.deepcopy(document)
    edit(doc)
    return doc


def _finding(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(f for f in doc["findings"] if f["kind"] == kind)


BROKEN_COMPARE = {
    "no verdict": (lambda d: d.pop("verdict"), "'verdict' is a required property"),
    "another schema version": (lambda d: d.update(schema_version=2), "1 was expected"),
    "match with errors": (lambda d: d.update(verdict="match"), "0 was expected"),
    "a severity the schema does not know": (lambda d: d["findings"][0].update(severity="fatal"), "'fatal' is not one of"),
    "a finding kind that is no name": (lambda d: d["findings"][0].update(kind="Segment order!"), "Segment order!"),
    "segment_order pairs as bare lists": (
        lambda d: _finding(d, "segment_order")["evidence"].update(pairs=[[0, 1], [1, 2]]), "is not of type 'object'"),
    "segment_missing without its segment": (
        lambda d: _finding(d, "segment_missing")["evidence"].pop("reference_segment"), "'reference_segment' is a required"),
    "a config finding without differences": (
        lambda d: _finding(d, "config")["evidence"].pop("differences"), "'differences' is a required property"),
    "a cosine written as a string": (lambda d: d["metrics"][0].update(cos_mean="nan"), "'nan' is not of type"),
    "a negative pair count": (lambda d: d["plan"].update(pairs=-1), "-1 is less than the minimum"),
    "an extra segment with a counterpart": (
        lambda d: next(m for m in d["segment_map"] if m["status"] == "extra").update(reference=0), "is not of type 'null'"),
    "a side without its rows": (lambda d: d["candidate"].pop("rows"), "'rows' is a required property"),
    "a cause without its consequences": (lambda d: d["causes"][0].pop("consequences"),
                                         "'consequences' is a required property"),
    "a Fix box whose value is text": (lambda d: d["fix"].update(value="[-1, 2, 5]"), "at $.fix:"),
    "a readable config diff without its field": (
        lambda d: _finding(d, "config")["evidence"]["changes"][0].pop("field"), "'field' is a required property"),
}


@pytest.mark.parametrize("case", list(BROKEN_COMPARE))
def test_a_broken_compare_report_fails_with_the_place_it_breaks(reports, case: str) -> None:
    edit, expected = BROKEN_COMPARE[case]
    found = schema_problems(_broken(reports["compare_broken_with_bank"]["document"], edit), "compare", limit=50)
    assert any(expected in p for p in found), found


def test_a_new_finding_kind_passes_the_shipped_schema_and_fails_the_strict_one(reports) -> None:
    """Forward compatibility: a later 1.x may add kinds; tracediff's own tests name every kind it writes."""
    doc = _broken(reports["compare_broken_with_bank"]["document"],
                  lambda d: d["findings"].append({"kind": "segment_future", "severity": "info", "message": "m",
                                                  "evidence": {}}))
    doc["unknown_new_field"] = {"anything": [1]}
    assert schema_problems(doc, "compare", strict=False) == []
    assert any("segment_future" in p for p in schema_problems(doc, "compare", limit=50))


def test_a_report_with_a_bare_nan_is_not_json() -> None:
    assert strict_json_problems('{"cos_mean": NaN}') == [
        "at the file: bare NaN (not JSON; a non-finite float is written as null)"]
    assert strict_json_problems('{"cos_mean": null}') == []


BROKEN_IDENTIFY = {
    "no segments": (lambda d: d.pop("segments"), "'segments' is a required property"),
    "an unknown verdict": (lambda d: d["segments"][0].update(verdict="maybe"), "'maybe' is not one of"),
    "a layer named for a segment that matches none": (lambda d: d["segments"][0].update(verdict="none"),
                                                      "is not of type 'null'"),
    "an infinite margin written as a string": (lambda d: d["segments"][0].update(margin="inf"), "'inf' is not of type"),
    "a layer kind that is no name": (lambda d: d["segments"][0]["best"].update(kind="Final Norm"), "Final Norm"),
    "another schema version": (lambda d: d.update(schema_version=2), "1 was expected"),
}


@pytest.mark.parametrize("case", list(BROKEN_IDENTIFY))
def test_a_broken_identify_result_fails_with_the_place_it_breaks(reports, case: str) -> None:
    edit, expected = BROKEN_IDENTIFY[case]
    found = schema_problems(_broken(reports["identify_hf_bank"]["document"], edit), "identify", limit=50)
    assert any(expected in p for p in found), found


# ---------------------------------------------------------------------------- the conftest hook
INNER_TESTS = '''
import json
import pytest

from tracediff.compare import compare_stores

SAMPLES = {samples!r}


def test_writes_a_valid_identify_result(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps({identify}))


def test_writes_a_compare_report_without_verdict(tmp_path):
    (tmp_path / "broken.json").write_text(json.dumps({broken}))


def test_a_module_folder_is_checked_too(tmp_path_factory):
    (tmp_path_factory.mktemp("mod") / "nan.json").write_text({nan!r})


def test_an_in_process_report_broken_after_compare():
    report = compare_stores(SAMPLES + "/train.zarr", SAMPLES + "/server_fixed.zarr")
    report.plan.pairs = -5


@pytest.mark.report_schema("off")
def test_opts_out_of_the_check(tmp_path):
    (tmp_path / "broken.json").write_text(json.dumps({broken}))


def test_ignores_json_that_is_no_report(tmp_path):
    (tmp_path / "send.json").write_text(json.dumps({{"trace": "t", "responses": {{}}}}))
'''


@pytest.mark.report_schema("off")  # the inner session's broken reports lie under this test's tmp_path
def test_the_conftest_hook_fails_a_test_whose_report_breaks_its_schema(reports, tmp_path: Path) -> None:
    """A pytest session of its own, with this conftest: each broken report errors its test at teardown."""
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), inner / "conftest.py")
    good = reports["identify_hf_bank"]["document"]
    bad = {k: v for k, v in reports["compare_fixed"]["document"].items() if k != "verdict"}
    nan = reports["compare_fixed"]["text"].replace('"noise_floor": ', '"noise_floor": NaN, "was": ', 1)
    (inner / "test_inner.py").write_text(INNER_TESTS.format(samples=str(SAMPLES), identify=good, broken=bad, nan=nan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "--basetemp", str(tmp_path / "basetemp"), "--rootdir", str(inner), str(inner)],
                         cwd=inner, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "6 passed, 3 errors" in out, out  # a teardown error leaves the test itself passed
    errors = {line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith("ERROR ")}
    assert errors == {"test_writes_a_compare_report_without_verdict", "test_a_module_folder_is_checked_too",
                      "test_an_in_process_report_broken_after_compare"}, out
    assert "broken.json: not a valid compare report at $: 'verdict' is a required property" in out
    assert "nan.json: not a valid compare report at the file: bare NaN" in out
    assert "tracediff.compare.run._compare() result: not a valid compare report at $.plan.pairs: -5 is less than" in out
    assert "tracediff report schemas: validated" in out
