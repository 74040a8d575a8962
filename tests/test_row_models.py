"""Row models as data (issue #52): what each slot of a draft-input row holds, recorded with the
store (the writer group's ``row_model``), read back by the strict reader, settable from the API
(``rec.tap(..., row_model=...)``) and from ``tracediff record --row-model``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import invoke_tracediff, run_tracediff

from tracediff.errors import CorruptStoreError, UsageError
from tracediff.record.recorder import Recorder
from tracediff.store import open_store
from tracediff.store.row_model import RowModel, Slot, eagle3, from_cli, from_json, mtp

HIDDEN = 8


# ------------------------------------------------------------------------------------- the contract
def test_mtp_row_model_names_its_slots():
    assert mtp().describe() == ["slot 0: embedding of the next token (enorm)",
                                "slot 1: the last layer's hidden state before the final norm (hnorm)"]
    assert mtp(final_norm=True, layer=61).describe()[1] == "slot 1: layer 61 hidden state after the final norm (hnorm)"
    assert mtp().slots[0].token_offset == 1 and mtp().slots[1].token_offset == 0


@pytest.mark.parametrize("model", [mtp(), mtp(final_norm=True, layer=4), eagle3([0, 3, 6, 9, "final_norm"]),
                                   RowModel("custom", (Slot("embedding", token_offset=2, draft_norm="enorm"),
                                                       Slot("hidden", 5)))])
def test_row_model_round_trips_through_json(model):
    assert from_json(json.loads(json.dumps(model.to_json()))) == model


def test_eagle3_has_one_hidden_slot_per_layer_before_the_final_norm_unless_named():
    model = eagle3([2, 16, 29, 30, 31])
    assert len(model.slots) == 5
    assert all(s.kind == "hidden" and not s.final_norm for s in model.slots)
    assert eagle3(["final_norm"]).slots[0].final_norm


@pytest.mark.parametrize(("stored", "field"), [
    ([], "row_model:"),
    ({"slots": [{"kind": "hidden"}]}, "row_model.name"),
    ({"name": "mtp", "slots": []}, "row_model.slots"),
    ({"name": "mtp", "slots": [{"kind": "hidden"}, {"kind": "residual"}]}, "row_model.slots[1].kind"),
    ({"name": "mtp", "slots": [{"kind": "hidden", "layer": -2}]}, "row_model.slots[0].layer"),
    ({"name": "mtp", "slots": [{"kind": "hidden", "final_norm": "yes"}]}, "row_model.slots[0].final_norm"),
    ({"name": "mtp", "slots": [{"kind": "embedding", "token_offset": 1.5}]}, "row_model.slots[0].token_offset"),
    ({"name": "mtp", "slots": [{"kind": "embedding", "draft_norm": 3}]}, "row_model.slots[0].draft_norm"),
    ({"name": "mtp", "slots": [{"kind": "embedding", "layer": 3}]}, "row_model.slots[0]:"),
])
def test_malformed_row_model_is_one_line_naming_the_field(stored, field):
    with pytest.raises(UsageError) as info:
        from_json(stored)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_cli_names_and_eagle3_needs_its_layers():
    assert from_cli("mtp") == mtp()
    assert from_cli("mtp-post-norm") == mtp(final_norm=True)
    assert from_cli("eagle3", [1, 3]) == eagle3([1, 3])
    with pytest.raises(UsageError, match="--aux-layers"):
        from_cli("eagle3")
    with pytest.raises(UsageError, match="mtp-post-norm"):
        from_cli("medusa")


# ------------------------------------------------------------------------------ recorded with a store
class _MtpHead(torch.nn.Module):
    """The shape of an MTP head's input projection: ``eh_proj(cat(enorm(e), hnorm(h)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.enorm = torch.nn.RMSNorm(HIDDEN)
        self.hnorm = torch.nn.RMSNorm(HIDDEN)
        self.eh_proj = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))


def test_tap_stores_the_row_model_and_the_reader_returns_it(tmp_path):
    head = _MtpHead()
    with Recorder(tmp_path / "s.zarr") as rec:
        rec.tap(head.eh_proj, "fc_in", row_model=mtp(final_norm=True))
        head(torch.randn(5, HIDDEN), torch.randn(5, HIDDEN))
    with open_store(tmp_path / "s.zarr") as store:
        (stream,) = store.tap_streams("fc_in")
        assert stream.row_model == mtp(final_norm=True)
        assert stream.segment_size == HIDDEN  # two slots: the row model says the segment size


def test_a_tap_without_a_row_model_stores_none(tmp_path):
    head = _MtpHead()
    with Recorder(tmp_path / "s.zarr") as rec:
        rec.tap(head.eh_proj, "fc_in")
        head(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    with open_store(tmp_path / "s.zarr") as store:
        assert store.tap_streams("fc_in")[0].row_model is None


def test_a_row_model_that_does_not_fit_the_width_is_left_out_with_a_warning(tmp_path, caplog):
    head = _MtpHead()
    with Recorder(tmp_path / "s.zarr") as rec:
        rec.tap(head.eh_proj, "fc_in", row_model=eagle3([1, 2, 3]))  # 3 slots in a 2 x 8 row
        head(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    assert "row_model names 3 slots" in caplog.text
    with open_store(tmp_path / "s.zarr") as store:
        assert store.tap_streams("fc_in")[0].row_model is None


def test_a_bad_row_model_is_refused_before_recording(tmp_path):
    with pytest.raises(UsageError, match=r"row_model.slots\[0\].kind"), Recorder(tmp_path / "s.zarr") as rec:
        rec.tap(_MtpHead().eh_proj, "fc_in", row_model={"name": "x", "slots": [{"kind": "cat"}]})


def test_reader_refuses_a_corrupt_row_model_naming_file_and_field(tmp_path):
    head = _MtpHead()
    with Recorder(tmp_path / "s.zarr") as rec:
        rec.tap(head.eh_proj, "fc_in", row_model=mtp())
        head(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    (doc_path,) = [p for p in (tmp_path / "s.zarr" / "fc_in").glob("*/zarr.json")]
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["row_model"]["slots"][1]["kind"] = "logits"
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError) as info:
        open_store(tmp_path / "s.zarr").tap_streams("fc_in")
    assert str(doc_path.name) in str(info.value) and "row_model.slots[1].kind" in str(info.value)


SCRIPT = textwrap.dedent(
    """
    import torch

    class MtpLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.eh_proj = torch.nn.Linear(16, 8, bias=False)

        def forward(self, x):
            return self.eh_proj(x)

    MtpLayer()(torch.randn(6, 16))
    """
)


def test_record_cli_row_model_mtp_is_stored(tmp_path: Path):
    (tmp_path / "mtp.py").write_text(SCRIPT)
    result = run_tracediff("record", "--tap", "MtpLayer.eh_proj:input", "--row-model", "mtp-post-norm",
                           "-o", str(tmp_path / "s.zarr"), "--", sys.executable, "mtp.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    with open_store(tmp_path / "s.zarr") as store:
        assert store.tap_streams("eh_proj_in")[0].row_model == mtp(final_norm=True)


def test_record_cli_row_model_eagle3_without_aux_layers_is_one_error_line(tmp_path: Path):
    (tmp_path / "mtp.py").write_text(SCRIPT)
    result = invoke_tracediff("record", "--tap", "MtpLayer.eh_proj:input", "--row-model", "eagle3",
                              "-o", str(tmp_path / "s.zarr"), "--", sys.executable, str(tmp_path / "mtp.py"))
    assert result.returncode == 2 and "--aux-layers" in result.stderr
    assert not (tmp_path / "s.zarr").exists()


# ------------------------------------------------------------- compare decides the new relations
# Real transformers models with massive activations (tracediff.testing.models), the MTP head built
# from the framework's own RMSNorm class, rows recorded with the recorder into real stores.
# Reference = what the draft was trained on; candidate = an engine with one fault, or none.
slow = pytest.mark.slow


def _kinds(report, severity: str | None = None) -> set[str]:
    return {f.kind for f in report.findings if severity is None or f.severity == severity}


def _one(report, kind: str):
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, [(f.kind, f.message) for f in report.findings]
    return found[0]


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def mtp_pair(request, tmp_path_factory):
    """A target with massive activations and the MTP reference (trained on h before the final norm)."""
    from row_model_traces import record_mtp  # noqa: PLC0415

    from tracediff.testing.models import build_tiny_model  # noqa: PLC0415
    from tracediff.testing.tiny_llama import make_sequences  # noqa: PLC0415

    root = tmp_path_factory.mktemp(f"mtp-{request.param}")
    model = build_tiny_model(request.param, hidden_size=64, num_layers=6)
    seqs = make_sequences(n_seqs=8, min_len=20, max_len=40, vocab_size=512, seed=3)
    return {"root": root, "model": model, "seqs": seqs, "ref": record_mtp(root / "ref.zarr", model, seqs, mtp())}


def _mtp(pair, name: str, row_model: RowModel, **fault) -> Path:
    from row_model_traces import record_mtp  # noqa: PLC0415

    return record_mtp(pair["root"] / f"{name}.zarr", pair["model"], pair["seqs"], row_model, **fault)


@slow
def test_clean_mtp_pair_is_a_match_without_warnings_and_names_its_slots(mtp_pair):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    report = compare_stores(mtp_pair["ref"], _mtp(mtp_pair, "clean", mtp()))
    assert report.verdict == "match" and _kinds(report, "warning") == set(), [f.message for f in report.findings]
    assert report.candidate.row_model["slots_text"] == mtp().describe()


@slow
def test_mtp_hidden_state_after_the_final_norm_is_a_final_norm_finding(mtp_pair):
    """The head's own hnorm absorbs the magnitude: the wrong input never looks broken by its norm."""
    from tracediff.compare import compare_stores  # noqa: PLC0415

    report = compare_stores(mtp_pair["ref"], _mtp(mtp_pair, "post", mtp(final_norm=True), post_norm=True))
    found = _one(report, "final_norm")
    assert found.severity == "error" and found.evidence["candidate_segment"] == 1
    assert found.evidence["transform"]["kind"] == "rmsnorm" and found.evidence["transform"]["side"] == "candidate"
    assert "before the target's final norm" in found.evidence["fix_line"]
    assert "slot 1: the last layer's hidden state before the final norm (hnorm)" in found.message
    assert _one(report, "row_model").severity == "warning"  # the stores say so too: named, not hidden
    assert not _kinds(report) & {"segment_missing", "segment_extra", "segment_scale"}


@slow
def test_mtp_trained_after_the_final_norm_fed_before_it_is_the_other_way_round(mtp_pair):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    ref = _mtp(mtp_pair, "ref-post", mtp(final_norm=True), post_norm=True)
    report = compare_stores(ref, _mtp(mtp_pair, "pre", mtp(final_norm=True)))  # mislabelled: the data decide
    found = _one(report, "final_norm")
    assert found.evidence["transform"]["side"] == "reference"
    assert "after the target's final norm" in found.evidence["fix_line"]


@slow
def test_mtp_embedding_of_the_rows_own_token_is_a_token_offset_of_that_slot(mtp_pair):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    report = compare_stores(mtp_pair["ref"], _mtp(mtp_pair, "offset", mtp(), embed_offset=0))
    found = _one(report, "slot_token_offset")
    assert found.evidence["candidate_segment"] == 0 and found.evidence["transform"]["params"]["offset"] == -1
    assert "embedding of the next token (enorm)" in found.message
    # the hidden slot pairs as it should; no wiring story about a missing slot
    assert not _kinds(report) & {"segment_missing", "segment_extra", "token_offset"}


EAGLE_LAYERS = ["hs0", "hs2", "hs4", "hs6", "pre_norm"]  # five slots; 8 layers: pre_norm = physical 8
EAGLE_PHYSICAL = [0, 2, 4, 6, 8]


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    """A Qwen3 target with massive activations; 16 sequences (~480 rows: enough to fit a 64 x 64
    rotation on half of them); the reference is a clean 5-slot EAGLE-3 fc input."""
    from row_model_traces import record_eagle3  # noqa: PLC0415

    from tracediff.testing.models import build_tiny_model  # noqa: PLC0415
    from tracediff.testing.tiny_llama import make_sequences  # noqa: PLC0415

    root = tmp_path_factory.mktemp("eagle5")
    model = build_tiny_model("qwen3", hidden_size=64, num_layers=8)
    seqs = make_sequences(n_seqs=16, min_len=20, max_len=40, vocab_size=512, seed=3)
    ref = record_eagle3(root / "ref.zarr", model, seqs, EAGLE_LAYERS, eagle3(EAGLE_PHYSICAL))
    return {"root": root, "model": model, "seqs": seqs, "ref": ref}


def _eagle(pair, name: str, layers=EAGLE_LAYERS, row_model=None, seqs=None, **fault) -> Path:
    from row_model_traces import record_eagle3  # noqa: PLC0415

    return record_eagle3(pair["root"] / f"{name}.zarr", pair["model"], seqs or pair["seqs"], layers,
                         row_model or eagle3(EAGLE_PHYSICAL), **fault)


@slow
def test_clean_five_slot_eagle3_pair_is_a_match_without_warnings(eagle):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    report = compare_stores(eagle["ref"], _eagle(eagle, "clean"))
    assert report.verdict == "match" and _kinds(report, "warning") == set(), [f.message for f in report.findings]
    assert [m.relation for m in report.segment_map] == ["same"] * 5


@slow
def test_rotated_target_is_a_rotation_on_every_slot_with_the_fold_fix(eagle):
    from row_model_traces import random_rotation  # noqa: PLC0415

    from tracediff.compare import compare_stores  # noqa: PLC0415

    report = compare_stores(eagle["ref"], _eagle(eagle, "rotated", rotation=random_rotation(64)))
    rotations = [f for f in report.findings if f.kind == "rotation"]
    assert sorted(f.evidence["candidate_segment"] for f in rotations) == [0, 1, 2, 3, 4]
    assert all("fold Q^T into the draft's fc" in f.evidence["fix_line"] for f in rotations)
    assert all(abs(f.evidence["norm_ratio_p50"] - 1) < 0.01 and abs(f.evidence["cos_mean"]) < 0.5 for f in rotations)
    assert not _kinds(report) & {"segment_missing", "segment_extra"}
    # One root cause, the rotated target; the other slots' rotations follow from it.
    (cause,) = [c for c in report.causes() if c.kind == "rotation"]
    assert len(cause.consequences) == 4


@slow
def test_rotated_on_both_sides_is_a_match_without_warnings(eagle):
    from row_model_traces import random_rotation  # noqa: PLC0415

    from tracediff.compare import compare_stores  # noqa: PLC0415

    q = random_rotation(64, seed=5)
    report = compare_stores(_eagle(eagle, "ref-rotated", rotation=q), _eagle(eagle, "cand-rotated", rotation=q))
    assert report.verdict == "match" and _kinds(report, "warning") == set(), [f.message for f in report.findings]


@slow
def test_a_sample_too_small_for_a_rotation_says_so_instead_of_guessing(eagle):
    from row_model_traces import random_rotation  # noqa: PLC0415

    from tracediff.compare import compare_stores  # noqa: PLC0415

    few = eagle["seqs"][:4]
    report = compare_stores(_eagle(eagle, "ref-few", seqs=few), _eagle(eagle, "rotated-few", seqs=few,
                                                                       rotation=random_rotation(64)))
    assert "rotation" not in _kinds(report)
    assert any("too few sample rows" in n and "rotated" in n for n in report.plan.notes), report.plan.notes


@slow
def test_gemma_style_embedding_scale_on_one_side_is_decided_by_the_norm_ratio(eagle):
    """Cosine 1.000000: only the fitted factor and the norm ratio see it."""
    from row_model_traces import gemma_scale  # noqa: PLC0415

    from tracediff.compare import compare_stores  # noqa: PLC0415

    def normaliser(states):
        return {**states, "hs0": states["hs0"] * gemma_scale(64)}

    report = compare_stores(eagle["ref"], _eagle(eagle, "gemma", fault=normaliser))
    found = _one(report, "embedding_scale")
    assert found.evidence["candidate_segment"] == 0 and found.evidence["cos_mean"] > 0.9999
    assert found.evidence["transform"]["params"]["factor"] == pytest.approx(gemma_scale(64), rel=1e-2)
    assert "sqrt(hidden_size)" in found.message and "fix_line" in found.evidence


@slow
def test_eagle3_slot_read_after_the_final_norm_is_a_final_norm_finding(eagle):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    layers = [*EAGLE_LAYERS[:4], "hs8"]  # HF's hidden_states[L]: after the final norm
    report = compare_stores(eagle["ref"], _eagle(eagle, "post", layers, eagle3([*EAGLE_PHYSICAL[:4], "final_norm"])))
    found = _one(report, "final_norm")
    assert found.evidence["candidate_segment"] == 4 and "before the target's final norm" in found.evidence["fix_line"]


@slow
def test_per_dimension_scale_on_one_slot_is_a_dimension_scale(eagle):
    from tracediff.compare import compare_stores  # noqa: PLC0415

    g = torch.Generator().manual_seed(7)
    w = 0.5 + 1.5 * torch.rand(64, generator=g)

    def weighted(states):
        return {**states, "hs4": states["hs4"] * w}

    report = compare_stores(eagle["ref"], _eagle(eagle, "diag", fault=weighted))
    found = _one(report, "dimension_scale")
    assert found.evidence["candidate_segment"] == 2


@slow
def test_compare_cli_names_the_slots_and_the_root_cause(mtp_pair, tmp_path):
    cand = _mtp(mtp_pair, "post-cli", mtp(final_norm=True), post_norm=True)
    result = run_tracediff("compare", mtp_pair["ref"], cand, "--json", tmp_path / "r.json")
    assert result.returncode == 1, result.stderr
    assert "row model: mtp: slot 0: embedding of the next token (enorm); slot 1:" in " ".join(result.stdout.split())
    kinds = {f["kind"] for f in json.loads((tmp_path / "r.json").read_text())["findings"]}
    assert "final_norm" in kinds


@slow
def test_target_final_norm_weight_names_the_final_norm_without_a_row_model(eagle, tmp_path):
    """No row model recorded: a norm on one side is a segment_scale as before; with the target's
    folder (--target) its own final norm weight, unfitted, makes the post-norm slot: the final norm."""
    from row_model_traces import record_eagle3  # noqa: PLC0415

    from tracediff.adapters.hf import final_norm_weight  # noqa: PLC0415
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415

    eagle["model"].model.save_pretrained(tmp_path / "target")
    layers = [*EAGLE_LAYERS[:4], "hs8"]
    ref = record_eagle3(tmp_path / "ref.zarr", eagle["model"], eagle["seqs"], EAGLE_LAYERS, None)
    cand = record_eagle3(tmp_path / "post.zarr", eagle["model"], eagle["seqs"], layers, None)
    assert "final_norm" not in _kinds(compare_stores(ref, cand))  # unchanged without --target
    report = compare_stores(ref, cand, CompareOptions(final_norm=final_norm_weight(tmp_path / "target")))
    found = _one(report, "final_norm")
    assert found.evidence["candidate_segment"] == 4 and "the target's final norm (its weight" in found.message
    assert found.evidence["transform"]["params"]["final_norm"]["matches"]
