"""Compare two traces: plan from metadata and a sample, then one streaming pass, then findings.

The first store is the reference (what the draft learned: usually the trainer), the second the
candidate (usually the server). :func:`compare_stores` returns a :class:`tracediff.results.Report`;
it raises :class:`tracediff.errors.CompareError` (exit 2) when the stores cannot be compared at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff import __version__
from tracediff.align import Alignment, RowIndex, RowPairs, align_sequences, pair_rows
from tracediff.diagnose import StreamResult, _aligned_empty, _ChunkReader, stream_metrics
from tracediff.errors import CompareError
from tracediff.results import Plan, Report, SegmentMatch, Side
from tracediff.segments import (
    SegmentDecision,
    infer_segment_size,
    match_segments,
    mismatched_rows_matrix,
    noise_floor,
    segment_cosine_matrix,
    to_float32,
)
from tracediff.store import VALUE_DTYPES, TraceStore, open_store

OFFSETS = (-2, -1, 0, 1, 2)
VOLATILE_KEYS = re.compile(
    r"(^|_)(pid|host|hostname|started|updated|time|timestamp|argv|python|recorded_by|record|limits|injected)$"
)
AUX_KEYS = re.compile(r"layer_ids|layers_to_capture|aux_hidden_state|eagle_aux|aux_layer|segment_labels", re.I)


# Tap names that hold the same fc input (reference name, candidate name), tried in order when the
# stores share no tap: a server in capture-only mode records the target's packed aux states only.
FC_INPUT_EQUIVALENTS = (("fc_in", "aux_hidden"), ("aux_hidden", "fc_in"), ("fc_in", "fc_in_raw"), ("fc_in_raw", "fc_in"))


@dataclass
class CompareOptions:
    tap: str | None = None
    reference_tap: str | None = None
    candidate_tap: str | None = None
    segment_size: int | None = None
    sample_rows: int = 2048
    offset_sample_rows: int = 512
    seed: int = 0
    progress: Callable[[int], None] | None = None
    progress_total: Callable[[int], None] | None = None
    bank: str | None = None
    extra_notes: list[str] = field(default_factory=list)


def _pick_taps(ref: TraceStore, cand: TraceStore, opts: CompareOptions) -> tuple[str, str]:
    if opts.reference_tap or opts.candidate_tap:
        rt = opts.reference_tap or opts.tap or opts.candidate_tap
        ct = opts.candidate_tap or opts.tap or opts.reference_tap
        assert rt is not None and ct is not None
        ref.tap_streams(rt)
        cand.tap_streams(ct)
        return rt, ct
    if opts.tap:
        ref.tap_streams(opts.tap)
        cand.tap_streams(opts.tap)
        return opts.tap, opts.tap
    common = [t for t in ref.taps if t in cand.taps and ref.rows(t) and cand.rows(t)]
    if not common:
        # The same fc input under the names different capture points give it: a trainer's fc_in
        # against a server's packed aux states (capture-only mode, no draft loaded).
        for rt, ct in FC_INPUT_EQUIVALENTS:
            if rt in ref.taps and ct in cand.taps and ref.rows(rt) and cand.rows(ct):
                opts.extra_notes.append(f"no common tap: compared reference {rt} with candidate {ct} "
                                        f"(both are the fc input); choose others with --ref-tap/--cand-tap")
                return rt, ct
        raise CompareError(
            f"no common tap with rows: {ref.path} has {tap_summary(ref)}, {cand.path} has {tap_summary(cand)}; "
            f"choose with --tap, or --ref-tap/--cand-tap"
        )
    preferred = [t for t in common if t == "fc_in"] or [t for t in common if not t.startswith("bank")] or common
    return preferred[0], preferred[0]


def tap_summary(store: TraceStore) -> str:
    """'bank (0 rows), fc_in (1937 rows)' or 'no taps': what a store holds, for error messages."""
    return ", ".join(f"{t} ({store.rows(t)} rows)" for t in store.taps) or "no taps"


def _stream_layout(store: TraceStore, tap: str) -> tuple[int, str, int | None, list[str] | None, dict[str, Any]]:
    streams = store.tap_streams(tap)
    with_rows = [s for s in streams if s.rows] or streams
    widths = {s.width for s in with_rows}
    dtypes = {s.dtype for s in with_rows}
    if len(widths) > 1 or len(dtypes) > 1:
        raise CompareError(
            f"{store.path}/{tap}: writers disagree on the row layout (widths {sorted(widths)}, dtypes {sorted(dtypes)}); "
            f"compare one process at a time"
        )
    first = with_rows[0]
    return first.width, first.dtype, first.segment_size, first.segment_labels, first.attrs


def _collect_meta(store: TraceStore, tap: str) -> dict[str, Any]:
    attrs = _stream_layout(store, tap)[4]
    tap_meta = {k: v for k, v in attrs.items() if k not in ("commit", "source", "meta", "limits", "phases", "rank",
                                                            "world_size", "tap")}
    # The in-process recorder writes its meta both at the root and per writer: keep each key once.
    writer_meta = {k: v for k, v in (attrs.get("meta") or {}).items() if store.meta.get(k) != v}
    return {"store": store.meta, "writer": writer_meta, "tap": tap_meta}


def _aux_config(meta: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(meta, dict):
        for k, v in meta.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if AUX_KEYS.search(str(k)):
                out[path] = v
            elif isinstance(v, dict):
                out.update(_aux_config(v, path))
    return out


def config_diff(ref_meta: dict[str, Any], cand_meta: dict[str, Any]) -> list[dict[str, Any]]:
    """deepdiff of the two metas, volatile keys (pids, hosts, times, command lines) left out."""
    from deepdiff import DeepDiff  # noqa: PLC0415

    diff = DeepDiff(ref_meta, cand_meta, ignore_order=False, verbose_level=2,
                    exclude_obj_callback=lambda obj, path: bool(VOLATILE_KEYS.search(_last_key(path))))
    out: list[dict[str, Any]] = []
    for change, items in diff.to_dict().items():
        if not isinstance(items, dict):
            continue
        for path, value in items.items():
            entry: dict[str, Any] = {"path": _clean_path(path), "change": change}
            if isinstance(value, dict) and ("old_value" in value or "new_value" in value):
                entry["reference"] = _plain(value.get("old_value"))
                entry["candidate"] = _plain(value.get("new_value"))
            elif "removed" in change:
                entry["reference"] = _plain(value)
                entry["candidate"] = None
            else:
                entry["reference"] = None
                entry["candidate"] = _plain(value)
            out.append(entry)
    # Aux-layer settings are shown whole ([3, 31, 59] -> [2, 30, 58]), not item by item.
    ref_aux, cand_aux = _aux_config(ref_meta), _aux_config(cand_meta)
    out = [e for e in out if not any(e["path"] == k or e["path"].startswith(k + ".") for k in (*ref_aux, *cand_aux))]
    for key in sorted(set(ref_aux) | set(cand_aux)):
        if ref_aux.get(key) != cand_aux.get(key):
            out.append({"path": key, "change": "values_changed", "reference": _plain(ref_aux.get(key)),
                        "candidate": _plain(cand_aux.get(key))})
    out.sort(key=lambda e: (0 if AUX_KEYS.search(e["path"]) else 1, e["path"]))
    return out


def _last_key(path: str) -> str:
    match = re.findall(r"\['([^']*)'\]", path)
    return match[-1] if match else path


def _clean_path(path: str) -> str:
    parts = re.findall(r"\[(?:'([^']*)'|(\d+))\]", path)
    return ".".join(a or f"[{b}]" for a, b in parts) or path


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _sample(pairs: RowPairs, k: int, seed: int) -> np.ndarray:
    n = len(pairs)
    if n <= k:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=k, replace=False))


def _read_rows(index: RowIndex, rows: np.ndarray) -> torch.Tensor:
    width = index.streams[0].width
    dtype = index.streams[0].dtype
    buf = _aligned_empty((rows.size, width), VALUE_DTYPES[dtype])
    reader = _ChunkReader(index, max_chunks=16)  # reads each chunk once whatever the order of rows
    try:
        reader.gather(rows, buf)
    finally:
        reader.close()
    return to_float32(buf, dtype)


def require_finite_rows(
    sides: list[tuple[TraceStore, str, torch.Tensor]], size: int, what: str = "compare"
) -> None:
    """Refuse (one :class:`CompareError` naming the file) when a side's paired sample has no row free
    of NaN and Inf: segments are matched on finite rows only, so there would be nothing to decide
    from, and a report of every segment missing says nothing true. Some non-finite rows are fine:
    they become ``nonfinite`` findings while the finite rows are compared."""
    finite = None
    for store, tap, rows in sides:
        ok = torch.isfinite(rows).all(dim=1)
        finite = ok if finite is None else finite & ok
        if rows.shape[0] and not bool(ok.any()):
            where = ""
            if size > 0 and rows.shape[1] % size == 0:
                bad = (~torch.isfinite(rows.reshape(rows.shape[0], -1, size))).any(dim=2).any(dim=0)
                where = f" (segments {[int(i) for i in torch.nonzero(bad).flatten()]})"
            raise CompareError(
                f"{store.path}: tap {tap} values hold NaN or Inf in every one of the {rows.shape[0]} sampled aligned "
                f"rows{where}: nothing finite to {what}; find where the non-finite values come from"
            )
    if finite is not None and finite.numel() and not bool(finite.any()):
        (a, ta, _), (b, tb, _) = sides[0], sides[1]
        raise CompareError(
            f"{a.path} (tap {ta}) and {b.path} (tap {tb}): no sampled aligned row is free of NaN or Inf on both "
            f"sides: nothing finite to {what}; find where the non-finite values come from"
        )


def _offset_search(
    alignment: Alignment, size: int, opts: CompareOptions, base: RowPairs | None = None
) -> tuple[int, dict[str, float], RowPairs]:
    """Try label offsets -2..2: the one under which paired rows are most alike wins.

    Score: per candidate segment, the best centred cosine with any reference segment, averaged.
    An offset other than 0 is taken only if its distance is under half that of offset 0.
    """
    results: dict[int, tuple[float, RowPairs]] = {}
    base = pair_rows(alignment, 0) if base is None else base
    cand_idx = alignment.candidate
    ref_idx = alignment.reference
    for off in OFFSETS:
        pairs = base if off == 0 else pair_rows(alignment, off)
        if len(pairs) == 0:
            continue
        pick = _sample(pairs, opts.offset_sample_rows, opts.seed)
        c = _read_rows(cand_idx, pairs.candidate[pick])
        r = _read_rows(ref_idx, pairs.reference[pick])
        m = segment_cosine_matrix(c, r, size, centred=True)
        score = float(np.nanmean(np.nanmax(m, axis=1))) if np.isfinite(m).any() else float("nan")
        results[off] = (score, pairs)
    scores = {str(k): v[0] for k, v in sorted(results.items())}
    if 0 not in results:
        if not results:
            return 0, scores, base
        best = max(results, key=lambda k: results[k][0] if math.isfinite(results[k][0]) else -1)
        return best, scores, results[best][1]
    d0 = 1 - results[0][0]
    best = 0
    for off, (score, _p) in results.items():
        d = 1 - score
        if math.isfinite(d) and d < 0.5 * d0 and d < 1 - results[best][0]:
            best = off
    return best, scores, results[best][1]


def compare_stores(reference_path: str | Path, candidate_path: str | Path, opts: CompareOptions | None = None) -> Report:
    opts = opts or CompareOptions()
    ref_store = open_store(reference_path)
    cand_store = open_store(candidate_path)
    try:
        return _compare(ref_store, cand_store, opts)
    finally:
        ref_store.close()
        cand_store.close()


def _compare(ref_store: TraceStore, cand_store: TraceStore, opts: CompareOptions) -> Report:
    from tracediff.findings import build_findings  # noqa: PLC0415

    rtap, ctap = _pick_taps(ref_store, cand_store, opts)
    rw, rdt, rsize, rlabels, _ = _stream_layout(ref_store, rtap)
    cw, cdt, csize, clabels, _ = _stream_layout(cand_store, ctap)
    # The two row indexes load concurrently: reading labels is mostly zarr's per-chunk overhead.
    with ThreadPoolExecutor(2, thread_name_prefix="tracediff-labels") as ex:
        ref_future = ex.submit(RowIndex.load, ref_store, rtap)
        cand_future = ex.submit(RowIndex.load, cand_store, ctap)
        ref_index = ref_future.result()  # the reference's error first, as when loaded one by one
        cand_index = cand_future.result()
    notes = list(opts.extra_notes)

    # -- sequences
    alignment = align_sequences(ref_index, cand_index)
    notes += alignment.notes
    base_pairs = pair_rows(alignment, 0)
    if len(base_pairs) == 0:
        raise CompareError(
            f"zero aligned rows between {ref_store.path} ({rtap}) and {cand_store.path} ({ctap}): "
            f"no candidate sequence shares tokens with a reference sequence; were both recorded on the same "
            f"inputs (see `tracediff send`)?"
        )

    # -- segment size
    if opts.segment_size is not None:
        size, size_source = opts.segment_size, "option"
        if opts.segment_size <= 0 or rw % size or cw % size:
            raise CompareError(
                f"--segment-size {size} does not divide the row widths (reference {rw}, candidate {cw})"
            )
    elif rsize and csize and rw % rsize == 0 and cw % csize == 0 and rsize == csize:
        size, size_source = rsize, "meta"
    elif (rsize or csize) and rw % (rsize or csize) == 0 and cw % (rsize or csize) == 0:
        size, size_source = int(rsize or csize), "meta"
        if rsize and csize and rsize != csize:
            notes.append(f"segment sizes in meta differ (reference {rsize}, candidate {csize}); used {size}")
    else:
        pick = _sample(base_pairs, 256, opts.seed)
        size, how = infer_segment_size(
            rw, cw, _read_rows(ref_index, base_pairs.reference[pick]), _read_rows(cand_index, base_pairs.candidate[pick])
        )
        size_source = "inferred"
        notes.append(f"segment size {size} {how}; pass --segment-size to override")
    if rw % size or cw % size:
        raise CompareError(f"segment size {size} does not divide the row widths (reference {rw}, candidate {cw})")

    # -- label offset, then the pairs every later stage uses
    offset, offset_scores, pairs = _offset_search(alignment, size, opts, base_pairs)

    # -- segment matching on a sample
    pick = _sample(pairs, opts.sample_rows, opts.seed + 1)
    c_sample = _read_rows(cand_index, pairs.candidate[pick])
    r_sample = _read_rows(ref_index, pairs.reference[pick])
    require_finite_rows([(ref_store, rtap, r_sample), (cand_store, ctap, c_sample)], size)
    raw = segment_cosine_matrix(c_sample, r_sample, size)
    centred = segment_cosine_matrix(c_sample, r_sample, size, centred=True)
    baseline = mismatched_rows_matrix(c_sample, r_sample, size)
    floor = noise_floor(r_sample, size, rdt, cdt, seed=opts.seed)
    decisions = match_segments(centred, baseline, floor)

    kc, kr = cw // size, rw // size
    rlabels = rlabels if rlabels and len(rlabels) == kr else [f"seg{j}" for j in range(kr)]
    clabels = clabels if clabels and len(clabels) == kc else [f"seg{i}" for i in range(kc)]
    segment_map = [_segment_match(d, raw, rlabels, clabels) for d in decisions]

    # -- the streaming pass
    matched = [(d.candidate, d.reference) for d in decisions if d.reference is not None and d.duplicate_of is None]
    if opts.progress_total is not None:
        opts.progress_total(len(pairs))
    stream: StreamResult = stream_metrics(pairs, ref_index, cand_index, matched, size, progress=opts.progress)

    ref_meta = _collect_meta(ref_store, rtap)
    cand_meta = _collect_meta(cand_store, ctap)
    diff = config_diff(ref_meta, cand_meta)
    deltas = alignment.delta_histogram()
    plan = Plan(
        tap_reference=rtap,
        tap_candidate=ctap,
        segment_size=size,
        segment_size_source=size_source,
        sequences_reference=len(alignment._ref_groups),
        sequences_candidate=len(alignment._cand_groups),
        sequences_aligned=alignment.aligned_sequences,
        sequence_deltas={str(k): v for k, v in deltas.items()},
        label_offset=offset,
        offset_scores=offset_scores,
        pairs=len(pairs),
        candidate_rows_unaligned=pairs.unaligned,
        candidate_rows_duplicate=pairs.duplicates,
        candidate_rows_invalid=int((~cand_index.valid).sum()),
        reference_rows_uncovered=int(ref_index.valid.sum()) - len(pairs),
        sample_rows=int(pick.size),
        noise_floor=floor,
        notes=notes,
    )
    sides = []
    for store, tap, index, width, dtype, labels, meta in (
        (ref_store, rtap, ref_index, rw, rdt, rlabels, ref_meta),
        (cand_store, ctap, cand_index, cw, cdt, clabels, cand_meta),
    ):
        sides.append(
            Side(
                path=str(store.path),
                tap=tap,
                role=str(store.source.get("role", "")),
                rows=len(index),
                valid_rows=int(index.valid.sum()),
                writers=[s.writer for s in index.streams],
                width=width,
                dtype=dtype,
                segment_size=size,
                segments=width // size,
                segment_labels=list(labels),
                sequences=len(index.group_keys),
                meta=meta,
                aux_layer_config=_aux_config(meta),
            )
        )
    report = Report(
        reference=sides[0],
        candidate=sides[1],
        plan=plan,
        segment_map=segment_map,
        matrix=[[float(x) for x in row] for row in raw],
        metrics=stream.metrics,
        findings=[],
        config_diff=diff,
        tracediff_version=__version__,
    )
    report.findings = build_findings(report, alignment, pairs, decisions, stream, centred, baseline)
    if opts.bank:
        _name_layers(report, ref_store, cand_store, opts)
    return report


def _name_layers(report: Report, ref_store: TraceStore, cand_store: TraceStore, opts: CompareOptions) -> None:
    """With a bank: say which layer each segment is, inside the segment map and the findings."""
    from tracediff.identify import identify_segments  # noqa: PLC0415

    size = report.plan.segment_size
    ref_id = identify_segments(ref_store.path, opts.bank or "", tap=report.plan.tap_reference, segment_size=size)
    cand_id = identify_segments(cand_store.path, opts.bank or "", tap=report.plan.tap_candidate, segment_size=size)

    def name(ident: Any, i: int) -> str:
        seg = ident.segments[i]
        return seg.best.text if seg.best is not None and seg.verdict in ("match", "scaled") else "no layer of the bank"

    for m in report.segment_map:
        m.bank_layer = name(cand_id, m.candidate)
    for f in report.findings:
        if f.kind == "segment_extra":
            i = f.evidence["candidate_segment"]
            f.message = f.message.replace("; use --bank to name its layer.", ".")
            f.message += f" Candidate segment {i} is {name(cand_id, i)}; the reference never used it."
            f.evidence["bank_layer"] = name(cand_id, i)
        elif f.kind == "segment_missing":
            j = f.evidence["reference_segment"]
            f.message += f" Reference segment {j} is {name(ref_id, j)}."
            f.evidence["bank_layer"] = name(ref_id, j)
    for side, ident in (("reference", ref_id), ("candidate", cand_id)):
        layers = ", ".join(name(ident, i) for i in range(len(ident.segments)))
        report.plan.notes.append(f"bank {opts.bank}: {side} segments are {layers}")
        if ident.suggestions:
            shown = "; ".join(f"{k} = {v}" for k, v in ident.suggestions.items())
            report.plan.notes.append(f"{side} in config terms: {shown}")


def _segment_match(d: SegmentDecision, raw: np.ndarray, rlabels: list[str], clabels: list[str]) -> SegmentMatch:
    if d.duplicate_of is not None:
        status = "duplicate"
    elif d.reference is None:
        status = "extra"
    elif d.tier in ("exact", "near"):
        status = "same" if d.reference == d.candidate else "moved"
    else:
        status = "related"
    ref = d.reference
    return SegmentMatch(
        candidate=d.candidate,
        reference=ref,
        status=status,
        cosine=float(raw[d.candidate, ref]) if ref is not None else None,
        runner_up=d.runner_up,
        runner_up_cosine=float(raw[d.candidate, d.runner_up]) if d.runner_up is not None else None,
        candidate_label=clabels[d.candidate],
        reference_label=rlabels[ref] if ref is not None else None,
    )
