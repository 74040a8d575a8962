"""The aux layers SGLang 0.5.23 itself resolves for a (target, draft) pair, for tests/test_preflight.py.

The ids through SGLang's own ``resolve_spec_aux_hidden_state_config`` (a real ``ServerArgs`` for an
EAGLE3 server and its ``ModelConfig``s, set as SGLang's runtime context the way its launcher does);
the capture indices through the target class's own ``set_eagle3_layers_to_capture`` (the class from
SGLang's ``ModelRegistry``), called on an object holding just the fields it touches (no weights are
built). Imports SGLang: only tests that found it installed call this.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sglang_harness import install_import_stubs


def sglang_resolution(target: Path, draft: Path) -> dict[str, Any]:
    install_import_stubs()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = ServerArgs(model_path=str(target), speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=str(draft), device="cpu", skip_tokenizer_init=True)
    get_context().set_server_args(args)
    model_config = ModelConfig.from_server_args(args)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=args, model_config=model_config, spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        is_draft_worker=False)
    cls, _ = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
    holder = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=model_config.hf_text_config,
                             model=SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)
    cls.set_eagle3_layers_to_capture(holder, aux.eagle_aux_hidden_state_layer_ids)
    return {"class": cls.__name__, "ids": aux.eagle_aux_hidden_state_layer_ids,
            "use_aux_hidden_state": aux.eagle_use_aux_hidden_state,
            "num_layers": model_config.hf_text_config.num_hidden_layers,
            "layers_to_capture": list(holder.model.layers_to_capture)}
