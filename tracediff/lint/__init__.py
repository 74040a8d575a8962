"""`tracediff lint`: check training hidden states before anything is trained or compared.

Reads a trace store or a trainer's offline files (speculators' ``hs_<i>.safetensors``, bf16 or
hs_connectors' FP8 with per-token scales; SpecForge's ``.ckpt`` cache) in one streaming pass of
bounded memory, and says per slot: all-zero, constant, non-finite and repeated rows, duplicated
samples, the RMS and massive-dimension profile; with the target (``--target``) whether a slot holds
the final norm's output; with a bank (``--bank``) whether it holds another layer than its label
says; for FP8 files, zero, negative or non-finite scales and saturated values.

Layout: :mod:`~tracediff.lint.sources` (what is read), :mod:`~tracediff.lint.stats` (the one pass),
:mod:`~tracediff.lint.checks` (the rules), :mod:`~tracediff.lint.results` (dataclasses),
:mod:`~tracediff.lint.run` (orchestration). Renderers: :mod:`tracediff.report.lint`.
"""

from tracediff.lint.results import KINDS, LintFinding, LintResult, SlotReport
from tracediff.lint.run import lint

__all__ = ["KINDS", "LintFinding", "LintResult", "SlotReport", "lint"]
