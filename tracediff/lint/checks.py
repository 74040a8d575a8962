"""From the statistics of one pass (:class:`~tracediff.lint.stats.SlotStats`) to slot reports and findings.

Every rule decides from the data's own statistics:

- **defect rows** (all zeros, constant, non-finite, a repeated row of another token): any is an
  error; the finding says how many, where (writer group; samples, as ranges) and gives examples;
- **duplicated samples**: samples whose slots hash alike (an error when their tokens differ: the
  values were not computed from those tokens; a warning when the tokens are alike too: the data set
  holds the sample twice), and a slot of one sample repeating another sample's;
- **post-norm**: with the target's final norm weight ``w``, the final norm's output ``y = w * x /
  rms(x)`` has ``rms(y / w) = 1`` on every row, up to the storage's rounding; no raw hidden state does.
  The tolerance is three rounding units of the storage dtype over the square root of the slot's
  effective dimension count (massive dimensions leave few), plus 1e-3;
- **other depth**: with a bank of every layer of the target, each slot's per-dimension RMS profile is
  ranked against the bank's; a slot fits another layer when the distance to its own layer exceeds the
  distance to the best by more than half the distance between those two layers in the bank;
- **massive dimensions**: dimensions whose RMS is :data:`MASSIVE_RATIO` x the median dimension's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracediff.lint.results import LintFinding, SlotReport
from tracediff.lint.sources import Source, hf_index
from tracediff.lint.stats import SlotStats, massive_dimensions, profile_distance

#: A massive dimension's RMS over the median dimension's. Massive activations of trained LLMs are
#: 100-10,000x the median; ordinary dimensions of trained models differ up to ~5-10x.
MASSIVE_RATIO = 20.0
#: Share of a slot's rows with rms(x / w) = 1 from which the slot is the final norm's output.
POST_NORM_SHARE = 0.99
#: Relative rounding unit of each storage dtype (half an ulp).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "float16": 2.0**-11, "bfloat16": 2.0**-8,
                 "float8_e4m3fn": 2.0**-4}
_DEFECTS = (("zero", "zero_rows", "all zeros"), ("constant", "constant_rows", "one constant value"),
            ("nonfinite", "nonfinite_rows", "NaN or Inf"),
            ("duplicate", "duplicate_rows", "identical to another position's row of the same sample (another token)"))


def slot_name(report: SlotReport) -> str:
    return f"slot {report.index} ({report.label})"


def ranges(ids: list[int], names: dict[int, str], limit: int = 4) -> str:
    """Sample ids as runs: ``hs_3..hs_5, hs_9`` (at most ``limit`` runs, then how many more)."""
    ids = sorted(ids)
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    text = [names.get(a, str(a)) if a == b else f"{names.get(a, str(a))}..{names.get(b, str(b))}" for a, b in runs[:limit]]
    more = f" and {len(runs) - limit} more runs" if len(runs) > limit else ""
    return ", ".join(text) + more


def slot_reports(source: Source, stats: SlotStats, tolerance_of: Any) -> list[SlotReport]:
    dim_rms = stats.dim_rms()
    out = []
    for s, (label, kind) in enumerate(zip(source.labels, source.kinds, strict=True)):
        mean, cv = stats.rms_moments(s)
        dims, ratio = massive_dimensions(dim_rms[s], MASSIVE_RATIO)
        out.append(SlotReport(
            index=s, label=label, kind=kind, rows=int(stats.rows[s]), zero_rows=int(stats.counts["zero"][s]),
            constant_rows=int(stats.counts["constant"][s]), nonfinite_rows=int(stats.counts["nonfinite"][s]),
            duplicate_rows=int(stats.counts["duplicate"][s]), rms_mean=mean, rms_cv=cv, massive_dims=dims,
            massive_ratio=ratio, unit_rms_after_norm=stats.unit_share(s, tolerance_of(dim_rms[s]))))
    return out


def unit_tolerance(storage_dtype: str, dim_rms: np.ndarray) -> float:
    """How far rms(y / w) of the final norm's output may sit from 1 after storage rounding."""
    u = UNIT_ROUNDOFF.get(storage_dtype, 2.0**-8)
    energy = dim_rms.astype(np.float64) ** 2
    effective = float(energy.sum() ** 2 / (energy**2).sum()) if energy.sum() > 0 else 1.0
    return 3 * u / np.sqrt(3 * max(effective, 1.0)) + 1e-3


def defect_findings(slots: list[SlotReport], stats: SlotStats) -> list[LintFinding]:
    out = []
    for rep in slots:
        for key, field, what in _DEFECTS:
            n = getattr(rep, field)
            if not n:
                continue
            book = stats.per_sample[(key, rep.index)]
            whole = [i for i, c in book.items() if c == stats.sample_rows.get(i)]
            where = dict(stats.where[(key, rep.index)])
            place = f"in {len(book)} sample{'s' if len(book) != 1 else ''} ({ranges(list(book), stats.names)})"
            if whole and key != "duplicate":
                place += "; every row of it" if len(book) == 1 else f"; every row of {len(whole)} of them"
            if len(stats.group_rows) > 1:
                place += "; by writer group: " + ", ".join(
                    f"{g} {where.get(g, 0)} of {rows}" for g, rows in sorted(stats.group_rows.items()))
            out.append(LintFinding(
                kind=field, severity="error", slot=rep.index,
                message=f"{slot_name(rep)}: {n} of {rep.rows} rows are {what}, {place}.",
                evidence={"rows": n, "of": rep.rows, "samples": len(book), "whole_samples": len(whole),
                          "by_group": where, "examples": [
                              {**e, "sample": stats.names.get(e["sample"], e["sample"])}
                              for e in stats.examples[(key, rep.index)]]}))
    return out


def duplicate_sample_findings(slots: list[SlotReport], stats: SlotStats) -> list[LintFinding]:
    """Samples identical in every slot, and single slots repeating another sample's."""
    out: list[LintFinding] = []
    defective = set()
    for (key, _s), book in stats.per_sample.items():
        if key != "duplicate":
            defective.update(book)
    ids = sorted(i for i in stats.sample_hash if i not in defective)
    if not ids:
        return out
    table = np.stack([stats.sample_hash[i] for i in ids])
    whole: dict[bytes, list[int]] = {}
    for i, row in zip(ids, table, strict=True):
        whole.setdefault(row.tobytes() + stats.sample_rows[i].to_bytes(8, "little"), []).append(i)
    same_sample = set()
    for group in whole.values():
        if len(group) < 2:
            continue
        same_sample.update(group)
        tokens_alike = len({stats.sample_tokens[i] for i in group}) == 1
        names = [stats.names.get(i, str(i)) for i in group]
        out.append(LintFinding(
            kind="duplicate_samples", severity="warning" if tokens_alike else "error",
            message=(f"samples {', '.join(names[:6])}{' ...' if len(names) > 6 else ''} hold identical hidden states "
                     f"in every slot" + (", and the same tokens: the data set holds one sample "
                                         f"{len(group)} times" if tokens_alike else
                                         ", for different tokens: they were not computed from their own tokens")
                     + "."),
            evidence={"samples": names, "same_tokens": tokens_alike}))
    for s, rep in enumerate(slots):
        seen: dict[int, list[int]] = {}
        for i, row in zip(ids, table, strict=True):
            if i not in same_sample:
                seen.setdefault(int(row[s]), []).append(i)
        for group in seen.values():
            if len(group) < 2:
                continue
            names = [stats.names.get(i, str(i)) for i in group]
            out.append(LintFinding(
                kind="duplicate_samples", severity="error", slot=s,
                message=f"{slot_name(rep)} of samples {', '.join(names[:6])} is identical while their other slots "
                        f"differ: that slot was filled from another sample.",
                evidence={"samples": names}))
    return out


def post_norm_findings(slots: list[SlotReport], tolerance: dict[int, float]) -> list[LintFinding]:
    out = []
    for rep in slots:
        share = rep.unit_rms_after_norm
        if share is None:
            continue
        ev = {"unit_rms_share": share, "tolerance": tolerance[rep.index]}
        if share >= POST_NORM_SHARE and rep.kind != "post_norm":
            out.append(LintFinding(
                kind="post_norm", severity="error", slot=rep.index, evidence=ev,
                message=f"{slot_name(rep)} holds the output of the target's final norm (rms(x / norm weight) = 1 on "
                        f"{100 * share:.1f}% of its rows), not a raw hidden state of the residual stream."))
        elif rep.kind == "post_norm" and share < 0.5:
            out.append(LintFinding(
                kind="post_norm", severity="warning", slot=rep.index, evidence=ev,
                message=f"{slot_name(rep)} should be the final norm's output, but rms(x / norm weight) = 1 holds on "
                        f"only {100 * share:.1f}% of its rows: another state, or another target."))
    return out


def depth_findings(slots: list[SlotReport], profiles: np.ndarray, bank: list[tuple[str, str, np.ndarray]],
                   num_layers: int | None) -> list[LintFinding]:
    """Rank every bank segment against each slot's profile (see the module docstring)."""
    out = []
    for rep in slots:
        if rep.rms_mean is None:  # no row with data: nothing to profile
            continue
        dist = [profile_distance(profiles[rep.index], p) for _label, _kind, p in bank]
        best = int(np.argmin(dist))
        claimed = _claimed(rep, bank, num_layers)
        fit: dict[str, Any] = {"best": bank[best][0], "best_distance": dist[best],
                               "claimed": None if claimed is None else bank[claimed][0],
                               "claimed_distance": None if claimed is None else dist[claimed]}
        rep.depth_fit = fit
        if claimed is None:
            out.append(LintFinding(kind="cannot_tell", severity="info", slot=rep.index, evidence=fit,
                                   message=f"{slot_name(rep)} fits {bank[best][0]} of the bank best; its label "
                                           f"names no layer to check it against."))
            continue
        if best == claimed:
            continue
        spacing = profile_distance(bank[best][2], bank[claimed][2])
        fit["spacing"] = spacing
        if dist[claimed] - dist[best] > spacing / 2:
            out.append(LintFinding(
                kind="other_depth", severity="error", slot=rep.index, evidence=fit,
                message=f"{slot_name(rep)} fits {_bank_name(bank[best])} of the target (profile distance {dist[best]:.3f}), "
                        f"not {bank[claimed][0]} ({dist[claimed]:.3f}; the two layers are {spacing:.3f} apart): "
                        f"it holds another depth."))
        else:
            out.append(LintFinding(
                kind="cannot_tell", severity="info", slot=rep.index, evidence=fit,
                message=f"{slot_name(rep)} fits {bank[best][0]} slightly better than its own {bank[claimed][0]} "
                        f"({dist[best]:.3f} vs {dist[claimed]:.3f}): within the bank's layer spacing, cannot tell."))
    return out


def _bank_name(segment: tuple[str, str, np.ndarray]) -> str:
    extra = {"post_norm": " (the final norm's output)", "pre_norm": " (the last layer before the final norm)",
             "embedding": " (the embedding)"}
    return segment[0] + extra.get(segment[1], "")


def _claimed(rep: SlotReport, bank: list[tuple[str, str, np.ndarray]], num_layers: int | None) -> int | None:
    labels = [b[0] for b in bank]
    if rep.label in labels and rep.kind not in ("pre_norm", "post_norm"):
        return labels.index(rep.label)
    if rep.kind in ("pre_norm", "post_norm"):
        kinds = [b[1] for b in bank]
        return kinds.index(rep.kind) if rep.kind in kinds else None
    k = hf_index(rep.label)
    if k is not None and num_layers is not None and k == num_layers:  # HF hs{L} is post-norm
        kinds = [b[1] for b in bank]
        return kinds.index("post_norm") if "post_norm" in kinds else None
    return None


def order_findings(slots: list[SlotReport], num_layers: int) -> list[LintFinding]:
    out = []
    for rep in slots:
        k = hf_index(rep.label)
        if k is not None and k > num_layers:
            out.append(LintFinding(
                kind="slot_order", severity="error", slot=rep.index, evidence={"hf_index": k, "num_layers": num_layers},
                message=f"{slot_name(rep)} is named after hidden_states[{k}], but the target has {num_layers} layers "
                        f"(hidden_states 0..{num_layers})."))
    return out


def fp8_findings(fp8: dict[str, Any]) -> list[LintFinding]:
    out = []
    tokens = fp8["tokens"]
    for key, what in (("zero_scales", "a zero scale: their rows dequantise to all zeros"),
                      ("negative_scales", "a negative scale: their rows come back with flipped signs"),
                      ("nonfinite_scales", "a NaN or Inf scale"),
                      ("nan_codes", "NaN codes (e4m3fn has no Inf: an out-of-range value became NaN)")):
        n = fp8[key]
        if n:
            out.append(LintFinding(
                kind="fp8_scales", severity="error",
                message=f"FP8: {n} of {tokens} tokens have {what} ({', '.join(fp8['examples'][key][:3])}).",
                evidence={"tokens": n, "of": tokens, "examples": fp8["examples"][key]}))
    if fp8["saturated_tokens"]:
        n = fp8["saturated_tokens"]
        out.append(LintFinding(
            kind="fp8_scales", severity="warning",
            message=f"FP8: {n} of {tokens} tokens hold several values at e4m3's largest magnitude (448): clipped by a "
                    f"scale smaller than the token's absmax / 448 ({', '.join(fp8['examples']['saturated_tokens'][:3])}).",
            evidence={"tokens": n, "of": tokens, "examples": fp8["examples"]["saturated_tokens"]}))
    return out


__all__ = ["MASSIVE_RATIO", "POST_NORM_SHARE", "UNIT_ROUNDOFF", "defect_findings", "depth_findings",
           "duplicate_sample_findings", "fp8_findings", "order_findings", "post_norm_findings", "ranges",
           "slot_name", "slot_reports", "unit_tolerance"]
