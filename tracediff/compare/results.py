"""Results of a compare: plain dataclasses with a stable, versioned JSON form.

Renderers (``tracediff.report``) read these objects and format them; they never compute. The JSON
schema is documented in ``docs/report-schema.md``; bump ``REPORT_SCHEMA_VERSION`` on any change that
is not a pure addition.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_SCHEMA_VERSION = 1

FINDING_KINDS: tuple[str, ...] = (
    "shape",
    "dtype",
    "segment_order",
    "segment_missing",
    "segment_extra",
    "segment_duplicate",
    "segment_scale",
    "segment_value",
    "segment_undecided",
    "token_offset",
    "position_offset",
    "sequence_prefix",
    "sequence_mismatch",
    "same_recording",
    "coverage",
    "nonfinite",
    "config",
    "precision",
    "token_pairing",
    "segment_subset",
    "sequence_insertion",
    "replay",
    "draft_vocabulary",
    "draft_embedding",
    "draft_path",
    "cannot_tell",
    "swapped_roles",
    # Row-model relations (issue #52: tracediff/compare/findings/slots.py)
    "row_model",
    "final_norm",
    "rotation",
    "embedding_scale",
    "slot_token_offset",
    "dimension_scale",
    # The first divergent tap inside the draft's forward (issue #53: tracediff/compare/chain.py)
    "draft_chain",
)
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")


@dataclass
class Finding:
    """One thing a person should know: what kind, how bad, one actionable sentence, the numbers."""

    kind: str
    severity: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    #: What is wrong in a few words ("the candidate's segments are shifted by one slot"): the verdict
    #: line names a root cause by it. "" where none was written (its kind then stands for it).
    summary: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")


@dataclass
class Precondition:
    """What one kind of conclusion needs, and whether this compare has it
    (:mod:`tracediff.compare.findings.evidence`).

    ``status``: ``met`` (recorded), ``supported`` (not recorded, but the data agree with what was
    assumed: the conclusions stand, with a warning), ``unmet`` (the conclusions in ``needed_by`` are
    withheld: one ``cannot_tell`` finding says to record ``record``)."""

    name: str  # token_ids | segment_sizes
    status: str  # met | supported | unmet
    message: str
    record: str  # what to record so that the next compare has it ("" when met)
    needed_by: list[str]  # the finding kinds that depend on it
    evidence: dict[str, Any] = field(default_factory=dict)
    short: str = ""  # what is missing in a few words, for the verdict line


@dataclass
class Side:
    """One of the two traces as compare saw it."""

    path: str
    tap: str
    role: str
    rows: int
    valid_rows: int
    writers: list[str]
    width: int
    dtype: str
    segment_size: int
    segments: int
    segment_labels: list[str]
    sequences: int
    meta: dict[str, Any]
    aux_layer_config: dict[str, Any]
    # The aux layers this side says it feeds, as recorded and in the physical numbering (HF
    # hidden_states index, L = last layer before the final norm, "final_norm"); None if unknown.
    aux_layers: dict[str, Any] | None = None
    # The command line that recorded this side (`tracediff record ... -- CMD`), as the store keeps it;
    # [] for a store written another way (in-process recorder, import).
    recorded_by: list[str] = field(default_factory=list)
    # The row model the side's store records (tracediff.store.row_model: what each slot holds, with
    # ``slots_text`` naming each); None (and left out of the JSON) when it records none.
    row_model: dict[str, Any] | None = None


@dataclass
class RowRef:
    """A row named the way a person finds it again: sequence key, position, token."""

    seq: str
    position: int
    token_id: int


@dataclass
class SegmentMatch:
    """Where one candidate segment comes from: the reference segment it matches, or None."""

    candidate: int
    reference: int | None
    status: str  # same | moved | related | duplicate | extra
    cosine: float | None  # mean cosine with that reference segment on the plan sample
    runner_up: int | None
    runner_up_cosine: float | None
    candidate_label: str
    reference_label: str | None
    bank_layer: str | None = None  # filled when compare ran with --bank
    standardised_cosine: float | None = None  # what the decision used (each dimension in robust units)
    relation: str | None = None  # same | transformed | other (matched segments)
    relative_error: float | None = None  # standardised relative error of the identity on the plan sample
    transform: dict[str, Any] | None = None  # the fitted transform, for "transformed"


@dataclass
class SegmentMetrics:
    """Numbers of one matched (candidate, reference) segment pair over every aligned row."""

    candidate: int
    reference: int
    rows: int
    cos_mean: float
    cos_p1: float
    cos_min: float
    norm_ratio_mean: float
    norm_ratio_p1: float
    norm_ratio_p50: float
    norm_ratio_p99: float
    rel_l2: float
    rel_diff_mean: float
    rel_diff_max: float
    max_abs_diff: float
    max_abs_diff_row: RowRef | None
    nonfinite_candidate: int
    nonfinite_reference: int
    worst_rows: list[dict[str, Any]]
    cos_by_position: list[list[float]]  # [[position bucket start, mean cosine, rows], ...]
    norm_ratio_hist: dict[str, list[float]]  # {"edges": [...], "counts": [...]} on log2 scale
    # The decision metric: relative error with every dimension in units of the reference segment's
    # robust scale (massive activations cannot dominate it). Whole pair, and per row (row error
    # over the pair's mean reference size) at the median, p99 and max.
    std_rel_error: float = float("nan")
    std_row_error_p50: float = float("nan")
    std_row_error_p99: float = float("nan")
    std_row_error_max: float = float("nan")
    # Per position bucket, the decision metric: the RMS of the per-row standardised errors above
    # ([[bucket start, error, rows], ...]; the pair's std_rel_error is the RMS over every bucket's rows).
    std_error_by_position: list[list[float]] = field(default_factory=list)
    # The thresholds the findings hold this pair's std_rel_error to: within numerics_budget it is the
    # same tensor; beyond, a precision warning; beyond drift_limit (the noise model's limit) other
    # data (segment_value). Also plan.numerics_budgets[reference], plan.noise[reference].
    numerics_budget: float = float("nan")
    drift_limit: float = float("nan")
    # The noise model behind them (tracediff.compare.plan.noise): where the expected drift came from (calibrated |
    # assumed), its size, what set the limit (neighbour | consistency | assumed), the estimated
    # distance to a neighbouring layer (NaN: not estimated).
    noise_source: str = ""
    expected_drift: float = float("nan")
    limit_source: str = ""
    neighbour_distance: float = float("nan")


@dataclass
class SegmentProfile:
    """One segment pair that is not a healthy match, per position: a segment a wiring finding calls
    wrong (``segment_missing``, ``segment_extra``, ``segment_duplicate``) against its closest
    counterpart, or one row group of a ``segment_subset`` finding (the group, then "the other rows").

    Every ``*_by_position`` series is ``[[bucket start, value, rows], ...]`` over the same position
    buckets as ``SegmentMetrics.cos_by_position``; buckets without a finite value are left out.
    """

    kind: str  # segment_missing | segment_extra | segment_duplicate | segment_subset
    candidate: int
    reference: int
    group: str | None  # segment_subset: the row group's description, or "the other rows"; else None
    rows: int
    cos_mean: float  # raw cosine, mean over rows
    std_cos_mean: float  # standardised cosine (what segment matching decides on); NaN for subset groups
    norm_ratio_mean: float  # |candidate| / |reference|, mean over rows
    std_rel_error: float  # RMS of the per-row standardised errors (as SegmentMetrics.std_rel_error)
    numerics_budget: float  # the reference segment's numerics budget
    drift_limit: float  # the noise model's limit: a row beyond it is "off" (subsets), a pair other data
    same_tensor_cosine: float  # standardised cosine at or above which matching calls a pair the same tensor
    cos_by_position: list[list[float]] = field(default_factory=list)
    std_cos_by_position: list[list[float]] = field(default_factory=list)  # [] for subset groups
    norm_ratio_by_position: list[list[float]] = field(default_factory=list)
    std_error_by_position: list[list[float]] = field(default_factory=list)


@dataclass
class Plan:
    """What compare decided from metadata and a sample, before the streaming pass."""

    tap_reference: str
    tap_candidate: str
    segment_size: int
    segment_size_source: str  # meta | option | inferred
    sequences_reference: int
    sequences_candidate: int
    sequences_aligned: int
    sequence_deltas: dict[str, int]  # position delta (candidate - reference) -> sequences
    label_offset: int
    offset_scores: dict[str, float]  # offset -> similarity score on the sample
    pairs: int
    candidate_rows_unaligned: int
    candidate_rows_duplicate: int
    candidate_rows_invalid: int
    reference_rows_uncovered: int
    sample_rows: int
    noise_floor: float  # expected standardised 1 - cosine from storage precision alone
    notes: list[str] = field(default_factory=list)
    # Of the unaligned candidate rows, those past the end of the reference sequence they align with
    # (a server recording one more position than the trainer kept): coverage, never an error.
    candidate_rows_trailing: int = 0
    # Labelled sequences whose positions restart (packed samples), split into their samples, per side.
    sequences_split: dict[str, int] = field(default_factory=lambda: {"reference": 0, "candidate": 0})
    noise_floor_error: float = 0.0  # expected standardised relative error from storage precision alone
    numerics_budget: float = 0.0  # the largest of numerics_budgets
    numerics_budgets: list[float] = field(default_factory=list)  # per reference segment: what numerics explain
    budget_depths: list[int | None] = field(default_factory=list)  # per reference segment: the depth assumed
    compute_dtype: str = ""  # the coarser dtype, whose rounding bounds the compute noise
    reference_segment_size: int = 0
    candidate_segment_size: int = 0
    token_pairing: dict[str, Any] = field(default_factory=dict)  # next-token agreement (tracediff.compare.align.pairing)
    candidate_rows_replica: int = 0  # pairs whose reference row another candidate writer group pairs too
    # The noise model (tracediff.compare.plan.noise): per reference segment its drift, budget, limit and their
    # sources (SegmentNoise.to_dict()); how the compute dtype was decided; the calibration rows used.
    noise: list[dict[str, Any]] = field(default_factory=list)
    compute: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    drift_limits: list[float] = field(default_factory=list)  # per reference segment: beyond it, other data


@dataclass
class Report:
    """Everything compare found; ``to_json`` is the CI contract."""

    reference: Side
    candidate: Side
    plan: Plan
    segment_map: list[SegmentMatch]
    matrix: list[list[float]]  # [candidate segment][reference segment] mean cosine
    metrics: list[SegmentMetrics]
    findings: list[Finding]
    config_diff: list[dict[str, Any]]
    tracediff_version: str
    schema_version: int = REPORT_SCHEMA_VERSION
    matrix_standardised: list[list[float]] = field(default_factory=list)  # what segment matching decided on
    replay: dict[str, Any] | None = None  # compare --draft / tracediff replay (tracediff.replay.ReplayResult)
    # What differs, per position: each wrong segment against its closest counterpart, each subset's groups.
    position_profiles: list[SegmentProfile] = field(default_factory=list)
    # The Fix box (tracediff.compare.findings.remedy.attach_next_steps): the config field and value in the candidate engine's
    # numbering, or why no config value can fix it, and the commands to record again and compare; None
    # when no fix is known.
    fix: dict[str, Any] | None = None
    # The "what to record next" box: why this report cannot decide, and what to record so that the
    # next one can (calibration rows, a bank, the aux-layer ids); None when nothing is missing.
    record_next: dict[str, Any] | None = None
    # What each kind of conclusion needed and whether this compare had it (tracediff.compare.findings.evidence);
    # an unmet one withholds the conclusions that need it (verdict cannot_tell).
    preconditions: list[Precondition] = field(default_factory=list)
    # The draft chain (record --draft-chain on both sides): one entry per tap in forward order
    # (tracediff.compare.chain.ChainLink); None (absent from the JSON) without one.
    chain: list[dict[str, Any]] | None = None
    # `tracediff replay SERVER --against-chain`: the checkpoint replayed on the server's chain inputs, per
    # draft step (tracediff.replay.chain.summarise); None (absent from the JSON) otherwise.
    replay_chain: dict[str, Any] | None = None

    @property
    def verdict(self) -> str:
        if any(f.kind == "cannot_tell" and f.severity == "error" for f in self.findings):
            return "cannot_tell"
        return "mismatch" if any(f.severity == "error" for f in self.findings) else "match"

    def exit_code(self, fail_on: str = "error") -> int:
        """0 match, 1 mismatch, 2 cannot tell (the evidence a conclusion needs is missing: the report
        says what to record); ``fail_on='warning'`` also fails on warnings (strict CI)."""
        if self.verdict == "cannot_tell":
            return 2
        levels = ("error",) if fail_on == "error" else ("error", "warning")
        return 1 if any(f.severity in levels for f in self.findings) else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}

    def causes(self) -> list[Cause]:
        """The findings grouped by cause: one entry per root cause (an error finding that no other
        finding explains), in finding order, with the findings that follow from it.

        A finding follows from another when its evidence names that finding's kind as
        ``explained_by``; it is grouped under the first root cause of that kind. A ``config`` finding
        so marked records the cause in the recorded configuration (it is no consequence of it) and is
        listed apart. Severities, counts and exit codes do not change: every finding is still counted.
        """
        roots = [i for i, f in enumerate(self.findings) if f.severity == "error" and not _explained_by(f)]
        # A finding without a summary is named by its kind (the message follows in every report).
        out = [Cause(i, self.findings[i].kind, self.findings[i].summary or self.findings[i].kind) for i in roots]
        first_of_kind: dict[str, Cause] = {}
        for c in out:
            first_of_kind.setdefault(c.kind, c)
        for i, f in enumerate(self.findings):
            cause = first_of_kind.get(_explained_by(f) or "")
            if cause is not None and i != cause.finding:
                (cause.config if f.kind == "config" else cause.consequences).append(i)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for side in ("reference", "candidate"):  # (absent rather than null: reports of stores without one unchanged)
            if isinstance(out.get(side), dict) and out[side].get("row_model") is None:
                out[side].pop("row_model", None)
        for key in ("chain", "replay_chain"):
            if out.get(key) is None:
                out.pop(key, None)
        out["verdict"] = self.verdict
        out["counts"] = self.counts()
        out["causes"] = [asdict(c) for c in self.causes()]
        return json_safe(out)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, allow_nan=False)


@dataclass
class Cause:
    """One root cause of a mismatch and what follows from it, as indices into ``Report.findings``."""

    finding: int  # the root-cause finding
    kind: str
    summary: str  # its summary, for the verdict line
    consequences: list[int] = field(default_factory=list)  # findings it explains (their explained_by)
    config: list[int] = field(default_factory=list)  # config findings that record it (explained_by too)


def _explained_by(f: Finding) -> str | None:
    value = f.evidence.get("explained_by") if isinstance(f.evidence, dict) else None
    return value if isinstance(value, str) and value else None


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null (documented in the schema)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
