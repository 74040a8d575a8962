"""Stage 2, plan: everything decided before the streaming pass, from metadata and a small sample
(:mod:`.decide`: taps, layouts, the label offset, segment sizes, the segment plan), with which slot
is which layer (:mod:`.segments`), how a pair relates (:mod:`.transforms`), how far numerics may move
it (:mod:`.noise`), the config diff (:mod:`.metadata`) and what each side's stores say about
themselves (:mod:`.sides`). :mod:`.identify` names one trace's layers against a bank from the same
plan. Imports :mod:`tracediff.compare.rows`, :mod:`tracediff.compare.align` and
:mod:`tracediff.compare.results` only."""
