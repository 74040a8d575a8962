"""What the serving-engine adapters (SGLang, vLLM) share: which ranks record, the engine's plugin
entry point, and reading the server's command line. No framework import here."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("tracediff")


class CaptureState:
    """What an adapter's hooks share in one process: the capture points (attached hooks, calls, rows,
    the reason a point stopped), one-time log messages, the engine step counter."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.step = -1
        self.points: dict[str, dict[str, Any]] = {}  # capture point -> {"attached", "calls", "rows", "skipped"}
        self.logged: set[str] = set()
        self.exit_hook = False

    def point(self, name: str) -> dict[str, Any]:
        return self.points.setdefault(name, {"attached": 0, "calls": 0, "rows": 0, "skipped": None})

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per capture point of this process: attached hooks, calls, rows, skip reason (an adapter's
        ``capture_summary``)."""
        return {name: dict(info) for name, info in self.points.items()}

    def log_once(self, key: str, level: int, fmt: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            log.log(level, fmt, *args)

    def skip(self, point: str, reason: str, message: str, *args: Any) -> None:
        """Stop recording one capture point in this process (the engine's internals moved, or a bug):
        ``message % args`` once; the engine goes on."""
        info = self.point(point)
        if info["skipped"] is None:
            info["skipped"] = reason
            log.warning(message, *args)


def all_ranks_requested(env_name: str) -> bool:
    """``tracediff record --all-ranks`` (this process's activation config) or ``env_name`` set."""
    try:
        from tracediff.record.inject import current_config  # noqa: PLC0415

        if current_config().get("all_ranks"):
            return True
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get(env_name, "") not in ("", "0", "false", "False")


def claim_rank(recorder: Any, rank: int | None, size: int | None, prefix: str) -> None:
    """Give a recorder its parallel rank (and a writer name saying it) before it wrote anything."""
    if recorder.rank is None and rank is not None:
        recorder.rank, recorder.world_size = rank, size
        if not recorder.stats() or all(s["rows"] == 0 for s in recorder.stats().values()):
            recorder.writer_name = f"{prefix}{rank}-pid{os.getpid()}"


def command_flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` of a server command line."""
    def is_flag(arg: str) -> bool:
        return arg.startswith("-") and not arg[1:2].isdigit()  # "-1" is a value (a layer id), not a flag

    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if is_flag(arg):
            name, eq, value = arg.partition("=")
            if eq:
                out[name] = value
            else:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                out[name] = nxt if nxt is not None and not is_flag(nxt) else None
    return out


def activate_from_plugin(adapter: str, framework: str, version: str, store_env: str, all_ranks_env: str) -> None:
    """Body of an engine's plugin entry point: record into ``$store_env`` (created on first use) with
    ``adapter``. A no-op without ``store_env``, and under ``tracediff record`` (it activates itself).
    Never raises."""
    store = os.environ.get(store_env)
    if not store or os.environ.get("TRACEDIFF_CONFIG") or os.environ.get("TRACEDIFF_DISABLE"):
        return
    try:
        from tracediff.errors import StoreExistsError  # noqa: PLC0415
        from tracediff.record.inject import activate  # noqa: PLC0415
        from tracediff.store import create_store, default_source  # noqa: PLC0415
        from tracediff.store.location import is_url  # noqa: PLC0415

        remote = is_url(store) and not store.startswith("file://")  # s3://...: credentials from the environment
        path = store if remote else os.path.abspath(store.removeprefix("file://"))
        if remote or not os.path.isfile(os.path.join(path, "zarr.json")):
            source = default_source("server", framework, version)
            source["argv"] = list(sys.argv)
            source["recorded_by"] = [f"{framework} plugin", store_env]
            # Another process of this server may have created it first (join: kept as it is).
            with contextlib.suppress(StoreExistsError, FileExistsError):
                create_store(path, role="server", source=source, meta={"record": {"adapters": [adapter]}}, join=True)
        activate({"store": path, "role": "server", "adapters": [adapter],
                  "all_ranks": all_ranks_requested(all_ranks_env)})
    except Exception as exc:  # noqa: BLE001
        log.error("tracediff: %s plugin: recording off in pid %d (%s: %s); the server goes on",
                  framework, os.getpid(), type(exc).__name__, exc)
