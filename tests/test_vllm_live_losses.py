"""No row lost silently on a live vLLM server under load (issue #48).

``tracediff record --adapter vllm`` around a real vLLM 0.32 CPU server (a random Llama 8 x 512
target, a one-layer EAGLE-3 draft, K = 3), 16 concurrent streamed ``/v1/completions`` requests while
one other busy process (a bounded CPU burner started and stopped here by its pid) competes for the
machine's cores, and the server stopped with SIGTERM right after the last response, without
``--shutdown-timeout`` (vLLM then kills its worker at once). Runs in both commit modes.

What the engine produced is counted from the requests alone (vLLM's own per-request spec-decode
metrics, ``num_spec_steps``, from the final usage chunk of each stream): the drafter reads
``prompt + (1 + K) * steps`` fc rows of a request (its prompt, then 1 + K verify rows a step) and
proposes ``K * (1 + steps)`` draft tokens (after the prefill and after every verify step). Then:
either record exits 0 and the store holds every one of those rows, or it exits non-zero and says, per
tap, how many rows were lost, which together with the stored rows make up every row produced.

Two runs per case (``TRACEDIFF_LOSS_RUNS=N`` for more; ``TRACEDIFF_LOSS_TOKENS`` new tokens a request,
24 by default). Servers listen on 127.0.0.1 only; every
process started here is stopped through its own pid.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import servers
import vllm_harness as h

pytestmark = pytest.mark.slow

K = 3
REQUESTS = 16
NEW_TOKENS = int(os.environ.get("TRACEDIFF_LOSS_TOKENS", "24"))  # per request
HIDDEN, LAYERS = 512, 8
LOST = re.compile(r"tracediff: error: (\w+)(?:/[\w-]+)? \(pid \d+\): ([\d,]+)(?: of [\d,]+)? rows (?:dropped|lost|were taken)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    from tracediff.testing.tiny_llama import build_tiny_llama

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm_losses")
    tl = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=h.VOCAB, seed=0)
    with torch.no_grad():
        h.favour_rows(tl.model.lm_head.weight, 40.0)
    tl.model.save_pretrained(root / "target")
    return {"root": root, "python": python, "target": root / "target",
            "draft": h.build_draft(root, "draft", tl, [2, 4, 5], "top")}


def _burner(seconds: float) -> subprocess.Popen:
    """One busy process (a spinning interpreter that ends by itself after ``seconds``)."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _stream(url: str, model: str, rid: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed greedy completion: its token count and vLLM's spec-decode metrics."""
    body = {"model": model, "prompt": prompt, "request_id": rid, "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out: dict[str, Any] = {"prompt": len(prompt), "chunks": 0, "spec": None, "usage": None}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            out["chunks"] += 1
            if doc.get("usage"):
                out["usage"] = doc["usage"]
                out["spec"] = (doc.get("metrics") or {}).get("speculative_decoding")
    return out


def _run_server(models: dict[str, Any], commit: str, shutdown: int | None, run: int) -> dict[str, Any]:
    root, python = models["root"], models["python"]
    name = f"{commit}-{shutdown}-{run}"
    store, port = root / f"{name}.zarr", h.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / f"{name}.log"
    cmd = [str(Path(python).parent / "tracediff"), "record", "--adapter", "vllm", "--commit", commit, "-o", str(store),
           "--", *h.serve_command(python, models["target"], models["draft"], port, k=K, shutdown_timeout=shutdown)]
    prompts = [[(7 * i + 3 * j) % (h.VOCAB - 1) + 1 for j in range(8 + 3 * i)] for i in range(REQUESTS)]
    results: dict[str, Any] = {}
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            results[f"r{i}"] = _stream(url, str(models["target"]), f"r{i}", prompts[i])
        except Exception as exc:  # noqa: BLE001
            errors.append(f"r{i}: {type(exc).__name__}: {exc}")

    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.vllm_env(), start_new_session=True)
        burner = None
        try:
            servers.wait_healthy(url, proc, log_path)
            burner = _burner(240.0)
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(REQUESTS)]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(1.0, 300.0 - (time.monotonic() - started)))
        finally:
            if burner is not None:
                burner.kill()
                burner.wait(timeout=30)
            servers.stop(proc)  # SIGTERM at once (without --shutdown-timeout, vLLM SIGKILLs its worker)
    return {"store": store, "returncode": proc.returncode, "log": log_path.read_text(), "results": results,
            "errors": errors}


def _stored_rows(store: Path) -> dict[str, int]:
    from tracediff.store import open_store

    if not store.exists():
        return {}
    with open_store(store) as s:
        return {tap: sum(stream.rows for stream in s.tap_streams(tap)) for tap in s.taps}


def _produced(results: dict[str, Any]) -> dict[str, int]:
    steps = {rid: int(r["spec"]["num_spec_steps"]) for rid, r in results.items()}
    return {"fc_in": sum(r["prompt"] + (1 + K) * steps[rid] for rid, r in results.items()),
            "draft_steps": sum(K * (1 + steps[rid]) for rid in results)}


def _reported_lost(log: str) -> dict[str, int]:
    lost: dict[str, int] = {}
    for tap, rows in LOST.findall(log):
        lost[tap] = lost.get(tap, 0) + int(rows.replace(",", ""))
    return lost


@pytest.mark.parametrize(("commit", "shutdown"), [("step", None), ("background", None), ("background", 10)])
def test_every_row_a_loaded_server_produced_is_stored_or_reported_lost_with_a_failing_exit(models, commit,
                                                                                           shutdown) -> None:
    outcomes = []
    for run in range(int(os.environ.get("TRACEDIFF_LOSS_RUNS", "2"))):  # more runs: more chances to lose rows
        r = _run_server(models, commit, shutdown, run)
        assert not r["errors"], r["errors"]
        assert len(r["results"]) == REQUESTS and all(x["spec"] for x in r["results"].values()), r["log"][-3000:]
        assert all(x["usage"]["completion_tokens"] == NEW_TOKENS for x in r["results"].values())
        produced, stored, lost = _produced(r["results"]), _stored_rows(r["store"]), _reported_lost(r["log"])
        outcomes.append((r["returncode"], produced, stored, lost))
        for tap in ("fc_in", "draft_steps"):
            assert stored.get(tap, 0) + lost.get(tap, 0) == produced[tap], (tap, outcomes, r["log"][-4000:])
        if lost:
            assert r["returncode"] != 0, (outcomes, r["log"][-4000:])
            # ... and names what avoids it (a full queue: --on-full block; a killed worker: the server's
            # --shutdown-timeout or --commit step)
            assert any(flag in r["log"] for flag in ("--on-full block", "--shutdown-timeout 10", "--commit step")), \
                r["log"][-4000:]
        else:
            assert r["returncode"] == 0, (outcomes, r["log"][-4000:])
        print(f"commit={commit} shutdown-timeout={shutdown} run {run}: exit {r['returncode']}, produced {produced}, stored {stored}, reported "
              f"lost {lost}")
        print("\n".join(line for line in r["log"].splitlines() if line.startswith("tracediff:")))
