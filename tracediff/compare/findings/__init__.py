"""Stage 4, findings: the plan and the pass's numbers turned into findings (:mod:`.build`: layout,
sequences, labels, coverage, config; :mod:`.segments`: segment wiring and values; :mod:`.subsets`:
which rows differ), the fix in the candidate's words (:mod:`.remedy`) and the evidence gates that
withhold what a compare cannot tell (:mod:`.evidence`). Imports every earlier stage; only
:mod:`tracediff.compare.run` imports it."""
