"""`tracediff record --adapter hf`: a bank of every hidden state of a real transformers Llama.

The recorded script runs HF forwards with ``output_hidden_states=True`` and saves what HF returned
(plus the final layer's output before the norm, from a plain forward hook); the bank's segments
must equal them bit for bit: hs0..hs{L-1}, then the pre-norm final layer, then hs{L} (post-norm).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HIDDEN, LAYERS, invoke_tracediff, read_plain, run_tracediff
from safetensors.torch import load_file

from tracediff.adapters.hf import bank_segments
from tracediff.store import TraceStore

SCRIPT = textwrap.dedent(
    """
    import torch
    from safetensors.torch import save_file

    from tracediff.testing.tiny_llama import build_tiny_llama, make_sequences

    tl = build_tiny_llama(hidden_size=32, num_layers=4, vocab_size=128, seed=0)
    seqs = make_sequences(n_seqs=3, min_len=5, max_len=12, vocab_size=128, seed=5)
    pre_norm = []
    tl.model.model.layers[-1].register_forward_hook(lambda _m, _a, out: pre_norm.append(out[0] if isinstance(out, tuple) else out))
    saved = {}
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            out = tl.model(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
            for j, state in enumerate(out.hidden_states):
                saved[f"seq{i}.hs{j}"] = state[0]
            saved[f"seq{i}.pre_norm"] = pre_norm[-1][0]
            saved[f"seq{i}.tokens"] = torch.tensor(seq)
    save_file({k: v.contiguous() for k, v in saved.items()}, "hidden_states.safetensors")
    """
)


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    workdir = tmp_path_factory.mktemp("bank")
    (workdir / "script.py").write_text(SCRIPT)
    store = workdir / "bank.zarr"
    result = run_tracediff(
        "record",
        "--adapter",
        "hf",
        "--role",
        "bank",
        "-o",
        store,
        "--",
        sys.executable,
        "script.py",
        cwd=workdir,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "tracediff:   bank/pid" in result.stderr
    return store, load_file(workdir / "hidden_states.safetensors")


@pytest.mark.slow
def test_hf_bank_segments_equal_output_hidden_states_bit_for_bit(bank) -> None:
    store, hf = bank
    (group,) = read_plain(store, "bank").values()
    assert group.attrs["dtype"] == "float32" and group.attrs["width"] == (LAYERS + 2) * HIDDEN
    start = 0
    for i in range(3):
        states = [hf[f"seq{i}.hs{j}"] for j in range(LAYERS)] + [hf[f"seq{i}.pre_norm"], hf[f"seq{i}.hs{LAYERS}"]]
        rows = group.values[start : start + len(states[0])]
        for k, state in enumerate(states):
            segment = rows[:, k * HIDDEN : (k + 1) * HIDDEN]
            assert np.array_equal(segment.view(np.uint32), state.numpy().view(np.uint32)), (i, k)
        tokens = hf[f"seq{i}.tokens"].numpy()
        assert np.array_equal(group.labels["token_id"][start : start + len(tokens)], tokens)
        assert np.array_equal(group.labels["position"][start : start + len(tokens)], np.arange(len(tokens)))
        assert np.array_equal(group.labels["next_token_id"][start : start + len(tokens)], [*tokens[1:], -1])
        assert (group.labels["seq"][start : start + len(tokens)] == i).all()
        start += len(tokens)
    assert group.rows == start


@pytest.mark.slow
def test_hf_bank_names_its_segments_in_hf_numbering(bank, tiny) -> None:
    store, hf = bank
    labels, info = bank_segments(LAYERS)
    assert labels == ["hs0", "hs1", "hs2", "hs3", "hs4_pre_norm", "hs4"]
    with TraceStore(store) as opened:
        (stream,) = opened.streams["bank"]
        assert (stream.segment_size, stream.segment_labels) == (HIDDEN, labels)
        assert [s["kind"] for s in stream.attrs["segment_info"]] == [
            "embedding",
            "layer",
            "layer",
            "layer",
            "pre_norm",
            "post_norm",
        ]
        assert stream.attrs["model"]["num_hidden_layers"] == LAYERS
        assert stream.commit["status"] == "closed"
        # The pre-norm segment really is the final norm's input: norm(pre_norm) == hs{L}.
        rows = torch.from_numpy(stream.read_float32(0, len(hf["seq0.tokens"])))
    pre, post = rows[:, LAYERS * HIDDEN : (LAYERS + 1) * HIDDEN], rows[:, (LAYERS + 1) * HIDDEN :]
    with torch.no_grad():
        torch.testing.assert_close(tiny.model.model.norm(pre), post)
    assert not torch.allclose(pre, post)
    shown = invoke_tracediff("inspect", store)
    assert "6 x 32 [hs0, hs1, hs2, hs3, hs4_pre_norm, hs4]" in shown.stdout
