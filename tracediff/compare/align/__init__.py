"""Stage 1, align: which candidate row holds the same token of the same sequence as which reference
row. Sequences matched by their tokens (:mod:`.sequences`, its stable sorts by :mod:`.argsort`), the
row pairs an alignment makes (:mod:`.rowpairs`) and the check of the draft's input tokens on them
(:mod:`.pairing`). Labels only, never values; imports only :mod:`tracediff.compare.rows`."""
