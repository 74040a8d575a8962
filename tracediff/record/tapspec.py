"""Tap specifications: which module of which class to record, as text a user types.

Grammar: ``[NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG]``, for example
``Eagle3DraftModel.fc:input`` (tap ``fc_in``), ``fc_in=LlamaForCausalLMEagle3.model.fc``,
``MyDraft.layers.0.fc:output`` or ``Linear@input``. CLASS matches a class's name, its qualified
name or ``module.qualname``, and also subclasses (any class in the instance's MRO).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracediff.errors import UsageError

_SPEC = re.compile(
    r"^(?:(?P<name>[A-Za-z0-9][A-Za-z0-9_-]*)=)?"
    r"(?P<cls>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*?)"
    r"(?P<path>(?:\.[A-Za-z0-9_]+)*)"
    r"(?::(?P<capture>input|output|in|out))?"
    r"(?:@(?P<arg>[A-Za-z0-9_]+))?$"
)


@dataclass(frozen=True)
class TapSpec:
    """A parsed tap spec; ``path`` is the attribute path below the matched class's instance."""

    name: str
    cls: str
    path: tuple[str, ...]
    capture: str
    arg: int | str
    text: str

    @classmethod
    def parse(cls, text: str) -> TapSpec:
        text = text.strip()
        match = _SPEC.match(text)
        if not match:
            raise UsageError(f"tap spec {text!r}: {_what_is_wrong(text)}; the form is "
                             f"[NAME=]CLASS[.ATTR.PATH][:input|:output][@ARG], e.g. 'Eagle3DraftModel.fc:input'")
        # The regex cannot tell `module.Class` from `Class.attr`: class names are CamelCase by
        # convention and attributes are not, so the class ends after its last leading CamelCase part.
        parts = (match["cls"] + match["path"]).split(".")
        first_class = next((i for i, p in enumerate(parts) if p[:1].isupper()), 0)
        split = next(
            (i for i in range(first_class + 1, len(parts)) if not parts[i][:1].isupper()), len(parts)
        )
        class_name, path = ".".join(parts[:split]), tuple(parts[split:])
        capture = {"in": "input", "out": "output"}.get(match["capture"] or "input", match["capture"] or "input")
        arg_text = match["arg"]
        arg: int | str = int(arg_text) if arg_text and arg_text.isdigit() else (arg_text or 0)
        if capture == "output" and arg_text:
            raise UsageError(f"tap spec {text!r}: @ARG selects an input; outputs take the first tensor")
        name = match["name"] or f"{(path[-1] if path else class_name.split('.')[-1]).lower()}_{'in' if capture == 'input' else 'out'}"
        return cls(name=name, cls=class_name, path=path, capture=capture, arg=arg, text=text)

    def class_matches(self, klass: type) -> bool:
        return any(_names_class(base, self.cls) for base in klass.__mro__)

    def resolve(self, root: object) -> object | None:
        """The module at ``path`` below ``root``, or None when the path does not exist (yet)."""
        obj = root
        for part in self.path:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                return None
        return obj

    @property
    def module_path(self) -> str:
        return ".".join((self.cls, *self.path))


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ATTR = re.compile(r"^[A-Za-z0-9_]+$")


def _what_is_wrong(text: str) -> str:
    """Which part of a spec that does not parse is wrong, in words (for the error message)."""
    if not text:
        return "it is empty"
    rest = text
    if "=" in rest:
        name, rest = rest.split("=", 1)
        if not name:
            return "the NAME before '=' is empty"
        if not _NAME.match(name):
            return f"the NAME {name!r} before '=' must be letters, digits, '_' or '-' (and not start with '_' or '-')"
    arg = None
    if "@" in rest:
        rest, arg = rest.rsplit("@", 1)
        if not _ATTR.match(arg):
            return f"the @ARG {arg!r} must be an input's position (@0) or keyword name (@hidden_states)"
    if ":" in rest:
        rest, capture = rest.rsplit(":", 1)
        if capture not in ("input", "output", "in", "out"):
            return f"the capture {capture!r} after ':' must be input or output (or in, out)"
        if ":" in rest:
            return "only one ':input' or ':output' may follow the module path"
    parts = rest.split(".")
    if not parts[0]:
        return "the CLASS is missing (the spec starts with a class name, e.g. Eagle3DraftModel)"
    if not _IDENT.match(parts[0]):
        return f"the CLASS {parts[0]!r} is not a Python class name"
    for part in parts[1:]:
        if not part:
            return "the attribute path has an empty part ('..' or a trailing '.')"
        if not _ATTR.match(part):
            return f"the attribute path part {part!r} is not an attribute name or an index"
    return "it does not parse"


def _names_class(klass: type, name: str) -> bool:
    return name in (klass.__name__, klass.__qualname__, f"{klass.__module__}.{klass.__qualname__}")
