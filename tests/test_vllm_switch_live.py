"""Recording switched off and on in a live vLLM 0.32 server on CPU (EAGLE-3 draft), without a restart.

``tracediff record --adapter vllm --control-port 0 -- python -m vllm.entrypoints.openai.api_server ...``;
the trainer's four sequences are sent three times with request-id prefixes ``a-`` (recording on), ``b-``
(after ``tracediff control STORE off``) and ``c-`` (after ``tracediff control STORE on``); the server is
stopped through the pid of the ``tracediff record`` process we started.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import servers
import vllm_harness as h

pytestmark = pytest.mark.slow

RIGHT = ["hs2", "hs4", "hs5"]


def tracediff(*args: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=h.vllm_env())


@pytest.fixture(scope="module")
def switched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm_switch")
    tl = h.build_target(root)
    h.record_trainer(root / "train.zarr", tl, RIGHT, make_sequences(n_seqs=4, min_len=6, max_len=20,
                                                                    vocab_size=h.VOCAB, seed=1))
    draft = h.build_draft(root, "draft_vllm", tl, [2, 4, 5], "top")
    store, port = root / "server.zarr", h.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    cmd = [str(Path(python).parent / "tracediff"), "record", "--adapter", "vllm", "--control-port", "0", "-o",
           str(store), "--", *h.serve_command(python, root / "target", draft, port)]
    steps: dict[str, subprocess.CompletedProcess[str]] = {}

    def send(prefix: str) -> None:
        steps[f"send {prefix}"] = tracediff("send", root / "train.zarr", "--url", url, "--engine", "vllm",
                                            "--max-new-tokens", 4, "--rid-prefix", prefix)

    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.vllm_env(), start_new_session=True)
        try:
            servers.wait_healthy(url, proc, log_path)
            send("a-")
            steps["off"] = tracediff("control", store, "off")
            send("b-")
            steps["status"] = tracediff("control", store, "status", "--json", "-")
            steps["on"] = tracediff("control", store, "on")
            send("c-")
        finally:
            servers.stop(proc)
    return {"store": store, "steps": steps, "returncode": proc.returncode, "log": log_path.read_text()}


def _attrs(store: Path, tap: str) -> dict:
    (doc,) = sorted((store / tap).glob("*/zarr.json"))
    return json.loads(doc.read_text())["attributes"]


def test_each_step_of_the_switch_ran(switched) -> None:
    for name, step in switched["steps"].items():
        assert step.returncode == 0, (name, step.stdout, step.stderr)
    assert "switched off" in switched["steps"]["off"].stdout
    assert "switched on" in switched["steps"]["on"].stdout
    (answer,) = json.loads(switched["steps"]["status"].stdout)["endpoints"]  # one worker: one endpoint
    assert answer["state"] == "off" and answer["rows"]["switched_off"] > 0 and answer["rows"]["lost"] == 0


def test_the_store_holds_only_the_requests_sent_while_on(switched) -> None:
    from tracediff.store import open_store

    for tap in ("fc_in", "aux_hidden"):
        (stream,) = open_store(switched["store"]).tap_streams(tap)
        names = set(dict(stream.seq_names).values())
        assert names == {f"{p}{i}" for p in ("a-", "c-") for i in range(4)}, (tap, sorted(names))


def test_the_rows_of_the_off_requests_are_counted_skipped_never_lost(switched) -> None:
    for tap in ("fc_in", "aux_hidden", "draft_steps"):
        attrs = _attrs(switched["store"], tap)
        commit = attrs["commit"]
        assert commit["dropped_rows"] == 0, tap
        assert commit["skipped_rows"] > 0 and attrs["skip_reasons"] == {"switched off": commit["skipped_rows"]}, tap
        assert [(e["state"], e["by"]) for e in attrs["switch"]] == [
            ("on", "start"), ("off", "http 127.0.0.1"), ("on", "http 127.0.0.1")], tap
    assert "rows lost" not in switched["log"] and "tracediff: error" not in switched["log"], switched["log"][-3000:]


def test_the_writer_ran_off_the_cores_vllm_bound_its_worker_to(switched) -> None:
    from tracediff.record.cores import online_cores

    threads = _attrs(switched["store"], "fc_in")["threads"]
    engine, writer = set(threads["engine_cores"]), set(threads["writer_cores"])
    if engine >= online_cores():
        assert "kept the inherited" in threads["how"], threads  # nothing free: said, and left as it was
    else:
        assert writer and writer.isdisjoint(engine), threads


def test_a_server_left_switched_off_says_so_and_exits_0_even_when_vllm_kills_its_worker(tmp_path: Path) -> None:
    """``--start-off`` never switched on, the production default: vLLM SIGKILLs its worker at shutdown
    (no ``--shutdown-timeout``), so no writer group was ever made; the worker's row ledger still says
    the drafter ran while off: one note, the server's exit code, no "never fired" (was: exit 2, "the
    capture points never fired", "no request reached the drafter" while requests had)."""
    from tracediff.testing.tiny_llama import make_sequences

    tl = h.build_target(tmp_path)
    h.record_trainer(tmp_path / "train.zarr", tl, RIGHT, make_sequences(n_seqs=2, min_len=6, max_len=12,
                                                                         vocab_size=h.VOCAB, seed=2))
    draft = h.build_draft(tmp_path, "draft_vllm", tl, [2, 4, 5], "top")
    served = h.record_served(h.vllm_python(), tmp_path, "server", draft, tmp_path / "train.zarr", "--start-off",
                             "--sample-requests", "0.5", "--commit", "background", new_tokens=4)  # both exit 0
    store, said = served["store"], served["log"]
    lines = [line for line in said.splitlines() if line.startswith("tracediff:")]
    notes = [line for line in lines if line.startswith("tracediff: note:")]
    assert len(notes) == 1 and "switched off the whole time" in notes[0], lines
    assert not [line for line in lines if "never fired" in line or "tracediff: error" in line], lines
    assert not [line for line in lines if "tracediff: warning" in line], lines  # ("did a request reach the server?")
    assert not store.exists()  # nothing recorded: no empty store left behind
