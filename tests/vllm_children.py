"""Scripts the vllm tests run in the vLLM venv (tests/vllm_harness.py): ``python vllm_children.py MODE ...``.

Modes (each prints one JSON line ``RESULT {...}`` last):

``offline TRACE TARGET DRAFT MAX_TOKENS``
    An ``LLM(...)`` script as users write them (engine core in a spawned process), meant to run under
    ``tracediff record --adapter vllm -- python vllm_children.py offline ...``: adds one request per
    sequence of TRACE, keyed by the sequence key, greedy, and prints the generated ids.
``inprocess STORE TARGET DRAFT FAULT``
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``tracediff.record(STORE, adapter="vllm")`` in this
    process. FAULT ``none`` records normally; ``labels`` makes the adapter's label builder raise (a bug
    in tracediff); ``moved`` points the adapter at a proposer module that does not exist (a vLLM whose
    internals moved). Generates twice, recording and not, and reports whether the outputs are equal.
"""

from __future__ import annotations

import json
import os
import sys


def _engine_args(target: str, draft: str) -> dict:
    return {"model": target, "skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
            "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": False, "seed": 0,
            "speculative_config": {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}}


def _run(llm, sequences, max_tokens: int) -> dict[str, list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for key, ids in sequences:
        engine.add_request(key, TokensPrompt(prompt_token_ids=list(ids)), params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id.rsplit("-", 1)[0]] = list(o.outputs[0].token_ids)
    return out


def offline(trace: str, target: str, draft: str, max_tokens: int) -> None:
    from vllm import LLM

    from tracediff.send import sequences_from_trace

    sequences = [(s.key, s.input_ids) for s in sequences_from_trace(trace)]
    llm = LLM(**_engine_args(target, draft))
    print("RESULT " + json.dumps({"outputs": _run(llm, sequences, max_tokens)}), flush=True)


def inprocess(store: str, target: str, draft: str, fault: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm  # noqa: F401
    from vllm import LLM

    import tracediff as td
    from tracediff.adapters import vllm as adapter

    if fault == "labels":
        def broken(*args, **kwargs):
            raise RuntimeError("injected fault in the label builder")

        adapter.batch_labels = broken
    elif fault == "moved":
        adapter.PROPOSER = "vllm.v1.spec_decode.no_such_module:SpecDecodeBaseProposer.propose"
    sequences = [("a", [5, 6, 7, 8, 9, 10, 11, 12]), ("b", [20, 21, 22, 23, 24])]
    with td.record(store, role="server", adapter="vllm", overwrite=True):
        llm = LLM(**_engine_args(target, draft))
        recorded = _run(llm, sequences, 8)
    plain = _run(llm, sequences, 8)  # the same engine, recorder closed: hooks and patches removed
    print("RESULT " + json.dumps({"recorded": recorded, "plain": plain, "summary": adapter.capture_summary(),
                                  "patched": bool(adapter._state.patches)}), flush=True)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "offline":
        offline(rest[0], rest[1], rest[2], int(rest[3]))
    elif mode == "inprocess":
        inprocess(*rest)
    else:
        raise SystemExit(f"unknown mode {mode}")
