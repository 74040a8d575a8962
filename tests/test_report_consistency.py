"""The report agrees with itself and with what the stores record: swapped arguments are pointed
out first, the re-record command is the one the candidate was recorded with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracediff
from tracediff.compare.run import compare_stores

ROWS, HIDDEN = 96, 32


def _store(path, role: str, rows: torch.Tensor, seed_tokens: int = 7) -> None:
    with tracediff.record(path, role=role) as rec:
        rec.declare("fc_in", segment_size=HIDDEN)
        rec.labels(seq=np.repeat(np.arange(4), ROWS // 4), position=np.tile(np.arange(ROWS // 4), 4),
                   token_id=np.random.default_rng(seed_tokens).integers(0, 500, ROWS))
        rec.capture("fc_in", rows)


@pytest.mark.parametrize("roles, swapped", [(("server", "trainer"), True), (("trainer", "server"), False),
                                             (("", "trainer"), False)])
def test_a_server_given_as_reference_against_a_trainer_is_pointed_out_first(tmp_path, roles, swapped):
    rows = torch.randn(ROWS, 3 * HIDDEN, generator=torch.Generator().manual_seed(0))
    _store(tmp_path / "a.zarr", roles[0], rows)
    _store(tmp_path / "b.zarr", roles[1], rows.clone())
    report = compare_stores(tmp_path / "a.zarr", tmp_path / "b.zarr")
    kinds = [f.kind for f in report.findings]
    assert ("swapped_roles" in kinds) is swapped
    if swapped:
        assert kinds[0] == "swapped_roles" and report.findings[0].severity == "warning"
        assert "tracediff compare TRAINER_STORE SERVER_STORE" in report.findings[0].message
    assert report.verdict == "match"


def _layered_store(path, layers: list[int], states: np.ndarray, tokens: np.ndarray, meta: dict | None = None) -> None:
    seqs, length, _, hidden = states.shape
    with tracediff.record(path, role="", meta=meta or {}) as rec:
        rec.declare("fc_in", segment_size=hidden)
        for s in range(seqs):
            rec.labels(seq=s, position=np.arange(length), token_id=tokens[s])
            rec.capture("fc_in", torch.from_numpy(np.concatenate([states[s, :, k] for k in layers], axis=-1)))


def _sink_states(seqs: int = 24, length: int = 40, layers: int = 6, hidden: int = 64) -> np.ndarray:
    """Hidden states of ``layers`` layers, each a step of a random walk from the one before (so
    neighbouring layers are alike, as in a real model), with the first position of every sequence
    the same state in every layer (an attention sink: same token, no context)."""
    rng = np.random.default_rng(0)
    states = rng.standard_normal((seqs, length, layers, hidden)).astype(np.float32)
    for k in range(1, layers):
        states[:, :, k] = states[:, :, k - 1] + 0.8 * states[:, :, k]
    states[:, 0] = 3 * rng.standard_normal(hidden).astype(np.float32)
    return states


def test_a_wrong_layer_in_every_slot_is_not_called_a_subset_because_the_sink_rows_agree(tmp_path):
    """Every slot reads a neighbouring layer; only position 0, alike in every layer, agrees. That is
    no evidence that the slot is right elsewhere: each whole slot is the finding (with the recorded
    config's fix), never "other data on the rows at positions >= 1"."""
    states = _sink_states()
    tokens = np.random.default_rng(1).integers(0, 1000, states.shape[:2])
    _layered_store(tmp_path / "ref.zarr", [0, 2, 4], states, tokens,
                   {"aux_layers": {"ids": [0, 2, 4], "convention": "hf"}})
    _layered_store(tmp_path / "cand.zarr", [1, 3, 5], states, tokens,
                   {"aux_layers": {"ids": [0, 2, 4], "convention": "sglang"}})
    report = compare_stores(tmp_path / "ref.zarr", tmp_path / "cand.zarr")
    assert report.verdict == "mismatch"
    kinds = [f.kind for f in report.findings if f.severity == "error"]
    assert "segment_subset" not in kinds
    assert sorted(f.evidence["candidate_segment"] for f in report.findings if f.kind == "segment_value") == [0, 1, 2]
    assert report.fix is not None and report.fix["value"] == [-1, 1, 3]  # sglang numbering of layers 0, 2, 4


def test_a_subset_whose_good_rows_carry_evidence_is_still_a_subset(tmp_path):
    """The same layers everywhere except in the second half of the sequences, which read a neighbour:
    the rows that agree differ from layer to layer, so the subset stands."""
    states = _sink_states()
    tokens = np.random.default_rng(1).integers(0, 1000, states.shape[:2])
    wrong = states.copy()
    wrong[:, 20:, 2] = states[:, 20:, 3]
    _layered_store(tmp_path / "ref.zarr", [0, 2, 4], states, tokens)
    _layered_store(tmp_path / "cand.zarr", [0, 2, 4], wrong, tokens)
    report = compare_stores(tmp_path / "ref.zarr", tmp_path / "cand.zarr")
    subsets = [f for f in report.findings if f.kind == "segment_subset"]
    assert len(subsets) == 1 and subsets[0].evidence["subset"]["dimension"] == "position"


def test_a_banks_names_are_the_root_cause_and_the_fix_says_what_the_candidate_feeds_now(tmp_path):
    """The shipped samples' model and token ids, a server feeding hs7 where the trainer fed hs6 and
    recording no aux layers: with the shipped bank, the root cause is "hs7 where the draft was
    trained on hs6", not "probably a neighbouring layer"."""
    import sys
    from pathlib import Path

    from tracediff.compare.plan.decide import CompareOptions
    from tracediff.report.text import render_text
    from tracediff.testing.pipelines import run_engine
    from tracediff.testing.tiny_llama import build_tiny_llama, make_sequences

    samples = Path(__file__).resolve().parents[1] / "samples"
    sys.path.insert(0, str(samples))
    try:
        import make_samples as ms
    finally:
        sys.path.remove(str(samples))
    torch.set_num_threads(1)
    tl = build_tiny_llama(hidden_size=ms.HIDDEN, num_layers=ms.LAYERS, vocab_size=ms.VOCAB, seed=ms.SEED)
    seqs = make_sequences(n_seqs=ms.N_SEQS, min_len=ms.MIN_LEN, max_len=ms.MAX_LEN, vocab_size=ms.VOCAB,
                          seed=ms.DATA_SEED)
    meta = {k: v for k, v in ms.server_meta([-1, 2, 6]).items() if k != "aux_layers"}
    ms.record_fc(tmp_path / "hs7.zarr", "server", meta, run_engine, ["hs0", "hs3", "hs7"], tl, seqs, max_running=3,
                 seed=ms.SEED)
    report = compare_stores(samples / "train.zarr", tmp_path / "hs7.zarr", CompareOptions(bank=samples / "bank.zarr"))
    (cause,) = report.causes()
    assert "hidden_states[7]" in cause.summary and "where the draft was trained on hidden_states[6]" in cause.summary
    text = render_text(report)
    assert "probably a neighbouring layer" not in text.split("Segment map")[0]
    assert report.fix is not None and report.fix["target_layers"] == [0, 3, 6]
    assert any("the candidate feeds [0, 3, 7] now" in step["text"] for step in report.fix["steps"])


def test_a_side_split_across_stores_gives_the_plan_of_one_store(tmp_path):
    """The same candidate rows in one store, and in two stores of half each (written in another
    order): the plan samples the same rows in the same order, so every number it decides on is
    identical; the streaming pass's float32 means agree to their precision."""
    from tracediff.compare.plan.decide import CompareOptions

    states = _sink_states(seqs=16, length=30)
    tokens = np.random.default_rng(1).integers(0, 1000, states.shape[:2])
    _layered_store(tmp_path / "ref.zarr", [0, 2, 4], states, tokens)
    noisy = states + np.random.default_rng(2).normal(0, 1e-3, states.shape).astype(np.float32)

    def write(path, seqs):
        with tracediff.record(path, role="server") as rec:
            rec.declare("fc_in", segment_size=states.shape[-1])
            for s in seqs:
                rec.labels(seq=100 + s, position=np.arange(states.shape[1]), token_id=tokens[s])
                rec.capture("fc_in", torch.from_numpy(np.concatenate([noisy[s, :, k] for k in (0, 2, 5)], axis=-1)))

    write(tmp_path / "one.zarr", range(16))
    write(tmp_path / "a.zarr", range(15, 7, -1))
    write(tmp_path / "b.zarr", range(8))
    opts = CompareOptions(sample_rows=300)  # fewer than the 480 pairs: which rows are drawn matters
    one = compare_stores(tmp_path / "ref.zarr", tmp_path / "one.zarr", opts).to_dict()
    two = compare_stores(tmp_path / "ref.zarr", [tmp_path / "a.zarr", tmp_path / "b.zarr"], opts).to_dict()
    for key in ("sample_rows", "noise_floor", "noise_floor_error", "numerics_budgets", "drift_limits", "noise",
                "label_offset", "offset_scores"):
        assert one["plan"][key] == two["plan"][key], key
    assert one["matrix_standardised"] == two["matrix_standardised"] and one["segment_map"] == two["segment_map"]
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m1["std_rel_error"] == pytest.approx(m2["std_rel_error"], rel=1e-5)
    assert [f["kind"] for f in one["findings"]] == [f["kind"] for f in two["findings"]]


def one_answer_per_segment(report) -> list[str]:
    """Where the findings and the segment map disagree about a segment: [] when they agree.

    A candidate segment a finding calls extra is extra in the map; a reference segment a finding
    calls missing is carried by no map entry; a pair a finding calls other data or wrongly scaled is
    not "same" in the map; the verdict CANNOT TELL leaves every segment undecided."""
    problems = []
    by_cand = {m.candidate: m for m in report.segment_map}
    carried = {m.reference for m in report.segment_map if m.status in ("same", "moved", "duplicate")}
    for f in report.findings:
        if f.severity != "error":
            continue
        ev = f.evidence
        if f.kind == "segment_extra" and by_cand[ev["candidate_segment"]].status not in ("extra", "related"):
            problems.append(f"{f.kind} {ev['candidate_segment']} but the map says {by_cand[ev['candidate_segment']]}")
        if f.kind == "segment_missing" and ev["reference_segment"] in carried:
            problems.append(f"{f.kind} {ev['reference_segment']} but the map carries it")
        if f.kind in ("segment_value", "segment_scale") and by_cand[ev["candidate_segment"]].relation == "same":
            problems.append(f"{f.kind} {ev['candidate_segment']} but the map says same")
    if report.verdict == "cannot_tell":
        problems += [f"segment {m.candidate} decided ({m.status})" for m in report.segment_map if m.status != "undecided"]
    return problems


def test_the_shipped_pairs_and_the_synthetic_cases_give_one_answer_per_segment(tmp_path):
    from pathlib import Path

    samples = Path(__file__).resolve().parents[1] / "samples"
    reports = [compare_stores(samples / "train.zarr", samples / name) for name in ("server_broken.zarr", "server_fixed.zarr")]
    states = _sink_states()
    tokens = np.random.default_rng(1).integers(0, 1000, states.shape[:2])
    _layered_store(tmp_path / "ref.zarr", [0, 2, 4], states, tokens)
    for name, layers, toks in (("shift", [2, 4, 5], tokens), ("wrong", [1, 3, 5], tokens), ("swap", [2, 0, 4], tokens),
                               ("unlabelled", [0, 2, 4], None)):
        seqs, length = states.shape[:2]
        with tracediff.record(tmp_path / f"{name}.zarr", role="") as rec:
            rec.declare("fc_in", segment_size=states.shape[-1])
            for s in range(seqs)[::-1]:
                if toks is not None:
                    rec.labels(seq=s, position=np.arange(length), token_id=toks[s])
                rec.capture("fc_in", torch.from_numpy(np.concatenate([states[s, :, k] for k in layers], axis=-1)))
        reports.append(compare_stores(tmp_path / "ref.zarr", tmp_path / f"{name}.zarr"))
    assert [r.verdict for r in reports] == ["mismatch", "match", "mismatch", "mismatch", "mismatch", "cannot_tell"]
    for r in reports:
        assert one_answer_per_segment(r) == [], r.candidate.path


def test_a_candidate_without_a_segment_size_on_a_wrong_layer_is_still_named_the_cut_being_confirmed(tmp_path):
    """Same widths, no recorded size on the candidate, slot 2 a neighbouring layer: slots 0 and 1 match
    exactly at the borrowed size, which confirms the cut; the wrong layer is named (with "Assumed, not
    recorded") instead of CANNOT TELL."""
    states = _sink_states()
    tokens = np.random.default_rng(1).integers(0, 1000, states.shape[:2])
    _layered_store(tmp_path / "ref.zarr", [0, 2, 4], states, tokens)
    seqs, length, _, hidden = states.shape
    with tracediff.record(tmp_path / "cand.zarr", role="") as rec:
        for s in range(seqs):
            rec.labels(seq=s, position=np.arange(length), token_id=tokens[s])
            rec.capture("fc_in", torch.from_numpy(np.concatenate([states[s, :, k] for k in (0, 2, 5)], axis=-1)))
    report = compare_stores(tmp_path / "ref.zarr", tmp_path / "cand.zarr")
    gate = {p.name: p for p in report.preconditions}
    assert gate["segment_sizes"].status == "supported"
    assert report.verdict == "mismatch"
    assert [f.evidence["candidate_segment"] for f in report.findings if f.kind == "segment_value"] == [2]
