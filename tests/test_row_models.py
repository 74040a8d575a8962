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
