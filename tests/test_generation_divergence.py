"""Two recordings whose generations diverge are not a template difference (compare/align/rowpairs.py
``cut_diverged_generations``).

Two servers with other drafts (or numerics flipping a near tie) generate other tokens from some
position on; a later run of matching tokens in the generated rows then pairs rows of another context
by chance, and a tokens-missing-inside-the-sequence finding would send the user to a chat template
while the real difference sits elsewhere (it hid a draft's final norm weight behind
``sequence_insertion`` in a live vLLM pair). Real parts: a tiny real Llama run by the engine-like
scheduler (prefill, then decode rows), recorded into real stores, compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tracediff
from tracediff.compare import compare_stores
from tracediff.testing.pipelines import run_engine
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

LAYERS = ["hs2", "hs4", "hs6"]
PROMPT = 12  # rows before it are prefill (the prompt), from it on decode (what the engine generated)


def _record(path: Path, tl, seqs) -> Path:
    draft = DraftHead(64, 3)
    with tracediff.record(path, role="server", on_full="block") as rec:
        rec.tap(draft.fc, "fc_in", segment_size=64)
        run_engine(tl, draft, seqs, LAYERS, prefill_len=PROMPT, on_batch=lambda lab: rec.labels(**lab))
    assert rec.error is None
    return path


@pytest.fixture(scope="module")
def model_and_seqs():
    tl = build_tiny_llama(hidden_size=64, num_layers=8, seed=0)
    return tl, make_sequences(n_seqs=4, min_len=26, max_len=30, seed=5)


def test_a_generation_that_diverges_is_a_warning_and_its_later_rows_are_left_out(tmp_path, model_and_seqs) -> None:
    tl, seqs = model_and_seqs
    ref = _record(tmp_path / "a.zarr", tl, seqs)
    # The candidate generated one token fewer at position 18 (a decode row): from there its tokens are
    # the reference's shifted by one, so every later 4-gram matches a shifted run of another context.
    cand = _record(tmp_path / "b.zarr", tl, [s[:18] + s[19:] for s in seqs])
    report = compare_stores(ref, cand)
    found = [f for f in report.findings if f.kind == "sequence_insertion"]
    assert [(f.severity, f.evidence["kind"]) for f in found] == [("warning", "generation")], \
        [f.message for f in report.findings]
    assert found[0].evidence["positions"] == [18] and found[0].evidence["sequences"] == 4
    assert "generate other tokens than the reference from position 18" in found[0].message
    # The rows before the divergence are compared and match; none after it is paired.
    assert report.verdict == "match", [f.message for f in report.findings if f.severity == "error"]
    assert not [f for f in report.findings if f.evidence.get("explained_by") == "sequence_insertion"]
    assert report.plan.pairs == 4 * 18


def test_tokens_missing_inside_the_prompt_are_still_the_root_cause(tmp_path, model_and_seqs) -> None:
    tl, seqs = model_and_seqs
    ref = _record(tmp_path / "a.zarr", tl, seqs)
    cand = _record(tmp_path / "b.zarr", tl, [s[:6] + s[9:] for s in seqs])  # a template dropped 3 prompt tokens
    report = compare_stores(ref, cand)
    found = [f for f in report.findings if f.kind == "sequence_insertion"]
    assert [(f.severity, f.evidence["kind"]) for f in found] == [("error", "deletion")]
    assert report.verdict == "mismatch"
