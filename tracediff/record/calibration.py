"""Calibration rows: the reference's own target recomputed in the server's compute dtype.

The "double benchmark" of accuracy tooling (Ascend's msprobe judges a candidate's error as a ratio
to a trusted low-precision run's error against the same golden): a few sequences of a trainer's
store are run again through the target model, cast to the server's compute dtype (bf16 by default)
with the same weights, and their fc-input rows (the same layers, concatenated the same way) are
appended to the store as tap :data:`tracediff.compare.plan.noise.CALIBRATION_TAP`. ``compare`` then measures
exactly how far a correct low-precision run drifts from the trainer's rows at every segment, and
holds the server to that instead of an assumed budget (``plan.noise[j].source == "calibrated"``).

The tap: same width, segment size and labels as the source tap; rows stored as float32 (storage
rounding does not add to the measured drift); labels seq / position / token_id / next_token_id
copied from the source rows; attrs ``calibrates`` (the source tap), ``compute_dtype``,
``calibration_model``. Runs the model on CPU or wherever it lives; the caller's model is untouched
(a deep copy is cast). Weights from disk load from safetensors only, never a pickle.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff.adapters.conventions import FINAL_NORM
from tracediff.compare.plan.noise import CALIBRATION_TAP, canonical_dtype
from tracediff.errors import StoreExistsError, UsageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _layers_of(store: Any, tap: str, layers: list[Any] | None) -> list[Any]:
    if layers is not None:
        out: list[Any] = []
        for value in layers:
            if value in ("pre_norm", FINAL_NORM):
                out.append(FINAL_NORM)
                continue
            try:
                out.append(int(value))
            except (TypeError, ValueError):
                raise UsageError(f"--layers {value!r}: neither an HF hidden_states index nor 'pre_norm'") from None
        return out
    from tracediff.compare.plan.decide import collect_meta  # noqa: PLC0415
    from tracediff.compare.plan.metadata import side_aux_layers  # noqa: PLC0415

    aux = side_aux_layers(collect_meta(store, tap))
    if aux is None or aux.physical is None:
        raise UsageError(f"{store.path}: tap {tap} records no aux layers (meta aux_layers): pass the layers its "
                         f"segments hold (--layers 3,19,pre_norm, HF hidden_states numbering)")
    return list(aux.physical)


def _sequences(store: Any, tap: str, count: int) -> list[dict[str, np.ndarray | str]]:
    """Up to ``count`` sequences of ``tap`` whose valid rows run from position 0 without a gap,
    longest first (ties by key); each once, whatever the writer groups that hold it."""
    found: dict[str, dict[str, Any]] = {}
    for stream in store.tap_streams(tap):
        if not stream.rows:
            continue
        lab = stream.labels(("seq", "position", "token_id", "next_token_id", "valid"))
        names = stream.seq_names
        for seq in np.unique(lab["seq"]).tolist():
            rows = np.flatnonzero((lab["seq"] == seq) & lab["valid"].astype(bool))
            if rows.size < 2:
                continue
            order = rows[np.argsort(lab["position"][rows], kind="stable")]
            pos = lab["position"][order]
            tokens = lab["token_id"][order]
            if pos[0] != 0 or not np.array_equal(pos, np.arange(pos.size)) or (tokens < 0).any():
                continue
            key = names.get(int(seq), str(seq))
            if key in found and found[key]["position"].size >= pos.size:
                continue
            found[key] = {"key": key, "position": pos, "token_id": tokens,
                          "next_token_id": lab["next_token_id"][order]}
    chosen = sorted(found.values(), key=lambda s: (-s["position"].size, s["key"]))[:count]
    if not chosen:
        raise UsageError(f"{store.path}: no sequence of tap {tap} has valid rows from position 0 on without a gap: "
                         f"nothing to recompute")
    return chosen


def _hidden_states(model: Any, input_ids: torch.Tensor) -> dict[Any, torch.Tensor]:
    """HF hidden_states by index, and the last decoder layer's output before the final norm."""
    base = getattr(model, "model", model)
    blocks = getattr(base, "layers", None)
    if blocks is None or len(blocks) == 0:
        raise UsageError(f"{type(model).__name__}: no decoder layers found (model.model.layers): is it a "
                         f"transformers causal LM?")
    captured: list[torch.Tensor] = []
    handle = blocks[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        out = base(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    states: dict[Any, torch.Tensor] = dict(enumerate(out.hidden_states))
    states[FINAL_NORM] = captured[-1]
    return states


def calibrate(store: str | Path, model: Any, *, dtype: str = "bfloat16", sequences: int = 8, tap: str = "fc_in",
              layers: list[Any] | None = None) -> dict[str, Any]:
    """Append calibration rows to ``store``: ``sequences`` of its tap ``tap`` recomputed by
    ``model`` (a transformers causal LM with the trainer's target weights, or a local folder to load
    it from with :func:`load_model`, loaded once the store is checked) cast to ``dtype``, the
    segments built from ``layers`` (HF hidden_states indices or "pre_norm"; default: the layers the
    store records). Returns what was written."""
    from tracediff.compare.plan.decide import stream_layout  # noqa: PLC0415
    from tracediff.record.recorder import Recorder  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    compute = canonical_dtype(str(dtype))
    if compute is None:
        raise UsageError(f"--server-dtype {dtype!r}: choose bfloat16, float16 or float32")
    if not isinstance(sequences, int) or sequences < 1:
        raise UsageError(f"--sequences {sequences!r}: must be a positive integer")
    with open_store(store) as st:
        if tap not in st.taps or not st.rows(tap):
            raise UsageError(f"{st.path}: no tap {tap} with rows (it has {', '.join(st.taps) or 'no taps'})")
        if CALIBRATION_TAP in st.taps and st.rows(CALIBRATION_TAP):
            raise StoreExistsError(f"{st.path}: already holds calibration rows (tap {CALIBRATION_TAP}); calibrate a "
                                   f"copy of the store without them")
        layout = stream_layout(st, tap)
        wanted = _layers_of(st, tap, layers)
        seqs = _sequences(st, tap, sequences)
    if isinstance(model, (str, Path)):
        model = load_model(model)
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    bad = [p for p in wanted if p != FINAL_NORM and (p < 0 or (depth is not None and p > depth))]
    if bad:
        raise UsageError(f"--layers {bad}: outside the model's hidden states 0..{depth} (num_hidden_layers {depth})")
    if layout.width % len(wanted):
        raise UsageError(f"{store}: tap {tap} is {layout.width} wide, not a multiple of {len(wanted)} layers {wanted}")
    size = layout.segment_size or layout.width // len(wanted)
    if size * len(wanted) != layout.width:
        raise UsageError(f"{store}: tap {tap} holds {layout.width // size} segments of {size}, not the {len(wanted)} "
                         f"layers {wanted}; pass --layers")
    runner = copy.deepcopy(model).to(DTYPES[compute]).eval()
    device = next(runner.parameters()).device
    rec = Recorder(store, append=True, role="calibration", writer_name="calibration",
                   meta={"compute_dtype": compute}, handle_sigterm=False, on_full="block")
    rows = 0
    try:
        rec.declare(CALIBRATION_TAP, segment_size=size, segment_labels=layout.segment_labels, calibrates=tap,
                    compute_dtype=compute, calibration_model=type(model).__name__)
        for seq in seqs:
            ids = torch.as_tensor(seq["token_id"], dtype=torch.long, device=device)[None]
            with torch.no_grad():
                states = _hidden_states(runner, ids)
                values = torch.cat([states[p][0] for p in wanted], dim=-1).float().cpu()
            if values.shape[-1] != layout.width:
                raise UsageError(f"the model's hidden size {values.shape[-1] // len(wanted)} is not the store's segment "
                                 f"size {size}: another target model")
            n = int(values.shape[0])
            rec.labels(seq=[seq["key"]] * n, position=seq["position"], token_id=seq["token_id"],
                       next_token_id=seq["next_token_id"])
            rec.capture(CALIBRATION_TAP, values, fresh=True)
            rows += n
    finally:
        rec.close()
    if rec.error is not None:
        raise UsageError(f"{store}: calibration rows could not be written: {rec.error}")
    return {"store": str(store), "tap": CALIBRATION_TAP, "calibrates": tap, "rows": rows, "sequences": len(seqs),
            "layers": ["pre_norm" if p == FINAL_NORM else p for p in wanted], "compute_dtype": compute}


def load_model(folder: str | Path) -> Any:
    """A transformers causal LM from a local folder, weights from safetensors only (no pickle)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: no config.json: --model takes a local folder saved by save_pretrained")
    if not any(path.glob("*.safetensors")):
        raise UsageError(f"{path}: no *.safetensors weights (pickled weights are never loaded)")
    try:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415
        from transformers.utils import logging as hf_logging  # noqa: PLC0415
    except ImportError as exc:
        raise UsageError("tracediff calibrate --model needs transformers: pip install transformers") from exc
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True, local_files_only=True)


__all__ = ["calibrate", "load_model"]
