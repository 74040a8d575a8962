"""The store a ``record --overwrite`` run replaces, kept until the new run has committed a row.

``record --overwrite -o it.zarr`` renames the store there to the sibling ``it.zarr.previous`` (one
rename in one folder: atomic, so a SIGKILL of ``record`` at any point leaves the old rows on disk
under one of the two names), records into ``it.zarr``, and deletes the sibling only once a writer
group of the new store has committed a row (:func:`has_committed_row`, polled by
:class:`PreviousStore`'s watcher thread while the command runs). A run that commits none gets the
old store back at its path. A sibling left by an interrupted run is never overwritten.

Local folders only: object storage has no atomic rename, and copying a store aside costs as much as
the store (a URL's old store is deleted before the command starts, as ``record --help`` says).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

from tracediff.errors import StoreExistsError, StoreWriteError
from tracediff.store.writer import as_good_as_empty, check_replaceable, looks_like_trace_store

log = logging.getLogger("tracediff")
SUFFIX = ".previous"
POLL_SECONDS = 0.5


def has_committed_row(path: Path) -> bool:
    """Whether any writer group of the store at ``path`` has committed a row: its ``zarr.json``
    commit record (the count readers trust, written last) says ``rows`` > 0. Reads only the writer
    groups' small documents: cheap enough to poll while a recording runs."""
    for doc_path in path.glob("*/*/zarr.json"):
        try:
            doc = json.loads(doc_path.read_text())
            rows = doc["attributes"]["commit"]["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being created, or not a writer group
        if isinstance(rows, int) and rows > 0:
            return True
    return False


def _remove_abandoned_deletions(path: Path) -> None:
    """Finish what a killed run started: a ``.<name>.previous.deleting-PID`` folder whose process is
    gone is an old store already given up (renamed there to be deleted), never one a user was told
    to look at."""
    for doomed in path.parent.glob(f".{path.name}{SUFFIX}.deleting-*"):
        pid = doomed.name.rpartition("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class PreviousStore:
    """The old store of ``path``, set aside at ``path.previous`` (see the module docstring)."""

    def __init__(self, path: Path, aside: Path) -> None:
        self.path = path
        self.aside = aside
        self.outcome = "kept aside"  # then "deleted" or "restored"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @classmethod
    def set_aside(cls, path: str | os.PathLike[str]) -> PreviousStore | None:
        """Rename the trace store at ``path`` to its sibling ``<name>.previous`` and return it;
        None when there is no store to keep (nothing there, or a folder holding nothing but zarr's
        temporary files). Refuses what is not a trace store (never moved) and a sibling already
        there (the store an interrupted run kept: never overwritten)."""
        path = Path(path)
        _remove_abandoned_deletions(path)
        if not os.path.lexists(path):
            return None
        check_replaceable(path, overwrite=True)
        if not looks_like_trace_store(path):  # zarr's temporary files only: nothing to keep
            return None
        aside = path.with_name(path.name + SUFFIX)
        if os.path.lexists(aside):
            raise StoreExistsError(
                f"{aside}: holds the store an interrupted `record --overwrite` of {path} kept aside; "
                f"compare or move it, delete the one you do not need, then rerun"
            )
        try:
            os.rename(path, aside)
        except OSError as exc:
            raise StoreWriteError(f"{path}: cannot move the previous store aside to {aside}: {exc.strerror or exc}") from exc
        return cls(path, aside)

    # -- while the command runs ------------------------------------------------------------------
    def watch(self) -> None:
        """Start the thread that deletes the old store once the new one has committed a row."""
        self._watcher = threading.Thread(target=self._watch, name="tracediff-previous-store", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            if has_committed_row(self.path):
                self._delete()
                return

    def _delete(self) -> None:
        with self._lock:
            if self.outcome != "kept aside":
                return
            # Renamed first: a kill during the deletion leaves a hidden, half-deleted folder, never
            # a half-deleted store under the name the user was told holds the old recording.
            doomed = self.aside.with_name(f".{self.aside.name}.deleting-{os.getpid()}")
            try:
                os.rename(self.aside, doomed)
            except OSError:
                return  # the user moved it meanwhile: theirs now
            shutil.rmtree(doomed, ignore_errors=True)
            self.outcome = "deleted"

    # -- once the command has ended ----------------------------------------------------------------
    def settle(self) -> str:
        """Stop watching, then delete the old store if the new one holds a committed row, else put
        the old one back at ``path`` (removing the new, rowless store). Idempotent; returns the
        outcome: ``deleted``, ``restored``, or ``kept aside`` (the path holds something that is not
        a rowless trace store now: the old store stays at ``aside``)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.outcome != "kept aside":
            return self.outcome
        if has_committed_row(self.path):
            self._delete()
            return self.outcome
        with self._lock:
            if os.path.lexists(self.path):
                if not (self.path.is_dir() and (looks_like_trace_store(self.path) or as_good_as_empty(self.path))):
                    return self.outcome
                shutil.rmtree(self.path)
            try:
                os.rename(self.aside, self.path)
            except OSError:
                return self.outcome
            self.outcome = "restored"
        return self.outcome

    def settle_and_say(self) -> None:
        """:meth:`settle`, from a recorder's close: what became of the old store said in the log,
        never raised (the host goes on; the old rows are at one of the two names)."""
        try:
            outcome = self.settle()
        except OSError as exc:
            log.error("tracediff: could not settle the previous store %s: %s", self.aside, exc)
            return
        if outcome == "restored":
            log.warning("tracediff: this run committed no row: the previous store is back at %s", self.path)
        elif outcome == "kept aside":
            log.warning("tracediff: the previous store stays at %s (%s now holds something else)", self.aside, self.path)
