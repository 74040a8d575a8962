"""Framework adapters: the only place that knows a framework's classes.

An adapter names the classes whose construction should attach taps (``watch``) and attaches them to
an instance (``attach``). The core never imports a framework; an adapter imports its own lazily.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tracediff.errors import AdapterError, UsageError

log = logging.getLogger("tracediff")


@dataclass(frozen=True)
class AdapterInfo:
    """How to load an adapter and check that its framework is installed, without importing it."""

    name: str
    module: str
    framework: str | None  # top-level import name of the framework, None for the generic adapter
    summary: str
    side: str | None = None  # what a recording with it is: "trainer", "server", or None (either)
    # a stdlib-only module whose engine_cores() says which cores the engine pinned its model to (the
    # recorder's threads go to the others: tracediff.record.cores), or None
    engine_cores: str | None = None


ADAPTERS: dict[str, AdapterInfo] = {
    "generic": AdapterInfo("generic", "tracediff.adapters.generic", None,
                           "taps given with --tap CLASS.ATTR:input|output on any torch module"),
    "hf": AdapterInfo("hf", "tracediff.adapters.hf", "transformers",
                      "a bank of every hidden state of a transformers decoder model (embedding, each layer, "
                      "final layer before and after the norm)"),
    "sglang": AdapterInfo("sglang", "tracediff.adapters.sglang", "sglang",
                          "SGLang server: the EAGLE-3 draft's fc input (a DeepSeek NextN head's eh_proj input) and the "
                          "target's packed aux hidden states",
                          side="server"),
    "vllm": AdapterInfo("vllm", "tracediff.adapters.vllm", "vllm",
                        "vLLM engine (V1): the EAGLE-3 draft's fc input (an MTP head's eh_proj input) and the target's "
                        "aux concatenation, per drafter call", side="server",
                        engine_cores="tracediff.adapters.vllm_cores"),
    "speculators": AdapterInfo("speculators", "tracediff.adapters.speculators", "speculators",
                               "speculators trainer: Eagle3DraftModel.fc input (MTPDraftModel: its MTP layer's input_proj) "
                               "with labels from its forward",
                               side="trainer"),
    "specforge": AdapterInfo("specforge", "tracediff.adapters.specforge", "specforge",
                             "SpecForge trainer: LlamaForCausalLMEagle3 / OnlineEagle3Model fc input",
                             side="trainer"),
}


def recording_side(role: str, adapters: Sequence[str]) -> str | None:
    """"trainer" or "server": what a store is, from the role it records or the adapters that
    recorded it; None when neither says."""
    role = (role or "").strip().lower()
    if role in ("trainer", "server"):
        return role
    sides = {ADAPTERS[a].side for a in adapters if a in ADAPTERS and ADAPTERS[a].side}
    return sides.pop() if len(sides) == 1 else None


def adapter_info(name: str) -> AdapterInfo:
    if name not in ADAPTERS:
        raise UsageError(f"unknown adapter {name!r}; known adapters: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[name]


def check_installed(name: str) -> None:
    """Fail early, in the launching process, when an adapter's framework is missing."""
    info = adapter_info(name)
    if info.framework and importlib.util.find_spec(info.framework) is None:
        raise AdapterError(
            f"adapter {name!r} needs the Python package {info.framework!r}, which is not installed here"
        )


def load_adapter(name: str) -> Any:
    """The adapter module: it has ``WATCH`` (class names) and ``attach(recorder, module) -> bool``."""
    info = adapter_info(name)
    try:
        return importlib.import_module(info.module)
    except ImportError as exc:
        raise AdapterError(f"adapter {name!r} cannot be loaded: {exc}") from exc


def adapter_names(spec: str | Sequence[str]) -> list[str]:
    """``"speculators"``, ``"hf,generic"`` or a list -> checked adapter names (unknown or not installed: error)."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n and n.strip()]
    for name in names:
        check_installed(name)
    return names


def attach_in_process(recorder: Any, spec: str | Sequence[str]) -> list[str]:
    """Attach the named adapters in this process, for ``tracediff.record(..., adapter=NAME)``.

    Attaches to every live instance of a watched class now, and to instances built while the
    recorder is open, of classes already imported (so import the framework first). The wrapped
    ``__init__`` methods are restored when the recorder closes. Returns what was attached.
    """
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415

    attached: list[str] = []
    for name in adapter_names(spec):
        adapter = load_adapter(name)
        prepare = getattr(adapter, "prepare_in_process", None)
        if prepare is not None:
            prepare()  # e.g. import the classes a framework loads lazily, so that their instances attach
        watched = set(adapter.WATCH)
        if not watched:
            continue

        def attach_one(module: Any, adapter: Any = adapter, name: str = name) -> None:
            try:
                if adapter.attach(recorder, module):
                    attached.append(f"{name} <- {type(module).__qualname__}")
            except Exception as exc:  # noqa: BLE001  (the host goes on; recording stops)
                recorder.fail(f"adapter {name!r} on {type(module).__qualname__}", exc)

        # type(), not isinstance(): isinstance reads __class__, which some lazy objects warn about.
        live = [obj for obj in gc.get_objects()
                if issubclass(type(obj), torch.nn.Module) and _watched(type(obj), watched)]
        # Outermost first: the adapter meets the whole model before its parts (a trainer wrapper
        # before its draft, LlamaForCausalLM before its LlamaModel).
        inner = {id(child) for module in live for child in module.modules() if child is not module}
        live.sort(key=lambda module: id(module) in inner)
        for module in live:
            attach_one(module)
        stack, seen, classes = [torch.nn.Module], set(), []
        while stack:
            klass = stack.pop()
            if klass in seen:
                continue  # reached again through another base
            seen.add(klass)
            stack.extend(klass.__subclasses__())
            if _watched(klass, watched):
                classes.append(klass)
        for klass in classes:
            recorder.keep_handle(_InitWrapper(klass, recorder, attach_one))
        if not live and not classes:
            log.warning("tracediff: adapter %r found no %s: import its framework (and build the model) before "
                        "tracediff.record(...)", name, " / ".join(sorted(watched)))
    return attached


def _watched(klass: type, names: set[str]) -> bool:
    return any(k.__name__ in names or f"{k.__module__}.{k.__qualname__}" in names for k in klass.__mro__)


class _InitWrapper:
    """Wraps ``klass.__init__`` so that finished instances get attached; ``remove()`` undoes it (the
    recorder calls it at close, like a hook handle)."""

    def __init__(self, klass: Any, recorder: Any, attach_one: Callable[[Any], None]) -> None:
        self.klass = klass
        self.original = klass.__dict__.get("__init__")
        own = self.original

        def init(instance: Any, *args: Any, **kwargs: Any) -> None:
            if own is not None:
                own(instance, *args, **kwargs)
            else:
                super(klass, instance).__init__(*args, **kwargs)
            # Only the most derived class's wrapper acts: by then the instance is fully built.
            if type(instance) is klass and not recorder.closed:
                attach_one(instance)

        if own is not None:
            # __wrapped__: frameworks that read the constructor's signature (vLLM decides how to call
            # a model class from it) see the real one.
            functools.update_wrapper(init, own)
        else:
            init.__name__ = init.__qualname__ = "__init__"
        self.wrapper = init
        klass.__init__ = init  # type: ignore[misc]

    def remove(self) -> None:
        if self.klass.__dict__.get("__init__") is not self.wrapper:
            return  # someone wrapped it again after us: leave theirs in place
        if self.original is None:
            delattr(self.klass, "__init__")
        else:
            self.klass.__init__ = self.original  # type: ignore[misc]


AttachFn = Callable[[Any, Any], bool]
