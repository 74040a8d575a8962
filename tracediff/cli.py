"""The `tracediff` command: a thin layer over the library.

Every command maps :class:`tracediff.errors.TracediffError` to a one-line ``tracediff: error: ...``
message and exit code 2; a traceback from here is a bug. The commands live in
:mod:`tracediff.commands`, one module a group (record; compare, identify, calibrate, demo; replay;
the store commands import, send, inspect, pack, push); this module is the group that holds them and
the program's entry point, :func:`run`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import click

from tracediff import __version__
from tracediff.commands.compare import calibrate, compare, demo, identify
from tracediff.commands.options import CommandGroup
from tracediff.commands.record import record
from tracediff.commands.replay import replay
from tracediff.commands.stores import import_group, inspect, pack, push, send


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracediff")
def main() -> None:
    """Record and compare the fc-input rows an EAGLE-3 draft sees in training and in serving."""


for _command in (record, compare, replay, identify, calibrate, import_group, demo, send, inspect, pack, push):
    main.add_command(_command)


def run() -> None:
    """The ``tracediff`` program (console script and ``python -m tracediff``).

    Once a command has finished (its reports written and closed, its output flushed), the process
    ends without the interpreter's teardown: unloading torch and zarr costs 0.3-0.5 s, a fifth of a
    small compare. Only when nothing else runs in this process (no non-daemon thread, no recorder)
    and the exit code is a plain number; ``main`` itself (what tests and other programs call) exits
    normally.
    """
    import logging  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from tracediff.runtime import return_freed_memory  # noqa: PLC0415

    return_freed_memory()
    try:
        main(prog_name="tracediff")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
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
