"""The compare pipeline: one sub-package a stage, in the order it runs (:func:`compare_stores` in
:mod:`~tracediff.compare.run` drives it). Each imports only the ones before it.

0. :mod:`~tracediff.compare.rows`: what every stage reads rows through (each side's row index, rows
   read from the chunk files, the per-row kernels);
1. :mod:`~tracediff.compare.align`: sequences of both sides matched by their tokens
   (:mod:`~tracediff.compare.align.sequences`), the row pairs
   (:mod:`~tracediff.compare.align.rowpairs`) and the draft's input tokens checked on them
   (:mod:`~tracediff.compare.align.pairing`);
2. :mod:`~tracediff.compare.plan` on a sample of pairs (:mod:`~tracediff.compare.plan.decide`):
   label offset, segment size, and per segment which reference segment it is
   (:mod:`~tracediff.compare.plan.segments`), how it was transformed
   (:mod:`~tracediff.compare.plan.transforms`) and how far numerics may move it
   (:mod:`~tracediff.compare.plan.noise`); the config diff (:mod:`~tracediff.compare.plan.metadata`);
3. :mod:`~tracediff.compare.stream`: one pass over every aligned row pair
   (:mod:`~tracediff.compare.stream.one_pass`), block by block
   (:mod:`~tracediff.compare.stream.blocks`), in threads or on a dask cluster
   (:mod:`~tracediff.compare.stream.cluster`), turned into metrics by
   :mod:`~tracediff.compare.stream.metrics`;
4. :mod:`~tracediff.compare.findings`: what is wrong (:mod:`~tracediff.compare.findings.build`,
   :mod:`~tracediff.compare.findings.segments`), which rows (:mod:`~tracediff.compare.findings.subsets`),
   what to change (:mod:`~tracediff.compare.findings.remedy`), what cannot be told
   (:mod:`~tracediff.compare.findings.evidence`);
5. :mod:`~tracediff.compare.results`: the :class:`~tracediff.compare.results.Report` the renderers
   (:mod:`tracediff.report`) print.

:mod:`~tracediff.compare.plan.identify` names the layers of one trace against a bank, from the same
plan. No torch anywhere here: a compare imports numpy and zarr only (numba for passes of 1 GiB or
more and alignments of 2 M candidate rows or more: :mod:`tracediff.compare.rows.kernels`).
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
