"""Identify: name the source layer of each segment of a trace against a bank of every layer.

The bank is a trace recorded with ``--adapter hf`` (tap ``bank``: the embedding, every decoder
layer's output, the final layer before and after the final norm, for the same token sequences).
Rows are aligned by token content like compare does; each segment is then ranked against every bank
column by standardised cosine (where it comes from) and the identity / transform fits (how), and the winner must beat the runner-up
by the same rank-and-margin rule compare uses, or the answer is "no layer matches".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.adapters.conventions import FINAL_NORM, layer_text
from tracediff.compare.align.sequences import align_sequences
from tracediff.compare.plan.decide import (
    CompareOptions,
    collect_meta,
    numerics_budget,
    offset_search,
    read_rows,
    require_finite_rows,
    sample_pairs,
    tap_summary,
)
from tracediff.compare.plan.metadata import num_layers, side_aux_layers
from tracediff.compare.plan.noise import DEFAULT_DEPTH, decide_compute_dtype
from tracediff.compare.plan.segments import (
    lower_median,
    noise_floor,
    relative_error,
    segment_cosine_matrix,
    segment_scales,
    split,
    standardised_cosine_matrix,
    tier_of,
)
from tracediff.compare.plan.transforms import best_transform, fit_transforms
from tracediff.compare.rows.index import RowIndex
from tracediff.errors import CompareError
from tracediff.store import TraceStore, open_store

IDENTIFY_SCHEMA_VERSION = 1


@dataclass
class LayerName:
    """A bank column in every numbering a user meets."""

    bank_segment: int
    label: str
    text: str
    kind: str  # embedding | layer | pre_norm | post_norm | unknown
    hf_index: int | None  # HF output_hidden_states index (= vLLM / SGLang capture index)
    sglang_id: int | None  # SGLang Llama/Qwen-style config id (-1 = embedding, j = output of layer j)
    vllm_id: int | None  # vLLM eagle_aux_hidden_state_layer_ids entry (its capture index)


@dataclass
class SegmentIdentity:
    segment: int
    label: str
    verdict: str  # match | scaled | closest | none
    best: LayerName | None
    cosine: float | None  # raw cosine with the best bank column
    centred_cosine: float | None  # the standardised cosine (each dimension in robust units)
    rel_l2: float | None
    norm_ratio: float | None
    runner_up: LayerName | None
    runner_up_cosine: float | None
    margin: float | None  # runner-up distance / best distance (higher = clearer)
    message: str = ""


@dataclass
class Identification:
    store: str
    tap: str
    bank: str
    bank_tap: str
    segment_size: int
    pairs: int
    label_offset: int
    segments: list[SegmentIdentity]
    suggestions: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Version of this document's layout (tracediff/schemas/identify.schema.json).
    schema_version: int = IDENTIFY_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bank_names(bank_attrs: dict[str, Any], count: int) -> list[LayerName]:
    info = bank_attrs.get("segment_info")
    labels = bank_attrs.get("segment_labels") or [f"bank{j}" for j in range(count)]
    names = []
    for j in range(count):
        entry = info[j] if isinstance(info, list) and j < len(info) and isinstance(info[j], dict) else {}
        kind = str(entry.get("kind", "unknown"))
        hf = entry.get("hf_index") if isinstance(entry.get("hf_index"), int) else None
        layer = entry.get("layer") if isinstance(entry.get("layer"), int) else None
        sglang = -1 if kind == "embedding" else (layer if kind in ("layer", "pre_norm") else None)
        vllm = hf if kind in ("embedding", "layer", "pre_norm") else None
        names.append(LayerName(j, str(labels[j]) if j < len(labels) else f"bank{j}",
                               str(entry.get("text", labels[j] if j < len(labels) else f"bank column {j}")),
                               kind, hf, sglang, vllm))
    return names


def _names_from_aux_layers(bank: TraceStore, tap: str, names: list[LayerName]) -> tuple[list[LayerName], str | None]:
    """Bank columns named from the bank's recorded aux layers (a trainer's or a server's store used as
    a bank): column j is physical layer ``aux.physical[j]``. Returns the names and where they came from."""
    meta = collect_meta(bank, tap)
    aux = side_aux_layers(meta)
    if aux is None or aux.physical is None or len(aux.physical) != len(names):
        return names, None
    layers = num_layers(meta)
    out = []
    for name, p in zip(names, aux.physical, strict=True):
        if p == FINAL_NORM:
            hf, kind, layer = layers, "post_norm", (layers - 1 if layers else None)
            text = f"{name.label} = the final norm's output (HF hidden_states[-1])"
        else:
            hf, layer = int(p), int(p) - 1
            kind = "embedding" if hf == 0 else ("pre_norm" if layers is not None and hf == layers else "layer")
            text = f"{name.label} = hidden_states[{hf}] = {layer_text(p).removeprefix('the ')}"
        sglang = -1 if kind == "embedding" else (layer if kind in ("layer", "pre_norm") else None)
        vllm = hf if kind in ("embedding", "layer", "pre_norm") else None
        out.append(LayerName(name.bank_segment, name.label, text, kind, hf, sglang, vllm))
    return out, f"recorded aux layers ({aux.field}, {aux.convention} numbering)"


def _pick_bank_tap(bank: TraceStore, tap: str | None) -> str:
    if tap:
        bank.tap_streams(tap)
        return tap
    banks = [t for t in bank.taps if t.startswith("bank")]
    if not banks:
        # Another trace as the bank (a trainer's store): its fc input, named by its aux layers.
        with_rows = [t for t in bank.taps if bank.rows(t)]
        banks = ["fc_in"] if "fc_in" in with_rows else with_rows
    if len(banks) != 1:
        raise CompareError(
            f"{bank.path}: expected one bank tap (recorded with --adapter hf), found {banks or 'none'}; "
            f"choose with --bank-tap"
        )
    return banks[0]


def identify_segments(
    store_path: str | Path,
    bank_path: str | Path,
    *,
    tap: str | None = None,
    bank_tap: str | None = None,
    segment_size: int | None = None,
    sample_rows: int = 2048,
    seed: int = 0,
) -> Identification:
    store, bank = open_store(store_path), open_store(bank_path)
    try:
        store.require_complete()
        bank.require_complete()
        return _identify(store, bank, tap, bank_tap, segment_size, sample_rows, seed)
    finally:
        store.close()
        bank.close()


def _identify(store: TraceStore, bank: TraceStore, tap: str | None, bank_tap: str | None,
              segment_size: int | None, sample_rows: int, seed: int) -> Identification:
    btap = _pick_bank_tap(bank, bank_tap)
    if tap is None:
        candidates = [t for t in store.taps if not t.startswith("bank") and store.rows(t)]
        tap = "fc_in" if "fc_in" in candidates else (candidates[0] if len(candidates) == 1 else None)
        if tap is None and not candidates:
            raise CompareError(f"{store.path}: no tap with rows to identify ({tap_summary(store)})")
        if tap is None:
            raise CompareError(f"{store.path}: choose the tap to identify with --tap ({tap_summary(store)})")
    streams = store.tap_streams(tap)
    bstreams = bank.tap_streams(btap)
    first, bfirst = streams[0], bstreams[0]
    bsize = bfirst.segment_size
    if bsize is None:
        raise CompareError(f"{bank.path}/{btap}: the bank has no segment_size attribute (not recorded with --adapter hf?)")
    size = segment_size or first.segment_size or bsize
    if size != bsize:
        raise CompareError(
            f"{store.path}/{tap}: segment size {size} differs from the bank's hidden size {bsize} "
            f"({bank.path}): the bank is from another model"
        )
    if first.width % size:
        raise CompareError(f"{store.path}/{tap}: width {first.width} is not a multiple of the bank's hidden size {size}")
    ref_index = RowIndex.load(bank, btap)
    cand_index = RowIndex.load(store, tap)
    alignment = align_sequences(ref_index, cand_index)
    opts = CompareOptions(sample_rows=sample_rows, seed=seed)
    offset, _scores, pairs = offset_search(alignment, size, opts)
    if len(pairs) == 0:
        raise CompareError(
            f"{bank.path}: the bank holds none of the token sequences of {store.path}; record the bank on the same "
            f"inputs (tracediff record --adapter hf ... on the same token ids)"
        )
    pick = sample_pairs(pairs, sample_rows, seed + 1)
    c = read_rows(cand_index, pairs.candidate[pick])
    b = read_rows(ref_index, pairs.reference[pick])
    require_finite_rows([(bank, btap, b), (store, tap, c)], size, what="identify")
    raw = segment_cosine_matrix(c, b, size)
    compute = decide_compute_dtype(collect_meta(bank, btap), collect_meta(store, tap)).dtype
    c_scales, b_scales = segment_scales(c, size, compute), segment_scales(b, size, compute)
    std = standardised_cosine_matrix(c, b, c_scales, b_scales)
    floor = noise_floor(b, size, bfirst.dtype, first.dtype, b_scales, seed=seed)
    names = _bank_names(bfirst.attrs, bfirst.width // size)
    named_from = None
    if not isinstance(bfirst.attrs.get("segment_info"), list):
        # Not an --adapter hf bank (e.g. a trainer's store): its recorded aux layers say what each
        # column is, if it recorded them.
        names, named_from = _names_from_aux_layers(bank, btap, names)
    layers = max((n.hf_index for n in names if n.hf_index is not None), default=DEFAULT_DEPTH)
    budgets = [numerics_budget(floor.errors[j] if j < len(floor.errors) else floor.error, compute,
                               n.hf_index if n.hf_index is not None else layers) for j, n in enumerate(names)]
    cs, bs = split(c, size), split(b, size)
    labels = first.segment_labels or [f"seg{i}" for i in range(first.width // size)]
    segments = []
    for i in range(first.width // size):
        dist = 1.0 - std[i]
        order = [int(j) for j in np.argsort(np.where(np.isfinite(dist), dist, np.inf))]
        # Standardised cosines say where a segment comes from, not how it was transformed: the final
        # layer before and after the final norm can tie. Among the close columns, the one the
        # segment equals (identity within the numerics budget) wins.
        close = [j for j in order[:4] if tier_of(float(dist[j]), float("inf"), floor.distance) == "exact"
                 or dist[j] <= 2 * dist[order[0]] + 1e-12]
        errors = {j: relative_error(cs[:, i], bs[:, j], b_scales.mean[j], b_scales.scale[j]) for j in close}
        equal = sorted((e, j) for j, e in errors.items() if math.isfinite(e) and e <= budgets[j])
        j1 = equal[0][1] if equal else order[0]
        rest = [j for j in order if j != j1]
        j2 = rest[0] if rest else None
        d1 = float(dist[j1])
        d2 = float(dist[j2]) if j2 is not None else float("inf")
        tier = "exact" if equal else tier_of(d1, d2, floor.distance)
        fit = None if equal else best_transform(fit_transforms(
            cs[:, i], bs[:, j1], c_scales.mean[i], c_scales.scale[i], b_scales.mean[j1], b_scales.scale[j1]),
            budgets[j1])
        ci, bj = cs[:, i], bs[:, j1]
        rel_l2 = float(np.linalg.norm(ci - bj) / max(float(np.linalg.norm(bj)), 1e-30)) if ci.size else float("nan")
        ratio = (float(lower_median(np.linalg.norm(ci, axis=1) / np.maximum(np.linalg.norm(bj, axis=1), np.float32(1e-30))))
                 if ci.size else float("nan"))
        best, runner = names[j1], (names[j2] if j2 is not None else None)
        label = labels[i] if i < len(labels) else f"seg{i}"
        if equal:
            verdict = "match"
            message = (f"segment {i} ({label}) is {best.text} (standardised error {math.sqrt(equal[0][0]):.2g} within "
                       f"{compute} numerics; cosine {raw[i, j1]:.6f})")
        elif fit is not None and tier != "none":
            verdict = "scaled"
            message = f"segment {i} ({label}) is {best.text} {fit.describe()} (cosine {raw[i, j1]:.6f})"
        elif tier != "none":
            verdict = "closest"
            message = (f"segment {i} ({label}): no layer matches within numerics; closest is {best.text} "
                       f"(standardised cosine {std[i, j1]:.4f}, raw {raw[i, j1]:.4f}; runner-up "
                       f"{runner.text if runner else '-'} {std[i, j2] if j2 is not None else float('nan'):.4f})")
        else:
            verdict = "none"
            message = (f"segment {i} ({label}): no layer matches (best {best.text} at standardised cosine "
                       f"{std[i, j1]:.4f}, not clearly above {runner.text if runner else '-'})")
        segments.append(SegmentIdentity(
            segment=i, label=label, verdict=verdict,
            best=best if verdict != "none" else None,
            cosine=float(raw[i, j1]), centred_cosine=float(std[i, j1]), rel_l2=rel_l2, norm_ratio=ratio,
            runner_up=runner, runner_up_cosine=float(raw[i, j2]) if j2 is not None else None,
            margin=(d2 / d1) if d1 > 0 else float("inf"), message=message,
        ))
    ident = Identification(store=str(store.path), tap=tap, bank=str(bank.path), bank_tap=btap, segment_size=size,
                           pairs=len(pairs), label_offset=offset, segments=segments)
    ident.suggestions, ident.notes = _suggest(segments)
    if named_from:
        ident.notes.insert(0, f"the bank is not an --adapter hf bank: its columns are named from its {named_from}")
    elif named_from is None and not isinstance(bfirst.attrs.get("segment_info"), list):
        ident.notes.insert(0, "the bank records neither segment_info (--adapter hf) nor its aux layers: segments are "
                              "named by the bank's column labels only, and no config ids can be suggested")
    if offset:
        ident.notes.append(f"rows matched the bank best at label offset {offset}: the store's token labels are shifted")
    return ident


def _suggest(segments: list[SegmentIdentity]) -> tuple[dict[str, Any], list[str]]:
    """The aux-layer ids a user would type to reproduce these segments, per framework convention."""
    notes: list[str] = []
    found = [s.best for s in segments if s.verdict in ("match", "scaled") and s.best is not None]
    if len(found) != len(segments):
        return {}, ["not every segment was identified: no config reproduces this trace from the bank's layers"]
    out: dict[str, Any] = {}
    if all(n.hf_index is not None for n in found):
        out["hf_hidden_states_indices"] = [n.hf_index for n in found]
    if all(n.sglang_id is not None for n in found):
        ids = [n.sglang_id for n in found]
        out["sglang_eagle_config.eagle_aux_hidden_state_layer_ids"] = ids
        if ids != sorted(ids):
            notes.append("SGLang concatenates aux hidden states in ascending layer order whatever the config says: "
                         "this order cannot be reproduced on SGLang")
        if any(n.kind == "pre_norm" for n in found):
            notes.append("SGLang captures a layer's output as the input of the next layer: the final layer's "
                         "output (pre-norm) is not capturable there except for gpt-oss")
    if all(n.vllm_id is not None for n in found):
        out["vllm_eagle_aux_hidden_state_layer_ids"] = [n.vllm_id for n in found]
    if any(n.kind == "post_norm" for n in found):
        notes.append("a segment is the final norm's output (HF hidden_states[-1]); servers feed pre-norm states")
    return out, notes


def render_identification(ident: Identification) -> str:
    lines = [f"identify {ident.store} ({ident.tap}) against bank {ident.bank} ({ident.bank_tap}): "
             f"{ident.pairs} aligned rows, segment size {ident.segment_size}"]
    for s in ident.segments:
        lines.append(f"  {s.message}")
        if s.best is not None and s.verdict in ("match", "scaled"):
            ids = []
            if s.best.sglang_id is not None:
                ids.append(f"SGLang id {s.best.sglang_id}")
            if s.best.vllm_id is not None:
                ids.append(f"vLLM/HF capture index {s.best.vllm_id}")
            if ids:
                lines.append(f"      {', '.join(ids)}; runner-up {s.runner_up.text if s.runner_up else '-'} "
                             f"(cosine {s.runner_up_cosine:.4f})")
    if ident.suggestions:
        lines.append("to reproduce this trace:")
        for key, value in ident.suggestions.items():
            lines.append(f"  {key} = {value}")
    for note in ident.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


__all__ = ["Identification", "LayerName", "SegmentIdentity", "identify_segments",
           "render_identification"]
