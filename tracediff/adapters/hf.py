"""transformers adapter: record a *bank* of every hidden state of a decoder-only model.

One tap, ``bank``, whose rows are ``cat(hs0, hs1, ..., hs{L-1}, pre_norm, hs{L})`` for each token:
HF ``hidden_states`` numbering (0 = embedding output, i = output of decoder layer i-1), the final
layer's output both before the final norm (``pre_norm``, what SGLang and vLLM capture) and after it
(``hs{L}``, what HF's ``hidden_states[-1]`` holds). ``identify`` and ``compare --bank`` match an fc
input's segments against these columns.

Runs inside the model's forward: each state is copied once into one preallocated row buffer; the
buffer is handed to the recorder as a fresh tensor (no second copy).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

from tracediff.adapters.generic import attach_label_source
from tracediff.record.parts import pick_output
from tracediff.record.recorder import Recorder

WATCH: tuple[str, ...] = ("PreTrainedModel",)


def bank_segments(num_layers: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Segment labels and descriptions of a bank of a model with ``num_layers`` decoder layers."""
    labels = ["hs0"]
    info: list[dict[str, Any]] = [
        {"hf_index": 0, "kind": "embedding", "layer": None, "text": "hidden_states[0] = embedding output"}
    ]
    for i in range(1, num_layers):
        labels.append(f"hs{i}")
        info.append({"hf_index": i, "kind": "layer", "layer": i - 1,
                     "text": f"hidden_states[{i}] = output of layer {i - 1}"})
    labels.append(f"hs{num_layers}_pre_norm")
    info.append({"hf_index": num_layers, "kind": "pre_norm", "layer": num_layers - 1,
                 "text": f"output of layer {num_layers - 1} (final layer), before the final norm"})
    labels.append(f"hs{num_layers}")
    info.append({"hf_index": num_layers, "kind": "post_norm", "layer": num_layers - 1,
                 "text": f"hidden_states[{num_layers}] = final norm output (HF hidden_states[-1])"})
    return labels, info


def _base_model(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module that owns embed_tokens, layers and norm (LlamaModel inside LlamaForCausalLM)."""
    for candidate in (module, getattr(module, "model", None)):
        if (
            isinstance(candidate, torch.nn.Module)
            and isinstance(getattr(candidate, "embed_tokens", None), torch.nn.Module)
            and isinstance(getattr(candidate, "layers", None), torch.nn.ModuleList)
            and isinstance(getattr(candidate, "norm", None), torch.nn.Module)
            and len(candidate.layers) > 0
        ):
            return candidate
    return None


def attach(recorder: Recorder, module: torch.nn.Module, *, name: str | None = None) -> bool:
    """Attach a bank tap to the decoder model inside ``module``. Returns False if it has none."""
    base = _base_model(module)
    if base is None:
        return False
    # Keyed by recorder: a later recorder on the same model must attach its own hooks.
    banks = base.__dict__.setdefault("_tracediff_banks", weakref.WeakKeyDictionary())
    if recorder in banks:
        return True
    config = getattr(module, "config", None) or getattr(base, "config", None)
    num_layers = len(base.layers)
    if name is None:
        taken = {t for t in recorder.stats()}
        name = "bank" if "bank" not in taken else f"bank_{len([t for t in taken if t.startswith('bank')]) + 1}"
    banks[recorder] = name
    hidden = getattr(config, "hidden_size", None)
    labels, info = bank_segments(num_layers)
    recorder.declare(
        name,
        segment_size=int(hidden) if isinstance(hidden, int) else None,
        segment_labels=labels,
        segment_info=info,
        module=f"{type(module).__qualname__}",
        module_class=f"{type(module).__module__}.{type(module).__qualname__}",
        capture="hidden_states_bank",
        model=_model_summary(module, config),
    )
    attach_label_source(recorder, base, how="adapter hf")
    slots = num_layers + 2
    state: dict[str, Any] = {"buf": None, "filled": None}

    def put(slot: int, tensor: Any) -> None:
        if not recorder.enabled or not isinstance(tensor, torch.Tensor):
            return
        try:
            width = tensor.shape[-1]
            buf = state["buf"]
            if buf is None or buf.shape[:-1] != tensor.shape[:-1] or buf.shape[-1] != slots * width:
                buf = torch.empty(*tensor.shape[:-1], slots * width, dtype=tensor.dtype, device=tensor.device)
                state["buf"], state["filled"] = buf, [False] * slots
            buf[..., slot * width : (slot + 1) * width].copy_(tensor.detach())
            state["filled"][slot] = True
        except Exception as exc:  # noqa: BLE001
            recorder.fail(f"bank slot {slot}", exc)

    def start(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        state["buf"], state["filled"] = None, None

    def finish(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        buf, filled = state["buf"], state["filled"]
        state["buf"], state["filled"] = None, None
        if buf is None or not recorder.enabled:
            return
        if not all(filled):
            missing = [labels[i] for i, ok in enumerate(filled) if not ok]
            recorder.fail(f"bank {name!r}", RuntimeError(f"hooks did not fire for {missing}"))
            return
        recorder.capture(name, buf, fresh=True)

    def hook_output(slot: int):  # noqa: ANN202
        def hook(mod: torch.nn.Module, args: tuple, output: Any) -> None:
            try:
                put(slot, pick_output(output))
            except Exception as exc:  # noqa: BLE001
                recorder.fail(f"bank slot {slot}", exc)

        return hook

    def norm_hooks() -> None:
        def pre(mod: torch.nn.Module, args: tuple) -> None:
            # The norm's input is the final layer's output: the pre-norm slot. Taking it here rather
            # than from the last layer's output also covers models that add a residual outside it.
            if args and isinstance(args[0], torch.Tensor):
                put(num_layers, args[0])

        recorder.keep_handle(base.norm.register_forward_pre_hook(pre))
        recorder.keep_handle(base.norm.register_forward_hook(hook_output(num_layers + 1)))

    recorder.keep_handle(base.register_forward_pre_hook(start, with_kwargs=True))
    def first_layer_input(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # hidden_states[0] is what enters layer 0, not embed_tokens' output: some models scale it.
        tensor = args[0] if args else kwargs.get("hidden_states")
        put(0, tensor)

    recorder.keep_handle(base.layers[0].register_forward_pre_hook(first_layer_input, with_kwargs=True))
    for i, layer in enumerate(base.layers[:-1]):
        recorder.keep_handle(layer.register_forward_hook(hook_output(i + 1)))
    norm_hooks()
    recorder.keep_handle(base.register_forward_hook(finish, with_kwargs=True))
    return True


def _model_summary(module: torch.nn.Module, config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type(module).__qualname__}
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "name_or_path",
                "_name_or_path", "rms_norm_eps", "dtype"):
        value = getattr(config, key, None)
        if value is not None:
            out[key.lstrip("_")] = value if isinstance(value, (int, float, str, bool)) else str(value)
    try:
        import transformers  # noqa: PLC0415

        out["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    return out


#: Where transformers checkpoints keep the final norm's weight (decoder-only models, and VLM wrappers).
FINAL_NORM_KEYS = ("model.norm.weight", "norm.weight", "model.language_model.norm.weight",
                   "language_model.model.norm.weight", "transformer.norm.weight")


def final_norm_weight(folder: Path) -> tuple[Any, str]:
    """A checkpoint folder's final norm weight as float32 numpy (one tensor read from its safetensors,
    nothing else), and where it came from; ``(None, why)`` when no file holds one."""
    from safetensors import safe_open  # noqa: PLC0415

    from tracediff.errors import UsageError  # noqa: PLC0415

    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                key = next((k for k in FINAL_NORM_KEYS if k in f.keys()), None)  # noqa: SIM118
                if key is not None:
                    return f.get_tensor(key).float().numpy(), f"{file.name}: {key}"
        except Exception as exc:  # noqa: BLE001  (safetensors raises its own types)
            raise UsageError(f"{file}: not a readable safetensors file ({exc})") from exc
    return None, f"{folder}: no final norm weight ({', '.join(FINAL_NORM_KEYS[:2])}) in *.safetensors"
