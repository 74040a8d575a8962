"""`tracediff preflight` for an MTP head (DeepSeek-V3 / Kimi / GLM ``eh_proj``): which row model each
engine builds for it, against the one the trainer recorded.

An MTP head ships inside its target's checkpoint (``model.layers.{L}.*``, ``num_nextn_predict_layers``),
so the draft folder is the target's. Each engine's input, ``cat(enorm(embed(x_{p+1})), hnorm(h_p))``,
differs only in where ``h_p`` is taken (before or after the target's final norm) and in the rows whose
embedding half it zeroes: :data:`tracediff.adapters.engine_rules.MTP_RULES`, each read from the
engine's source. A trainer store's recorded row model (its ``fc_in`` group's ``row_model``) says what
the head was trained on. Reads JSON and safetensors headers only, as :mod:`tracediff.preflight` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tracediff.adapters.engine_rules import (
    MTP_RULES,
    MTP_TRAINER_RULES,
    Resolution,
    engine_row_model,
    installed_version,
    row_model_fix,
)
from tracediff.errors import UsageError
from tracediff.preflight_facts import Check, DraftFacts, EngineView, Preflight, TargetFacts, TrainerView
from tracediff.store.row_model import from_json, mtp


def mtp_preflight(draft: DraftFacts, target: TargetFacts, engines: tuple[str, ...], trainer: str | None,
                  versions: dict[str, str], checks: list[Check]) -> Preflight:
    """What each engine feeds the MTP head of ``draft`` (the target's own checkpoint), as data."""
    trainer_view = _trainer_view(trainer, target.model_type, checks)
    trained = trainer_view.detail.get("row_model")
    views: list[EngineView] = []
    for name in engines:
        rule = MTP_RULES.get(name)
        version, version_from = (versions[name], "given") if versions.get(name) else (
            (installed_version(name), "installed") if installed_version(name) else (None, "unknown"))
        res = Resolution(name, f"{name}.mtp", f"read from {rule.read_from}" if rule else "unknown",
                         rule.read_from if rule else "none", rule.source if rule else "", version, version_from,
                         None, "none: an MTP head reads no aux layer ids", numbering="MTP: the last layer's hidden "
                         "state and the next token's embedding", capture=[], physical=None)
        model = engine_row_model(name, mtp=True, model_type=target.model_type)
        view = EngineView(res, "unknown", row_model=model)
        views.append(view)
        if model is None:
            checks.append(Check("row_model", "warning", f"tracediff has no MTP rule for {name} with a "
                                                        f"{target.model_type or 'unknown'} target (read for: "
                                                        f"{', '.join(MTP_RULES[name].model_types) if name in MTP_RULES else 'none'})",
                                {"engine": name}))
            continue
        if model["zeroed_embedding_positions"]:
            checks.append(Check("zeroed_slot", "info",
                                f"{name} zeroes the embedding slot at positions {model['zeroed_embedding_positions']} "
                                f"(trainers and the other engines do not): compare leaves those rows out",
                                {"engine": name, "positions": model["zeroed_embedding_positions"]}))
        if trained is not None:
            engine_model = from_json(model["row_model"])
            same = engine_model.same_layout(trained)
            view.verdict = "same" if same else "different"
            if not same:
                fed = "after" if engine_model.slots[-1].final_norm else "before"
                want = trained.slots[-1].final_norm if trained.slots and trained.slots[-1].kind == "hidden" else None
                fix = row_model_fix("final_norm", name, {"reference_final_norm": want, "mtp": True}) \
                    if want is not None and want != engine_model.slots[-1].final_norm else "record the trainer's slots"
                checks.append(Check("row_model", "error",
                                    f"{name} feeds the MTP head the hidden state {fed} the target's final norm; the "
                                    f"trainer recorded {'; '.join(trained.describe())}: {fix}",
                                    {"engine": name, "engine_row_model": model["row_model"],
                                     "trainer_row_model": trained.to_json()}))
    _check_eh_proj(draft, target, checks)
    if trained is None:
        checks.append(Check("trainer", "info", "what the trainer fed the MTP head is unknown: give --trainer STORE (a "
                                               "trainer store recorded with its row model) to check it"))
    return Preflight(draft, target, trainer_view, views, checks)


def _trainer_view(trainer: str | None, model_type: str | None, checks: list[Check]) -> TrainerView:
    if trainer is None:
        return TrainerView("unknown", None)
    rule = MTP_TRAINER_RULES.get(trainer)
    if rule is not None and model_type not in rule.model_types:
        checks.append(Check("trainer", "warning", f"{trainer} {rule.read_from} trains MTP heads of "
                                                  f"{', '.join(rule.model_types)} models only, not this "
                                                  f"{model_type or 'unknown'} target: give the trainer store of the "
                                                  f"MTP head's training (--trainer STORE)"))
        return TrainerView(trainer, None)
    if rule is not None:
        model = mtp(final_norm=rule.hidden_final_norm)
        return TrainerView(trainer, None, {"row_model": model, "rule": rule.to_dict()})
    if trainer in ("speculators", "specforge"):
        checks.append(Check("trainer", "warning", f"{trainer} trains no MTP head: give the trainer store of the MTP "
                                                  f"head's training (--trainer STORE)"))
        return TrainerView(trainer, None)
    model = _store_row_model(Path(trainer))
    return TrainerView(f"store {trainer}", None, {"row_model": model} if model is not None else {})


def _store_row_model(store: Path) -> Any:
    """The row model a trainer store recorded (its ``fc_in`` writer groups', else any tap's)."""
    if not (store / "zarr.json").is_file():
        raise UsageError(f"{store}: --trainer: not speculators, specforge or a trainer store (no zarr.json)")
    groups = sorted(store.glob("fc_in/*/zarr.json")) + sorted(store.glob("*/*/zarr.json"))
    for path in groups:
        try:
            attrs = json.loads(path.read_text()).get("attributes") or {}
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: cannot read ({exc})") from None
        if attrs.get("row_model") is not None:
            return from_json(attrs["row_model"], f"{path}: row_model")
    return None


def _check_eh_proj(draft: DraftFacts, target: TargetFacts, checks: list[Check]) -> None:
    hidden = target.hidden_size
    if draft.eh_proj_shape and hidden and list(draft.eh_proj_shape) != [hidden, 2 * hidden]:
        checks.append(Check("eh_proj_shape", "error", f"the MTP layer's eh_proj.weight is {draft.eh_proj_shape}: "
                                                      f"[hidden, 2 x hidden] = [{hidden}, {2 * hidden}] expected"))


def render_mtp_text(pf: Preflight) -> str:
    """The MTP preflight a person reads; computes nothing."""
    t, d = pf.target, pf.draft
    lines = [f"tracediff preflight: {d.path} ({t.model_type or '?'}, {t.num_layers} layers, hidden {t.hidden_size}) "
             f"with MTP layers {d.mtp_layers}; eh_proj.weight {d.eh_proj_shape}"]
    trained = pf.trainer.detail.get("row_model")
    lines.append(f"  trainer ({pf.trainer.source}): "
                 + ("; ".join(trained.describe()) if trained is not None else "unknown: say --trainer STORE"))
    for v in pf.engines:
        r, model = v.resolution, v.row_model
        ver = f"{r.version} ({r.version_from})" if r.version else "version unknown"
        lines.append(f"  {r.framework} {ver}: rule {r.rule} (source read: {r.rule_read_from})")
        if model is None:
            lines.append(f"      row model unknown  -> {v.verdict}")
            continue
        lines.append(f"      row model {model['name']}: " + "; ".join(model["slots"]))
        lines.append(f"      hidden state {model['hidden_final_norm']} the final norm; embedding zeroed at positions "
                     f"{model['zeroed_embedding_positions'] or 'none'}  -> {v.verdict}")
    for sev in ("error", "warning", "info"):
        for c in (c for c in pf.checks if c.severity == sev):
            lines.append(f"  {sev}: [{c.kind}] {c.message}")
    lines.append(f"verdict: {pf.verdict} (exit {pf.exit_code})")
    return "\n".join(lines)
