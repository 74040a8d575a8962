"""Checks of tracediff.testing.tiny_llama against real transformers forwards (no mocks).

The helpers are the ground truth of many other tests, so they are held to the properties those
tests rely on: the engine imitation (KV caches, chunked prefill, packed decode) reproduces the
full-sequence states, labels are right and complete, and the bug knobs do what they say.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from tracediff.testing.pipelines import ENGINE_RID_BASE, Batch, run_engine, run_trainer
from tracediff.testing.tiny_llama import (
    DraftHead,
    TinyLlama,
    build_tiny_llama,
    layer_states,
    make_sequences,
    select,
    state_names,
)

HIDDEN = 32
LAYERS = 4
VOCAB = 128
# Relative L2 error allowed between a cached / packed forward and the full-sequence forward: the
# two differ only by fp32 summation order (observed ~1e-7).
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def tl() -> TinyLlama:
    return build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    out = make_sequences(n_seqs=5, min_len=6, max_len=22, vocab_size=VOCAB, seed=1)
    assert [len(s) for s in out] == [22, 6, 10, 14, 18]  # the schedules below are planned on these
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _rows(batches: list[Batch]) -> dict[tuple[int, int], tuple[torch.Tensor, dict[str, int]]]:
    """(seq, position) -> (fc-input row, its labels); asserts every key appears once."""
    out: dict[tuple[int, int], tuple[torch.Tensor, dict[str, int]]] = {}
    for b in batches:
        assert b.fc_input is not None
        assert b.fc_input.shape[:2] == (1, b.num_rows)
        for r in range(b.num_rows):
            key = (int(b.labels["seq"][r]), int(b.labels["position"][r]))
            assert key not in out, f"row {key} seen twice"
            labels = {k: int(b.labels[k][r]) for k in ("token_id", "next_token_id")}
            out[key] = (b.fc_input[0, r], labels)
    return out


def _full_states(tl: TinyLlama, tokens: list[int]) -> dict[str, torch.Tensor]:
    states, _ = layer_states(tl, torch.tensor(tokens))
    return {k: v[0] for k, v in states.items()}


# ---------------------------------------------------------------------------------------------


def test_build_is_seeded_realistic_and_leaves_global_rng_alone() -> None:
    before = torch.get_rng_state()
    a = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=3)
    assert torch.equal(before, torch.get_rng_state())
    b = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=3)
    c = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert not a.model.training and a.model.dtype == torch.float32
    assert (a.hidden_size, a.num_layers, a.config.num_attention_heads, a.config.num_key_value_heads) == (
        HIDDEN,
        LAYERS,
        4,
        2,
    )
    assert a.config.intermediate_size == 2 * HIDDEN
    for name, w in sa.items():
        if "norm" in name:
            assert float(w.min()) >= 0.5 and float(w.max()) <= 2.0, name
            assert float(w.std()) > 0.2, f"{name} should not be (near) unit"


def test_layer_states_follow_hf_numbering_and_pre_norm(tl: TinyLlama, seqs: list[list[int]]) -> None:
    ids = torch.tensor(seqs[0])
    states, past = layer_states(tl, ids)
    assert past is None
    assert list(states) == state_names(LAYERS) == tl.state_names()
    for v in states.values():
        assert v.shape == (1, len(seqs[0]), HIDDEN) and v.dtype == torch.float32
    # The same numbers as HF's own full model output.
    with torch.no_grad():
        hf = tl.model(input_ids=ids[None], output_hidden_states=True, use_cache=False).hidden_states
        assert len(hf) == LAYERS + 1
        for i, h in enumerate(hf):
            assert torch.equal(states[f"hs{i}"], h)
        assert torch.equal(states["hs0"], tl.model.model.embed_tokens(ids[None]))
        # hs{L} is post-norm; pre_norm is the last layer's output before the final norm.
        torch.testing.assert_close(tl.model.model.norm(states["pre_norm"]), states[f"hs{LAYERS}"])
    pre, post = states["pre_norm"][0], states[f"hs{LAYERS}"][0]
    assert _cos(pre, post) < 0.99, "non-unit norm weights must change the direction"
    scale = float(post.norm(dim=-1).mean() / pre.norm(dim=-1).mean())
    assert not 0.5 < scale < 2.0, "pre and post norm should differ in scale"
    # Adjacent layers correlate, as in a real model, but are not copies of each other.
    for i in range(LAYERS - 1):
        c = _cos(states[f"hs{i}"], states[f"hs{i + 1}"])
        assert 0.3 < c < 0.99, (i, c)
    # Batched [B, T] input gives [B, T, H] and the same numbers per row.
    two, _ = layer_states(tl, torch.stack([ids, ids.flip(0)]))
    assert two["pre_norm"].shape == (2, len(seqs[0]), HIDDEN)
    assert _rel_err(two["hs2"][0], states["hs2"][0]) < REL_TOL


def test_layer_states_with_cache_match_the_full_forward(tl: TinyLlama, seqs: list[list[int]]) -> None:
    from transformers import DynamicCache  # noqa: PLC0415  (seconds to import: not at collection)

    tokens = seqs[1]
    full = _full_states(tl, tokens)
    states, past = layer_states(tl, torch.tensor(tokens[:4]), use_cache=True)
    assert isinstance(past, DynamicCache) and past.get_seq_length() == 4
    got = [states]
    # The rest one token at a time, once with explicit positions and once letting HF derive them.
    for p in range(4, len(tokens)):
        pos = torch.tensor([p]) if p % 2 else None
        s, past2 = layer_states(tl, torch.tensor(tokens[p : p + 1]), past_key_values=past, position_ids=pos)
        assert past2 is past
        got.append(s)
    assert past.get_seq_length() == len(tokens)
    for name, ref in full.items():
        cat = torch.cat([g[name][0] for g in got], dim=0)
        assert _rel_err(cat, ref) < REL_TOL, name


def test_select_concatenates_in_the_given_order() -> None:
    states = {"hs0": torch.zeros(1, 2, 3), "hs1": torch.ones(1, 2, 3)}
    out = select(states, ["hs1", "hs0"])
    assert out.shape == (1, 2, 6)
    assert torch.equal(out[..., :3], states["hs1"]) and torch.equal(out[..., 3:], states["hs0"])
    with pytest.raises(KeyError, match="hs9"):
        select(states, ["hs0", "hs9"])


def test_make_sequences_is_seeded_and_varied() -> None:
    a = make_sequences(n_seqs=6, min_len=5, max_len=30, vocab_size=50, seed=7)
    assert a == make_sequences(n_seqs=6, min_len=5, max_len=30, vocab_size=50, seed=7)
    assert a != make_sequences(n_seqs=6, min_len=5, max_len=30, vocab_size=50, seed=8)
    lengths = [len(s) for s in a]
    assert min(lengths) == 5 and max(lengths) == 30 and len(set(lengths)) == 6
    assert all(isinstance(t, int) and 0 <= t < 50 for s in a for t in s)


def test_trainer_feeds_full_sequences_with_complete_labels(tl: TinyLlama, seqs: list[list[int]]) -> None:
    layers = ["hs1", "hs3", "pre_norm"]
    draft = DraftHead(HIDDEN, 3)
    seen_labels: list[dict[str, Any]] = []
    seen_inputs: list[torch.Tensor] = []
    # A real forward hook on draft.fc, as the recorder uses, checks what the draft really got.
    handle = draft.fc.register_forward_hook(lambda _m, args, _o: seen_inputs.append(args[0]))
    try:
        batches = run_trainer(tl, draft, seqs, layers, on_batch=seen_labels.append, keep_inputs=True)
    finally:
        handle.remove()
    assert len(batches) == len(seen_labels) == len(seen_inputs) == len(seqs)
    for i, (seq, b, lab, x) in enumerate(zip(seqs, batches, seen_labels, seen_inputs, strict=True)):
        t = len(seq)
        assert lab is b.labels and x is b.fc_input
        assert x.shape == (1, t, 3 * HIDDEN) and x.dtype == torch.float32
        assert lab["phase"] == "train" and lab["step"] == i
        for k in ("seq", "position", "token_id", "next_token_id"):
            assert lab[k].dtype == np.int64 and lab[k].shape == (t,), k
        assert (lab["seq"] == i).all()
        assert lab["position"].tolist() == list(range(t))
        assert lab["token_id"].tolist() == seq
        assert lab["next_token_id"].tolist() == [*seq[1:], -1]
        full = _full_states(tl, seq)
        assert torch.equal(x[0], select(full, layers))


def test_trainer_casts_fc_input_and_draft(tl: TinyLlama, seqs: list[list[int]]) -> None:
    draft = DraftHead(HIDDEN, 2)
    batches = run_trainer(tl, draft, seqs[:2], ["hs1", "hs2"], dtype=torch.bfloat16, keep_inputs=True)
    assert draft.fc.weight.dtype == torch.bfloat16
    assert all(b.fc_input is not None and b.fc_input.dtype == torch.bfloat16 for b in batches)
    assert run_trainer(tl, DraftHead(HIDDEN, 2), seqs[:1], ["hs1", "hs2"])[0].fc_input is None


def test_engine_reproduces_full_forward_states_with_complete_interleaved_labels(
    tl: TinyLlama, seqs: list[list[int]]
) -> None:
    names = state_names(LAYERS)  # every state, pre_norm included, as k segments
    draft = DraftHead(HIDDEN, len(names))
    prompt = [10, 2, 3, 12, 4]  # dataset tokens in each prompt (lengths 22, 6, 10, 14, 18); the rest is decoded
    chunk, max_running = 7, 3
    shapes: list[tuple[int, ...]] = []
    handle = draft.fc.register_forward_hook(lambda _m, args, _o: shapes.append(tuple(args[0].shape)))
    try:
        batches = run_engine(
            tl,
            draft,
            seqs,
            names,
            prefill_len=lambda i, _seq: prompt[i],
            chunk_size=chunk,
            max_running=max_running,
            keep_inputs=True,
        )
    finally:
        handle.remove()
    assert shapes == [tuple(b.fc_input.shape) for b in batches if b.fc_input is not None]

    # Coverage: every position of every sequence exactly once, under request ids 1000+i.
    rows = _rows(batches)
    expected = {(ENGINE_RID_BASE + i, p) for i, s in enumerate(seqs) for p in range(len(s))}
    assert set(rows) == expected

    # Values: each row equals the full-sequence forward at that position, for every state.
    for i, seq in enumerate(seqs):
        full = _full_states(tl, seq)
        for p in range(len(seq)):
            row, labels = rows[(ENGINE_RID_BASE + i, p)]
            assert labels == {"token_id": seq[p], "next_token_id": seq[p + 1] if p + 1 < len(seq) else -1}
            for j, name in enumerate(names):
                got = row[j * HIDDEN : (j + 1) * HIDDEN]
                assert _rel_err(got, full[name][p]) < REL_TOL, (i, p, name)

    # Scheduling: steps count up, both phases occur, chunking and the running cap are respected.
    assert [b.labels["step"] for b in batches] == list(range(len(batches)))
    phases = Counter(b.labels["phase"] for b in batches)
    assert set(phases) == {"prefill", "decode"}
    for b in batches:
        seq_ids = b.labels["seq"].tolist()
        if b.labels["phase"] == "prefill":
            assert b.num_rows <= chunk
            # Packed ragged prefill: each request's rows are contiguous and in position order.
            for rid in set(seq_ids):
                pos = b.labels["position"][b.labels["seq"] == rid]
                assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + len(pos)))
        else:
            assert len(set(seq_ids)) == len(seq_ids) <= max_running  # one token per request
    # A chunked prefill continues a request past position 0 (prompts of 10 and 12 > chunk).
    assert any(b.labels["phase"] == "prefill" and int(b.labels["position"][0]) > 0 for b in batches), (
        "no chunked prefill continuation"
    )
    # Interleaving: decode batches hold several requests, and the engine order is not sorted.
    assert max(b.num_rows for b in batches if b.labels["phase"] == "decode") > 1
    order = [(int(s), int(p)) for b in batches for s, p in zip(b.labels["seq"], b.labels["position"], strict=True)]
    assert order != sorted(order)
    # Admission as others finish: a request starts after some decode step already ran.
    first_decode = next(k for k, b in enumerate(batches) if b.labels["phase"] == "decode")
    assert any(b.labels["phase"] == "prefill" and (b.labels["position"] == 0).any() for b in batches[first_decode:])


def test_engine_default_schedule_and_trainer_agree_by_content(tl: TinyLlama, seqs: list[list[int]]) -> None:
    layers = ["hs1", "hs2", "hs3"]
    eng = _rows(run_engine(tl, DraftHead(HIDDEN, 3), seqs, layers, keep_inputs=True))
    trn = _rows(run_trainer(tl, DraftHead(HIDDEN, 3), seqs, layers, keep_inputs=True))
    assert len(eng) == len(trn) == sum(len(s) for s in seqs)
    for (seq, pos), (row, labels) in trn.items():
        erow, elabels = eng[(ENGINE_RID_BASE + seq, pos)]
        assert elabels == labels
        assert _rel_err(erow, row) < REL_TOL


def test_engine_bf16_casts_like_the_trainer(tl: TinyLlama, seqs: list[list[int]]) -> None:
    draft = DraftHead(HIDDEN, 2)
    batches = run_engine(tl, draft, seqs[:2], ["hs0", "pre_norm"], dtype=torch.bfloat16, keep_inputs=True)
    assert draft.fc.weight.dtype == torch.bfloat16
    assert all(b.fc_input is not None and b.fc_input.dtype == torch.bfloat16 for b in batches)


def test_prefix_tokens_add_rows_and_move_positions(tl: TinyLlama, seqs: list[list[int]]) -> None:
    prefix = [5, 6, 7]
    layers = ["hs1", "hs4"]
    batches = run_engine(tl, DraftHead(HIDDEN, 2), seqs, layers, prefix_tokens=prefix, prefill_len=4, keep_inputs=True)
    rows = _rows(batches)
    assert len(rows) == sum(len(s) for s in seqs) + len(prefix) * len(seqs)
    for i, seq in enumerate(seqs):
        tokens = prefix + seq
        rid = ENGINE_RID_BASE + i
        assert {p for (s, p) in rows if s == rid} == set(range(len(tokens)))
        assert [rows[(rid, p)][1]["token_id"] for p in range(len(tokens))] == tokens
        # The preamble's rows are real rows of the forward of prefix + seq ...
        full = select(_full_states(tl, tokens), layers)
        for p in range(len(tokens)):
            assert _rel_err(rows[(rid, p)][0], full[p]) < REL_TOL
        # ... and the sequence's own tokens sit len(prefix) later, with different states than in
        # the trainer (they attend to the preamble): the mismatch compare has to explain.
        trained = select(_full_states(tl, seq), layers)
        assert _rel_err(rows[(rid, len(prefix))][0], trained[0]) > 1e-2


def test_label_shift_mislabels_token_ids_only(tl: TinyLlama, seqs: list[list[int]]) -> None:
    layers = ["hs2"]
    plain = _rows(run_engine(tl, DraftHead(HIDDEN, 1), seqs, layers, prefill_len=5, keep_inputs=True))
    late = _rows(run_engine(tl, DraftHead(HIDDEN, 1), seqs, layers, prefill_len=5, label_shift=1, keep_inputs=True))
    early = _rows(run_engine(tl, DraftHead(HIDDEN, 1), seqs, layers, prefill_len=5, label_shift=-2, keep_inputs=True))
    assert set(plain) == set(late) == set(early)
    for i, seq in enumerate(seqs):
        rid, n = ENGINE_RID_BASE + i, len(seq)
        for p in range(n):
            assert late[(rid, p)][1]["token_id"] == (seq[p + 1] if p + 1 < n else -1)
            assert early[(rid, p)][1]["token_id"] == (seq[p - 2] if p >= 2 else -1)
            assert late[(rid, p)][1]["next_token_id"] == plain[(rid, p)][1]["next_token_id"]
            assert torch.equal(late[(rid, p)][0], plain[(rid, p)][0])


def test_transform_rewrites_what_the_draft_sees(tl: TinyLlama, seqs: list[list[int]]) -> None:
    layers = ["hs1", "hs2", "hs3"]
    calls: list[set[str]] = []

    def scale_middle(x: torch.Tensor, states: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(set(states))
        assert all(v.shape[:2] == x.shape[:2] for v in states.values())
        x = x.clone()
        x[..., HIDDEN : 2 * HIDDEN] *= 4.0
        x[0, 0, 0] = float("nan")
        return x

    draft = DraftHead(HIDDEN, 3)
    seen: list[torch.Tensor] = []
    handle = draft.fc.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        batches = run_engine(tl, draft, seqs[:3], layers, transform=scale_middle, keep_inputs=True)
    finally:
        handle.remove()
    assert len(calls) == len(batches) == len(seen)
    assert calls[0] == set(state_names(LAYERS))
    base = _rows(run_engine(tl, DraftHead(HIDDEN, 3), seqs[:3], layers, keep_inputs=True))
    for b, x in zip(batches, seen, strict=True):
        assert x is b.fc_input and torch.isnan(x[0, 0, 0])
        s, p = int(b.labels["seq"][-1]), int(b.labels["position"][-1])
        ref = base[(s, p)][0]
        torch.testing.assert_close(x[0, -1, HIDDEN : 2 * HIDDEN], 4.0 * ref[HIDDEN : 2 * HIDDEN])
        torch.testing.assert_close(x[0, -1, 2 * HIDDEN :], ref[2 * HIDDEN :])


def test_engine_rejects_bad_arguments(tl: TinyLlama) -> None:
    with pytest.raises(ValueError, match="max_running"):
        run_engine(tl, DraftHead(HIDDEN, 1), [[1, 2]], ["hs0"], max_running=0)
    with pytest.raises(ValueError, match="chunk_size"):
        run_engine(tl, DraftHead(HIDDEN, 1), [[1, 2]], ["hs0"], chunk_size=0)
    with pytest.raises(ValueError, match="non-empty"):
        run_engine(tl, DraftHead(HIDDEN, 1), [[1, 2], []], ["hs0"])
