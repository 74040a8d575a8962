"""Aux-layer numberings: every framework's ids, as its adapter records them, mean the right physical
layers, and a physical layer list is said back in each engine's words (or why it cannot be)."""

from __future__ import annotations

import pytest

from tracediff.adapters.conventions import (
    CONVENTIONS,
    FINAL_NORM,
    aux_layers_from_meta,
    convention,
    from_physical,
    to_physical,
)
from tracediff.compare.plan.metadata import config_diff, side_aux_layers

L = 32


@pytest.mark.parametrize(
    ("name", "ids", "physical"),
    [
        ("hf", [0, 3, 31], [0, 3, 31]),
        ("hf", [1, L], [1, FINAL_NORM]),  # HF's hidden_states[L] is the final norm's output
        ("capture", [31, 3, 0], [31, 3, 0]),  # as listed
        ("vllm", [31, 3, 3, 0], [0, 3, 31]),  # sorted, duplicates dropped
        ("speculators", [2, 16, 29], [2, 16, 29]),
        ("sglang", [-1, 2, 30], [0, 3, 31]),  # output of layer j, SGLang adds 1
        ("sglang", [30, -1, 2], [0, 3, 31]),  # concatenated in ascending order whatever the config
        ("specforge", [1, 15, 28], [2, 16, 29]),
        ("sglang_deepseek", [3, 1], [1, 3]),  # raw
    ],
)
def test_ids_translate_into_physical_layers_in_concatenation_order(name, ids, physical):
    conv = convention(name)
    assert conv is not None
    assert to_physical(ids, conv, L) == physical


@pytest.mark.parametrize("name", ["capture", "vllm", "sglang", "sglang_deepseek"])
def test_physical_layers_round_trip_through_every_engine_numbering(name):
    conv = CONVENTIONS[name]
    target = [0, 3, 31]
    ids, problems = from_physical(target, conv, L)
    assert problems == [] and ids is not None
    assert to_physical(ids, conv, L) == target


def test_an_order_a_sorting_engine_cannot_express_is_said_so():
    ids, problems = from_physical([3, 0, 31], CONVENTIONS["sglang"], L)
    assert ids == [2, -1, 30]
    assert any("ascending layer order" in p for p in problems)


def test_the_last_layer_before_the_norm_and_the_final_norm_are_not_capturable_in_sglang():
    _ids, problems = from_physical([0, L], CONVENTIONS["sglang"], L)
    assert any("before the final norm" in p for p in problems)
    ids, problems = from_physical([0, FINAL_NORM], CONVENTIONS["vllm"], L)
    assert ids is None and any("final norm" in p for p in problems)
    assert from_physical([0, L], CONVENTIONS["vllm"], L) == ([0, L], [])


def test_each_adapters_recorded_format_is_read():
    # The SGLang adapter: what the target really captured wins over the draft config's ids.
    sglang = {"sglang": {"sglang_version": "0.5.23", "aux_layer_ids": [1, 3, 4], "layers_to_capture": [2, 4, 5]}}
    aux = aux_layers_from_meta(sglang)
    assert aux is not None and aux.physical == [2, 4, 5] and aux.framework == "sglang"
    assert aux.field == "sglang.layers_to_capture" and aux.notes == []
    # A DeepSeek-style raw path: the config ids do not explain what was captured; said in a note.
    raw = {"sglang": {"sglang_version": "0.5.23", "aux_layer_ids": [2, 4, 5], "layers_to_capture": [2, 4, 5]}}
    assert aux_layers_from_meta(raw).notes
    # speculators / SpecForge adapters: the aux_layer_ids block with capture indices.
    spec = {"aux_layer_ids": {"convention": "vllm: id i = ...", "ids": [2, 16, 29], "hf_hidden_states": [2, 16, 29]}}
    assert aux_layers_from_meta(spec).physical == [2, 16, 29]
    forge = {"aux_layer_ids": {"convention": "sglang config id j = ...", "ids": [1, 15, 28],
                               "hf_hidden_states": [2, 16, 29]}}
    assert aux_layers_from_meta(forge).physical == [2, 16, 29]
    # tracediff's own labels.
    assert aux_layers_from_meta({"aux_layer_ids": ["hs0", "hs3", "hs8_pre_norm"]}).physical == [0, 3, 8]


def test_ids_without_a_numbering_are_unknown_and_say_what_to_record():
    aux = aux_layers_from_meta({"aux_layer_ids": [2, 5, 7]})
    assert aux is not None and aux.physical is None and "convention" in aux.notes[0]
    odd = aux_layers_from_meta({"aux_layers": {"ids": [1, 2], "convention": "mystery"}})
    assert odd.physical is None and "mystery" in odd.notes[0]


def test_the_same_layers_in_two_numberings_are_an_equivalent_config_difference():
    ref = {"store": {"aux_layers": {"ids": [0, 3, 6], "convention": "hf"}, "num_hidden_layers": 8}}
    cand = {"store": {"aux_layers": {"ids": [-1, 2, 5], "convention": "sglang"}, "num_hidden_layers": 8}}
    assert side_aux_layers(ref).physical == side_aux_layers(cand).physical == [0, 3, 6]
    diff = config_diff(ref, cand, same_physical_layers=True)
    assert [d["path"] for d in diff] == ["store.aux_layers"] and diff[0]["equivalent"] is True


@pytest.mark.parametrize("meta, engine", [
    ({"record": {"adapters": ["vllm"]}}, "vllm"),
    ({"record": {"adapters": ["sglang", "generic"]}}, "sglang"),
    ({"record": {"adapters": ["generic"]}}, None),
    ({"record": {"adapters": ["sglang", "vllm"]}}, None),  # two engines: neither is named
    ({"framework": "SGLang 0.5", "record": {"adapters": ["vllm"]}}, "sglang"),  # provenance first
])
def test_the_engine_of_a_store_recorded_with_one_engines_adapter(meta, engine):
    from tracediff.adapters.conventions import engine_of

    assert engine_of(meta) == engine
