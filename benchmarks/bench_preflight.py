"""Benchmark `tracediff preflight` on a draft folder of real size: issue #49 asks for under 1 s.

The draft is the shape of a Kimi-K2 / DeepSeek-V3 EAGLE-3 draft (hidden 7168, fc [7168, 3 x 7168], a
32000-token draft vocabulary with its d2t / t2d maps, lm_head, one decoder layer: ~2.6 GB of bf16),
written as a valid safetensors file whose tensor bytes are a sparse hole except d2t and t2d (preflight
reads only the header and those two maps, so the hole is never read; the file still has its full
size). The target is a 61-layer DeepSeek-V3 config.json. Timed: the whole command in a fresh process
(interpreter start-up and imports included, what a user waits for), and `run_preflight` in process.

Run:  python benchmarks/bench_preflight.py               (prints, and writes '## bench_preflight' of RESULTS.md)
      python benchmarks/bench_preflight.py --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from results_md import RESULTS, write_section  # noqa: E402  (benchmarks/, on the path of a script run from it)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECTION = "## bench_preflight"
HIDDEN, DRAFT_VOCAB, VOCAB, LAYERS = 7168, 32000, 163840, 61


def write_draft(folder: Path) -> int:
    """A DeepSeek-V3-shaped EAGLE-3 draft; returns the safetensors file size."""
    folder.mkdir(parents=True, exist_ok=True)
    h = HIDDEN
    shapes = {
        "fc.weight": ("BF16", [h, 3 * h]), "lm_head.weight": ("BF16", [DRAFT_VOCAB, h]),
        "norm.weight": ("BF16", [h]), "midlayer.input_layernorm.weight": ("BF16", [h]),
        "midlayer.hidden_norm.weight": ("BF16", [h]), "midlayer.post_attention_layernorm.weight": ("BF16", [h]),
        "midlayer.self_attn.q_proj.weight": ("BF16", [h, 2 * h]),
        "midlayer.self_attn.k_proj.weight": ("BF16", [1024, 2 * h]),
        "midlayer.self_attn.v_proj.weight": ("BF16", [1024, 2 * h]),
        "midlayer.self_attn.o_proj.weight": ("BF16", [h, h]),
        "midlayer.mlp.gate_proj.weight": ("BF16", [18432, h]), "midlayer.mlp.up_proj.weight": ("BF16", [18432, h]),
        "midlayer.mlp.down_proj.weight": ("BF16", [h, 18432]),
        "d2t": ("I64", [DRAFT_VOCAB]), "t2d": ("BOOL", [VOCAB]),
    }
    size = {"BF16": 2, "I64": 8, "BOOL": 1}
    rng = np.random.default_rng(0)
    kept = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    payload = {"d2t": (kept - np.arange(DRAFT_VOCAB)).astype("<i8").tobytes(),
               "t2d": np.isin(np.arange(VOCAB), kept).astype(np.bool_).tobytes()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in shapes.items():
        n = int(np.prod(shape)) * size[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        base = f.tell()
        for name, data in payload.items():
            f.seek(base + header[name]["data_offsets"][0])
            f.write(data)
        f.truncate(base + offset)  # the weights: a sparse hole of their full size
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "target_hidden_size": h, "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return base + offset


def write_target(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "tie_word_embeddings": False, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        draft, target = Path(tmp) / "draft", Path(tmp) / "target"
        file_size = write_draft(draft)
        write_target(target)
        argv = [sys.executable, "-m", "tracediff", "preflight", str(draft), "--target", str(target),
                "--trainer-layers", "0,3,31", "--engine-version", "sglang=0.5.23", "--engine-version", "vllm=0.32.0"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cli: list[float] = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            cli.append(time.perf_counter() - t)
            assert proc.returncode == 1, proc.stderr  # the case differs: exit 1
        sys.path.insert(0, str(REPO))
        from tracediff.preflight import run_preflight  # noqa: PLC0415

        inproc: list[float] = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            run_preflight(draft, target, trainer_layers=[0, 3, 31], versions={"sglang": "0.5.23", "vllm": "0.32.0"})
            inproc.append(time.perf_counter() - t)
    lines = [
        SECTION, "",
        f"`python benchmarks/bench_preflight.py` on {platform.machine()} ({os.cpu_count()} CPUs), Python "
        f"{platform.python_version()}: a DeepSeek-V3-shaped draft folder ({file_size / 1e9:.2f} GB safetensors, "
        f"d2t over {DRAFT_VOCAB} ids, t2d over {VOCAB}), a 61-layer target config; {args.repeats} runs each; "
        f"1-minute load average {os.getloadavg()[0]:.1f} at the end (the VM is shared: seconds vary with it).", "",
        "| what | median | min | max |", "|---|---|---|---|",
        f"| `tracediff preflight` (fresh process) | {statistics.median(cli):.3f} s | {min(cli):.3f} s | {max(cli):.3f} s |",
        f"| `run_preflight` (in process) | {statistics.median(inproc) * 1e3:.1f} ms | {min(inproc) * 1e3:.1f} ms | "
        f"{max(inproc) * 1e3:.1f} ms |", "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(RESULTS, text, SECTION)


if __name__ == "__main__":
    main()
