"""No false alarm on real trainer and dataset layouts: packed rows, multi-turn prefixes, imported data.

Correct pairs of traces (same layers, same weights; the reference an fp32 trainer, the candidate a
bf16 engine) laid out as trainers and datasets really lay them out:

* a trainer packing 2-4 samples into one batch row (varlen attention: positions restart at each
  sample, the recorder's sequence key is the packed row), with and without padding rows between;
* a multi-turn chat dataset whose earlier turns are whole prefixes of later samples, imported from
  speculators' offline files (``hs_<i>.safetensors``: the importer keeps rows 0..T-2 of each sample)
  against a server with a radix cache (a later turn records only the rows after its cached prefix);
* a server recording position T-1 of every sequence, which the trainer's store lacks.

Each is a match with coverage information only; a real chunked-prefill pairing bug and a real
insertion on the same data are still found.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import tracediff
from tracediff.compare import compare_stores
from tracediff.importers import import_speculators
from tracediff.testing.models import build_tiny_model, server_model
from tracediff.testing.pipelines import run_engine, run_packed_trainer, run_trainer
from tracediff.testing.tiny_llama import DraftHead, layer_states, make_sequences, select

# Slow (-m "not slow" leaves it out; CI runs it): packed, multi-turn and imported layouts recorded: 1+ min of fixture on two cores.
pytestmark = pytest.mark.slow

LAYERS = ["hs2", "hs4", "hs6"]
H = 64
CHUNK = 7


def kinds(report, severity: str | None = None) -> set[str]:
    return {f.kind for f in report.findings if severity is None or f.severity == severity}


def messages(report) -> list[str]:
    return [f"{f.severity} {f.kind}: {f.message}" for f in report.findings]


def coverage(report):
    return next(f for f in report.findings if f.kind == "coverage")


#: What each side records of its aux layers: the trainer in HF numbering, the server in SGLang's.
TRAINER_META = {"aux_layers": {"ids": [2, 4, 6], "convention": "capture"}, "num_hidden_layers": 8}
SERVER_META = {"aux_layers": {"ids": [1, 3, 5], "convention": "sglang", "framework": "sglang",
                              "field": "eagle_config.eagle_aux_hidden_state_layer_ids"}, "num_hidden_layers": 8}


def _record(path: Path, runner, model, seqs, dtype, relabel=None, **kw) -> Path:
    draft = DraftHead(H, len(LAYERS))
    meta = TRAINER_META if dtype == torch.float32 else SERVER_META
    with tracediff.record(path, role=path.stem, meta=meta, on_full="block") as rec:
        rec.tap(draft.fc, "fc_in", segment_size=H)
        runner(model, draft, seqs, LAYERS, dtype=dtype,
               on_batch=lambda lab: rec.labels(**(relabel(lab) if relabel else lab)), **kw)
    assert rec.error is None
    return path


def _conversations(n: int, seed: int) -> list[list[int]]:
    """Multi-turn samples: every conversation appears as its first turn and as first + second turn,
    so the first sample is a whole prefix of the second."""
    turns = make_sequences(n_seqs=2 * n, min_len=10, max_len=20, seed=seed)
    out = []
    for c in range(n):
        out.append(list(turns[2 * c]))
        out.append(list(turns[2 * c]) + list(turns[2 * c + 1]))
    return out


def _speculators_files(model, seqs, folder: Path) -> Path:
    """speculators' offline data layout: ``hs_<i>.safetensors`` with ``hidden_states [T, 4, H]`` (the
    three aux layers, then the last layer) and ``token_ids [T]``, computed by the fp32 target."""
    folder.mkdir()
    for i, seq in enumerate(seqs):
        states, _ = layer_states(model, torch.tensor(seq))
        slots = torch.stack([states[n][0] for n in [*LAYERS, "pre_norm"]], dim=1).to(torch.bfloat16)
        save_file({"hidden_states": slots.contiguous(), "token_ids": torch.tensor(seq)},
                  str(folder / f"hs_{i}.safetensors"))
    return folder


def _radix_server(cached: dict[int, int]):
    """A server with a radix cache: request i's first ``cached[i]`` positions were computed by an
    earlier request and are not run again, so they record no rows. One request per prefill step."""

    @torch.no_grad()
    def run(tl, draft, seqs, layers, *, dtype, on_batch):
        draft.to(dtype)
        for i, seq in enumerate(seqs):
            start = cached.get(i, 0)
            states, _ = layer_states(tl, torch.tensor(seq))
            x = select(states, layers)[:, start:].to(dtype)
            pos = np.arange(start, len(seq))
            tokens = np.asarray(seq)
            on_batch({"seq": np.full(pos.size, 1000 + i), "position": pos, "token_id": tokens[pos],
                      "next_token_id": np.where(pos + 1 < len(seq), tokens[np.minimum(pos + 1, len(seq) - 1)], -1),
                      "phase": "prefill", "step": i})
            draft(x)

    return run


def _wrong_next_token_at_chunk_ends(labels: dict) -> dict:
    """The chunked-prefill bug: the last row of each request's prefill chunk is paired with another
    token (as if the sampled one) than the next prompt token."""
    if labels["phase"] != "prefill":
        return labels
    labels = dict(labels)
    seq, pos, nxt = labels["seq"], labels["position"], labels["next_token_id"]
    last = np.zeros(seq.size, dtype=bool)
    for s in np.unique(seq).tolist():
        rows = np.flatnonzero(seq == s)
        last[rows[np.argmax(pos[rows])]] = True
    labels["next_token_id"] = np.where(last & (nxt >= 0), (nxt + 1) % 512, nxt)
    return labels


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    trainer = build_tiny_model("qwen3", hidden_size=H, num_layers=8)
    bf16 = server_model(trainer, "bf16")
    out: dict = {}
    # Packed rows: 12 samples, 2-4 to a row.
    seqs = make_sequences(n_seqs=12, min_len=10, max_len=30, seed=4)
    out["packed"] = _record(root / "packed.zarr", run_packed_trainer, trainer, seqs, torch.float32,
                            samples_per_row=[2, 3, 4])
    out["packed_padded"] = _record(root / "packed_padded.zarr", run_packed_trainer, trainer, seqs, torch.float32,
                                   samples_per_row=[4, 2, 3], pad_between=3)
    out["engine"] = _record(root / "engine.zarr", run_engine, bf16, seqs, torch.bfloat16, max_running=3)
    out["packed_samples"] = len(seqs)
    # Multi-turn: imported offline data against a radix-cached server.
    conv = _conversations(4, seed=8)
    out["imported"] = root / "imported.zarr"
    import_speculators(_speculators_files(trainer, conv, root / "hs"), out["imported"], layer_ids=[2, 4, 6])
    cached = {i: len(conv[i - 1]) for i in range(1, len(conv), 2)}  # turn 2 reuses turn 1's positions
    out["radix"] = _record(root / "radix.zarr", _radix_server(cached), bf16, conv, torch.bfloat16)
    out["chunked"] = _record(root / "chunked.zarr", run_engine, bf16, conv, torch.bfloat16, max_running=2,
                             chunk_size=CHUNK)
    out["chunked_bug"] = _record(root / "chunked_bug.zarr", run_engine, bf16, conv, torch.bfloat16, max_running=2,
                                 chunk_size=CHUNK, relabel=_wrong_next_token_at_chunk_ends)
    # Sequences that end on a run of one token (padding, repeated EOS): the server's row T-1 agrees
    # with an earlier reference row under other deltas too.
    ending = [list(s) + [3] * 10 for s in make_sequences(n_seqs=6, min_len=10, max_len=30, seed=6)]
    out["ending_ref"] = _record(root / "ending_ref.zarr", _drop_last_rows, trainer, ending, torch.float32)
    out["ending_server"] = _record(root / "ending_server.zarr", run_engine, bf16, ending, torch.bfloat16,
                                   max_running=3)
    inserted = [s[:8] + [77, 78] + s[8:] for s in ending]
    # The insertion is in the prompt (a template's tokens): a real engine's decode rows hold what it generated,
    # where other tokens are a generation that diverged, not an insertion (compare/align/rowpairs.py).
    out["ending_inserted"] = _record(root / "ending_inserted.zarr", run_engine, bf16, inserted, torch.bfloat16,
                                     max_running=3, prefill_len=lambda i, s: max(12, len(s) // 2))
    out["ending_sequences"] = len(ending)
    return out


@torch.no_grad()
def _drop_last_rows(tl, draft, seqs, layers, *, dtype, on_batch):
    """A trainer (or an importer) that keeps rows 0..T-2 of each sample: the last row has no next
    token to train on."""
    def without_last(lab: dict) -> dict:
        return {k: v[:-1] if isinstance(v, np.ndarray) else v for k, v in lab.items()}

    run_trainer(tl, draft, seqs, layers, dtype=dtype, on_batch=lambda lab: on_batch(without_last(lab)),
                transform=lambda x, states: x[:, :-1])


@pytest.mark.parametrize("reference", ["packed", "packed_padded"])
def test_a_packed_trainer_is_a_match_with_each_sample_aligned(layouts, reference):
    report = compare_stores(layouts[reference], layouts["engine"])
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set() and kinds(report, "error") == set(), messages(report)
    assert report.plan.sequences_aligned == layouts["packed_samples"]
    assert report.plan.pairs == report.reference.valid_rows  # every sample's rows, once
    assert report.plan.candidate_rows_duplicate == 0 and report.plan.token_pairing["mismatched"] == 0
    # The packed rows were split into their samples, and the report says so.
    assert report.plan.sequences_split["reference"] == 4
    assert "split into its samples" in coverage(report).message


def test_packed_rows_on_the_candidate_side_are_split_too(layouts):
    report = compare_stores(layouts["engine"], layouts["packed_padded"])
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)
    assert report.plan.sequences_split == {"reference": 0, "candidate": 4}
    assert report.plan.candidate_rows_duplicate == 0


def test_multi_turn_data_against_a_radix_cached_server_is_a_match_with_coverage_only(layouts):
    report = compare_stores(layouts["imported"], layouts["radix"])
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)
    assert {f.kind for f in report.findings if f.kind not in ("dtype", "config")} <= {"coverage"}, messages(report)
    # Each server row is paired once, with its own sample: no duplicates, nothing flagged.
    assert report.plan.candidate_rows_duplicate == 0
    pairing = report.plan.token_pairing
    assert pairing["mismatched"] == 0 and pairing["compared"] > 0


def test_multi_turn_data_against_a_chunked_server_pairs_each_request_with_its_own_sample(layouts):
    report = compare_stores(layouts["imported"], layouts["chunked"])
    assert report.verdict == "match", messages(report)
    assert kinds(report, "warning") == set(), messages(report)
    assert report.plan.candidate_rows_duplicate == 0
    assert report.plan.reference_rows_uncovered == 0  # the first turns' own samples are covered too
    # The server's last row of each request (position T-1) is past the importer's rows: trailing.
    assert report.plan.candidate_rows_trailing == report.plan.sequences_candidate
    assert "extra trailing rows" in coverage(report).message
    assert report.plan.token_pairing["diverging"] > 0 and report.plan.token_pairing["mismatched"] == 0


def test_a_real_chunked_prefill_pairing_bug_on_multi_turn_data_is_still_found(layouts):
    report = compare_stores(layouts["imported"], layouts["chunked_bug"])
    finding = next((f for f in report.findings if f.kind == "token_pairing"), None)
    assert finding is not None and finding.severity == "error", messages(report)
    assert finding.evidence["pattern"]["pattern"] == "chunk_end", finding.message
    assert "non-final prefill chunk" in finding.message
    # Only the bug's rows: the requests' last rows, where the samples diverge, are not compared.
    assert finding.evidence["rows"] == report.plan.token_pairing["mismatched"] > 0


def test_a_server_row_past_the_trainers_last_row_is_coverage_not_an_insertion(layouts):
    report = compare_stores(layouts["ending_ref"], layouts["ending_server"])
    assert report.verdict == "match", messages(report)
    assert not kinds(report) & {"sequence_insertion", "token_pairing"}, messages(report)
    assert report.plan.candidate_rows_duplicate == 0
    assert report.plan.candidate_rows_trailing == layouts["ending_sequences"]
    assert report.plan.reference_rows_uncovered == 0


def test_a_real_insertion_mid_sequence_is_still_an_insertion(layouts):
    report = compare_stores(layouts["ending_ref"], layouts["ending_inserted"])
    found = [f for f in report.findings if f.kind == "sequence_insertion"]
    assert found and found[0].severity == "error", messages(report)
    assert found[0].evidence["sequences"] == layouts["ending_sequences"]

