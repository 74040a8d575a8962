"""The fix, in the candidate engine's own words: which aux-layer ids to set, or why no config can.

From the segment decisions and what each side says about its aux layers (and the bank, when one is
given), work out the physical layers the reference fed per slot, then translate them into the
candidate engine's convention and config field (:mod:`tracediff.adapters.conventions`). When the
candidate is already configured for those layers and the data still differ, the fix is in code
(concatenation order, an index path); when a side's numbering is unknown, say what to record.
"""

from __future__ import annotations

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
from tracediff.segments import SegmentDecision


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
            text = (f"Set {where}{self.field} = {self.value} ({self.convention} numbering; physical layers "
                    f"{format_layers(self.target_layers)} in HF hidden_states numbering, from the {self.target_from}).")
            mix = self.numbering_mixup
            if mix:
                text += (f" The candidate's ids {mix['ids']} are the {mix['convention']} numbering of those layers "
                         f"({mix['convention']}: {mix['meaning']}; {self.convention}: {mix['candidate_meaning']}): the "
                         f"same numbers name other layers in {self.engine or self.convention}.")
            return text
        return " ".join(self.reasons)


def _bank_physical(ident: Any, j: int) -> PhysicalLayer | None:
    seg = ident.segments[j] if j < len(ident.segments) else None
    if seg is None or seg.best is None or seg.verdict not in ("match", "scaled"):
        return None
    if seg.best.kind == "post_norm":
        return FINAL_NORM
    return seg.best.hf_index


def propose_fix(decisions: list[SegmentDecision], ref_segments: int, ref_aux: AuxLayers | None,
                cand_aux: AuxLayers | None, candidate_engine: str | None, bank: Any = None,
                num_layers: int | None = None) -> Fix:
    """The fix for a wiring mismatch (call it only when the segments are not wired the same)."""
    target: list[PhysicalLayer | None] = [None] * ref_segments
    source = ""
    if ref_aux is not None and ref_aux.physical is not None and len(ref_aux.physical) == ref_segments:
        target, source = list(ref_aux.physical), "reference's recorded aux layers"
    elif bank is not None:
        target = [_bank_physical(bank[0], j) for j in range(ref_segments)]
        source = "bank"
    if any(t is None for t in target) and cand_aux is not None and cand_aux.physical is not None:
        # A reference slot that a candidate segment carries unchanged holds that segment's layer.
        for d in decisions:
            if (d.reference is not None and d.duplicate_of is None and d.tier in ("exact", "near")
                    and d.candidate < len(cand_aux.physical) and target[d.reference] is None):
                target[d.reference] = cand_aux.physical[d.candidate]
                source = source or "candidate's recorded aux layers, where its segments match"
    cand_layers = cand_aux.physical if cand_aux is not None else None
    engine = candidate_engine or (cand_aux.framework if cand_aux is not None else None)
    conv = convention(engine) or (convention(cand_aux.convention) if cand_aux is not None else None)
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
