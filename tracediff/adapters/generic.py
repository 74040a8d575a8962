"""Generic adapter: taps given as specs (``Eagle3DraftModel.fc:input``) and label sources.

A label source is a module whose forward receives ``input_ids`` (and maybe ``position_ids``): a
pre-hook on it tells the recorder which tokens the next captured rows belong to. Runs inside the
host's forward: it reads arguments and hands small label tensors over, nothing more.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tracediff.record.recorder import Recorder
from tracediff.record.tapspec import TapSpec

WATCH: tuple[str, ...] = ()


def attach_spec(recorder: Recorder, spec: TapSpec, instance: torch.nn.Module) -> bool:
    """Attach ``spec`` below ``instance`` (of a class the spec names). False if the path is absent."""
    target = spec.resolve(instance)
    if not isinstance(target, torch.nn.Module):
        return False
    per_recorder = target.__dict__.setdefault("_tracediff_taps", weakref.WeakKeyDictionary())
    seen = per_recorder.setdefault(recorder, set())
    if (spec.name, spec.capture) in seen:
        return True
    seen.add((spec.name, spec.capture))
    recorder.tap(target, spec.name, capture=spec.capture, arg=spec.arg, module_path=spec.module_path)
    return True


def labels_from_forward(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Row labels from a model forward's ``input_ids`` / ``position_ids`` / cache arguments.

    Positions: ``position_ids`` if given, else ``cache_position``, else the cache's length plus
    0..T-1. The next token is known inside the batch only (the last one is -1).
    """
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2):
        return None
    ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
    batch, length = ids2.shape
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        cache_position = kwargs.get("cache_position")
        if isinstance(cache_position, torch.Tensor) and cache_position.numel() == length:
            positions = cache_position.reshape(1, length).expand(batch, length)
        else:
            offset = 0
            past = kwargs.get("past_key_values")
            if past is not None and hasattr(past, "get_seq_length"):
                try:
                    offset = int(past.get_seq_length())
                except Exception:  # noqa: BLE001  (a cache we do not know: positions start at 0)
                    offset = 0
            positions = torch.arange(offset, offset + length, device=ids2.device).expand(batch, length)
    positions = positions.reshape(-1, length).expand(batch, length)
    next_ids = torch.full_like(ids2, -1)
    next_ids[:, :-1] = ids2[:, 1:]
    return {"token_id": ids2.detach(), "position": positions.detach(), "next_token_id": next_ids}


def attach_label_source(recorder: Recorder, module: torch.nn.Module, *, how: str = "label source") -> bool:
    """Make ``module``'s forward arguments label the rows captured after it in this thread. Each
    tap that uses them records ``labelled_by = {"class": ..., "how": how}``."""
    sources = module.__dict__.setdefault("_tracediff_label_sources", weakref.WeakSet())
    if recorder in sources:
        return True
    sources.add(recorder)
    labelled_by = {"class": f"{type(module).__module__}.{type(module).__qualname__}", "how": how}

    def pre_hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.enabled:
            return
        try:
            fields = labels_from_forward(args, kwargs)
            if fields is not None:
                recorder.labels(labelled_by=labelled_by, **fields)
        except Exception as exc:  # noqa: BLE001  (never raise into the host)
            recorder.fail(f"label source {type(mod).__name__}", exc)

    recorder.keep_handle(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return True


def attach(recorder: Recorder, module: torch.nn.Module) -> bool:
    """The generic adapter attaches nothing by itself: taps come from specs."""
    return False
