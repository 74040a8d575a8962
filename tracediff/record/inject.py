"""Activation of the recorder inside processes started by ``tracediff record -- CMD``.

``hooks/sitecustomize.py`` calls :func:`activate_from_env` in every Python process of the command's
tree (spawned multiprocessing children included: they inherit ``PYTHONPATH`` and ``TRACEDIFF_CONFIG``).
Activation must be cheap and harmless in processes that never use torch: it only installs a watcher
for the import of ``torch``. Once torch is imported, every ``nn.Module`` subclass whose MRO names a
watched class gets its ``__init__`` wrapped, so taps attach as soon as an instance is fully built.
The recorder itself is created lazily, at the first attach: processes that match nothing write nothing.
Nothing here may raise into the host: failures are logged and recording stays off.

Each process also leaves the ``record`` command a note in the folder ``TRACEDIFF_REPORT_DIR`` names
(on the command's machine, whatever the store's location), one small JSON file per process and kind,
``<pid>-<kind>.json``: ``recorder`` (its :meth:`~tracediff.record.recorder.Recorder.outcome`, at close),
``inject`` (why recording could not start or stopped: the store unreachable, a tap that could not
attach), ``shim`` (written by ``hooks/sitecustomize.py`` in an interpreter that cannot import
tracediff), ``ledger<n>`` (the recorder's row counts, which outlive a SIGKILL:
:mod:`tracediff.record.ledger`). :func:`recording_problems` reads them back: a run that lost rows
fails, never exits 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger("tracediff")
ENV_CONFIG = "TRACEDIFF_CONFIG"
ENV_DISABLE = "TRACEDIFF_DISABLE"
ENV_REPORT_DIR = "TRACEDIFF_REPORT_DIR"

_lock = threading.RLock()
_context: _Context | None = None


class _Context:
    """What one process records, from the JSON config the launcher put in the environment."""

    def __init__(self, config: dict[str, Any]) -> None:
        from tracediff.record.tapspec import TapSpec  # noqa: PLC0415

        self.config = config
        self.specs = [TapSpec.parse(s) for s in config.get("taps", [])]
        self.adapters = list(config.get("adapters", []))
        self.labels_from = list(config.get("labels_from", []))
        # Without --labels-from or a framework adapter (each labels its own rows), the outermost
        # module whose forward gets input_ids labels the rows (tracediff.adapters.label_sources).
        self.auto_labels = bool(self.specs) and not self.labels_from and not (set(self.adapters) - {"generic"})
        self.candidates: weakref.WeakSet[Any] = weakref.WeakSet()  # label sources built before the recorder
        self.tapped: weakref.WeakSet[Any] = weakref.WeakSet()  # modules a tap spec attached to
        self.recorder_obj: Any = None
        self.failed = False
        self.attached: list[str] = []
        self.control: Any = None  # the switch's endpoint (tracediff.record.control), once recording

    def watched_names(self) -> set[str]:
        from tracediff.adapters import load_adapter  # noqa: PLC0415

        names = {spec.cls for spec in self.specs} | set(self.labels_from)
        for name in self.adapters:
            names |= set(load_adapter(name).WATCH)
        return names

    def recorder(self) -> Any:
        if self.recorder_obj is None and not self.failed:
            from tracediff.record.recorder import Limits, Recorder  # noqa: PLC0415
            from tracediff.store import DEFAULT_CHUNK_ROWS  # noqa: PLC0415

            cfg = self.config
            limits = Limits.from_dict(cfg.get("limits"))
            rank = _env_int("RANK")
            _engine_cores_hints(self.adapters)  # before the writer thread starts and places itself
            self.recorder_obj = Recorder(
                cfg["store"],
                role=cfg.get("role", ""),
                append=True,
                rank=rank,
                world_size=_env_int("WORLD_SIZE"),
                limits=limits,
                on_full=cfg.get("on_full", "drop"),
                max_queue_bytes=int(cfg.get("max_queue_bytes", 1 << 30)),
                chunk_rows=int(cfg.get("chunk_rows", DEFAULT_CHUNK_ROWS)),
                compressor=cfg.get("compressor", "none"),
                durable=bool(cfg.get("durable", False)),
                adapter=",".join(self.adapters) or "generic",
                meta={"injected": True},
                storage_options=cfg.get("storage_options"),  # record -o URL --storage-option ...
                on_close=lambda rec: _note_for_record("recorder", rec.outcome()),
                ledger=_ledger(),
                row_model=cfg.get("row_model"),  # record --row-model: every tap that declares none
                draft_chain=bool(cfg.get("draft_chain")),  # record --draft-chain
                commit_interval=float(cfg.get("commit_interval") or 0.0),  # record --commit-interval
                **({"retry_seconds": float(cfg["retry_seconds"])} if cfg.get("retry_seconds") is not None else {}),
            )
            from tracediff.record.control import setup_switch  # noqa: PLC0415

            self.control = setup_switch(self.recorder_obj, cfg)  # record --start-off, --control-port, signals
            for spec in self.specs:
                self.recorder_obj.declare(spec.name, **_segment_kw(cfg, spec.name))
            for module in list(self.candidates):
                self.attach_automatic(module)
        return self.recorder_obj

    def attach_automatic(self, module: Any) -> None:
        """Make ``module`` an automatic label source once this process records (before that, only
        remember it: a process that records nothing gets no hook)."""
        if self.recorder_obj is None:
            self.candidates.add(module)
            return
        from tracediff.adapters.label_sources import attach_automatic_source  # noqa: PLC0415

        attach_automatic_source(self.recorder_obj, module, self.tapped, lambda: len(self.attached))

    def tap_attached(self, spec: Any, module: Any) -> None:
        self.attached.append(f"{spec.name} <- {type(module).__qualname__}")
        target = spec.resolve(module)
        if target is not None:
            self.tapped.add(target)

    def on_constructed(self, module: Any) -> None:
        """Called after the ``__init__`` of an instance of a watched class has finished."""
        if self.failed:
            return
        try:
            from tracediff.adapters import load_adapter  # noqa: PLC0415
            from tracediff.adapters.generic import attach_label_source, attach_spec  # noqa: PLC0415

            klass = type(module)
            for spec in self.specs:
                if spec.class_matches(klass):
                    rec = self.recorder()
                    if attach_spec(rec, spec, module):
                        self.tap_attached(spec, module)
                        log.info("tracediff: tap %s attached to %s (pid %d)", spec.name, spec.module_path, os.getpid())
                    else:
                        _attach_on_first_forward(self, spec, module)
            for name in self.labels_from:
                if any(_class_named(base, name) for base in klass.__mro__):
                    attach_label_source(self.recorder(), module, how="--labels-from")
            if self.auto_labels:
                from tracediff.adapters.label_sources import input_ids_slot  # noqa: PLC0415

                if input_ids_slot(klass) is not None:
                    self.attach_automatic(module)
            for name in self.adapters:
                adapter = load_adapter(name)
                watched = any(_class_named(base, w) for w in adapter.WATCH for base in klass.__mro__)
                if watched and adapter.attach(self.recorder(), module):
                    self.attached.append(f"{name} <- {klass.__qualname__}")
        except Exception as exc:  # noqa: BLE001
            self.failed = True
            log.error("tracediff: cannot attach taps in pid %d (recording off, the program goes on): %s: %s",
                      os.getpid(), type(exc).__name__, exc)
            _note_for_record("inject", {"error": f"cannot attach taps: {type(exc).__name__}: {exc}"})


def _ledger() -> Any:
    """This process's row ledger in the report folder (None outside `tracediff record`, or when the
    folder cannot take it: then a killed process's loss is not counted, and that is said)."""
    folder = os.environ.get(ENV_REPORT_DIR)
    if not folder:
        return None
    from tracediff.record.ledger import Ledger  # noqa: PLC0415

    try:
        return Ledger(folder)
    except (OSError, ValueError) as exc:
        log.error("tracediff: no row accounting in pid %d (%s): rows lost if this process is killed are not "
                  "counted", os.getpid(), exc)
        return None


def _engine_cores_hints(adapters: list[str]) -> None:
    """What each adapter knows of the cores its engine pinned (its registry entry's ``engine_cores``
    module), for the placement of the recorder's threads (:mod:`tracediff.record.cores`)."""
    import importlib  # noqa: PLC0415

    from tracediff.adapters import adapter_info  # noqa: PLC0415
    from tracediff.record.cores import add_engine_cores_hint  # noqa: PLC0415

    for name in adapters:
        try:
            module = adapter_info(name).engine_cores
            if module:
                add_engine_cores_hint(importlib.import_module(module).engine_cores)
        except Exception as exc:  # noqa: BLE001  (advice only: the threads are placed from their affinity)
            log.info("tracediff: adapter %s cannot say its engine's cores: %s", name, exc)


def _segment_kw(cfg: dict[str, Any], tap: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg.get("segment_size"):
        out["segment_size"] = int(cfg["segment_size"])
    if cfg.get("segment_labels"):
        out["segment_labels"] = list(cfg["segment_labels"])
    return out


def _attach_on_first_forward(ctx: _Context, spec: Any, module: Any) -> None:
    """The path did not exist when __init__ ended (set later): retry once, at the first forward."""
    from tracediff.adapters.generic import attach_spec  # noqa: PLC0415

    handle: Any = None

    def pre_hook(mod: Any, args: tuple) -> None:
        handle.remove()
        try:
            if attach_spec(ctx.recorder(), spec, mod):
                ctx.tap_attached(spec, mod)
            else:
                log.warning("tracediff: %s has no attribute path %s; tap %s not attached",
                            type(mod).__qualname__, ".".join(spec.path), spec.name)
        except Exception as exc:  # noqa: BLE001
            log.error("tracediff: attaching tap %s failed: %s", spec.name, exc)
            _note_for_record("inject", {"error": f"cannot attach tap {spec.name}: {type(exc).__name__}: {exc}"})

    handle = module.register_forward_pre_hook(pre_hook)


def _class_named(klass: type, name: str) -> bool:
    return name in (klass.__name__, klass.__qualname__, f"{klass.__module__}.{klass.__qualname__}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# ---------------------------------------------------------------------- class watching
def _wrap_class(klass: type, names: set[str], label_sources: bool = False) -> None:
    """Wrap ``klass.__init__`` when an instance may need taps: its MRO names a watched class or,
    with ``label_sources``, its forward takes ``input_ids`` (an automatic label source)."""
    if "_tracediff_wrapped" in klass.__dict__:
        return
    if not any(_class_named(base, n) for n in names for base in klass.__mro__) and not (
            label_sources and _label_source_class(klass)):
        return
    original = klass.__init__

    @functools.wraps(original)  # the wrapper takes the name __init__ from the original
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # Only the most derived class's wrapper acts: by then the instance is fully built.
        if type(self) is klass and _context is not None:
            _context.on_constructed(self)

    klass.__init__ = init  # type: ignore[misc]
    klass._tracediff_wrapped = True  # type: ignore[attr-defined]


def _label_source_class(klass: type) -> bool:
    from tracediff.adapters.label_sources import input_ids_slot  # noqa: PLC0415  (stdlib imports only)

    return input_ids_slot(klass) is not None


def _on_torch_imported() -> None:
    ctx = _context
    if ctx is None:
        return
    try:
        import torch  # noqa: PLC0415

        names = ctx.watched_names()
        auto = ctx.auto_labels
        module_cls = torch.nn.Module
        previous = module_cls.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:  # noqa: N807
            if previous is not None:
                previous.__func__(cls, **kwargs)
            else:
                super(module_cls, cls).__init_subclass__(**kwargs)
            try:
                _wrap_class(cls, names, auto)
            except Exception as exc:  # noqa: BLE001
                log.error("tracediff: cannot watch class %s: %s", cls.__qualname__, exc)

        module_cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        stack = [module_cls]
        while stack:
            klass = stack.pop()
            _wrap_class(klass, names, auto)
            stack.extend(klass.__subclasses__())
    except Exception as exc:  # noqa: BLE001
        ctx.failed = True
        log.error("tracediff: cannot watch torch modules (recording off, the program goes on): %s", exc)
        _note_for_record("inject", {"error": f"cannot watch torch modules: {type(exc).__name__}: {exc}"})


class _TorchImportWatcher:
    """A meta-path finder that runs a callback right after ``torch`` finishes importing."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            try:
                original(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # back to the class's method
            _remove_watcher()
            _on_torch_imported()

        loader.exec_module = exec_module
        return spec


_watcher = _TorchImportWatcher()


def _remove_watcher() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_watcher)


def activate(config: dict[str, Any]) -> None:
    """Start watching for the configured taps in this process."""
    global _context
    with _lock:
        if _context is not None:
            return
        _context = _Context(config)
        _setup_logging()
        if "torch" in sys.modules:
            _on_torch_imported()
        else:
            sys.meta_path.insert(0, _watcher)


def activate_from_env() -> None:
    """Entry point of the sitecustomize shim: never raises."""
    text = os.environ.get(ENV_CONFIG)
    if not text or os.environ.get(ENV_DISABLE):
        return
    try:
        config = json.loads(text)
        if not isinstance(config, dict) or "store" not in config:
            raise ValueError("config is not an object with a 'store'")
        activate(config)
    except Exception as exc:  # noqa: BLE001
        print(f"tracediff: ignoring {ENV_CONFIG} in pid {os.getpid()}: {exc}", file=sys.stderr)


def _setup_logging() -> None:
    level = os.environ.get("TRACEDIFF_LOG", "WARNING").upper()
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(getattr(logging, level, logging.WARNING))


def current_config() -> dict[str, Any]:
    """This process's activation config (``{}`` when inactive): adapters read their options here."""
    ctx = _context
    return dict(ctx.config) if ctx is not None else {}


def context_summary() -> dict[str, Any]:
    """What this process attached (for tests and logs)."""
    ctx = _context
    if ctx is None:
        return {}
    return {"attached": list(ctx.attached), "failed": ctx.failed}


# ---------------------------------------------------------------------- notes for `record`
def _note_for_record(kind: str, note: dict[str, Any]) -> None:
    """Leave the ``record`` command that started this process a note (see the module docstring);
    written whole (a temporary file renamed into place), never raises."""
    folder = os.environ.get(ENV_REPORT_DIR)
    if not folder:
        return
    path = os.path.join(folder, f"{os.getpid()}-{kind}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump({"pid": os.getpid(), "executable": sys.executable, **note}, fh, default=str)
        os.replace(path + ".tmp", path)
    except (OSError, TypeError, ValueError) as exc:
        log.error("tracediff: cannot tell `tracediff record` how this process recorded (%s)", exc)


def read_notes(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every note the processes of a recorded command left in ``folder``, each with its ``kind``;
    a row ledger (kind ``ledger``) with its counts read in, as ``counts``."""
    from pathlib import Path  # noqa: PLC0415

    from tracediff.record.ledger import read_ledger  # noqa: PLC0415

    notes = []
    for path in sorted(Path(folder).glob("*-*.json")):
        try:
            note = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(note, dict):
            note["kind"] = path.stem.split("-", 1)[1]
            if note["kind"].startswith("ledger"):
                note["kind"], note["counts"] = "ledger", read_ledger(note, folder)
            notes.append(note)
    return notes


KILLED_ADVICE = "let the command's processes exit normally, so that each recorder closes and writes what it holds"


def recording_problems(notes: list[dict[str, Any]], store_rows: dict[str, int] | None = None,
                       on_full: str = "drop", killed_advice: str = KILLED_ADVICE) -> list[str]:
    """One line per way the recorded command lost rows: an interpreter that could not import
    tracediff (once per interpreter, only where the process imported torch or did not end normally:
    one that never imported torch had nothing to record), recording that could not start, every
    writer group that stopped on an error, every tap that dropped rows because its writer fell behind
    (``on_full``: the run's ``--on-full``, for the advice), and every tap of a process that ended
    before its writer had committed what it had queued (a SIGKILL: its row ledger says how many).
    ``store_rows``: the rows each writer group (``fc_in/pid123``) committed, from the store's commit
    records (the truth where a process died between a commit and its count); else the ledgers' own.
    ``killed_advice``: what avoids the last kind (an adapter knows its engine's flag)."""
    out: list[str] = []
    lacking: dict[str, list[int]] = {}
    outcomes: dict[Any, dict[str, Any]] = {}
    for note in notes:
        if note.get("kind") == "recorder":
            outcomes[note.get("pid")] = note
    ledgers: dict[tuple[Any, str], dict[str, Any]] = {}
    for note in notes:
        if note.get("kind") == "ledger":
            for tap, counts in (note.get("counts") or {}).items():
                ledgers[(note.get("pid"), tap)] = counts
    for note in notes:
        kind, pid = note.get("kind"), note.get("pid")
        if kind == "shim":
            if note.get("torch") is False:
                continue
            if note.get("missing"):
                lacking.setdefault(str(note.get("executable")), []).append(int(pid or 0))
            else:
                out.append(f"pid {pid} ({note.get('executable')}): recording could not start: {note.get('error')}")
        elif kind == "inject":
            out.append(f"pid {pid}: recording could not start: {note.get('error')}")
        elif kind == "recorder":
            for tap, info in (note.get("taps") or {}).items():
                # A tap that saw no row before its recorder stopped lost nothing.
                if info.get("error") and (info.get("group") or info.get("dropped_rows")):
                    out.append(
                        f"{info.get('group') or tap} (pid {pid}): recording stopped after {info.get('rows', 0)} "
                        f"committed rows, {info.get('dropped_rows', 0)} rows lost: {info['error']}"
                    )
                elif info.get("dropped_rows") and (pid, tap) not in ledgers:
                    out.append(_drop_line(info.get("group") or tap, pid, info, None, on_full))
        elif kind == "ledger":
            for tap, counts in (note.get("counts") or {}).items():
                info = ((outcomes.get(pid) or {}).get("taps") or {}).get(tap) or {}
                if info.get("error") and (info.get("group") or info.get("dropped_rows")):
                    continue  # said above, with the error
                out.extend(_ledger_lines(tap, pid, counts, info, store_rows, on_full, killed_advice))
    for exe, pids in lacking.items():
        who = f"pid {pids[0]}" if len(pids) == 1 else f"{len(pids)} processes (pids {', '.join(map(str, pids[:5]))})"
        out.insert(
            0,
            f"{exe} ({who}) cannot import tracediff, so nothing was recorded in it: install tracediff into "
            f"that interpreter ({exe} -m pip install tracediff) and record with `{exe} -m tracediff record ...`",
        )
    return out


def _drop_line(group: str, pid: Any, info: dict[str, Any], offered: int | None, on_full: str) -> str:
    """A tap that dropped rows: how many and why; when its writer fell behind, the flag."""
    dropped = int(info.get("dropped_rows") or 0)
    of = f" of {offered:,}" if offered else ""
    why = info.get("drop_reason") or ""
    if not why.startswith("the queue"):  # not the writer's pace: an error, an adapter that could not take them
        return f"{group} (pid {pid}): {dropped:,}{of} rows lost, not recorded: {why or 'no reason was recorded'}"
    fix = ("a larger --queue-bytes, or fewer rows (--every-n-steps, --phases)" if on_full == "block" else
           "--on-full block (the host then waits for the writer, a bounded time per batch) or a larger "
           "--queue-bytes")
    return (f"{group} (pid {pid}): {dropped:,}{of} rows dropped, not recorded: the writer fell behind ({why}, "
            f"--on-full {on_full}); rerun with {fix}")


def _ledger_lines(tap: str, pid: Any, counts: dict[str, Any], info: dict[str, Any],
                  store_rows: dict[str, int] | None, on_full: str, killed_advice: str) -> list[str]:
    """What one tap of one process lost, from its row ledger (and its outcome, when it closed)."""
    group = counts.get("group") or info.get("group")
    if store_rows is not None and group in store_rows:
        committed = int(store_rows[group])
    else:
        committed = int(info.get("rows", counts.get("committed", 0)) if info else counts.get("committed", 0))
    offered, skipped = int(counts.get("offered", 0)), int(counts.get("skipped", 0))
    dropped = max(int(counts.get("dropped", 0)), int(info.get("dropped_rows") or 0))
    unsettled = offered - skipped - committed - dropped
    name = group or tap
    parts = []
    if dropped:
        reason = info.get("drop_reason") or counts.get("reason") or ""
        parts.append(_drop_line(name, pid, dict(info, dropped_rows=dropped, drop_reason=reason), offered, on_full))
    if unsettled > 0:
        parts.append(
            f"{name} (pid {pid}): {unsettled:,} of {offered:,} rows were taken but never committed: the process "
            f"ended before its writer had written them "
            f"({'killed before it closed its recorder' if not info else 'its writer was behind'}); {killed_advice}")
    return parts
