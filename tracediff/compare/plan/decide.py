"""The plan: everything decided before the streaming pass, from metadata and a small sample.

Used by compare and identify alike. In order (DESIGN.md §5): taps, each side's row layout and
segment size (shapes first: two hidden sizes are a ``shape`` error, never re-cut into more
segments), sequence alignment by token content, the label-offset search, the plan sample, and the
segment decisions: which reference segment each candidate segment comes from (standardised cosines,
ranked against the runner-up and the data's own noise floor) and how the two relate (fitted
transforms, :mod:`tracediff.compare.plan.transforms`). The result is a frozen :class:`SegmentPlan` that the
streaming pass and the findings read; nothing here reads more than the sample.
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracediff.compare.align.rowpairs import RowPairs, mix64, pair_rows
from tracediff.compare.align.sequences import Alignment
from tracediff.compare.plan.noise import (
    ASSUMED_LIMIT_FACTOR,
    CALIBRATION_TAP,
    DEFAULT_DEPTH,
    SEPARATION_FRACTION,
    Calibration,
    CalibrationRows,
    ComputeDtype,
    SegmentNoise,
    decide_compute_dtype,
    neighbour_distances,
    prior_drift,
    segment_noise,
    with_limits,
)
from tracediff.compare.plan.segments import (
    NoiseFloor,
    SegmentDecision,
    SegmentScales,
    closest_counterparts,
    exact_distance,
    frozen,
    infer_segment_size,
    match_segments,
    mismatched_rows_matrix,
    noise_floor,
    relative_error,
    segment_cosine_matrix,
    segment_finite,
    segment_scales,
    split,
    standardised_cosine_matrix,
    to_float32,
    widen_into,
)
from tracediff.compare.plan.transforms import TransformFit, best_transform, fit_transforms
from tracediff.compare.rows.gather import ChunkReader, in_parallel
from tracediff.compare.rows.index import RowIndex
from tracediff.compare.rows.kernels import plan_reads_compiled
from tracediff.errors import CompareError
from tracediff.store import VALUE_DTYPES, TraceStore
from tracediff.store.files import aligned_empty

OFFSETS = (-2, -1, 0, 1, 2)

# Tap names that hold the same fc input (reference name, candidate name), tried in order when the
# stores share no tap: a server in capture-only mode records the target's packed aux states only.
FC_INPUT_EQUIVALENTS = (("fc_in", "aux_hidden"), ("aux_hidden", "fc_in"), ("fc_in", "fc_in_raw"), ("fc_in_raw", "fc_in"))

#: A pair this many times beyond its budget is no longer drift of the same tensor but other data,
#: when the data gives no limit of its own (:mod:`tracediff.compare.plan.noise`).
DRIFT_FACTOR = ASSUMED_LIMIT_FACTOR


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
    #: Called as each stage begins, with its name (tracediff.progress.Progress.stage).
    stage: Callable[[str], None] | None = None
    bank: str | None = None
    extra_notes: list[str] = field(default_factory=list)
    #: Where the streaming pass runs its blocks (:class:`tracediff.compare.stream.cluster.DaskRunner`); None:
    #: threads of this process.
    runner: Any = None
    #: Raw rows of both sides one block of the streaming pass reads (rows of a block: 64..32768 with
    #: the compiled kernels, 64..8192 without): what bounds the memory of each thread or cluster
    #: worker running blocks.
    block_bytes: int = 16 << 20
    #: Passed to :func:`tracediff.store.open_store` with each store's location (URLs: fsspec's options),
    #: here and on cluster workers; None: none.
    storage_options: dict[str, Any] | None = None
    #: The target's final norm weight and where it was read (``compare --target DIR``): names a slot
    #: normalised on one side only as the final norm when that weight explains it (compare/plan/slots.py).
    final_norm: tuple[np.ndarray, str] | None = None
    #: Decoder layers deep the compared tap is, where its segments record no layer (a draft chain tap:
    #: the fc input's deepest slot plus the draft layers before it); None: the model's depth.
    assumed_depth: int | None = None


# ------------------------------------------------------------------------------------------ taps
def pick_taps(ref: TraceStore, cand: TraceStore, opts: CompareOptions) -> tuple[str, str]:
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
        for rt, ct in FC_INPUT_EQUIVALENTS:
            if rt in ref.taps and ct in cand.taps and ref.rows(rt) and cand.rows(ct):
                opts.extra_notes.append(f"no common tap: compared reference {rt} with candidate {ct} "
                                        f"(both are the fc input); choose others with --ref-tap/--cand-tap")
                return rt, ct
        raise CompareError(
            f"no common tap with rows: {ref.path} has {tap_summary(ref)}, {cand.path} has {tap_summary(cand)}; "
            f"choose with --tap, or --ref-tap/--cand-tap"
        )
    preferred = [t for t in common if t == "fc_in"] or [t for t in common if not t.startswith("bank") and t != CALIBRATION_TAP] or common
    return preferred[0], preferred[0]


def tap_summary(store: TraceStore) -> str:
    """'bank (0 rows), fc_in (1937 rows)' or 'no taps': what a store holds, for error messages."""
    return ", ".join(f"{t} ({store.rows(t)} rows)" for t in store.taps) or "no taps"


@dataclass(frozen=True)
class Layout:
    """One side's row layout as its writers recorded it."""

    width: int
    dtype: str
    segment_size: int | None
    segment_labels: list[str] | None
    attrs: dict[str, Any]


def stream_layout(store: TraceStore, tap: str) -> Layout:
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
    return Layout(first.width, first.dtype, first.segment_size, first.segment_labels, first.attrs)


def collect_meta(store: TraceStore, tap: str) -> dict[str, Any]:
    attrs = stream_layout(store, tap).attrs
    # (switch, skip_reasons, threads: how the recording ran, not what the rows are)
    tap_meta = {k: v for k, v in attrs.items() if k not in ("commit", "source", "meta", "limits", "phases", "rank",
                                                            "world_size", "tap", "switch", "skip_reasons", "threads")}
    # The in-process recorder writes its meta both at the root and per writer: keep each key once.
    writer_meta = {k: v for k, v in (attrs.get("meta") or {}).items() if store.meta.get(k) != v}
    return {"store": store.meta, "writer": writer_meta, "tap": tap_meta}


# ---------------------------------------------------------------------------------- rows, samples
def sample_pairs(pairs: RowPairs, k: int, seed: int) -> np.ndarray:
    """``k`` pairs (indices into ``pairs``), all of them when there are no more. Pairs that carry
    content keys are drawn by them, the k smallest of the keys mixed with ``seed``, in that order:
    the same rows in the same order whichever stores hold them and however the row indexes number
    them (so is every number measured on the sample). Others: drawn at random, ascending."""
    n = len(pairs)
    keys = getattr(pairs, "content_keys", None)
    if keys is not None and keys.size == n and n > 0:
        salt = mix64(np.full(1, seed, dtype=np.uint64))[0]
        if n <= k:
            pick = np.arange(n)
        else:
            # The k smallest of keys ^ salt (uniform 64-bit numbers): first those under a bound that
            # holds about 1.5 k of them (one pass), then the k smallest of those.
            bound = np.uint64(min(int(1.5 * k / n * 2.0**64) + (1 << 40), 2**64 - 1))
            pick = np.flatnonzero((keys ^ salt) < bound)
            if pick.size < k:
                pick = np.arange(n)
            pick = pick[np.argpartition(keys[pick] ^ salt, k - 1)[:k]]
        return pick[np.argsort(keys[pick] ^ salt, kind="stable")]
    if n <= k:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=k, replace=False))


#: Stored bytes of the rows read at a time before they are widened into the float32 sample.
_STAGE_BYTES = 1 << 19


def read_rows(index: RowIndex, rows: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """The stored rows ``rows`` of ``index`` as a read-only float32 array [len(rows), width]: a
    fresh array, or the first rows of ``into`` (a float32 buffer of at least that shape, reused by a
    caller that reads sample after sample: no fresh pages to fault in each time; the answer is a new
    view of it, read-only, and the caller lets the previous one go before reading again).

    Rows of uncompressed chunk files (read straight from the files) go through a small staging
    buffer, a few at a time, widened into the float32 array as they come: no whole sample of stored
    values is held (or page-faulted in) beside it. Other stores are gathered whole (each chunk is
    decoded once whatever the order of rows), then widened."""
    width = index.streams[0].width
    dtype = index.streams[0].dtype
    reader = ChunkReader(index.streams, max_chunks=16, compiled=plan_reads_compiled())
    try:
        if dtype == "float32" or not all(s.reads_rows_directly for s in index.streams):
            buf = aligned_empty((rows.size, width), VALUE_DTYPES[dtype])
            reader.gather(index, rows, buf)
            if into is None:
                return frozen(to_float32(buf, dtype))
            out = into[: rows.size]
            out[...] = to_float32(buf, dtype)
            return frozen(out)
        out = aligned_empty((rows.size, width), np.float32) if into is None else into[: rows.size]
        step = max(1, _STAGE_BYTES // (width * VALUE_DTYPES[dtype].itemsize))
        stage = aligned_empty((min(step, rows.size), width), VALUE_DTYPES[dtype])
        for a in range(0, rows.size, step):
            b = min(rows.size, a + step)
            widen_into(reader.gather(index, rows[a:b], stage), dtype, out[a:b])
        return frozen(out)
    finally:
        reader.close()


def require_finite_rows(
    sides: list[tuple[TraceStore, str, np.ndarray]], size: int, what: str = "compare"
) -> None:
    """Refuse (one :class:`CompareError` naming the file) when there is nothing finite to decide
    from: a side whose every segment holds NaN or Inf on every sampled aligned row, or no pair of
    segments finite on a common row. Anything less is compared: rows or whole segments that are
    non-finite become ``nonfinite`` findings while the rest is compared."""
    masks = []
    for store, tap, rows in sides:
        k_ok = size > 0 and rows.shape[1] % size == 0
        fin = segment_finite(rows, size) if k_ok else np.isfinite(rows).all(axis=1, keepdims=True)
        masks.append(fin)
        if rows.shape[0] and not bool(fin.any()):
            raise CompareError(
                f"{store.path}: tap {tap} values hold NaN or Inf in every segment of every one of the "
                f"{rows.shape[0]} sampled aligned rows: nothing finite to {what}; find where the non-finite values "
                f"come from"
            )
    if len(masks) == 2 and masks[0].size and masks[1].size:
        common = (masks[1].astype(np.float64).T @ masks[0].astype(np.float64)) > 0  # [Kc, Kr]: a row where both are finite
        if not bool(common.any()):
            (a, ta, _), (b, tb, _) = sides[0], sides[1]
            raise CompareError(
                f"{a.path} (tap {ta}) and {b.path} (tap {tb}): no sampled aligned row has a finite segment on both "
                f"sides: nothing finite to {what}; find where the non-finite values come from"
            )


# ----------------------------------------------------------------------------------- label offset
def offset_search(
    alignment: Alignment, size: int, opts: CompareOptions, base: RowPairs | None = None,
    compute_dtype: str | None = None,
) -> tuple[int, dict[str, float], RowPairs]:
    """Try label offsets -2..2: the one under which paired rows are most alike wins.

    Score: per candidate segment, the best standardised cosine with any reference segment, averaged
    (standardised so that massive activations, alike in every row, cannot make every offset look
    equally good). An offset other than 0 is taken only if its distance is under half that of 0.
    """
    results: dict[int, tuple[float, RowPairs]] = {}
    base = pair_rows(alignment, 0) if base is None else base
    # The other offsets are scored on a sample of rows: pairing only enough whole sequences to hold
    # it (not every row, 4 times over) keeps the search's cost independent of the trace's size. The
    # winner's pairs, when not 0's, are then made for every row.
    groups = _scoring_groups(alignment, 4 * opts.offset_sample_rows, opts.seed)
    # One robust scale estimate a side, from the first offset's sample, for every offset: the rows of
    # one side are the same population whatever the label offset pairs them with (issue #27: the
    # estimates were 1.5 of the 2.6 s of this search at 3 x 4096).
    scales: list[tuple[SegmentScales, SegmentScales]] = []

    # Each offset's sample is read into a pair of buffers taken from here and given back (at most
    # one pair per thread ever made): no fresh pages to fault in for every offset.
    buffers: queue.SimpleQueue = queue.SimpleQueue()

    def score(off: int) -> tuple[float, RowPairs] | None:
        pairs = base if off == 0 else pair_rows(alignment, off, candidate_groups=groups)
        if len(pairs) == 0:
            return None
        pick = sample_pairs(pairs, opts.offset_sample_rows, opts.seed)
        try:
            into = buffers.get_nowait()
        except queue.Empty:
            into = (aligned_empty((opts.offset_sample_rows, alignment.candidate.streams[0].width), np.float32),
                    aligned_empty((opts.offset_sample_rows, alignment.reference.streams[0].width), np.float32))
        try:
            c = read_rows(alignment.candidate, pairs.candidate[pick], into[0])
            r = read_rows(alignment.reference, pairs.reference[pick], into[1])
            if not scales:
                scales.append((segment_scales(c, size, compute_dtype), segment_scales(r, size, compute_dtype)))
            m = standardised_cosine_matrix(c, r, *scales[0])
            del c, r  # (the views die before the buffers are read into again)
        finally:
            buffers.put(into)
        best_each = [float(np.nanmax(row)) for row in m if np.isfinite(row).any()]  # an all-NaN segment casts none
        return (float(np.mean(best_each)) if best_each else float("nan")), pairs

    # Offset 0 first (its sample makes the scales; with no rows, the first offset that has some does),
    # then the others on both cores.
    order = sorted(OFFSETS, key=lambda o: (o != 0, o))
    first = 0
    while first < len(order) and not scales:
        got = score(order[first])
        if got is not None:
            results[order[first]] = got
        first += 1
    rest = order[first:]
    for off, got in zip(rest, in_parallel(*(lambda o=o: score(o) for o in rest)), strict=True):
        if got is not None:
            results[off] = got
    scores = {str(k): v[0] for k, v in sorted(results.items())}
    if 0 not in results:
        if not results:
            return 0, scores, base
        best = max(results, key=lambda k: results[k][0] if math.isfinite(results[k][0]) else -1)
        return best, scores, _every_row(alignment, best, results[best][1], groups)
    d0 = 1 - results[0][0]
    best = 0
    for off, (score, _p) in results.items():
        d = 1 - score
        if math.isfinite(d) and d < 0.5 * d0 and d < 1 - results[best][0]:
            best = off
    return best, scores, _every_row(alignment, best, results[best][1], groups)


def _scoring_groups(alignment: Alignment, rows: int, seed: int) -> list[int] | None:
    """Candidate sequences, drawn at random, holding at least ``rows`` rows; None when that is all."""
    sizes = [(s.candidate_group, int(alignment.cand_groups[s.candidate_group].size))
             for s in alignment.sequences if s.hypotheses]
    if sum(n for _, n in sizes) <= rows:
        return None
    picked, held = [], 0
    for i in np.random.default_rng(seed).permutation(len(sizes)).tolist():
        picked.append(sizes[i][0])
        held += sizes[i][1]
        if held >= rows:
            break
    return picked


def _every_row(alignment: Alignment, offset: int, pairs: RowPairs, groups: list[int] | None) -> RowPairs:
    """The pairs of ``offset`` for every candidate row (those scored may be of a few sequences)."""
    return pairs if offset == 0 or groups is None else pair_rows(alignment, offset)


# ------------------------------------------------------------------------------------ segment size
@dataclass(frozen=True)
class SegmentSizes:
    """The segment size each side is cut into, and how it was decided."""

    reference: int
    candidate: int
    source: str  # option | meta | inferred | mixed
    notes: tuple[str, ...] = ()

    @property
    def comparable(self) -> bool:
        return self.reference == self.candidate


def decide_segment_sizes(ref: Layout, cand: Layout, opts: CompareOptions,
                         sample: Callable[[], tuple[np.ndarray, np.ndarray]]) -> SegmentSizes:
    """Each side's recorded ``segment_size`` first; infer only for a side that recorded none.

    Two recorded sizes that differ are two hidden sizes (two target models, or a truncated
    transfer): returned as they are, for a ``shape`` error; never re-cut into a common divisor.
    """
    rw, cw = ref.width, cand.width
    if opts.segment_size is not None:
        size = opts.segment_size
        if size <= 0 or rw % size or cw % size:
            raise CompareError(f"--segment-size {size} does not divide the row widths (reference {rw}, candidate {cw})")
        return SegmentSizes(size, size, "option")
    rs, cs = ref.segment_size, cand.segment_size
    for side, s, w in (("reference", rs, rw), ("candidate", cs, cw)):
        if s is not None and (s <= 0 or w % s):
            raise CompareError(f"{side} segment size {s} does not divide its row width {w}")
    if rs and cs:
        return SegmentSizes(rs, cs, "meta")
    if rs or cs:
        known, width, side = (rs, cw, "candidate") if rs else (cs, rw, "reference")
        assert known is not None
        if width % known == 0:
            return SegmentSizes(known, known, "mixed", (
                f"the {side} recorded no segment size: took the other side's {known} "
                f"({width} = {width // known} x {known}); pass --segment-size to override",))
        r_rows, c_rows = sample()
        own, how = infer_segment_size(width, width, *((r_rows, r_rows) if side == "reference" else (c_rows, c_rows)))
        sizes = (own, known) if side == "reference" else (known, own)
        return SegmentSizes(*sizes, "mixed", (
            f"the {side} recorded no segment size and its width {width} is not a multiple of the other side's "
            f"{known}: its size {own} was {how}",))
    r_rows, c_rows = sample()
    size, how = infer_segment_size(rw, cw, r_rows, c_rows)
    if rw % size or cw % size:
        raise CompareError(f"segment size {size} does not divide the row widths (reference {rw}, candidate {cw})")
    return SegmentSizes(size, size, "inferred", (f"segment size {size} {how}; pass --segment-size to override",))


# --------------------------------------------------------------------------------- segment decisions
@dataclass
class Relation:
    """How one matched candidate segment relates to its reference segment."""

    candidate: int
    reference: int
    #: same | transformed | drift (same tensor, beyond numerics) | other | undecided (within the
    #: budget, but as far as a neighbouring layer may be: the data cannot tell)
    relation: str
    error: float  # squared standardised relative error of the identity
    transform: TransformFit | None  # the fitted transform for "transformed" (and the identity for "same")
    fits: list[TransformFit]

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.error) if math.isfinite(self.error) and self.error >= 0 else float("nan")


@dataclass
class SegmentPlan:
    """The segment decisions of a compare, from the plan sample (read by the pass and the findings)."""

    size: int
    sample_rows: int
    raw: np.ndarray  # [Kc, Kr] mean raw cosine (shown to users)
    standardised: np.ndarray  # [Kc, Kr] mean standardised cosine (decides)
    baseline: np.ndarray  # the standardised matrix on mismatched rows
    floor: NoiseFloor
    budgets: list[float]  # per reference segment: squared standardised relative error numerics explain
    depths: list[int]  # per reference segment: the depth its budget assumed
    compute_dtype: str
    decisions: list[SegmentDecision]
    relations: dict[int, Relation]  # candidate segment -> its relation, for matched segments
    ref_scales: SegmentScales
    cand_scales: SegmentScales
    #: per reference segment: squared standardised relative error beyond which a pair is other data
    limits: list[float]
    noise: list[SegmentNoise]  # per reference segment: the noise model, with where each number came from
    compute: ComputeDtype
    calibration: Calibration | None
    # Segments with no finite value on any sampled row: reported as non-finite, never as wiring.
    dead_candidate: frozenset[int] = frozenset()
    dead_reference: frozenset[int] = frozenset()


def numerics_budget(floor_error: float, compute_dtype: str, depth: int) -> float:
    """The squared standardised relative error numerics alone explain for one segment with no
    calibration and no other segment to learn from (``tracediff identify``): twice the storage
    rounding measured on the sample (``floor_error``), or the assumed drift of ``compute_dtype`` at
    ``depth`` (:func:`tracediff.compare.plan.noise.prior_drift`), twice over."""
    return max(2.0 * math.sqrt(max(floor_error, 0.0)), 2.0 * prior_drift(compute_dtype, depth), 1e-6) ** 2


def plan_segments(cand: np.ndarray, ref: np.ndarray, size: int, dtype_ref: str, dtype_cand: str,
                  depths: list[int | None] | None = None, seed: int = 0, *, compute: ComputeDtype | None = None,
                  assumed_depth: int | None = None, calibration: CalibrationRows | None = None) -> SegmentPlan:
    """Decide, on paired sample rows ([n, Wc], [n, Wr] float32), what every candidate segment is.

    ``depths``: per reference segment, how many decoder layers deep it is (its physical layer), where
    a side records it; the prior assumes ``assumed_depth`` (the model's depth, else
    :data:`tracediff.compare.plan.noise.DEFAULT_DEPTH`) for the others. ``compute``: the compute dtype of the
    compare (:func:`tracediff.compare.plan.noise.decide_compute_dtype`; None: assumed bfloat16). ``calibration``:
    the measured drift of calibration rows, per reference segment.
    """
    compute = compute or decide_compute_dtype({}, {})
    # A side stored quantised (an FP8 reference): its rounding is storage noise, simulated on the sample.
    quantised = next(iter(compute.storage.values()), None)
    c, r = cand, ref  # non-finite segments of a row are left out pair by pair, never whole rows
    # Independent numpy work, on both cores: each answer is the same whichever thread computes it.
    cs, rs = in_parallel(lambda: segment_scales(c, size, compute.dtype), lambda: segment_scales(r, size, compute.dtype))
    # (The longest first: the noise floor draws its random numbers and takes relative errors besides
    # its matrix; the raw cosines skip the scales. Both cores then finish together.)
    floor, std, baseline, raw = in_parallel(
        lambda: noise_floor(r, size, dtype_ref, dtype_cand, rs, seed=seed, quantised=quantised),
        lambda: standardised_cosine_matrix(c, r, cs, rs),
        lambda: mismatched_rows_matrix(c, r, cs, rs),
        lambda: segment_cosine_matrix(cand, ref, size),
    )
    kr = ref.shape[1] // size
    known = list(depths or [None] * kr)
    fallback = assumed_depth or DEFAULT_DEPTH
    depth = [d if d is not None else fallback for d in known]
    floors = [floor.errors[j] if j < len(floor.errors) else floor.error for j in range(kr)]
    measured = _measure_calibration(calibration, size, rs) if calibration is not None else None
    noise = segment_noise(floors, depth, compute.dtype, measured)
    for n, d in zip(noise, known, strict=True):
        n.depth = d
        n.storage_dtype = ", ".join(f"{fmt} on the {side}" for side, fmt in compute.storage.items()) or None
    budgets = [n.budget**2 for n in noise]
    decisions = match_segments(std, baseline, floor.distance)
    c3, r3 = split(c, size), split(r, size)
    fit_pairs = [(d.candidate, d.reference) for d in decisions if d.reference is not None and d.duplicate_of is None]
    # Each pair's fits on their own (numpy work on both cores; the same answers in any thread).
    fitted: dict[int, list[TransformFit]] = dict(zip((i for i, _ in fit_pairs), in_parallel(*(
        lambda i=i, j=j: fit_transforms(c3[:, i], r3[:, j], cs.mean[i], cs.scale[i], rs.mean[j], rs.scale[j],
                                        identity_budget=budgets[j]) for i, j in fit_pairs)), strict=True))
    # The limits, from the data: the reference's own layers (how far apart they are per layer of
    # spacing) and the drift the other matched segments show.
    errors = {d.reference: math.sqrt(fitted[d.candidate][0].error) for d in decisions if d.candidate in fitted
              and d.reference is not None and math.isfinite(fitted[d.candidate][0].error)
              and fitted[d.candidate][0].error >= 0}
    neighbours = neighbour_distances(
        lambda k, j: math.sqrt(max(relative_error(r3[:, k], r3[:, j], rs.mean[j], rs.scale[j]), 0.0)), known)
    noise = with_limits(noise, neighbours, errors)
    limits = [n.limit**2 for n in noise]
    relations: dict[int, Relation] = {}
    for d in decisions:
        if d.candidate not in fitted:
            continue
        i, j = d.candidate, d.reference
        assert j is not None
        fits = fitted[i]
        best = best_transform(fits, budgets[j])
        if best is None:
            # Beyond the budget: drift of the same tensor (quantised weights, other kernels) while
            # within the limit, other data beyond.
            kind = "drift" if fits[0].error <= limits[j] else "other"
        elif best.kind == "identity":
            nb = noise[j].neighbour
            kind = ("undecided" if nb is not None and fits[0].error > (SEPARATION_FRACTION * nb) ** 2 else "same")
        else:
            kind = "transformed"
        relations[i] = Relation(i, j, kind, fits[0].error, best, fits)
    for d in decisions:
        rel = relations.get(d.candidate)
        if rel is not None and rel.relation == "other" and d.tier == "related" and d.reference != d.candidate:
            # In another slot and only alike, through no transform: another tensor, not this one moved
            # (the missing reference segment and this extra one are reported, the look-alike as context).
            d.runner_up, d.reference, d.tier = d.reference, None, "none"
            del relations[d.candidate]
    dead_c = frozenset(int(i) for i in np.flatnonzero(~segment_finite(c, size).any(axis=0)))
    dead_r = frozenset(int(j) for j in np.flatnonzero(~segment_finite(r, size).any(axis=0)))
    return SegmentPlan(size, int(c.shape[0]), raw, std, baseline, floor, budgets, depth, compute.dtype, decisions,
                       relations, rs, cs, limits, noise, compute, measured, dead_c, dead_r)


def _measure_calibration(cal: CalibrationRows, size: int, scales: SegmentScales) -> Calibration:
    """The drift of the calibration rows from the reference rows of the same tokens, per reference
    segment, in the plan's reference scales (the error the candidate is held to, measured the same way)."""
    kr = cal.reference.shape[1] // size
    drift: list[float | None] = []
    if cal.values.shape[1] != cal.reference.shape[1] or cal.values.shape[0] < 2:
        drift = [None] * kr
    else:
        cv, rv = split(cal.values, size), split(cal.reference, size)
        for j in range(kr):
            e = relative_error(cv[:, j], rv[:, j], scales.mean[j], scales.scale[j])
            drift.append(math.sqrt(e) if math.isfinite(e) and e >= 0 else None)
    return Calibration(drift, int(cal.values.shape[0]), cal.compute_dtype, cal.store, cal.tap, cal.sequences)


# ----------------------------------------------------------- what the streaming pass measures
def pair_limits(segplan: SegmentPlan, matches: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """Per (candidate, reference) pair: the numerics budget the findings hold its standardised
    relative error to (``tracediff.compare.findings.segments``: beyond it a ``precision`` warning), and the
    drift limit (the noise model's limit, :mod:`tracediff.compare.plan.noise`: beyond it other data, and a row
    beyond it is "off" for :mod:`tracediff.compare.findings.subsets`)."""
    out = []
    for _, j in matches:
        ok = 0 <= j < len(segplan.budgets)
        out.append((math.sqrt(segplan.budgets[j]) if ok else float("nan"),
                    math.sqrt(segplan.limits[j]) if ok else float("nan")))
    return out


@dataclass(frozen=True)
class ProfileRequest:
    """A segment pair the pass measures per position only (:func:`tracediff.compare.plan.decide.profile_requests`)."""

    kind: str  # segment_missing | segment_extra | segment_duplicate
    candidate: int
    reference: int
    cand_mean: np.ndarray  # the candidate segment's robust (mean, scale), as the plan's matrix used
    cand_scale: np.ndarray
    ref_mean: np.ndarray
    ref_scale: np.ndarray
    numerics_budget: float
    drift_limit: float
    same_tensor_cosine: float


def profile_requests(segplan: SegmentPlan) -> list[ProfileRequest]:
    """The pairs to profile per position: every segment the wiring findings call wrong against its
    closest counterpart (:func:`tracediff.compare.plan.segments.closest_counterparts`), each side standardised by
    its own robust scales as the plan's matrix was."""
    same = 1.0 - exact_distance(segplan.floor.distance)
    out = []
    for c in closest_counterparts(segplan.decisions, segplan.standardised, segplan.dead_candidate,
                                  segplan.dead_reference):
        (budget, drift), = pair_limits(segplan, [(c.candidate, c.reference)])
        out.append(ProfileRequest(c.kind, c.candidate, c.reference, segplan.cand_scales.mean[c.candidate],
                                  segplan.cand_scales.scale[c.candidate], segplan.ref_scales.mean[c.reference],
                                  segplan.ref_scales.scale[c.reference], budget, drift, same))
    return out


__all__ = ["FC_INPUT_EQUIVALENTS", "OFFSETS", "CompareOptions", "Layout", "Relation", "SegmentPlan", "SegmentSizes",
           "collect_meta", "decide_segment_sizes", "numerics_budget", "offset_search", "pick_taps", "plan_segments",
           "pair_limits", "profile_requests", "read_rows", "require_finite_rows", "sample_pairs", "stream_layout",
           "tap_summary"]
