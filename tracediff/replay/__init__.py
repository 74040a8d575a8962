"""What a mismatch costs: the draft replayed, teacher-forced, on each side's recorded rows.

The split that answers "where is the gap" (all on the sequences both sides recorded, positions both
cover, labels = the reference's tokens):

(a) the draft on the reference's (trainer's) fc rows and input tokens;
(b) the draft on the candidate's (server's) rows and input tokens (and, with ``--server-draft``, the
    checkpoint the server loaded on the same rows: what the checkpoint itself costs);
(c) the candidate's rows with compare's proposed fix applied: each reference slot fed by the
    candidate segment the segment map puts there; a slot the candidate does not feed at all is taken
    from the reference (what the fixed config would capture) and counted in the report;
(z) a baseline: the draft with no fc input at all (zeros) on the reference's tokens, what it gets
    from the tokens alone: "near chance" for a draft is near z (scored at a quarter of the starts);
(d) the accept length the engine itself reported for those requests (``send --json``), next to
    (b) replayed at the positions the engine drafted from, over the server's whole sequence
    (generated tokens are the labels of greedy serving).

a - b is what the fc-input mismatch costs, c - a what the fix leaves, b - d what everything past
the fc input costs (draft KV, tree, verification, sampling, vocabulary map, embedding). The
numbers are :class:`~tracediff.replay.score.Tally` summaries (trainer and engine definitions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff.compare.results import Finding, Report
from tracediff.drafts import compare_provenance
from tracediff.errors import UsageError
from tracediff.replay.draft import Eagle3Draft, replay_dtype
from tracediff.replay.rows import SideRows, SideSequence
from tracediff.replay.score import Tally, draft_sequence
from tracediff.store import open_store

RAW_TAPS = ("aux_hidden", "fc_in_raw")
MATCHED = ("same", "moved")


@dataclass
class ReplayOptions:
    draft: str
    target: str | None = None
    server_draft: str | None = None  # the checkpoint the server loaded, when it differs from --draft
    send_report: str | None = None
    steps: int = 3
    max_sequences: int | None = None
    score_rows: int = 4096  # step 0 scored at most at this many starts per replay (evenly spread)
    multi_step_starts: int = 1024  # steps >= 1 from at most this many of them
    dtype: str = "auto"  # auto (the checkpoint's: bf16 stays bf16) | float32 | bfloat16


@dataclass
class ReplayResult:
    draft: dict[str, Any]
    server_draft: dict[str, Any] | None
    steps: int
    sequences: int
    positions: int
    a: dict[str, Any]
    b: dict[str, Any] | None
    c: dict[str, Any] | None
    z: dict[str, Any] | None = None  # no fc input (zeros): what the draft gets from the tokens alone
    b_server: dict[str, Any] | None = None  # (b) with the server's checkpoint (--server-draft)
    b_engine: dict[str, Any] | None = None  # (b) at the positions the engine drafted from
    d: dict[str, Any] | None = None  # what the engine reported
    fix: dict[str, Any] = field(default_factory=dict)  # how (c) was built
    engine_drafts: dict[str, Any] | None = None  # replay's draft tokens vs the engine's own (draft_steps tap)
    provenance: list[dict[str, Any]] = field(default_factory=list)  # draft-input differences
    conclusion: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fixed_rows(cand: np.ndarray, ref: np.ndarray, segment_map: list[Any], ref_size: int, cand_size: int,
               k_ref: int) -> tuple[np.ndarray, list[int]]:
    """The candidate's rows rearranged per the segment map (reference slot j <- the candidate segment
    matched to it); slots no candidate segment feeds are taken from ``ref``. Returns (rows, the
    reference slots filled from the reference)."""
    out = np.empty((cand.shape[0], k_ref * ref_size), dtype=np.float32)
    source: dict[int, int] = {}
    for m in segment_map:
        if m.reference is not None and m.status in MATCHED and m.reference not in source and ref_size == cand_size:
            source[m.reference] = m.candidate
    borrowed = []
    for j in range(k_ref):
        dst = slice(j * ref_size, (j + 1) * ref_size)
        if j in source:
            c = source[j]
            out[:, dst] = cand[:, c * cand_size:(c + 1) * cand_size]
        else:
            out[:, dst] = ref[:, dst]
            borrowed.append(j)
    return out, borrowed


def _fix_is_identity(segment_map: list[Any], k_ref: int, ref_size: int, cand_size: int) -> bool:
    """The fix would feed the candidate's rows unchanged: (c) is (b)."""
    if ref_size != cand_size:
        return False
    placed = {m.reference: m.candidate for m in segment_map if m.reference is not None and m.status in MATCHED}
    return len(placed) == k_ref and all(placed.get(j) == j for j in range(k_ref))


def read_send_report(send_report: str | Path) -> dict[str, Any]:
    """The send report (tracediff send --json), checked: commands call it before any other work,
    so a wrong path is one line at once, not after a compare and a replay."""
    path = Path(send_report)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise UsageError(f"--send-report {path}: no such file (write it with tracediff send --json)") from exc
    except (OSError, ValueError) as exc:
        raise UsageError(f"--send-report {path}: not a JSON send report ({exc})") from exc
    responses = doc.get("responses") if isinstance(doc, dict) else None
    if not isinstance(responses, dict):
        raise UsageError(f"--send-report {path}: no 'responses' (write it with tracediff send --json)")
    return doc


def engine_accept(send_report: str | Path | None, keys: list[str]) -> dict[str, Any] | None:
    """(d): the accept length the engine reported for ``keys`` (tracediff send --json): vLLM's
    per-request ``speculative_decoding`` block, or SGLang's ``spec_verify_ct`` / completion tokens."""
    if send_report is None:
        return None
    path = Path(send_report)
    doc = read_send_report(path)
    responses = doc["responses"]
    steps = accepted = 0
    per_step: dict[str, list[int]] = {}
    used = 0
    for key in keys:
        spec = (responses.get(key) or {}).get("spec_decoding") or {}
        if "num_spec_steps" in spec and "num_accepted_draft_tokens" in spec:
            steps += int(spec["num_spec_steps"])
            accepted += int(spec["num_accepted_draft_tokens"])
            if isinstance(spec.get("per_step_accepted"), list):
                per_step[key] = [int(x) for x in spec["per_step_accepted"]]
            used += 1
        elif "spec_verify_ct" in spec and "completion_tokens" in spec and int(spec["spec_verify_ct"]):
            steps += int(spec["spec_verify_ct"])
            accepted += int(spec["completion_tokens"]) - int(spec["spec_verify_ct"])
            used += 1
    if not steps:
        return {"engine": doc.get("engine"), "requests": 0, "accept_engine": None,
                "note": f"{path} has no speculative-decoding numbers for these sequences (vLLM: "
                        f"--per-request-spec-decode-metrics detailed)"}
    return {"engine": doc.get("engine"), "requests": used, "verify_steps": steps, "accepted_drafts": accepted,
            "accept_engine": 1 + accepted / steps, "per_step_accepted": per_step}


def _sequence_tokens(seq: SideSequence) -> np.ndarray:
    tokens = seq.token_id.copy()
    if seq.length and seq.next_token_id[-1] >= 0:
        tokens = np.append(tokens, seq.next_token_id[-1])
    return tokens


def run_replay(report: Report, opts: ReplayOptions) -> ReplayResult:
    """The a/b/c/d split for the two stores of ``report`` (compare's result for them)."""
    if opts.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {opts.steps}")
    if opts.multi_step_starts < 1 or opts.score_rows < 1:
        raise UsageError(f"--score-rows and --multi-step-starts must be >= 1, got {opts.score_rows}, "
                         f"{opts.multi_step_starts}")
    draft = Eagle3Draft(opts.draft, opts.target, dtype=replay_dtype(opts.dtype, opts.draft))
    server_draft = (Eagle3Draft(opts.server_draft, opts.target, dtype=replay_dtype(opts.dtype, opts.server_draft))
                    if opts.server_draft else draft)
    k_ref, size_ref = report.reference.segments, report.reference.segment_size
    size_cand = report.candidate.segment_size
    for name, d in (("--draft", draft), ("--server-draft", server_draft)):
        if d.info.num_aux * d.info.target_hidden_size != report.reference.width:
            raise UsageError(f"{name} {d.info.path}: its fc takes {d.info.num_aux} x {d.info.target_hidden_size} inputs, "
                             f"the reference rows are {report.reference.width} wide: another draft?")
    with open_store(report.reference.path) as ref_store, open_store(report.candidate.path) as cand_store:
        ref = SideRows(ref_store, report.reference.tap)
        cand = SideRows(cand_store, report.candidate.tap)
        keys = [k for k in ref.sequences if k in cand.sequences]
        if opts.max_sequences is not None:
            keys = keys[: opts.max_sequences]
        if not keys:
            raise UsageError(f"no sequence is recorded on both sides ({report.reference.path}: {len(ref.sequences)}, "
                             f"{report.candidate.path}: {len(cand.sequences)}): replay needs the same request ids")
        tallies = {name: Tally(opts.steps) for name in ("a", "b", "b_server", "c", "z", "b_engine")}
        common = sum(min(ref.sequences[k].length, cand.sequences[k].length) for k in keys)
        stride0 = max(1, -(-common // opts.score_rows))
        scored = -(-common // stride0)  # ceil: the starts step 0 is scored at
        stride = max(1, -(-scored // opts.multi_step_starts))  # steps >= 1 from every stride-th of them
        c_is_b = _fix_is_identity(report.segment_map, k_ref, size_ref, size_cand)
        cand_fits = cand.width == report.reference.width  # else the draft's fc cannot read the server's rows
        borrowed: list[int] = []
        positions = 0
        engine_runs: dict[str, list[int]] = {}
        engine_drafts = EngineDrafts(cand_store) if DRAFT_TAP in cand_store.taps else None
        ref_raw = report.reference.tap in RAW_TAPS
        cand_raw = report.candidate.tap in RAW_TAPS
        for key in keys:
            rs, cs = ref.sequences[key], cand.sequences[key]
            n = min(rs.length, cs.length)
            tokens = torch.from_numpy(_sequence_tokens(rs))
            rv, cv = ref.values(rs)[:n], cand.values(cs)
            positions += n
            g = torch.arange(positions - n, positions)  # the rows' global index over all sequences
            score = torch.nonzero(g % stride0 == 0).reshape(-1)  # step 0 scored here
            sample = score[((g[score] // stride0) % stride) == 0]  # steps >= 1 from these
            z_score = score[((g[score] // stride0) % 4) == 0]  # the baseline: a quarter of them
            runs = [("a", draft, rv, rs.next_token_id[:n], ref_raw)]
            if cand_fits:
                runs.append(("b", draft, cv[:n], cs.next_token_id[:n], cand_raw))
            if cand_fits and server_draft is not draft:
                runs.append(("b_server", server_draft, cv[:n], cs.next_token_id[:n], cand_raw))
            for name, d, rows, first, raw in runs:
                correct, known, _ = draft_sequence(d, torch.from_numpy(rows), torch.from_numpy(first), tokens,
                                                   opts.steps, raw=raw, score=score, starts=sample)
                tallies[name].add(correct, known, rs.positions[:n])
            fixed, borrowed = fixed_rows(cv[:n], rv, report.segment_map, size_ref, size_cand, k_ref)
            if not c_is_b:
                correct, known, _ = draft_sequence(draft, torch.from_numpy(fixed),
                                                   torch.from_numpy(cs.next_token_id[:n]), tokens, opts.steps,
                                                   raw=cand_raw, score=score, starts=sample)
                tallies["c"].add(correct, known, rs.positions[:n])
            # z: no fc input at all (zeros), the reference's tokens: what the draft gets from tokens alone.
            z_multi = z_score[torch.isin(z_score, sample)]
            correct, known, _ = draft_sequence(draft, torch.zeros_like(torch.from_numpy(rv)),
                                               torch.from_numpy(rs.next_token_id[:n]), tokens, opts.steps,
                                               score=z_score, starts=z_multi)
            tallies["z"].add(correct, known, rs.positions[:n])
            # (b) over the server's whole sequence (its generated tokens are the labels), at the
            # positions the engine drafted from.
            starts = cand.engine_starts(cs)
            if starts.size and cand_fits:
                full_tokens = torch.from_numpy(_sequence_tokens(cs))
                index = torch.from_numpy(np.searchsorted(cs.positions, starts))
                correct, known, preds = draft_sequence(server_draft, torch.from_numpy(cv),
                                                       torch.from_numpy(cs.next_token_id), full_tokens, opts.steps,
                                                       raw=cand_raw, score=index, starts=index)
                if engine_drafts is not None:
                    engine_drafts.compare(key, starts, preds[starts], _sequence_tokens(cs))
                tallies["b_engine"].add(correct[starts], known[starts], starts, every_start=True)
                engine_runs[key] = np.cumprod(correct[starts], axis=1).sum(1).tolist()
        result = ReplayResult(
            draft=draft.info.to_dict(), server_draft=server_draft.info.to_dict() if opts.server_draft else None,
            steps=opts.steps, sequences=len(keys), positions=positions,
            a=tallies["a"].summary(), b=tallies["b"].summary() if cand_fits else None,
            c=(tallies["b"] if c_is_b and cand_fits else tallies["c"]).summary(), z=tallies["z"].summary(),
            fix={"slots_from_candidate": k_ref - len(borrowed), "slots_from_reference": borrowed,
                 "segment_map": [(m.candidate, m.reference, m.status) for m in report.segment_map]})
        if tallies["b_engine"].sequences:
            result.b_engine = tallies["b_engine"].summary()
        if server_draft is not draft:
            result.b_server = tallies["b_server"].summary()
        result.d = engine_accept(opts.send_report, keys)
        if result.d and result.d.get("per_step_accepted") and engine_runs:
            result.d["replay_agrees"] = _agreement(result.d["per_step_accepted"], engine_runs)
        result.provenance = compare_provenance(draft.info, server_draft.info, report.candidate.meta)
        if engine_drafts is not None:
            result.engine_drafts = engine_drafts.summary()
        result.conclusion = conclusion(result)
        if not cand_fits:
            result.notes.append(f"the candidate's rows are {cand.width} wide, the draft's fc reads "
                                f"{report.reference.width}: (b) cannot run; (c) is the fix's rows")
        gaps = {k: cand.gaps[k] for k in keys if k in cand.gaps}
        if gaps:
            result.notes.append(f"{len(gaps)} candidate sequence(s) have a missing position and were replayed up to it "
                                f"(e.g. {next(iter(gaps))} at {next(iter(gaps.values()))})")
        if report.plan.label_offset:
            result.notes.append(f"compare found a position offset of {report.plan.label_offset} between the sides; "
                                f"replay pairs rows by their recorded positions")
        return result


DRAFT_TAP = "draft_steps"


class EngineDrafts:
    """The tokens the engine's draft proposed at each step (the vLLM adapter's ``draft_steps`` tap),
    compared with replay's from the same rows: step 0 always (same inputs), step k where the engine's
    input there is the sequence's own token (its earlier drafts were right)."""

    def __init__(self, store: Any) -> None:
        self.calls: dict[str, dict[int, list[tuple[int, int, list[int]]]]] = {}
        for stream in store.tap_streams(DRAFT_TAP):
            if not stream.rows:
                continue
            labels = stream.labels()
            from tracediff.store import decode_values  # noqa: PLC0415

            top = decode_values(stream.read(), stream.dtype).astype(np.int64)
            for i in np.lexsort((labels["position"], labels["step"], labels["seq"])):
                key = stream.seq_names.get(int(labels["seq"][i]), str(int(labels["seq"][i])))
                calls = self.calls.setdefault(key, {})
                calls.setdefault(int(labels["step"][i]), []).append(
                    (int(labels["position"][i]), int(labels["token_id"][i]), top[i].tolist()))
        self.same: dict[int, int] = {}
        self.compared: dict[int, int] = {}
        self.unrelated: dict[int, int] = {}

    def compare(self, key: str, starts: np.ndarray, preds: np.ndarray, tokens: np.ndarray) -> None:
        by_start = {int(rows[0][0]): rows for rows in self.calls.get(key, {}).values() if rows}
        for start, pred in zip(starts.tolist(), preds, strict=True):
            rows = by_start.get(int(start))
            if rows is None:
                continue
            for k, (position, given, top) in enumerate(rows[: pred.shape[0]]):
                truth = position + 1
                if k > 0 and not (truth < tokens.size and given == int(tokens[truth])):
                    break  # the engine's input differs from replay's teacher-forced one from here on
                if pred[k] < 0:
                    break
                self.compared[k] = self.compared.get(k, 0) + 1
                if int(pred[k]) == top[0]:
                    self.same[k] = self.same.get(k, 0) + 1
                elif int(pred[k]) not in top:
                    self.unrelated[k] = self.unrelated.get(k, 0) + 1

    def summary(self) -> dict[str, Any]:
        steps = sorted(self.compared)
        return {"steps": [{"step": k, "compared": self.compared[k], "same": self.same.get(k, 0),
                           "unrelated": self.unrelated.get(k, 0),
                           "rate": self.same.get(k, 0) / self.compared[k]} for k in steps]}


def _agreement(engine: dict[str, list[int]], replay: dict[str, list[int]]) -> dict[str, Any]:
    """How often replay's leading-run at an engine drafting step equals what the engine accepted."""
    same = total = 0
    for key, runs in replay.items():
        mine = engine.get(key)
        if not mine:
            continue
        for r, e in zip(runs, mine, strict=False):
            total += 1
            same += int(r == e)
    return {"steps": total, "same": same, "rate": (same / total) if total else None}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def conclusion(r: ReplayResult) -> str:
    """One sentence a person acts on."""
    parts = []
    if r.b is None:
        c0 = r.c["acc"][0] if r.c else None
        return (f"The server's rows do not fit the draft's fc (another hidden size): step-0 accuracy "
                f"{_pct(r.a['acc'][0])} on the reference's rows, {_pct(c0)} with the proposed fix's rows.")
    a0, b0 = r.a["acc"][0], r.b["acc"][0]
    if a0 is None or b0 is None:
        return "No position had a label: nothing to score."
    cost = 100 * (a0 - b0)
    if abs(cost) < 1.0:
        parts.append(f"the fc input costs nothing measurable (step-0 accuracy {_pct(a0)} on the reference's rows, "
                     f"{_pct(b0)} on the candidate's)")
    else:
        parts.append(f"the candidate's fc input costs {cost:.1f} points of step-0 accuracy ({_pct(a0)} -> {_pct(b0)}; "
                     f"accept length {r.a['accept_engine'] or 0:.2f} -> {r.b['accept_engine'] or 0:.2f})")
        if r.c is not None and r.c["acc"][0] is not None:
            left = 100 * (a0 - r.c["acc"][0])
            how = "all of it" if abs(left) < 1.0 else f"all but {left:.1f} points"
            parts.append(f"the proposed fix recovers {how} ({_pct(r.c['acc'][0])})")
    if r.b_server is not None and r.b_server["acc"][0] is not None:
        lost = 100 * (b0 - r.b_server["acc"][0])
        if abs(lost) >= 1.0:
            parts.append(f"the server's checkpoint costs {lost:.1f} more points on the same rows ({_pct(b0)} -> "
                         f"{_pct(r.b_server['acc'][0])}): it is not the trained draft")
        else:
            parts.append("the server's checkpoint drafts as the trained one on the same rows")
    if r.d and r.d.get("accept_engine") is not None and r.b_engine and r.b_engine.get("accept_engine") is not None:
        gap = r.b_engine["accept_engine"] - r.d["accept_engine"]
        if abs(gap) < 0.05:
            parts.append(f"the engine's own accept length ({r.d['accept_engine']:.2f}) is what replay predicts from its "
                         f"rows ({r.b_engine['accept_engine']:.2f}): nothing past the fc input costs more")
        else:
            parts.append(f"the engine's own accept length is {abs(gap):.2f} {'below' if gap > 0 else 'above'} replay "
                         f"on its own rows ({r.d['accept_engine']:.2f} vs {r.b_engine['accept_engine']:.2f}): look past "
                         f"the fc input (draft KV, vocabulary map, embedding, sampling)")
    for p in r.provenance:
        if p.get("severity") == "error":
            parts.append(p["message"])
            break
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


_PROVENANCE_KINDS = {"d2t_absolute": "draft_vocabulary", "d2t_presence": "draft_vocabulary",
                     "d2t_differs": "draft_vocabulary", "d2t_absolute_checkpoint": "draft_vocabulary",
                     "embedding_source": "draft_embedding"}


def attach_replay(report: Report, opts: ReplayOptions) -> ReplayResult:
    """Run the replay for ``report``'s stores and add it, and its findings, to the report."""
    result = run_replay(report, opts)
    report.replay = result.to_dict()
    report.findings.append(Finding("replay", "info", result.conclusion, {
        "a": _brief(result.a), "b": _brief(result.b) if result.b else None,
        "c": _brief(result.c) if result.c else None,
        "b_engine": _brief(result.b_engine) if result.b_engine else None,
        "d": result.d.get("accept_engine") if result.d else None}))
    already = {f.evidence.get("kind") for f in report.findings if f.kind == "draft_vocabulary"}
    for p in result.provenance:
        if p["kind"] in already:
            continue  # compare reported it from the recorded provenance already
        report.findings.append(Finding(_PROVENANCE_KINDS.get(p["kind"], "draft_vocabulary"), p["severity"],
                                       p["message"][0].upper() + p["message"][1:] + ".",
                                       {k: v for k, v in p.items() if k not in ("severity", "message")}))
    gap = _engine_gap(result)
    if gap is not None:
        report.findings.append(Finding("draft_path", "warning", gap[0], gap[1]))
    drafts = _engine_draft_finding(result)
    if drafts is not None:
        report.findings.append(Finding("draft_path", drafts[0], drafts[1], drafts[2]))
    return result


def _engine_draft_finding(r: ReplayResult) -> tuple[str, str, dict[str, Any]] | None:
    """The engine's draft proposes tokens replay's does not even rank in its top 4, from the same rows
    and inputs: its draft computes something else (positions, KV, embedding, d2t, lm_head). Near ties
    (replay's token in the engine's top 4) are numerics and only counted."""
    steps = (r.engine_drafts or {}).get("steps") or []
    if not steps:
        return None
    first = steps[0]
    compared, same, unrelated = first["compared"], first["same"], first["unrelated"]
    if not unrelated:
        return None
    severity = "error" if unrelated * 10 >= compared else "warning"
    return (severity, f"The engine's draft proposed a token outside replay's top 4 at {unrelated} of {compared} step-0 "
                      f"drafts ({same} identical) from the same fc rows and input tokens: the engine's draft path "
                      f"computes something else (draft positions or KV, embedding, lm_head, d2t).",
            {"engine_drafts": r.engine_drafts})


def _brief(t: dict[str, Any]) -> dict[str, Any]:
    return {"acc": t["acc"], "accept_engine": t["accept_engine"], "accept_specforge": t["accept_specforge"],
            "starts": t["starts"]}


def _engine_gap(r: ReplayResult) -> tuple[str, dict[str, Any]] | None:
    """A warning when the engine accepts fewer (or more) drafts than replay on its own rows predicts,
    beyond 3 standard errors of replay's own estimate."""
    if not (r.d and r.d.get("accept_engine") is not None and r.b_engine and r.b_engine.get("accept_engine")):
        return None
    gap = r.b_engine["accept_engine"] - r.d["accept_engine"]
    se = r.b_engine.get("accept_engine_se") or 0.0
    if abs(gap) <= max(3 * se, 0.05):
        return None
    return (f"The engine's accept length ({r.d['accept_engine']:.2f}) is {abs(gap):.2f} "
            f"{'below' if gap > 0 else 'above'} what its own fc rows give the draft in replay "
            f"({r.b_engine['accept_engine']:.2f} +- {se:.2f}): the loss is past the fc input (draft KV or positions, "
            f"vocabulary map, embedding, verification, sampling).",
            {"engine": r.d["accept_engine"], "replay": r.b_engine["accept_engine"], "replay_se": se, "gap": gap})


__all__ = ["ReplayOptions", "ReplayResult", "attach_replay", "engine_accept", "fixed_rows", "read_send_report",
           "run_replay"]
