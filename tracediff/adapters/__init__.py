"""Framework adapters: the only place that knows a framework's classes.

An adapter names the classes whose construction should attach taps (``watch``) and attaches them to
an instance (``attach``). The core never imports a framework; an adapter imports its own lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracediff.errors import AdapterError, UsageError


@dataclass(frozen=True)
class AdapterInfo:
    """How to load an adapter and check that its framework is installed, without importing it."""

    name: str
    module: str
    framework: str | None  # top-level import name of the framework, None for the generic adapter
    summary: str


ADAPTERS: dict[str, AdapterInfo] = {
    "generic": AdapterInfo("generic", "tracediff.adapters.generic", None,
                           "taps given with --tap CLASS.ATTR:input|output on any torch module"),
    "hf": AdapterInfo("hf", "tracediff.adapters.hf", "transformers",
                      "a bank of every hidden state of a transformers decoder model (embedding, each layer, "
                      "final layer before and after the norm)"),
}


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


AttachFn = Callable[[Any, Any], bool]
