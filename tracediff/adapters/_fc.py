"""What the trainer adapters share: the fc-input tap, a framework's version, sync-free label helpers.

No framework knowledge here (each framework's conventions live in its own adapter module). Code in
the hooks runs inside the trainer's forward pass: it reads arguments and builds small label tensors
on their device, never waits for the device (no ``.item()``, no ``.tolist()``) and never raises.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from tracediff.record.recorder import Recorder


def framework_version(distribution: str) -> str:
    """Installed version of a distribution, without importing it ("unknown" when not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tap_fc_input(recorder: Recorder, fc: torch.nn.Linear, tap: str, *, module_path: str) -> None:
    """Capture what ``fc`` receives, under tap ``tap``.

    The hook is excluded from ``torch.compile`` tracing (speculators compiles its forward on CUDA):
    the compiled graph breaks around it and the hook runs eagerly, as it does without compilation.
    """

    def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.enabled:
            return
        try:
            tensor = args[0] if args else kwargs.get("input")
            recorder.capture(tap, tensor)  # type: ignore[arg-type]  # a non-tensor is skipped with a warning
        except Exception as exc:  # noqa: BLE001  (a hook must never raise into the trainer)
            recorder.fail(f"tap {tap!r} ({module_path})", exc)

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    hook = disable(pre_hook) if disable is not None else pre_hook
    recorder.keep_handle(fc.register_forward_pre_hook(hook, with_kwargs=True))


def argument(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    """A forward argument given by keyword or at position ``index`` (``None`` when absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else None


def previous_in_row(ids: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """``out[..., i] = ids[..., i-1]`` where ``same[..., i]``, else -1 (and -1 at i = 0)."""
    out = torch.full_like(ids, -1)
    out[..., 1:] = torch.where(same[..., 1:], ids[..., :-1], out[..., 1:])
    return out


def hf_labels(hf_indices: list[int] | None, count: int) -> list[str] | None:
    """Segment names in HF ``hidden_states`` numbering ("hs3"), when there is one id per segment."""
    if not hf_indices or len(hf_indices) != count:
        return None
    return [f"hs{i}" for i in hf_indices]
