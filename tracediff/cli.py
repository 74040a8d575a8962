"""The `tracediff` command: a thin layer over the library.

Every command maps :class:`tracediff.errors.TracediffError` to a one-line ``tracediff: error: ...``
message and exit code 2; a traceback from here is a bug. The commands live in
:mod:`tracediff.commands`, one module a group (record; compare, identify, calibrate, demo; replay;
the store commands import, send, inspect, pack, push); this module is the group that holds them and
the program's entry point, :func:`run`.

The program (:func:`run`; a program that calls ``main`` keeps its own signal handlers, and gets the
same line and 130 for a KeyboardInterrupt) ends on SIGINT with one ``tracediff: interrupted`` line
and exit code 130, on SIGTERM with one line and 143: never click's ``Aborted!`` and exit 1 (which
reads as "mismatch"), never a traceback. The
signal unwinds the command as an exception, so its ``with`` blocks run (a dask cluster it started
is closed, a report's temporary file removed: a report is renamed into place whole or not at all);
a second signal, or unwinding that takes longer than :data:`UNWIND_SECONDS`, ends the process at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

import click

from tracediff import __version__
from tracediff.commands.compare import calibrate, compare, demo, identify
from tracediff.commands.control import control
from tracediff.commands.lint import lint
from tracediff.commands.options import CommandGroup, exit_codes
from tracediff.commands.preflight import preflight
from tracediff.commands.record import record
from tracediff.commands.replay import replay
from tracediff.commands.stores import import_group, inspect, pack, push, send


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=exit_codes(
    (0, "success (compare: match); each command's own codes end its 'tracediff COMMAND -h'"),
    (1, "a difference (compare: mismatch; preflight: a wiring difference)"),
    (2, "a usage or input error (one 'tracediff: error:' line, with a did-you-mean for a mistyped option or "
        "command), or compare's CANNOT TELL")))
@click.version_option(__version__, prog_name="tracediff")
def main() -> None:
    """Record and compare the fc-input rows an EAGLE-3 draft sees in training and in serving."""


for _command in (preflight, lint, record, control, compare, replay, identify, calibrate, import_group, demo, send,
                 inspect, pack, push):
    main.add_command(_command)


#: Seconds a command may take to unwind after SIGINT or SIGTERM (closing a cluster, removing a
#: report's temporary file) before the process ends without finishing that.
UNWIND_SECONDS = 10.0

_SIGNAL_ENDINGS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the program. A BaseException, and no KeyboardInterrupt: no
    ``except Exception`` of a library swallows it, and click does not turn it into ``Aborted!``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Ending:
    """The ending a signal gives the program, said once whoever gets there first: :func:`run` once
    the command has unwound, the deadline, a second signal."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a second signal may come while the main thread says the first
        self.signum: int | None = None
        self.finished = False  # the command has returned: nothing left to unwind
        self.said = False

    def say(self, signum: int, *, flush: bool = True) -> int:
        with self.lock:
            if not self.said:
                # Only the orderly path flushes: a forced one may run while the main thread is inside
                # a write to stdout (its buffer's lock held, or this very thread in it).
                for stream in (sys.stdout, sys.stderr) if flush else ():
                    with contextlib.suppress(OSError, ValueError, RuntimeError):
                        stream.flush()
                # A forced ending leaves a live progress line drawn on a terminal: clear it first.
                clear = "\r\x1b[K" if not flush and os.isatty(2) else ""
                with contextlib.suppress(OSError):
                    os.write(2, f"{clear}tracediff: {_SIGNAL_ENDINGS.get(signum, 'stopped by a signal')}\n".encode())
                self.said = True
        return 128 + signum

    def now(self, signum: int) -> None:
        os._exit(self.say(signum, flush=False))

    def on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum is not None or self.finished:  # a second signal while unwinding, or nothing to unwind
            self.now(self.signum or signum)
        self.signum = signum
        deadline = threading.Timer(UNWIND_SECONDS, self.now, args=(signum,))
        deadline.daemon = True
        deadline.start()
        raise Interrupted(signum)


def _handle_signals() -> _Ending:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread, unless the process was started
    with them ignored (``nohup``, a background job of a script) or something else handles them."""
    ending = _Ending()
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) == default:
            signal.signal(signum, ending.on_signal)
    return ending


def run() -> None:
    """The ``tracediff`` program (console script and ``python -m tracediff``).

    Once a command has finished (its reports written and closed, its output flushed), the process
    ends without the interpreter's teardown: unloading torch and zarr costs 0.3-0.5 s, a fifth of a
    small compare. Only when nothing else runs in this process (no non-daemon thread, no recorder)
    and the exit code is a plain number; ``main`` itself (what tests and other programs call) exits
    normally.
    """
    ending = _handle_signals()
    try:
        _run(ending)
    except Interrupted as exc:
        code = ending.say(exc.signum)
        # That line is the last word: what a dask cluster's event loop logs while it is torn down
        # (tasks whose exceptions nobody retrieved, a closed comm) would follow it on stderr.
        import logging  # noqa: PLC0415

        logging.disable(logging.CRITICAL)
        from tracediff.store.files import silence_abandoned_io  # noqa: PLC0415

        silence_abandoned_io()
        if "tracediff.record.recorder" in sys.modules or "multiprocessing.resource_tracker" in sys.modules:
            # The recorder closes at exit; multiprocessing's finalizers release what a cluster that
            # was starting created (else its resource tracker warns of leaked semaphores). The
            # deadline still holds.
            sys.exit(code)
        os._exit(code)  # worker threads may be mid-block: they end with the process


def _run(ending: _Ending) -> None:
    import logging  # noqa: PLC0415

    from tracediff.runtime import return_freed_memory  # noqa: PLC0415

    return_freed_memory()
    try:
        main(prog_name="tracediff")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    ending.finished = True  # a signal from here on ends the process at once: the output is complete
    if code is not None and not isinstance(code, int):
        sys.exit(code)  # a message: let the interpreter print it
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    # A recorder in this process (the start-up shim injects one into every Python process of a
    # recorded command, this one too) closes at exit: let it.
    if others or "tracediff.record.recorder" in sys.modules:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(int(code or 0))


if __name__ == "__main__":
    run()
