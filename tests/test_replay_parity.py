"""Replay's draft forward equals the real classes' on the same weights and inputs: speculators'
``Eagle3DraftModel`` (the trainer) and SGLang's ``LlamaForCausalLMEagle3`` (the engine), step-0 logits
for every row of a sequence. (vLLM's ``Eagle3LlamaForCausalLM`` is checked live: replay reproduces
the engine's accepted count at every drafting step, tests/test_vllm_live.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tracediff.replay.draft import Eagle3Draft

T = 23


def _replay_logits(folder: Path, fc_in: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    draft = Eagle3Draft(folder)
    logits, _ = draft.step(draft.project(fc_in), ids, torch.arange(ids.numel()), [], [], 0)
    return logits


def test_replay_equals_speculators_eagle3_draft_model(tmp_path: Path) -> None:
    pytest.importorskip("speculators", reason="speculators is not installed: requirements/frameworks-trainers.sh")
    import trainer_runs as tr

    model = tr.build_speculators_draft(seed=0).eval()
    folder = tmp_path / "speculators_draft"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), default=str))
    gen = torch.Generator().manual_seed(1)
    fc_in = torch.randn(T, model.fc.in_features, generator=gen)
    ids = torch.randint(0, tr.VOCAB, (T,), generator=gen)
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=fc_in[None], input_ids=ids[None], document_ids=torch.zeros(1, T, dtype=torch.long),
              ttt_steps=1)
    handle.remove()
    expected = seen[0][0]
    got = _replay_logits(folder, fc_in, ids)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1.6e-2 * float(expected.abs().max()))
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_replay_equals_sglang_llama_for_causal_lm_eagle3(tmp_path: Path) -> None:
    pytest.importorskip("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")
    import sglang_harness as h

    from tracediff.testing.eagle3 import write_eagle3_draft

    h.init_sglang()
    from safetensors.torch import load_file
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    hidden, vocab = 32, 128
    target_config = h.llama_config(6, hidden=hidden, vocab=vocab)
    spec = write_eagle3_draft(tmp_path / "draft", target_config, [1, 3, 4], where="eagle_config", seed=5,
                              own_embedding=True)
    config = h.llama_config(1, hidden=hidden, vocab=vocab, draft_vocab_size=None,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    draft = LlamaForCausalLMEagle3(config)
    draft.load_weights(load_file(str(spec.path / "model.safetensors")).items())
    gen = torch.Generator().manual_seed(2)
    fc_in = torch.randn(T, 3 * hidden, generator=gen)
    ids = torch.randint(0, vocab, (T,), generator=gen)
    batch = h.forward_batch("EXTEND", ids, [T], ["r0"], spec_info=EagleDraftExtendInput(
        hidden_states=fc_in, num_tokens_for_logprob_per_req=1))
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=h.CausalSDPA())):
        normed, _aux = draft.model(ids, batch.positions, batch)
        expected = normed @ draft.lm_head.weight.T
    got = _replay_logits(spec.path, fc_in, ids)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1.6e-2 * float(expected.abs().max()))
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
