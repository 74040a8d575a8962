"""Write samples/README.md from the samples themselves (run by hand: ``python samples/make_readme.py``;
``make_samples.py`` runs it after rebuilding the stores).

Every number the README gives (rows, widths, what compare and identify say, sizes on disk, how the
chunks are stored) is read from the stores or from a compare of them here, so the README cannot
drift from the samples: ``--check`` exits 1 when the file differs from what this writes, and
tests/test_samples_readme.py fails then. The prose is this file's; edit it here, not in README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STORES = ("train.zarr", "server_broken.zarr", "server_fixed.zarr", "bank.zarr")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e6:.2f} MB"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 or noun == "info" else f"{n} {noun}s"


def _counts(report: Any) -> str:
    c = report.counts()
    return ", ".join(_plural(c[s], s) for s in ("error", "warning", "info"))


def _arrays(store: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every array of a store folder: (its folder, its zarr.json)."""
    out = []
    for meta in sorted(store.rglob("zarr.json")):
        doc = json.loads(meta.read_text())
        if doc.get("node_type") == "array":
            out.append((meta.parent, doc))
    return out


def _chunk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "c").rglob("*") if p.is_file())


def _codec(doc: dict[str, Any]) -> str:
    """How an array's chunks are compressed, as a person names it (``lz4`` in blosc, ``zstd``, ``none``)."""
    for codec in doc.get("codecs", []):
        conf = codec.get("configuration") or {}
        if codec.get("name") == "blosc":
            return f"{conf.get('cname')} (blosc, {conf.get('shuffle')})"
        if codec.get("name") in ("zstd", "gzip"):
            return str(codec["name"])
    return "none"


def _bullet(text: str) -> str:
    return textwrap.fill(text, width=100, initial_indent="* ", subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def facts(samples: Path = HERE) -> dict[str, Any]:
    """What the README says, measured on the stores in ``samples``."""
    from tracediff.compare import compare_stores  # noqa: PLC0415
    from tracediff.compare.plan.identify import identify_segments  # noqa: PLC0415
    from tracediff.report.wording import fix_assignment, root_cause_sentence  # noqa: PLC0415
    from tracediff.store import open_store  # noqa: PLC0415

    out: dict[str, Any] = {"stores": {}}
    for name in STORES:
        with open_store(samples / name) as store:
            tap = store.taps[0]
            stream = store.tap_streams(tap)[0]
            out["stores"][name] = {"rows": sum(s.rows for s in store.tap_streams(tap)), "width": stream.width,
                                   "dtype": stream.dtype, "labels": stream.segment_labels or []}
    disk = 0
    values: dict[str, list[int]] = {}  # dtype -> [compressed bytes, raw bytes of the rows they hold]
    labels: set[tuple[int, str]] = set()
    git = 0
    for name in STORES:
        for path in (samples / name).rglob("*"):
            if path.is_file():
                disk += path.stat().st_size
                git += len(zlib.compress(path.read_bytes()))  # a loose git object is the zlib of the file
        for folder, doc in _arrays(samples / name):
            chunk_rows = doc["chunk_grid"]["configuration"]["chunk_shape"][0]
            if folder.name == "values":
                itemsize = 2 if doc["data_type"] in ("uint16", "float16") else 4
                # The committed rows, not the whole chunks: a last chunk is padded to its full rows with
                # zeros that compress to nothing, and would make the codec look better than it is.
                raw = doc["shape"][0] * doc["shape"][1] * itemsize
                dtype = "fp32" if itemsize == 4 else "bf16"
                got = values.setdefault(dtype, [0, 0, 0])
                got[0] += _chunk_bytes(folder)
                got[1] += raw
                got[2] = chunk_rows
                out.setdefault("values_codec", _codec(doc))
            else:
                labels.add((chunk_rows, _codec(doc)))
    out["disk"], out["git"] = disk, git
    out["values"] = {k: {"saved": 1 - v[0] / v[1], "chunk_rows": v[2]} for k, v in values.items()}
    if len(labels) != 1:
        raise SystemExit(f"the label arrays are stored in several ways {sorted(labels)}: say so in the README")
    out["label_rows"], out["label_codec"] = next(iter(labels))

    broken = compare_stores(samples / "train.zarr", samples / "server_broken.zarr")
    fixed = compare_stores(samples / "train.zarr", samples / "server_fixed.zarr")
    out["broken"] = {"verdict": broken.verdict.upper(), "exit": broken.exit_code(), "counts": _counts(broken),
                     "cause": root_cause_sentence(broken), "fix": fix_assignment(broken.fix) if broken.fix else None,
                     "kinds": [f.kind for f in broken.findings if f.severity == "error"]}
    out["fixed"] = {"verdict": fixed.verdict.upper(), "exit": fixed.exit_code(), "counts": _counts(fixed),
                    "warnings": sum(f.severity == "warning" for f in fixed.findings)}
    ident = identify_segments(samples / "server_broken.zarr", samples / "bank.zarr")
    out["identify"] = [s.best.text if s.best is not None else "none" for s in ident.segments]
    return out


def render(samples: Path = HERE, measured: dict[str, Any] | None = None) -> str:
    f = measured or facts(samples)
    s = f["stores"]

    def shape(name: str) -> str:
        d = s[name]
        return f"{d['rows']} x {d['width']} {'bf16' if d['dtype'] == 'bfloat16' else 'fp32' if d['dtype'] == 'float32' else d['dtype']}"

    def cat(name: str) -> str:
        return f"`cat({', '.join(s[name]['labels'])})`"

    b, x = f["broken"], f["fixed"]
    bank_labels = s["bank.zarr"]["labels"]
    fixed_config = ("no warning" if x["warnings"] == 0 else _plural(x["warnings"], "warning"))
    saved = f["values"]
    bullets = "\n".join(_bullet(t) for t in (
        f"**compare (broken)**: `{b['verdict']}`, exit {b['exit']}, {b['counts']}: \"{b['cause']}\" The root cause "
        f"is `segment_order`: the server's segments are the trainer's shifted by one slot. Its consequences: "
        f"`segment_missing` (the trainer's segment 0, the embedding, is not fed) and `segment_extra` (the server's "
        f"segment 2 is a state the draft never saw; with the bank: the final layer's output before the norm). The "
        f"recorded configs differ the same way (a `config` warning, grouped under the cause). The Fix box at the top "
        f"says `{b['fix']}`, with the commands to record the server again and compare.",
        f"**compare (fixed)**: `{x['verdict']}`, exit {x['exit']}, {x['counts']}: every row agrees within bf16 "
        f"rounding although the two configs still *look* different (`[0, 3, 6]` against `[-1, 2, 5]`, "
        f"{fixed_config}: an info finding): they name the same layers in two numberings, and the rows are what "
        f"counts.",
        f"**identify (broken)**: segment 0 is {f['identify'][0]}, segment 1 {f['identify'][1]}, segment 2 "
        f"{f['identify'][2]}, with the ids that would reproduce the trace in each framework's numbering. Its note "
        f"that stock SGLang can capture the final layer's output only for gpt-oss (it captures a layer's output as "
        f"the next layer's input) is true of SGLang; the simulated server here has no such limit.",
    ))
    storage = _bullet(
        f"values are stored in {saved['bf16']['chunk_rows']}-row chunks with the {f['values_codec']} codec, whose "
        f"chunk files are {_pct(saved['bf16']['saved'])} smaller than the rows they hold for the bf16 stores and "
        f"{_pct(saved['fp32']['saved'])} for the fp32 bank; the label arrays are {f['label_codec']}-compressed in "
        f"{f['label_rows']}-row chunks (format 1). The four stores' files take {_mb(f['disk'])} (more in filesystem "
        f"blocks: `du` counts whole blocks), {_mb(f['git'])} zlib-compressed as git stores them.")
    return f"""<!-- Written by samples/make_readme.py from the samples themselves: edit that file, not this one. -->
# Sample traces

Four small trace stores that tell the bug tracediff was built for, end to end, in a few seconds on a
CPU. `tracediff demo` runs on them; you can run every command of the README on them too.

## The story

A team trains an EAGLE-3 draft for a (tiny) Llama with 8 decoder layers, hidden size 64. Its `fc`
layer reads three hidden states of the target, and the trainer's config names them in Hugging Face
`output_hidden_states` numbering: `[0, 3, 6]`, that is the embedding output, the output of layer 2
and the output of layer 5. The draft reaches a fine validation accuracy.

They serve it with an SGLang-style server. Its draft config,
`eagle_config.eagle_aux_hidden_state_layer_ids`, counts differently: id `j` is *the output of
layer j* (`-1` is the embedding), and it was set to `[2, 5, 7]`, the ids of a draft that reads the
last layer, not of this one. So the server feeds the draft `cat(hs3, hs6, hs8_pre_norm)`: two of the
right states one slot early, the embedding missing, and in the last slot the final layer's output
before the final norm, a state the draft never saw. (HF's `hidden_states[8]` is the final norm's
*output*; servers capture the final layer *before* the norm, hence the label `hs8_pre_norm`.)
Acceptance collapses; nothing crashes, and both configs look plausible on their own. This is the
shape of the bug that started tracediff, where a 60-layer model's server fed layer 59 instead of
the embedding.

The fix is `[-1, 2, 5]`, which feeds `cat(hs0, hs3, hs6)` again.

| store | what it is | rows x width | fc input / columns |
|---|---|---|---|
| `train.zarr` | the trainer: one full-sequence forward per sample | {shape('train.zarr')} | {cat('train.zarr')} |
| `server_broken.zarr` | the server with ids `[2, 5, 7]` | {shape('server_broken.zarr')} | {cat('server_broken.zarr')} |
| `server_fixed.zarr` | the server with ids `[-1, 2, 5]` | {shape('server_fixed.zarr')} | {cat('server_fixed.zarr')} |
| `bank.zarr` | every hidden state of the target (`hf` adapter) | {shape('bank.zarr')} | `{bank_labels[0]} .. {bank_labels[-3]}, {bank_labels[-2]}, {bank_labels[-1]}` |

Each store's `meta` carries the aux-layer setting as the side would report it (the trainer's
`aux_layers` in HF numbering, the server's `eagle_config.eagle_aux_hidden_state_layer_ids` and
where it was read from), so `compare` shows both next to its findings.

## What tracediff finds

```bash
tracediff demo                                                      # all of the below, plus reports
tracediff compare samples/train.zarr samples/server_broken.zarr --bank samples/bank.zarr
tracediff compare samples/train.zarr samples/server_fixed.zarr      # {x['verdict']}, exit {x['exit']}
tracediff identify samples/server_broken.zarr --bank samples/bank.zarr
```

{bullets}

## How they were made

`python samples/make_samples.py` (a few seconds to a minute on a CPU; no download) rebuilds all four
from scratch and writes the same values every time, then this README (`samples/make_readme.py`):

* the target is `tracediff.testing.tiny_llama.build_tiny_llama(hidden_size=64, num_layers=8,
  seed=0)`: a real `transformers.LlamaForCausalLM` built from a config with seeded random weights and
  RMSNorm weights drawn in [0.5, 2] (unit weights would make pre- and post-norm states differ only
  in scale; trained models' do not);
* 6 token sequences of 16 to 48 tokens (`make_sequences(..., seed=7)`);
* the trainer (`tracediff.testing.pipelines.run_trainer`) forwards each whole sequence without a
  cache and feeds the draft stand-in's `fc` in bf16; the server (`run_engine`) packs ragged prefill
  batches, then decodes one token per step with a per-request KV cache, up to 3 requests
  interleaved, rows in engine order and request ids 1000+ (compare aligns by token content, never
  by ids);
* the fc inputs are recorded with `tracediff.record` and a tap on `draft.fc`'s input, the bank with
  the `hf` adapter (`tracediff.adapters.hf.attach`) on full forwards of the same sequences;
{storage}

The "server" is a simulation (`tracediff.testing.pipelines.run_engine`), not SGLang: it
reproduces what matters here (packing, KV-cache decode numerics, engine row order, the aux-layer
convention) and is labelled as such in each store's `meta.framework`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not what this writes")
    args = parser.parse_args(argv)
    text = render(HERE)
    readme = HERE / "README.md"
    if args.check:
        if readme.read_text() != text:
            print(f"{readme} is stale: run python {Path(__file__).relative_to(HERE.parent)}", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text)
    print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
