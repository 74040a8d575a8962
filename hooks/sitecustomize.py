"""tracediff's shim, put first on PYTHONPATH by `tracediff record -- CMD`.

Python imports ``sitecustomize`` at start-up in every process of the command's tree. This file
activates tracediff from the ``TRACEDIFF_CONFIG`` environment variable and then runs the
``sitecustomize`` that would have run without it (a venv's or the distribution's), so we never hide
a user's start-up code. It must never raise and must stay cheap: no torch import here.
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


try:
    from tracediff.inject import activate_from_env as _activate

    _activate()
except Exception as _exc:  # noqa: BLE001
    _sys.stderr.write(f"tracediff: shim could not activate recording in pid {_os.getpid()}: {_exc}\n")

try:
    _chain_next_sitecustomize()
except Exception as _exc:  # noqa: BLE001
    _sys.stderr.write(f"tracediff: the chained sitecustomize raised: {_exc}\n")
