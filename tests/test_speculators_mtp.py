"""speculators 0.9 training an MTP head (``MTPDraftModel``, a Qwen3 verifier), recorded by the speculators
adapter: tap ``fc_in`` = the input of ``mtp_layers[0].input_proj`` at step 0 of each forward.

The verifier is a tiny random Qwen3 in transformers; its last hidden states before the final norm are
what speculators' datagen stores as ``verifier_last_hidden_states``. Two documents are packed into one
row (positions restart), as speculators' collate function packs them. The recorded rows must be
``[token_layernorm(embed(x_{p+1})) | hidden_layernorm(h_p)]``, computed here from the module's norm
weights and the verifier's embedding with the RMSNorm formula, one row per position of step 0 only,
the row whose next token starts the other document invalid, under the row model ``mtp`` with the
hidden state before the final norm.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("speculators")

import tracediff as td  # noqa: E402
from tracediff.adapters import speculators as adapter  # noqa: E402
from tracediff.store import open_store  # noqa: E402

HIDDEN, VOCAB, STEPS = 64, 128, 2
DOCS = [[5, 17, 33, 8, 91, 2, 40, 11], [70, 3, 64, 29, 12, 99]]


def _verifier() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: captured.append(a[0].detach()))
    states = []
    with torch.no_grad():
        for doc in DOCS:
            model(input_ids=torch.tensor([doc]))
            states.append(captured.pop()[0])
    hook.remove()
    return model, torch.cat(states)  # [sum(len), H]: the last state before the final norm


def _mtp_draft(verifier: torch.nn.Module) -> torch.nn.Module:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel
    from speculators.models.mtp.config import MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = verifier.config.__class__(**verifier.config.to_dict())
    layer._attn_implementation = "sdpa"
    config = MTPSpeculatorConfig(
        transformer_layer_config=layer,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                      architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(1)
    model = MTPDraftModel(config)
    with torch.no_grad():  # what load_verifier_weights does: the verifier's embedding and head
        model.embed_tokens.weight.copy_(verifier.model.embed_tokens.weight)
        model.lm_head.weight.copy_(verifier.lm_head.weight)
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)  # norms that are not the identity
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_step0_input_of_the_mtp_layer_is_recorded_with_its_labels_and_row_model(tmp_path: Path) -> None:
    verifier, hidden = _verifier()
    draft = _mtp_draft(verifier)
    ids = torch.tensor([[t for d in DOCS for t in d]])
    positions = torch.tensor([[p for d in DOCS for p in range(len(d))]])
    with td.record(tmp_path / "train.zarr", role="trainer", on_full="block") as rec:
        assert adapter.attach(rec, draft)
        logits, loss, _ = draft(input_ids=ids, hidden_states=hidden[None], position_ids=positions,
                                loss_mask=torch.ones_like(ids))
        loss.backward()
    assert len(logits) == STEPS  # the MTP layer ran once per step; only step 0 is recorded
    with open_store(tmp_path / "train.zarr") as st:
        (stream,) = st.tap_streams("fc_in")
        values, labels, attrs, model = stream.read_float32(), stream.labels(), stream.attrs, stream.row_model
    n = ids.shape[1] - STEPS - 1
    layer = draft.mtp_layers[0]
    eps = verifier.config.rms_norm_eps
    with torch.no_grad():
        want = torch.cat([_rms(verifier.model.embed_tokens.weight[ids[0, 1:n + 1]], layer.token_layernorm.weight, eps),
                          _rms(hidden[:n], layer.hidden_layernorm.weight, eps)], dim=-1)
    np.testing.assert_allclose(values, want.numpy(), rtol=1e-5, atol=1e-5)
    assert labels["position"].tolist() == positions[0, :n].tolist()
    assert labels["token_id"].tolist() == ids[0, :n].tolist()
    assert labels["next_token_id"].tolist() == ids[0, 1:n + 1].tolist()
    first = len(DOCS[0])
    assert labels["seq"].tolist() == [0] * first + [1] * (n - first)
    # The last row of the first document embeds the second document's first token: not a real input.
    assert labels["valid"].tolist() == [True] * (first - 1) + [False] + [True] * (n - first)
    assert model is not None and model.name == "mtp" and model.slots[1].final_norm is False
    assert attrs["segment_labels"] == ["embed_next", "hidden"] and attrs["segment_size"] == HIDDEN
    assert attrs["meta"]["mtp"]["hidden_final_norm"] == "before"
