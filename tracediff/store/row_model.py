"""Row models: what one row of a draft-input tap holds, slot by slot, as data (docs/row-models.md).

A row of an fc-input tap is the concatenation of equal-width *slots*. An EAGLE-3 ``fc`` input holds
K hidden states of chosen target layers; an MTP head's ``eh_proj`` input (DeepSeek-V3 / Kimi / GLM,
Qwen3-Next MTP) holds ``cat(enorm(embed(x_{p+1})), hnorm(h_p))``. Each slot says where its values
come from:

* ``kind``: ``hidden`` (a target hidden state) or ``embedding`` (the embedding of a token);
* ``layer``: for ``hidden``, the physical layer (docs/format.md "Aux layers": 0 = the embedding
  output, ``k`` = the output of decoder layer ``k - 1``); None = the target's last layer;
* ``final_norm``: for ``hidden``, whether the target's final norm was applied (``h`` after it);
* ``token_offset``: the row at position ``p`` holds this slot's value for token ``x_{p+offset}``
  (an MTP embedding slot: +1, the next token);
* ``draft_norm``: the draft's own norm applied before the tap (``enorm``, ``hnorm``), or None.

Stored as the writer-group attribute ``row_model`` (a JSON object, :meth:`RowModel.to_json`). A
store without it holds the EAGLE-3 model derived from its aux layers, as before row models existed.

Pure data: no I/O, no framework import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tracediff.errors import UsageError

SLOT_KINDS = ("hidden", "embedding")
#: Names ``tracediff record --row-model`` accepts (eagle3 takes its layers from --aux-layers).
CLI_NAMES = ("eagle3", "mtp", "mtp-post-norm")


@dataclass(frozen=True)
class Slot:
    """One slot of a row: see the module docstring."""

    kind: str
    layer: int | None = None
    final_norm: bool = False
    token_offset: int = 0
    draft_norm: str | None = None

    def describe(self) -> str:
        """'embedding of the next token (enorm)', 'layer 61 hidden state after the final norm'."""
        normed = f" ({self.draft_norm})" if self.draft_norm else ""
        if self.kind == "embedding":
            return f"embedding of {_token_text(self.token_offset)}{normed}"
        token = "" if self.token_offset == 0 else f" of {_token_text(self.token_offset)}"
        if self.layer == 0 and not self.final_norm:
            return f"the embedding output (hidden state 0){token}{normed}"
        where = "the last layer's hidden state" if self.layer is None else f"layer {self.layer} hidden state"
        norm = "after the final norm" if self.final_norm else "before the final norm"
        return f"{where}{token} {norm}{normed}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "layer": self.layer, "final_norm": self.final_norm,
                "token_offset": self.token_offset, "draft_norm": self.draft_norm}


@dataclass(frozen=True)
class RowModel:
    """The slots of one row, in concatenation order, and the model's name (``eagle3``, ``mtp``...).
    ``derived`` is true for a model compare inferred from aux layers (nothing was stored)."""

    name: str
    slots: tuple[Slot, ...]
    derived: bool = False

    def describe(self) -> list[str]:
        return [f"slot {i}: {s.describe()}" for i, s in enumerate(self.slots)]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "slots": [s.to_json() for s in self.slots]}

    def same_layout(self, other: RowModel) -> bool:
        """The same slots (what each holds), whatever the models are called."""
        return self.slots == other.slots


def eagle3(layers: Iterable[int | str]) -> RowModel:
    """EAGLE-3: one hidden-state slot per aux layer (physical numbering; ``"final_norm"`` = the last
    layer after the final norm), in concatenation order."""
    slots = []
    for layer in layers:
        if layer == "final_norm":
            slots.append(Slot("hidden", None, final_norm=True))
        elif isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise UsageError(f"row model eagle3: layer {layer!r} is no physical layer (an integer >= 0 or 'final_norm')")
        else:
            slots.append(Slot("hidden", int(layer)))
    if not slots:
        raise UsageError("row model eagle3: give at least one layer")
    return RowModel("eagle3", tuple(slots))


def mtp(final_norm: bool = False, layer: int | None = None) -> RowModel:
    """An MTP head's input: ``cat(enorm(embed(x_{p+1})), hnorm(h_p))``, ``h_p`` the target's last
    hidden state (``layer``: None = the last layer) before the final norm, or after it."""
    return RowModel("mtp", (Slot("embedding", token_offset=1, draft_norm="enorm"),
                            Slot("hidden", layer, final_norm=final_norm, draft_norm="hnorm")))


def from_cli(name: str, layers: Sequence[int | str] | None = None) -> RowModel:
    """The model ``tracediff record --row-model NAME`` names (``layers``: the physical aux layers)."""
    if name == "mtp":
        return mtp(final_norm=False)
    if name == "mtp-post-norm":
        return mtp(final_norm=True)
    if name == "eagle3":
        if not layers:
            raise UsageError("--row-model eagle3 takes its slots from --aux-layers: give them too "
                             "(e.g. --aux-layers 2,16,29 --convention vllm)")
        return eagle3(layers)
    raise UsageError(f"--row-model {name!r} is not a row model; choose one of {', '.join(CLI_NAMES)}")


def from_json(obj: Any, where: str = "row_model") -> RowModel:
    """A stored ``row_model`` -> :class:`RowModel`; a malformed one raises one ``UsageError`` line
    naming the field (``row_model.slots[1].kind``); readers wrap it with the file."""
    if isinstance(obj, RowModel):
        return obj
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}: expected an object with name and slots, got {_short(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise UsageError(f"{where}.name: expected a non-empty string, got {_short(name)}")
    raw = obj.get("slots")
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{where}.slots: expected a non-empty list of slots, got {_short(raw)}")
    return RowModel(name, tuple(_slot(s, f"{where}.slots[{i}]") for i, s in enumerate(raw)))


def _slot(obj: Any, where: str) -> Slot:
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}: expected an object, got {_short(obj)}")
    kind = obj.get("kind")
    if kind not in SLOT_KINDS:
        raise UsageError(f"{where}.kind: expected one of {', '.join(SLOT_KINDS)}, got {_short(kind)}")
    layer = obj.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise UsageError(f"{where}.layer: expected a physical layer (an integer >= 0) or null, got {_short(layer)}")
    final_norm = obj.get("final_norm", False)
    if not isinstance(final_norm, bool):
        raise UsageError(f"{where}.final_norm: expected true or false, got {_short(final_norm)}")
    offset = obj.get("token_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise UsageError(f"{where}.token_offset: expected an integer, got {_short(offset)}")
    draft_norm = obj.get("draft_norm")
    if draft_norm is not None and not isinstance(draft_norm, str):
        raise UsageError(f"{where}.draft_norm: expected a name (e.g. enorm) or null, got {_short(draft_norm)}")
    if kind == "embedding" and (layer is not None or final_norm):
        raise UsageError(f"{where}: an embedding slot has no layer and no final norm (got layer {_short(layer)}, "
                         f"final_norm {final_norm})")
    return Slot(kind, layer, final_norm, offset, draft_norm)


def _token_text(offset: int) -> str:
    if offset == 0:
        return "the row's token"
    if offset == 1:
        return "the next token"
    if offset == -1:
        return "the previous token"
    return f"token x_(p{offset:+d})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["CLI_NAMES", "SLOT_KINDS", "RowModel", "Slot", "eagle3", "from_cli", "from_json", "mtp"]
