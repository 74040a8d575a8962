"""What lint reads: a trace store's tap, or a trainer's offline files, as blocks of ``[rows, slots, H]``.

A trace store is read chunk by chunk (its labels say the sample, position and token of each row;
rows marked invalid, padding, are skipped); offline files one file at a time through the importers'
readers (:func:`tracediff.importers.read_offline_file`: what the trainer's own reader hands it, FP8
files dequantised as hs_connectors' ``FP8Transfer`` does, with their stored codes and scales kept for
the scale checks). Memory stays at one chunk or one file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.errors import UsageError

_HS = re.compile(r"^hs(\d+)$")


@dataclass
class Block:
    """Rows of one chunk or one file."""

    values: np.ndarray  # [n, slots, H] float32
    seq: np.ndarray
    position: np.ndarray
    token: np.ndarray
    group: str
    names: dict[int, str] = field(default_factory=dict)
    codes: Any = None  # torch float8 [n, slots, H] of an FP8 file
    scales: np.ndarray | None = None  # [n] float32


@dataclass
class Source:
    """A data set lint can read: its layout, and its rows as :class:`Block` s (:meth:`blocks`)."""

    path: str
    format: str
    storage: str
    width: int
    segment_size: int
    labels: list[str]
    kinds: list[str]
    units: int  # rows (store) or files (offline) in all, for the progress line
    unit: str
    _open: Any = field(repr=False, default=None)
    rounding: str = ""  # the dtype whose rounding the values carry (an FP8 import: float8_e4m3fn)

    @property
    def slots(self) -> int:
        return self.width // self.segment_size

    def blocks(self) -> Iterator[Block]:
        return self._open()


def slot_kind(label: str) -> str:
    """What a segment label says the slot holds."""
    if label.endswith("pre_norm"):
        return "pre_norm"
    if label in ("final_norm_out", "post_norm") or label.endswith("post_norm"):
        return "post_norm"
    if label == "hs0":
        return "embedding"
    if _HS.match(label):
        return "layer"
    return "aux" if label.startswith("aux") else "unknown"


def hf_index(label: str) -> int | None:
    """``hs7`` -> 7 (HF ``hidden_states`` numbering); None for any other label."""
    m = _HS.match(label)
    return int(m[1]) if m else None


def open_source(path: Path, *, tap: str | None = None, layer_ids: list[int] | None = None) -> Source:
    """A trace store (a folder holding ``zarr.json``, or a ``.zarr.zip``) or an offline folder."""
    if path.suffix == ".zip" or (path / "zarr.json").is_file():
        return _store_source(path, tap)
    if tap is not None:
        raise UsageError(f"--tap {tap}: {path} is a trainer's offline folder, not a trace store; leave --tap out")
    return _offline_source(path, layer_ids)


# ---------------------------------------------------------------------------------------- stores
def _store_source(path: Path, tap: str | None) -> Source:
    from tracediff.store import TraceStore  # noqa: PLC0415

    store = TraceStore(path)
    taps = store.taps
    if tap is None:
        tap = "fc_in" if "fc_in" in taps else (taps[0] if len(taps) == 1 else None)
        if tap is None:
            raise UsageError(f"{path}: holds taps {', '.join(taps) or 'none'}; pick one with --tap")
    if tap not in taps:
        raise UsageError(f"--tap {tap}: {path} holds {', '.join(taps) or 'no taps'}")
    streams = store.tap_streams(tap)
    first = streams[0]
    width = first.width
    size = first.segment_size or _meta_hidden(store, first) or width
    if width % size:
        raise UsageError(f"{path}/{tap}/{first.writer}: segment_size {size} does not divide width {width}")
    for s in streams[1:]:
        if s.width != width:
            raise UsageError(f"{path}/{tap}/{s.writer}: width {s.width}, but {first.writer} has {width}")
    labels = first.segment_labels or [f"slot{i}" for i in range(width // size)]
    info = first.attrs.get("segment_info")
    kinds = [str(i.get("kind") or slot_kind(lab)) if isinstance(i, dict) else slot_kind(lab)
             for i, lab in zip(info if isinstance(info, list) else [None] * len(labels), labels, strict=True)]
    quant = (store.meta or {}).get("storage_quantisation") if isinstance(store.meta, dict) else None
    storage = first.dtype + (f" (imported from {quant['dtype']}, {quant['scales']})" if isinstance(quant, dict) else "")

    def blocks() -> Iterator[Block]:
        for stream in streams:
            names = stream.seq_names
            seq, pos, tok, valid = (stream.label(n) for n in ("seq", "position", "token_id", "valid"))
            for start, raw in stream.iter_chunks():
                from tracediff.store import decode_values  # noqa: PLC0415

                stop = start + len(raw)
                keep = valid[start:stop]
                values = decode_values(raw, stream.dtype).reshape(len(raw), width // size, size)[keep]
                ids = seq[start:stop][keep]
                yield Block(np.ascontiguousarray(values, dtype=np.float32), ids.astype(np.int64),
                            pos[start:stop][keep].astype(np.int64), tok[start:stop][keep].astype(np.int64),
                            f"{tap}/{stream.writer}",
                            {int(i): f"seq {names.get(int(i), int(i))}" for i in np.unique(ids).tolist()})

    return Source(str(path), "trace store", storage, width, size, labels, kinds,
                  sum(s.rows for s in streams), "rows", blocks,
                  rounding=quant["dtype"] if isinstance(quant, dict) else first.dtype)


def _meta_hidden(store: Any, stream: Any) -> int | None:
    for meta in (stream.attrs.get("meta"), store.meta):
        if isinstance(meta, dict) and isinstance(meta.get("hidden_size"), int) and meta["hidden_size"] > 0:
            return int(meta["hidden_size"])
    return None


# --------------------------------------------------------------------------------------- offline
def _offline_source(path: Path, layer_ids: list[int] | None) -> Source:
    from tracediff.importers import offline_files, read_offline_file  # noqa: PLC0415

    framework, files = offline_files(path)
    first = read_offline_file(framework, files[0][1], files[0][0])
    _n, slots, size = first.states.shape
    labels = _offline_labels(framework, first.kinds, layer_ids)

    def load(index: int, file: Path) -> Block:
        f = first if index == first.index and file.name == first.name else read_offline_file(framework, file, index)
        if tuple(f.states.shape[1:]) != (slots, size):
            raise UsageError(f"{file}: hidden states of {tuple(f.states.shape[1:])} (slots, width) after "
                             f"{first.name}'s {(slots, size)}: files of two models or settings; lint them apart")
        t = len(f.tokens)
        return Block(f.states.float().numpy(), np.full(t, index, dtype=np.int64), np.arange(t, dtype=np.int64),
                     f.tokens.numpy().astype(np.int64), framework, {index: f.name}, f.codes,
                     None if f.scales is None else f.scales.numpy())

    def blocks() -> Iterator[Block]:
        # The next file is read (and dequantised) on another thread while this one's rows are checked:
        # both halves spend their time in code that releases the GIL. Memory: two files.
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        with ThreadPoolExecutor(1, thread_name_prefix="tracediff-lint-read") as reader:
            pending = reader.submit(load, *files[0])
            for k in range(len(files)):
                block = pending.result()
                if k + 1 < len(files):
                    pending = reader.submit(load, *files[k + 1])
                yield block

    rounding = str((first.states if first.codes is None else first.codes).dtype).removeprefix("torch.")
    return Source(str(path), framework, first.storage, slots * size, size, labels, first.kinds, len(files),
                  "files", blocks, rounding=rounding)


def _offline_labels(framework: str, kinds: list[str], layer_ids: list[int] | None) -> list[str]:
    aux = kinds.count("aux")
    if layer_ids and len(layer_ids) not in (aux, aux + 1):
        raise UsageError(f"--layer-ids gives {len(layer_ids)} ids but the files hold {aux} aux hidden states")
    # speculators' ids are vLLM's (= HF hidden_states indices); SpecForge's are SGLang config ids (HF j+1).
    hf = [i if framework == "speculators" else i + 1 for i in (layer_ids or [])[:aux]]
    names = [f"hs{i}" for i in hf] or [f"aux{i}" for i in range(aux)]
    last = {"pre_norm": "last_layer_pre_norm", "post_norm": "final_norm_out"}
    return names + [last.get(k, k) for k in kinds[aux:]]


__all__ = ["Block", "Source", "hf_index", "open_source", "slot_kind"]
