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
