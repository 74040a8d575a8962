"""JSON Schema files (draft 2020-12) for tracediff's machine-readable outputs; see docs/report-schema.md."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMAS = {"compare": "compare-report.schema.json", "identify": "identify.schema.json"}


def load_schema(name: str) -> dict[str, Any]:
    """The parsed JSON Schema for ``name`` (``"compare"`` or ``"identify"``)."""
    try:
        filename = SCHEMAS[name]
    except KeyError:
        raise ValueError(f"unknown schema {name!r}; known: {', '.join(sorted(SCHEMAS))}") from None
    return json.loads(resources.files(__name__).joinpath(filename).read_text(encoding="utf-8"))
