"""The draft chain walked: the first tap inside the draft's forward that diverges beyond numerics.

Stores recorded with ``record --draft-chain`` hold several taps of one draft forward, each with a
``chain`` attribute (its point, its order in the forward, its draft step; docs/draft-chain.md). When
both sides hold them, compare takes the taps in forward order (step by step: fc input, fc output,
decoder layer input and output, final norm, logits' top k) on the same aligned rows (every tap of a
forward carries that forward's labels) and

* compares each hidden-state tap as a trace of its own (``compare_tap``: the whole compare, its noise
  model measured for that tap, so an attention output is allowed the drift it shows and a residual
  its own; norm ratio and relative error decide where the cosine cannot);
* compares the logits' top k by top-1 agreement: a row whose top-1 differs counts only where the
  reference's margin between its first and second logit exceeds what numerics move a logit (the
  preceding tap's budget carried to the row's logit scale); draft ids that agree with target ids
  that do not name the d2t map.

The first diverged tap is the root cause (finding ``draft_chain``); each later divergence is
``explained_by`` it. Metadata and row reads only; no framework knowledge, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.rowpairs import pair_rows
from tracediff.compare.align.sequences import align_sequences
from tracediff.compare.plan.decide import read_rows, stream_layout
from tracediff.compare.results import Finding, Report
from tracediff.compare.rows.index import RowIndex
from tracediff.errors import CompareError

#: What a divergence first seen at a point comes from, in an EAGLE-3 draft's forward.
POINT_CAUSES = {
    "fc_in": "the aux hidden states the draft is fed (the main report above)",
    "fc_out": "the fc weights (another checkpoint, or fc loaded transposed)",
    "layer_in": "the decoder layer's input: the token embedding (shared with the target or not, another "
                "checkpoint) or, after step 0, the hidden state recycled from the previous step",
    "layer_out": "the decoder layer: attention (RoPE theta / scaling, a sliding window ignored), its norms, "
                 "its weights",
    "norm_out": "the draft's final norm: its weight or its epsilon",
    "logits_topk": "the lm_head (another checkpoint, or the target's head in place of the draft's) or the "
                   "d2t map",
}
#: The chain's ``order`` from which a tap is past the draft's decoder layer (layer_out, norm_out, logits).
POINTS_PAST_LAYER = 3
POINT_NAMES = {"fc_in": "fc input", "fc_out": "fc output", "layer_in": "decoder layer input",
               "layer_out": "decoder layer output", "norm_out": "final norm output", "logits_topk": "logits (top k)"}


@dataclass
class ChainLink:
    """One tap of the chain, compared."""

    tap_reference: str
    tap_candidate: str
    point: str
    order: int
    step: int
    status: str  # match | diverged | cannot_tell | missing | not_comparable
    rows: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)  # the per-tap compare's error findings, "kind: summary"
    explained_by: str | None = None  # the root link's tap, for a later divergence

    @property
    def label(self) -> str:
        return f"{self.tap_candidate} ({POINT_NAMES.get(self.point, self.point)}, step {self.step})"


def chain_taps(store: Any) -> dict[tuple[int, int], tuple[str, dict[str, Any]]]:
    """(step, order) -> (tap, its chain attribute) for every tap with rows that is part of a draft chain."""
    out: dict[tuple[int, int], tuple[str, dict[str, Any]]] = {}
    for tap in store.taps:
        if not store.rows(tap):
            continue
        for stream in store.tap_streams(tap):
            chain = (getattr(stream, "attrs", None) or {}).get("chain")
            if isinstance(chain, dict) and "order" in chain and "point" in chain:
                out[(int(chain.get("step", 0)), int(chain["order"]))] = (tap, chain)
                break
    return out


def has_chain(ref_store: Any, cand_store: Any) -> bool:
    """Both sides hold a chain of taps beyond the fc input."""
    ref, cand = chain_taps(ref_store), chain_taps(cand_store)
    return len(set(ref) & set(cand)) > 1


def walk_chain(ref_store: Any, cand_store: Any, main: Report, compare_tap: Callable[[str, str], Report]) -> list[ChainLink]:
    """Every chain tap both sides hold, in forward order, compared; the main report is the fc input's."""
    ref, cand = chain_taps(ref_store), chain_taps(cand_store)
    links: list[ChainLink] = []
    previous_budget = 0.0
    for key in sorted(set(ref) | set(cand)):
        rtap, rchain = ref.get(key, ("", {}))
        ctap, cchain = cand.get(key, ("", {}))
        point = str((rchain or cchain).get("point"))
        link = ChainLink(rtap, ctap, point, key[1], key[0], "missing")
        unpaired = step_inputs_differ(key[0], rchain, cchain) if rtap and ctap else None
        if unpaired:
            link.status, link.found = "not_comparable", [unpaired]
        elif rtap and ctap:
            if rtap == main.plan.tap_reference and ctap == main.plan.tap_candidate:
                _from_report(link, main)
            elif point == "logits_topk":
                _topk_link(link, ref_store, cand_store, previous_budget)
            else:
                try:
                    _from_report(link, compare_tap(rtap, ctap))
                except CompareError as exc:  # this tap cannot be compared (no rows in common): say so, go on
                    link.status, link.found = "cannot_tell", [str(exc)]
            previous_budget = link.metrics.get("numerics_budget", previous_budget)
        links.append(link)
    root = next((x for x in links if x.status == "diverged"), None)
    for x in links:
        if root is not None and x is not root and x.status == "diverged":
            x.explained_by = root.tap_candidate
    return links


#: How a draft step s >= 1 gets its input (the chain attribute ``step_inputs``): a trainer's is teacher
#: forced (the data's next token, its hidden state recycled from its own step s-1 at every position;
#: absent = teacher forced), a server's reads its own proposal of step s-1.
TEACHER_FORCED, PROPOSED = "teacher_forced", "proposed"
_READS = {TEACHER_FORCED: "the data's tokens", PROPOSED: "its own proposals"}


def step_inputs_differ(step: int, ref_chain: dict[str, Any], cand_chain: dict[str, Any]) -> str | None:
    """Why a step >= 1 tap of two sides cannot be paired (one reads the data's tokens, the other its own
    proposals: the rows of one label are different computations), None when it can."""
    ref, cand = (str(c.get("step_inputs") or TEACHER_FORCED) for c in (ref_chain, cand_chain))
    if step < 1 or ref == cand:
        return None
    sides = sorted([("reference", ref), ("candidate", cand)], key=lambda s: s[1] != PROPOSED)
    (first, how), (second, other) = sides
    return (f"step {step} of the {first} reads {_READS.get(how, how)}, of the {second} "
            f"{_READS.get(other, other)}: only step 0 pairs")


def _from_report(link: ChainLink, report: Report) -> None:
    link.rows = report.plan.pairs
    link.status = {"match": "match", "mismatch": "diverged"}.get(report.verdict, "cannot_tell")
    worst = max(report.metrics, key=lambda m: m.rel_l2, default=None)
    link.metrics = {"numerics_budget": report.plan.numerics_budget, "compute_dtype": report.plan.compute_dtype,
                    "budget_depth": max((d for d in report.plan.budget_depths if d is not None), default=None)}
    if worst is not None:
        link.metrics.update(cos_mean=worst.cos_mean, rel_l2=worst.rel_l2, norm_ratio_p50=worst.norm_ratio_p50,
                            max_abs_diff=worst.max_abs_diff)
    link.found = [f"{f.kind}: {f.summary or f.message}" for f in report.findings if f.severity == "error"]


#: Row pairs of the logits' top k read at once (24 floats a row: 25 MiB a side).
TOPK_BLOCK = 1 << 18


def _topk_link(link: ChainLink, ref_store: Any, cand_store: Any, budget: float) -> None:
    width, cand_width = stream_layout(ref_store, link.tap_reference).width, stream_layout(cand_store, link.tap_candidate).width
    if width != cand_width or width % 3:
        link.status, link.found = "cannot_tell", [f"top-k rows of {width} and {cand_width} values: recorded with "
                                                  "another top k"]
        return
    ref_index, cand_index = RowIndex.load(ref_store, link.tap_reference), RowIndex.load(cand_store, link.tap_candidate)
    pairs = pair_rows(align_sequences(ref_index, cand_index), 0)
    link.rows = len(pairs)
    if not len(pairs):
        link.status, link.found = "cannot_tell", ["no aligned rows"]
        return
    counts: dict[str, float] = {}
    for start in range(0, len(pairs), TOPK_BLOCK):
        block = slice(start, start + TOPK_BLOCK)
        one = topk_counts(read_rows(ref_index, pairs.reference[block]), read_rows(cand_index, pairs.candidate[block]),
                          width // 3, budget)
        for key, value in one.items():
            counts[key] = max(counts.get(key, 0.0), value) if key == "logit_noise_max" else counts.get(key, 0.0) + value
    rows = link.rows
    link.metrics = {
        "draft_top1_agreement": counts["same_draft"] / rows,
        "target_top1_agreement": counts["same_target"] / rows,
        "rows_beyond_noise": int(counts["beyond"]),
        "logit_noise_max": counts["logit_noise_max"],
        "top_logit_rel_error": float(np.sqrt(counts["diff_sq"] / max(counts["ref_sq"], 1e-30))),
        "numerics_budget": budget,
    }
    link.status = "diverged" if counts["beyond"] else "match"
    if counts["beyond"]:
        what = ("the draft's top-1 ids agree but their target ids do not: the d2t map differs"
                if counts["same_draft"] == rows else "the top-1 token differs where numerics cannot flip it")
        link.found = [f"{what} ({int(counts['beyond'])} of {rows} rows)"]


def topk_counts(r: np.ndarray, c: np.ndarray, k: int, budget: float) -> dict[str, float]:
    """Top-1 agreement counts of two ``[rows, 3k]`` blocks of top-k rows (values, draft ids, target
    ids), and how many disagreeing rows numerics cannot explain.

    A row's logits move by numerics at most ``noise``: the budget of the tap before the head (a
    relative error, from that tap's noise model) times the row's largest logit. The drift of the
    logits themselves is no measure of it: a head of another checkpoint moves every logit, those of
    the rows that keep their top-1 too. A row whose top-1 differs is beyond numerics when the
    reference's margin between its first and second logit exceeds twice that (both sides move)."""
    rv, cv = r[:, :k], c[:, :k]
    same_draft, same_target = r[:, k] == c[:, k], r[:, 2 * k] == c[:, 2 * k]
    noise = budget * np.max(np.abs(rv), axis=1)
    margin = rv[:, 0] - (rv[:, 1] if k > 1 else rv[:, 0])
    beyond = ~same_target & (margin > 2 * noise)
    return {
        "same_draft": float(same_draft.sum()),
        "same_target": float(same_target.sum()),
        "beyond": float(beyond.sum()),
        "logit_noise_max": float(np.max(noise, initial=0.0)),
        "diff_sq": float(np.square(cv[:, 0] - rv[:, 0], dtype=np.float64).sum()),
        "ref_sq": float(np.square(rv[:, 0], dtype=np.float64).sum()),
    }


def chain_findings(links: list[ChainLink], main: Report) -> list[Finding]:
    """``draft_chain`` findings: the first diverged tap inside the draft (a root cause unless it is the
    fc input, which the main report already explains), every later divergence explained by it."""
    root = next((x for x in links if x.status == "diverged"), None)
    if root is None:
        return []
    main_root = next((f.kind for f in main.findings if f.severity == "error"
                      and not (f.evidence or {}).get("explained_by")), None)
    out: list[Finding] = []
    for x in links:
        if x.status != "diverged" or (x is root and x.point == "fc_in"):
            continue
        evidence: dict[str, Any] = {"tap_reference": x.tap_reference, "tap_candidate": x.tap_candidate,
                                    "point": x.point, "step": x.step, "rows": x.rows, "metrics": x.metrics,
                                    "found": x.found}
        if x is root:
            before = [y.tap_candidate for y in links if (y.step, y.order) < (x.step, x.order) and y.status == "match"]
            evidence["matched_before"] = before
            out.append(Finding(
                "draft_chain", "error",
                f"the draft's forward first diverges at {x.label}: every earlier tap matches within numerics "
                f"({', '.join(before) or 'none recorded'}); look at {POINT_CAUSES.get(x.point, x.point)}. "
                + "; ".join(x.found),
                evidence, summary=f"the draft diverges first at {x.label}"))
        else:
            evidence["explained_by"] = "draft_chain" if root.point != "fc_in" else (main_root or "draft_chain")
            out.append(Finding("draft_chain", "error",
                               f"{x.label} diverges too, downstream of {root.label}", evidence,
                               summary=f"{x.tap_candidate} diverges downstream of {root.tap_candidate}"))
    return out


def chain_json(links: list[ChainLink]) -> list[dict[str, Any]]:
    """The chain section of the report: one entry per tap, in forward order."""
    return [asdict(x) for x in links]


def chain_report(report: Report, ref_store: Any, cand_store: Any,
                 compare_tap: Callable[[str, str, int | None], Report]) -> None:
    """Walk the chain after the fc input's compare (``report``) and add its table and findings to it.
    ``compare_tap(reference tap, candidate tap, depth)``: one tap's compare, its numerics prior
    assuming ``depth`` decoder layers (:func:`chain_tap_depth`)."""
    fc_depth = max((int(d) for d in report.plan.budget_depths or [] if d is not None), default=None)
    links = walk_chain(ref_store, cand_store, report,
                       lambda rtap, ctap: compare_tap(rtap, ctap, chain_tap_depth(fc_depth, ref_store, rtap)))
    report.chain = chain_json(links)
    report.findings.extend(chain_findings(links, report))


def chain_tap_depth(fc_depth: int | None, store: Any, tap: str) -> int | None:
    """How many layers of rounding a chain tap carries: the fc input's deepest slot (drift of the
    target, which the draft reads), one more for every draft step whose decoder layer the tap is past
    (the fc and the layer's input add a matmul, not a layer). None when the fc input's depth is not known
    (the model's depth is assumed then)."""
    if fc_depth is None:
        return None
    chains = ((getattr(s, "attrs", None) or {}).get("chain") for s in store.tap_streams(tap))
    chain = next((c for c in chains if isinstance(c, dict)), None) or {}
    step, order = int(chain.get("step", 0)), int(chain.get("order", 0))
    return fc_depth + step + (1 if order >= POINTS_PAST_LAYER else 0)
