"""Build the shipped sample traces (run by hand: ``python samples/make_samples.py``).

Everything comes from a tiny real transformers Llama built from a config with seeded random weights
(hidden 64, 8 layers, non-unit RMSNorm weights as in a trained model): no download, CPU only, under a
minute. Re-running writes the same values (only host, pid and times in the attributes change).

Writes, next to this file:

* ``train.zarr``: the trainer. One full-sequence forward per sample, the draft's fc input is
  ``cat(hs0, hs3, hs6)`` in HF ``hidden_states`` numbering (embedding, outputs of layers 2 and 5).
* ``server_broken.zarr``: an SGLang-like server. Ragged prefill batches, then KV-cache decode one
  token per step with requests interleaved; its draft config lists ``eagle_aux_hidden_state_layer_ids
  = [2, 5, 7]`` in the server's "output of layer j" numbering, so the fc input is
  ``cat(hs3, hs6, hs8_pre_norm)``: the embedding dropped, the final layer before its norm added,
  everything one slot early (the seed bug).
* ``server_fixed.zarr``: the same server with the ids translated (``[-1, 2, 5]``): ``cat(hs0, hs3, hs6)``.
* ``bank.zarr``: every hidden state of the model on the same token sequences, recorded with the
  ``hf`` adapter (``tracediff identify`` names layers against it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import tracediff
from tracediff.adapters import hf
from tracediff.testing.pipelines import run_engine, run_trainer
from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, layer_states, make_sequences

HERE = Path(__file__).resolve().parent
HIDDEN, LAYERS, VOCAB, SEED = 64, 8, 512, 0
N_SEQS, MIN_LEN, MAX_LEN, DATA_SEED = 6, 16, 48, 7
TRAIN_LAYERS = ["hs0", "hs3", "hs6"]
BROKEN_LAYERS = ["hs3", "hs6", "pre_norm"]
MODEL = f"tiny-llama-h{HIDDEN}-l{LAYERS} (random weights, seed {SEED})"
COMPRESSOR = "lz4"
WRITER = "rank0"  # fixed writer group names keep re-runs diffable (the default is pid<N>)


def _labels(names: list[str]) -> list[str]:
    return [f"hs{LAYERS}_pre_norm" if n == "pre_norm" else n for n in names]


def _common_meta() -> dict[str, Any]:
    return {"model": MODEL, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "dtype": "bfloat16",
            "sample_data": f"make_sequences(n_seqs={N_SEQS}, min_len={MIN_LEN}, max_len={MAX_LEN}, seed={DATA_SEED})"}


def trainer_meta() -> dict[str, Any]:
    return {**_common_meta(),
            # The canonical aux_layers block (docs/format.md): ids in the trainer's own numbering.
            "aux_layers": {"ids": [0, 3, 6], "convention": "hf", "source": "trainer config"},
            "framework": "simulated EAGLE-3 trainer (tracediff.testing.pipelines.run_trainer)"}


def server_meta(sglang_ids: list[int]) -> dict[str, Any]:
    return {**_common_meta(),
            "aux_layers": {"ids": sglang_ids, "convention": "sglang", "framework": "sglang",
                           "field": "eagle_config.eagle_aux_hidden_state_layer_ids",
                           "source": "draft config eagle_config (nested)"},
            "framework": "simulated SGLang-style server (tracediff.testing.pipelines.run_engine)",
            "server_args": {"speculative_algorithm": "EAGLE3", "max_running_requests": 3,
                            "dtype": "bfloat16"}}


def record_fc(path: Path, role: str, meta: dict[str, Any], runner: Any, layers: list[str], tl: Any,
              seqs: list[list[int]], **kw: Any) -> None:
    draft = DraftHead(HIDDEN, len(layers), seed=SEED)
    with tracediff.record(path, role=role, meta=meta, overwrite=True, compressor=COMPRESSOR,
                          writer_name=WRITER, handle_sigterm=False) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=HIDDEN, segment_labels=_labels(layers),
                module_path="draft.fc")
        runner(tl, draft, seqs, layers, dtype=torch.bfloat16, on_batch=lambda lab: rec.labels(**lab), **kw)
    if rec.error:
        raise RuntimeError(f"{path}: recording failed: {rec.error}")


def record_bank(path: Path, tl: Any, seqs: list[list[int]]) -> None:
    meta = {"model": MODEL, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "dtype": "float32"}
    with tracediff.record(path, role="bank", meta=meta, overwrite=True, compressor=COMPRESSOR,
                          writer_name=WRITER, handle_sigterm=False, adapter="hf") as rec:
        if not hf.attach(rec, tl.model):
            raise RuntimeError("the hf adapter found no decoder model")
        for seq in seqs:
            # One forward per sample: the adapter's label source gives token ids and positions,
            # the recorder numbers the sequences 0, 1, ... in call order.
            layer_states(tl, torch.tensor(seq, dtype=torch.long))
    if rec.error:
        raise RuntimeError(f"{path}: recording failed: {rec.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write the stores to (default: here)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # One thread: the same float reductions on every machine, so re-runs write the same bits.
    torch.set_num_threads(1)
    tl = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=SEED)
    seqs = make_sequences(n_seqs=N_SEQS, min_len=MIN_LEN, max_len=MAX_LEN, vocab_size=VOCAB, seed=DATA_SEED)
    record_fc(out / "train.zarr", "trainer", trainer_meta(), run_trainer, TRAIN_LAYERS, tl, seqs)
    record_fc(out / "server_broken.zarr", "server", server_meta([2, 5, LAYERS - 1]), run_engine, BROKEN_LAYERS,
              tl, seqs, max_running=3, seed=SEED)
    record_fc(out / "server_fixed.zarr", "server", server_meta([-1, 2, 5]), run_engine, TRAIN_LAYERS,
              tl, seqs, max_running=3, seed=SEED)
    record_bank(out / "bank.zarr", tl, seqs)
    for name in ("train", "server_broken", "server_fixed", "bank"):
        store = tracediff.open_store(out / f"{name}.zarr")
        rows = {tap: store.rows(tap) for tap in store.taps}
        store.close()
        print(f"{out / (name + '.zarr')}: {json.dumps(rows)}")
    if out.resolve() == HERE:
        # The README's numbers come from the stores: rewrite it from the ones just built.
        from make_readme import main as write_readme  # noqa: PLC0415  (this folder is on sys.path)

        write_readme([])


if __name__ == "__main__":
    main()
