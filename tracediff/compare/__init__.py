"""The compare pipeline, in the order it runs (:func:`compare_stores` in :mod:`~tracediff.compare.run`
drives it):

1. :mod:`~tracediff.compare.align.sequences` (sequences of both sides matched by their tokens),
   :mod:`~tracediff.compare.align.rowpairs` (the row pairs) and :mod:`~tracediff.compare.align.pairing` (token
   pairing checks);
2. :mod:`~tracediff.compare.plan.decide` on a sample of pairs: label offset, segment size, and per segment
   :mod:`~tracediff.compare.plan.segments` (which reference segment it is), :mod:`~tracediff.compare.plan.transforms`
   (how it was transformed) and :mod:`~tracediff.compare.plan.noise` (how far numerics may move it);
3. :mod:`~tracediff.compare.stream.one_pass`: one pass over every aligned row pair, block by block
   (:mod:`~tracediff.compare.stream.blocks`; rows read by :mod:`~tracediff.compare.rows.gather`, per-row
   statistics by :mod:`~tracediff.compare.rows.kernels`, in threads or on a dask cluster:
   :mod:`~tracediff.compare.stream.cluster`), turned into metrics by
   :mod:`~tracediff.compare.stream.metrics`;
4. :mod:`~tracediff.compare.findings.subsets` (rows that differ: which ones), :mod:`~tracediff.compare.plan.metadata`
   (the config diff), :mod:`~tracediff.compare.findings.build` and :mod:`~tracediff.compare.findings.segments`
   (what is wrong), :mod:`~tracediff.compare.findings.remedy` (what to change);
5. :mod:`~tracediff.compare.results`: the :class:`~tracediff.compare.results.Report` the renderers
   (:mod:`tracediff.report`) print.

:mod:`~tracediff.compare.plan.identify` names the layers of one trace against a bank, from the same plan.
No torch anywhere here: a compare imports numpy and zarr only (numba for passes of 1 GiB or more and
alignments of 2 M candidate rows or more: :mod:`tracediff.compare.rows.kernels`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompareOptions", "compare_stores"]


def __getattr__(name: str) -> Any:
    # Lazily, so that importing one stage (tracediff.compare.plan.segments) does not import every other.
    if name == "compare_stores":
        from tracediff.compare.run import compare_stores  # noqa: PLC0415

        return compare_stores
    if name == "CompareOptions":
        from tracediff.compare.plan.decide import CompareOptions  # noqa: PLC0415

        return CompareOptions
    raise AttributeError(f"module 'tracediff.compare' has no attribute {name!r}")
