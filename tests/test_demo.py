"""`tracediff demo`: the README's first command, end to end on the shipped samples.

It must tell the story first, name the seed bug in the broken pair, show the fixed pair matching,
name the broken server's layers, write the reports and say where they are; offline, on a CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import invoke_tracediff, run_tracediff

from tracediff.demo import SAMPLE_STORES, default_samples_dir


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("demo")
    result = run_tracediff("demo", "--out", "reports", cwd=root, timeout=120)
    return result, root / "reports"


def test_demo_runs_end_to_end_and_exits_0(demo):
    result, _ = demo
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""


def test_demo_tells_the_story_first_then_names_the_seed_bug(demo):
    out = demo[0].stdout
    assert out.startswith("tracediff demo: an EAGLE-3 draft trained on fc input cat(hs0, hs3, hs6)")
    broken = out.index("$ tracediff compare")
    fixed = out.index("$ tracediff compare", broken + 1)
    identify = out.index("$ tracediff identify")
    assert broken < fixed < identify
    seed_bug = out[broken:fixed]
    assert "tracediff compare: MISMATCH" in seed_bug
    for kind in ("segment_order", "segment_missing", "segment_extra"):
        assert f"ERROR {kind}:" in seed_bug
    assert "shifted by one slot" in seed_bug
    assert "Reference segment 0 (hs0) is missing" in seed_bug
    assert "before the final norm" in seed_bug  # the bank names the extra segment's layer


def test_demo_shows_the_fixed_pair_matching(demo):
    out = demo[0].stdout
    fixed = out[out.index("server_fixed.zarr\n"):out.index("$ tracediff identify")]
    assert "tracediff compare: MATCH" in fixed
    assert "ERROR" not in fixed


def test_demo_identifies_every_layer_of_the_broken_server(demo):
    out = demo[0].stdout
    identified = out[out.index("$ tracediff identify"):out.index("reports:")]
    assert "segment 0 (hs3) is hidden_states[3] = output of layer 2" in identified
    assert "segment 1 (hs6) is hidden_states[6] = output of layer 5" in identified
    assert "segment 2 (hs8_pre_norm) is output of layer 7 (final layer), before the final norm" in identified
    assert "no layer matches" not in identified


def test_demo_writes_the_reports_and_prints_where_they_are(demo):
    result, reports = demo
    names = ["broken.html", "broken.md", "broken.json", "fixed.html", "fixed.md", "fixed.json", "identify.json"]
    tail = result.stdout[result.stdout.index("reports:"):]
    for name in names:
        assert (reports / name).is_file()
        assert f"reports/{name}" in tail
    assert (reports / "broken.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert "segment_order" in (reports / "broken.md").read_text()
    assert json.loads((reports / "broken.json").read_text())["verdict"] == "mismatch"
    assert json.loads((reports / "fixed.json").read_text())["verdict"] == "match"
    assert [s["verdict"] for s in json.loads((reports / "identify.json").read_text())["segments"]] == ["match"] * 3


@pytest.mark.parametrize("case", ["no_folder", "missing_store"])
def test_demo_without_samples_is_one_line_exit_2(tmp_path, case):
    samples = tmp_path / "samples"
    if case == "missing_store":
        samples.mkdir()
        for name in list(SAMPLE_STORES.values())[:-1]:  # every store but the bank
            shutil.copytree(default_samples_dir() / name, samples / name)
    result = invoke_tracediff("demo", "--samples", samples, "--out", tmp_path / "out")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert "--samples DIR" in lines[0]
    if case == "missing_store":
        assert "bank.zarr" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written before the inputs were checked


def test_demo_finds_the_samples_next_to_the_package():
    assert default_samples_dir() == Path(__file__).resolve().parents[1] / "samples"
