"""The draft chain (issue #53; docs/draft-chain.md): `record --draft-chain` taps the draft's forward
in order, and compare names the first tap that diverges beyond numerics.

Real parts: speculators' own ``Eagle3DraftModel`` built from a tiny config, its real forward (two TTT
steps) on batches from speculators' own reader and collate function, tracediff's recorder writing
real stores through the speculators adapter, the real compare. Each candidate differs from the
reference draft in one thing a server can get wrong (the final norm's epsilon or weight, RoPE theta,
a sliding window ignored, the embedding, the lm_head, the d2t map, the hidden state recycled between
steps); the test checks the chain's root cause is the tap where that thing first acts, that every
earlier tap matches, and that a clean pair matches at every tap.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, skip_unless_installed

skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402

from tracediff.adapters import speculators as speculators_adapter  # noqa: E402
from tracediff.compare import compare_stores  # noqa: E402
from tracediff.record.recorder import Recorder  # noqa: E402

TESTS = Path(__file__).resolve().parent
WINDOW = 3  # a sliding window shorter than every packed document (7-12 tokens)


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("speculators_data")
    tr.write_speculators_data(folder)
    return [{k: v for k, v in b.items() if k != "verifier_last_hidden_states"} for b in tr.speculators_batches(folder)]


def record_draft(path: Path, batches: list[dict[str, Any]], change: Callable[[torch.nn.Module], Any] | None = None,
                 steps: int = 2, **layer_config: Any) -> Path:
    """One draft (seed 0: the same weights each time), ``change`` applied, recorded with its chain
    over ``steps`` TTT steps of its own forward."""
    model = tr.build_speculators_draft(seed=0, vocab_size=2 * tr.VOCAB, **layer_config)
    d2t = _d2t_offsets()
    t2d = torch.zeros(2 * tr.VOCAB, dtype=torch.bool)
    t2d[d2t + torch.arange(tr.VOCAB)] = True
    model.load_vocab_mappings(t2d, d2t)
    _trained_attention(model)
    if change is not None:
        change(model)
    model.eval()
    with Recorder(path, draft_chain=True) as rec:
        assert speculators_adapter.attach(rec, model)
        with torch.no_grad():
            for batch in batches:
                model(**batch, ttt_steps=steps)
    return path


def _trained_attention(model: torch.nn.Module) -> None:
    """Attention projections at the scale a trained draft's have: at speculators' 0.02 init the
    attention output is ~1e-4 of the residual, and nothing done to positions would show."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.layers[0].self_attn.named_parameters():
            if name.endswith("weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / math.sqrt(param.shape[1]))


def _d2t_offsets() -> torch.Tensor:
    """A draft vocabulary that is a sorted subset of a target vocabulary twice its size, as offsets
    (``target = draft + d2t[draft]``, speculators' and SGLang's convention)."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randperm(2 * tr.VOCAB, generator=gen)[: tr.VOCAB].sort().values
    return target - torch.arange(tr.VOCAB)


def _other_checkpoint(param: torch.nn.Parameter) -> None:
    """The same tensor from another training run: a fresh draw at the same scale."""
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=gen) * param.float().std().clamp(min=0.02))


def _rope_theta_times_ten(model: torch.nn.Module) -> None:
    """RoPE theta 10x the draft's (inv_freq_i = theta^(-2i/d), so inv_freq ** log_theta(10 theta))."""
    rope = model.rotary_emb
    theta = rope.config.rope_parameters["rope_theta"] if hasattr(rope.config, "rope_parameters") else rope.config.rope_theta
    power = math.log(10 * theta) / math.log(theta)
    rope.inv_freq = rope.inv_freq ** power
    rope.original_inv_freq = rope.inv_freq


def _ignore_sliding_window(model: torch.nn.Module) -> None:
    """The window the draft's config names, ignored: every layer attends to the whole document."""
    assert model.sliding_window_indices, "the reference must use its sliding window"
    model.sliding_window_indices = []
    model.uses_sliding_window_attn = False
    model.uses_full_attn = True


def _d2t_as_absolute(model: torch.nn.Module) -> None:
    """The d2t map stored as absolute target ids where the reader expects offsets."""
    with torch.no_grad():
        model.d2t.copy_(model.d2t + torch.arange(tr.VOCAB))


def _recycle_fc_output(model: torch.nn.Module) -> None:
    """From step 1 on, the decoder layer gets the fc output again (the hidden state of the wrong
    step) in place of the previous step's layer output: its second half is replaced."""
    state: dict[str, Any] = {}

    def keep_fc(_m: torch.nn.Module, _a: tuple, out: torch.Tensor) -> None:
        state["fc"], state["calls"] = out, 0

    def feed_wrong(_m: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        state["calls"] += 1
        if state["calls"] == 1:
            return None
        hidden = args[0]
        return (torch.cat([hidden[..., : tr.HIDDEN], state["fc"]], dim=-1), *args[1:]), kwargs

    model.fc.register_forward_hook(keep_fc)
    model.layers[0].register_forward_pre_hook(feed_wrong, with_kwargs=True)


def _scale_norm_weight(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.norm.weight.mul_(1 + 0.1 * torch.randn(model.norm.weight.shape, generator=gen))


SLIDING = {"layer_types": ["sliding_attention"], "sliding_window": WINDOW}

#: (case, what the candidate changes, layer config of both sides, the tap that must be named)
CASES = [
    # An epsilon shows only where it is not small against the norm input's mean square (about 11 here):
    # 1e-6 against 1e-5 is a match at every tap, as it should be; 1.0 (a config field mixed up) is not.
    ("final norm epsilon", lambda m: setattr(m.norm, "variance_epsilon", 1.0), {}, "draft_norm_out"),
    ("final norm weight", _scale_norm_weight, {}, "draft_norm_out"),
    ("RoPE theta", _rope_theta_times_ten, {}, "draft_layer_out"),
    ("sliding window ignored", _ignore_sliding_window, SLIDING, "draft_layer_out"),
    ("embedding of another checkpoint", lambda m: _other_checkpoint(m.embed_tokens.weight), {}, "draft_layer_in"),
    ("lm_head of another checkpoint", lambda m: _other_checkpoint(m.lm_head.weight), {}, "draft_logits_topk"),
    ("d2t read as absolute ids", _d2t_as_absolute, {}, "draft_logits_topk"),
    ("hidden state recycled from the wrong step", _recycle_fc_output, {}, "draft_layer_in_s1"),
]


def _chain(report: Any) -> dict[str, dict[str, Any]]:
    return {link["tap_candidate"]: link for link in report.chain or []}


def test_records_every_tap_of_the_forward_in_order_with_its_step(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    from tracediff.store import open_store  # noqa: PLC0415

    store = open_store(record_draft(tmp_path / "a.zarr", batches))
    chain = {}
    for tap in store.taps:
        chain[tap] = store.tap_streams(tap)[0].attrs["chain"]
    ordered = sorted(chain, key=lambda t: (chain[t]["step"], chain[t]["order"]))
    assert ordered == ["fc_in", "draft_fc_out", "draft_layer_in", "draft_layer_out", "draft_norm_out",
                       "draft_logits_topk", "draft_layer_in_s1", "draft_layer_out_s1", "draft_norm_out_s1",
                       "draft_logits_topk_s1"]
    rows = {store.rows(t) for t in store.taps}
    assert len(rows) == 1  # every tap holds one row per fc row: the same forward, the same labels
    assert store.tap_streams("draft_layer_in")[0].width == 2 * tr.HIDDEN  # cat(embedding, hidden state)
    assert store.tap_streams("draft_logits_topk")[0].width == 3 * 8  # values, draft ids, target ids of the top 8


def test_clean_pair_matches_at_every_tap(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    a, b = record_draft(tmp_path / "a.zarr", batches), record_draft(tmp_path / "b.zarr", batches)
    report = compare_stores(a, b)
    assert report.verdict == "match"
    assert len(report.chain) == 10
    assert {link["status"] for link in report.chain} == {"match"}
    assert not [f for f in report.findings if f.kind == "draft_chain"]
    from tracediff.report.markdown import render_markdown  # noqa: PLC0415
    from tracediff.report.text import render_text  # noqa: PLC0415

    text = render_text(report)
    assert "Draft chain" in text and "draft_logits_topk_s1" in text
    assert "| draft\\_layer\\_out | 0 | match |" in render_markdown(report)
    from tracediff.report.html import render_html  # noqa: PLC0415

    assert '<section id="chain">' in render_html(report)
    assert "not_comparable" not in text  # two trainers: every step pairs


def test_a_trainer_chain_records_teacher_forced_steps_that_pair_only_with_teacher_forced_ones(
        tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    from tracediff.compare.chain import chain_taps, step_inputs_differ  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    taps = chain_taps(open_store(record_draft(tmp_path / "a.zarr", batches)))
    assert {chain["step_inputs"] for _, chain in taps.values()} == {"teacher_forced"}
    (_, step1), (_, step0) = taps[(1, 3)], taps[(0, 3)]
    server = dict(step1, step_inputs="proposed")  # what the vLLM adapter records (tests/test_vllm_chain_live.py)
    assert step_inputs_differ(1, step1, server) == ("step 1 of the candidate reads its own proposals, of the "
                                                    "reference the data's tokens: only step 0 pairs")
    assert step_inputs_differ(1, server, step1).startswith("step 1 of the reference reads its own proposals")
    assert step_inputs_differ(0, step0, dict(step0, step_inputs="proposed")) is None  # step 0 always pairs
    older = {k: v for k, v in step1.items() if k != "step_inputs"}  # stores from before the attribute
    assert step_inputs_differ(1, older, step1) is None and step_inputs_differ(1, server, server) is None


@pytest.mark.parametrize(("case", "change", "layer_config", "tap"), CASES, ids=[c[0] for c in CASES])
def test_names_the_first_divergent_tap(tmp_path: Path, batches: list[dict[str, Any]], case: str,
                                       change: Callable[[torch.nn.Module], Any], layer_config: dict[str, Any],
                                       tap: str) -> None:
    reference = record_draft(tmp_path / "train.zarr", batches, **layer_config)
    candidate = record_draft(tmp_path / "server.zarr", batches, change, **layer_config)
    report = compare_stores(reference, candidate)
    assert report.verdict == "mismatch", case
    chain = _chain(report)
    root = [f for f in report.findings if f.kind == "draft_chain" and not f.evidence.get("explained_by")]
    assert [f.evidence["tap_candidate"] for f in root] == [tap], (case, {t: x["status"] for t, x in chain.items()})
    order = [link["tap_candidate"] for link in report.chain]
    before = order[: order.index(tap)]
    assert all(chain[t]["status"] == "match" for t in before), {t: chain[t] for t in before}
    assert root[0].evidence["matched_before"] == before
    for link in report.chain[order.index(tap) + 1:]:  # every later divergence follows from the root
        assert link["status"] == "match" or link["explained_by"] == tap
    cause = report.causes()[0]
    assert report.findings[cause.finding].kind == "draft_chain"
    assert tap in report.findings[cause.finding].summary


def test_d2t_read_as_absolute_ids_is_named_as_the_d2t_map(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    a = record_draft(tmp_path / "a.zarr", batches)
    b = record_draft(tmp_path / "b.zarr", batches, _d2t_as_absolute)
    link = _chain(compare_stores(a, b))["draft_logits_topk"]
    assert link["metrics"]["draft_top1_agreement"] == 1.0
    assert link["metrics"]["target_top1_agreement"] < 1.0
    assert "d2t map" in link["found"][0]


def test_stores_without_a_chain_report_no_chain(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    model = tr.build_speculators_draft(seed=0)
    model.eval()
    paths = []
    for name in ("a.zarr", "b.zarr"):
        with Recorder(tmp_path / name) as rec:
            speculators_adapter.attach(rec, model)
            with torch.no_grad():
                model(**batches[0], ttt_steps=2)
        paths.append(tmp_path / name)
    report = compare_stores(*paths)
    assert report.chain is None
    assert "chain" not in json.loads(report.to_json())


@pytest.mark.slow
def test_record_draft_chain_and_compare_as_a_user_types_them(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    """`tracediff record --adapter speculators --draft-chain -- python run.py` twice (the second run's
    final norm epsilon differs), then `tracediff compare`: exit 1, the root cause names the tap."""
    data = tmp_path / "data"
    tr.write_speculators_data(data)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        import trainer_runs as tr
        model = tr.build_speculators_draft(seed=0)
        if sys.argv[1] == "eps":
            model.norm.variance_epsilon = 1.0
        model.eval()
        with torch.no_grad():
            for batch in tr.speculators_batches(__import__("pathlib").Path({str(data)!r})):
                batch.pop("verifier_last_hidden_states")
                model(**batch, ttt_steps=2)
    """))
    env = cli_env()
    for name, arg in (("train.zarr", "same"), ("server.zarr", "eps")):
        done = subprocess.run([sys.executable, "-m", "tracediff", "record", "--adapter", "speculators", "--draft-chain",
                               "-o", str(tmp_path / name), "--", sys.executable, str(script), arg],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(tmp_path / "train.zarr"),
                           str(tmp_path / "server.zarr"), "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    assert "the draft diverges first at draft_norm_out" in done.stdout
    assert "Draft chain (each tap of the draft's forward, in order)" in done.stdout


def test_an_epsilon_below_numerics_is_a_match_at_every_tap(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    """1e-5 in place of 1e-6 moves the final norm's output by ~1e-7 relative at this input's scale:
    no tap may call that a divergence."""
    a = record_draft(tmp_path / "a.zarr", batches)
    b = record_draft(tmp_path / "b.zarr", batches, lambda m: setattr(m.norm, "variance_epsilon", 1e-5))
    report = compare_stores(a, b)
    assert report.verdict == "match"
    assert {link["status"] for link in report.chain} == {"match"}


@pytest.mark.slow
def test_specforge_draft_chain_names_the_final_norm(tmp_path: Path) -> None:
    """SpecForge's own LlamaForCausalLMEagle3 trained through OnlineEagle3Model (bf16, two TTT
    steps, its own offline reader): a clean pair matches at every tap; a final norm weight of
    another checkpoint is named at draft_norm_out, with the logits downstream of it."""
    skip_unless_installed("specforge", reason="specforge is not installed (requirements/frameworks-trainers.sh)")
    from specforge.runtime.contracts import TrainBatch  # noqa: PLC0415

    from tracediff.adapters import specforge as specforge_adapter  # noqa: PLC0415

    data = tmp_path / "data"
    tr.write_specforge_data(data)
    batches = tr.specforge_batches(data)

    def record(name: str, change: Callable[[torch.nn.Module], Any] | None = None) -> Path:
        strategy, model, draft = tr.build_specforge(data, seed=0)
        if change is not None:
            change(draft)
        with Recorder(tmp_path / name, draft_chain=True) as rec:
            assert specforge_adapter.attach(rec, model)
            with torch.no_grad():
                for i, batch in enumerate(batches):
                    strategy.forward_loss(TrainBatch([f"s{i}"], "eagle3", batch, {"target_repr": "hidden_state"}))
        return tmp_path / name

    def other_norm_weight(draft: torch.nn.Module) -> None:
        gen = torch.Generator().manual_seed(5)
        noise = 1 + 0.5 * torch.randn(draft.norm.weight.shape, generator=gen)
        with torch.no_grad():
            draft.norm.weight.mul_(noise.to(draft.norm.weight.dtype))

    reference, clean, changed = record("train.zarr"), record("clean.zarr"), record("norm.zarr", other_norm_weight)
    report = compare_stores(reference, clean)
    assert report.verdict == "match" and len(report.chain) == 10
    assert {link["status"] for link in report.chain} == {"match"}
    assert {link["metrics"].get("compute_dtype") for link in report.chain[1:5]} == {"bfloat16"}  # as SpecForge trains
    report = compare_stores(reference, changed)
    root = [f for f in report.findings if f.kind == "draft_chain" and not f.evidence.get("explained_by")]
    assert [f.evidence["tap_candidate"] for f in root] == ["draft_norm_out"]
    assert _chain(report)["draft_logits_topk"]["explained_by"] == "draft_norm_out"


def test_a_step_one_side_did_not_run_is_missing_not_a_divergence(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    """The candidate drafts one step, the reference two: the step-1 taps are 'missing' on one side;
    the taps both hold still match."""
    a = record_draft(tmp_path / "a.zarr", batches)
    b = record_draft(tmp_path / "b.zarr", batches, steps=1)
    report = compare_stores(a, b)
    status = {link["tap_reference"]: (link["status"], link["tap_candidate"]) for link in report.chain}
    assert status["draft_layer_out_s1"] == ("missing", "")
    assert status["draft_norm_out"] == ("match", "draft_norm_out")
    assert report.verdict == "match"


def test_an_fc_input_that_diverges_explains_the_whole_chain(tmp_path: Path, batches: list[dict[str, Any]]) -> None:
    """The candidate's aux hidden states in another slot order: the main report's root cause
    (segment_order) is the fc input's; every chain tap after it follows from it, no draft_chain root."""
    def rotate(batch: dict[str, Any]) -> dict[str, Any]:
        a, b, c = batch["hidden_states"].chunk(3, dim=-1)
        return {**batch, "hidden_states": torch.cat([b, c, a], dim=-1)}

    reference = record_draft(tmp_path / "a.zarr", batches)
    candidate = record_draft(tmp_path / "b.zarr", [rotate(b) for b in batches])
    report = compare_stores(reference, candidate)
    chain = _chain(report)
    assert chain["fc_in"]["status"] == "diverged"
    assert chain["draft_fc_out"]["status"] == "diverged" and chain["draft_fc_out"]["explained_by"] == "fc_in"
    roots = [report.findings[c.finding].kind for c in report.causes()]
    assert "draft_chain" not in roots and roots[0] == "segment_order"
    chained = [f for f in report.findings if f.kind == "draft_chain"]
    assert chained and {f.evidence["explained_by"] for f in chained} == {"segment_order"}


def test_draft_chain_without_an_adapter_that_taps_it_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tracediff", "record", "--adapter", "generic", "--draft-chain", "-o",
                           str(tmp_path / "x.zarr"), "--", sys.executable, "-c", "pass"],
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--draft-chain taps the draft of --adapter speculators, specforge, vllm or sglang" in done.stderr
    assert not (tmp_path / "x.zarr").exists()
