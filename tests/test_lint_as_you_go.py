"""The light lint `record` and `import` run as they write (issue #51, item 3): a slot that is all zeros
is a warning in the end-of-run summary, naming the writer group and the slot; clean data says nothing.

Real runs: `tracediff record --tap ... -- python script.py` as a user types it, and `tracediff import
speculators` of files written with safetensors in speculators' layout.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import invoke_tracediff, run_tracediff
from safetensors.torch import save_file

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch


    class Head(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = torch.nn.Linear(3 * width, 4)

        def forward(self, x):
            return self.fc(x)


    width, zero_slot = int(sys.argv[1]), int(sys.argv[2])
    head = Head(width)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(40, 3 * width, generator=gen)
            if zero_slot >= 0:  # an extraction that never filled this slot
                x[:, zero_slot * width:(zero_slot + 1) * width] = 0
            head(x)
    """
)


@pytest.mark.parametrize("zero_slot", [1, -1])
def test_record_warns_of_a_slot_of_zero_rows_in_its_summary(tmp_path: Path, zero_slot: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    store = tmp_path / "s.zarr"
    result = run_tracediff("record", "--tap", "Head.fc:input", "--segment-size", 16, "--segment-labels",
                           "hs2,hs4,hs6", "-o", store, "--", sys.executable, script, 16, zero_slot, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "rows are all zeros" in line]
    if zero_slot < 0:
        assert warnings == []
    else:
        assert len(warnings) == 1, result.stderr
        assert warnings[0].startswith("tracediff: warning: fc_in/")
        assert "segment 1 (hs4): 120 of 120 rows are all zeros" in warnings[0]
        assert "tracediff lint" in warnings[0]


@pytest.mark.parametrize("zero_slot", [2, None])
def test_import_warns_of_a_slot_of_zero_rows_in_its_summary(tmp_path: Path, zero_slot: int | None) -> None:
    folder = tmp_path / "hidden_states"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i, length in enumerate((9, 12)):
        hs = torch.randn(length, 4, 16, generator=gen).to(torch.bfloat16)
        if zero_slot is not None:
            hs[:, zero_slot] = 0
        save_file({"hidden_states": hs, "token_ids": torch.arange(length)}, str(folder / f"hs_{i}.safetensors"))
    result = invoke_tracediff("import", "speculators", tmp_path, "-o", tmp_path / "s.zarr", "--layer-ids", "2,4,6")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "rows are all zeros" in line]
    if zero_slot is None:
        assert warnings == []
    else:
        assert warnings == ["tracediff: warning: bank: segment 2 (hs6): 21 of 21 rows are all zeros (a slot the "
                            "producer never filled?); check the data with tracediff lint"]
