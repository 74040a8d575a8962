"""Axis ticks of the HTML report's charts: round values and labels that tell them apart.

Numbers only (no SVG, no report): :func:`nice_ticks` picks round values over a range,
:func:`tick_labels` writes them as short as they can be while still telling them apart (``1 − 4e-6``
on a cosine axis near 1, never ``1.0000010``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence


def nice_step(span: float, count: int = 5) -> float:
    """The 1, 2 or 5 x 10^k step that cuts ``span`` into about ``count - 1`` intervals."""
    raw = span / max(1, count - 1)
    if not math.isfinite(raw) or raw <= 0:
        return 1.0
    exp = math.floor(math.log10(raw))
    for mult in (1, 2, 5):
        if mult * 10.0**exp >= raw * (1 - 1e-9):
            return mult * 10.0**exp
    return 10.0 ** (exp + 1)


def _smaller_step(step: float) -> float:
    """The next smaller round step: 5 -> 2 -> 1 -> 0.5 (x 10^k)."""
    exp = math.floor(math.log10(step) + 1e-9)
    mult = round(step / 10.0**exp)
    return {5: 2, 2: 1}.get(mult, 0.5) * 10.0**exp


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values (multiples of a 1, 2 or 5 x 10^k step) from ``lo`` to ``hi``: about ``count``
    of them, and at least 3 (a finer step when the range falls between round values)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    step = nice_step(hi - lo, count)
    for _ in range(4):
        first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
        if last - first >= 2:
            break
        step = _smaller_step(step)
    return [k * step for k in range(first, last + 1)]


def _fewest_decimals(values: Sequence[float]) -> int:
    """The fewest decimals whose labels tell every value apart, each within 1% of the smallest gap."""
    ordered = sorted(values)
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
    tolerance = 0.01 * min(gaps) if gaps else 0.0
    for d in range(0, 13):
        labels = [f"{v:.{d}f}" for v in values]
        if len(set(labels)) == len(set(values)) and all(abs(float(t) - v) <= tolerance for t, v in
                                                           zip(labels, values, strict=True)):
            return d
    return 12


def _shortest(value: float, tolerance: float) -> str:
    """``value`` in the fewest significant digits within ``tolerance`` (``2e-6``, ``1.5e-5``)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if abs(float(text) - value) <= tolerance:
            return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), text)
    return f"{value:g}"


def tick_labels(values: Sequence[float]) -> list[str]:
    """Axis labels that are short and tell the ticks apart: the fewest decimals that do
    (``0.4 0.6 0.8 1.0``), and for ticks that need 6 or more, all within 0.001 below 1 (a cosine
    axis near 1), ``1 - x`` (``1 − 4e-6``, ``1 − 2e-6``, ``1``): never ``1.0000010``."""
    values = [float(v) for v in values]
    if not values:
        return []
    decimals = _fewest_decimals(values)
    if decimals >= 6 and len(values) > 1 and all(1 - 1e-3 <= v <= 1 + 1e-12 for v in values):
        ordered = sorted(values)
        gap = min((b - a for a, b in itertools.pairwise(ordered) if b > a), default=1e-6)
        out = []
        for v in values:
            below = 1.0 - v
            out.append("1" if abs(below) <= 0.01 * gap else f"1 \u2212 {_shortest(below, 0.01 * gap)}")
        return out
    if decimals > 6:  # tiny values: in scientific notation, each as short as it can be
        ordered = sorted(values)
        gap = min((b - a for a, b in itertools.pairwise(ordered) if b > a), default=abs(values[0]) or 1.0)
        return ["0" if v == 0 else _shortest(v, 0.01 * gap) for v in values]
    labels = [f"{v:.{decimals}f}" for v in values]
    return [re.sub(r"^-(0(\.0*)?)$", r"\1", t) for t in labels]  # never "-0.0"


def decade_label(exp: int) -> str:
    return f"{10.0**exp:g}" if -3 <= exp <= 4 else f"1e{exp}"
