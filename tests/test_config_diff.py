"""The config diff walks the two metas itself (no deepdiff import: it pulls in pandas, seconds of a
compare's start-up) and reports exactly what ``DeepDiff(ref, cand, ignore_order=False,
threshold_to_diff_deeper=0)`` reports, volatile keys left out: field by field, never a whole dict."""

from __future__ import annotations

import re
import subprocess
import sys

from deepdiff import DeepDiff
from hypothesis import given, settings
from hypothesis import strategies as st

from tracediff.compare.plan.decide import collect_meta
from tracediff.compare.plan.metadata import AUX_KEYS, VOLATILE_KEYS, config_diff
from tracediff.store import open_store

KEYS = st.sampled_from(["model", "dtype", "server_args", "ids", "pid", "host", "a", "b", "seq_len", "started"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-2, 2, allow_nan=False),
                    st.sampled_from(["bf16", "fp8", "x", ""]))
# Dicts and scalars, and lists of scalars of one length: deepdiff aligns lists of other lengths by a
# sequence match, where config_diff compares index by index (tested on its own below).
JSON = st.recursive(st.one_of(SCALARS, st.lists(st.integers(0, 3), min_size=3, max_size=3)),
                    lambda inner: st.dictionaries(KEYS, inner, max_size=4), max_leaves=20)
# A whole meta is never empty (deepdiff reports an empty root against a full one as one value change).
METAS = st.dictionaries(KEYS, JSON, min_size=1, max_size=5)


def _deepdiff_entries(ref: dict, cand: dict) -> set[tuple]:
    """What config_diff reported when it ran deepdiff (its paths cleaned the same way)."""

    def last_key(path: str) -> str:
        found = re.findall(r"\['([^']*)'\]", path)
        return found[-1] if found else path

    # threshold_to_diff_deeper=0: deepdiff (8+) otherwise reports two dicts with few keys in common
    # as one whole-value change, the dict dump a report should not show; config_diff always goes deeper.
    diff = DeepDiff(ref, cand, ignore_order=False, verbose_level=2, threshold_to_diff_deeper=0,
                    exclude_obj_callback=lambda obj, path: bool(VOLATILE_KEYS.search(last_key(path))))
    out = set()
    for change, items in diff.to_dict().items():
        for path, value in items.items():
            parts = re.findall(r"\[(?:'([^']*)'|(\d+))\]", path)
            name = ".".join(a or f"[{b}]" for a, b in parts)
            if isinstance(value, dict) and ("old_value" in value or "new_value" in value):
                old, new = value.get("old_value"), value.get("new_value")
            elif "removed" in change:
                old, new = value, None
            else:
                old, new = None, value
            out.add((name, change, repr(old), repr(new)))
    return out


@settings(max_examples=300, deadline=None)
@given(METAS, METAS)
def test_the_config_diff_reports_what_deepdiff_reports(ref, cand):
    mine = {(e["path"], e["change"], repr(e["reference"]), repr(e["candidate"])) for e in config_diff(ref, cand)}
    assert mine == _deepdiff_entries(ref, cand)


def test_lists_are_compared_index_by_index():
    diff = config_diff({"m": {"x": [1, 2, 3], "pid": [1]}}, {"m": {"x": [1, 5], "pid": [2]}})
    assert [(e["path"], e["change"], e["reference"], e["candidate"]) for e in diff] == [
        ("m.x.[1]", "values_changed", 2, 5), ("m.x.[2]", "iterable_item_removed", 3, None)]


def test_the_shipped_samples_config_diff_is_unchanged():
    with open_store("samples/train.zarr") as r, open_store("samples/server_broken.zarr") as c:
        ref, cand = collect_meta(r, "fc_in"), collect_meta(c, "fc_in")
    diff = config_diff(ref, cand)
    # Aux-layer settings are reported whole (one entry per setting), everything else as deepdiff does.
    mine = {(e["path"], e["change"], repr(e["reference"]), repr(e["candidate"])) for e in diff
            if not AUX_KEYS.search(e["path"])}
    assert mine == {e for e in _deepdiff_entries(ref, cand) if not AUX_KEYS.search(e[0])}
    assert any(AUX_KEYS.search(e["path"]) for e in diff) and len(mine) > 0


def test_compare_imports_neither_deepdiff_nor_pandas_nor_torch():
    # torch alone is 1.1-1.4 s of a process's start-up here: a compare is numpy (issue #27).
    code = ("import sys; from tracediff.compare import compare_stores; "
            "compare_stores('samples/train.zarr', 'samples/server_broken.zarr'); "
            "print(sorted(m for m in ('deepdiff', 'pandas', 'polars', 'torch', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
