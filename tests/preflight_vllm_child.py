"""Run by tests/test_preflight.py in vLLM's venv: the aux layers vLLM 0.32 itself resolves for
(target, draft) folders, printed as one JSON line.

For each pair: the target's ``ModelConfig`` and the draft's ``SpeculativeConfig`` built by vLLM (its
own config loading, speculators-format conversion included); the ids through
``GPUModelRunner._get_eagle3_aux_layers_from_config``; when none, the target class's
``get_eagle3_default_aux_hidden_state_layers``; then the target class's own
``set_aux_hidden_state_layers`` (sorted and de-duplicated by ``EagleModelMixin``, raw on DeepSeek's
model), on an object holding just the fields those methods touch (no weights are built).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def resolve(target: str, draft: str) -> dict:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    mc = ModelConfig(model=target, skip_tokenizer_init=True)
    sc = SpeculativeConfig(model=draft, method="eagle3", num_speculative_tokens=1, target_model_config=mc,
                           target_parallel_config=ParallelConfig())
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=sc))
    num_layers = mc.hf_text_config.num_hidden_layers
    cls, _arch = ModelRegistry.resolve_model_cls(mc.hf_config.architectures, mc)
    inner = type("DecoderStack", (EagleModelMixin,), {})()  # the mixin vLLM's decoder stacks inherit
    inner.layers, inner.start_layer = [None] * num_layers, 0
    holder = SimpleNamespace(model=inner)
    from_config = ids is not None
    if not ids:
        ids = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(holder)
    owner = next(k for k in cls.__mro__ if "set_aux_hidden_state_layers" in k.__dict__)
    if owner is not SupportsEagle3:  # DeepSeek (and Kimi-K2.5's wrapper): the tuple as given, on its model
        owner.__dict__["set_aux_hidden_state_layers"](holder, tuple(ids))
    else:  # SupportsEagle3's: the decoder stack's EagleModelMixin sorts and de-duplicates
        EagleModelMixin._set_aux_hidden_state_layers(inner, tuple(ids))
    return {"class": cls.__name__, "setter": owner.__name__, "ids": list(ids), "from_config": from_config, "num_layers": num_layers,
            "aux_hidden_state_layers": list(inner.aux_hidden_state_layers)}


if __name__ == "__main__":
    pairs = json.loads(sys.argv[1])
    out = [resolve(t, d) for t, d in pairs]
    print("RESULT " + json.dumps(out))
