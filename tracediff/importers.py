"""Import a trainer's offline hidden-state files as a reference trace (``tracediff import``).

Two formats, both read without running any code from the files:

- **speculators** (``speculators generate-offline-data``, vLLM's hidden-states connector):
  ``hs_<i>.safetensors`` with ``hidden_states [T, n_slots, H]`` (the aux layers in the order of the
  draft's ``eagle_aux_hidden_state_layer_ids``, then the verifier's last layer) and
  ``token_ids [T]``; the FP8 variant adds ``hidden_states_scales [T, 1, 1]`` and is dequantised to
  bf16 as speculators' ``FP8Transfer`` does. Read with ``safetensors`` (no pickle).
- **SpecForge** (``scripts/prepare_hidden_states.py``): ``data_<i>.ckpt`` (or ``.ckpt.gz``) under any
  sub-folder, a ``torch.save`` dict with ``input_ids [T]``, ``loss_mask [T]``,
  ``hidden_state [1, T, H]`` (the target's final state) and ``aux_hidden_state [1, T, 3H]``. Read
  with ``torch.load(weights_only=True)`` only: a file holding anything but plain tensors is refused.

Each becomes tap ``fc_in`` (exactly the rows and slots the trainer feeds ``fc``) and tap ``bank``
(every stored slot of every position, for ``identify``). Rows are labelled as the adapters label
the live trainers: true position ``p``, ``token_id = x_p``, ``next_token_id = x_{p+1}`` (-1 past
the end), one sequence per file (its index), phase ``train``. Memory stays bounded by one file.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff.errors import ImportFormatError, TracediffError, UsageError, first_line
from tracediff.lint.light import zero_row_warnings, zero_rows
from tracediff.store import (
    PHASES,
    TraceWriter,
    check_replaceable,
    create_store,
    default_source,
    phase_code,
    replace_store,
)

_TORCH_TO_STORE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                   torch.float64: "float64"}
_TRAIN = phase_code("train")


@dataclass
class ImportResult:
    """What an import wrote."""

    store: Path
    files: int
    rows: dict[str, int] = field(default_factory=dict)
    #: The light lint of the rows written (tracediff.lint.light): one sentence per slot with all-zero rows.
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        taps = ", ".join(f"{tap} {rows} rows" for tap, rows in self.rows.items())
        return f"imported {self.files} files into {self.store}: {taps}" + "".join(
            f"\ntracediff: warning: {w}" for w in self.warnings)


@dataclass
class _Sample:
    """One file, normalised: what fc saw, every slot, and the tokens."""

    name: str
    seq: int
    fc_in: torch.Tensor  # [rows, K*H]
    bank: torch.Tensor  # [T, n*H]
    tokens: torch.Tensor  # [T] int64
    fc_rows: int  # the first fc_rows positions are fed to fc
    quantised: str | None = None  # the FP8 format the file stored its values in (read back as bf16)


# --------------------------------------------------------------------------------------- speculators
_HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")


def speculators_files(src: Path) -> list[tuple[int, Path]]:
    """``hs_<i>.safetensors`` in ``src`` or in ``src/hidden_states`` (speculators' default), by index."""
    if not src.is_dir():
        raise UsageError(f"{src}: not a folder; give the folder that holds the hs_<i>.safetensors files")
    for folder in (src, src / "hidden_states"):
        found = sorted(
            (int(m[1]), p) for p in folder.iterdir() if (m := _HS_FILE.match(p.name)) and p.is_file()
        ) if folder.is_dir() else []
        if found:
            return found
    raise ImportFormatError(f"{src}: no hs_<i>.safetensors files here or in {src / 'hidden_states'} "
                            f"(speculators generate-offline-data writes them)")


@dataclass
class OfflineFile:
    """One offline file as its trainer reads it: every stored slot of every position.

    ``states`` [T, slots, H] are what the trainer's reader hands it (an FP8 file dequantised as
    hs_connectors' ``FP8Transfer`` does); ``codes`` [T, slots, H] and ``scales`` [T] are the stored
    FP8 values and per-token scales of an FP8 file (None otherwise). ``kinds`` says per slot what it
    is meant to hold: ``aux`` (an aux layer), ``pre_norm`` (the last layer before the final norm),
    ``post_norm`` (the final norm's output)."""

    name: str
    index: int
    states: torch.Tensor
    tokens: torch.Tensor
    kinds: list[str]
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def storage(self) -> str:
        if self.codes is None:
            return str(self.states.dtype).removeprefix("torch.")
        return f"{str(self.codes.dtype).removeprefix('torch.')} with one float32 scale per token"


def read_speculators_file(path: Path, index: int = 0) -> OfflineFile:
    """One ``hs_<i>.safetensors`` file (speculators datagen, vLLM's ExampleHiddenStatesConnector or
    hs_connectors' FP8HiddenStatesConnector) as speculators' trainer reads it: ``FileTransfer`` hands
    ``hidden_states`` over as stored; ``FP8Transfer`` replaces it, whenever ``hidden_states_scales`` is
    present, by ``hidden_states.to(bf16) * hidden_states_scales.to(bf16)``."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ImportFormatError(f"{path}: not a readable safetensors file: {first_line(exc)}") from exc
    missing = {"hidden_states", "token_ids"} - set(data)
    if missing:
        raise ImportFormatError(f"{path}: missing {sorted(missing)}; speculators files hold hidden_states "
                                f"[T, n_layers, H] and token_ids [T]")
    hs, tokens = data["hidden_states"], data["token_ids"]
    if hs.dim() != 3 or hs.shape[1] < 2:
        raise ImportFormatError(f"{path}: hidden_states has shape {tuple(hs.shape)}, expected [T, n_layers >= 2, H] "
                                f"(the aux layers, then the last layer)")
    if tokens.dim() != 1 or tokens.shape[0] != hs.shape[0] or tokens.is_floating_point():
        raise ImportFormatError(f"{path}: token_ids has shape {tuple(tokens.shape)} {tokens.dtype}, expected "
                                f"[{hs.shape[0]}] integers (one per row of hidden_states)")
    codes = scales = None
    if _SCALES in data:
        scale = data[_SCALES]
        if scale.numel() != hs.shape[0] or not scale.is_floating_point():
            raise ImportFormatError(f"{path}: {_SCALES} has shape {tuple(scale.shape)} {scale.dtype}, expected "
                                    f"[{hs.shape[0]}, 1, 1] floats (one scale per token)")
        codes, scales = hs, scale.reshape(-1).float()
        # hs_connectors.fp8_utils.dequantize_fp8_tensor with FP8Transfer's default dtype, bfloat16.
        hs = hs.to(torch.bfloat16) * scale.reshape(-1, 1, 1).to(torch.bfloat16)
    elif hs.dtype not in _TORCH_TO_STORE:
        raise ImportFormatError(f"{path}: hidden_states is {hs.dtype} without {_SCALES}")
    kinds = ["aux"] * (hs.shape[1] - 1) + ["pre_norm"]
    return OfflineFile(path.name, index, hs, tokens.long(), kinds, codes, scales)


_SCALES = "hidden_states_scales"


def _load_speculators_file(path: Path, index: int) -> _Sample:
    offline = read_speculators_file(path, index)
    hs = offline.states
    length, slots, width = hs.shape
    return _Sample(
        name=path.name,
        seq=index,
        # The trainer (ArrowDataset + shift_batch) feeds fc the aux slots of rows 0..T-2.
        fc_in=hs[: max(length - 1, 0), :-1].reshape(-1, (slots - 1) * width),
        bank=hs.reshape(length, slots * width),
        tokens=offline.tokens,
        fc_rows=max(length - 1, 0),
        quantised=None if offline.codes is None else str(offline.codes.dtype).removeprefix("torch."),
    )


def _quantisation_meta(first: _Sample) -> dict[str, Any]:
    """``storage_quantisation`` when the files stored FP8 values: compare's noise model then allows
    that storage's rounding on this side (tracediff.compare.plan.storage)."""
    if first.quantised is None:
        return {}
    return {"storage_quantisation": {
        "dtype": first.quantised, "scales": "one float32 scale per token (hidden_states_scales [T, 1, 1], absmax / max)",
        "read_as": "bfloat16: hidden_states.to(bf16) * scales.to(bf16), as hs_connectors' FP8Transfer hands them to "
                   "the trainer", "written_by": "hs_connectors FP8HiddenStatesConnector (quantize_tensor_to_fp8)"}}


def import_speculators(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    layer_ids: Sequence[int] | None = None,
    overwrite: bool = False,
    max_files: int | None = None,
) -> ImportResult:
    """speculators' offline ``hs_<i>.safetensors`` files -> a reference trace at ``dest``.

    ``layer_ids``: the draft's ``eagle_aux_hidden_state_layer_ids`` (vLLM ids = HF hidden_states
    indices), optionally followed by the last layer's id; they only name the segments.
    """
    src = Path(src)
    files = speculators_files(src)[: max_files if max_files else None]
    samples = (_load_speculators_file(path, index) for index, path in files)

    def meta(first: _Sample, slots: int, width: int) -> dict[str, Any]:
        aux = _layer_meta(layer_ids, slots - 1, width, convention="vllm: id i = output of layer i-1 = HF hidden_states[i]",
                          hf=list(layer_ids or []))
        return {
            "framework": "speculators",
            "framework_version": _version("speculators"),
            "imported_from": {"format": "speculators hs_<i>.safetensors (hidden_states [T, n_layers, H], token_ids [T])",
                              "folder": str(src.resolve()), "files": len(files)},
            "hidden_size": width,
            "aux_layer_ids": aux,
            **_quantisation_meta(first),
            "positions": {
                "position_offset": 1,
                "stored": "the true position p of the hidden state (its token is x_p)",
                "framework": "speculators' trainer feeds fc the aux slots of rows 0..T-2 with position_ids = p + 1 "
                             "and input_ids = x_{p+1} (shift_batch); the last row only reaches the bank",
            },
        }

    return _write(dest, samples, meta, overwrite=overwrite, last_label="last_layer_pre_norm", files=len(files))


# ---------------------------------------------------------------------------------------- SpecForge
_CKPT_INDEX = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")


def specforge_files(src: Path) -> list[tuple[int, Path]]:
    """``*.ckpt`` / ``*.ckpt.gz`` under ``src`` (any depth), sorted by path as SpecForge lists them;
    each with its ``data_<i>`` index when every file has a distinct one, else its rank in that order."""
    if not src.exists():
        raise UsageError(f"{src}: no such file or folder")
    if src.is_file():
        paths = [src]
    else:
        paths = sorted(Path(root) / name for root, _dirs, names in os.walk(src) for name in names
                       if name.endswith((".ckpt", ".ckpt.gz")))
    if not paths:
        raise ImportFormatError(f"{src}: no .ckpt or .ckpt.gz files (SpecForge's prepare_hidden_states.py writes "
                                f"rows_<a>-<b>/data_<i>.ckpt)")
    indices = [int(m[1]) if (m := _CKPT_INDEX.match(p.name)) else None for p in paths]
    if None in indices or len(set(indices)) != len(indices):
        return list(enumerate(paths))
    return sorted(zip(indices, paths, strict=True))  # type: ignore[arg-type]


def load_specforge_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)``: plain tensors and containers only, never arbitrary pickles."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  (unpickling errors come in many types; all mean "refused")
        raise ImportFormatError(
            f"{path}: refused by torch.load(weights_only=True) (only plain tensors are read): {first_line(exc)}"
        ) from exc
    if not isinstance(data, dict):
        raise ImportFormatError(f"{path}: holds a {type(data).__name__}, not the dict SpecForge saves")
    return data


def _load_specforge_file(path: Path, index: int) -> _Sample:
    data = load_specforge_file(path)
    missing = {"input_ids", "aux_hidden_state"} - set(data)
    if missing:
        raise ImportFormatError(f"{path}: missing {sorted(missing)}; SpecForge EAGLE-3 files hold input_ids, "
                                f"loss_mask, hidden_state and aux_hidden_state (prepare with --enable-aux-hidden-states)")
    ids, aux = data["input_ids"], data["aux_hidden_state"]
    if not isinstance(ids, torch.Tensor) or not isinstance(aux, torch.Tensor):
        raise ImportFormatError(f"{path}: input_ids and aux_hidden_state must be tensors")
    ids = ids.reshape(-1)
    aux = aux.squeeze(0) if aux.dim() == 3 else aux
    if aux.dim() != 2 or aux.shape[0] != ids.shape[0] or ids.is_floating_point():
        raise ImportFormatError(f"{path}: aux_hidden_state {tuple(data['aux_hidden_state'].shape)} does not match "
                                f"input_ids {tuple(data['input_ids'].shape)}; expected [1, T, K*H] and [T] integers")
    if aux.dtype not in _TORCH_TO_STORE:
        raise ImportFormatError(f"{path}: aux_hidden_state is {aux.dtype}, not a float type")
    bank = aux
    last = data.get("hidden_state")
    if isinstance(last, torch.Tensor):
        last = last.squeeze(0) if last.dim() == 3 else last
        if last.dim() != 2 or last.shape[0] != aux.shape[0] or last.dtype != aux.dtype:
            raise ImportFormatError(f"{path}: hidden_state {tuple(data['hidden_state'].shape)} {last.dtype} does not "
                                    f"match aux_hidden_state {tuple(aux.shape)} {aux.dtype}")
        bank = torch.cat([aux, last], dim=-1)
    return _Sample(name=path.name, seq=index, fc_in=aux, bank=bank, tokens=ids.long(), fc_rows=aux.shape[0])


def read_specforge_file(path: Path, index: int = 0, num_aux: int = 3) -> OfflineFile:
    """One SpecForge ``.ckpt`` file as an :class:`OfflineFile`: the ``num_aux`` aux slots of
    ``aux_hidden_state``, then ``hidden_state`` (the target's final norm output) when present."""
    sample = _load_specforge_file(path, index)
    width = sample.fc_in.shape[-1] // num_aux if num_aux > 0 else 0
    if width <= 0 or sample.fc_in.shape[-1] % num_aux:
        raise ImportFormatError(f"{path}: aux_hidden_state rows of {sample.fc_in.shape[-1]} values do not split "
                                f"into {num_aux} aux states")
    slots = sample.bank.shape[-1] // width
    kinds = ["aux"] * num_aux + ["post_norm"] * (slots - num_aux)
    return OfflineFile(path.name, index, sample.bank.reshape(len(sample.tokens), slots, width), sample.tokens, kinds)


def offline_files(src: Path) -> tuple[str, list[tuple[int, Path]]]:
    """Which trainer wrote the offline files in ``src`` (``speculators`` or ``specforge``), and its files."""
    if not src.exists():
        raise UsageError(f"{src}: no such file or folder")
    if src.is_file() and (m := _HS_FILE.match(src.name)):
        return "speculators", [(int(m[1]), src)]
    if src.is_dir() and any(f.is_dir() and any(_HS_FILE.match(p.name) for p in f.iterdir())
                            for f in (src, src / "hidden_states") if f.exists()):
        return "speculators", speculators_files(src)
    try:
        return "specforge", specforge_files(src)
    except ImportFormatError:
        raise ImportFormatError(f"{src}: neither speculators' hs_<i>.safetensors files (here or in hidden_states/) "
                                f"nor SpecForge's .ckpt files; give a trace store or a trainer's offline folder") from None


def read_offline_file(framework: str, path: Path, index: int) -> OfflineFile:
    """One file of :func:`offline_files`, as its trainer reads it."""
    return read_speculators_file(path, index) if framework == "speculators" else read_specforge_file(path, index)


def import_specforge(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    layer_ids: Sequence[int] | None = None,
    overwrite: bool = False,
    max_files: int | None = None,
    num_aux: int = 3,
) -> ImportResult:
    """SpecForge's offline ``.ckpt`` files -> a reference trace at ``dest``.

    ``layer_ids``: the draft config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang config
    ids; for Llama/Qwen targets id j is HF ``hidden_states[j+1]``); they only name the segments.
    """
    src = Path(src)
    files = specforge_files(src)[: max_files if max_files else None]
    samples = (_load_specforge_file(path, index) for index, path in files)

    def meta(first: _Sample, slots: int, width: int) -> dict[str, Any]:
        aux = _layer_meta(layer_ids, num_aux, width,
                          convention="sglang config id j = output of layer j = HF hidden_states[j+1] (Llama/Qwen targets)",
                          hf=[i + 1 for i in layer_ids or []])
        return {
            "framework": "specforge",
            "framework_version": _version("specforge"),
            "imported_from": {"format": "SpecForge data_<i>.ckpt (input_ids, loss_mask, hidden_state, aux_hidden_state)",
                              "folder": str(src.resolve()), "files": len(files)},
            "hidden_size": width,
            "aux_layer_ids": aux,
            "positions": {
                "position_offset": 0,
                "stored": "the true position p of the hidden state (its token is x_p)",
                "framework": "SpecForge feeds fc every row p with input_ids shifted left by one (x_{p+1} at row p)",
            },
        }

    return _write(dest, samples, meta, overwrite=overwrite, last_label="final_norm_out", files=len(files),
                  num_aux=num_aux)


# ------------------------------------------------------------------------------------------ writing
def _write(
    dest: str | os.PathLike[str],
    samples: Iterator[_Sample],
    meta_for: Callable[[_Sample, int, int], dict[str, Any]],
    *,
    overwrite: bool,
    last_label: str,
    files: int,
    num_aux: int | None = None,
) -> ImportResult:
    """Write the samples into a new store; on any error the half-written store is removed."""
    dest = Path(dest)
    if dest.exists():
        check_replaceable(dest, overwrite)
    first = next(samples, None)
    if first is None:
        raise ImportFormatError("no files to import")
    bank_width = first.bank.shape[-1]
    fc_width = first.fc_in.shape[-1]
    width = bank_width - fc_width if num_aux is None else fc_width // num_aux
    if width <= 0 or fc_width % width or bank_width % width:
        raise ImportFormatError(f"{first.name}: rows of {fc_width} values do not split into {num_aux} aux states")
    slots, aux_slots = bank_width // width, fc_width // width
    meta = meta_for(first, slots, width)
    aux_labels = meta["aux_layer_ids"].get("labels") or [f"aux{i}" for i in range(aux_slots)]
    bank_labels = list(aux_labels) + ([last_label] if slots > aux_slots else [])
    dtype = _TORCH_TO_STORE[first.fc_in.dtype]
    source = default_source("trainer", meta["framework"], meta["framework_version"])
    source["imported"] = True
    # The store is built beside its destination under a hidden name and moved there whole once every
    # file is in: an import that fails, or is killed, never leaves a half-written store at ``dest``
    # (a kill leaves the hidden folder, which nothing reads), and --overwrite keeps the old store
    # until the new one is complete.
    final, dest = dest, dest.with_name(f".{dest.name}.importing-{os.getpid()}")
    create_store(dest, role="trainer", meta=meta, source=source, overwrite=True)
    result = ImportResult(final, 0)
    writers: dict[str, TraceWriter] = {}
    zeros = [0] * slots
    try:
        for tap, tap_width, labels, what in (
            ("fc_in", fc_width, aux_labels, "the aux hidden states the trainer feeds fc"),
            ("bank", bank_width, bank_labels, "every hidden state stored in the file"),
        ):
            attrs = {"segment_size": width, "segment_labels": labels, "rank": None, "world_size": None,
                     "source": source, "meta": meta, "phases": list(PHASES), "module": "offline files",
                     "capture": what, "in_features": tap_width if tap == "fc_in" else None, "phase": "train"}
            writers[tap] = TraceWriter(dest, tap, "import", width=tap_width, dtype=dtype, attrs=attrs)
        sample: _Sample | None = first
        while sample is not None:
            if sample.bank.shape[-1] != bank_width or sample.fc_in.shape[-1] != fc_width or \
                    _TORCH_TO_STORE.get(sample.fc_in.dtype) != dtype or sample.quantised != first.quantised:
                raise ImportFormatError(
                    f"{sample.name}: rows of {sample.fc_in.shape[-1]} / {sample.bank.shape[-1]} {sample.fc_in.dtype} "
                    f"values (stored {sample.quantised or 'unquantised'}) after {first.name}'s {fc_width} / {bank_width} "
                    f"{first.fc_in.dtype} (stored {first.quantised or 'unquantised'}): the files come from "
                    f"two different models or settings; import them separately"
                )
            for tap, values, rows in (("fc_in", sample.fc_in, sample.fc_rows), ("bank", sample.bank, len(sample.tokens))):
                stored = _store_values(values)
                if tap == "bank":  # every slot of every position: the light lint of what was imported
                    zeros = [a + b for a, b in zip(zeros, zero_rows(stored, width), strict=True)]
                    writers[tap].note_attr("row_checks", {"rows": result.rows.get(tap, 0) + rows, "zero_rows": zeros})
                writers[tap].append(stored, _labels(sample, rows))
                result.rows[tap] = result.rows.get(tap, 0) + rows
            result.files += 1
            sample = next(samples, None)
        for writer in writers.values():
            writer.close()
        replace_store(dest, final)
        result.warnings = zero_row_warnings("bank", zeros, result.rows.get("bank", 0), bank_labels)
    except (TracediffError, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        if isinstance(exc, TracediffError):
            raise
        raise ImportFormatError(f"{final}: import failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return result


def _labels(sample: _Sample, rows: int) -> dict[str, np.ndarray]:
    tokens = sample.tokens.numpy()
    nxt = np.full(rows, -1, dtype=np.int64)
    nxt[: max(min(rows, len(tokens) - 1), 0)] = tokens[1 : rows + 1]
    return {
        "seq": np.full(rows, sample.seq, dtype=np.int64),
        "position": np.arange(rows, dtype=np.int64),
        "token_id": tokens[:rows].astype(np.int64),
        "next_token_id": nxt,
        "step": np.full(rows, -1, dtype=np.int64),
        "phase": np.full(rows, _TRAIN, dtype=np.int8),
        "valid": np.ones(rows, dtype=bool),
    }


def _store_values(values: torch.Tensor) -> np.ndarray:
    values = values.detach().contiguous()
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().view(np.uint16)
    return values.numpy()


def _layer_meta(ids: Sequence[int] | None, aux_slots: int, width: int, *, convention: str,
                hf: list[int]) -> dict[str, Any]:
    if not ids:
        return {"ids": None, "hf_hidden_states": None, "convention": convention,
                "read_from": "not given (--layer-ids); segments are named aux0, aux1, ..."}
    ids = [int(i) for i in ids]
    if len(ids) not in (aux_slots, aux_slots + 1):
        raise UsageError(f"--layer-ids gives {len(ids)} ids but the files hold {aux_slots} aux hidden states "
                         f"(of width {width}); give one id per aux state")
    out: dict[str, Any] = {"ids": ids[:aux_slots], "hf_hidden_states": hf[:aux_slots], "convention": convention,
           "read_from": "--layer-ids", "labels": [f"hs{i}" for i in hf[:aux_slots]]}
    if len(ids) > aux_slots:
        out["last_layer_id"] = ids[aux_slots]
    return out


def _version(distribution: str) -> str:
    import importlib.metadata  # noqa: PLC0415

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def parse_layer_ids(text: str | None) -> list[int] | None:
    """``"2,16,29"`` -> ``[2, 16, 29]``."""
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise UsageError(f"--layer-ids: cannot read {text!r}; give comma-separated integers, e.g. 2,16,29") from exc


__all__ = ["ImportResult", "OfflineFile", "import_specforge", "import_speculators", "load_specforge_file", "offline_files",
           "parse_layer_ids", "read_offline_file", "read_specforge_file", "read_speculators_file"]
