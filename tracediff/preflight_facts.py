"""What ``tracediff preflight`` finds, as data: the facts read from the draft and target folders, each
engine's view, the checks, and the whole result (:mod:`tracediff.preflight` reads and decides,
:mod:`tracediff.preflight_mtp` adds the MTP heads' checks; both build these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tracediff.adapters.conventions import PhysicalLayer
from tracediff.adapters.engine_rules import Resolution

#: The format of ``preflight --json``.
FORMAT = 1


@dataclass
class DraftFacts:
    path: str
    architectures: list[str]
    ids: dict[str, list[int] | None]  # top / eagle_config
    hidden_size: int | None
    target_hidden_size: int | None
    vocab_size: int | None
    draft_vocab_size: int | None
    norm_before_fc: bool | None
    fc_shape: list[int] | None
    has_embedding: bool
    has_lm_head: bool
    lm_head_rows: int | None
    d2t: dict[str, Any]
    t2d: dict[str, Any]
    speculators_format: bool
    files: list[str] = field(default_factory=list)
    mtp_layers: list[int] = field(default_factory=list)  # an MTP checkpoint's layers with eh_proj
    eh_proj_shape: list[int] | None = None


@dataclass
class TargetFacts:
    path: str | None
    model_type: str | None
    architectures: list[str]
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    tie_word_embeddings: bool | None
    family: str
    embedding_scale: str | None


@dataclass
class Check:
    kind: str  # layers | default_layers | ignored_ids | missing_slot | engine_error | fc_shape | d2t | vocab | ...
    severity: str  # error | warning | info
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineView:
    resolution: Resolution
    verdict: str  # same | different | unknown
    fix: dict[str, Any] | None = None
    #: The row model the engine builds for this draft (engine_rules.engine_row_model): EAGLE-3 with K
    #: slots, or MTP with the hidden state before / after the final norm.
    row_model: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.resolution.to_dict(), "verdict": self.verdict, "fix": self.fix, "row_model": self.row_model}


@dataclass
class TrainerView:
    source: str  # "speculators", "specforge", "store PATH", "--trainer-layers", or "unknown"
    physical: list[PhysicalLayer] | None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Preflight:
    draft: DraftFacts
    target: TargetFacts
    trainer: TrainerView
    engines: list[EngineView]
    checks: list[Check]

    @property
    def verdict(self) -> str:
        """``same``, ``different``, or ``unknown`` when the only errors are layers it cannot tell."""
        errors = [c for c in self.checks if c.severity == "error"]
        if not errors:
            return "same"
        return "unknown" if all(c.kind == "layers_unknown" for c in errors) else "different"

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "same" else 1

    def to_dict(self) -> dict[str, Any]:
        draft = asdict(self.draft)
        for key in ("d2t", "t2d"):
            draft[key] = {k: v for k, v in draft[key].items() if not k.startswith("_")}
        return {"preflight": {"format": FORMAT}, "verdict": self.verdict, "exit_code": self.exit_code,
                "draft": draft, "target": asdict(self.target), "trainer": asdict(self.trainer),
                "engines": [e.to_dict() for e in self.engines], "checks": [asdict(c) for c in self.checks]}
