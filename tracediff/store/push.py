"""Uploading a local store to object storage (``tracediff push LOCAL URL``), with the commit
protocol of :mod:`tracediff.store`: committed rows only, every chunk object before the metadata
that covers it, every writer group's commit record last.

The root ``zarr.json`` goes first: it names the recording (its ``source``), so a second push after
a crash knows the objects already there are this store's, skips every chunk object already
present with the right size, and writes the metadata and commit records again. Until a writer
group's commit record is written, readers skip the group (a folder without its ``zarr.json``), so
a push killed at any point leaves a store that opens with the strict reader and shows only groups
that are complete. The first root also carries a ``push`` attribute (``status: uploading``, where
from): the store's own root, without it, is written last. A push that stopped in between leaves a
store that says so: ``inspect`` shows it incomplete and ``compare`` refuses it, naming the push to
rerun (an incomplete store is no trace of fewer rows).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracediff.errors import NotATraceStoreError, StoreExistsError, StoreWriteError, UsageError
from tracediff.store.format import LABEL_FIELDS, MAX_METADATA_BYTES, now_iso
from tracediff.store.location import FETCH_CONCURRENCY, Location, remote_error
from tracediff.store.reader import TraceStore


@dataclass
class PushResult:
    """What one push did; ``groups`` maps ``tap/writer`` to the committed rows now at ``url``."""

    url: str
    uploaded: int = 0
    skipped: int = 0
    bytes: int = 0
    seconds: float = 0.0
    groups: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        rows = sum(self.groups.values())
        return (
            f"pushed {rows} committed rows in {len(self.groups)} writer group(s) to {self.url}: {self.uploaded} "
            f"objects ({self.bytes / 2**20:.1f} MiB) uploaded, {self.skipped} already there, in {self.seconds:.1f}s"
        )


def push_store(
    src: str | os.PathLike[str],
    dest: str | Location,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    stage: Callable[[str, int | None, int | None], None] | None = None,
) -> PushResult:
    """Upload the committed rows of local store folder ``src`` to URL ``dest``; resumable.

    ``dest`` may already hold this store (an earlier, interrupted or older push): objects present
    with the right size are kept. Another store there is refused unless ``overwrite``. The result
    is checked by opening ``dest`` with the strict reader. Progress, for the CLI's status line:
    ``stage(name, total_bytes, total_objects)`` as each step begins (totals None where unknown), and
    ``progress(bytes, objects)`` as objects land.
    """
    started = time.perf_counter()
    step = stage or (lambda name, total, objects: None)
    loc = Location.of(dest, None if storage_options is None else dict(storage_options))
    if not loc.remote:
        raise UsageError(f"{loc.display}: push uploads to a URL (s3://..., gs://...); to copy a folder use cp -r")
    with TraceStore(src) as local:
        if local.location.remote or local._zipfile is not None:
            raise UsageError(f"{local.path}: push takes a local store folder")
        plan = _plan(local)
        result = PushResult(url=loc.display, groups={f"{g['tap']}/{g['writer']}": g["rows"] for g in plan["groups"]})
        step(f"listing {loc.display}", None, None)
        present = _prepare_destination(loc, local, overwrite)
        base = os.fspath(local.path)
        keys = [key for g in plan["groups"] for key in g["chunks"]]
        todo = [(k, p, os.path.getsize(p)) for k, p in ((k, os.path.join(base, *k.split("/"))) for k in keys)]
        fresh = [(k, p, n) for k, p, n in todo if present.get(k) != n]
        result.skipped = len(todo) - len(fresh)
        marked = _marked_root(plan["root"], os.path.abspath(base))
        first = [("zarr.json", marked)] + [(f"{tap}/zarr.json", doc) for tap, doc in plan["taps"]]
        arrays = [doc for g in plan["groups"] for doc in g["arrays"]]
        commits = [g["commit"] for g in plan["groups"]]
        last = [("zarr.json", plan["root"])]  # the store's own root: complete
        docs = first + arrays + commits + last
        step("uploading", sum(n for _, _, n in fresh) + sum(len(b) for _, b in docs), len(fresh) + len(docs))

        def put_docs(batch: list[tuple[str, bytes]]) -> None:
            _put_bytes(loc, batch, progress)
            result.uploaded += len(batch)
            result.bytes += sum(len(b) for _, b in batch)

        put_docs(first)
        _put_files(loc, fresh, progress)
        result.uploaded += len(fresh)
        result.bytes += sum(n for _, _, n in fresh)
        put_docs(arrays)
        put_docs(commits)
        put_docs(last)
    step("checking the upload", None, None)
    with TraceStore(loc) as remote:  # the strict reader: every check a local store gets
        got = {f"{s.tap}/{s.writer}": s.rows for streams in remote.streams.values() for s in streams}
    for group, rows in result.groups.items():
        if got.get(group) != rows:
            raise StoreWriteError(
                f"{loc.display}/{group}: holds {got.get(group)} committed rows after the push, expected {rows}; "
                "push again (it resumes)"
            )
    result.seconds = time.perf_counter() - started
    return result


def _plan(local: TraceStore) -> dict[str, Any]:
    """The objects to upload, from the store as opened (one consistent snapshot of every commit
    record, whatever a live writer commits meanwhile): chunk keys of committed rows, array
    metadata with the committed shape, the commit records."""
    root = local._read_bytes("zarr.json", MAX_METADATA_BYTES)
    assert root is not None
    taps, groups = [], []
    for tap in local.taps:
        doc = local._read_bytes(f"{tap}/zarr.json", MAX_METADATA_BYTES)
        assert doc is not None
        taps.append((tap, doc))
        for stream in local.streams[tap]:
            key = f"{tap}/{stream.writer}"
            chunks: list[str] = []
            arrays: list[tuple[str, bytes]] = []
            for name in ("values", *LABEL_FIELDS):
                array_doc = local._node_doc(f"{key}/{name}")
                assert array_doc is not None
                chunk_rows = int(array_doc["chunk_grid"]["configuration"]["chunk_shape"][0])
                suffix = "/0" * (len(array_doc["shape"]) - 1)
                chunks += [f"{key}/{name}/c/{i}{suffix}" for i in range(math.ceil(stream.rows / chunk_rows))]
                # shapes say the committed rows: rows a killed batch wrote past them stay local
                array_doc["shape"] = [stream.rows, *array_doc["shape"][1:]]
                arrays.append((f"{key}/{name}/zarr.json", json.dumps(array_doc, indent=2).encode()))
            group_doc = local._node_doc(key)
            assert group_doc is not None
            group_doc["attributes"] = stream.attrs  # the commit record as read, matching the chunks
            groups.append(
                {
                    "tap": tap,
                    "writer": stream.writer,
                    "rows": stream.rows,
                    "chunks": chunks,
                    "arrays": arrays,
                    "commit": (f"{key}/zarr.json", json.dumps(group_doc, indent=2).encode()),
                }
            )
    return {"root": root, "taps": taps, "groups": groups}


def _marked_root(root: bytes, src: str) -> bytes:
    """The local root ``zarr.json`` with a ``push`` attribute saying a push from ``src`` is under
    way: what the URL holds until the push's last write replaces it by ``root`` itself."""
    doc = json.loads(root)
    doc.setdefault("attributes", {})["push"] = {
        "status": "uploading",
        "from": src,
        "host": socket.gethostname(),
        "started": now_iso(),
    }
    return json.dumps(doc, indent=2).encode()


def _prepare_destination(loc: Location, local: TraceStore, overwrite: bool) -> dict[str, int]:
    """The objects already at ``loc`` (key -> size) that a resumed push may keep; refuses (or with
    ``overwrite`` deletes) anything that is not this store."""
    present = loc.list_sizes("")
    if not present:
        return present
    same = False
    if "zarr.json" in present:
        try:
            with TraceStore(loc) as there:
                same = bool(there.source) and there.source == local.source
        except (NotATraceStoreError, ValueError):
            same = False
    if same:
        return present
    if not overwrite:
        what = "another trace store" if "zarr.json" in present else f"{len(present)} objects that are no trace store"
        raise StoreExistsError(f"{loc.display}: holds {what}; choose another URL or pass --overwrite to replace it")
    loc.delete_all()
    return {}


def _run(loc: Location, coroutines: list[Callable[[], Any]], what: list[str], sizes: list[int],
         progress: Callable[[int, int], None] | None) -> None:
    """Run upload coroutines (FETCH_CONCURRENCY at a time) on the filesystem's loop, telling
    ``progress`` each object's bytes as it lands; the first failure, after all have finished, is
    raised as one line naming its object."""
    from fsspec.asyn import sync  # noqa: PLC0415

    async def run_all() -> list[Any]:
        gate = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def one(make: Callable[[], Any], size: int) -> Any:
            async with gate:
                try:
                    done = await make()
                except Exception as exc:  # noqa: BLE001
                    return exc
            if progress is not None:
                progress(size, 1)
            return done

        return await asyncio.gather(*(one(m, n) for m, n in zip(coroutines, sizes, strict=True)))

    for key, outcome in zip(what, sync(loc.fs.loop, run_all), strict=True):
        if isinstance(outcome, BaseException):
            raise remote_error(loc.where(key), outcome, "written") from outcome


def _put_files(loc: Location, files: list[tuple[str, str, int]], progress: Callable[[int, int], None] | None) -> None:
    fs = loc.fs
    for lo in range(0, len(files), 256):  # 256 coroutines made at a time, FETCH_CONCURRENCY in flight
        batch = files[lo : lo + 256]
        _run(loc, [_bind(fs._put_file, path, loc.object_path(key)) for key, path, _ in batch],
             [k for k, _, _ in batch], [n for _, _, n in batch], progress)


def _put_bytes(loc: Location, docs: list[tuple[str, bytes]], progress: Callable[[int, int], None] | None) -> None:
    if docs:
        _run(loc, [_bind(loc.fs._pipe_file, loc.object_path(key), data) for key, data in docs],
             [k for k, _ in docs], [len(b) for _, b in docs], progress)


def _bind(func: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: func(*args)


__all__ = ["PushResult", "push_store"]
