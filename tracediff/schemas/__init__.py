"""JSON Schema files (draft 2020-12) for tracediff's machine-readable outputs; see docs/report-schema.md.

``compare`` describes the compare report: what ``tracediff compare --json``, ``tracediff replay --json``
and ``compare --draft --json`` write (one document; ``replay`` is filled by the last two). ``identify``
describes what ``tracediff identify --json`` writes, ``lint`` what ``tracediff lint --json`` writes
(docs/lint.md). Objects are open (a minor version may add fields), required fields stay; the files are
package data, read here without importing jsonschema.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMAS = {"compare": "compare-report.schema.json", "identify": "identify.schema.json", "lint": "lint.schema.json"}


def load_schema(name: str) -> dict[str, Any]:
    """The parsed JSON Schema for ``name`` (``"compare"`` or ``"identify"``)."""
    try:
        filename = SCHEMAS[name]
    except KeyError:
        raise ValueError(f"unknown schema {name!r}; known: {', '.join(sorted(SCHEMAS))}") from None
    return json.loads(resources.files(__name__).joinpath(filename).read_text(encoding="utf-8"))
