"""Replay: what a mismatch costs the draft, on a draft trained for real on a tiny target.

The target is a tiny Llama with the statistics of a trained LLM (massive activations,
tracediff.testing.models); its sequences are its own greedy continuations of random prompts (with a
repetition penalty: a random-weight model otherwise falls into one-token loops a draft learns from the
tokens alone). The draft (one EAGLE-3 layer, a 96-token draft vocabulary with d2t) is trained 3000
Adam steps, two training-time-test steps, on the fc rows cat(hs0, hs3, hs5) of 400 sequences; the
stores hold 8 others. Three servers: the same wiring in bf16 (bf16 rows), the seed's wiring (hs3, hs5, hs6: shifted
by one slot, the embedding missing) and a checkpoint whose d2t holds absolute ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracediff as td
from tracediff.testing.eagle3 import greedy_sequences, train_eagle3_draft, with_absolute_d2t
from tracediff.testing.models import build_tiny_model, server_model
from tracediff.testing.pipelines import run_trainer
from tracediff.testing.tiny_llama import DraftHead

# Slow (-m "not slow" leaves it out; CI runs it): an EAGLE-3 draft trained on a tiny target: 1-2 min of fixture on two cores.
pytestmark = pytest.mark.slow

H, LAYERS, VOCAB, DRAFT_VOCAB = 64, 6, 128, 96
RIGHT = ["hs0", "hs3", "hs5"]
SEED = ["hs3", "hs5", "hs6"]
TRAIN, EVAL = 400, 8


def _record(path: Path, model, layers: list[str], seqs, dtype: torch.dtype = torch.float32) -> None:
    ids = [int(name[2:]) for name in layers]
    with td.record(path, role="x", meta={"aux_layers": {"ids": ids, "convention": "capture"}}) as rec:
        head = DraftHead(H, len(layers))
        rec.tap(head.fc, "fc_in", segment_size=H, segment_labels=layers)
        run_trainer(model, head, seqs, layers, dtype=dtype, on_batch=lambda labels: rec.labels(**labels))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("replay")
    tl = build_tiny_model("llama", hidden_size=H, num_layers=LAYERS, vocab_size=VOCAB, seed=0)
    rng = np.random.default_rng(0)
    seqs = greedy_sequences(tl, [rng.integers(0, VOCAB, 4).tolist() for _ in range(TRAIN + EVAL)], 40,
                            repetition_penalty=3.0)
    draft = train_eagle3_draft(root / "draft", tl, RIGHT, seqs[:TRAIN], aux_layer_ids=[0, 3, 5], steps=3000,
                               draft_vocab_size=DRAFT_VOCAB).path
    held_out = seqs[TRAIN:]
    server = server_model(tl, "bf16")
    _record(root / "train.zarr", tl, RIGHT, held_out)
    _record(root / "server_right.zarr", server, RIGHT, held_out, torch.bfloat16)  # a bf16 server records bf16
    _record(root / "server_seed.zarr", server, SEED, held_out, torch.bfloat16)
    return {"root": root, "tl": tl, "draft": draft, "abs": with_absolute_d2t(draft, root / "draft_abs")}


def replay(world: dict, server: str, *extra: object) -> tuple[dict, subprocess.CompletedProcess[str]]:
    out = world["root"] / f"{server}.{len(extra)}.json"
    run = subprocess.run([sys.executable, "-m", "tracediff", "replay", world["root"] / "train.zarr",
                          world["root"] / f"{server}.zarr", "--draft", world["draft"], "--json", out, *extra],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr
    return json.loads(out.read_text()), run


def _se(t: dict) -> float:
    p = t["acc"][0]
    return (p * (1 - p) / t["starts"]) ** 0.5


def test_the_trained_draft_is_well_above_what_the_tokens_alone_give(world) -> None:
    report, _ = replay(world, "server_right")
    r = report["replay"]
    a, z = r["a"], r["z"]
    assert a["acc"][0] > z["acc"][0] + 6 * _se(a), (a["acc"], z["acc"])  # the fc input carries the prediction
    assert a["accept_engine"] > z["accept_engine"] + 0.3
    assert a["acc"][0] > 0.5 and all(x is not None for x in a["cond_acc"])
    # The trainers' and the engines' definitions of accept length, on the same counts.
    acc = a["acc"]
    assert a["accept_specforge"] == pytest.approx(acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    assert 1.0 <= a["accept_engine"] <= 1 + r["steps"]


def test_correct_wiring_in_bf16_costs_nothing(world) -> None:
    report, run = replay(world, "server_right")
    r = report["replay"]
    assert report["verdict"] == "match" and run.returncode == 0
    assert abs(r["a"]["acc"][0] - r["b"]["acc"][0]) <= 3 * _se(r["a"]) + 1e-9
    assert abs(r["a"]["accept_engine"] - r["b"]["accept_engine"]) < 0.1
    assert "costs nothing measurable" in r["conclusion"]
    assert r["draft"]["d2t"]["kind"] == "offsets" and r["draft"]["draft_vocab_size"] == DRAFT_VOCAB


def test_the_seeds_wiring_costs_the_fc_input_and_the_fix_recovers_it(world) -> None:
    report, run = replay(world, "server_seed")
    r = report["replay"]
    assert report["verdict"] == "mismatch" and run.returncode == 1
    a, b, c, z = r["a"], r["b"], r["c"], r["z"]
    # b near chance for this draft: no better than the tokens alone.
    assert b["acc"][0] <= z["acc"][0] + 3 * _se(z), (b["acc"], z["acc"])
    assert a["acc"][0] - b["acc"][0] > 6 * _se(a)
    # c: the server's hs3 and hs5 moved back to their slots, the missing embedding from the reference.
    assert r["fix"]["slots_from_reference"] == [0] and r["fix"]["slots_from_candidate"] == 2
    assert abs(c["acc"][0] - a["acc"][0]) <= 3 * _se(a) + 1e-9
    assert "costs" in r["conclusion"] and "the proposed fix recovers" in r["conclusion"]
    text = " ".join(run.stdout.split())
    assert "c candidate's rows, fix applied" in text and "z no fc input (tokens alone)" in text


def test_a_d2t_of_absolute_ids_is_flagged_while_the_fc_input_matches(world) -> None:
    report, run = replay(world, "server_right", "--server-draft", world["abs"])
    r = report["replay"]
    assert report["segment_map"] and all(m["status"] == "same" for m in report["segment_map"])  # fc matches
    assert r["server_draft"]["d2t"]["kind"] == "absolute ids"
    assert abs(r["a"]["acc"][0] - r["b"]["acc"][0]) <= 3 * _se(r["a"]) + 1e-9  # the rows cost nothing
    served = r["b_server"]["acc"][0]
    assert served < r["z"]["acc"][0] and served < 0.25  # nearly every draft token wrong
    assert "the server's checkpoint costs" in r["conclusion"] and "costs nothing measurable" in r["conclusion"]
    kinds = {(f["kind"], f["severity"]) for f in report["findings"]}
    assert ("draft_vocabulary", "error") in kinds
    assert run.returncode == 1
    assert any("d2t is absolute ids" in f["message"] for f in report["findings"])


def test_replay_reads_the_speculators_naming_and_refuses_pickles(world, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tracediff.errors import UsageError
    from tracediff.replay.draft import Eagle3Draft

    spec = tmp_path / "speculators_naming"
    spec.mkdir()
    (spec / "config.json").write_text((world["draft"] / "config.json").read_text())
    weights = load_file(str(world["draft"] / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}, str(spec / "model.safetensors"))
    a, b = Eagle3Draft(world["draft"]), Eagle3Draft(spec)
    assert b.info.naming == "layers.0" and a.info.naming == "midlayer"
    assert torch.equal(a.q, b.q) and torch.equal(a.fc_weight, b.fc_weight)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    torch.save({"fc.weight": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(UsageError, match="never unpickles"):
        Eagle3Draft(pickled)


def test_the_replay_table_is_in_every_report_format(world) -> None:
    root = world["root"]
    md, html = root / "r.md", root / "r.html"
    _, run = replay(world, "server_seed", "--markdown", md, "--html", html)
    text = md.read_text()
    assert "### Replay: what the mismatch costs the draft" in text
    assert "| c  candidate's rows, fix applied |" in text and "the proposed fix recovers" in text
    page = html.read_text()
    assert "<table class='replay'>" in page and "candidate&#x27;s rows, fix applied" in page
    assert "Replay (what the mismatch costs the draft)" in run.stdout


def test_server_rows_of_another_width_are_a_note_not_a_crash(world) -> None:
    root = world["root"]
    if not (root / "server_two.zarr").exists():
        from tracediff.testing.models import server_model as _server

        _record(root / "server_two.zarr", _server(world["tl"], "bf16"), ["hs0", "hs3"], _held_out(world),
                torch.bfloat16)
    report, run = replay(world, "server_two")
    r = report["replay"]
    assert run.returncode == 1 and r["b"] is None
    assert any("cannot run" in n for n in r["notes"])
    assert "do not fit the draft's fc" in r["conclusion"]


def _held_out(world) -> list[list[int]]:
    from tracediff.send import sequences_from_trace

    return [s.input_ids for s in sequences_from_trace(world["root"] / "train.zarr")]


@pytest.mark.parametrize("case", ["no_config", "wrong_width", "no_send_report", "bad_send_report"])
def test_bad_replay_input_is_a_one_line_error_naming_the_file(world, tmp_path: Path, case: str) -> None:
    from tracediff.testing.eagle3 import write_eagle3_draft

    draft, extra, expect = world["draft"], [], ""
    if case == "no_config":
        draft = tmp_path / "empty_draft"
        draft.mkdir()
        expect = f"{draft / 'config.json'}: draft config.json not found"
    elif case == "wrong_width":
        draft = write_eagle3_draft(tmp_path / "two_aux", world["tl"].config, [0, 3]).path  # fc reads 2 x 64
        expect = "its fc takes 2 x 64 inputs, the reference rows are 192 wide"
    elif case == "no_send_report":
        extra, expect = ["--send-report", tmp_path / "nope.json"], "nope.json: no such file"
    else:
        bad = tmp_path / "bad.json"
        bad.write_text("{not json")
        extra, expect = ["--send-report", bad], "bad.json: not a JSON send report"
    run = subprocess.run([sys.executable, "-m", "tracediff", "replay", world["root"] / "train.zarr",
                          world["root"] / "server_right.zarr", "--draft", draft, *extra],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().count("\n") == 0 and expect in run.stderr, run.stderr
