"""identify, specified on the shipped samples and on traces freshly recorded from a tiny real Llama.

Every segment must be named as the layer it was built from (the label the recording gave it),
including the embedding, the final layer before the norm (what servers capture) and after it (HF's
``hidden_states[-1]``), with the ids each framework would need; a segment whose layer the bank does
not hold matches no layer; inputs that cannot be identified at all are a one-line error, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import invoke_tracediff

import tracediff
from tracediff.adapters import hf
from tracediff.compare.plan.identify import identify_segments, render_identification
from tracediff.demo import default_samples_dir
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, layer_states, make_sequences

SAMPLES = default_samples_dir()
H, L, SEED = 32, 6, 3  # the fresh model: smaller than the samples' (64, 8), so its bank differs in size too


def _record_bank(path: Path, num_layers: int, seqs: list[list[int]], *, weights_from=None) -> None:
    # A fresh model per bank: the hf adapter marks a model it attached to (one bank per model).
    tl = build_tiny_llama(hidden_size=H, num_layers=num_layers, seed=SEED)
    if weights_from is not None:  # the same checkpoint with fewer layers: the rest are unexpected keys
        tl.model.load_state_dict(weights_from.model.state_dict(), strict=False)
    with tracediff.record(path, role="bank", handle_sigterm=False) as rec:
        assert hf.attach(rec, tl.model)
        for seq in seqs:
            layer_states(tl, torch.tensor(seq))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Stores recorded once per module: name -> path. Labels are the bank's names of the layers used."""
    root = tmp_path_factory.mktemp("identify")
    tl = build_tiny_llama(hidden_size=H, num_layers=L, seed=SEED)
    other = build_tiny_llama(hidden_size=H, num_layers=L, seed=SEED + 100)
    seqs = make_sequences(n_seqs=3, min_len=8, max_len=16, seed=5)
    out = {name: root / f"{name}.zarr" for name in ("bank", "bank_short", "bank_other_seqs", "engine", "perm",
                                                    "foreign")}
    _record_bank(out["bank"], L, seqs)
    _record_bank(out["bank_short"], L - 2, seqs, weights_from=tl)
    _record_bank(out["bank_other_seqs"], L, make_sequences(n_seqs=2, min_len=8, max_len=12, seed=6))

    def record(name: str, runner, layers: list[str], labels: list[str], **kw) -> None:
        draft = DraftHead(H, len(layers))
        with tracediff.record(out[name], role=name, handle_sigterm=False) as rec:
            rec.tap(draft.fc, "fc_in", segment_size=H, segment_labels=labels)
            runner(tl, draft, seqs, layers, dtype=torch.bfloat16, on_batch=lambda lab: rec.labels(**lab), **kw)

    # Server-like: ragged prefill, then KV-cache decode, requests interleaved; both final-layer states.
    record("engine", run_engine, ["hs0", "hs3", "pre_norm", f"hs{L}"], ["hs0", "hs3", f"hs{L}_pre_norm", f"hs{L}"])
    record("perm", run_trainer, ["hs5", "hs1", "hs2"], ["hs5", "hs1", "hs2"])
    # Segment 1 is another model's hs3 on the same tokens (the trainer calls the draft once per sequence).
    foreign_states = iter([layer_states(other, torch.tensor(s))[0]["hs3"] for s in seqs])

    def swap_in_foreign(x: torch.Tensor, states) -> torch.Tensor:
        x = x.clone()
        x[..., H : 2 * H] = next(foreign_states).to(x.dtype)
        return x

    record("foreign", run_trainer, ["hs0", "hs3", "hs5"], ["hs0", "other_model_hs3", "hs5"],
           transform=swap_in_foreign)
    return out


def _named(ident) -> list[tuple[str, str | None]]:
    return [(s.verdict, s.best.label if s.best else None) for s in ident.segments]


# ------------------------------------------------------------------------------- shipped samples
@pytest.mark.parametrize(
    ("store", "labels", "kinds", "sglang", "vllm"),
    [
        ("train", ["hs0", "hs3", "hs6"], ["embedding", "layer", "layer"], [-1, 2, 5], [0, 3, 6]),
        ("server_broken", ["hs3", "hs6", "hs8_pre_norm"], ["layer", "layer", "pre_norm"], [2, 5, 7], [3, 6, 8]),
        ("server_fixed", ["hs0", "hs3", "hs6"], ["embedding", "layer", "layer"], [-1, 2, 5], [0, 3, 6]),
    ],
)
def test_names_every_segment_of_the_shipped_samples(store, labels, kinds, sglang, vllm):
    ident = identify_segments(SAMPLES / f"{store}.zarr", SAMPLES / "bank.zarr")
    assert [s.label for s in ident.segments] == labels  # what the recording says each segment is
    assert _named(ident) == [("match", label) for label in labels]
    assert [s.best.kind for s in ident.segments] == kinds
    assert [s.best.sglang_id for s in ident.segments] == sglang
    assert [s.best.vllm_id for s in ident.segments] == vllm
    assert ident.suggestions["sglang_eagle_config.eagle_aux_hidden_state_layer_ids"] == sglang
    assert ident.suggestions["vllm_eagle_aux_hidden_state_layer_ids"] == vllm
    assert ident.pairs == 192 and ident.label_offset == 0
    assert all(s.cosine > 0.9999 and s.margin > 100 for s in ident.segments)


def test_names_the_broken_servers_final_layer_as_captured_before_the_norm():
    ident = identify_segments(SAMPLES / "server_broken.zarr", SAMPLES / "bank.zarr")
    last = ident.segments[2]
    assert "before the final norm" in last.message
    # The post-norm state is the runner-up: close in direction, yet clearly told apart.
    assert last.runner_up.kind == "post_norm" and last.runner_up_cosine < 0.99
    assert any("pre-norm" in note for note in ident.notes)


# ------------------------------------------------------------------------------- fresh recordings
def test_names_embedding_layers_and_the_final_layer_before_and_after_the_norm(fresh):
    ident = identify_segments(fresh["engine"], fresh["bank"])
    assert _named(ident) == [("match", "hs0"), ("match", "hs3"), ("match", f"hs{L}_pre_norm"), ("match", f"hs{L}")]
    assert [s.best.kind for s in ident.segments] == ["embedding", "layer", "pre_norm", "post_norm"]
    assert [s.best.hf_index for s in ident.segments] == [0, 3, L, L]
    assert ident.suggestions["hf_hidden_states_indices"] == [0, 3, L, L]
    # Post-norm states have no SGLang/vLLM capture id: no server config reproduces this trace.
    assert "sglang_eagle_config.eagle_aux_hidden_state_layer_ids" not in ident.suggestions
    assert any("final norm's output" in note for note in ident.notes)


def test_gives_framework_ids_and_warns_that_sglang_cannot_reproduce_an_unsorted_order(fresh):
    ident = identify_segments(fresh["perm"], fresh["bank"])
    assert _named(ident) == [("match", "hs5"), ("match", "hs1"), ("match", "hs2")]
    assert ident.suggestions == {
        "hf_hidden_states_indices": [5, 1, 2],
        "sglang_eagle_config.eagle_aux_hidden_state_layer_ids": [4, 0, 1],
        "vllm_eagle_aux_hidden_state_layer_ids": [5, 1, 2],
    }
    assert any("ascending layer order" in note for note in ident.notes)


def test_segments_from_layers_missing_from_the_bank_match_no_layer(fresh):
    """A bank of the same checkpoint cut to L-2 layers: hs0 and hs3 are there, the last layers are not."""
    ident = identify_segments(fresh["engine"], fresh["bank_short"])
    assert _named(ident) == [("match", "hs0"), ("match", "hs3"), ("none", None), ("none", None)]
    for seg in ident.segments[2:]:
        assert "no layer matches" in seg.message
    assert ident.suggestions == {}
    assert any("not every segment was identified" in note for note in ident.notes)


def test_a_segment_from_another_model_matches_no_layer(fresh):
    ident = identify_segments(fresh["foreign"], fresh["bank"])
    assert _named(ident) == [("match", "hs0"), ("none", None), ("match", "hs5")]
    assert "no layer matches" in ident.segments[1].message
    assert "no layer matches" in render_identification(ident)


# ---------------------------------------------------------------------------------------- the CLI
def test_cli_exits_0_when_every_segment_is_named(tmp_path):
    out = tmp_path / "identify.json"
    result = invoke_tracediff("identify", SAMPLES / "server_broken.zarr", "--bank", SAMPLES / "bank.zarr",
                              "--json", out)
    assert result.returncode == 0, result.stderr
    assert "segment 2 (hs8_pre_norm) is output of layer 7 (final layer), before the final norm" in result.stdout
    assert "sglang_eagle_config.eagle_aux_hidden_state_layer_ids = [2, 5, 7]" in result.stdout
    assert '"verdict": "match"' in out.read_text()


def test_cli_exits_1_when_a_segment_matches_no_layer(fresh):
    result = invoke_tracediff("identify", fresh["engine"], "--bank", fresh["bank_short"])
    assert result.returncode == 1
    assert result.stdout.count("no layer matches") == 2


@pytest.mark.parametrize(
    ("store", "bank", "expected"),
    [
        ("engine", "bank_other_seqs", "holds none of the token sequences"),
        ("engine", "samples_bank", "differs from the bank's hidden size 64"),
        ("samples_train", "bank", "segment size 64 differs from the bank's hidden size 32"),
        ("engine", "missing", "no such trace store"),
    ],
)
def test_bad_input_is_one_line_exit_2(fresh, tmp_path, store, bank, expected):
    paths = {**fresh, "samples_bank": SAMPLES / "bank.zarr", "samples_train": SAMPLES / "train.zarr",
             "missing": tmp_path / "nope.zarr"}
    result = invoke_tracediff("identify", paths[store], "--bank", paths[bank])
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert expected in lines[0]


def test_a_trainer_store_as_the_bank_names_each_segment_and_the_ids_to_set(tmp_path):
    fixed = invoke_tracediff("identify", SAMPLES / "server_fixed.zarr", "--bank", SAMPLES / "train.zarr")
    assert fixed.returncode == 0, fixed.stderr
    assert "hf_hidden_states_indices = [0, 3, 6]" in fixed.stdout
    assert "sglang_eagle_config.eagle_aux_hidden_state_layer_ids = [-1, 2, 5]" in fixed.stdout
    assert "None" not in fixed.stdout
    assert "columns are named from its recorded aux layers (store.aux_layers, hf numbering)" in fixed.stdout
    out = tmp_path / "identify.json"
    broken = invoke_tracediff("identify", SAMPLES / "server_broken.zarr", "--bank", SAMPLES / "train.zarr",
                              "--json", out)
    segments = json.loads(out.read_text())["segments"]
    assert [s["best"]["hf_index"] if s["best"] else None for s in segments] == [3, 6, None]
    assert "None" not in broken.stdout


def test_identify_against_a_bank_without_the_layers_suggests_no_ids(fresh):
    result = invoke_tracediff("identify", fresh["engine"], "--bank", fresh["perm"])
    assert result.returncode == 1
    assert "no layer matches" in result.stdout
    assert "None" not in result.stdout and "hf_hidden_states_indices" not in result.stdout
