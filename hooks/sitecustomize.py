"""tracediff's shim, put first on PYTHONPATH by `tracediff record -- CMD`.

Python imports ``sitecustomize`` at start-up in every process of the command's tree. This file
activates tracediff from the ``TRACEDIFF_CONFIG`` environment variable and then runs the
``sitecustomize`` that would have run without it (a venv's or the distribution's), so we never hide
a user's start-up code. It must never raise and must stay cheap: no torch import here.

It also runs in interpreters that cannot import tracediff (a trainer's own venv): there it says so
and leaves a note for the ``record`` command in ``TRACEDIFF_REPORT_DIR``, which then fails the run
instead of reporting a tap that "never fired". Standard library only, for the same reason.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _chain_next_sitecustomize():
    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in _sys.path:
        if not entry or _os.path.abspath(entry) == here:
            continue
        candidate = _os.path.join(entry, "sitecustomize.py")
        if _os.path.isfile(candidate):
            spec = _ilu.spec_from_file_location("_tracediff_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = _ilu.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


def _note_for_record(error, missing):
    """Leave ``record`` a note that this process records nothing: written now (a process that ends
    by os._exit or a signal runs no exit hook) and again at exit with whether it imported torch (one
    that never did had nothing to record: a helper script in another interpreter is no failure)."""
    import atexit
    import json

    folder = _os.environ.get("TRACEDIFF_REPORT_DIR")
    if not folder or not _os.environ.get("TRACEDIFF_CONFIG") or _os.environ.get("TRACEDIFF_DISABLE"):
        return
    path = _os.path.join(folder, f"{_os.getpid()}-shim.json")
    note = {"pid": _os.getpid(), "executable": _sys.executable, "error": error, "missing": missing, "torch": None}

    def write():
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(note, fh)
            _os.replace(path + ".tmp", path)
        except OSError:
            pass

    def at_exit():
        note["torch"] = "torch" in _sys.modules
        write()

    write()
    atexit.register(at_exit)


try:
    from tracediff.record.inject import activate_from_env as _activate

    _activate()
except Exception as _exc:  # noqa: BLE001
    _missing = isinstance(_exc, ImportError) and getattr(_exc, "name", None) == "tracediff"
    if _os.environ.get("TRACEDIFF_CONFIG") and not _os.environ.get("TRACEDIFF_DISABLE"):
        if _missing:
            _sys.stderr.write(
                f"tracediff: {_sys.executable} (pid {_os.getpid()}) cannot import tracediff: nothing is recorded "
                f"in this process; install tracediff into that interpreter ({_sys.executable} -m pip install "
                f"tracediff) and record with `{_sys.executable} -m tracediff record ...`\n"
            )
        else:
            _sys.stderr.write(f"tracediff: shim could not activate recording in pid {_os.getpid()}: {_exc}\n")
    try:  # noqa: SIM105  (standard library only, imported at every start-up: no contextlib)
        _note_for_record(f"{type(_exc).__name__}: {_exc}", _missing)
    except Exception:  # noqa: BLE001, S110  (a note for the parent must never break the host's start-up)
        pass

try:
    _chain_next_sitecustomize()
except Exception as _exc:  # noqa: BLE001
    _sys.stderr.write(f"tracediff: the chained sitecustomize raised: {_exc}\n")
