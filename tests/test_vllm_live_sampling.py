"""Production recording on a real vLLM 0.32 server on CPU running an EAGLE-3 draft:
``tracediff record --adapter vllm --sample-requests 0.5 --max-bytes SIZE --ring``, a dozen prompts
sent: exactly the requests ``tracediff.sampled`` chooses are in the store, each with every row it
produced, in ring segments within the budget, and the sampled server store matches a trainer store
of every sequence.

Servers listen on 127.0.0.1 only and are stopped through the pid of the ``tracediff record``
process we started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import servers
import vllm_harness as h

import tracediff

pytestmark = pytest.mark.slow

RATE = 0.5
BUDGET = 1_500_000  # per tap and process: segments of 300,000 bytes, 3 KiB rows (3 x 256 float32)
NEW_TOKENS = 4
RIGHT = ["hs2", "hs4", "hs5"]


def _tracediff(*args: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=h.vllm_env())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm_sampling")
    tl = h.build_target(root)
    seqs = make_sequences(n_seqs=12, min_len=6, max_len=20, vocab_size=h.VOCAB, seed=5)
    h.record_trainer(root / "train.zarr", tl, RIGHT, seqs)
    draft = h.build_draft(root, "draft", tl, [2, 4, 5], "top")
    store, port = root / "server.zarr", h.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    cmd = [str(Path(python).parent / "tracediff"), "record", "--adapter", "vllm", "--sample-requests", str(RATE),
           "--max-bytes", str(BUDGET), "--ring", "-o", str(store), "--",
           *h.serve_command(python, root / "target", draft, port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.vllm_env(), start_new_session=True)
        try:
            servers.wait_healthy(url, proc, log_path)
            sent = _tracediff("send", root / "train.zarr", "--url", url, "--engine", "vllm", "--max-new-tokens",
                              NEW_TOKENS, "--json", root / "send.json")
        finally:
            servers.stop(proc)
    report = json.loads((root / "send.json").read_text()) if (root / "send.json").is_file() else {}
    return {"root": root, "store": store, "train": root / "train.zarr", "sent": sent, "report": report,
            "returncode": proc.returncode, "log": log_path.read_text()}


def _rows_per_request(store: Path, tap: str) -> tuple[dict[str, int], list[str]]:
    """Rows per client request id over every writer group (ring segment) of ``tap``, and the groups."""
    from tracediff.store import open_store

    out: dict[str, int] = {}
    with open_store(store) as s:
        streams = s.streams[tap]
        for stream in streams:
            seq = stream.labels(("seq",))["seq"]
            keys, counts = np.unique(seq, return_counts=True)
            for k, c in zip(keys.tolist(), counts.tolist(), strict=True):
                name = stream.seq_names[int(k)]
                out[name] = out.get(name, 0) + int(c)
        return out, [stream.writer for stream in streams]


def test_exactly_the_sampled_requests_are_recorded_whole_within_the_ring(run) -> None:
    from tracediff.send import sequences_from_trace

    assert run["sent"].returncode == 0, run["sent"].stdout + run["sent"].stderr
    assert run["returncode"] == 0, run["log"][-4000:]
    prompts = {s.key: s.input_ids for s in sequences_from_trace(run["train"])}
    assert len(prompts) == 12
    chosen = {k for k, ids in prompts.items() if tracediff.sampled(ids, RATE)}
    assert 0 < len(chosen) < len(prompts)
    responses = run["report"]["responses"]
    fc, fc_groups = _rows_per_request(run["store"], "fc_in")
    aux, _ = _rows_per_request(run["store"], "aux_hidden")
    # Prompt rows, then 1 + K verify rows per decode step (K = 3), for every chosen request, on both taps.
    expected = {k: len(prompts[k]) + responses[k]["spec_decoding"]["num_spec_steps"] * 4 for k in chosen}
    assert fc == expected and aux == expected
    draft, _ = _rows_per_request(run["store"], "draft_steps")
    assert set(draft) == chosen
    assert len(fc_groups) > 1  # the ring rotated into segments
    for tap in ("fc_in", "aux_hidden"):
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(run["store"] / tap) for f in fs)
        assert size <= BUDGET, tap
    summary = run["log"].split("tracediff: command exited with code")[-1]
    assert "sampled requests: rate 0.5" in summary and "dropped 0 rows" in summary, summary
    # Every row of the others counted as skipped (a drafter call none of whose requests is chosen is
    # skipped whole, before any label or copy; a mixed call by its rows): none lost, none twice.
    others = sum(len(prompts[k]) + responses[k]["spec_decoding"]["num_spec_steps"] * 4 for k in prompts if k not in chosen)
    commits = [json.loads(f.read_text())["attributes"]["commit"] for f in (run["store"] / "fc_in").glob("*/zarr.json")]
    assert max(c["skipped_rows"] for c in commits) == others and all(c["dropped_rows"] == 0 for c in commits)


def test_the_sampled_server_store_matches_the_trainer_store_of_every_sequence(run) -> None:
    out = run["root"] / "compare.json"
    result = _tracediff("compare", run["train"], run["store"], "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "match"
    assert [(m["candidate"], m["reference"], m["status"]) for m in report["segment_map"]] == [
        (0, 0, "same"), (1, 1, "same"), (2, 2, "same")]
