"""The fix, in the candidate engine's own words: which aux-layer ids to set, or why no config can.

From the segment decisions and what each side says about its aux layers (and the bank, when one is
given), work out the physical layers the reference fed per slot, then translate them into the
candidate engine's convention and config field (:mod:`tracediff.adapters.conventions`). When the
candidate is already configured for those layers and the data still differ, the fix is in code
(concatenation order, an index path); when a side's numbering is unknown, say what to record.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from tracediff.adapters.conventions import (
    CONVENTIONS,
    FINAL_NORM,
    AuxLayers,
    PhysicalLayer,
    convention,
    format_layers,
    from_physical,
)
from tracediff.compare.plan.segments import SegmentDecision


@dataclass
class Fix:
    """What to change on the candidate so that it feeds what the reference fed."""

    target_layers: list[PhysicalLayer | None]  # per reference slot, physical numbering (None: unknown)
    candidate_layers: list[PhysicalLayer] | None  # what the candidate says it feeds now
    engine: str | None  # the candidate's framework, when known
    convention: str | None
    field: str | None
    value: list[int] | None  # the ids to set there; None when no config value can do it
    config_can_fix: bool
    reasons: list[str] = field(default_factory=list)
    target_from: str = ""  # where the target layers were read: reference meta, bank, candidate meta
    #: When the candidate's configured ids are another engine's ids for the target layers: which one
    numbering_mixup: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sentence(self) -> str:
        if self.value is not None and self.config_can_fix:
            where = f"{self.engine} " if self.engine else ""
            # Where the layers were read and what the numbering means: evidence.fix and the Fix box.
            text = (f"Set {where}{self.field} = {self.value} ({self.convention} numbering; physical layers "
                    f"{format_layers(self.target_layers)}).")
            mix = self.numbering_mixup
            if mix:
                text += (f" The candidate's ids {mix['ids']} are the {mix['convention']} numbering of those layers "
                         f"({mix['convention']}: {mix['meaning']}; {self.convention}: {mix['candidate_meaning']}): the "
                         f"same numbers name other layers in {self.engine or self.convention}.")
            return text
        return " ".join(self.reasons)


def bank_physical(ident: Any, j: int) -> PhysicalLayer | None:
    seg = ident.segments[j] if j < len(ident.segments) else None
    if seg is None or seg.best is None or seg.verdict not in ("match", "scaled"):
        return None
    if seg.best.kind == "post_norm":
        return FINAL_NORM
    return seg.best.hf_index


def propose_fix(decisions: list[SegmentDecision], ref_segments: int, ref_aux: AuxLayers | None,
                cand_aux: AuxLayers | None, candidate_engine: str | None, bank: Any = None,
                num_layers: int | None = None, engine_rule: Any = None) -> Fix:
    """The fix for a wiring mismatch (call it only when the segments are not wired the same).

    ``engine_rule``: the candidate engine's rule for its target as the recording stored it
    (:func:`tracediff.adapters.engine_rules.recorded_rule`, the rule `tracediff preflight` applies):
    its numbering replaces the engine's generic one, and its own limits apply (SGLang's DeepSeek path
    adds 1 when the first id is 1; vLLM's fails on id 0 there)."""
    target: list[PhysicalLayer | None] = [None] * ref_segments
    source = ""
    if ref_aux is not None and ref_aux.physical is not None and len(ref_aux.physical) == ref_segments:
        target, source = list(ref_aux.physical), "reference's recorded aux layers"
    elif bank is not None:
        target = [bank_physical(bank[0], j) for j in range(ref_segments)]
        source = "bank"
    if any(t is None for t in target) and cand_aux is not None and cand_aux.physical is not None:
        # A reference slot that a candidate segment carries unchanged holds that segment's layer.
        for d in decisions:
            if (d.reference is not None and d.duplicate_of is None and d.tier in ("exact", "near")
                    and d.candidate < len(cand_aux.physical) and target[d.reference] is None):
                target[d.reference] = cand_aux.physical[d.candidate]
                source = source or "candidate's recorded aux layers, where its segments match"
    cand_layers = cand_aux.physical if cand_aux is not None else None
    if cand_layers is None and bank is not None:
        named = [bank_physical(bank[1], i) for i in range(len(bank[1].segments))]
        cand_layers = named if all(n is not None for n in named) else None  # type: ignore[assignment]
    engine = candidate_engine or (cand_aux.framework if cand_aux is not None else None)
    conv = convention(engine) or (convention(cand_aux.convention) if cand_aux is not None else None)
    if engine_rule is not None:
        conv = CONVENTIONS[engine_rule.convention]
    fix = Fix(target, cand_layers, engine, conv.name if conv else None, conv.field if conv else None, None, False,
              target_from=source)
    unknown = [j for j, t in enumerate(target) if t is None]
    if unknown:
        fix.reasons.append(
            f"The physical layer of reference segment(s) {unknown} is not known: record the trainer's aux layer ids "
            f"with their convention (meta aux_layers = {{ids, convention}}) or pass --bank, and compare again.")
        return fix
    if cand_layers is not None and list(cand_layers) == list(target):
        fix.reasons.append(
            f"Both sides are configured for the same physical layers {format_layers(target)}, yet the data differ: "
            f"no config value can fix it. The difference is in code: the concatenation order, a layer-index path "
            f"(e.g. SGLang's DeepSeek/Kimi ids taken raw instead of +1), or which tensor is captured.")
        return fix
    if conv is None:
        fix.reasons.append(
            f"The reference fed physical layers {format_layers(target)} (HF hidden_states numbering, L = last layer "
            f"before the final norm); the candidate's engine and numbering are not recorded, so in each engine's "
            f"words: " + "; ".join(_in_words(target, CONVENTIONS[n], num_layers) for n in ("sglang", "vllm")) + ".")
        return fix
    if engine_rule is not None:
        from tracediff.adapters.engine_rules import fix_ids  # noqa: PLC0415  (preflight's fix: one source)

        value, problems = fix_ids(engine_rule, list(target), num_layers)  # type: ignore[arg-type]
    else:
        value, problems = from_physical(list(target), conv, num_layers)  # type: ignore[arg-type]
    fix.value = value
    fix.config_can_fix = value is not None and not problems
    fix.numbering_mixup = _numbering_mixup(cand_aux, target, conv, num_layers)
    if problems:
        fix.reasons.append(f"No {conv.name} config value reproduces the reference's layers "
                           f"{format_layers(target)}: " + "; ".join(problems) + ".")
    return fix


def _in_words(target: list[PhysicalLayer | None], conv: Any, num_layers: int | None) -> str:
    value, problems = from_physical(list(target), conv, num_layers)  # type: ignore[arg-type]
    if value is None or problems:
        return f"{conv.name}: not expressible ({'; '.join(problems)})"
    return f"{conv.name} {conv.field} = {value}"


def _numbering_mixup(cand_aux: AuxLayers | None, target: list[PhysicalLayer | None], conv: Any,
                     num_layers: int | None) -> dict[str, Any] | None:
    """The candidate's configured ids are what another engine's convention writes for the target
    layers (SGLang's ids given to vLLM, say): the classic cross-engine mix-up, worth naming."""
    ids = cand_aux.recorded if cand_aux is not None else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        return None
    for name, other in CONVENTIONS.items():
        if name in (conv.name, "capture"):
            continue
        value, problems = from_physical(list(target), other, num_layers)  # type: ignore[arg-type]
        if value is not None and not problems and sorted(value) == sorted(ids) and value != from_physical(
                list(target), conv, num_layers)[0]:
            return {"ids": list(ids), "convention": name, "meaning": other.meaning, "field": other.field,
                    "candidate_meaning": conv.meaning}
    return None


# ----------------------------------------------------------------------------- the two boxes
#: How each engine is recorded and sent the reference's token ids again (README "Record the server").
_SERVER_RECORDING = {
    "sglang": ("python -m sglang.launch_server ...", "--url http://127.0.0.1:30000"),
    "vllm": ("python -m vllm.entrypoints.openai.api_server ...", "--url http://127.0.0.1:8000 --engine vllm"),
}


def attach_next_steps(report: Any) -> None:
    """Fill ``report.fix`` (the Fix box) and ``report.record_next`` (what to record next) from its
    findings: what a person does after reading the report, with the commands to do it. Run it
    once every finding is in (compare does, last)."""
    report.fix = fix_box(report)
    report.record_next = record_next_box(report)


def _stores(side: Any) -> list[str]:
    """A side's stores as the command line gives them (several for a side read from several)."""
    stores = side.meta.get("stores") if isinstance(side.meta, dict) else None
    return [str(s) for s in stores] if isinstance(stores, list) and stores else [str(side.path)]


def _q(paths: list[str]) -> str:
    return " ".join(shlex.quote(p) for p in paths)


def _compare_command(report: Any, extra: str = "") -> str:
    ref, cand = _stores(report.reference), _stores(report.candidate)
    refs = _q(ref) if len(ref) == 1 else " ".join(f"--reference {shlex.quote(r)}" for r in ref)
    return f"tracediff compare {refs} {_q(cand)}{extra}"


def _rerecord_commands(report: Any, engine: str | None) -> list[str]:
    """Record the candidate again (its engine's adapter when known), replay the reference's tokens, compare."""
    cand = _stores(report.candidate)
    out_store = shlex.quote(cand[0])
    ref = _q(_stores(report.reference)[:1])
    recorded = _recorded_command(report.candidate)
    if engine in _SERVER_RECORDING:
        launch, url = _SERVER_RECORDING[engine]
        return [recorded or f"tracediff record --adapter {engine} -o {out_store} --overwrite -- {launch}",
                f"tracediff send {ref} {url}", _compare_command(report)]
    # The engine is not known: "..." is the command (and adapter) the candidate was recorded with.
    return [recorded or f"tracediff record -o {out_store} --overwrite -- ...", _compare_command(report)]


def _recorded_command(side: Any) -> str | None:
    """The command line that recorded ``side``, with --overwrite (the store exists); None when the
    store does not record one."""
    argv = list(getattr(side, "recorded_by", None) or [])
    if argv[:2] != ["tracediff", "record"]:
        return None
    options = argv[:argv.index("--")] if "--" in argv else argv
    if "--overwrite" not in options and "--append" not in options:
        argv.insert(2, "--overwrite")
    return shlex.join(argv)


#: Where a draft-chain root cause's tensor is decided: what to diff between the draft checkpoint and
#: config each side loaded (docs/draft-chain.md).
DRAFT_CHAIN_LOOK = {
    "fc_out": "the fc weight (fc.weight: another checkpoint, loaded transposed, or quantised on one side)",
    "layer_in": "the token embedding (embed_tokens.weight, or the target's when the draft shares it) and, after "
                "step 0, which hidden state the draft recycles into its next step (code)",
    "layer_out": "the decoder layer's config and weights: rope_theta, rope_scaling, sliding_window / layer_types, "
                 "rms_norm_eps of its norms, num_key_value_heads, head_dim, and its attention and MLP weights",
    "norm_out": "the final norm: norm.weight and rms_norm_eps",
    "logits_topk": "the head: lm_head.weight (the draft's own, not the target's), draft_vocab_size, and the d2t map "
                   "(offsets, draft id + d2t[id]; not absolute ids)",
}


def _draft_chain_fix(report: Any, finding: Any) -> dict[str, Any]:
    """The Fix box of a root cause inside the draft: no fc wiring value fixes it; where to look, and the
    commands to record the candidate's chain again and compare."""
    ev = finding.evidence
    point, tap = str(ev.get("point")), str(ev.get("tap_candidate"))
    commands = _rerecord_commands(report, None)
    if commands and commands[0].startswith("tracediff record ") and "--draft-chain" not in commands[0]:
        commands[0] = commands[0].replace("tracediff record ", "tracediff record --draft-chain ", 1)
    steps = [{"text": f"The draft's inputs match up to {tap}; the draft itself differs there. Diff what each side's "
                      f"draft loaded: {DRAFT_CHAIN_LOOK.get(point, point)}.", "commands": []},
             {"text": "Once the candidate's draft is changed, record its chain again and compare:", "commands": commands}]
    return {"engine": None, "field": None, "field_location": None, "value": None, "convention": None,
            "target_layers": [], "target_from": f"the draft chain ({tap})", "config_can_fix": False,
            "finding": finding.kind, "how": "draft", "steps": steps}


def _root_fix(report: Any) -> tuple[Any, dict[str, Any]] | None:
    """The first root cause that carries a fix, and that fix."""
    for cause in report.causes():
        finding = report.findings[cause.finding]
        if finding.kind == "draft_chain":
            return finding, {"draft_chain": True}
        fix = finding.evidence.get("fix")
        if isinstance(fix, dict):
            return finding, fix
    return None


def _target_unknown(fix: dict[str, Any]) -> bool:
    return any(t is None for t in fix.get("target_layers") or [None])


def fix_box(report: Any) -> dict[str, Any] | None:
    """The Fix box: the config field and value in the candidate engine's numbering with the commands
    to record again and compare, or why no config value fixes it (then where to look). None when
    no root cause carries a fix, or when the layers to feed are not known (what to record next)."""
    found = _root_fix(report)
    if found is None:
        return None
    finding, fix = found
    if fix.get("draft_chain"):
        return _draft_chain_fix(report, finding)
    if _target_unknown(fix):
        return None
    box = {key: fix.get(key) for key in ("engine", "field", "value", "convention", "target_layers", "target_from",
                                          "config_can_fix")}
    # "eagle_config.x (nested in the draft config)": the name to set on its own, where it lives apart.
    name, _, where = str(fix.get("field") or "").partition(" (")
    box["field"], box["field_location"] = (name or None), where.rstrip(")") or None
    box["finding"] = finding.kind
    steps: list[dict[str, Any]] = []
    # config: set field = value; engine: a value per engine (the candidate's is not recorded); code: no value can.
    box["how"] = ("config" if fix.get("config_can_fix") and fix.get("value") is not None
                  else "engine" if fix.get("convention") is None else "code")
    if box["how"] == "engine":
        steps.append({"text": " ".join(str(r) for r in fix.get("reasons") or []), "commands": []})
        steps.append({"text": "Set it in the candidate's engine, then record the candidate again as before, with its "
                              "engine's adapter (--adapter sglang or vllm: it records the ids and their numbering), "
                              "and compare:",
                      "commands": _rerecord_commands(report, None)})
    elif box["how"] == "config":
        conv = CONVENTIONS.get(str(fix.get("convention")))
        steps.append({"text": f"{fix.get('convention')} numbering"
                              + (f" ({conv.meaning})" if conv else "")
                              + f": physical layers {format_layers(fix.get('target_layers'))}, what the reference "
                                f"fed (from the {fix.get('target_from')})"
                              + (f"; the candidate feeds {format_layers(fix.get('candidate_layers'))} now."
                                 if fix.get("candidate_layers") and fix.get("candidate_layers") != fix.get("target_layers")
                                 else "."),
                      "commands": []})
        mix = fix.get("numbering_mixup")
        if isinstance(mix, dict):
            steps.append({"text": f"The candidate's ids {mix['ids']} are the {mix['convention']} numbering of those "
                                  f"layers: the same numbers name other layers in {fix.get('engine') or fix.get('convention')}.",
                          "commands": []})
        steps.append({"text": "Then record the candidate again with that setting and compare:",
                      "commands": _rerecord_commands(report, fix.get("engine"))})
    else:
        steps.append({"text": "No config value fixes this. " + " ".join(str(r) for r in fix.get("reasons") or []),
                      "commands": []})
        steps.append({"text": "Once it is changed, record the candidate again and compare:",
                      "commands": _rerecord_commands(report, fix.get("engine"))})
    box["steps"] = steps
    return box


def _bank_used(report: Any) -> bool:
    return any(m.bank_layer for m in report.segment_map)


def _bank_step(report: Any) -> dict[str, Any]:
    return {"text": "A bank of every layer of the target, recorded on the same token ids, names each segment's "
                    "layer: record one and compare with it:",
            "commands": ["tracediff record --adapter hf -o bank.zarr -- python run_target_on_samples.py",
                         _compare_command(report, " --bank bank.zarr")]}


def record_next_box(report: Any) -> dict[str, Any] | None:
    """What to record next, when this report cannot decide: a pair the data cannot tell from a
    neighbouring layer, layers no side records, one recording on both sides. None otherwise."""
    reasons: list[str] = []
    steps: list[dict[str, Any]] = []
    ref = _q(_stores(report.reference)[:1])
    same = [f for f in report.findings if f.kind == "same_recording"]
    if same:
        reasons.append("Both sides are one recording: this compare says nothing about the server.")
        steps.append({"text": "Record the server on the reference's token ids and compare the two:",
                      "commands": [f"tracediff record --adapter sglang -o server.zarr -- "
                                   f"{_SERVER_RECORDING['sglang'][0]}",
                                   f"tracediff send {ref} {_SERVER_RECORDING['sglang'][1]}",
                                   f"tracediff compare {ref} server.zarr"]})
    undecided = [f for f in report.findings if f.kind == "segment_undecided"
                 or (f.kind == "config" and f.severity == "error")]
    if undecided:
        pairs = len(undecided)
        reasons.append(f"The data cannot tell {pairs} segment pair{'s' if pairs != 1 else ''} from a neighbouring "
                       f"layer at this depth ({', '.join(sorted({f.kind for f in undecided}))}).")
        # Calibration rows already used and still undecided: only a bank can tell.
        if report.plan.calibration is None:
            dtype = report.plan.compute_dtype or "bfloat16"
            steps.append({"text": "Record calibration rows on the reference (a few of its sequences recomputed "
                                  "with the trainer's weights in the server's compute dtype), and compare again:",
                          "commands": [f"tracediff calibrate {ref} --model TARGET_DIR --server-dtype {dtype}",
                                       _compare_command(report)]})
        if not _bank_used(report):
            steps.append(_bank_step(report))
    found = _root_fix(report)
    if found is not None and not found[1].get("draft_chain") and _target_unknown(found[1]):
        finding, fix = found
        reasons.append(f"{finding.kind} has no fix value: " + " ".join(str(r) for r in fix.get("reasons") or []))
        steps.append({"text": "Record the reference's aux-layer ids with their numbering (tracediff record --aux-layers "
                              "0,3,6 --convention hf ..., tracediff.record(..., meta={\"aux_layers\": {\"ids\": [...], "
                              "\"convention\": \"hf\"}}), or the trainer's adapter: --adapter speculators / "
                              "specforge), and compare again.",
                      "commands": []})
        if not _bank_used(report):
            steps.append(_bank_step(report))
    if not reasons:
        return None
    unique = [s for k, s in enumerate(steps) if s not in steps[:k]]
    return {"reasons": reasons, "steps": unique}
