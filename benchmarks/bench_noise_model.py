#!/usr/bin/env python
"""Noise-model evidence: how server drift and the distance between layers grow with depth.

Run by hand (not a test)::

    python benchmarks/bench_noise_model.py                              # all four architectures, prints
    python benchmarks/bench_noise_model.py --archs llama qwen3          # a subset
    python benchmarks/bench_noise_model.py --out /tmp/noise-model.md    # also writes the tables there

What it measures, on the tiny random-weight models of real depth of
:func:`tracediff.testing.models.build_tiny_model` (hidden size 64, massive activations included;
Llama 32 layers, Qwen3 36, Mistral 40, DeepSeek-V3 61, as ``tracediff.testing.models.DEEP_LAYERS``),
fed seeded random token ids (``--seqs`` sequences x ``--tokens`` tokens, one forward each):

1. **Drift**: the standardised relative error between the fp32 model's hidden state ``hs{l}`` (HF
   numbering) and the same state of the model as a server runs it
   (:func:`~tracediff.testing.models.server_model` ``"bf16"`` and ``"fp8"``), at every
   ``l = 1..L-1``.
2. **Neighbour distance**: the same error between ``hs{l}`` and ``hs{l-1}`` / ``hs{l+1}`` of the fp32
   model (the smaller of the two is reported), i.e. how far the wrong layer looks. For ``l = L-1``
   the upper neighbour is the last decoder layer's raw output (``pre_norm``), not HF's post-norm
   ``hs{L}``.
3. **Spacing**: the distance ``d(l, l-D)`` for ``D = 1, 2, 4, 8, ...`` (plus the spacings of SGLang's
   default capture layers) at the three default capture layers, and how well ``d(D)/sqrt(D)`` and
   ``d(D)/D`` estimate the true neighbour distance ``d(1) = d(l, l-1)`` there (ratio estimate/true).

Errors are measured the way compare measures them: the reference's scales
``tracediff.compare.plan.segments.segment_scales(ref_rows, H)`` (looked up at run time: whatever compare does to
massive dimensions, this does too), then ``sqrt(relative_error(cand, ref, mean, scale))``. For
comparison, the ``ord`` columns give the same error over the ordinary dimensions only (the massive
ones, ``tm.massive.dims``, dropped), standardised by the plain per-dimension standard deviation.

For DeepSeek-V3 (a random-weight deep mixture of experts) it also counts routing flips (tokens whose
routed expert set differs from the fp32 model's at a layer) and repeats the drift with the router
kept in fp32 (the gate weights restored from the fp32 model after ``server_model``; transformers'
router already casts its input to fp32) and with the routes pinned to the fp32 model's (a
diagnostic, not a server: it shows how much of the drift the flips cause).

Prints the per-depth and spacing tables for the first of ``--seeds`` (default 0 1 2) and a summary
row per (architecture, seed). Writes nothing but ``--out`` (if given). About 50-65 s on 2 cores, most
of it building the three 61-layer models.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --------------------------------------------------------------------------------------------------
# States and errors
# --------------------------------------------------------------------------------------------------


def _states(tm: Any, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{l: [n, H] float32}`` for ``hs0..hs{L-1}``, and ``L`` -> the last decoder layer's raw output."""
    from tracediff.testing.tiny_llama import layer_states

    with torch.no_grad():
        states, _ = layer_states(tm, ids)
    width = tm.hidden_size
    out = {i: states[f"hs{i}"].reshape(-1, width).float().contiguous() for i in range(tm.num_layers)}
    out[tm.num_layers] = states["pre_norm"].reshape(-1, width).float().contiguous()
    return out


class Meter:
    """The two errors of a candidate against a reference ([n, H] rows): compare's and ordinary-only."""

    def __init__(self, hidden: int, massive_dims: tuple[int, ...]) -> None:
        from tracediff import segments

        self.segments = segments
        self.hidden = hidden
        keep = torch.ones(hidden, dtype=torch.bool)
        keep[list(massive_dims)] = False
        self.keep = keep

    def standardised(self, cand: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
        """``sqrt`` of compare's squared standardised relative error, and how many dimensions its
        scales excluded (0 when segment_scales does not say)."""
        scales = self.segments.segment_scales(ref, self.hidden)
        sq = self.segments.relative_error(cand, ref, scales.mean[0], scales.scale[0])
        excluded = getattr(scales, "excluded", ()) or (0,)
        return math.sqrt(max(sq, 0.0)), int(excluded[0])

    def per_token_median(self, cand: torch.Tensor, ref: torch.Tensor) -> float:
        """The median over tokens of each token's standardised error (its squared error over the
        mean squared standardised norm of the reference rows): robust to a few tokens that moved far."""
        scales = self.segments.segment_scales(ref, self.hidden)
        mean, scale = scales.mean[0], scales.scale[0]
        num = (((cand - ref) / scale) ** 2).sum(1, dtype=torch.float64)
        den = (((ref - mean) / scale) ** 2).sum(1, dtype=torch.float64).mean()
        return float((num / den).sqrt().median())

    def ordinary(self, cand: torch.Tensor, ref: torch.Tensor) -> float:
        """The same error over the ordinary dimensions, standardised by each one's plain std."""
        c, r = cand[:, self.keep].double(), ref[:, self.keep].double()
        mean, std = r.mean(0), r.std(0).clamp_min(1e-30)
        num = (((c - r) / std) ** 2).sum()
        den = (((r - mean) / std) ** 2).sum()
        return math.sqrt(float(num / den))


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3 routing: flips, fp32 router, pinned routes
# --------------------------------------------------------------------------------------------------


def _gates(tm: Any) -> dict[int, nn.Module]:
    """``{decoder layer index: its router}`` (DeepSeek's MoE layers; empty for dense models)."""
    out = {}
    for i, layer in enumerate(tm.model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            out[i] = gate
    return out


def _record_routes(tm: Any, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """Each router's output ``(logits, weights, indices)`` on one forward of ``ids``."""
    routes: dict[int, tuple[torch.Tensor, ...]] = {}
    handles = []
    for i, gate in _gates(tm).items():
        def hook(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            routes[i] = tuple(t.detach().clone() for t in out)
        handles.append(gate.register_forward_hook(hook))
    try:
        _states(tm, ids)
    finally:
        for h in handles:
            h.remove()
    return routes


def _flipped_so_far(ref: dict[int, tuple[torch.Tensor, ...]], cand: dict[int, tuple[torch.Tensor, ...]]) -> dict[int, torch.Tensor]:
    """Per MoE decoder layer ``i``: which tokens ([n] bool) had a routed expert set differing from the
    reference's at some MoE layer ``<= i``."""
    out, flipped = {}, None
    for i in sorted(ref):
        now = (ref[i][2].sort(-1).values != cand[i][2].sort(-1).values).any(-1)
        flipped = now if flipped is None else flipped | now
        out[i] = flipped.clone()
    return out


def _fp32_router(server: Any, trainer: Any) -> Any:
    """``server`` with every router back in float32, its weights those of ``trainer`` (in place)."""
    ref = _gates(trainer)
    with torch.no_grad():
        for i, gate in _gates(server).items():
            gate.to(torch.float32)
            gate.weight.copy_(ref[i].weight)
            gate.e_score_correction_bias.copy_(ref[i].e_score_correction_bias)
    return server


def _pin_routes(server: Any, routes: dict[int, tuple[torch.Tensor, ...]]) -> list[Any]:
    """Make ``server``'s routers return the recorded routes (hooks; remove the returned handles)."""
    handles = []
    for i, gate in _gates(server).items():
        def hook(_m: nn.Module, _a: Any, out: Any, i: int = i) -> Any:
            logits, weights, indices = routes[i]
            return (logits.to(out[0].dtype), weights.to(out[1].dtype), indices)
        handles.append(gate.register_forward_hook(hook))
    return handles


# --------------------------------------------------------------------------------------------------
# One architecture
# --------------------------------------------------------------------------------------------------


def _report_depths(num_layers: int, capture: list[int]) -> list[int]:
    """The depths the per-depth table shows."""
    n = num_layers
    wanted = {1, 2, 3, 4, 6, 8, 12, 16, n // 2, (3 * n) // 4, n - 3, n - 1, *capture}
    return sorted(d for d in wanted if 1 <= d <= n - 1)


def _capture_gaps(capture: list[int]) -> set[int]:
    """The spacings between consecutive capture layers."""
    return {b - a for a, b in zip(capture, capture[1:], strict=False)}


def _spacings(depth: int, capture: list[int]) -> list[int]:
    """Powers of two and the capture gaps that reach no lower than hs1 from ``depth``."""
    ds = [1 << k for k in range(8) if (1 << k) <= depth - 1]
    ds += [g for g in _capture_gaps(capture) if g <= depth - 1 and g not in ds]
    return sorted(ds)


def _fit_exponent(depths: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``log v = log c + a log depth``: ``(a, c)``."""
    pts = [(math.log(d), math.log(v)) for d, v in zip(depths, values, strict=True) if v > 0]
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    a = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return a, math.exp(my - a * mx)


def measure(arch: str, num_layers: int, ids: torch.Tensor, seed: int) -> dict[str, Any]:
    from tracediff.testing.models import build_tiny_model, server_model

    t0 = time.perf_counter()
    tm = build_tiny_model(arch, hidden_size=64, num_layers=num_layers, seed=seed)
    build_s = time.perf_counter() - t0
    n_layers = tm.num_layers
    meter = Meter(tm.hidden_size, tm.massive.dims)
    capture = [i + 1 for i in (2, n_layers // 2, n_layers - 3)]  # SGLang's default capture ids, HF numbering
    ref = _states(tm, ids)
    servers = {"bf16": server_model(tm, "bf16"), "fp8": server_model(tm, "fp8")}
    cand = {name: _states(sm, ids) for name, sm in servers.items()}

    moe = bool(_gates(tm))
    flips: dict[str, dict[int, torch.Tensor]] = {}
    if moe:
        ref_routes = _record_routes(tm, ids)
        for name, sm in servers.items():
            flips[name] = _flipped_so_far(ref_routes, _record_routes(sm, ids))
            r32 = _fp32_router(server_model(tm, name), tm)
            flips[f"{name}+fp32 router"] = _flipped_so_far(ref_routes, _record_routes(r32, ids))
            cand[f"{name}+fp32 router"] = _states(r32, ids)
            pinned = server_model(tm, name)
            handles = _pin_routes(pinned, ref_routes)
            try:
                cand[f"{name}+pinned routes"] = _states(pinned, ids)
            finally:
                for h in handles:
                    h.remove()

    n = ids.numel()
    rows = []
    for d in range(1, n_layers):
        row: dict[str, Any] = {"depth": d}
        for name, states in cand.items():
            row[name], row[f"{name} excl"] = meter.standardised(states[d], ref[d])
            row[f"{name} ord"] = meter.ordinary(states[d], ref[d])
        for name, per_layer in flips.items():
            # hs{d} is decoder layer d-1's output: the flips of MoE layers <= d-1 have reached it.
            flipped = per_layer.get(d - 1, torch.zeros(n, dtype=torch.bool))
            row[f"{name} flipped"] = float(flipped.float().mean())
            if name in servers:
                row[f"{name} tok median"] = meter.per_token_median(cand[name][d], ref[d])
                row[f"{name} unflipped"] = (meter.standardised(cand[name][d][~flipped], ref[d][~flipped])[0]
                                            if bool((~flipped).any()) else float("nan"))
        lo, _ = meter.standardised(ref[d - 1], ref[d])
        hi, _ = meter.standardised(ref[d + 1], ref[d])
        row["nb"], row["nb-1"] = min(lo, hi), lo
        row["nb ord"] = min(meter.ordinary(ref[d - 1], ref[d]), meter.ordinary(ref[d + 1], ref[d]))
        rows.append(row)

    spacing = []
    for layer in capture:
        d1, _ = meter.standardised(ref[layer - 1], ref[layer])
        nb = rows[layer - 1]["nb"]
        for gap in _spacings(layer, capture):
            dist, _ = meter.standardised(ref[layer - gap], ref[layer])
            spacing.append({"layer": layer, "D": gap, "d": dist, "d1": d1,
                            "sqrt": dist / math.sqrt(gap) / d1, "lin": dist / gap / d1,
                            "sqrt nb": dist / math.sqrt(gap) / nb, "lin nb": dist / gap / nb,
                            "capture gap": gap in _capture_gaps(capture)})

    fit_from = 2  # the massive activations show from hs2 on
    fit = {}
    for name in cand:
        fit_rows = [r for r in rows if r["depth"] >= fit_from]
        fit[name] = _fit_exponent([r["depth"] for r in fit_rows], [r[name] for r in fit_rows])
        fit[f"{name} ord"] = _fit_exponent([r["depth"] for r in fit_rows], [r[f"{name} ord"] for r in fit_rows])
    fit_rows = [r for r in rows if r["depth"] >= fit_from]
    fit["nb"] = _fit_exponent([r["depth"] for r in fit_rows], [r["nb"] for r in fit_rows])
    return {"arch": arch, "L": n_layers, "capture": capture, "rows": rows, "spacing": spacing, "fit": fit,
            "moe": moe, "variants": list(cand), "build_s": build_s, "massive": tm.massive.dims}


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------


def _pct(v: float) -> str:
    return f"{100 * v:.2f}%" if v < 0.1 else f"{100 * v:.1f}%"


def render(res: dict[str, Any]) -> str:
    n_layers, capture = res["L"], res["capture"]
    out = [f"### {res['arch']} ({n_layers} layers; massive dims {list(res['massive'])}; capture layers "
           + ", ".join(f"hs{c}" for c in capture) + ")", ""]
    shown = set(_report_depths(n_layers, capture))
    excl = max(r["bf16 excl"] for r in res["rows"])
    out += [f"Standardised relative error (compare's `segment_scales`; it excluded up to {excl} dims as "
            "resolution-limited); `ord` = ordinary dims only, plain std. `*` = SGLang default capture layer.", "",
            "| depth | bf16 drift | fp8 drift | neighbour | neighbour/bf16 | neighbour/fp8 "
            "| bf16 ord | fp8 ord | neighbour ord |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["depth"] not in shown:
            continue
        mark = "*" if r["depth"] in capture else ""
        out.append(f"| hs{r['depth']}{mark} | {_pct(r['bf16'])} | {_pct(r['fp8'])} | {_pct(r['nb'])} "
                   f"| {r['nb'] / r['bf16']:.1f} | {r['nb'] / r['fp8']:.1f} "
                   f"| {_pct(r['bf16 ord'])} | {_pct(r['fp8 ord'])} | {_pct(r['nb ord'])} |")
    f = res["fit"]
    out += ["", f"Fit over hs2..hs{n_layers - 1}, drift ~ c * depth^a: "
            + "; ".join(f"{k}: a = {f[k][0]:.2f} (c = {_pct(f[k][1])})"
                        for k in ("bf16", "fp8", "bf16 ord", "fp8 ord", "nb")), ""]
    if res["moe"]:
        out += ["Routing (DeepSeek-V3 MoE). `drift`: as above; `per-token median`: the median token's error; "
                "`unflipped`: the error over the tokens whose routes never differed from the fp32 model's up to "
                "that layer; `+fp32 router`: gate weights restored to fp32 after `server_model` (transformers' "
                "router already casts its input to fp32); `+pinned routes`: the fp32 model's routes forced, a "
                "diagnostic; `flipped`: tokens whose routed expert set differed at some MoE layer so far.", ""]
        for name in ("bf16", "fp8"):
            out += [f"| depth | {name} drift | per-token median | unflipped | +fp32 router | +pinned routes "
                    "| flipped | flipped (+fp32 router) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in res["rows"]:
                if r["depth"] not in shown:
                    continue
                mark = "*" if r["depth"] in capture else ""
                out.append(f"| hs{r['depth']}{mark} | " + " | ".join(_pct(r[k]) for k in (
                    name, f"{name} tok median", f"{name} unflipped", f"{name}+fp32 router",
                    f"{name}+pinned routes", f"{name} flipped", f"{name}+fp32 router flipped")) + " |")
            out.append("")
        out += ["Fits (a): " + "; ".join(f"{k}: {f[k][0]:.2f}" for k in res["variants"]), ""]
    out += ["Spacing at the capture layers: d(D) = d(hs{l}, hs{l-D}); ratios = estimate / true d(1) "
            "(`g` = a spacing between two default capture layers); the last two columns divide by the "
            "neighbour column above, min(d(l, l-1), d(l, l+1)), instead.", "",
            "| layer | D | d(D) | d(D)/sqrt(D) / d(1) | d(D)/D / d(1) | d(D)/sqrt(D) / neighbour | d(D)/D / neighbour |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in res["spacing"]:
        out.append(f"| hs{s['layer']} | {s['D']}{' g' if s['capture gap'] else ''} | {_pct(s['d'])} "
                   f"| {s['sqrt']:.2f} | {s['lin']:.2f} | {s['sqrt nb']:.2f} | {s['lin nb']:.2f} |")
    big = [s for s in res["spacing"] if s["D"] > 1]
    if big:
        rng = {k: (min(s[k] for s in big), max(s[k] for s in big)) for k in ("sqrt", "lin", "sqrt nb", "lin nb")}
        out += ["", "Over D > 1: " + ", ".join(f"{label} in [{rng[k][0]:.2f}, {rng[k][1]:.2f}]" for k, label in (
            ("sqrt", "d(D)/sqrt(D) / d(1)"), ("lin", "d(D)/D / d(1)"),
            ("sqrt nb", "d(D)/sqrt(D) / neighbour"), ("lin nb", "d(D)/D / neighbour"))) + "."]
    out += ["", f"(build {res['build_s']:.1f} s)", ""]
    return "\n".join(out)


def render_summary(results: list[dict[str, Any]]) -> str:
    """One row per (architecture, model seed): the numbers at the three capture layers, the fits, the
    spacing-estimate ranges."""
    out = ["### Summary over model seeds", "",
           "At the SGLang default capture layers (c1 / c2 / c3 = hs3 / hs{L//2+1} / hs{L-2}); `a` = fitted "
           "exponent of drift ~ c * depth^a over hs2..hs{L-1}; spacing ranges over D > 1 at the three "
           "capture layers, estimate / true d(1).", "",
           "| arch | seed | bf16 drift | fp8 drift | neighbour | neighbour/bf16 at c3 | neighbour/fp8 at c3 "
           "| a bf16 | a fp8 | d(D)/sqrt(D) / d(1) | d(D)/D / d(1) |",
           "|---|---:|---|---|---|---:|---:|---:|---:|---|---|"]
    for res in results:
        by = {r["depth"]: r for r in res["rows"]}
        c = [by[d] for d in res["capture"]]
        big = [s for s in res["spacing"] if s["D"] > 1]

        def cell(k: str, c: list[dict[str, Any]] = c) -> str:
            return " / ".join(_pct(r[k]) for r in c)

        def rng(k: str, big: list[dict[str, Any]] = big) -> str:
            return f"{min(s[k] for s in big):.2f}-{max(s[k] for s in big):.2f}"

        out.append(f"| {res['arch']} | {res['seed']} | {cell('bf16')} | {cell('fp8')} | {cell('nb')} "
                   f"| {c[2]['nb'] / c[2]['bf16']:.1f} | {c[2]['nb'] / c[2]['fp8']:.1f} "
                   f"| {res['fit']['bf16'][0]:.2f} | {res['fit']['fp8'][0]:.2f} | {rng('sqrt')} | {rng('lin')} |")
        if res["moe"]:
            out.append(f"| {res['arch']} pinned routes | {res['seed']} | {cell('bf16+pinned routes')} "
                       f"| {cell('fp8+pinned routes')} | | {c[2]['nb'] / c[2]['bf16+pinned routes']:.1f} "
                       f"| {c[2]['nb'] / c[2]['fp8+pinned routes']:.1f} | {res['fit']['bf16+pinned routes'][0]:.2f} "
                       f"| {res['fit']['fp8+pinned routes'][0]:.2f} | | |")
    all_big = [s for res in results for s in res["spacing"] if s["D"] > 1]
    gaps = [s for s in all_big if s["capture gap"]]
    out += ["", f"All seeds and architectures, D > 1: d(D)/sqrt(D) / d(1) in "
            f"[{min(s['sqrt'] for s in all_big):.2f}, {max(s['sqrt'] for s in all_big):.2f}], d(D)/D / d(1) in "
            f"[{min(s['lin'] for s in all_big):.2f}, {max(s['lin'] for s in all_big):.2f}]; at the capture "
            f"spacings only: sqrt [{min(s['sqrt'] for s in gaps):.2f}, {max(s['sqrt'] for s in gaps):.2f}], "
            f"linear [{min(s['lin'] for s in gaps):.2f}, {max(s['lin'] for s in gaps):.2f}].", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from tracediff.testing import models

    # Real EAGLE-3 target depths (Llama-3.1-8B, Qwen3-8B, Mistral-Nemo, DeepSeek-V3), if models lacks them.
    deep_layers = getattr(models, "DEEP_LAYERS", {"llama": 32, "qwen3": 36, "mistral": 40, "deepseek_v3": 61})
    archs = models.ARCHITECTURES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=list(archs), choices=archs)
    parser.add_argument("--layers", type=int, nargs="+", help="depth per arch (default: DEEP_LAYERS)")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="model seeds: full tables for the first, a summary over all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = args.layers or [deep_layers[a] for a in args.archs]
    if len(layers) != len(args.archs):
        parser.error("--layers needs one depth per arch")
    ids = torch.randint(0, 512, (args.seqs, args.tokens), generator=torch.Generator().manual_seed(1234))
    import transformers

    start = time.perf_counter()
    parts = [f"## bench_noise_model\n\n```\n$ python benchmarks/bench_noise_model.py {shlex.join(argv or sys.argv[1:])}\n```\n",
             f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC; python {platform.python_version()}, "
             f"torch {torch.__version__} ({args.threads} threads), transformers {transformers.__version__}; "
             f"{args.seqs} sequences x {args.tokens} seeded random tokens, hidden 64; full tables for model "
             f"seed {args.seeds[0]}, a summary over seeds {args.seeds}.\n"]
    print(parts[0] + "\n" + parts[1], flush=True)
    results = []
    for arch, n_layers in zip(args.archs, layers, strict=True):
        for k, seed in enumerate(args.seeds):
            res = measure(arch, n_layers, ids, seed)
            res["seed"] = seed
            results.append(res)
            if k == 0:
                text = render(res)
                print(text, flush=True)
                parts.append(text)
    text = render_summary(results)
    print(text, flush=True)
    parts.append(text)
    tail = f"Total run time {time.perf_counter() - start:.0f} s."
    print(tail)
    parts.append(tail + "\n")
    if args.out:
        args.out.write_text("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
