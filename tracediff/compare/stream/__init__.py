"""Stage 3, stream: one pass over every aligned row pair, block by block (:mod:`.one_pass` runs and
merges the blocks, :mod:`.blocks` is one block's work, :mod:`.cluster` runs them on
dask.distributed), its per-row columns (:mod:`.rowcolumns`) and the metrics made of its numbers
(:mod:`.metrics`). Imports the earlier stages (rows, align, plan) and :mod:`tracediff.compare.results`,
never findings."""
