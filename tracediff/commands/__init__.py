"""The `tracediff` commands, one module a group; :mod:`tracediff.cli` holds them in one click group.

``record`` (run a command with recording injected), ``compare`` (compare, identify, calibrate, demo),
``replay`` (the draft replayed on both sides' rows), ``stores`` (import, send, inspect, pack, push),
and ``options`` (the conventions every command keeps, docs/cli.md: help in option sections ending with
the exit codes, ``--json``/``--markdown``/``--html PATH`` with ``-`` for stdout, one-line errors with a
did-you-mean and exit code 2; and what they share: the store argument, ``--storage-option``, sizes,
progress). Each command imports the library it runs inside its body, so `tracediff --help` loads
click and these modules only.
"""
