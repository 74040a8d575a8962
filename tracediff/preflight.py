"""`tracediff preflight`: before anything is recorded, what each engine will feed a draft's ``fc``.

From the draft's ``config.json`` and safetensors *headers*, the target's ``config.json`` and the
engines' rules (:mod:`tracediff.adapters.engine_rules`, numbering from
:mod:`tracediff.adapters.conventions`: the same code compare's Fix box reads), it predicts per engine
the ids read, where from, what they mean, the physical layers (HF ``hidden_states`` numbering)
captured and in what order; compares them with what the trainer fed (its convention for the same
config, a trainer store's recorded aux layers, or layers given on the command line); and checks the
``fc`` width, the ``d2t`` map, the vocabularies and the depth.

Must never: read a whole weight file (only the headers, and the small ``d2t``/``t2d`` maps from
their byte ranges), unpickle anything, or import a framework or torch (it answers in well under a
second). Results are plain dataclasses; :func:`render_text` only formats them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracediff.adapters.conventions import AuxLayers, PhysicalLayer, aux_layers_from_meta, format_layers, layer_text
from tracediff.adapters.engine_rules import (
    ENGINES,
    Resolution,
    choose_rule,
    config_field,
    draft_ids,
    engine_row_model,
    fix_ids,
    installed_version,
    mtp_layers_of,
    resolve,
    target_family,
)
from tracediff.drafts import read_json_config
from tracediff.errors import UsageError
from tracediff.preflight_facts import Check, DraftFacts, EngineView, Preflight, TargetFacts, TrainerView
from tracediff.preflight_mtp import mtp_preflight, render_mtp_text

_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


# ------------------------------------------------------------------------------------------ reading


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    file: str
    start: int  # absolute byte offset of the data in the file
    end: int


def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header only (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise UsageError(f"{path}: header: file shorter than 8 bytes, not a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise UsageError(f"{path}: header: length {n} is over 100 MiB, not a safetensors file")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: header: not a JSON object")
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in info["data_offsets"])
            out[name] = TensorInfo(name, str(info["dtype"]), [int(d) for d in info["shape"]], str(path),
                                   8 + n + start, 8 + n + end)
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: header: tensor {name!r} has no dtype/shape/data_offsets") from None
    return out


_NUMPY_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def _read_small(t: TensorInfo, limit: int = 64 << 20) -> Any:
    """The values of a small integer/bool tensor (d2t, t2d) from its byte range."""
    import numpy as np  # noqa: PLC0415

    if t.dtype not in _NUMPY_DTYPES or t.end - t.start > limit:
        return None
    with open(t.file, "rb") as f:
        f.seek(t.start)
        data = f.read(t.end - t.start)
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[t.dtype])


def _find(tensors: dict[str, TensorInfo], *suffixes: str) -> TensorInfo | None:
    for suffix in suffixes:
        for name, t in tensors.items():
            if name == suffix or name.endswith("." + suffix):
                return t
    return None


def read_draft(folder: Path) -> tuple[DraftFacts, dict[str, Any]]:
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder; give the draft checkpoint's folder (config.json + *.safetensors)")
    cfg = read_json_config(folder / "config.json", "draft")
    tensors: dict[str, TensorInfo] = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        tensors.update(safetensors_header(f))
    ids = draft_ids(cfg)
    for key, where in (("top", "eagle_aux_hidden_state_layer_ids"),
                       ("eagle_config", "eagle_config.eagle_aux_hidden_state_layer_ids")):
        raw = cfg.get("eagle_aux_hidden_state_layer_ids") if key == "top" else (
            (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if isinstance(cfg.get("eagle_config"), dict) else None)
        if raw is not None and ids[key] is None:
            raise UsageError(f"{folder / 'config.json'}: field {where} = {raw!r}: expected a non-empty list of integers")
    fc = _find(tensors, "fc.weight")
    lm = _find(tensors, "lm_head.weight")
    d2t, t2d = _find(tensors, "d2t"), _find(tensors, "t2d")
    layer_cfg = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    vocab = _int(cfg.get("vocab_size")) or _int(layer_cfg.get("vocab_size"))  # speculators: nested
    facts = DraftFacts(
        str(folder), list(cfg.get("architectures") or []), ids,
        _int(cfg.get("hidden_size")) or _int(layer_cfg.get("hidden_size")),
        _int(cfg.get("target_hidden_size")), vocab, _int(cfg.get("draft_vocab_size")),
        cfg.get("norm_before_fc") if isinstance(cfg.get("norm_before_fc"), bool) else None,
        fc.shape if fc else None, _find(tensors, "embed_tokens.weight") is not None, lm is not None,
        lm.shape[0] if lm and lm.shape else None,
        {"present": d2t is not None, **({"dtype": d2t.dtype, "shape": d2t.shape} if d2t else {})},
        {"present": t2d is not None, **({"dtype": t2d.dtype, "shape": t2d.shape} if t2d else {})},
        "speculators_model_type" in cfg or "speculators_config" in cfg, [f.name for f in files])
    facts.mtp_layers = mtp_layers_of(cfg, tensors)
    if facts.mtp_layers:
        eh = _find(tensors, f"layers.{facts.mtp_layers[0]}.eh_proj.weight")
        facts.eh_proj_shape = eh.shape if eh else None
    if d2t is not None:
        facts.d2t["_tensor"] = d2t
    if t2d is not None:
        facts.t2d["_tensor"] = t2d
    return facts, cfg


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def read_target(folder: Path | None) -> TargetFacts:
    if folder is None:
        return TargetFacts(None, None, [], None, None, None, None, "llama", None)
    path = folder / "config.json" if folder.is_dir() else folder
    cfg = read_json_config(folder, "target")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = _int(text.get("num_hidden_layers"))
    if layers is None or layers < 1:
        raise UsageError(f"{path}: field num_hidden_layers = {text.get('num_hidden_layers')!r}: expected a positive "
                         f"integer (the target's decoder layer count)")
    model_type = str(text.get("model_type") or cfg.get("model_type") or "") or None
    hidden = _int(text.get("hidden_size"))
    scale = None
    if model_type and model_type.startswith("gemma") and hidden:
        scale = f"sqrt(hidden_size) = {hidden ** 0.5:.4g} (Gemma scales its embedding output)"
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return TargetFacts(str(folder), model_type, list(cfg.get("architectures") or []), layers, hidden,
                       _int(text.get("vocab_size")), tie if isinstance(tie, bool) else None, target_family(cfg), scale)


# ------------------------------------------------------------------------------------------ planning
def run_preflight(draft_dir: Path, target_dir: Path | None = None, engines: tuple[str, ...] = ENGINES,
                  trainer: str | None = None, trainer_layers: list[int] | None = None,
                  versions: dict[str, str] | None = None) -> Preflight:
    """Everything preflight says, as data. ``trainer``: ``speculators``, ``specforge`` or a trainer
    store's path; ``trainer_layers``: the layers the trainer fed, as HF ``hidden_states`` indices;
    ``versions``: engine versions the server runs (else the installed ones, else unknown)."""
    draft, cfg = read_draft(draft_dir)
    target = read_target(target_dir if target_dir is not None or not draft.mtp_layers else draft_dir)
    versions = dict(versions or {})
    depth = target.num_layers
    checks: list[Check] = []
    if draft.mtp_layers:  # an MTP head ships inside its target's checkpoint

        return mtp_preflight(draft, target, engines, trainer, versions, checks)

    def version_of(name: str) -> tuple[str | None, str]:
        if versions.get(name):
            return versions[name], "given"
        v = installed_version(name)
        return (v, "installed") if v else (None, "unknown")

    if target_dir is None:
        checks.append(Check("target", "warning", "no --target: its family is unknown, so a Llama-like target is "
                                                 "assumed (SGLang numbers DeepSeek/Kimi and gpt-oss targets "
                                                 "differently), and its depth, hidden size and vocabulary are not "
                                                 "checked"))
    sg_version = version_of("sglang")[0]
    trainer_view = _trainer_view(trainer, trainer_layers, draft, cfg, target, version_of, sg_version, checks)
    views: list[EngineView] = []
    for name in engines:
        version, source = version_of(name)
        choice = choose_rule(name, target.family, version, source)
        res = resolve(choice, cfg, depth)
        views.append(_engine_view(res, choice.rule, trainer_view, depth, checks))
        views[-1].row_model = engine_row_model(name, mtp=False, slots=len(res.capture) or None)
    if trainer_view.physical is None:
        known = [v for v in views if v.resolution.physical is not None]
        if len({tuple(map(str, v.resolution.physical or [])) for v in known}) > 1:
            checks.append(Check("layers", "error",
                                "the engines feed the draft different layers: "
                                + "; ".join(f"{v.resolution.framework} {format_layers(v.resolution.physical)}"
                                            for v in known)
                                + ". Say what the trainer fed (--trainer) to know which is right",
                                {v.resolution.framework: v.resolution.physical for v in known}))
            for v in known:
                v.verdict = "different"
    _check_weights(draft, target, views, checks)
    for v in views:
        for w in v.resolution.warnings:
            checks.append(Check("version", "warning", w, {"engine": v.resolution.framework}))
    return Preflight(draft, target, trainer_view, views, checks)


def _trainer_view(trainer: str | None, layers: list[int] | None, draft: DraftFacts, cfg: dict[str, Any],
                  target: TargetFacts, version_of: Any, sg_version: str | None,
                  checks: list[Check]) -> TrainerView:
    depth = target.num_layers
    if layers is not None:
        bad = [p for p in layers if p < 0 or (depth is not None and p > depth)]
        if bad:
            raise UsageError(f"--trainer-layers {layers}: {bad} outside 0..{depth} (HF hidden_states indices)")
        return TrainerView("--trainer-layers", list(layers), {"numbering": "HF hidden_states indices"})
    name = trainer
    if name is None and draft.speculators_format:
        name = "speculators"
        checks.append(Check("trainer", "info", "the draft config is in speculators' format: taking speculators as "
                                               "the trainer (say --trainer to override)"))
    if name is None:
        return TrainerView("unknown", None)
    if name in ("speculators", "specforge"):
        version, source = version_of(name)
        choice = choose_rule(name, target.family, version, source, sglang_version=sg_version)
        res = resolve(choice, cfg, depth)
        for w in res.warnings:
            checks.append(Check("version", "warning", w, {"trainer": name}))
        if res.error:
            checks.append(Check("trainer_error", "error", res.error, {"trainer": name}))
        if res.ids is None and depth is not None:
            checks.append(Check("default_layers", "warning",
                                f"the draft config names no aux layers: {name} trained on its defaults "
                                f"{format_layers(res.physical)} (HF hidden_states indices)", {"trainer": name}))
        return TrainerView(name, res.physical, {"resolution": res.to_dict()})
    return _store_view(Path(name), depth)


def _store_view(store: Path, num_layers: int | None) -> TrainerView:
    doc_path = store / "zarr.json"
    if not doc_path.is_file():
        raise UsageError(f"{store}: --trainer: not speculators, specforge or a trainer store (no zarr.json)")
    doc = read_json_config(doc_path, "trainer store")
    attrs = doc.get("attributes")
    if not isinstance(attrs, dict) or "tracediff" not in attrs:
        raise UsageError(f"{doc_path}: field attributes.tracediff missing: not a trace store")
    meta = attrs.get("meta") or {}
    aux: AuxLayers | None = aux_layers_from_meta(meta, num_layers)
    if aux is None or aux.physical is None:
        raise UsageError(f"{doc_path}: field attributes.meta: no aux layers with a known convention recorded; "
                         f"give --trainer-layers (HF hidden_states indices) instead")
    return TrainerView(f"store {store}", list(aux.physical), {"aux_layers": aux.to_dict()})


def _engine_view(res: Resolution, rule: Any, trainer: TrainerView, depth: int | None, checks: list[Check]) -> EngineView:
    name = res.framework
    if res.ignored and res.ids_from == "default":
        checks.append(Check("ignored_ids", "error" if depth is not None else "warning",
                            f"{name} reads the ids only from {config_field(rule)}; the draft has them only at "
                            f"{', '.join(res.ignored)}: {name} ignores them and uses its defaults",
                            {"engine": name, "ignored": res.ignored}))
    elif res.ids is None and res.physical is None:
        checks.append(Check("layers_unknown", "error",
                            f"cannot tell which layers {name} feeds: the draft config names no aux layers and its "
                            f"default [2, L//2, L-3] depends on the target's depth: give --target",
                            {"engine": name}))
    elif res.ids is None:
        checks.append(Check("default_layers", "warning",
                            f"the draft config names no aux layers: {name} uses its defaults "
                            f"{format_layers(res.physical)} (HF hidden_states indices: "
                            f"{', '.join(layer_text(p) for p in res.physical or [])})",
                            {"engine": name, "physical": res.physical}))
    if res.missing:
        checks.append(Check("missing_slot", "error",
                            f"{name} never captures ids {res.missing} (capture indices outside the target's layer "
                            f"loop, 0..{'L' if depth is None else (depth if rule.convention == 'vllm' else depth - 1)}): their "
                            f"fc slots are left unfilled", {"engine": name, "capture": res.capture}))
    if res.error:
        checks.append(Check("engine_error", "error", res.error, {"engine": name}))
    verdict, fix = "unknown", None
    if trainer.physical is not None and res.physical is not None:
        same = [str(p) for p in res.physical] == [str(p) for p in trainer.physical] and not res.missing
        verdict = "same" if same else "different"
        if not same:
            ids, problems = fix_ids(rule, list(trainer.physical), depth)
            fix = {"field": config_field(rule), "ids": ids, "problems": problems}
            say = (f"set {config_field(rule)} = {ids}" if ids is not None
                   else "cannot be set in its config: " + "; ".join(problems))
            checks.append(Check("layers", "error",
                                f"{name} feeds {_cat(res.physical)}, the trainer fed {_cat(trainer.physical)}: "
                                f"{say}", {"engine": name, "engine_layers": res.physical,
                                           "trainer_layers": trainer.physical, "fix": fix}))
    return EngineView(res, verdict, fix)


def _cat(layers: list[PhysicalLayer] | None) -> str:
    if layers is None:
        return "unknown layers"
    return "cat(" + ", ".join("emb" if p == 0 else str(p) if isinstance(p, str) else f"L{p}" for p in layers) + ")"


def _check_weights(draft: DraftFacts, target: TargetFacts, views: list[EngineView], checks: list[Check]) -> None:
    hidden = target.hidden_size or draft.target_hidden_size or draft.hidden_size
    widths = {len(v.resolution.capture) if v.resolution.capture else None for v in views} - {None}
    if draft.fc_shape is None:
        checks.append(Check("fc_shape", "warning", f"{draft.path}: no fc.weight in the safetensors headers: cannot "
                                                   f"check the fc input width"))
    elif hidden:
        for k in sorted(widths):
            if draft.fc_shape[-1] != hidden * k:
                checks.append(Check("fc_shape", "error",
                                    f"the draft's fc.weight is {draft.fc_shape}: it takes {draft.fc_shape[-1]} inputs, "
                                    f"but {k} aux layers x target hidden {hidden} = {hidden * k}",
                                    {"fc_shape": draft.fc_shape, "target_hidden": hidden, "slots": k}))
    if draft.target_hidden_size and target.hidden_size and draft.target_hidden_size != target.hidden_size:
        checks.append(Check("fc_shape", "error", f"the draft config's target_hidden_size {draft.target_hidden_size} "
                                                 f"is not the target's hidden_size {target.hidden_size}"))
    vocab = target.vocab_size or draft.vocab_size
    rows = draft.lm_head_rows or draft.draft_vocab_size
    if draft.vocab_size and target.vocab_size and draft.vocab_size != target.vocab_size:
        checks.append(Check("vocab", "error", f"the draft config's vocab_size {draft.vocab_size} is not the target's "
                                              f"{target.vocab_size}"))
    if rows and vocab and rows < vocab and not draft.d2t["present"]:
        checks.append(Check("vocab", "error", f"the draft's lm_head has {rows} rows, fewer than the target vocabulary "
                                              f"{vocab}, and there is no d2t map: draft ids would be read as target ids"))
    if draft.d2t["present"]:
        t = draft.d2t["_tensor"]
        values = _read_small(t)
        if values is None:
            checks.append(Check("d2t", "warning", f"d2t is {t.dtype} {t.shape}: not an integer map tracediff reads"))
        else:
            from tracediff.drafts import AMBIGUOUS, d2t_kind_of_array  # noqa: PLC0415

            kept = _read_small(draft.t2d["_tensor"]) if draft.t2d["present"] else None
            kind = d2t_kind_of_array(values, vocab, kept)
            draft.d2t["kind"] = kind
            if rows and values.size != rows:
                checks.append(Check("d2t", "error", f"d2t has {values.size} entries, the lm_head {rows} rows"))
            if kind.startswith("absolute") or kind == AMBIGUOUS:
                checks.append(Check("d2t", "error", f"d2t holds {kind}: every engine reads it as offsets (target id = "
                                                    f"i + d2t[i]), so nearly every drafted token is wrong; store "
                                                    f"d2t[i] = target_id[i] - i", {"kind": kind}))
            elif kind.startswith("neither"):
                checks.append(Check("d2t", "error", f"d2t is {kind} inside the target vocabulary {vocab}",
                                    {"kind": kind}))
    if draft.has_embedding:
        checks.append(Check("embedding", "info", "the draft ships embed_tokens: vLLM uses it, SGLang replaces it with "
                                                 "the target's; they differ if the two embeddings do"))
    if target.embedding_scale:
        checks.append(Check("embedding", "info", f"the target's embedding output is scaled by {target.embedding_scale}:"
                                                 f" an embedding slot must be taken after that scale on both sides"))


# ------------------------------------------------------------------------------------------ record
def resolution_for_record(engine: str, draft_dir: Any, target_dir: Any, version: str | None,
                          captured: list[int] | None = None) -> dict[str, Any] | None:
    """Preflight's prediction for the engine a recording runs in, stored by the serving adapters next
    to the ids the engine really used (``meta.<engine>.preflight``): ``rule``, ``ids``, ``ids_from``,
    ``capture``, ``physical``, the errors preflight found, and, given ``captured`` (the capture indices
    the engine resolved), ``agrees``: False means a rule in :mod:`tracediff.adapters.engine_rules` does
    not hold for this engine version. None when either path is not a local folder (a hub id); never
    raises (it runs inside the engine's process)."""
    try:
        draft, target = Path(str(draft_dir)), Path(str(target_dir))
        if not draft_dir or not target_dir or not draft.is_dir() or not target.is_dir():
            return None
        from tracediff.adapters.engine_rules import parse_version  # noqa: PLC0415

        pf = run_preflight(draft, target, (engine,), versions={engine: version} if parse_version(version) else None)
        res = pf.engines[0].resolution
        out: dict[str, Any] = {
            "rule": res.rule, "rule_read_from": res.rule_read_from, "source": res.source, "version": res.version,
            "ids": res.ids, "ids_from": res.ids_from, "capture": res.capture, "physical": res.physical,
            "missing": res.missing, "errors": [c.message for c in pf.checks if c.severity == "error"]}
        if captured is not None:
            out["agrees"] = sorted(set(res.capture)) == sorted(set(int(c) for c in captured))
            if not out["agrees"]:
                out["errors"].append(
                    f"preflight predicted capture indices {res.capture} ({res.rule}, read from {engine} "
                    f"{res.rule_read_from}); {engine} {version} captured {list(captured)}: the rule does not hold "
                    f"for this version (tracediff/adapters/engine_rules.py)")
        return out
    except Exception as exc:  # noqa: BLE001  (never into the engine)
        from tracediff.errors import first_line  # noqa: PLC0415

        return {"error": first_line(exc)}


# ------------------------------------------------------------------------------------------ text
def render_text(pf: Preflight) -> str:
    """The report a person reads; computes nothing."""
    if pf.draft.mtp_layers:

        return render_mtp_text(pf)
    t = pf.target
    lines = [f"tracediff preflight: {pf.draft.path}"
             + (f" for {t.path} ({t.model_type or '?'}, {t.num_layers} layers, hidden {t.hidden_size})" if t.path
                else " (no --target: defaults and depth unknown)")]
    ids = pf.draft.ids
    lines.append(f"  draft ids: top level {ids['top']}, eagle_config {ids['eagle_config']}; fc.weight "
                 f"{pf.draft.fc_shape}; d2t {pf.draft.d2t.get('kind', 'present' if pf.draft.d2t['present'] else 'none')}")
    tr = pf.trainer
    lines.append(f"  trainer ({tr.source}): "
                 + (f"{_cat(tr.physical)}  (HF hidden_states {format_layers(tr.physical)})" if tr.physical is not None
                    else "unknown: say --trainer speculators|specforge|STORE or --trainer-layers"))
    for v in pf.engines:
        r = v.resolution
        ver = f"{r.version} ({r.version_from})" if r.version else "version unknown"
        lines.append(f"  {r.framework} {ver}: rule {r.rule} (source read: {r.rule_read_from}; holds for "
                     f"{r.rule_versions})")
        lines.append(f"      reads {r.ids if r.ids is not None else 'no ids'} from {r.ids_from}"
                     + (f"; ignores {r.ignored}" if r.ignored else ""))
        lines.append(f"      numbering: {r.numbering}; captures (its indices) {r.capture}")
        if v.row_model is not None:
            lines.append(f"      row model eagle3: {v.row_model['k']} hidden-state slots")
        lines.append(f"      feeds {_cat(r.physical)}  (HF hidden_states {format_layers(r.physical)})  -> {v.verdict}")
        if v.fix:
            lines.append(f"      fix: set {v.fix['field']} = {v.fix['ids']}" if v.fix["ids"] is not None
                         else f"      fix: none in its config ({'; '.join(v.fix['problems'])})")
    for sev in ("error", "warning", "info"):
        for c in (c for c in pf.checks if c.severity == sev):
            lines.append(f"  {sev}: [{c.kind}] {c.message}")
    lines.append(f"verdict: {pf.verdict} (exit {pf.exit_code})")
    return "\n".join(lines)


__all__ = ["Check", "DraftFacts", "EngineView", "Preflight", "TargetFacts", "TrainerView", "read_draft",
           "read_target", "render_text", "resolution_for_record", "run_preflight", "safetensors_header"]
