"""End to end with a live SGLang server on CPU: record it, replay a trainer trace to it, compare.

A tiny random-weight Llama is saved to disk; the trainer trace is recorded from the same model in
transformers (the fc input = cat of HF hidden_states[2], [4], [5]); the server runs
``--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids 1 3 4`` (SGLang captures
the states entering layers 2, 4, 5: the same tensors) under ``tracediff record --adapter sglang``;
``tracediff send`` replays the trainer's token ids; compare says ``match``, and ``mismatch`` naming
the segments against a trainer that used other layers. The server listens on 127.0.0.1 only and is
stopped through the pid of its ``tracediff record`` process, which forwards SIGTERM.

A second server records through the SGLang plugin alone (``TRACEDIFF_SGLANG_STORE=s3://...``, no
``tracediff record``) into a bucket of moto's S3 server on loopback (tests/object_store.py): the
rows land in the bucket and compare against the trainer as the folder's do.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import skip_unless_installed

skip_unless_installed("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")

import servers  # noqa: E402
import sglang_harness as h  # noqa: E402
from object_store import ObjectStore, object_store  # noqa: E402

pytestmark = pytest.mark.slow
__all__ = ["object_store"]  # the fixture, used by name

HIDDEN, LAYERS, VOCAB = 32, 6, 128
RIGHT = ["hs2", "hs4", "hs5"]  # what --return-aux-hidden-state-layer-ids 1 3 4 captures
WRONG = ["hs1", "hs3", "hs4"]  # a trainer that took the layer ids as HF indices
BIN = Path(sys.executable).parent


def tracediff(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRACEDIFF_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def record_trainer(path: Path, layers: list[str]) -> None:
    import tracediff as td
    from tracediff.testing.pipelines import run_trainer
    from tracediff.testing.tiny_llama import DraftHead, build_tiny_llama, make_sequences

    tl = build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0)
    draft = DraftHead(HIDDEN, len(layers))
    seqs = make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=VOCAB, seed=1)
    ids = [int(name[2:]) for name in layers]  # HF hidden_states indices, as the trainer counts them
    with td.record(path, role="trainer", meta={"aux_layers": {"ids": ids, "convention": "capture"}}) as rec:
        rec.tap(draft.fc, "fc_in", segment_size=HIDDEN, segment_labels=layers)
        run_trainer(tl, draft, seqs, layers, on_batch=lambda labels: rec.labels(**labels))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model on disk and the two trainer traces recorded from it."""
    from tracediff.testing.tiny_llama import build_tiny_llama

    root = tmp_path_factory.mktemp("trainer")
    build_tiny_llama(hidden_size=HIDDEN, num_layers=LAYERS, vocab_size=VOCAB, seed=0).model.save_pretrained(
        root / "model")
    traces = {"model": root / "model", "right": root / "train_right.zarr", "wrong": root / "train_wrong.zarr"}
    record_trainer(traces["right"], RIGHT)
    record_trainer(traces["wrong"], WRONG)
    return traces


SERVER_ARGS = ["--device", "cpu", "--skip-tokenizer-init", "--max-total-tokens", "4096", "--host", "127.0.0.1",
               "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
               "--return-aux-hidden-state-layer-ids", "1", "3", "4", "--disable-radix-cache"]


def serve_and_send(root: Path, launcher: list[str], trainer: dict[str, Path], **env_extra: str) -> dict:
    """Start ``launcher`` + SGLang's server on a free port, replay the right trainer trace to it with
    ``tracediff send``, stop it with SIGTERM: (send's result, exit code, log, url)."""
    port = h.free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEDIFF_CONFIG", *h._DIST_ENV)}
    # SGLang imports torchvision / vllm on CPU: tracediff's shim chains to this test-only stub.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(h.STUBS), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(env_extra)
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [*launcher, sys.executable, "-m", "sglang.launch_server", "--model-path", str(trainer["model"]),
         "--port", str(port), *SERVER_ARGS],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    try:
        servers.wait_healthy(url, proc, root / "server.log")
        sent = tracediff("send", trainer["right"], "--url", url, "--concurrency", "2")
    finally:
        servers.stop(proc)  # SIGTERM (tracediff record forwards it to the server)
        log.close()
    return {"sent": sent, "returncode": proc.returncode, "log": (root / "server.log").read_text(), "url": url}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, trainer: dict[str, Path]):
    """The recorded server: (store, trainer traces, the record process's result and stderr)."""
    root = tmp_path_factory.mktemp("live")
    store = root / "server.zarr"
    run = serve_and_send(root, [str(BIN / "tracediff"), "record", "--adapter", "sglang", "-o", str(store), "--"],
                         trainer)
    yield {"store": store, "traces": trainer, **run}


def test_send_replays_every_training_sequence(live) -> None:
    sent = live["sent"]
    assert sent.returncode == 0, sent.stderr
    assert "sent 4 of 4 sequences (52 tokens)" in sent.stdout


def server_rows_are_the_training_tokens(store: Path | str, trainer_trace: Path) -> dict:
    """Each replayed request's prefill rows carry the trainer sequence's token ids and positions,
    keyed by request id (= the trainer's sequence key); returns the server group's attributes."""
    from tracediff.store import PHASES, open_store

    with open_store(store) as st:
        (stream,) = st.tap_streams("aux_hidden")
        labels = stream.labels()
        names = stream.seq_names
        attrs = stream.attrs
    with open_store(trainer_trace) as tr:
        (ref,) = tr.tap_streams("fc_in")
        ref_labels = ref.labels()
    prefill = labels["phase"] == PHASES.index("prefill")
    for key in range(4):  # rid = the trainer's sequence key
        request = labels["seq"] == names_to_ids(names)[str(key)]
        ref_rows = ref_labels["seq"] == key
        rows = request & prefill
        assert labels["token_id"][rows].tolist() == ref_labels["token_id"][ref_rows].tolist()
        assert labels["position"][rows].tolist() == ref_labels["position"][ref_rows].tolist()
        # The overlap scheduler may run one decode step for a request that just finished: the
        # generated token's row, past the training sequence.
        assert (labels["position"][request & ~prefill] >= ref_rows.sum()).all()
    return attrs


def test_server_rows_are_the_training_tokens_keyed_by_request_id(live) -> None:
    attrs = server_rows_are_the_training_tokens(live["store"], live["traces"]["right"])
    meta = attrs["meta"]["sglang"]
    assert meta["sglang_version"] == "0.5.23"
    assert meta["layers_to_capture"] == [2, 4, 5]
    assert meta["aux_layer_ids"] == [1, 3, 4]
    assert meta["aux_layer_ids_source"] == "server arg --return-aux-hidden-state-layer-ids"
    assert meta["server_args"]["cuda_graphs"] is False
    assert attrs["segment_labels"] == RIGHT and attrs["rank"] == 0
    assert attrs["source"]["framework"] == "sglang"


def names_to_ids(names: dict[int, str]) -> dict[str, int]:
    return {v: k for k, v in names.items()}


def test_record_summary_lists_the_server_rows(live) -> None:
    assert live["returncode"] == 0  # SIGTERM: SGLang drains and exits cleanly, the recorder closes
    summary = live["log"].split("tracediff: command exited with code")[-1]
    assert re.search(r"aux_hidden/\S+: \d+ rows, width 96 float\d+, \d+ batches, dropped 0, skipped 0, closed", summary)
    assert "Traceback" not in summary
    # Every capture point fired and the flags for full coverage were given: nothing to warn about.
    assert "tracediff: warning: sglang" not in summary


def test_compare_matches_the_trainer_that_used_the_same_layers(live) -> None:
    result = tracediff("compare", live["traces"]["right"], live["store"], "--ref-tap", "fc_in", "--cand-tap",
                       "aux_hidden", "--json", live["store"].parent / "right.json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((live["store"].parent / "right.json").read_text())
    assert report["verdict"] == "match"
    assert [(m["candidate"], m["reference"], m["status"]) for m in report["segment_map"]] == [
        (0, 0, "same"), (1, 1, "same"), (2, 2, "same")]


def test_compare_names_the_mismatched_segments_of_a_trainer_with_other_layers(live) -> None:
    result = tracediff("compare", live["traces"]["wrong"], live["store"], "--ref-tap", "fc_in", "--cand-tap",
                       "aux_hidden", "--json", live["store"].parent / "wrong.json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((live["store"].parent / "wrong.json").read_text())
    assert report["verdict"] == "mismatch"
    kinds = {f["kind"] for f in report["findings"] if f["severity"] == "error"}
    assert kinds & {"segment_order", "segment_missing", "segment_extra", "segment_value"}, kinds
    # The server's hs4 is the trainer's segment 2; its hs2 and hs5 are layers the trainer never used
    # (only related to its neighbours).
    by_candidate = {m["candidate"]: m for m in report["segment_map"]}
    assert by_candidate[1]["reference"] == 2 and by_candidate[1]["cosine"] > 0.999, report["segment_map"]
    assert by_candidate[0]["status"] not in ("same", "moved") and by_candidate[2]["status"] not in ("same", "moved")
    assert "segment" in result.stdout
    # Other layers are other data, never a normalisation; the fix is in SGLang's own numbering.
    assert "segment_scale" not in {f["kind"] for f in report["findings"]}
    fixes = [f["evidence"]["fix"] for f in report["findings"] if "fix" in f["evidence"]]
    assert len(fixes) == 1 and fixes[0]["engine"] == "sglang", fixes
    assert fixes[0]["candidate_layers"] == [2, 4, 5] and fixes[0]["value"] == [0, 2, 3], fixes


def test_send_to_a_stopped_server_is_a_one_line_error(live) -> None:
    result = tracediff("send", live["traces"]["right"], "--url", live["url"], "--retries", "0", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "cannot reach the server" in result.stderr


# --------------------------------------------------------------- the plugin, into a bucket
@pytest.fixture(scope="module")
def live_s3(tmp_path_factory: pytest.TempPathFactory, trainer: dict[str, Path], object_store: ObjectStore):
    """A server started by "other tooling": SGLang's own launcher, recording through the tracediff
    plugin into ``TRACEDIFF_SGLANG_STORE=s3://...`` (credentials and endpoint from the standard
    AWS_* environment the object_store fixture set)."""
    root = tmp_path_factory.mktemp("live_s3")
    url = f"s3://{object_store.bucket()}/server.zarr"
    run = serve_and_send(root, [], trainer, TRACEDIFF_SGLANG_STORE=url)
    yield {"store": url, "traces": trainer, "fs": object_store.fs, **run}


def test_the_plugin_records_the_server_into_the_bucket(live_s3) -> None:
    sent = live_s3["sent"]
    assert sent.returncode == 0, sent.stderr
    assert "sent 4 of 4 sequences (52 tokens)" in sent.stdout
    assert "Traceback" not in live_s3["log"] and "tracediff: error" not in live_s3["log"], live_s3["log"][-4000:]
    objects = live_s3["fs"].find(live_s3["store"].removeprefix("s3://"))
    assert any("/aux_hidden/" in key and "/values/c/" in key for key in objects), objects
    attrs = server_rows_are_the_training_tokens(live_s3["store"], live_s3["traces"]["right"])
    assert attrs["meta"]["sglang"]["layers_to_capture"] == [2, 4, 5]
    assert attrs["segment_labels"] == RIGHT and attrs["source"]["framework"] == "sglang"
    assert attrs["commit"]["status"] == "closed" and attrs["commit"]["dropped_rows"] == 0


def test_compare_of_the_bucket_matches_the_trainer_as_the_folder_does(live_s3, tmp_path: Path) -> None:
    right = tracediff("compare", live_s3["traces"]["right"], live_s3["store"], "--ref-tap", "fc_in", "--cand-tap",
                      "aux_hidden", "--json", tmp_path / "right.json")
    assert right.returncode == 0, right.stdout + right.stderr
    report = json.loads((tmp_path / "right.json").read_text())
    assert report["verdict"] == "match" and report["candidate"]["path"] == live_s3["store"]
    assert [(m["candidate"], m["reference"], m["status"]) for m in report["segment_map"]] == [
        (0, 0, "same"), (1, 1, "same"), (2, 2, "same")]
    wrong = tracediff("compare", live_s3["traces"]["wrong"], live_s3["store"], "--ref-tap", "fc_in", "--cand-tap",
                      "aux_hidden", "--json", tmp_path / "wrong.json")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert json.loads((tmp_path / "wrong.json").read_text())["verdict"] == "mismatch"
