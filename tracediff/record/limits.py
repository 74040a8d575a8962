"""Sampling and resource limits of a recording (torch-free: the CLI validates them before it runs
anything)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracediff.errors import UsageError
from tracediff.store import PHASES


@dataclass
class Limits:
    """Sampling and resource controls; per tap and per process. ``None`` means unlimited."""

    max_rows: int | None = None
    max_bytes: int | None = None
    every_n_steps: int = 1
    first_n_steps: int | None = None
    phases: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes", "first_n_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise UsageError(f"limit {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise UsageError(f"limit every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        if self.phases is not None:
            phases = frozenset(str(p).lower() for p in self.phases)
            unknown = phases - set(PHASES)
            if unknown:
                raise UsageError(f"unknown phase(s) {sorted(unknown)}; known phases: {', '.join(PHASES)}")
            self.phases = phases

    def wants_step(self, step: int) -> bool:
        if self.first_n_steps is not None and step >= self.first_n_steps:
            return False
        return step % self.every_n_steps == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_rows": self.max_rows,
            "max_bytes": self.max_bytes,
            "every_n_steps": self.every_n_steps,
            "first_n_steps": self.first_n_steps,
            "phases": sorted(self.phases) if self.phases is not None else None,
        }
