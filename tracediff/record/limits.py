"""Sampling and resource limits of a recording (torch-free: the CLI validates them before it runs
anything)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracediff.errors import UsageError
from tracediff.record.sampling import SAMPLE_RULE, check_rate
from tracediff.store import PHASES


@dataclass
class Limits:
    """Sampling and resource controls; per tap and per process. ``None`` means unlimited.

    ``max_bytes`` caps the rows recorded; with ``ring`` it is a budget instead: the writer keeps the
    most recent rows within it, dropping its oldest segments whole (:mod:`tracediff.store.ring`);
    with ``ring_store`` too, the budget is the whole store's, shared by its processes and taps.
    ``sample_requests``: keep whole requests chosen by :func:`tracediff.sampled` of their prompt;
    ``max_requests``: keep the first N requests (of those chosen) whole (:mod:`tracediff.record.sampling`)."""

    max_rows: int | None = None
    max_bytes: int | None = None
    every_n_steps: int = 1
    first_n_steps: int | None = None
    phases: frozenset[str] | None = None
    sample_requests: float | None = None
    max_requests: int | None = None
    ring: bool = False
    ring_store: bool = False

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes", "first_n_steps", "max_requests"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise UsageError(f"limit {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise UsageError(f"limit every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        if self.phases is not None:
            phases = frozenset(str(p).lower() for p in self.phases)
            unknown = phases - set(PHASES)
            if unknown:
                raise UsageError(f"unknown phase(s) {sorted(unknown)}; known phases: {', '.join(PHASES)}")
            self.phases = phases
        if self.sample_requests is not None:
            try:
                self.sample_requests = check_rate(self.sample_requests)
            except ValueError as exc:
                raise UsageError(f"limit sample_requests (--sample-requests): {exc}") from None
        if not isinstance(self.ring, bool):
            raise UsageError(f"limit ring must be true or false, got {self.ring!r}")
        if not isinstance(self.ring_store, bool):
            raise UsageError(f"limit ring_store must be true or false, got {self.ring_store!r}")
        if self.ring_store and not self.ring:
            raise UsageError("limit ring_store (--ring-store) shares the --ring budget over the whole store: give --ring")
        if self.ring and not self.max_bytes:
            raise UsageError("limit ring (--ring) keeps the most recent rows within --max-bytes: give --max-bytes SIZE")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> Limits:
        """Limits from :meth:`as_dict`'s form (how ``tracediff record`` hands them to its processes);
        the keys that only describe (``sample_rule``) and null values are left out."""
        fields = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in (values or {}).items() if k in fields and v is not None})

    @property
    def samples_requests(self) -> bool:
        """Whether rows are chosen by request (``sample_requests`` or ``max_requests``)."""
        return self.sample_requests is not None or self.max_requests is not None

    def wants_step(self, step: int) -> bool:
        if self.first_n_steps is not None and step >= self.first_n_steps:
            return False
        return step % self.every_n_steps == 0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_rows": self.max_rows,
            "max_bytes": self.max_bytes,
            "every_n_steps": self.every_n_steps,
            "first_n_steps": self.first_n_steps,
            "phases": sorted(self.phases) if self.phases is not None else None,
        }
        # Only when set: the limits of a recording without them read as they always did.
        if self.sample_requests is not None:
            out["sample_requests"] = self.sample_requests
            out["sample_rule"] = SAMPLE_RULE
        if self.max_requests is not None:
            out["max_requests"] = self.max_requests
        if self.ring:
            out["ring"] = True
        if self.ring_store:
            out["ring_store"] = True
        return out
