"""benchmarks/RESULTS.md, shared by the benchmarks: each owns one ``## name`` section and rewrites only
that one (from its heading to the next ``## ``), atomically (a temporary file renamed)."""

from __future__ import annotations

import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(path: Path, text: str, heading: str) -> None:
    """Replace the ``heading`` section of ``path`` with ``text`` (which starts with that heading),
    keep every other section; a section not there yet is appended."""
    old = path.read_text() if path.exists() else "# Benchmark results\n\nEach benchmark owns one `##` section.\n"
    pattern = re.compile(rf"^{re.escape(heading)}\b.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _m: text.rstrip("\n") + "\n\n", old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new.rstrip("\n") + "\n")
    os.replace(tmp, path)
