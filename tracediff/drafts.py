"""Facts about an EAGLE-3 draft's vocabulary map and weights that both the recorders (provenance)
and replay (checks) need; no framework import, no I/O.

``d2t`` maps a draft-vocabulary id to a target id. Every engine reads it as *offsets*: target id =
``i + d2t[i]``. A map holding the target ids themselves (*absolute ids*, a converter bug seen in the
wild) then sends draft id i to ``i + id_i``: nearly every drafted token is wrong while the fc input
is perfect.

torch is imported by the functions that take tensors (the recorders and replay have it loaded
already); a compare reads only :func:`recorded_d2t_problems` and never imports it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracediff.errors import UsageError

if TYPE_CHECKING:
    import torch

#: Both readings are valid maps and no t2d decides; absolute ids are by far the likelier.
AMBIGUOUS = "absolute ids (probably: read as offsets it is valid too, but then no two kept ids are adjacent)"


def tensor_sha256(t: torch.Tensor, limit: int = 1 << 26) -> str:
    """sha256 of a tensor's bytes (of the first ``limit`` bytes of very large ones, said in the value)."""
    import torch  # noqa: PLC0415

    flat = t.detach().reshape(-1)
    size = 1 if flat.dtype == torch.bool else flat.element_size()
    n = flat.numel() * size
    # Cut on the tensor's own device: a 1 GB embedding on a GPU copies only the hashed part to the host.
    data = flat[: max(limit // size, 1)].to("cpu").contiguous()
    raw = data.to(torch.uint8) if data.dtype == torch.bool else data.view(torch.uint8)
    digest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return digest if n <= limit else f"{digest} (first {raw.numel()} of {n} bytes)"


def d2t_kind(d2t: torch.Tensor, vocab: int | None, t2d: torch.Tensor | None = None) -> str:
    """``offsets``, ``absolute ids``, :data:`AMBIGUOUS` or ``neither (not a strictly increasing map)``
    (:func:`d2t_kind_of_array` on the tensors' values)."""
    values = d2t.detach().to("cpu").long().reshape(-1).numpy()
    kept = None if t2d is None else t2d.detach().to("cpu").reshape(-1).bool().numpy()
    return d2t_kind_of_array(values, vocab, kept)


def d2t_kind_of_array(values: Any, vocab: int | None, t2d: Any = None) -> str:
    """:func:`d2t_kind` on numpy arrays (``tracediff preflight`` reads d2t without torch).

    As offsets, ``i + d2t[i]`` must be strictly increasing target ids inside the vocabulary; as
    absolute ids, ``d2t[i]`` itself must be. A map can be both only when every kept target id is at
    least 2 from the next (``d2t`` then strictly increases either way): ``t2d`` (the kept target ids'
    mask, which engines ignore) decides then, else the answer is :data:`AMBIGUOUS`."""
    import numpy as np  # noqa: PLC0415

    values = np.asarray(values).astype(np.int64).reshape(-1)
    if values.size == 0:
        return "neither (not a strictly increasing map)"
    idx = np.arange(values.size, dtype=np.int64)

    def valid(ids: Any) -> bool:
        inside = vocab is None or (int(ids.max()) < vocab and int(ids.min()) >= 0)
        return inside and (ids.size == 1 or bool((ids[1:] > ids[:-1]).all()))

    as_offsets, as_absolute = valid(idx + values), valid(values) and values.size > 1
    if as_offsets and as_absolute:
        if t2d is not None:
            kept = np.nonzero(np.asarray(t2d).reshape(-1).astype(bool))[0]
            if kept.size == values.size:
                if np.array_equal(kept, idx + values):
                    return "offsets"
                if np.array_equal(kept, values):
                    return "absolute ids"
        # An offsets map increases strictly only if no two kept ids are adjacent, which a draft
        # vocabulary of the most frequent tokens never is.
        return AMBIGUOUS
    if as_absolute:
        return "absolute ids"
    return "offsets" if as_offsets else "neither (not a strictly increasing map)"


def d2t_facts(d2t: Any, vocab: int | None, t2d: Any = None) -> dict[str, Any]:
    """Present, size, sha256 and kind of a d2t map (``{"present": False}`` without one)."""
    import torch  # noqa: PLC0415

    if not isinstance(d2t, torch.Tensor):
        return {"present": False}
    values = d2t.detach().to("cpu").long().reshape(-1)
    return {"present": True, "size": int(values.numel()), "sha256": tensor_sha256(values),
            "kind": d2t_kind(values, vocab, t2d if isinstance(t2d, torch.Tensor) else None)}


def _find(meta: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in nested dicts (shallowest first)."""
    stack = [meta]
    while stack:
        cur = stack.pop(0)
        if isinstance(cur, dict):
            if key in cur:
                return cur[key]
            stack.extend(v for v in cur.values() if isinstance(v, dict))
    return None


def compare_provenance(draft: Any, server_draft: Any, candidate_meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Differences between the draft replay loaded and what the server recorded about its own draft
    (``d2t``, embedding source), each ``{severity, kind, message, ...}``."""
    out: list[dict[str, Any]] = []
    engine_draft = _find(candidate_meta, "draft") or {}
    served = engine_draft.get("d2t") if isinstance(engine_draft, dict) else None
    mine = getattr(server_draft, "d2t", None) or {}
    if isinstance(served, dict):
        if served.get("present") and str(served.get("kind", "")).startswith("absolute ids"):
            out.append({"severity": "error", "kind": "d2t_absolute",
                        "message": "the server's d2t is absolute ids: draft id i maps to i + d2t[i] instead of d2t's "
                                   "own target id (convert it to offsets: d2t[i] = target_id[i] - i)",
                        "server": served})
        elif served.get("present") != mine.get("present"):
            out.append({"severity": "error", "kind": "d2t_presence",
                        "message": f"the server's draft {'has' if served.get('present') else 'has no'} d2t map, the "
                                   f"replayed draft {'has' if mine.get('present') else 'has none'}",
                        "server": served, "replayed": mine})
        elif served.get("present") and served.get("sha256") != mine.get("sha256"):
            out.append({"severity": "warning", "kind": "d2t_differs",
                        "message": f"the server's d2t (sha256 {str(served.get('sha256'))[:12]}, {served.get('kind')}) is "
                                   f"not the replayed draft's ({str(mine.get('sha256'))[:12]}, {mine.get('kind')})",
                        "server": served, "replayed": mine})
    mine_kind = mine.get("kind")
    if mine.get("present") and str(mine_kind or "").startswith("absolute ids"):
        out.append({"severity": "error", "kind": "d2t_absolute_checkpoint",
                    "message": f"the draft checkpoint {getattr(server_draft, 'path', '')}'s d2t is absolute ids: every "
                               f"engine reads it as offsets, so draft id i maps to i + d2t[i]"})
    served_embed = engine_draft.get("embed_tokens_from") if isinstance(engine_draft, dict) else None
    my_embed = getattr(server_draft, "embed_from", None)
    if served_embed and my_embed and served_embed != my_embed and my_embed != "missing":
        out.append({"severity": "warning", "kind": "embedding_source",
                    "message": f"the server's draft took its embedding from the {served_embed}, the replayed one from "
                               f"the {my_embed}"})
    return out


def recorded_d2t_problems(meta: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """What a side's own recorded draft provenance says is wrong with its vocabulary map, without a
    draft to replay: a d2t of absolute ids (compare reports it from provenance alone)."""
    engine_draft = _find(meta, "draft") or {}
    d2t = engine_draft.get("d2t") if isinstance(engine_draft, dict) else None
    if isinstance(d2t, dict) and d2t.get("present") and str(d2t.get("kind", "")).startswith("absolute ids"):
        return [{"severity": "error", "kind": "d2t_absolute",
                 "message": f"the {side}'s d2t is absolute ids (as its engine recorded it, {d2t.get('size')} entries, "
                            f"sha256 {str(d2t.get('sha256'))[:12]}): the engine reads d2t as offsets, so draft id i "
                            f"maps to i + d2t[i] and nearly every drafted token is wrong while the fc input can be "
                            f"perfect; convert it to offsets (d2t[i] = target_id[i] - i)",
                 "recorded": d2t}]
    return []


__all__ = ["compare_provenance", "d2t_facts", "d2t_kind", "recorded_d2t_problems", "tensor_sha256"]


def read_json_config(path: Path, what: str) -> dict[str, Any]:
    """A checkpoint's config.json (a draft's, a target's; a folder or the file) as a dict; a missing or unreadable file is a :class:`UsageError` naming it."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"{path}: {what} config.json not found; give the {what} checkpoint's folder")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: top level is {type(doc).__name__}, expected an object")
    return doc
