"""samples/README.md says what the shipped samples hold: every number in it (rows and widths, what
compare and identify find, how the chunks are stored, the sizes) is measured on the stores by
samples/make_readme.py, and the file is exactly what that script writes. Two compares and an
identify of the samples, a few seconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _make_readme():
    spec = importlib.util.spec_from_file_location("make_readme", REPO / "samples" / "make_readme.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_samples_readme_is_what_the_samples_say():
    make_readme = _make_readme()
    measured = make_readme.facts(REPO / "samples")
    text = (REPO / "samples" / "README.md").read_text()
    assert text == make_readme.render(REPO / "samples", measured), (
        "samples/README.md is stale: run python samples/make_readme.py")
    # The facts the README was wrong about before it was written from the samples (issue #25).
    assert measured["fixed"]["counts"] == "0 errors, 0 warnings, 2 info"
    assert (measured["label_rows"], measured["label_codec"]) == (4096, "zstd")
    assert measured["disk"] < 1_000_000
    assert measured["broken"]["cause"] == "1 root cause: the candidate's segments are shifted by one slot; 2 consequences."
    assert "0 warnings, 2 info" in text and "4096-row chunks" in text
