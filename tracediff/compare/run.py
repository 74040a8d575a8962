"""Compare two traces: plan from metadata and a sample, then one streaming pass, then findings.

The first store is the reference (what the draft learned: usually the trainer), the second the
candidate (usually the server). :func:`compare_stores` returns a :class:`tracediff.compare.results.Report`;
it raises :class:`tracediff.errors.CompareError` (exit 2) when the stores cannot be compared at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tracediff import __version__
from tracediff.adapters.conventions import FINAL_NORM, AuxLayers
from tracediff.compare.align.pairing import check_token_pairing
from tracediff.compare.align.rowpairs import RowPairs, content_keys, pair_rows
from tracediff.compare.align.sequences import Alignment, align_sequences
from tracediff.compare.chain import chain_report, has_chain
from tracediff.compare.findings.build import build_findings
from tracediff.compare.findings.evidence import (
    Evidence,
    apply_preconditions,
    gather_evidence,
    pairing_of_rows,
    preconditions,
)
from tracediff.compare.findings.remedy import attach_next_steps
from tracediff.compare.findings.segments import name_bank_layers
from tracediff.compare.findings.subsets import localise_subsets
from tracediff.compare.plan.decide import (
    CompareOptions,
    Layout,
    SegmentPlan,
    SegmentSizes,
    collect_meta,
    decide_segment_sizes,
    offset_search,
    pair_limits,
    pick_taps,
    plan_segments,
    profile_requests,
    read_rows,
    require_finite_rows,
    sample_pairs,
    stream_layout,
    tap_summary,
)
from tracediff.compare.plan.metadata import aux_config, config_diff, num_layers, side_aux_layers
from tracediff.compare.plan.noise import CALIBRATION_TAP, CalibrationRows, canonical_dtype, decide_compute_dtype
from tracediff.compare.plan.segments import SegmentDecision, segment_scales
from tracediff.compare.plan.sides import recorded_by, same_recording_of, store_set_notes, swapped_roles
from tracediff.compare.plan.slots import SampleTokens, refine_relations, row_model_json, side_row_model
from tracediff.compare.results import Finding, Plan, Report, SegmentMatch, Side
from tracediff.compare.rows.gather import in_parallel
from tracediff.compare.rows.index import RowIndex, stream_names
from tracediff.compare.rows.kernels import prepare_kernel
from tracediff.compare.stream.metrics import StreamResult, with_subset_profiles
from tracediff.compare.stream.one_pass import stream_metrics
from tracediff.drafts import recorded_d2t_problems
from tracediff.errors import CompareError, UsageError
from tracediff.store import TraceStore
from tracediff.store.storeset import StoreSet, open_side

__all__ = ["CompareOptions", "compare_stores", "tap_summary"]


Locations = str | Path | Sequence[str | Path]


def compare_stores(reference_path: Locations, candidate_path: Locations, opts: CompareOptions | None = None) -> Report:
    """Compare the reference with the candidate. Either side may be several stores (a sequence of
    locations: one per node or replica), read as one trace (:class:`tracediff.store.storeset.StoreSet`)."""
    opts = opts or CompareOptions()
    ref_store = open_side(reference_path, opts.storage_options)
    try:
        cand_store = open_side(candidate_path, opts.storage_options)
    except BaseException:
        ref_store.close()
        raise
    try:
        report = _compare(ref_store, cand_store, opts)
        if not (opts.tap or opts.reference_tap or opts.candidate_tap or opts.bank) and has_chain(ref_store, cand_store):
            _walk_chain(report, ref_store, cand_store, opts)
        return report
    finally:
        ref_store.close()
        cand_store.close()


def _walk_chain(report: Report, ref_store: Side_, cand_store: Side_, opts: CompareOptions) -> None:
    """Both stores hold a draft chain (record --draft-chain): each tap compared in forward order, the
    first that diverges named (tracediff/compare/chain.py)."""
    _stage(opts, "walking the draft chain")
    chain_report(report, ref_store, cand_store, lambda rtap, ctap, depth: _compare(ref_store, cand_store, replace(
        opts, reference_tap=rtap, candidate_tap=ctap, extra_notes=[], stage=None, assumed_depth=depth)))
    attach_next_steps(report)  # a chain root cause has its own Fix box


def _stage(opts: CompareOptions, name: str) -> None:
    if opts.stage is not None:
        opts.stage(name)


def _compare(ref_store: Side_, cand_store: Side_, opts: CompareOptions) -> Report:
    """The stages in order: open both sides, align their rows, decide each side's segment size, read
    the metadata, plan and stream (when the segments compare at all), assemble the report, draw its
    findings."""
    if opts.bank and (isinstance(ref_store, StoreSet) or isinstance(cand_store, StoreSet)):
        raise UsageError("--bank names the layers of one store per side; compare several stores without --bank")
    sides = _open_sides(ref_store, cand_store, opts)
    notes = list(opts.extra_notes) + store_set_notes(ref_store, "reference") + store_set_notes(cand_store, "candidate")
    aligned = _align(sides, opts)
    notes += aligned.alignment.notes
    sizes, evidence = _segment_sizes(sides, aligned.base_pairs, opts)
    notes += list(sizes.notes)
    meta = _read_metadata(sides)
    notes += meta.notes
    if sizes.comparable:
        measured = _plan_and_stream(sides, aligned, sizes.reference, meta, evidence, opts, notes)
    else:
        measured = _Measured(aligned.take_base_pairs())
    report = _assemble_report(sides, aligned.alignment, sizes, meta, measured, notes)
    _draw_findings(report, sides, aligned.alignment, meta, measured, opts)
    apply_preconditions(report, preconditions(evidence, report))
    return report


@dataclass
class _Sides:
    """Both sides opened: their stores, the taps compared, each tap's layout and row index."""

    ref_store: Side_
    cand_store: Side_
    rtap: str
    ctap: str
    rl: Layout
    cl: Layout
    ref_index: RowIndex
    cand_index: RowIndex


def _open_sides(ref_store: Side_, cand_store: Side_, opts: CompareOptions) -> _Sides:
    rtap, ctap = pick_taps(ref_store, cand_store, opts)
    _stage(opts, "reading labels")
    rl, cl = stream_layout(ref_store, rtap), stream_layout(cand_store, ctap)
    ref_index, cand_index = _load_indexes(ref_store, rtap, cand_store, ctap)
    return _Sides(ref_store, cand_store, rtap, ctap, rl, cl, ref_index, cand_index)


@dataclass
class _Aligned:
    """The sequences aligned and the row pairs at label offset 0 (handed over to the plan, which lets
    them go once it has the pairs of the offset it keeps)."""

    alignment: Alignment
    base_pairs: RowPairs

    def take_base_pairs(self) -> RowPairs:
        pairs = self.base_pairs
        del self.base_pairs  # (a later read is an error, not the pairs kept alive through the pass)
        return pairs


def _align(sides: _Sides, opts: CompareOptions) -> _Aligned:
    _stage(opts, "aligning sequences")
    alignment = align_sequences(sides.ref_index, sides.cand_index)
    base_pairs = pair_rows(alignment, 0)
    base_pairs.content_keys = content_keys(base_pairs, alignment)
    if len(base_pairs) == 0:
        raise CompareError(
            f"zero aligned rows between {sides.ref_store.path} ({sides.rtap}) and {sides.cand_store.path} "
            f"({sides.ctap}): no candidate sequence shares tokens with a reference sequence; were both recorded "
            f"on the same inputs (see `tracediff send`)?"
        )
    prepare_kernel(len(base_pairs), sides.cand_index, sides.ref_index, lambda: _stage(opts, "loading compiled kernels"))
    return _Aligned(alignment, base_pairs)


def _segment_sizes(sides: _Sides, base_pairs: RowPairs, opts: CompareOptions) -> tuple[SegmentSizes, Evidence]:
    """Shapes first: each side's segment size (recorded, or read off a sample of the pairs), and the
    evidence the conclusions will rest on."""

    def size_sample() -> tuple[np.ndarray, np.ndarray]:
        pick = sample_pairs(base_pairs, 256, opts.seed)
        return read_rows(sides.ref_index, base_pairs.reference[pick]), read_rows(sides.cand_index, base_pairs.candidate[pick])

    sizes = decide_segment_sizes(sides.rl, sides.cl, opts, size_sample)
    evidence = gather_evidence(sides.ref_index, sides.cand_index, sides.rl, sides.cl, sizes, size_sample)
    return sizes, evidence


@dataclass
class _Metadata:
    """Each side's recorded metadata, its aux layers in one physical numbering, and the config diff."""

    ref_meta: dict[str, Any]
    cand_meta: dict[str, Any]
    ref_aux: AuxLayers | None
    cand_aux: AuxLayers | None
    diff: Any
    notes: list[str]


def _read_metadata(sides: _Sides) -> _Metadata:
    ref_meta, cand_meta = collect_meta(sides.ref_store, sides.rtap), collect_meta(sides.cand_store, sides.ctap)
    ref_aux, cand_aux = side_aux_layers(ref_meta), side_aux_layers(cand_meta)
    same_layers = bool(ref_aux and cand_aux and ref_aux.physical is not None and ref_aux.physical == cand_aux.physical)
    diff = config_diff(ref_meta, cand_meta, same_physical_layers=same_layers)
    notes = [n for aux in (ref_aux, cand_aux) if aux is not None for n in aux.notes]
    return _Metadata(ref_meta, cand_meta, ref_aux, cand_aux, diff, notes)


@dataclass
class _Measured:
    """What the plan and the pass made: the pairs compared (under the label offset kept), the segment
    plan, the pass's numbers and the subsets of rows that differ. Only the pairs when the segments do
    not compare."""

    pairs: RowPairs
    offset: int = 0
    offset_scores: dict = field(default_factory=dict)
    segplan: SegmentPlan | None = None
    stream: StreamResult = field(default_factory=lambda: StreamResult([], {}, {}, 0))
    subsets: dict = field(default_factory=dict)


def _plan_and_stream(sides: _Sides, aligned: _Aligned, size: int, meta: _Metadata, evidence: Evidence,
                     opts: CompareOptions, notes: list[str]) -> _Measured:
    pairs, offset, offset_scores, segplan = _plan(sides, aligned, size, meta, evidence, opts, notes)
    stream, subsets = _stream(sides, pairs, segplan, size, opts)
    return _Measured(pairs, offset, offset_scores, segplan, stream, subsets)


def _plan(sides: _Sides, aligned: _Aligned, size: int, meta: _Metadata, evidence: Evidence, opts: CompareOptions,
          notes: list[str]) -> tuple[RowPairs, int, dict, SegmentPlan]:
    """The label offset, then the pairs every later stage uses, then the segment plan on a sample."""
    ref_index, cand_index, alignment = sides.ref_index, sides.cand_index, aligned.alignment
    base_pairs = aligned.take_base_pairs()
    _stage(opts, "planning: label offset")
    compute = decide_compute_dtype(meta.ref_meta, meta.cand_meta)

    def plan_sample(of: RowPairs, sample_notes: list[str]) -> tuple[np.ndarray, np.ndarray]:
        pick = _plan_pick(of, cand_index, opts, sample_notes)
        return in_parallel(lambda: read_rows(cand_index, of.candidate[pick]),
                           lambda: read_rows(ref_index, of.reference[pick]))

    def ahead_of_time(of: RowPairs) -> tuple[tuple[np.ndarray, np.ndarray], list[str]]:
        ahead_notes: list[str] = []
        c, r = plan_sample(of, ahead_notes)
        for side in (c, r):  # remembered with the sample (segments._memo): the plan asks again
            segment_scales(side, size, compute.dtype)
        return (c, r), ahead_notes

    # Offset 0's plan sample (the offset nearly always kept) is read, and its scales estimated, on
    # the other core while the offset search runs; another offset reads its own afterwards. What
    # the plan decides does not change: the same rows, the same numbers.
    with ThreadPoolExecutor(1, thread_name_prefix="tracediff-plan") as ex:
        ahead = ex.submit(ahead_of_time, base_pairs)
        offset, offset_scores, pairs = offset_search(alignment, size, opts, base_pairs, compute.dtype)
        if pairs is not base_pairs:
            pairs.content_keys = content_keys(pairs, alignment)
        # -- segment decisions on a sample
        _stage(opts, "planning: segment map")
        if pairs is base_pairs:
            (c_sample, r_sample), ahead_notes = ahead.result()
            notes += ahead_notes
        else:
            c_sample, r_sample = plan_sample(pairs, notes)
    # The pairs are made: the candidate sequences' rows and, under another label offset, offset
    # 0's pairs are let go.
    alignment.let_go_of_rows()
    del base_pairs
    rl, cl = sides.rl, sides.cl
    require_finite_rows([(sides.ref_store, sides.rtap, r_sample), (sides.cand_store, sides.ctap, c_sample)], size)
    depths = _segment_depths(rl.width // size, meta.ref_aux, meta.cand_aux, meta.ref_meta, meta.cand_meta)
    calibration = _calibration_rows(sides.ref_store, sides.rtap, ref_index, rl.width, compute.dtype, notes)
    segplan = plan_segments(c_sample, r_sample, size, rl.dtype, cl.dtype, depths, seed=opts.seed, compute=compute,
                            assumed_depth=opts.assumed_depth or num_layers(meta.ref_meta) or num_layers(meta.cand_meta),
                            calibration=calibration)
    notes += refine_relations(segplan, c_sample, r_sample, side_row_model(ref_index.streams), side_row_model(cand_index.streams),
                              lambda: _sample_tokens(pairs, ref_index, cand_index, opts), opts.final_norm)
    del c_sample, r_sample, ahead  # (up to 2 x 100 MB at 3 x 4096: not held through the pass)
    if not (ref_index.has_tokens and cand_index.has_tokens):
        evidence.pairing = pairing_of_rows(pairs, ref_index, cand_index, segplan, min(opts.sample_rows, 2048), opts.seed + 2)
    return pairs, offset, offset_scores, segplan


def _stream(sides: _Sides, pairs: RowPairs, segplan: SegmentPlan, size: int,
            opts: CompareOptions) -> tuple[StreamResult, dict]:
    """The streaming pass over every pair, then the subsets of rows that differ."""
    ref_index, cand_index, rl = sides.ref_index, sides.cand_index, sides.rl
    matched = [(d.candidate, d.reference) for d in segplan.decisions
               if d.reference is not None and d.duplicate_of is None]
    # Same-slot pairs the plan left unmatched are measured too: their rows may be right on all
    # but a subset (a bug on most decode rows can hide the match in the sample).
    probes = _same_slot_probes(segplan, matched, rl.width // size, sides.cl.width // size)
    pass_pairs = matched + probes
    scales = [(segplan.ref_scales.mean[j], segplan.ref_scales.scale[j]) for _, j in pass_pairs]
    _stage(opts, "comparing rows")
    if opts.progress_total is not None:
        opts.progress_total(len(pairs))
    stream = stream_metrics(pairs, ref_index, cand_index, pass_pairs, size, scales, progress=opts.progress,
                            limits=pair_limits(segplan, pass_pairs), profiles=profile_requests(segplan),
                            runner=opts.runner, block_bytes=opts.block_bytes)
    matched_set = set(matched)
    stream.metrics = [m for m in stream.metrics if (m.candidate, m.reference) in matched_set]
    for m in stream.metrics:
        n = segplan.noise[m.reference]
        m.noise_source, m.expected_drift, m.limit_source = n.source, n.drift, n.limit_source
        m.neighbour_distance = n.neighbour if n.neighbour is not None else float("nan")
    _stage(opts, "localising")
    subsets = localise_subsets(pass_pairs, pairs, ref_index, cand_index, stream, segplan, _labels_of(rl, size))
    stream.profiles = with_subset_profiles(stream, subsets)
    return stream, subsets


def _assemble_report(sides: _Sides, alignment: Alignment, sizes: SegmentSizes, meta: _Metadata,
                     measured: _Measured, notes: list[str]) -> Report:
    """The report without its findings: both sides, the plan, the segment map, the matrices, the metrics."""
    pairs, segplan, stream = measured.pairs, measured.segplan, measured.stream
    ref_index, cand_index = sides.ref_index, sides.cand_index
    if pairs.replicas:
        names = stream_names(cand_index.streams)
        writers = sorted({names[int(k)] for k in np.unique(cand_index.stream_of(pairs.candidate))})
        notes.append(f"{pairs.replicas} aligned rows are held by more than one candidate writer group "
                     f"({', '.join(writers)}): tensor-parallel replicas (ranks, or stores of replicas), each compared with the reference")
    if isinstance(sides.ref_store, StoreSet):  # (single stores: reports unchanged)
        notes += _reference_replica_notes(alignment, ref_index)
    pairing = check_token_pairing(pairs, ref_index, cand_index)
    if pairing.unknown:
        notes.append(f"draft input tokens (next_token_id) compared on {pairing.compared} aligned rows; "
                     f"{pairing.unknown} rows where a side does not know the next token are not compared")
    rlabels = _labels_of(sides.rl, sizes.reference)
    clabels = _labels_of(sides.cl, sizes.candidate)
    plan = _plan_summary(sides, alignment, sizes, measured, pairing.to_dict(), notes)
    reference = _side(sides.ref_store, sides.rtap, ref_index, sides.rl, sizes.reference, rlabels, meta.ref_meta, meta.ref_aux)
    candidate = _side(sides.cand_store, sides.ctap, cand_index, sides.cl, sizes.candidate, clabels, meta.cand_meta,
                      meta.cand_aux)
    segment_map = ([_segment_match(d, segplan, rlabels, clabels) for d in segplan.decisions] if segplan else [])
    return Report(
        reference=reference,
        candidate=candidate,
        plan=plan,
        segment_map=segment_map,
        matrix=[[float(x) for x in row] for row in segplan.raw] if segplan else [],
        metrics=stream.metrics,
        findings=[],
        config_diff=meta.diff,
        tracediff_version=__version__,
        matrix_standardised=[[float(x) for x in row] for row in segplan.standardised] if segplan else [],
        position_profiles=stream.profiles,
    )


def _plan_summary(sides: _Sides, alignment: Alignment, sizes: SegmentSizes, measured: _Measured,
                  token_pairing: dict[str, Any], notes: list[str]) -> Plan:
    pairs, segplan = measured.pairs, measured.segplan
    ref_index, cand_index = sides.ref_index, sides.cand_index
    deltas = alignment.delta_histogram()
    return Plan(
        tap_reference=sides.rtap,
        tap_candidate=sides.ctap,
        segment_size=sizes.reference if sizes.comparable else 0,
        segment_size_source=sizes.source,
        sequences_reference=len(alignment.ref_groups),
        sequences_candidate=len(alignment.cand_groups),
        sequences_aligned=alignment.aligned_sequences,
        sequence_deltas={str(k): v for k, v in deltas.items()},
        label_offset=measured.offset,
        offset_scores=measured.offset_scores,
        pairs=len(pairs),
        candidate_rows_unaligned=pairs.unaligned,
        candidate_rows_duplicate=pairs.duplicates,
        candidate_rows_trailing=pairs.trailing,
        sequences_split={"reference": ref_index.split_sequences, "candidate": cand_index.split_sequences},
        candidate_rows_invalid=int((~cand_index.valid).sum()),
        reference_rows_uncovered=int(ref_index.valid.sum()) - pairs.reference_rows,
        candidate_rows_replica=pairs.replicas,
        sample_rows=segplan.sample_rows if segplan else 0,
        noise_floor=segplan.floor.distance if segplan else 0.0,
        notes=notes,
        noise_floor_error=math.sqrt(segplan.floor.error) if segplan else 0.0,
        numerics_budget=math.sqrt(max(segplan.budgets)) if segplan and segplan.budgets else 0.0,
        numerics_budgets=[math.sqrt(b) for b in segplan.budgets] if segplan else [],
        budget_depths=list(segplan.depths) if segplan else [],
        compute_dtype=segplan.compute_dtype if segplan else "",
        noise=[n.to_dict() for n in segplan.noise] if segplan else [],
        compute=segplan.compute.to_dict() if segplan else {},
        calibration=segplan.calibration.to_dict() if segplan and segplan.calibration else None,
        drift_limits=[math.sqrt(x) for x in segplan.limits] if segplan else [],
        reference_segment_size=sizes.reference,
        candidate_segment_size=sizes.candidate,
        token_pairing=token_pairing,
    )


def _side(store: Side_, tap: str, index: RowIndex, layout: Layout, size: int, labels: list[str], meta: dict[str, Any],
          aux: AuxLayers | None) -> Side:
    return Side(
        path=str(store.path),
        tap=tap,
        role=str(store.source.get("role", "")),
        rows=len(index),
        valid_rows=int(index.valid.sum()),
        writers=stream_names(index.streams),
        width=layout.width,
        dtype=layout.dtype,
        segment_size=size,
        segments=layout.width // size,
        segment_labels=list(labels),
        sequences=len(index.group_keys),
        meta={**meta, "stores": store.names} if isinstance(store, StoreSet) else meta,
        aux_layer_config=aux_config(meta),
        aux_layers=aux.to_dict() if aux is not None else None,
        recorded_by=recorded_by(store),
        row_model=row_model_json(side_row_model(index.streams)),
    )


def _draw_findings(report: Report, sides: _Sides, alignment: Alignment, meta: _Metadata, measured: _Measured,
                   opts: CompareOptions) -> None:
    """The findings, in the report's order: the bank's layer names, the recorded drafts' vocabulary
    problems, a recording compared with itself or the roles swapped first, the next steps."""
    ref_store, cand_store, segplan = sides.ref_store, sides.cand_store, measured.segplan
    if opts.bank and segplan:
        _stage(opts, "naming layers (bank)")
    bank = _identify_with_bank(ref_store, cand_store, report, opts) if opts.bank and segplan else None
    _stage(opts, "findings")
    report.findings = build_findings(report, alignment, measured.pairs, segplan, measured.stream, meta.ref_aux,
                                     meta.cand_aux, bank, measured.subsets)
    for side, side_meta in (("candidate", meta.cand_meta), ("reference", meta.ref_meta)):
        for p in recorded_d2t_problems(side_meta, side):
            report.findings.append(Finding("draft_vocabulary", p["severity"], p["message"][0].upper() + p["message"][1:]
                                           + ".", {k: v for k, v in p.items() if k not in ("severity", "message")}))
    if bank is not None:
        name_bank_layers(report, bank, opts.bank)
    same = same_recording_of(ref_store, cand_store)
    if same is not None:
        what = ("the same store" if same == "same store"
                else f"two copies of one recording ({Path(str(ref_store.path)).name} and {Path(str(cand_store.path)).name})")
        report.findings.insert(0, Finding(
            "same_recording", "warning",
            f"Both sides are {what}: this compare checks the store against itself and says nothing about "
            f"the server. Compare the trainer's store with one the server recorded.",
            {"how": same, "reference": str(ref_store.path), "candidate": str(cand_store.path)}))
    swapped = swapped_roles(ref_store, cand_store)
    if swapped is not None:
        report.findings.insert(0, swapped)
    attach_next_steps(report)


Side_ = TraceStore | StoreSet


def _load_indexes(ref_store: Side_, rtap: str, cand_store: Side_, ctap: str) -> tuple[RowIndex, RowIndex]:
    """Both sides' row indexes, loaded concurrently (decoding label chunks), but their light label
    columns first, one after the other in this thread (:meth:`RowIndex.light_labels`: at 8 M rows a
    side, every label 1.05 s read side by side, 0.75 s this way). The reference's error first, as
    when loaded one by one."""
    light: list[Any] = []
    for store, tap in ((ref_store, rtap), (cand_store, ctap)):
        try:
            light.append(RowIndex.light_labels(store, tap))
        except Exception as exc:  # noqa: BLE001  (raised below, after any of the reference's own)
            light.append(exc)
    ref_read, cand_read = light
    if isinstance(ref_read, BaseException):
        raise ref_read
    if isinstance(cand_read, BaseException):
        RowIndex.load(ref_store, rtap, ref_read)
        raise cand_read
    return in_parallel(lambda: RowIndex.load(ref_store, rtap, ref_read), lambda: RowIndex.load(cand_store, ctap, cand_read))


def _reference_replica_notes(alignment: Any, ref_index: RowIndex) -> list[str]:
    """Reference sequences held whole by several writer groups (replicated ranks or stores): the
    candidate is paired with one copy; say so, and how to check the others."""
    if len(ref_index.streams) < 2:
        return []
    seen: dict[bytes, int] = {}
    copies, rows, writers = 0, 0, set()
    names = stream_names(ref_index.streams)
    for key, g in alignment.ref_groups.items():
        if g.tokens.size == 0 or (g.tokens < 0).all():
            continue
        digest = g.positions.tobytes() + b"|" + g.tokens.tobytes()
        first = seen.setdefault(digest, key)
        if first != key:
            copies += 1
            rows += g.size
            for k in (first, key):
                writers.add(names[int(ref_index.stream_of(alignment.ref_groups[k].rows[0]))])
    if not copies:
        return []
    return [f"{copies} reference sequences ({rows} rows) are held whole by more than one reference writer group "
            f"({', '.join(sorted(writers))}): the candidate is compared with one copy of each; compare a copy "
            f"as the candidate to check the reference replicas against each other"]


def _labels_of(layout: Any, size: int) -> list[str]:
    """A side's segment labels as recorded, or ``seg<k>`` when they do not fit its layout."""
    k = layout.width // size
    labels = layout.segment_labels
    return list(labels) if labels and len(labels) == k else [f"seg{j}" for j in range(k)]


def _same_slot_probes(segplan: SegmentPlan, matched: list[tuple[int, int]], kr: int, kc: int) -> list[tuple[int, int]]:
    taken_c = {i for i, _ in matched} | {d.candidate for d in segplan.decisions if d.duplicate_of is not None}
    taken_r = {j for _, j in matched}
    return [(i, i) for i in range(min(kr, kc)) if i not in taken_c and i not in taken_r
            and i not in segplan.dead_candidate and i not in segplan.dead_reference]


def _segment_depths(kr: int, ref_aux: AuxLayers | None, cand_aux: AuxLayers | None, ref_meta: dict[str, Any],
                    cand_meta: dict[str, Any]) -> list[int | None]:
    """Per reference segment, how many decoder layers deep it is: from the reference's recorded
    layers, else the candidate's for the same slot; None where neither records it."""
    layers = num_layers(ref_meta) or num_layers(cand_meta)
    out: list[int | None] = [None] * kr
    for aux in (ref_aux, cand_aux):
        if aux is None or aux.physical is None or len(aux.physical) != kr:
            continue
        for j, p in enumerate(aux.physical):
            if out[j] is None and (p != FINAL_NORM or layers):
                out[j] = layers if p == FINAL_NORM else int(p)
    return out


def _plan_pick(pairs: Any, cand_index: RowIndex, opts: CompareOptions, notes: list[str]) -> np.ndarray:
    """The plan sample: pairs drawn at random, leaving out the rows after tokens inserted into (or
    deleted from) a candidate sequence while enough others remain: those rows see another context
    by construction (reported as such), and must not decide what the segments are nor what numerics
    cost."""
    first: dict[int, int] = {}
    for ins in pairs.insertions:
        g = int(ins["group"])
        first[g] = min(first.get(g, ins["position"]), int(ins["position"]))
    if not first:
        return sample_pairs(pairs, opts.sample_rows, opts.seed + 1)
    groups = cand_index.group[pairs.candidate]
    positions = cand_index.position[pairs.candidate]
    changed = np.zeros(len(pairs), dtype=bool)
    for g, p in first.items():
        changed |= (groups == g) & (positions >= p)
    keep = np.flatnonzero(~changed)
    if keep.size < max(32, len(pairs) // 10):
        return sample_pairs(pairs, opts.sample_rows, opts.seed + 1)
    notes.append(f"{int(changed.sum())} aligned rows after tokens inserted into or deleted from their sequence are left "
                 f"out of the plan sample (another context by construction); the streaming pass measures every row")
    sub = sample_pairs(_Subset(keep.size), opts.sample_rows, opts.seed + 1)
    return keep[sub]


def _sample_tokens(pairs: RowPairs, ref_index: RowIndex, cand_index: RowIndex, opts: CompareOptions) -> SampleTokens:
    """The token labels of the plan sample's pairs (the same draw as the sample: :func:`_plan_pick`)."""
    pick = _plan_pick(pairs, cand_index, opts, [])
    r, c = pairs.reference[pick], pairs.candidate[pick]
    return SampleTokens(ref_index.token_id[r].astype(np.int64), ref_index.column("next_token_id")[r].astype(np.int64),
                        cand_index.token_id[c].astype(np.int64), cand_index.column("next_token_id")[c].astype(np.int64))


class _Subset:
    """A stand-in of ``n`` pairs for :func:`sample_pairs`, which only counts them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _calibration_rows(store: Side_, tap: str, index: RowIndex, width: int, compute: str,
                      notes: list[str]) -> CalibrationRows | None:
    """The reference store's calibration rows (tap ``calibration``, ``tracediff calibrate``) paired
    with its own rows of the same tokens; None when it has none that fit."""
    if tap == CALIBRATION_TAP or CALIBRATION_TAP not in store.taps or not store.rows(CALIBRATION_TAP):
        return None
    layout = stream_layout(store, CALIBRATION_TAP)
    calibrates = layout.attrs.get("calibrates")
    if calibrates not in (None, tap):
        return None
    if layout.width != width:
        notes.append(f"calibration rows of {store.path} are {layout.width} wide, the reference's {width}: not used")
        return None
    cal_index = RowIndex.load(store, CALIBRATION_TAP)
    pairs = pair_rows(align_sequences(index, cal_index), 0)
    if len(pairs) < 2:
        notes.append(f"calibration rows of {store.path} share no tokens with its tap {tap}: not used")
        return None
    pick = sample_pairs(pairs, 4096, 0)
    cal_dtype = canonical_dtype(layout.attrs.get("compute_dtype"))
    if cal_dtype is not None and cal_dtype != compute:
        notes.append(f"calibration rows of {store.path} were computed in {cal_dtype}, this compare's compute dtype is "
                     f"{compute}: their drift is used as measured")
    sequences = int(np.unique(cal_index.group[pairs.candidate[pick]]).size)
    return CalibrationRows(read_rows(cal_index, pairs.candidate[pick]), read_rows(index, pairs.reference[pick]),
                           cal_dtype, str(store.path), CALIBRATION_TAP, sequences)


def _identify_with_bank(ref_store: TraceStore, cand_store: TraceStore, report: Report, opts: CompareOptions) -> Any:
    """Both sides' segments named against the bank (``compare --bank``)."""
    from tracediff.compare.plan.identify import identify_segments  # noqa: PLC0415

    size = report.plan.segment_size
    ref_id = identify_segments(ref_store.path, opts.bank or "", tap=report.plan.tap_reference, segment_size=size)
    cand_id = identify_segments(cand_store.path, opts.bank or "", tap=report.plan.tap_candidate, segment_size=size)
    return ref_id, cand_id


def _segment_match(d: SegmentDecision, segplan: SegmentPlan, rlabels: list[str], clabels: list[str]) -> SegmentMatch:
    rel = segplan.relations.get(d.candidate)
    if d.duplicate_of is not None:
        status = "duplicate"
    elif d.reference is None:
        status = "extra"
    elif d.tier in ("exact", "near") or (rel is not None and rel.relation != "other"):
        status = "same" if d.reference == d.candidate else "moved"
    else:
        status = "related"
    ref = d.reference
    raw, std = segplan.raw, segplan.standardised
    return SegmentMatch(
        candidate=d.candidate,
        reference=ref,
        status=status,
        cosine=float(raw[d.candidate, ref]) if ref is not None else None,
        runner_up=d.runner_up,
        runner_up_cosine=float(raw[d.candidate, d.runner_up]) if d.runner_up is not None else None,
        candidate_label=clabels[d.candidate],
        reference_label=rlabels[ref] if ref is not None else None,
        standardised_cosine=float(std[d.candidate, ref]) if ref is not None else None,
        relation=rel.relation if rel is not None else None,
        relative_error=rel.relative_error if rel is not None else None,
        transform=rel.transform.to_dict() if rel is not None and rel.transform is not None else None,
    )
