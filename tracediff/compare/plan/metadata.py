"""What the two sides say about themselves: the config diff and each side's aux layers.

Step 1 of the plan (DESIGN.md §5): a structural diff over the recorded ``meta`` (JSON: dicts, lists,
scalars; the change names are deepdiff's, so reports read as before) with volatile keys (pids,
hosts, times, command lines) left out, and the aux-layer settings of both sides translated into one
physical numbering (:mod:`tracediff.adapters.conventions`), so that two sides that read the same
layers under two numberings are not reported as different. Metadata only: no values, no I/O beyond
what the open stores already hold.
"""

from __future__ import annotations

import re
from typing import Any

from tracediff.adapters.conventions import AuxLayers, aux_layers_from_meta

# row_checks: what a writer counted as it wrote (lint as you go), data statistics rather than configuration
# (row_model: compare reads it and names a difference in a finding of its own, findings/slots.py);
# ring: a ring segment's bookkeeping (tracediff.store.ring: its number, what the ring dropped)
VOLATILE_KEYS = re.compile(
    r"(^|_)(pid|host|hostname|started|updated|time|timestamp|argv|python|recorded_by|record|limits|injected|labelled_by|row_checks|row_model|ring)$"
)
AUX_KEYS = re.compile(
    r"layer_ids|layers_to_capture|aux_hidden_state|eagle_aux|aux_layer|aux_layers|segment_labels|hf_hidden_states",
    re.I,
)


def is_aux_key(path: str) -> bool:
    return bool(AUX_KEYS.search(path))


def aux_config(meta: Any, prefix: str = "") -> dict[str, Any]:
    """Every aux-layer setting in ``meta``, flattened: ``{"store.aux_layers": {...}, ...}``."""
    out: dict[str, Any] = {}
    if isinstance(meta, dict):
        for k, v in meta.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if VOLATILE_KEYS.search(str(k)):
                continue  # e.g. `record`'s own options: its --segment-labels are the tap's, said there
            if AUX_KEYS.search(str(k)):
                out[path] = v
            elif isinstance(v, dict):
                out.update(aux_config(v, path))
    return out


def num_layers(meta: dict[str, Any]) -> int | None:
    """The target's decoder layer count, if a side's collected meta records it (writer first)."""
    for part in ("writer", "store"):
        block = meta.get(part) or {}
        for key in ("num_hidden_layers", "num_layers"):
            value = block.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def side_aux_layers(meta: dict[str, Any]) -> AuxLayers | None:
    """One side's aux layers from its collected meta (``{"store", "writer", "tap"}``), the writer's
    own meta first (it is what that process really had), then the store's."""
    layers = num_layers(meta)
    for part in ("writer", "store"):
        found = aux_layers_from_meta(meta.get(part) or {}, layers)
        if found is not None:
            found.field = f"{part}.{found.field}"
            return found
    return None


def config_diff(ref_meta: dict[str, Any], cand_meta: dict[str, Any], *, same_physical_layers: bool = False
                ) -> list[dict[str, Any]]:
    """Structural diff of the two metas, volatile keys left out; aux-layer settings shown whole
    (``[3, 31, 59] -> [2, 30, 58]``). With ``same_physical_layers`` (both sides read the same
    layers, whatever numbering each recorded), aux-layer entries are marked ``"equivalent": True``.

    A meta is plain JSON, so this walks it itself rather than through deepdiff, whose import pulls
    in pandas (seconds of a compare's start-up, in the CLI and in a user's Python process alike); the
    entries are what ``DeepDiff(ref, cand, ignore_order=False, threshold_to_diff_deeper=0)`` reports
    (tested against it): field by field, never two dicts with few keys in common as one dict dump."""
    out: list[dict[str, Any]] = []
    _walk_diff(ref_meta, cand_meta, [], out)
    ref_aux, cand_aux = aux_config(ref_meta), aux_config(cand_meta)
    out = [e for e in out if not any(e["path"] == k or e["path"].startswith(k + ".") for k in (*ref_aux, *cand_aux))]
    for key in sorted(set(ref_aux) | set(cand_aux)):
        if ref_aux.get(key) != cand_aux.get(key):
            entry = {"path": key, "change": "values_changed", "reference": _plain(ref_aux.get(key)),
                     "candidate": _plain(cand_aux.get(key))}
            if same_physical_layers:
                entry["equivalent"] = True
            out.append(entry)
    out.sort(key=lambda e: (0 if AUX_KEYS.search(e["path"]) else 1, e["path"]))
    return out


def _walk_diff(ref: Any, cand: Any, path: list[str | int], out: list[dict[str, Any]]) -> None:
    """Append the differences of ``cand`` from ``ref`` under ``path`` (deepdiff's change names:
    values_changed, type_changes, dictionary_item_added/removed, iterable_item_added/removed)."""
    if isinstance(ref, dict) and isinstance(cand, dict):
        for key in ref:
            if VOLATILE_KEYS.search(str(key)):
                continue
            if key in cand:
                _walk_diff(ref[key], cand[key], [*path, key], out)
            else:
                out.append(_entry([*path, key], "dictionary_item_removed", ref[key], None))
        for key in cand:
            if key not in ref and not VOLATILE_KEYS.search(str(key)):
                out.append(_entry([*path, key], "dictionary_item_added", None, cand[key]))
        return
    if isinstance(ref, (list, tuple)) and isinstance(cand, (list, tuple)):
        for i in range(min(len(ref), len(cand))):
            _walk_diff(ref[i], cand[i], [*path, i], out)
        for i in range(len(cand), len(ref)):
            out.append(_entry([*path, i], "iterable_item_removed", ref[i], None))
        for i in range(len(ref), len(cand)):
            out.append(_entry([*path, i], "iterable_item_added", None, cand[i]))
        return
    if type(ref) is not type(cand):
        out.append(_entry(path, "type_changes", ref, cand))
    elif ref != cand:
        out.append(_entry(path, "values_changed", ref, cand))


#: The field name of the first line of a readable config diff: what the two sides feed, in one numbering.
PHYSICAL_FIELD = "physical layers (HF hidden_states numbering)"


def readable_changes(entries: list[dict[str, Any]], reference_physical: Any = None,
                     candidate_physical: Any = None) -> list[dict[str, Any]]:
    """Config differences as a person reads a diff: one ``{"field", "reference", "candidate"}`` per
    field that differs, the physical layers first (when a side knows them and they differ), then
    each entry of :func:`config_diff` walked down to the fields that differ, so a changed aux-layer
    block reads as its changed ids and convention, never as two whole dicts. A side that lacks a
    field has ``None`` there."""
    out: list[dict[str, Any]] = []
    if (reference_physical is not None or candidate_physical is not None) and reference_physical != candidate_physical:
        out.append({"field": PHYSICAL_FIELD, "reference": reference_physical, "candidate": candidate_physical})
    for entry in entries:
        out += _leaf_changes(str(entry.get("path", "")), entry.get("reference"), entry.get("candidate"))
    return out


def _leaf_changes(path: str, reference: Any, candidate: Any) -> list[dict[str, Any]]:
    if isinstance(reference, dict) or isinstance(candidate, dict):
        ref = reference if isinstance(reference, dict) else None
        cand = candidate if isinstance(candidate, dict) else None
        if (ref is None and reference is not None) or (cand is None and candidate is not None):
            return [{"field": path, "reference": reference, "candidate": candidate}]  # a dict against a value
        ref, cand = ref or {}, cand or {}
        rows: list[dict[str, Any]] = []
        for key in [*ref, *(k for k in cand if k not in ref)]:
            if key not in ref or key not in cand or ref[key] != cand[key]:
                rows += _leaf_changes(f"{path}.{key}" if path else str(key), ref.get(key), cand.get(key))
        return rows
    return [{"field": path, "reference": reference, "candidate": candidate}]


def _entry(path: list[str | int], change: str, ref: Any, cand: Any) -> dict[str, Any]:
    name = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path)
    return {"path": name, "change": change, "reference": _plain(ref), "candidate": _plain(cand)}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def same_recording(ref_store: Any, cand_store: Any) -> str | None:
    """Whether both sides are one recording: ``"same store"`` (one path), ``"copy"`` (e.g. a store and
    its own ``.zarr.zip``: the same source, meta and committed writer groups), else None.

    A recording's root ``source`` names its process, host and start time, and every writer group's
    commit record its rows and batches: two recordings agree on all of that only when they are one.
    """
    try:
        if ref_store.path.resolve() == cand_store.path.resolve():
            return "same store"
    except OSError:
        pass
    if not ref_store.source or ref_store.source != cand_store.source or ref_store.meta != cand_store.meta:
        return None

    def groups(store: Any) -> dict[tuple[str, str], Any]:
        return {(s.tap, s.writer): (s.rows, s.width, s.dtype, s.commit) for tap in store.taps
                for s in store.tap_streams(tap)}

    return "copy" if groups(ref_store) == groups(cand_store) else None
