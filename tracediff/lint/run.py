"""`tracediff lint`: one streaming pass over a data set, then the findings (:func:`lint`).

Reads the target (``--target``: its config's depth and its final norm's weight, one tensor read from
its safetensors) and a bank (``--bank``: a store of every hidden state of the target, recorded with
``--adapter hf``) before the pass; neither is needed for the row checks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.errors import UsageError
from tracediff.lint.checks import (
    defect_findings,
    depth_findings,
    duplicate_sample_findings,
    fp8_findings,
    order_findings,
    post_norm_findings,
    slot_reports,
    unit_tolerance,
)
from tracediff.lint.results import LintFinding, LintResult
from tracediff.lint.sources import Block, Source, open_source, slot_kind
from tracediff.lint.stats import SlotStats

_FP8_EXAMPLES = 5


@dataclass
class Target:
    num_layers: int | None
    hidden_size: int | None
    norm_weight: np.ndarray | None
    note: str


def read_target(folder: Path) -> Target:
    """The target's depth and hidden size (config.json) and its final norm weight (one tensor)."""
    from tracediff.drafts import read_json_config  # noqa: PLC0415

    cfg = read_json_config(folder, "target")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise UsageError(f"{folder / 'config.json'}: num_hidden_layers / hidden_size missing or not integers")
    from tracediff.adapters.hf import final_norm_weight  # noqa: PLC0415  (transformers' checkpoint names)

    weight, note = final_norm_weight(folder)
    return Target(layers, hidden, weight, note)


def read_bank(path: Path, segment_size: int) -> list[tuple[str, str, np.ndarray]]:
    """(label, kind, per-dimension RMS) of every segment of a bank store's tap ``bank``."""
    src = open_source(path, tap="bank")
    if src.segment_size != segment_size:
        raise UsageError(f"--bank {path}: segments of {src.segment_size} values, the data's are {segment_size}: "
                         f"a bank of another model")
    stats = SlotStats(src.slots, src.segment_size)
    for block in src.blocks():
        stats.add(block.values, block.seq, block.position, block.token, block.group)
    rms = stats.dim_rms()
    return [(label, kind if kind != "unknown" else slot_kind(label), rms[i])
            for i, (label, kind) in enumerate(zip(src.labels, src.kinds, strict=True))]


def _fp8_add(acc: dict[str, Any], block: Block, name: str) -> None:
    """Scale and code checks of one FP8 file, on the stored bytes: an e4m3fn code's low 7 bits are
    0x7F for NaN and 0x7E for the largest magnitude, 448."""
    import torch  # noqa: PLC0415

    scales = block.scales
    assert scales is not None
    if block.codes.dtype != torch.float8_e4m3fn:
        raise UsageError(f"{name}: hidden_states is {block.codes.dtype}; lint checks float8_e4m3fn scales only")
    low = block.codes.view(torch.uint8).numpy().reshape(len(scales), -1) & np.uint8(0x7F)
    at_top = (low == 0x7E).sum(axis=1)
    tests = {"zero_scales": scales == 0, "negative_scales": scales < 0, "nonfinite_scales": ~np.isfinite(scales),
             "nan_codes": (low == 0x7F).any(axis=1), "saturated_tokens": at_top >= max(2, 0.01 * low.shape[1])}
    acc["tokens"] += len(scales)
    for key, mask in tests.items():
        hit = np.flatnonzero(mask)
        acc[key] += len(hit)
        room = _FP8_EXAMPLES - len(acc["examples"][key])
        acc["examples"][key] += [f"{name} position {int(p)}" for p in hit[: max(room, 0)]]


def lint(path: str | Path, *, target: str | Path | None = None, bank: str | Path | None = None,
         tap: str | None = None, layer_ids: list[int] | None = None, progress: Any = None) -> LintResult:
    """Lint a trace store or a trainer's offline folder (see :mod:`tracediff.lint`)."""
    started = time.monotonic()
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    source = open_source(path, tap=tap, layer_ids=layer_ids)
    tgt = read_target(Path(target)) if target is not None else None
    if tgt is not None and tgt.hidden_size != source.segment_size:
        raise UsageError(f"--target {target}: hidden_size {tgt.hidden_size}, but {path} holds slots of "
                         f"{source.segment_size} values: another model")
    bank_profiles = read_bank(Path(bank), source.segment_size) if bank is not None else None
    stats = SlotStats(source.slots, source.segment_size, None if tgt is None else tgt.norm_weight)
    fp8: dict[str, Any] | None = None
    if progress is not None:  # rows, and for offline folders files (of how many)
        if source.unit == "rows":
            progress.stage("lint", source.units)
        else:
            progress.stage("lint", None, source.units)
    for block in source.blocks():
        stats.add(block.values, block.seq, block.position, block.token, block.group, block.names)
        if block.codes is not None and block.scales is not None:
            if fp8 is None:
                fp8 = defaultdict(int, examples=defaultdict(list))
            _fp8_add(fp8, block, next(iter(block.names.values()), block.group))
        if progress is not None:
            progress.advance(len(block.values), items=0 if source.unit == "rows" else 1)
    return _result(source, stats, tgt, bank_profiles, fp8, time.monotonic() - started)


def _result(source: Source, stats: SlotStats, tgt: Target | None, bank: list | None, fp8: dict | None,
            seconds: float) -> LintResult:
    dtype = source.rounding  # the storage's rounding: an FP8 import's values carry e4m3's, not bf16's
    tolerance = {s: unit_tolerance(dtype, r) for s, r in enumerate(stats.dim_rms())}
    slots = slot_reports(source, stats, lambda r: unit_tolerance(dtype, r))
    findings: list[LintFinding] = defect_findings(slots, stats) + duplicate_sample_findings(slots, stats)
    used: dict[str, str] = {"rows": "every row: all-zero, constant, non-finite, repeated; samples: duplicated"}
    if tgt is None:
        used["post_norm"] = "not run: give --target TARGET_DIR (the final norm's weight decides it)"
        findings.append(LintFinding(kind="cannot_tell", severity="info", message=(
            "Whether a slot holds the final norm's output instead of a raw hidden state: cannot tell without "
            "--target TARGET_DIR (its final norm weight).")))
    else:
        findings += order_findings(slots, tgt.num_layers or 0)
        if tgt.norm_weight is None:
            used["post_norm"] = f"not run: {tgt.note}"
        else:
            used["post_norm"] = f"rms(x / w) = 1 with w from {tgt.note}"
            findings += post_norm_findings(slots, tolerance)
    if bank is None:
        used["depth"] = "not run: give --bank BANK.zarr (every hidden state of the target, record --adapter hf)"
        findings.append(LintFinding(kind="cannot_tell", severity="info", message=(
            "Whether a slot holds another layer than its label says: cannot tell without --bank BANK.zarr "
            "(a store of every hidden state of the target).")))
    else:
        used["depth"] = f"per-dimension RMS profile ranked against {len(bank)} bank segments"
        findings += depth_findings(slots, stats.dim_rms(), bank, None if tgt is None else tgt.num_layers)
    fp8_out = None
    if fp8 is not None:
        fp8_out = {k: (dict(v) if k == "examples" else v) for k, v in fp8.items()}
        findings += fp8_findings(fp8_out)
    order = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: (order[f.severity], -1 if f.slot is None else f.slot))
    return LintResult(source=source.path, format=source.format, storage=source.storage,
                      samples=len(stats.sample_rows), rows=int(stats.rows[0]) if len(stats.rows) else 0,
                      width=source.width, segment_size=source.segment_size, slots=slots, findings=findings,
                      fp8=fp8_out, checks=used, seconds=seconds)


__all__ = ["Target", "lint", "read_bank", "read_target"]
