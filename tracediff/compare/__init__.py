"""The compare pipeline, in the order it runs (:func:`compare_stores` in :mod:`~tracediff.compare.run`
drives it):

1. :mod:`~tracediff.compare.align` (sequences of both sides matched by their tokens),
   :mod:`~tracediff.compare.rowpairs` (the row pairs) and :mod:`~tracediff.compare.pairing` (token
   pairing checks);
2. :mod:`~tracediff.compare.plan` on a sample of pairs: label offset, segment size, and per segment
   :mod:`~tracediff.compare.segments` (which reference segment it is), :mod:`~tracediff.compare.transforms`
   (how it was transformed) and :mod:`~tracediff.compare.noise` (how far numerics may move it);
3. :mod:`~tracediff.compare.stream`: one pass over every aligned row pair, block by block
   (:mod:`~tracediff.compare.blocks`; rows read by :mod:`~tracediff.compare.gather`, per-row
   statistics by :mod:`~tracediff.compare.kernels`, in threads or on a dask cluster:
   :mod:`~tracediff.compare.cluster`), turned into metrics by
   :mod:`~tracediff.compare.metrics`;
4. :mod:`~tracediff.compare.subsets` (rows that differ: which ones), :mod:`~tracediff.compare.metadata`
   (the config diff), :mod:`~tracediff.compare.findings` and :mod:`~tracediff.compare.segment_findings`
   (what is wrong), :mod:`~tracediff.compare.remedy` (what to change);
5. :mod:`~tracediff.compare.results`: the :class:`~tracediff.compare.results.Report` the renderers
   (:mod:`tracediff.report`) print.

:mod:`~tracediff.compare.identify` names the layers of one trace against a bank, from the same plan.
No torch anywhere here: a compare imports numpy and zarr only (numba for passes of 1 GiB or more and
alignments of 2 M candidate rows or more: :mod:`tracediff.compare.kernels`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompareOptions", "compare_stores"]


def __getattr__(name: str) -> Any:
    # Lazily, so that importing one stage (tracediff.compare.segments) does not import every other.
    if name == "compare_stores":
        from tracediff.compare.run import compare_stores  # noqa: PLC0415

        return compare_stores
    if name == "CompareOptions":
        from tracediff.compare.plan import CompareOptions  # noqa: PLC0415

        return CompareOptions
    raise AttributeError(f"module 'tracediff.compare' has no attribute {name!r}")
