"""What every stage of a compare reads rows through: each side's row index (:mod:`.index`), rows read
from the chunk files (:mod:`.gather`, with the thread helpers every stage uses) and the per-row
kernels, numpy's and the compiled ones (:mod:`.kernels`, :mod:`.fused`, :mod:`.fused_votes`).
Imports nothing else of :mod:`tracediff.compare`."""
