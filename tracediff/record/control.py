"""The switch's controls inside a recording process: an HTTP endpoint on 127.0.0.1, SIGUSR1 / SIGUSR2,
and ``record --start-off`` (:func:`setup_switch`, called where ``tracediff record -- CMD`` creates a
process's recorder).

The endpoint (:func:`serve`): ``GET /status``, ``POST /on``, ``POST /off``, each answered with JSON
(the recorder's :meth:`~tracediff.record.switch.Switchable.switch_status`, plus ``pid`` and ``url``).
It listens on 127.0.0.1 only, in one daemon thread placed off the engine's cores, handles one request
at a time with a socket timeout, reads no request body past :data:`MAX_BODY` bytes (and needs none),
parses nothing but the request line and headers, and stops when the recorder closes. Each endpoint
is written into the store, ``STORE/_control/<writer>.json`` (``url``, ``pid``, ``host``, ``writer``,
``started``; removed when the recorder closes), where ``tracediff control STORE`` finds every
recording process of a run (several TP ranks: one file each). ``_`` starts no tap name: the file
never shadows a tap.

What this module must never do: stall or crash the host (a failure to listen or to write the file
is one log line, the recording goes on), or replace a signal handler the host installed (a Python
one is chained: ours runs, then theirs; one installed outside Python, or SIG_IGN, is left alone and
that is said once).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

from tracediff.record.cores import place_this_thread

log = logging.getLogger("tracediff")

CONTROL_DIR = "_control"
MAX_BODY = 1024
REQUEST_TIMEOUT = 2.0  # seconds a client may take to send its request
SIGNALS = {"SIGUSR1": True, "SIGUSR2": False}  # the signal's name -> the state it switches to


class _Handler(BaseHTTPRequestHandler):
    server: _ControlServer
    timeout = REQUEST_TIMEOUT
    server_version = "tracediff-control"
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        if self.path.split("?")[0] == "/status":
            self._reply(200, self.server.status())
        else:
            self._reply(404, {"error": f"no such endpoint {self.path[:60]!r}: GET /status, POST /on, POST /off"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._reply(413, {"error": f"a request body of at most {MAX_BODY} bytes (none is needed)"})
            return
        if length:
            self.rfile.read(length)  # (ignored: the path says what to do)
        action = self.path.split("?")[0].strip("/")
        if action not in ("on", "off"):
            self._reply(404, {"error": f"no such endpoint {self.path[:60]!r}: GET /status, POST /on, POST /off"})
            return
        recorder = self.server.recorder
        if recorder.closed:
            self._reply(409, {"error": "the recorder is closed", **self.server.status()})
            return
        changed = recorder.switch(action == "on", by=f"http {self.client_address[0]}")
        self._reply(200, {"changed": changed, **self.server.status()})

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's signature)
        pass  # the host's stderr is not ours to fill


class _ControlServer(HTTPServer):
    def __init__(self, recorder: Any, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.recorder = recorder
        self.timeout = 0.25  # handle_request's wait: how soon the loop sees the recorder closed
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def status(self) -> dict[str, Any]:
        return {**self.recorder.switch_status(), "pid": os.getpid(), "url": self.url}

    def handle_error(self, request: Any, client_address: Any) -> None:
        # (socketserver prints a traceback to stderr: the host's stderr is not ours to fill)
        log.info("tracediff: the control endpoint %s failed a request from %s", self.url, client_address)


class Control:
    """One recorder's endpoint: the server, its thread and its file in the store."""

    def __init__(self, recorder: Any, port: int = 0) -> None:
        try:
            self.server = _ControlServer(recorder, port)
        except OSError as exc:
            if not port:
                raise
            # Several processes of one run (TP ranks) given one port: the first takes it, the others
            # an ephemeral one; `tracediff control STORE` finds each in the store.
            log.warning("tracediff: control port %d is taken (%s): pid %d listens on an ephemeral port",
                        port, exc.strerror or exc, os.getpid())
            self.server = _ControlServer(recorder, 0)
        self.recorder = recorder
        self.url = self.server.url
        self.file: Path | None = None
        self.thread = threading.Thread(target=self._serve, name="tracediff-control", daemon=True)
        self.thread.start()
        self._write_file()
        recorder.on_switch_close(self._remove_file)  # at close, not when this thread next looks

    def _serve(self) -> None:
        place_this_thread("control")
        try:
            while not self.recorder.closed:
                self.server.handle_request()
        except Exception as exc:  # noqa: BLE001  (the endpoint is a convenience: the recording goes on)
            log.error("tracediff: the control endpoint %s stopped: %s", self.url, exc)
        finally:
            self.server.server_close()
            self._remove_file()

    def _write_file(self) -> None:
        location = self.recorder.location
        if location.remote:
            log.warning("tracediff: the control endpoint of pid %d is %s (`tracediff control STORE` finds endpoints "
                        "in local stores only: give it this URL)", os.getpid(), self.url)
            return
        folder = Path(location.local) / CONTROL_DIR
        note = {"url": self.url, "pid": os.getpid(), "host": socket.gethostname(),
                "writer": self.recorder.writer_name, "started": self.recorder.switch_history()[0]["time"]}
        path = folder / f"{self.recorder.writer_name}.json"
        try:
            folder.mkdir(exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(note))
            os.replace(tmp, path)
            self.file = path
        except OSError as exc:
            log.error("tracediff: cannot write the control endpoint into %s (%s): it is %s", path, exc, self.url)

    def _remove_file(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.unlink()


def serve(recorder: Any, port: int = 0) -> Control:
    """Start ``recorder``'s control endpoint on 127.0.0.1:``port`` (0: an ephemeral port; a taken
    port: an ephemeral one, said in the log); it stops when the recorder closes. Raises OSError when
    no port can be had."""
    return Control(recorder, int(port))


def install_signals(recorder: Any) -> list[str]:
    """SIGUSR1 switches ``recorder`` on, SIGUSR2 off, where this is the main thread and the host left
    the signal to us (its default) or installed a Python handler (chained: ours, then theirs).
    Returns the signals it handles; the others are said once in the log."""
    if threading.current_thread() is not threading.main_thread():
        log.info("tracediff: pid %d records outside its main thread: SIGUSR1/SIGUSR2 do not switch it (use the "
                 "control endpoint)", os.getpid())
        return []
    done = []
    for name, on in SIGNALS.items():
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            previous = signal.getsignal(signum)
            if previous is None or previous == signal.SIG_IGN:
                log.warning("tracediff: pid %d's host handles %s itself (%s): it does not switch recording here",
                            os.getpid(), name, "outside Python" if previous is None else "ignored")
                continue
            signal.signal(signum, _handler(recorder, on, name, previous if callable(previous) else None))
            done.append(name)
        except (ValueError, OSError) as exc:
            log.warning("tracediff: cannot handle %s in pid %d: %s", name, os.getpid(), exc)
    return done


def _handler(recorder: Any, on: bool, name: str, chained: Any) -> Any:
    def handle(signum: int, frame: Any) -> None:
        recorder.switch(on, by=name)  # one assignment: safe in a handler (no I/O, no lock the host holds)
        if chained is not None:
            chained(signum, frame)

    return handle


def setup_switch(recorder: Any, config: dict[str, Any]) -> Control | None:
    """What ``tracediff record``'s switch options ask of a process's new recorder: ``start_off``
    (begin off), ``control_port`` (an endpoint; None: none), and the signals. Never raises."""
    control = None
    try:
        if config.get("start_off"):
            recorder.start_off()
        install_signals(recorder)
        if config.get("control_port") is not None:
            control = serve(recorder, int(config["control_port"]))
    except Exception as exc:  # noqa: BLE001
        log.error("tracediff: the recording switch of pid %d has no endpoint (%s); recording goes on", os.getpid(), exc)
    return control


# ---------------------------------------------------------------------- the client (`tracediff control`)
MAX_ANSWER = 1 << 16  # bytes of an answer read at most
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def find_endpoints(store: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The control endpoints the recording processes of ``store`` (a local folder) wrote into it, each
    ``{url, pid, host, writer, started, file}``, plus ``ended: True`` for one whose process (on this
    host) is gone. Raises UsageError naming the store when it is no trace store or holds no endpoint."""
    from tracediff.errors import UsageError  # noqa: PLC0415

    folder = Path(store)
    if not (folder / "zarr.json").is_file():
        raise UsageError(f"{folder}: no trace store there (give a local store that is recording, or the endpoint's "
                         f"URL http://127.0.0.1:PORT)")
    found = []
    for path in sorted((folder / CONTROL_DIR).glob("*.json")):
        try:
            with open(path, "rb") as fh:
                note = json.loads(fh.read(MAX_BODY * 4))  # an endpoint's note is small: no more is read
        except (OSError, ValueError):
            continue
        if not isinstance(note, dict) or not isinstance(note.get("url"), str):
            continue  # (text from a store is data: anything else is not an endpoint)
        note["file"] = str(path)
        note["ended"] = note.get("host") == socket.gethostname() and not _alive(note.get("pid"))
        found.append(note)
    if not found:
        raise UsageError(f"{folder}/{CONTROL_DIR}: no recording process of this store has a control endpoint (record "
                         f"with --control-port 0 to open one in each recording process)")
    return found


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def ask(url: str, action: str, timeout: float = 5.0) -> dict[str, Any]:
    """``status`` (GET /status), ``on`` or ``off`` (POST) at the endpoint ``url`` (loopback only);
    the JSON answer. Raises ControlError (one line naming the endpoint) when it cannot be reached,
    takes longer than ``timeout`` or answers anything but a JSON object."""
    import urllib.error  # noqa: PLC0415
    import urllib.parse  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from tracediff.errors import ControlError, UsageError  # noqa: PLC0415

    if action not in ("status", "on", "off"):
        raise UsageError(f"unknown action {action!r}: status, on or off")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in _LOOPBACK or parts.port is None:
        raise UsageError(f"{url}: a control endpoint is http://127.0.0.1:PORT (recording processes listen on this "
                         f"machine's loopback only)")
    base = f"http://{parts.netloc}"
    request = urllib.request.Request(base + f"/{action}", method="GET" if action == "status" else "POST",
                                     data=None if action == "status" else b"")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(request, timeout=timeout) as response:
            data = response.read(MAX_ANSWER + 1)
    except urllib.error.HTTPError as exc:
        data = exc.read(MAX_ANSWER + 1)
        try:
            message = json.loads(data).get("error")
        except (ValueError, AttributeError):
            message = None
        raise ControlError(f"{base}: answered {exc.code}: {message or exc.reason}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ControlError(f"{base}: unreachable ({reason}); is the recording process still running?") from None
    try:
        answer = json.loads(data[:MAX_ANSWER])
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or len(data) > MAX_ANSWER:
        raise ControlError(f"{base}: answered something that is no control endpoint's JSON")
    return answer


__all__ = ["CONTROL_DIR", "Control", "ask", "find_endpoints", "install_signals", "serve", "setup_switch"]
