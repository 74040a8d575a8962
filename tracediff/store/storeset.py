"""Several trace stores of one side of a compare, read as one trace (``compare REF CAND CAND...``).

A recording spread over nodes or replicas leaves one store per node; their writer groups together
are the trace. :class:`StoreSet` offers what a compare reads of a store (taps, writer groups, meta)
over all of them; each writer group keeps its own store, so errors and row references name the store
a row came from. Rows of one (sequence, position) held by several stores are paired like the rows of
tensor-parallel ranks: each is compared with the reference (:func:`tracediff.compare.align.rowpairs.pair_rows`).

Stores of one side must hold the same layout (format, and per tap width, dtype and segment size):
anything else is one :class:`tracediff.errors.CompareError` naming both stores.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

from tracediff.errors import CompareError, UsageError
from tracediff.store import TraceStore, TraceStream, open_store

__all__ = ["StoreSet", "expand_stores", "open_side"]

_GLOB_CHARS = set("*?[")


def expand_stores(locations: Sequence[str | os.PathLike[str]], role: str) -> list[str]:
    """The stores ``locations`` name, in order: each is a store (path or URL) or a glob of paths or
    URLs (quoted on the command line; ``s3://traces/server-*.zarr`` lists the bucket) matching at
    least one. The same store named twice counts once."""
    out: list[str] = []
    seen: set[str] = set()
    for loc in locations:
        text = os.fspath(loc)
        if "://" in text and _GLOB_CHARS & set(text.split("://", 1)[1].split("?", 1)[0]):
            matches = _url_matches(text, role)
        elif "://" not in text and _GLOB_CHARS & set(text) and not os.path.lexists(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise UsageError(f"{role} {text!r}: no store matches this pattern")
        else:
            matches = [text]
        for m in matches:
            key = os.path.realpath(m) if "://" not in m else m
            if key not in seen:
                seen.add(key)
                out.append(m)
    if not out:
        raise UsageError(f"no {role} store given")
    return out


def _url_matches(pattern: str, role: str) -> list[str]:
    """The URLs a URL glob matches (listed with the command's storage options), sorted."""
    from tracediff.store.location import Location, remote_error  # noqa: PLC0415

    where = Location(pattern)
    try:
        found = where.fs.glob(where.fs._strip_protocol(pattern))
    except Exception as exc:  # the object store's own errors: one line naming the pattern
        raise remote_error(where.display, exc, "listed") from exc
    protocol = pattern.split("://", 1)[0]
    matches = sorted(f"{protocol}://{path.rstrip('/')}" for path in found)
    if not matches:
        raise UsageError(f"{role} {where.display!r}: no store matches this pattern")
    return matches


class StoreSet:
    """Several opened stores as one: the parts of :class:`TraceStore` a compare reads."""

    def __init__(self, stores: Sequence[TraceStore]) -> None:
        if len(stores) < 2:
            raise UsageError("StoreSet: give two stores or more (one store is a TraceStore)")
        self.stores = list(stores)
        first = self.stores[0]
        for s in self.stores[1:]:
            if s.format != first.format:
                raise CompareError(f"{s.path} is trace format {s.format}, {first.path} format {first.format}: "
                                   f"stores read as one trace must share their format; compare them separately")
        self.path = " + ".join(str(s.path) for s in self.stores)
        self.format, self.version = first.format, first.version
        self.source: dict[str, Any] = first.source
        self.meta: dict[str, Any] = first.meta
        taps: list[str] = []
        for s in self.stores:
            taps += [t for t in s.taps if t not in taps]
        self.taps = taps
        self._checked: dict[str, list[TraceStream]] = {}

    @property
    def names(self) -> list[str]:
        return [str(s.path) for s in self.stores]

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def __enter__(self) -> StoreSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tap_streams(self, tap: str) -> list[TraceStream]:
        """Every store's writer groups of ``tap``, store after store (the layouts checked to agree)."""
        if tap in self._checked:
            return self._checked[tap]
        held = [s for s in self.stores if tap in s.taps]
        if not held:
            raise UsageError(f"{self.path}: no store holds a tap named {tap!r}; taps: {', '.join(self.taps) or 'none'}")
        seen: tuple[TraceStore, tuple] | None = None
        streams: list[TraceStream] = []
        for store in held:
            own = store.tap_streams(tap)
            streams += own
            with_rows = [st for st in own if st.rows]
            if not with_rows:
                continue
            layout = (with_rows[0].width, with_rows[0].dtype, with_rows[0].segment_size)
            if seen is None:
                seen = (store, layout)
            elif layout != seen[1]:
                (w0, d0, k0), (w1, d1, k1) = seen[1], layout
                raise CompareError(
                    f"{store.path}/{tap} holds rows of width {w1} {d1} (segment size {k1}), {seen[0].path}/{tap} of "
                    f"width {w0} {d0} (segment size {k0}): stores read as one trace must hold the same layout; "
                    f"compare them separately")
        self._checked[tap] = streams
        return streams

    def rows(self, tap: str) -> int:
        return sum(s.rows(tap) for s in self.stores if tap in s.taps)

    def meta_differences(self) -> list[str]:
        """Top-level meta keys on which some store differs from the first (whose meta is compared)."""
        first = self.stores[0].meta
        keys = sorted({k for s in self.stores[1:] for k in set(first) | set(s.meta) if first.get(k) != s.meta.get(k)})
        return keys


def open_side(locations: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
              storage_options: dict[str, Any] | None = None) -> TraceStore | StoreSet:
    """One store, or a :class:`StoreSet` of several (opened in order; all closed if one fails).
    ``storage_options`` go to :func:`tracediff.store.open_store` with each location."""
    locs = [locations] if isinstance(locations, (str, os.PathLike)) else list(locations)
    opened: list[TraceStore] = []
    try:
        for loc in locs:
            opened.append(_open(loc, storage_options))
        return opened[0] if len(opened) == 1 else StoreSet(opened)
    except BaseException:
        for s in opened:
            s.close()
        raise


def _open(location: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> TraceStore:
    if not storage_options:
        store = open_store(location)
    else:
        try:
            store = open_store(location, storage_options=storage_options)  # type: ignore[call-arg]
        except TypeError as exc:  # a store reader that reads paths only
            raise UsageError(f"{os.fspath(location)}: this tracediff's store reader takes no storage options "
                             f"(paths only); drop them") from exc
    try:
        store.require_complete()  # part of a trace would compare as a trace of fewer rows
    except BaseException:
        store.close()
        raise
    return store
