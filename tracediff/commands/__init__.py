"""The `tracediff` commands, one module a group; :mod:`tracediff.cli` holds them in one click group.

``record`` (run a command with recording injected), ``compare`` (compare, identify, calibrate, demo),
``replay`` (the draft replayed on both sides' rows), ``stores`` (import, send, inspect, pack, push),
and ``options`` (what they share: the store argument, ``--storage-option``, sizes, progress, the
group that turns every error into one line and exit code 2). Each command imports the library it
runs inside its body, so `tracediff --help` loads click and these modules only.
"""
