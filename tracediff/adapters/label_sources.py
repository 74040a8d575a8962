"""Automatic label sources: the outermost module whose forward receives ``input_ids`` labels the rows.

``tracediff record --tap ...`` without ``--labels-from`` (and without a framework adapter, which
labels its own rows) still needs token ids on its rows: compare aligns sequences by content. The
candidates are found when their class is created, never per forward: a class is a candidate when
its ``forward`` has an ``input_ids`` parameter, or when it is a transformers ``PreTrainedModel``.
Only instances of candidate classes get hooks, and only in a process that records (a recorder
exists); every other module's forward runs untouched.

Of the candidates, the one that labels is the first forward entered while no other candidate's
forward is active in that thread (the outermost: ``LlamaForCausalLM`` over its ``LlamaModel``). A
candidate that holds a tapped module (an EAGLE-3 draft whose forward gets the draft's own input
tokens, one position ahead of the hidden states it is fed) labels only when no other automatic
source has labelled in that thread: the target model's tokens are the rows' tokens. Labels the
script gives itself (``tracediff.labels``) always win: automatic sources stand aside once it has.

Runs inside the host's forward: reads arguments, hands small label tensors over, never raises.
Imports nothing heavy at module level (it is imported in every recording process when torch is).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

#: Base classes (by name) whose subclasses are label sources even when their forward's signature
#: hides ``input_ids`` (decorated or ``**kwargs`` forwards): transformers' models.
LABEL_SOURCE_BASES: tuple[str, ...] = ("PreTrainedModel",)

#: Per recorder, ``.depth`` of a thread-local: the candidate forwards active in that thread.
_active: weakref.WeakKeyDictionary[Any, threading.local] = weakref.WeakKeyDictionary()


def input_ids_slot(klass: type) -> int | None:
    """Where ``klass.forward`` takes ``input_ids``: its positional index (``self`` excluded), -1
    when keyword-only or unknown (a transformers model: keyword or first argument), None when
    instances of ``klass`` are no label source. Reads code objects only (microseconds: it runs once
    per class created and once per candidate instance built)."""
    forward = getattr(klass, "forward", None)
    try:
        forward = inspect.unwrap(forward) if forward is not None else None
    except ValueError:  # a cycle of __wrapped__
        forward = None
    code = getattr(forward, "__code__", None)
    if code is not None:
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if "input_ids" in names:
            index = names.index("input_ids")
            return index - 1 if 0 < index < code.co_argcount else -1
    if any(base.__name__ in LABEL_SOURCE_BASES for base in klass.__mro__):
        return -1
    return None


def attach_automatic_source(recorder: Any, module: Any, tapped: weakref.WeakSet[Any],
                            taps_attached: Any) -> bool:
    """Hook ``module`` (an instance of a class :func:`input_ids_slot` accepts) as an automatic label
    source of ``recorder``. ``tapped`` holds the modules whose rows are recorded; ``taps_attached()``
    counts the taps attached so far (when it grows, whether ``module`` holds one is asked again)."""
    slot = input_ids_slot(type(module))
    if slot is None:
        return False
    sources = module.__dict__.setdefault("_tracediff_auto_sources", weakref.WeakSet())
    if recorder in sources:
        return True
    sources.add(recorder)
    klass = type(module)
    name = f"{klass.__module__}.{klass.__qualname__}"
    active = _active.setdefault(recorder, threading.local())
    held: list[Any] = [-1, False]  # (taps attached when last asked, whether module holds one)

    def holds_tap(mod: Any) -> bool:
        count = taps_attached()
        if held[0] != count:
            held[0], held[1] = count, any(m in tapped for m in mod.modules())
        return bool(held[1])

    def pre_hook(mod: Any, args: tuple, kwargs: dict) -> None:
        depth = getattr(active, "depth", 0)
        active.depth = depth + 1
        if depth or not recorder.enabled or recorder.explicit_labels:
            return
        try:
            from tracediff.adapters.generic import labels_from_forward  # noqa: PLC0415

            inner = holds_tap(mod)
            if inner:
                pending = recorder.pending_labelled_by()
                if pending and pending.get("how") == "automatic" and not pending.get("holds_tap"):
                    return  # the target model labelled this thread's rows: its tokens are theirs
            if "input_ids" not in kwargs and slot > 0 and slot < len(args):
                args, kwargs = (), {**kwargs, "input_ids": args[slot]}
            fields = labels_from_forward(args, kwargs)
            if fields is not None:
                recorder.labels(labelled_by={"class": name, "how": "automatic", "holds_tap": inner}, **fields)
        except Exception as exc:  # noqa: BLE001  (never raise into the host)
            recorder.fail(f"label source {klass.__name__}", exc)

    def post_hook(mod: Any, args: tuple, kwargs: dict, output: Any) -> None:
        active.depth = max(getattr(active, "depth", 1) - 1, 0)

    recorder.keep_handle(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    # always_call: a forward that raises still leaves the active depth as it found it.
    recorder.keep_handle(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
    return True
