"""Aux-layer numbering conventions of every framework, and one physical numbering to compare them in.

The same integer means different layers in different frameworks (``../docs/format.md``, "Aux
layers"), which is the root of most EAGLE-3 wiring bugs. This module holds that framework knowledge
so that compare can (a) translate what each side recorded into one *physical* numbering, the HF
``hidden_states`` index with ``L`` meaning the last decoder layer's output *before* the final norm
and ``"final_norm"`` the final norm's output, and (b) say a fix in the candidate engine's own words.

Physical numbering (``PhysicalLayer = int | "final_norm"``):

* ``0``: the embedding output;
* ``k`` (1..L): the output of decoder layer ``k - 1`` (= the input of layer ``k``), pre-norm;
* ``"final_norm"``: the final norm's output (what HF's ``hidden_states[-1]`` holds).

Conventions (``convention`` names in a store's ``meta``):

=================== ============================================ =========================== =========
name                id k means                                   concatenation order         examples
=================== ============================================ =========================== =========
``hf``              HF ``hidden_states[k]`` (k = L: final norm)  as listed                   trainers
``capture``         input of layer k (0 = embedding, L = last)   as listed                   generic
``vllm``            input of layer k, taken as given             sorted, duplicates dropped  vLLM, speculators
``sglang``          output of layer k (-1 = embedding)           sorted ascending            SGLang Llama/Qwen, SpecForge
``sglang_deepseek`` input of layer k, taken raw                  sorted ascending            SGLang DeepSeek/Kimi
=================== ============================================ =========================== =========

Pure data and small functions: no framework import, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Union

PhysicalLayer = Union[int, str]  # noqa: UP007  (an int, or "final_norm")
FINAL_NORM = "final_norm"


@dataclass(frozen=True)
class Convention:
    """How one framework numbers aux layers and orders the concatenation."""

    name: str
    meaning: str
    field: str  # the config field a user sets, in that framework's words
    order: str  # "as_listed" | "sorted" | "sorted_unique"
    offset: int  # physical = id + offset, for ordinary layers
    embedding_id: int | None  # the id of the embedding output (None: not expressible)
    final_norm_id: int | None = None  # the id of the final norm's output, where one exists
    last_layer_reachable: bool = True  # can the last layer's pre-norm output be captured?


CONVENTIONS: dict[str, Convention] = {
    c.name: c
    for c in (
        Convention("hf", "HF output_hidden_states index (0 = embedding, L = final norm output)",
                   "hidden_states indices", "as_listed", 0, 0, final_norm_id=-1, last_layer_reachable=False),
        Convention("capture", "input of layer k (0 = embedding, L = last layer before the final norm)",
                   "capture indices", "as_listed", 0, 0),
        Convention("vllm", "input of layer k, taken as given (0 = embedding)",
                   "eagle_aux_hidden_state_layer_ids (top level of the draft config)", "sorted_unique", 0, 0),
        Convention("sglang", "output of layer k (-1 = embedding); SGLang adds 1",
                   "eagle_config.eagle_aux_hidden_state_layer_ids (nested in the draft config)", "sorted", 1, -1,
                   last_layer_reachable=False),
        Convention("sglang_deepseek", "input of layer k, taken raw (DeepSeek/Kimi targets)",
                   "eagle_config.eagle_aux_hidden_state_layer_ids (nested in the draft config)", "sorted", 0, 0,
                   last_layer_reachable=False),
    )
}
# Frameworks that use another's numbering.
ALIASES = {"speculators": "vllm", "specforge": "sglang", "transformers": "hf", "hidden_states": "hf",
           "vllm_capture": "vllm", "sglang_capture": "capture"}


def convention(name: str | None) -> Convention | None:
    if not name:
        return None
    key = str(name).strip().lower()
    return CONVENTIONS.get(ALIASES.get(key, key))


def to_physical(ids: list[int], conv: Convention, num_layers: int | None = None) -> list[PhysicalLayer]:
    """Ids in ``conv`` -> physical layers, in the order the framework concatenates them."""
    out: list[PhysicalLayer] = []
    for i in ids:
        if conv.final_norm_id is not None and (i == conv.final_norm_id or (conv.name == "hf" and i == num_layers)):
            out.append(FINAL_NORM)
        elif conv.embedding_id is not None and i == conv.embedding_id:
            out.append(0)
        else:
            out.append(int(i) + conv.offset)
    return _ordered(out, conv.order)


def from_physical(layers: list[PhysicalLayer], conv: Convention,
                  num_layers: int | None = None) -> tuple[list[int] | None, list[str]]:
    """Physical layers -> the ids to write in ``conv``, and why that cannot reproduce them (if so).
    With ``num_layers``, the last layer's pre-norm output is checked for reachability too."""
    problems: list[str] = []
    ids: list[int] = []
    for p in layers:
        if num_layers is not None and p == num_layers and not conv.last_layer_reachable:
            problems.append(f"the last layer's output before the final norm (physical {p}) is not capturable in "
                            f"{conv.name}")
            continue
        if p == FINAL_NORM:
            if conv.final_norm_id is None:
                problems.append(f"the final norm's output is not capturable in {conv.name} (it feeds pre-norm states)")
                continue
            ids.append(conv.final_norm_id)
        elif p == 0:
            if conv.embedding_id is None:
                problems.append(f"the embedding output is not expressible in {conv.name}")
                continue
            ids.append(conv.embedding_id)
        else:
            ids.append(int(p) - conv.offset)
    if conv.order != "as_listed" and list(layers) != _ordered(list(layers), conv.order):
        problems.append(
            f"{conv.name} concatenates aux states in ascending layer order"
            f"{' and drops duplicates' if conv.order == 'sorted_unique' else ''} whatever the config lists, so the "
            f"order {format_layers(layers)} cannot be set there: change the training side's order, or the code")
    return (ids if len(ids) == len(layers) else None), problems


def _ordered(layers: list[PhysicalLayer], order: str) -> list[PhysicalLayer]:
    if order == "as_listed":
        return list(layers)
    key = [(10**9 if p == FINAL_NORM else int(p)) for p in layers]
    pairs = sorted(zip(key, layers, strict=True), key=lambda kv: kv[0])
    if order == "sorted_unique":
        seen: list[Any] = []
        out: list[PhysicalLayer] = []
        for k, p in pairs:
            if k not in seen:
                seen.append(k)
                out.append(p)
        return out
    return [p for _, p in pairs]


def format_layers(layers: list[PhysicalLayer] | None) -> str:
    """'[0, 3, 6]' with final_norm spelt out."""
    if layers is None:
        return "unknown"
    return "[" + ", ".join(str(p) for p in layers) + "]"


def layer_text(p: PhysicalLayer) -> str:
    if p == FINAL_NORM:
        return "the final norm's output"
    if p == 0:
        return "the embedding output"
    return f"the output of layer {int(p) - 1}"


@dataclass
class AuxLayers:
    """What one side says about its aux layers: as recorded, and in the physical numbering."""

    recorded: Any  # the values as the store holds them
    field: str  # where in the store's meta they were found
    convention: str | None  # a CONVENTIONS name, or None when unknown
    physical: list[PhysicalLayer] | None  # per concatenated slot, in order; None when unknown
    framework: str | None = None  # the engine/trainer these ids belong to, when known
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_HS_LABEL = re.compile(r"^hs(\d+)(_pre_norm)?$")


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
        return [int(v) for v in value]
    return None


def _from_labels(value: Any) -> list[PhysicalLayer] | None:
    """``["hs0", "hs3", "hs8_pre_norm"]``: tracediff's own HF-style segment labels."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    out: list[PhysicalLayer] = []
    for v in value:
        m = _HS_LABEL.match(str(v)) if isinstance(v, str) else None
        if m is None:
            return None
        out.append(int(m.group(1)))
    return out


def aux_layers_from_meta(meta: dict[str, Any], num_layers: int | None = None) -> AuxLayers | None:
    """Find a side's aux-layer ids in its meta (any adapter's format) and translate them.

    Looked for, in order: the canonical ``aux_layers`` block (``{"ids": [...], "convention": ...}``),
    SGLang's recorded provenance (``sglang.layers_to_capture``: what the target really captured,
    else the draft config's ids), the trainer adapters' ``aux_layer_ids`` block (speculators,
    SpecForge, importers), and plain lists (``aux_layer_ids = [...]`` with a ``convention`` next to
    it, or tracediff's ``hs<k>`` labels).
    """
    for path, block in _walk(meta):
        found = _read_block(path, block, num_layers)
        if found is not None:
            return found
    return None


def _walk(meta: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) of every dict under ``meta``, shallowest first."""
    out: list[tuple[str, Any]] = []
    if isinstance(meta, dict):
        out.append((prefix, meta))
        for k, v in meta.items():
            if isinstance(v, dict):
                out += _walk(v, f"{prefix}.{k}" if prefix else str(k))
    out.sort(key=lambda kv: kv[0].count(".") + (1 if kv[0] else 0))
    return out


def _at(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _read_block(prefix: str, block: dict[str, Any], num_layers: int | None) -> AuxLayers | None:
    canonical = block.get("aux_layers")
    if isinstance(canonical, dict):
        ids = _int_list(canonical.get("ids"))
        conv = convention(canonical.get("convention"))
        where = _at(prefix, "aux_layers")
        if ids is not None and conv is not None:
            return AuxLayers(ids, where, conv.name, to_physical(ids, conv, num_layers),
                             framework=canonical.get("framework"))
        labels = _from_labels(canonical.get("ids"))
        if labels is not None:
            return AuxLayers(canonical.get("ids"), where, "capture", labels, framework=canonical.get("framework"))
        return AuxLayers(canonical.get("ids"), where, None, None, framework=canonical.get("framework"),
                         notes=[f"{where}: convention {canonical.get('convention')!r} is not one tracediff knows "
                                f"({', '.join(CONVENTIONS)})"])
    if prefix.split(".")[-1] == "sglang" or "sglang_version" in block:
        return _read_sglang(prefix, block)
    legacy = block.get("aux_layer_ids")
    if isinstance(legacy, dict):
        # speculators / SpecForge adapters and importers: hf_hidden_states are capture indices.
        where = _at(prefix, "aux_layer_ids")
        phys = _int_list(legacy.get("hf_hidden_states"))
        ids = _int_list(legacy.get("ids"))
        text = str(legacy.get("convention", ""))
        conv = convention(text.split(":")[0]) if text else None
        if phys is not None:
            return AuxLayers(ids if ids is not None else phys, where, conv.name if conv else "capture", phys)
        if ids is not None and conv is not None:
            return AuxLayers(ids, where, conv.name, to_physical(ids, conv, num_layers))
        return None
    ids = _int_list(legacy)
    if ids is not None:
        conv = convention(block.get("aux_layer_convention") or block.get("convention"))
        where = _at(prefix, "aux_layer_ids")
        if conv is not None:
            return AuxLayers(ids, where, conv.name, to_physical(ids, conv, num_layers))
        return AuxLayers(ids, where, None, None, notes=[
            f"{where} = {ids} has no convention next to it: record aux_layers = {{ids, convention}} "
            f"(one of {', '.join(CONVENTIONS)}) so compare can translate it"])
    labels = _from_labels(legacy)
    if labels is not None:
        return AuxLayers(legacy, _at(prefix, "aux_layer_ids"), "capture", labels)
    return None


def _read_sglang(prefix: str, block: dict[str, Any]) -> AuxLayers | None:
    """The SGLang adapter's provenance: ``layers_to_capture`` (capture indices) is what the target
    really captured; the draft config's ids are what the user set."""
    captured = _int_list(block.get("layers_to_capture")) or _int_list((block.get("target") or {}).get(
        "layers_to_capture"))
    ids = _int_list(block.get("aux_layer_ids")) or _int_list((block.get("draft") or {}).get("aux_layer_ids"))
    sg = CONVENTIONS["sglang"]
    if captured is not None:
        notes = []
        if ids is not None and sorted(to_physical(ids, sg)) != sorted(captured):
            notes.append(f"the draft config's ids {ids} (SGLang numbering) are not what the target captured "
                         f"(capture indices {captured}): a DeepSeek/Kimi raw-id path, or defaults")
        return AuxLayers(ids if ids is not None else captured, _at(prefix, "layers_to_capture"),
                         "sglang" if ids is not None else "capture", _ordered(list(captured), "sorted"),
                         framework="sglang", notes=notes)
    if ids is not None:
        return AuxLayers(ids, _at(prefix, "aux_layer_ids"), "sglang", to_physical(ids, sg), framework="sglang")
    return None


def engine_of(meta: dict[str, Any], source: dict[str, Any] | None = None) -> str | None:
    """The serving engine or trainer a side comes from, from its provenance."""
    framework = str((source or {}).get("framework") or meta.get("framework") or "").lower()
    for name in ("sglang", "vllm", "speculators", "specforge"):
        if name in framework or name in meta:
            return name
    aux = meta.get("aux_layers")
    if isinstance(aux, dict) and aux.get("framework"):
        return str(aux["framework"]).lower()
    # `tracediff record --adapter NAME`: the adapters the recording ran with.
    record = meta.get("record")
    adapters = record.get("adapters") if isinstance(record, dict) else None
    engines = {str(a).lower() for a in adapters or [] if str(a).lower() in ("sglang", "vllm", "speculators", "specforge")}
    return engines.pop() if len(engines) == 1 else None


__all__ = ["ALIASES", "CONVENTIONS", "FINAL_NORM", "AuxLayers", "Convention", "PhysicalLayer",
           "aux_layers_from_meta", "convention", "engine_of", "format_layers", "from_physical", "layer_text",
           "to_physical"]
