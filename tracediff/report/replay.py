"""The replay table (what a mismatch costs), for every renderer: rows a/b/c/b@engine/d, columns the
trainers' and the engines' numbers. Formatting only; the numbers come from ``report.replay``."""

from __future__ import annotations

from typing import Any

ROWS = (("a", "a  reference's rows (trainer)"), ("b", "b  candidate's rows (server)"),
        ("b_server", "b  same rows, the server's checkpoint"),
        ("c", "c  candidate's rows, fix applied"), ("z", "z  no fc input (tokens alone)"),
        ("b_engine", "b' candidate, at the engine's draft starts"))


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(replay: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the replay table."""
    k = int(replay.get("steps") or 0)
    header = ["replay", *[f"acc step {i}" for i in range(k)], "cond acc (last)", "accept (SpecForge)",
              "accept (engine, +1)", "starts"]
    rows: list[list[str]] = []
    for key, name in ROWS:
        t = replay.get(key)
        if not t:
            continue
        acc = list(t.get("acc") or [None] * k)
        cond = t.get("cond_acc") or [None]
        rows.append([name, *[_pct(a) for a in acc], _pct(cond[-1] if cond else None), _num(t.get("accept_specforge")),
                     _num(t.get("accept_engine")), str(t.get("starts", "-"))])
    d = replay.get("d")
    if d and d.get("accept_engine") is not None:
        agree = d.get("replay_agrees") or {}
        rate = f" (replay = engine at {_pct(agree.get('rate'))} of {agree.get('steps')} steps)" if agree.get("steps") else ""
        rows.append([f"d  the engine's own report{rate}", *["" for _ in range(k)], "", "", _num(d["accept_engine"]),
                     str(d.get("verify_steps", "-"))])
    return header, rows


def by_position(replay: dict[str, Any]) -> list[str]:
    """Step-0 accuracy per position bucket, one line per side."""
    out = []
    for key, _name in ROWS[:3]:
        t = replay.get(key) or {}
        buckets = t.get("acc_by_position") or []
        if buckets:
            out.append(f"{key}: " + ", ".join(f"{b['positions']} {_pct(b['acc'])} ({b['rows']})" for b in buckets))
    return out


def text_lines(replay: dict[str, Any]) -> list[str]:
    header, rows = table(replay)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(  # noqa: E731
        zip(r, widths, strict=True)))
    lines = [fmt(header)] + [fmt(r) for r in rows]
    draft = replay.get("draft") or {}
    lines.append(f"  draft {draft.get('path')} ({draft.get('naming')}, {draft.get('num_aux')} x "
                 f"{draft.get('target_hidden_size')} -> {draft.get('hidden_size')}, vocabulary "
                 f"{draft.get('draft_vocab_size')} of {draft.get('vocab_size')}, d2t "
                 f"{(draft.get('d2t') or {}).get('kind', 'none')}, embedding from the {draft.get('embed_from')}); "
                 f"{replay.get('sequences')} sequences, {replay.get('positions')} positions, {replay.get('steps')} steps")
    drafts = (replay.get("engine_drafts") or {}).get("steps") or []
    if drafts:
        lines.append("  the engine's own draft tokens (draft_steps): " + ", ".join(
            f"step {d['step']} {d['same']}/{d['compared']} same as replay" for d in drafts))
    fix = replay.get("fix") or {}
    if fix.get("slots_from_reference"):
        lines.append(f"  c: slots {fix['slots_from_reference']} are fed by no candidate segment; taken from the reference "
                     f"(what the fixed config would capture)")
    for line in by_position(replay):
        lines.append(f"  step-0 accuracy by position, {line}")
    for note in replay.get("notes") or []:
        lines.append(f"  note: {note}")
    return lines


def markdown_lines(replay: dict[str, Any], escape: Any) -> list[str]:
    header, rows = table(replay)
    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape(c) for c in r) + " |" for r in rows]
    return lines


def html_table(replay: dict[str, Any], escape: Any) -> str:
    header, rows = table(replay)
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='replay'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def chain_steps(replay_chain: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of ``replay --against-chain``'s per-step table: the checkpoint replayed on the
    server's inputs against what the served draft produced (Report.replay_chain)."""
    header = ["step", "status", "rows", "top-1 agreement", "first diverging tap"]
    rows = [[str(s["step"]), str(s["status"]), str(s["rows"]), _pct(s.get("top1_agreement")),
             str(s.get("first_diverging") or ("; ".join(s.get("why_cannot_tell") or []) or "-"))]
            for s in replay_chain.get("steps") or []]
    return header, rows


CHAIN_TITLE = "Replay against the server's draft chain (the checkpoint on the server's inputs, per draft step)"
