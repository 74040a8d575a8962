"""What `tracediff lint` found: plain dataclasses with a stable JSON form (:meth:`LintResult.to_dict`).

The renderers (:mod:`tracediff.report.lint`) read these objects and compute nothing; the checks that
fill them are in :mod:`tracediff.lint.checks`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Finding kinds (the JSON report's stable vocabulary).
KINDS = (
    "zero_rows",          # rows of a slot that are all zeros
    "constant_rows",      # rows whose values are all one number (not zero)
    "nonfinite_rows",     # rows holding NaN or Inf
    "duplicate_rows",     # two positions of one sample (other tokens) with identical values
    "duplicate_samples",  # two samples whose slots are identical
    "post_norm",          # a slot meant to be a raw hidden state holds the final norm's output
    "other_depth",        # a slot whose profile fits another layer of the target
    "fp8_scales",         # zero, negative or non-finite FP8 scales; NaN codes; saturated values
    "slot_order",         # slots named as layers the target does not have
    "cannot_tell",        # a check that needs --target or --bank
)
SEVERITIES = ("error", "warning", "info")


@dataclass
class LintFinding:
    """One finding: ``slot`` is the slot's index (None: the whole data set)."""

    kind: str
    severity: str
    message: str
    slot: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class SlotReport:
    """One slot (segment) of every row: its defect counts and its profile."""

    index: int
    label: str
    kind: str  # aux, layer, embedding, pre_norm, post_norm, unknown (what it is meant to hold)
    rows: int = 0
    zero_rows: int = 0
    constant_rows: int = 0
    nonfinite_rows: int = 0
    duplicate_rows: int = 0
    rms_mean: float | None = None  # mean per-row RMS over the rows with data
    rms_cv: float | None = None  # its coefficient of variation across rows
    massive_dims: list[int] = field(default_factory=list)
    massive_ratio: float | None = None  # largest dimension's RMS / the median dimension's
    unit_rms_after_norm: float | None = None  # share of rows whose rms(x / final norm weight) is 1 (--target)
    depth_fit: dict[str, Any] | None = None  # with --bank: the bank segment it fits best, and the claimed one


@dataclass
class LintResult:
    """Everything lint found in one data set."""

    source: str
    format: str  # trace store, speculators, specforge
    storage: str  # how the values are stored: bfloat16, float8_e4m3fn with per-token scales...
    samples: int
    rows: int
    width: int
    segment_size: int
    slots: list[SlotReport]
    findings: list[LintFinding] = field(default_factory=list)
    fp8: dict[str, Any] | None = None
    checks: dict[str, str] = field(default_factory=dict)  # what each check used, or why it did not run
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        return "findings" if any(f.severity in ("error", "warning") for f in self.findings) else "clean"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "findings" else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.verdict  # not "verdict": that key marks a compare report
        out["exit_code"] = self.exit_code
        out["counts"] = self.counts()
        out["schema"] = "tracediff.lint/1"
        return out


__all__ = ["KINDS", "SEVERITIES", "LintFinding", "LintResult", "SlotReport"]
