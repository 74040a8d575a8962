"""What each side's stores say about themselves beyond their rows: who recorded them (a trainer or a
server, with what command line), several stores read as one side, one recording on both sides.
Metadata only: reads no rows."""

from __future__ import annotations

import os
from pathlib import Path

from tracediff.adapters import recording_side
from tracediff.compare.plan.metadata import same_recording
from tracediff.compare.results import Finding
from tracediff.store import TraceStore
from tracediff.store.storeset import StoreSet

Side_ = TraceStore | StoreSet


def _recording_side(store: Side_) -> str | None:
    """"trainer" or "server", as the store records it (its role, or the adapters that recorded it)."""
    first = store.stores[0] if isinstance(store, StoreSet) else store
    record = first.meta.get("record") if isinstance(first.meta, dict) else None
    adapters = record.get("adapters") if isinstance(record, dict) else None
    role = first.source.get("role", "") if isinstance(first.source, dict) else ""
    return recording_side(str(role or ""), [str(a) for a in adapters] if isinstance(adapters, list) else [])


def swapped_roles(ref_store: Side_, cand_store: Side_) -> Finding | None:
    """A warning, first in the report, when the reference was recorded by a server and the candidate
    by a trainer: every finding then reads the server as what the draft learned."""
    ref, cand = _recording_side(ref_store), _recording_side(cand_store)
    if (ref, cand) != ("server", "trainer"):
        return None
    return Finding(
        "swapped_roles", "warning",
        f"The reference ({Path(str(ref_store.path)).name}) was recorded by a server and the candidate "
        f"({Path(str(cand_store.path)).name}) by a trainer: the arguments look swapped. compare reads the first store "
        f"as what the draft learned, so 'missing' and 'extra' are inverted and the Fix names the trainer's config; "
        f"run: tracediff compare TRAINER_STORE SERVER_STORE.",
        {"reference": ref, "candidate": cand}, "the arguments look swapped (server as reference)")


def recorded_by(store: Side_) -> list[str]:
    """The `tracediff record` command line a store records (one store of a set: the first's)."""
    first = store.stores[0] if isinstance(store, StoreSet) else store
    argv = first.source.get("recorded_by") if isinstance(first.source, dict) else None
    return [str(a) for a in argv] if isinstance(argv, list) and argv[:2] == ["tracediff", "record"] else []


def store_set_notes(store: Side_, role: str) -> list[str]:
    """What a compare tells of a side read from several stores: which, and where their meta differ."""
    if not isinstance(store, StoreSet):
        return []
    each = ("; rows of one sequence and position in several stores are each compared with the reference"
            if role == "candidate" else "")
    notes = [f"{role}: {len(store.stores)} stores read as one trace ({', '.join(store.names)}): their writer "
             f"groups together{each}"]
    differ = store.meta_differences()
    if differ:
        notes.append(f"{role} stores differ in meta {', '.join(differ)}: the config diff reads {store.names[0]}'s")
    return notes


def same_recording_of(ref_store: Side_, cand_store: Side_) -> str | None:
    """same_recording for single stores; for several, whether a store is on both sides."""
    if not isinstance(ref_store, StoreSet) and not isinstance(cand_store, StoreSet):
        return same_recording(ref_store, cand_store)
    def paths(s: Side_) -> set[str]:
        return {os.path.realpath(p) for p in (s.names if isinstance(s, StoreSet) else [str(s.path)])}

    return "same store" if paths(ref_store) & paths(cand_store) else None
