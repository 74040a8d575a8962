"""`tracediff replay SERVER --draft DIR --against-chain` (issue #53, item 3): the checkpoint replayed on
the server's recorded chain inputs, compared tap by tap and step by step with what the served draft
produced.

Real parts: an EAGLE-3 draft checkpoint on disk (config.json + safetensors, a real d2t map), a served
draft run the way vLLM drafts (drafter calls over a request's rows: step 0 on every row, steps >= 1
from the call's last row reading the draft's own proposals, labelled position p + k with the step's
input token) and recorded with tracediff's Recorder into a real zarr store with chain taps; the served
checkpoint differs from the replayed one in one thing (final norm weight, RoPE theta, lm_head, d2t read
as absolute ids) or in nothing; the real `tracediff replay` command in a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import cli_env, schema_problems
from safetensors.torch import load_file, save_file

from tracediff.adapters._chain import TOP_K, chain_attrs, tap_name, topk_row
from tracediff.record.recorder import Recorder
from tracediff.replay.chain import ChainReplayOptions, NoServerChainError, replay_against_chain
from tracediff.replay.draft import Eagle3Draft
from tracediff.testing.eagle3 import with_absolute_d2t, write_eagle3_draft

H, VOCAB, DRAFT_VOCAB, AUX = 32, 128, 96, 3
TARGET = {"hidden_size": H, "vocab_size": VOCAB, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 2 * H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
LENGTHS = (21, 17, 26)  # three requests
PROMPT, ACCEPTED = 8, 3  # the prefill drafter call's rows, then each decode call's


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained draft: a vocabulary of 96 of the target's 128 ids (d2t offsets, as engines read them)."""
    folder = write_eagle3_draft(tmp_path_factory.mktemp("draft") / "draft", TARGET, [1, 3, 4],
                                draft_vocab_size=DRAFT_VOCAB, own_embedding=True, seed=3).path
    weights = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    target_ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    weights["d2t"] = (target_ids - torch.arange(DRAFT_VOCAB)).contiguous()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    weights["t2d"] = t2d
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def changed(draft: Path, dst: Path, weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
            **config: Any) -> Path:
    """A copy of the checkpoint with one thing changed: a weight (in place) or a config field."""
    shutil.copytree(draft, dst)
    if weights is not None:
        w = load_file(str(dst / "model.safetensors"))
        weights(w)
        save_file({k: v.contiguous() for k, v in w.items()}, str(dst / "model.safetensors"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _scale_norm(w: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(5)
    w["norm.weight"] = w["norm.weight"] * (1 + 0.1 * torch.randn(w["norm.weight"].shape, generator=gen))


def _other_lm_head(w: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(123)
    w["lm_head.weight"] = torch.randn(w["lm_head.weight"].shape, generator=gen) * w["lm_head.weight"].std()


def serve(path: Path, checkpoint: Path, steps: int = 3, record_steps: tuple[int, ...] | None = None,
          chain: bool = True) -> Path:
    """Serve ``checkpoint`` as vLLM drafts and record it with its chain: per request, drafter calls
    over its fc rows (the prompt, then ``ACCEPTED`` rows a call); step 0 on every row of a call
    (attending to every earlier row), steps 1..steps-1 from the call's last row p at position p + k,
    reading the draft's own top-1 of step k-1. ``record_steps``: the steps whose taps are recorded
    (default all: a recorder that lost a step's rows leaves it out); ``chain`` False: the fc input
    alone, as a server recorded without --draft-chain."""
    model = Eagle3Draft(checkpoint)
    gen = torch.Generator().manual_seed(11)
    with Recorder(path, role="server", framework="served-draft-test") as rec:
        rec.declare("fc_in", segment_size=H, segment_labels=["hs1", "hs3", "hs4"], compute_dtype="float32",
                    **({"chain": chain_attrs("fc_in", 0)} if chain else {}))
        for r, length in enumerate(LENGTHS):
            key = f"req{r}"
            tokens = torch.randint(0, VOCAB, (length + 1,), generator=gen)
            fc_rows = torch.randn(length, AUX * H, generator=gen)
            call = torch.zeros(length, dtype=torch.long)
            ends = list(range(PROMPT, length, ACCEPTED)) + [length]
            for i, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
                call[lo:hi] = i
            labels = {"seq": key, "position": torch.arange(length), "token_id": tokens[:-1],
                      "next_token_id": tokens[1:], "step": call, "phase": "draft_extend", "valid": True}
            rec.capture("fc_in", fc_rows, labels=labels)
            if not chain:
                continue
            keys: list[torch.Tensor] = []
            values: list[torch.Tensor] = []
            points: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                hidden = model.project(fc_rows)
                logits, state = model.step(hidden, tokens[1:], torch.arange(length), keys, values, 0, taps=points)
            _capture(rec, 0, {"fc_out": hidden, **points}, logits, model, labels, record_steps)
            starts = torch.tensor([e - 1 for e in ends])
            proposal = model.to_target_ids(logits[starts].argmax(-1))
            state = state[starts]
            for k in range(1, steps):
                points = {}
                with torch.no_grad():
                    logits, state = model.step(state, proposal, starts + k, keys, values, k, starts=starts, taps=points)
                step_labels = {"seq": key, "position": starts + k, "token_id": proposal, "step": call[starts],
                               "next_token_id": model.to_target_ids(logits.argmax(-1)), "phase": "decode",
                               "valid": True}
                _capture(rec, k, points, logits, model, step_labels, record_steps)
                proposal = step_labels["next_token_id"]
    return path


def _capture(rec: Recorder, step: int, points: dict[str, torch.Tensor], logits: torch.Tensor, model: Eagle3Draft,
             labels: dict[str, Any], record_steps: tuple[int, ...] | None) -> None:
    if record_steps is not None and step not in record_steps:
        return
    rows = {**points, "logits_topk": topk_row(logits, model.d2t)}
    for point in ("fc_out", "layer_in", "layer_out", "norm_out", "logits_topk"):
        if point not in rows:
            continue
        name = tap_name(point, step)
        extra = {"step_inputs": "proposed"} if step else {}
        rec.declare(name, segment_size=None if point == "logits_topk" else H, compute_dtype="float32",
                    segment_labels=["embedding", "hidden_state"] if point == "layer_in" else None,
                    chain=chain_attrs(point, step, **extra), **({"top_k": TOP_K} if point == "logits_topk" else {}))
        rec.capture(name, rows[point].contiguous(), labels=labels)


def _links(report: Any) -> dict[str, dict[str, Any]]:
    return {x["tap_candidate"] or x["tap_reference"]: x for x in report.chain}


def test_the_same_checkpoint_matches_at_every_tap_and_step(tmp_path: Path, draft: Path) -> None:
    report = replay_against_chain(serve(tmp_path / "server.zarr", draft), ChainReplayOptions(draft=str(draft)))
    summary = report.replay_chain
    assert report.verdict == "match" and summary["verdict"] == "match"
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
    assert {s["status"] for s in summary["steps"]} == {"match"}
    assert all(s["top1_agreement"] == 1.0 for s in summary["steps"])
    assert {x["status"] for x in report.chain} == {"match"}
    assert len(report.chain) == 1 + 5 + 4 * 2  # fc_in, step 0's five points, steps 1 and 2's four
    rows = {x["tap_candidate"]: x["rows"] for x in report.chain}
    assert rows["draft_layer_out"] == sum(LENGTHS)  # step 0 on every row
    starts = sum(len(range(PROMPT, n, ACCEPTED)) + 1 for n in LENGTHS)
    assert rows["draft_layer_out_s1"] == rows["draft_logits_topk_s2"] == starts  # one per drafter call
    assert summary["conclusion"] == "The served draft computes what the checkpoint computes."


#: (case, the served checkpoint's change, draft steps served, the tap replay-vs-served must name)
CASES = [
    ("final norm weight", lambda d, t: changed(d, t, _scale_norm), 3, "draft_norm_out"),
    ("RoPE theta 10x", lambda d, t: changed(d, t, rope_theta=100000.0), 3, "draft_layer_out"),
    ("lm_head of another checkpoint", lambda d, t: changed(d, t, _other_lm_head), 3, "draft_logits_topk"),
    # A d2t read as offsets though it holds target ids proposes ids past the vocabulary: the served
    # draft cannot run its later steps on them, so it serves step 0 alone here.
    ("d2t as absolute ids", with_absolute_d2t, 1, "draft_logits_topk"),
]


@pytest.mark.parametrize(("case", "change", "steps", "tap"), CASES, ids=[c[0] for c in CASES])
def test_names_the_tap_where_the_served_draft_first_differs(tmp_path: Path, draft: Path, case: str,
                                                             change: Callable[[Path, Path], Path], steps: int,
                                                             tap: str) -> None:
    served = change(draft, tmp_path / "served_draft")
    report = replay_against_chain(serve(tmp_path / "server.zarr", served, steps=steps),
                                  ChainReplayOptions(draft=str(draft)))
    summary = report.replay_chain
    assert summary["verdict"] == "diverged" and report.verdict == "mismatch", case
    assert summary["first_diverging"] == tap, (case, {t: x["status"] for t, x in _links(report).items()})
    links = _links(report)
    order = [x["tap_candidate"] for x in report.chain]
    assert all(links[t]["status"] == "match" for t in order[: order.index(tap)])  # the inputs are the same
    assert summary["conclusion"].startswith(f"The draft's inputs are the same, its outputs are not: look at {tap} ")
    assert summary["steps"][0]["first_diverging"] == tap and summary["steps"][0]["status"] == "diverged"
    root = [f for f in report.findings if f.kind == "draft_chain" and not f.evidence.get("explained_by")]
    assert [f.evidence["tap_candidate"] for f in root] == [tap]
    if case == "d2t as absolute ids":
        assert summary["steps"][0]["draft_top1_agreement"] == 1.0 > summary["steps"][0]["top1_agreement"]
        assert "d2t map" in links[tap]["found"][0]


def test_a_step_whose_rows_are_missing_cannot_tell(tmp_path: Path, draft: Path) -> None:
    """The server's step-1 rows were lost: step 2's starts have no step-1 state to continue from, so
    step 2 is cannot_tell (not a verdict); step 0 still matches."""
    server = serve(tmp_path / "server.zarr", draft, record_steps=(0, 2))
    report = replay_against_chain(server, ChainReplayOptions(draft=str(draft)))
    steps = {s["step"]: s for s in report.replay_chain["steps"]}
    assert steps[0]["status"] == "match"
    assert steps[2]["status"] == "cannot_tell" and steps[2]["top1_agreement"] is None
    assert steps[2]["why_cannot_tell"]
    assert report.replay_chain["verdict"] == "match"
    assert "cannot tell at step 2" in report.replay_chain["conclusion"]


def test_a_server_without_chain_taps_cannot_tell(tmp_path: Path, draft: Path) -> None:
    server = serve(tmp_path / "server.zarr", draft, chain=False)
    with pytest.raises(NoServerChainError, match="cannot tell: record the server with --draft-chain"):
        replay_against_chain(server, ChainReplayOptions(draft=str(draft)))
    done = subprocess.run([sys.executable, "-m", "tracediff", "replay", str(server), "--draft", str(draft),
                           "--against-chain"], env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot tell: record the server with --draft-chain" in lines[0]


def test_replay_against_chain_as_a_user_types_it(tmp_path: Path, draft: Path) -> None:
    """The command: exit 1, the sentence and the per-step table in the text, the JSON (replay_chain,
    chain), Markdown and HTML reports; two stores with --against-chain is a usage error."""
    server = serve(tmp_path / "server.zarr", changed(draft, tmp_path / "served", _scale_norm))
    out, md, page = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.html"
    done = subprocess.run([sys.executable, "-m", "tracediff", "replay", str(server), "--draft", str(draft),
                           "--against-chain", "--json", str(out), "--markdown", str(md), "--html", str(page)],
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "The draft's inputs are the same, its outputs are not: look at draft_norm_out" in done.stdout
    assert "first diverging tap" in done.stdout and "Draft chain" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["replay_chain"]["first_diverging"] == "draft_norm_out"
    assert [s["status"] for s in doc["replay_chain"]["steps"]] == ["diverged"] * 3
    assert "Replay against the server's draft chain" in md.read_text()
    assert '<section id="replay-chain">' in page.read_text() and "draft_norm_out" in page.read_text()
    assert schema_problems(doc, "compare") == []
    assert doc["candidate"]["path"] == str(server) and "tracediff-replay-chain-" not in out.read_text()
    assert f"tracediff replay {server} --draft {draft} --against-chain" in json.dumps(doc["fix"])
    done = subprocess.run([sys.executable, "-m", "tracediff", "replay", str(server), str(server), "--draft", str(draft),
                           "--against-chain"], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--against-chain takes one store" in done.stderr


def test_max_sequences_replays_and_compares_those_sequences_only(tmp_path: Path, draft: Path) -> None:
    report = replay_against_chain(serve(tmp_path / "server.zarr", draft), ChainReplayOptions(draft=str(draft),
                                                                                           max_sequences=1))
    assert report.replay_chain["sequences"] == 1 and report.verdict == "match"
    assert _links(report)["draft_layer_out"]["rows"] == LENGTHS[0]  # req0 alone
    assert not [f for f in report.findings if f.severity == "warning"]  # no unpaired server rows
