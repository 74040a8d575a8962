"""SGLang's DeepSeek NextN (MTP) head recorded in this process with its real classes, on CPU.

SGLang's server does not run a DeepSeek model on CPU here (its CPU attention and MoE kernels live in
``sgl_kernel``, not installed; docs/sglang.md), but its NextN classes do, in process, as SGLang's own
layer tests drive them (``tests/sglang_harness.py``): ``DeepseekV3ForCausalLMNextN`` is built from the
tiny DeepSeek-V3 + MTP checkpoint of ``tests/test_vllm_mtp_live.py`` and loads its MTP layer with
SGLang's own ``load_weights``; a draft-extend forward runs through its ``eh_proj``, MLA decoder
(SGLang's absorbed-MLA path over the harness's SDPA) and logits processor. The target's hidden
states it is handed are those a transformers forward of the same checkpoint returns after the final
norm (what SGLang's DeepseekV2Model hands its NextN head).

The rows the adapter records must be ``[enorm(embed(x_{p+1})) | hnorm(h_p)]`` computed from the
checkpoint's tensors, position 0 included (SGLang, unlike vLLM, does not zero it), under the MTP row
model with the hidden state after the final norm.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")
pytestmark = pytest.mark.slow

import sglang_harness as h  # noqa: E402

from tracediff.store import open_store  # noqa: E402

SEQS = [[40, 92, 59, 37, 125, 58], [120, 7, 82, 78, 17, 3]]
ACCEPT = [6, 4]  # rows per request that are real; SGLang pads DRAFT_EXTEND_V2 to equal widths


@pytest.fixture(scope="module")
def nextn(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tracediff.testing.deepseek_mtp import write_deepseek_mtp

    h.init_sglang()
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))
    path = write_deepseek_mtp(tmp_path_factory.mktemp("sglang_mtp") / "target")
    config = AutoConfig.from_pretrained(path)
    config.architectures = ["DeepseekV3ForCausalLMNextN"]
    # SGLang's CPU rotary embedding is DeepSeek's YaRN only (rotary_embedding/factory.py get_rope_cpu);
    # factor 1 is plain RoPE. It acts after eh_proj, on what the tap records nothing depends.
    config.rope_parameters = {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 1.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    config.moe_layer_freq = 1
    return path, config, load_file(str(path / "model.safetensors"))


def _build(config, weights):
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN

    model = DeepseekV3ForCausalLMNextN(config)
    model.load_weights(iter(weights.items()))  # skips the MTP layer's embed_tokens / shared_head.head
    # SGLang's speculative worker then hands the draft the target's embedding and head
    # (set_embed_and_head, srt/models/deepseek_v2.py), which ends in torch.cuda.synchronize(): the
    # same two assignments here, on CPU.
    model.model.embed_tokens.weight = torch.nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
    model.lm_head.weight = torch.nn.Parameter(weights["lm_head.weight"], requires_grad=False)
    return model.eval()


def _draft_extend(model, path: Path):
    """A draft extend (``DRAFT_EXTEND_V2``, as after a verify) over rows p = 0..5 of each request:
    input ids rotated left (x_{p+1}, the target's greedy token last), spec_info.hidden_states = h_p;
    the second request's last two rows past its accepted tokens. (A plain ``EXTEND`` sends SGLang's
    DeepSeek attention down its MHA path, which writes the latent KV pool a real runner holds.)"""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    from tracediff.testing.deepseek_mtp import greedy_continuation, target_hidden_states

    full = greedy_continuation(path, SEQS)
    hidden = torch.cat(target_hidden_states(path, SEQS))
    rotated = torch.tensor([t for s in full for t in s[1:]])
    accept = torch.tensor(ACCEPT)
    spec = EagleDraftExtendInput(hidden_states=hidden, num_tokens_for_logprob_per_req=1, num_accept_tokens=accept,
                                 num_correct_drafts=accept - 1, num_tokens_per_req=len(SEQS[0]))
    batch = h.forward_batch("DRAFT_EXTEND_V2", rotated, [len(s) for s in SEQS], ["r0", "r1"], spec_info=spec)

    class MlaBackend(h.CausalSDPA):
        """The harness's SDPA, named as a backend whose DeepSeek handler picks SGLang's MLA path."""

        prefill_attention_backend_str = "triton"
        decode_attention_backend_str = "triton"

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=MlaBackend())):
        out = model(batch.input_ids, batch.positions, batch)
    return full, out


def test_the_nextn_eh_proj_input_is_recorded_as_sglang_builds_it(tmp_path: Path, nextn) -> None:
    import tracediff as td
    from tracediff.adapters import sglang as adapter
    from tracediff.testing.deepseek_mtp import mtp_head_inputs

    path, config, weights = nextn
    model = _build(config, weights)
    with td.record(tmp_path / "s.zarr", role="server", on_full="block") as rec:
        assert adapter.attach(rec, model)
        full, out = _draft_extend(model, path)
    assert out.next_token_logits is not None and torch.isfinite(out.next_token_logits).all()
    with open_store(tmp_path / "s.zarr") as st:
        (stream,) = st.tap_streams("fc_in")
        values, labels, names, attrs = stream.read_float32(), stream.labels(), stream.seq_names, stream.attrs
    want = torch.cat(mtp_head_inputs(path, full)).numpy()  # no zeroed position
    assert values.shape == want.shape == (sum(len(s) for s in SEQS), 256)
    np.testing.assert_allclose(values, want, rtol=1e-4, atol=1e-5)
    assert [names[int(s)] for s in labels["seq"]] == ["r0"] * 6 + ["r1"] * 6
    assert labels["position"].tolist() == list(range(6)) * 2
    assert labels["valid"].tolist() == [True] * 6 + [True] * 4 + [False] * 2
    assert labels["next_token_id"].tolist() == [t for s in full for t in s[1:]]
    assert (np.abs(values[labels["position"] == 0, :128]).sum(1) > 0).all()  # position 0 not zeroed
    model_json = stream.row_model.to_json() if stream.row_model else None
    assert model_json is not None and model_json["name"] == "mtp" and model_json["slots"][1]["final_norm"] is True
    assert attrs["segment_size"] == 128 and attrs["segment_labels"] == ["embed_next", "hidden"]
    assert "zeroed_slots" not in attrs
    assert attrs["meta"]["sglang"]["draft"]["hidden_final_norm"] == "after"


def test_preflight_predicted_the_row_model_sglang_built(tmp_path: Path, nextn) -> None:
    import tracediff as td
    from tracediff.adapters import sglang as adapter
    from tracediff.preflight import run_preflight

    path, config, weights = nextn
    model = _build(config, weights)
    with td.record(tmp_path / "s.zarr", role="server", on_full="block") as rec:
        assert adapter.attach(rec, model)
        _draft_extend(model, path)
    with open_store(tmp_path / "s.zarr") as st:
        (stream,) = st.tap_streams("fc_in")
        recorded = stream.row_model.to_json()
    (view,) = run_preflight(path, None, ("sglang",), versions={"sglang": "0.5.23"}).engines
    assert view.row_model["row_model"] == recorded and view.row_model["zeroed_embedding_positions"] == []
