"""Checks of tracediff.testing.models: real transformers architectures with trained-like statistics.

These models stand in for real targets when decision thresholds are tuned, so the tests pin the
statistics those thresholds depend on (massive activations, raw cosine of adjacent layers, bf16 and
fp8 server drift), besides what every helper model must do: run both pipelines and reproduce a full
forward from a KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tracediff.testing.models import (
    ARCHITECTURES,
    MASSIVE_LAYER,
    TinyModel,
    build_tiny_model,
    server_model,
)
from tracediff.testing.pipelines import ENGINE_RID_BASE, Batch, run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, layer_states, make_sequences

LAYERS = 8
# Cached/packed vs full-sequence forwards differ by fp32 summation order only (observed ~1e-7).
REL_TOL = 1e-5
# States from the massive layer's output to the deepest pre-norm state, in depth order.
AFTER_INJECTION = [f"hs{i}" for i in range(MASSIVE_LAYER + 1, LAYERS)] + ["pre_norm"]
MID, DEEP = "hs4", "pre_norm"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny matrices: a second thread buys nothing, and on a busy 2-core host oversubscribed
    # OpenMP threads made this file ~15x slower (3 min instead of 12 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tm(request: pytest.FixtureRequest) -> TinyModel:
    return build_tiny_model(request.param, num_layers=LAYERS, seed=0)


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    return make_sequences(n_seqs=4, min_len=16, max_len=40, vocab_size=512, seed=1)


def _states(model: TinyModel, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Every state of every token of ``seqs`` (full forwards), ``[tokens, H]`` in float64."""
    per_seq = [layer_states(model, torch.tensor(s))[0] for s in seqs]
    return {k: torch.cat([s[k][0] for s in per_seq]).double() for k in per_seq[0]}


@pytest.fixture(scope="module")
def trainer_states(tm: TinyModel, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    return _states(tm, seqs)


def _rest(tm: TinyModel) -> list[int]:
    assert tm.massive is not None
    return [d for d in range(tm.hidden_size) if d not in tm.massive.dims]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _mean_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a, b, dim=-1).mean())


def _rows(batches: list[Batch], rid_base: int = 0) -> dict[tuple[int, int], torch.Tensor]:
    out = {}
    for b in batches:
        assert b.fc_input is not None
        for r in range(b.num_rows):
            out[(int(b.labels["seq"][r]) - rid_base, int(b.labels["position"][r]))] = b.fc_input[0, r]
    return out


# ------------------------------------------------------------------------------------- building


def test_each_architecture_is_its_real_transformers_class_with_sane_heads(tm: TinyModel) -> None:
    expected = {
        "llama": "LlamaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }
    config = tm.config
    assert type(tm.model).__name__ == expected[tm.arch]
    assert config._attn_implementation == "sdpa"
    assert (tm.hidden_size, tm.num_layers, config.num_attention_heads) == (64, LAYERS, 4)
    assert not tm.model.training and tm.dtype == torch.float32
    if tm.arch == "deepseek_v3":
        # MLA: query/key = 8 no-RoPE + 8 RoPE dims, value 16; layer 0 dense, the rest MoE.
        assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (8, 8, 16)
        assert config.q_lora_rank and config.kv_lora_rank
        assert type(tm.model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
        assert type(tm.model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    else:
        assert config.head_dim == 16
    if tm.arch == "qwen3":
        assert hasattr(tm.model.model.layers[0].self_attn, "q_norm")
    # Every RMSNorm weight is per-channel random in the range, none left at HF's ones.
    norms = [m.weight for m in tm.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) >= 2 * LAYERS + 1
    for w in norms:
        assert float(w.min()) >= 0.5 and float(w.max()) <= 2.0 and float(w.std()) > 0.1


def test_building_twice_with_a_seed_gives_identical_weights_and_leaves_the_global_rng(tm: TinyModel) -> None:
    before = torch.get_rng_state()
    again = build_tiny_model(tm.arch, num_layers=LAYERS, seed=0)
    assert torch.equal(before, torch.get_rng_state())
    ours, theirs = tm.model.state_dict(), again.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert again.massive == tm.massive
    other = build_tiny_model(tm.arch, num_layers=LAYERS, seed=1).model.state_dict()
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"], other["model.layers.0.mlp.down_proj.weight"])


def test_massive_false_gives_the_plain_model() -> None:
    plain = build_tiny_model("llama", num_layers=4, massive=False)
    assert plain.massive is None
    assert all(not layer._forward_hooks for layer in plain.model.model.layers)
    reference = build_tiny_llama(num_layers=4).model.state_dict()
    assert all(torch.equal(w, reference[k]) for k, w in plain.model.state_dict().items())


def test_build_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'"):
        build_tiny_model("gpt2")
    with pytest.raises(ValueError, match="multiple of 32"):
        build_tiny_model("llama", hidden_size=48)
    with pytest.raises(ValueError, match="more than 1 layers"):
        build_tiny_model("llama", num_layers=1)
    with pytest.raises(ValueError, match="unknown compute 'int4'"):
        server_model(build_tiny_model("llama", num_layers=2, massive=False), "int4")


# ----------------------------------------------------------------------------------- pipelines


def test_trainer_and_cached_engine_rows_agree_to_fp32_noise(tm: TinyModel, seqs: list[list[int]]) -> None:
    names = tm.state_names()  # every state as a segment: hooks, caches and MoE are all exercised
    trainer = _rows(run_trainer(tm, DraftHead(tm.hidden_size, len(names)), seqs, names, keep_inputs=True))
    engine = _rows(
        run_engine(tm, DraftHead(tm.hidden_size, len(names)), seqs, names, chunk_size=11, keep_inputs=True),
        ENGINE_RID_BASE,
    )
    assert engine.keys() == trainer.keys() and len(trainer) == sum(len(s) for s in seqs)
    worst = max(_rel_err(engine[k], trainer[k]) for k in trainer)
    assert worst < REL_TOL


def test_bf16_server_runs_both_pipelines_and_casts_the_fc_input(tm: TinyModel, seqs: list[list[int]]) -> None:
    server = server_model(tm, "bf16")
    states, _ = layer_states(server, torch.tensor(seqs[0]))
    assert all(v.dtype == torch.bfloat16 for v in states.values())
    layers = ["hs2", MID, DEEP]
    trainer = _rows(run_trainer(tm, DraftHead(tm.hidden_size, 3), seqs[:2], layers, keep_inputs=True))
    batches = run_engine(server, DraftHead(tm.hidden_size, 3), seqs[:2], layers, keep_inputs=True)
    assert all(b.fc_input is not None and b.fc_input.dtype == torch.float32 for b in batches)
    engine = _rows(batches, ENGINE_RID_BASE)
    assert engine.keys() == trainer.keys()
    assert all(_rel_err(engine[k], trainer[k]) < 0.03 for k in trainer)


def test_drafts_fed_by_the_same_engine_run_get_what_their_own_runs_give(tm: TinyModel, seqs: list[list[int]]) -> None:
    """``also``: other drafts reading other layers of the same engine steps get, row for row and label for
    label, what a run of their own gives (the deep fixtures record several layer choices from one run)."""
    server = server_model(tm, "bf16")
    first, second = ["hs2", MID, DEEP], [MID, DEEP, "hs2"]
    got: list[dict] = []
    seen: list[torch.Tensor] = []
    other = DraftHead(tm.hidden_size, 3)
    other.fc.register_forward_hook(lambda _m, args, _out: seen.append(args[0].clone()))
    shared = run_engine(server, DraftHead(tm.hidden_size, 3), seqs[:2], first, dtype=torch.bfloat16, chunk_size=11,
                        keep_inputs=True, also=[(other, second, got.append)])
    alone = run_engine(server, DraftHead(tm.hidden_size, 3), seqs[:2], first, dtype=torch.bfloat16, chunk_size=11,
                       keep_inputs=True)
    own = run_engine(server, DraftHead(tm.hidden_size, 3), seqs[:2], second, dtype=torch.bfloat16, chunk_size=11,
                     keep_inputs=True)
    assert other.fc.weight.dtype == torch.bfloat16
    assert len(shared) == len(alone) == len(own) == len(seen) == len(got)
    for a, b in zip(shared, alone, strict=True):
        assert torch.equal(a.fc_input, b.fc_input)
    for mine, labels, b in zip(seen, got, own, strict=True):
        assert torch.equal(mine, b.fc_input)
        assert labels.keys() == b.labels.keys()
        assert all(np.array_equal(labels[k], b.labels[k]) for k in ("seq", "position", "token_id", "next_token_id"))
        assert (labels["phase"], labels["step"]) == (b.labels["phase"], b.labels["step"])


# ------------------------------------------------------------------------ massive activations


def test_massive_dims_carry_100_to_1000x_the_median_on_every_token_after_the_injection(
    tm: TinyModel, trainer_states: dict[str, torch.Tensor]
) -> None:
    assert tm.massive is not None and len(tm.massive.dims) == 2 and tm.massive.layer == MASSIVE_LAYER
    for name in AFTER_INJECTION:
        h = trainer_states[name]
        median = h.abs().median()
        for d in tm.massive.dims:
            ratio = float(h[:, d].abs().mean() / median)
            assert 100 <= ratio <= 1000, (name, d, ratio)
            assert float((h[:, d].abs() > 50 * median).float().mean()) == 1.0, (name, d)
            # A large constant plus a small token-dependent part (a few %).
            assert 0.003 < float(h[:, d].std() / h[:, d].abs().mean()) < 0.1, (name, d)
    for name in [f"hs{i}" for i in range(MASSIVE_LAYER + 1)]:  # not there before the injection
        h = trainer_states[name]
        assert float(h.abs().mean(0).max() / h.abs().median()) < 15, name


def test_adjacent_layers_agree_at_raw_cosine_098_to_09995_only_through_the_massive_dims(
    tm: TinyModel, trainer_states: dict[str, torch.Tensor]
) -> None:
    rest = _rest(tm)
    for a, b in zip(AFTER_INJECTION, AFTER_INJECTION[1:], strict=False):
        ha, hb = trainer_states[a], trainer_states[b]
        raw = _mean_cos(ha, hb)
        assert 0.98 <= raw <= 0.9995, (a, b, raw)
        # Without the massive dims (and centred), the same two layers are clearly different.
        centred = _mean_cos(ha[:, rest] - ha[:, rest].mean(0), hb[:, rest] - hb[:, rest].mean(0))
        assert centred < 0.985, (a, b, centred)


# -------------------------------------------------------------------------------- server numerics


@pytest.fixture(scope="module")
def server_drift(
    tm: TinyModel, seqs: list[list[int]], trainer_states: dict[str, torch.Tensor]
) -> dict[tuple[str, str], tuple[float, float]]:
    """(relative L2 error, median per-token relative error) outside the massive dims of each server's
    states, at a mid and a deep layer."""
    rest = _rest(tm)
    drift = {}
    for compute in ("bf16", "fp8"):
        served = _states(server_model(tm, compute), seqs)
        for name in (MID, DEEP):
            got, ref = served[name][:, rest], trainer_states[name][:, rest]
            per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
            drift[compute, name] = (_rel_err(got, ref), float(per_token.median()))
    return drift


def test_bf16_server_drifts_under_two_percent_outside_the_massive_dims(
    tm: TinyModel, server_drift: dict[tuple[str, str], tuple[float, float]]
) -> None:
    for name in (MID, DEEP):
        total, typical = server_drift["bf16", name]
        assert 0.002 < typical < 0.02, (name, server_drift)
        # DeepSeek's MoE routes a few tokens differently under bf16 rounding, as real MoE servers
        # do; each moves that token's state by ~30% and dominates the total, not the typical token.
        if tm.arch != "deepseek_v3":
            assert 0.002 < total < 0.02, (name, server_drift)


def test_fp8_server_drifts_several_percent_and_over_3x_bf16(
    server_drift: dict[tuple[str, str], tuple[float, float]],
) -> None:
    for name in (MID, DEEP):
        total, typical = server_drift["fp8", name]
        assert 0.025 < typical < 0.1 and total < 0.12, (name, server_drift)
        assert typical > 3 * server_drift["bf16", name][1], (name, server_drift)


def test_server_model_leaves_the_original_untouched(tm: TinyModel, seqs: list[list[int]]) -> None:
    before = {k: v.clone() for k, v in tm.model.state_dict().items()}
    ids = torch.tensor(seqs[0])
    reference, _ = layer_states(tm, ids)
    servers: dict[str, Any] = {c: server_model(tm, c) for c in ("fp32", "bf16", "fp8")}
    assert all(torch.equal(v, before[k]) for k, v in tm.model.state_dict().items())
    assert tm.dtype == torch.float32 and tm.compute == "fp32"
    after, _ = layer_states(tm, ids)
    assert all(torch.equal(after[k], reference[k]) for k in reference)
    # The copies carry the massive-activation hooks and say what they are.
    fp32, _ = layer_states(servers["fp32"], ids)
    assert all(torch.equal(fp32[k], reference[k]) for k in reference)
    for compute, server in servers.items():
        assert server.compute == compute and server.massive == tm.massive and server.model is not tm.model
    # fp8 rounds the decoder projection weights (~3% rms), never the embedding.
    bf16, fp8 = servers["bf16"].model.state_dict(), servers["fp8"].model.state_dict()
    assert torch.equal(bf16["model.embed_tokens.weight"], fp8["model.embed_tokens.weight"])
    key = "model.layers.0.mlp.down_proj.weight"
    assert fp8[key].dtype == torch.bfloat16
    assert 0.01 < _rel_err(fp8[key], before[key]) < 0.06 and _rel_err(bf16[key], before[key]) < 0.005
