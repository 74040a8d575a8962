"""Replay against a server's draft chain: does the served draft compute what the checkpoint computes?

A server recorded with ``--draft-chain`` holds, per drafter call, the fc input rows its draft read
and the draft's own points along its forward (fc output, decoder layer input and output, final
norm, the logits' top k; docs/draft-chain.md). Replay runs the checkpoint (``--draft``) on the same
inputs and writes the same points into a trace store of its own, then compare's chain walk
(tracediff/compare/chain.py: each tap's noise budget, norm ratio and relative error, top-1 agreement
with the margin rule) names the first tap where the two differ:

* step 0 on every fc row the server recorded (row p, input token x_{p+1}, position p, attending to
  rows 0..p), labelled as the server labelled it;
* step k >= 1 the way the server ran it: from each row of the server's step-k taps (position p + k,
  token_id = the step's input token: the server's own proposal of step k-1), the hidden state replay's
  own step k-1 output from start p, attending to the step-0 keys of positions 0..p and its own keys of
  steps 1..k. Every replayed row carries the server row's labels, so the two pair row for row.

The inputs are the server's (its fc rows, its input tokens): a tap that diverges says the draft's
forward differs, not what it was fed. No framework knowledge; torch only through the replayed draft.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracediff.adapters._chain import topk_row
from tracediff.compare.chain import POINT_CAUSES, POINT_NAMES, chain_taps
from tracediff.compare.results import Report
from tracediff.errors import CompareError, UsageError
from tracediff.replay.chain_stores import TapRows, pairing_keys, server_rows, write_store
from tracediff.replay.draft import Eagle3Draft, replay_dtype
from tracediff.replay.rows import SideRows
from tracediff.store import open_store

#: What a server store without chain taps gets (exit 2): replay has nothing to compare its steps with.
NO_CHAIN = "cannot tell: record the server with --draft-chain"
#: The points replay computes, in forward order (the fc input is the server's own rows).
POINTS = ("fc_out", "layer_in", "layer_out", "norm_out", "logits_topk")


class NoServerChainError(CompareError):
    """The server store holds no draft chain: nothing to compare replay's steps with."""


@dataclass
class ChainReplayOptions:
    draft: str
    target: str | None = None
    max_sequences: int | None = None
    dtype: str = "auto"  # --replay-dtype: auto (the checkpoint's) | float32 | bfloat16
    stage: Callable[[str], None] | None = None


@dataclass
class ReplayedChain:
    """What replay computed: per tap name, its rows (float32) and the server's labels of them."""

    taps: dict[str, TapRows] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)  # step -> server rows replay could not run
    keys: set[str] = field(default_factory=set)  # the sequences replayed
    sequences: int = 0

    def add(self, tap: str, rows: torch.Tensor, labels: dict[str, Any]) -> None:
        self.taps.setdefault(tap, TapRows()).add(rows.detach().float().numpy(), labels)


def replay_against_chain(server: str | Path, opts: ChainReplayOptions) -> Report:
    """Replay ``opts.draft`` on ``server``'s recorded fc rows and input tokens, and compare its chain
    with the server's (compare's chain walk; the replay is the reference, the server the candidate).
    The report's ``replay_chain`` holds the per-step summary and the conclusion."""
    from tracediff.compare import CompareOptions, compare_stores  # noqa: PLC0415

    with open_store(server) as store:
        taps = chain_taps(store)
        if not any(order > 0 for (_step, order) in taps) or (0, 0) not in taps:
            raise NoServerChainError(f"{NO_CHAIN} ({store.path} holds no draft chain taps)")
        draft = Eagle3Draft(opts.draft, opts.target, dtype=replay_dtype(opts.dtype, opts.draft))
        width = store.tap_streams(taps[(0, 0)][0])[0].width
        if draft.info.num_aux * draft.info.target_hidden_size != width:
            raise UsageError(f"--draft {draft.info.path}: its fc takes {draft.info.num_aux} x "
                             f"{draft.info.target_hidden_size} inputs, the server's {taps[(0, 0)][0]} rows are {width} "
                             f"wide: another draft?")
        if opts.stage is not None:
            opts.stage("replaying the draft's steps")
        replayed = _replay(store, taps, draft, opts)
        served = server_rows(store, taps, replayed.keys)
        keys = pairing_keys(served, taps)
        dtype = str(draft.fc_weight.dtype).removeprefix("torch.")
        own = {tap: {"compute_dtype": dtype, "module": f"tracediff replay ({draft.info.path})"}
               for tap, _chain in taps.values() if tap != taps[(0, 0)][0]}
        with tempfile.TemporaryDirectory(prefix="tracediff-replay-chain-") as tmp:
            write_store(Path(tmp) / "replay.zarr", store, taps, replayed.taps, "replay", keys, own)
            write_store(Path(tmp) / "server.zarr", store, taps, served, "server", keys)
            if opts.stage is not None:
                opts.stage("walking the draft chain")
            report = compare_stores(Path(tmp) / "replay.zarr", Path(tmp) / "server.zarr", CompareOptions())
    _name_the_stores(report, Path(tmp), server, opts.draft)
    summary = summarise(report.chain or [], replayed, draft)
    report.replay_chain = summary
    return report


def _name_the_stores(report: Report, tmp: Path, server: str | Path, draft: str) -> None:
    """The report names the server's store and the replay, never the temporary copies compare read;
    its commands (the Fix box) rerun this replay. The 'what to record next' box is about the fc
    input's wiring, which here is the server's own rows on both sides: left out."""
    again = f"tracediff replay {server} --draft {draft} --against-chain"
    swaps = ((f"tracediff compare {tmp / 'replay.zarr'} {tmp / 'server.zarr'}", again),
             (str(tmp / "server.zarr"), str(server)), (str(tmp / "replay.zarr"), f"replay of {draft}"))

    def swap(value: Any) -> Any:
        if isinstance(value, str):
            for old, new in swaps:
                value = value.replace(old, new)
            return value
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    report.reference.path, report.candidate.path = f"replay of {draft}", str(server)
    report.fix, report.chain = swap(report.fix), swap(report.chain)
    report.record_next = None
    for finding in report.findings:
        finding.message, finding.evidence = swap(finding.message), swap(finding.evidence)


def _replay(store: Any, taps: dict[tuple[int, int], tuple[str, dict[str, Any]]], draft: Eagle3Draft,
            opts: ChainReplayOptions) -> ReplayedChain:
    fc_tap = taps[(0, 0)][0]
    rows = SideRows(store, fc_tap)
    later = _server_steps(store, taps)
    out = ReplayedChain()
    keys = sorted(rows.sequences)[: opts.max_sequences] if opts.max_sequences else sorted(rows.sequences)
    for key in keys:
        seq = rows.sequences[key]
        out.keys.add(key)
        values = torch.from_numpy(rows.values(seq))
        first = torch.from_numpy(seq.next_token_id).long()
        n = seq.length
        fc_labels = {"seq": key, "position": seq.positions, "token_id": seq.token_id,
                     "next_token_id": seq.next_token_id, "phase": seq.phase, "step": seq.step}
        out.add(fc_tap, values, fc_labels)
        known = first >= 0
        if not bool(known.any()):
            continue
        # Step 0 on every row with an input token (the last row of a sequence may have none).
        ids = torch.where(known, first, torch.zeros_like(first))
        keys_, values_ = [], []  # the draft's KV: step 0's of every row, then each step's own
        points: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            hidden0 = draft.project(values)
            logits, hidden = draft.step(hidden0, ids, torch.arange(n), keys_, values_, 0, taps=points)
        query = torch.nonzero(known).reshape(-1)
        step0 = {name: column[query.numpy()] for name, column in fc_labels.items() if name != "seq"}
        _emit(out, taps, 0, {name: t[query] for name, t in {"fc_out": hidden0, **points, "logits": logits}.items()},
              draft, {"seq": key, **step0})
        out.sequences += 1
        _later_steps(out, taps, later, key, draft, hidden, keys_, values_)
    return out


def _later_steps(out: ReplayedChain, taps: dict[tuple[int, int], tuple[str, dict[str, Any]]],
                 later: dict[int, dict[str, dict[str, np.ndarray]]], key: str, draft: Eagle3Draft,
                 hidden: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Steps k >= 1 of one sequence from the starts the server drafted from (those of its step-1 rows),
    each reading the server's input token of that step and replay's own state of step k-1. A start the
    server has no row for at step k runs on a placeholder token and is not written (its keys are its
    own: no other start reads them); one whose input token is outside the embedding ends there."""
    vocab = int(draft.embed.shape[0]) if draft.embed is not None else 0
    first = later.get(1, {}).get(key)
    if first is None:
        return
    starts = np.unique(first["position"] - 1)
    starts = starts[(starts >= 0) & (starts < hidden.shape[0])]
    if not starts.size:
        return
    starts_t = torch.from_numpy(starts).long()
    state, alive = hidden[starts_t], np.ones(starts.size, dtype=bool)
    k = 1
    while k in later and (rows := later[k].get(key)) is not None:
        want = rows["position"] - k
        where = np.minimum(np.searchsorted(starts, want), starts.size - 1)
        found = starts[where] == want
        row_of = np.full(starts.size, -1)
        row_of[where[found]] = np.flatnonzero(found)
        tokens = np.zeros(starts.size, dtype=np.int64)
        tokens[where[found]] = rows["token_id"][found]
        alive &= (row_of < 0) | ((tokens >= 0) & (tokens < vocab))
        emit = (row_of >= 0) & alive
        out.skipped[k] = out.skipped.get(k, 0) + int((~found).sum()) + int(((row_of >= 0) & ~alive).sum())
        if not emit.any():
            return
        points: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            logits, state = draft.step(state, torch.from_numpy(np.where(alive, tokens, 0)), starts_t + k, keys, values,
                                       k, starts=starts_t, taps=points)
        sel = np.flatnonzero(emit)
        labels = {name: column[row_of[sel]] for name, column in rows.items()}
        _emit(out, taps, k, {name: t[torch.from_numpy(sel)] for name, t in {**points, "logits": logits}.items()}, draft,
              {"seq": key, **labels})
        k += 1


def _emit(out: ReplayedChain, taps: dict[tuple[int, int], tuple[str, dict[str, Any]]], step: int,
          points: dict[str, torch.Tensor], draft: Eagle3Draft, labels: dict[str, Any]) -> None:
    """One step's points, for the taps the server recorded at that step, under the server's tap names."""
    for order, point in enumerate(POINTS, start=1):
        if (step, order) in taps:
            rows = topk_row(points["logits"], draft.d2t) if point == "logits_topk" else points[point]
            out.add(taps[(step, order)][0], rows, labels)


def _server_steps(store: Any, taps: dict[tuple[int, int], tuple[str, dict[str, Any]]]) -> dict[int, dict[str, dict[str, np.ndarray]]]:
    """step k >= 1 -> sequence key -> the labels of the server's rows of that step (one per position,
    the first of each), read from the first tap of the step."""
    out: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for step in sorted({s for s, _o in taps if s >= 1}):
        tap = taps[(step, min(o for s, o in taps if s == step))][0]
        by_seq: dict[str, dict[str, np.ndarray]] = {}
        for stream in store.tap_streams(tap):
            if not stream.rows:
                continue
            labels = stream.labels()
            valid = labels["valid"].astype(bool) & (labels["seq"] >= 0) & (labels["position"] >= 0)
            for code in np.unique(labels["seq"][valid]):
                key = stream.seq_names.get(int(code), str(int(code)))
                if key in by_seq:
                    continue  # another writer (TP rank) of the same request
                idx = np.flatnonzero(valid & (labels["seq"] == code))
                idx = idx[np.unique(labels["position"][idx], return_index=True)[1]]
                by_seq[key] = {name: labels[name][idx] for name in ("position", "token_id", "next_token_id", "phase",
                                                                    "step")}
        out[step] = by_seq
    return out


def summarise(chain: list[dict[str, Any]], replayed: ReplayedChain, draft: Eagle3Draft) -> dict[str, Any]:
    """Per draft step: its status (match, diverged, or cannot_tell where a tap of it has no rows on a
    side or could not be compared), its top-1 agreement, its first diverging tap; the first diverging
    tap overall and the sentence a person acts on."""
    steps: list[dict[str, Any]] = []
    for step in sorted({int(x["step"]) for x in chain}):
        links = [x for x in chain if int(x["step"]) == step]
        diverged = next((x for x in links if x["status"] == "diverged"), None)
        untold = [x for x in links if x["status"] not in ("match", "diverged")]
        logits = next((x for x in links if x["point"] == "logits_topk" and x["status"] in ("match", "diverged")), None)
        metrics = (logits or {}).get("metrics") or {}
        status = "diverged" if diverged else "cannot_tell" if untold else "match"
        why = [f"{x['tap_candidate'] or x['tap_reference']}: {x['status']}" + (f" ({x['found'][0]})" if x["found"] else "")
               for x in untold]
        if replayed.skipped.get(step):
            why.append(f"{replayed.skipped[step]} server rows not replayed (no earlier step for their start, or an "
                       f"input token outside the embedding)")
        steps.append({"step": step, "status": status, "rows": max((int(x["rows"]) for x in links), default=0),
                      "top1_agreement": metrics.get("target_top1_agreement"),
                      "draft_top1_agreement": metrics.get("draft_top1_agreement"),
                      "first_diverging": diverged["tap_candidate"] if diverged else None, "why_cannot_tell": why})
    root = next((x for x in chain if x["status"] == "diverged"), None)
    fc_in = next((x for x in chain if x["point"] == "fc_in"), None)
    if root is not None and root["point"] != "fc_in" and fc_in is not None and fc_in["status"] == "match":
        verdict = "diverged"
        conclusion = (f"the draft's inputs are the same, its outputs are not: look at {root['tap_candidate']} "
                      f"({POINT_NAMES.get(root['point'], root['point'])}, step {root['step']}): "
                      f"{POINT_CAUSES.get(root['point'], root['point'])}")
    elif root is not None:
        verdict = "diverged"
        conclusion = f"the replayed draft and the served one differ from {root['tap_candidate']} on"
    elif any(s["status"] == "match" for s in steps):
        told = [s["step"] for s in steps if s["status"] == "match"]
        untold = [s["step"] for s in steps if s["status"] == "cannot_tell"]
        verdict = "match"
        conclusion = "the served draft computes what the checkpoint computes"
        if untold:
            conclusion += (f" at step{'s' if len(told) > 1 else ''} {', '.join(map(str, told))}; cannot tell at "
                           f"step{'s' if len(untold) > 1 else ''} {', '.join(map(str, untold))} (rows missing)")
    else:
        verdict = "cannot_tell"
        conclusion = "cannot tell: no step of the server's chain could be paired with the replay"
    return {"draft": draft.info.to_dict(), "sequences": replayed.sequences, "verdict": verdict,
            "first_diverging": root["tap_candidate"] if root else None, "steps": steps,
            "conclusion": conclusion[0].upper() + conclusion[1:] + "."}


__all__ = ["NO_CHAIN", "ChainReplayOptions", "NoServerChainError", "replay_against_chain", "summarise"]
