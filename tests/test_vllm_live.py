"""End to end with a real vLLM 0.32 engine on CPU running an EAGLE-3 draft: record, replay, compare.

A tiny random-weight Llama target (head_dim 64) and two one-layer EAGLE-3 drafts are written to disk:
``draft_vllm`` lists the aux layer ids ``[2, 4, 5]`` at the top level of its config (vLLM reads id k
as the input of layer k = HF ``hidden_states[k]``: the trainer's hs2, hs4, hs5) and ``draft_sglang``
has the ids ``[1, 3, 4]`` in ``eagle_config``, which are right for SGLang (it adds 1) and name
hs1, hs3, hs4 in vLLM; it also has a 100-token draft vocabulary whose ``d2t`` holds absolute ids (draft id i -> 2i: still
inside the vocabulary, so vLLM runs, drafting wrong tokens). The trainer trace is recorded from the same target in transformers.

* ``live``: ``tracediff record --adapter vllm -- python -m vllm.entrypoints.openai.api_server ...``
  with ``draft_vllm``, ``tracediff send --engine vllm`` replays the trainer's sequences (12 new
  tokens each, so that decode steps verify drafts), and the server is stopped with SIGTERM right
  after the last response, without ``--shutdown-timeout`` (vLLM then SIGKILLs its worker).
* ``offline``: an ``LLM(...)`` script under ``tracediff record`` with ``draft_sglang``.

Servers listen on 127.0.0.1 only and are stopped through the pid of the ``tracediff record``
process we started.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import servers
import vllm_harness as h

pytestmark = pytest.mark.slow

RIGHT = ["hs2", "hs4", "hs5"]
NEW_TOKENS = 12
HERE = Path(__file__).resolve().parent


def tracediff(*args: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = h.vllm_env()
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    tl = h.build_target(root)
    seqs = make_sequences(n_seqs=4, min_len=6, max_len=20, vocab_size=h.VOCAB, seed=1)
    h.record_trainer(root / "train.zarr", tl, RIGHT, seqs)
    return {"root": root, "python": python, "target": root / "target", "train": root / "train.zarr", "tl": tl,
            "draft_vllm": h.build_draft(root, "draft_vllm", tl, [2, 4, 5], "top"),
            "draft_sglang": _with_absolute_d2t(h.build_draft(root, "draft_sglang", tl, [1, 3, 4], "eagle_config",
                                                            draft_vocab_size=100))}


def _with_absolute_d2t(path: Path) -> Path:
    """The converter bug on top: d2t holding the target ids themselves instead of offsets."""
    from tracediff.testing.eagle3 import with_absolute_d2t

    return with_absolute_d2t(path, path)


@pytest.fixture(scope="module")
def live(models: dict[str, Path]) -> dict[str, object]:
    root, python = models["root"], models["python"]
    store, port = root / "server.zarr", h.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    tracediff_bin = Path(python).parent / "tracediff"
    cmd = [str(tracediff_bin), "record", "--adapter", "vllm", "-o", str(store), "--",
           *h.serve_command(python, models["target"], models["draft_vllm"], port, shutdown_timeout=None)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.vllm_env(), start_new_session=True)
        try:
            servers.wait_healthy(url, proc, log_path)
            sent = tracediff("send", models["train"], "--url", url, "--engine", "vllm", "--max-new-tokens",
                             NEW_TOKENS, "--json", root / "send.json")
        finally:
            servers.stop(proc)  # at once: no --shutdown-timeout, so vLLM SIGKILLs its worker
    report = json.loads((root / "send.json").read_text()) if (root / "send.json").is_file() else {}
    return {"store": store, "sent": sent, "report": report, "returncode": proc.returncode,
            "log": log_path.read_text(), "url": url}


def _labels(store: Path, tap: str) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    from tracediff.store import open_store

    s = open_store(store)
    (stream,) = s.tap_streams(tap)
    return stream.labels(), dict(stream.seq_names)


def test_send_replays_every_training_sequence_through_the_openai_api(live) -> None:
    sent = live["sent"]
    assert sent.returncode == 0, sent.stdout + sent.stderr
    assert "sent 4 of 4 sequences" in sent.stdout
    responses = live["report"]["responses"]
    assert sorted(responses) == ["0", "1", "2", "3"]
    for key, r in responses.items():
        assert r["request_id"] == key
        assert len(r["output_ids"]) == NEW_TOKENS
        spec = r["spec_decoding"]
        # The prefill gives one token, each verify step 1 + the drafts accepted (the last may overshoot).
        assert spec["num_spec_steps"] == len(spec["per_step_accepted"]) > 0, r
        assert 1 + sum(1 + a for a in spec["per_step_accepted"]) >= NEW_TOKENS, r


def test_every_row_of_every_response_survives_the_worker_being_killed(live) -> None:
    """No --shutdown-timeout: vLLM SIGKILLs the worker; rows are committed before each step returns."""
    from tracediff.send import sequences_from_trace

    labels, names = _labels(live["store"], "fc_in")
    sequences = {s.key: s.input_ids for s in sequences_from_trace(live["store"].parent / "train.zarr")}
    for code, key in names.items():
        mine = labels["seq"] == code
        steps = live["report"]["responses"][key]["spec_decoding"]["num_spec_steps"]
        # Prompt rows, then 1 + K verify rows per decode step (K = 3 drafts), rejected ones included.
        assert int(mine.sum()) == len(sequences[key]) + steps * 4, key
    assert "did not close its writer" in live["log"]  # it really was killed, not closed


def test_server_rows_are_the_training_tokens_keyed_by_the_client_request_id(live) -> None:
    from tracediff.send import sequences_from_trace
    from tracediff.store import PHASES

    labels, names = _labels(live["store"], "fc_in")
    aux, aux_names = _labels(live["store"], "aux_hidden")
    assert sorted(names.values()) == ["0", "1", "2", "3"]  # not vLLM's "cmpl-0-0-<random>"
    output = {k: r["output_ids"] for k, r in live["report"]["responses"].items()}
    for seq in sequences_from_trace(live["store"].parent / "train.zarr"):
        code = next(c for c, k in names.items() if k == seq.key)
        rows = (labels["seq"] == code) & (labels["step"] == labels["step"][labels["seq"] == code].min())
        n = len(seq.input_ids)
        assert labels["position"][rows].tolist() == list(range(n))
        assert labels["token_id"][rows].tolist() == seq.input_ids
        # The draft's input token (after vLLM's rotation): x_{p+1}, and the first generated token last.
        assert labels["next_token_id"][rows].tolist() == seq.input_ids[1:] + [output[seq.key][0]]
        assert set(labels["phase"][rows].tolist()) == {PHASES.index("draft_extend")}
        acode = next(c for c, k in aux_names.items() if k == seq.key)
        arows = (aux["seq"] == acode) & (aux["position"] < n)
        assert set(aux["phase"][arows].tolist()) == {PHASES.index("prefill")}


def test_rejected_verify_rows_are_invalid_as_the_engine_counted_them(live) -> None:
    """Per request and decode step: valid rows = 1 + the drafts the engine accepted at that step."""
    from tracediff.store import PHASES

    labels, names = _labels(live["store"], "aux_hidden")
    verify = labels["phase"] == PHASES.index("verify")
    seen_accepts = set()
    for code, key in names.items():
        mine = verify & (labels["seq"] == code)
        steps = np.unique(labels["step"][mine])
        valid = [int(labels["valid"][mine & (labels["step"] == t)].sum()) for t in steps]
        accepted = live["report"]["responses"][key]["spec_decoding"]["per_step_accepted"]
        assert valid == [1 + a for a in accepted], key
        seen_accepts |= set(accepted)
        # Valid rows are the leading ones of each step, and consecutive positions across steps.
        positions = labels["position"][mine & labels["valid"]]
        assert positions.tolist() == list(range(int(positions[0]), int(positions[0]) + len(positions)))
    assert 0 in seen_accepts and max(seen_accepts) > 0, seen_accepts  # both accepted and rejected drafts


def test_provenance_names_vllm_the_resolved_layers_and_the_draft_weights(live) -> None:
    from tracediff.store import open_store

    s = open_store(live["store"])
    (stream,) = s.tap_streams("fc_in")
    assert stream.attrs["source"]["framework"] == "vllm"
    meta = stream.attrs["meta"]
    v = meta["vllm"]
    assert v["vllm_version"].startswith("0.32")
    assert v["aux_hidden_state_layers"] == [2, 4, 5]
    assert v["draft"]["aux_layer_ids_source"].endswith("(top level)")
    assert v["draft"]["embed_tokens_from"] == "target" and v["draft"]["lm_head_from"] == "draft"
    assert v["draft"]["d2t"] == {"present": False}
    assert v["num_speculative_tokens"] == 3 and v["tensor_parallel_size"] == 1 and v["cuda_graphs"] is False
    assert v["draft_attention_backends"] and all(isinstance(b, str) for b in v["draft_attention_backends"])
    assert v["draft"]["max_position_embeddings"] == 4096
    assert "rope_theta" in v["draft"] or "theta" in str(v["draft"].get("rope_parameters"))
    assert meta["aux_layers"]["convention"] == "vllm" and meta["aux_layers"]["ids"] == [2, 4, 5]
    assert stream.segment_labels == RIGHT


def test_compare_matches_the_trainer_when_the_ids_are_right_for_vllm(live, models) -> None:
    out = models["root"] / "right.json"
    result = tracediff("compare", models["train"], live["store"], "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "match"
    assert [(m["candidate"], m["reference"], m["status"]) for m in report["segment_map"]] == [
        (0, 0, "same"), (1, 1, "same"), (2, 2, "same")]


@pytest.fixture(scope="module")
def offline(models: dict[str, Path]) -> dict[str, object]:
    """An LLM(...) script under tracediff record, with the draft whose ids are SGLang's."""
    root, python = models["root"], models["python"]
    store = root / "offline.zarr"
    tracediff_bin = Path(python).parent / "tracediff"
    run = subprocess.run(
        [str(tracediff_bin), "record", "--adapter", "vllm", "-o", str(store), "--", str(python),
         str(HERE / "vllm_children.py"), "offline", str(models["train"]), str(models["target"]),
         str(models["draft_sglang"]), "4"],
        capture_output=True, text=True, timeout=600, env=h.vllm_env())
    return {"store": store, "run": run}


def test_an_llm_script_under_record_is_recorded_from_its_spawned_engine(offline) -> None:
    run = offline["run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert sorted(result["outputs"]) == ["0", "1", "2", "3"]
    labels, names = _labels(offline["store"], "fc_in")
    assert sorted(names.values()) == ["0", "1", "2", "3"]  # add_request ids, not "<id>-<random>"
    assert "fc_in/tp0-pid" in run.stderr


def test_compare_names_the_sglang_numbering_and_the_vllm_value_to_set(offline, models) -> None:
    out = models["root"] / "wrong.json"
    result = tracediff("compare", models["train"], offline["store"], "--json", out)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "mismatch"
    fixes = [f["evidence"]["fix"] for f in report["findings"] if "fix" in f["evidence"]]
    assert len(fixes) == 1, fixes
    fix = fixes[0]
    assert fix["engine"] == "vllm" and fix["convention"] == "vllm"
    assert fix["field"].startswith("eagle_aux_hidden_state_layer_ids")
    assert fix["value"] == [2, 4, 5] and fix["candidate_layers"] == [1, 3, 4]
    assert fix["numbering_mixup"]["convention"] == "sglang" and fix["numbering_mixup"]["ids"] == [1, 3, 4]
    text = " ".join(result.stdout.split())  # the text report wraps lines
    assert "eagle_aux_hidden_state_layer_ids (top level of the draft config) = [2, 4, 5]" in text
    assert "The candidate's ids [1, 3, 4] are the sglang numbering of those layers" in text
    # The one slot both feed (hs4) is found, moved by one.
    by_candidate = {m["candidate"]: m for m in report["segment_map"]}
    assert by_candidate[2]["reference"] == 1


# ------------------------------------------------------------------------------- SGLang vs vLLM
@pytest.fixture(scope="module")
def sglang_store(models) -> Path:
    """The same target in real SGLang classes (in this process) capturing SGLang ids [1, 3, 4] (its
    numbering for hs2, hs4, hs5), over the trainer's sequences keyed as send keys them."""
    pytest.importorskip("sglang", reason="SGLang is not installed: bash requirements/frameworks-sglang.sh installs it")
    import sglang_harness as sh
    import torch

    from tracediff.adapters import sglang as sglang_adapter
    from tracediff.record.recorder import Recorder
    from tracediff.send import sequences_from_trace

    sh.init_sglang()
    from sglang.srt.models.llama import LlamaForCausalLM

    tl = models["tl"]
    target = LlamaForCausalLM(tl.config)
    target.load_weights(tl.model.state_dict().items())
    target.set_eagle3_layers_to_capture([1, 3, 4])
    sequences = sequences_from_trace(models["train"])
    store = models["root"] / "sglang.zarr"
    with Recorder(store, role="server") as rec:
        assert sglang_adapter.attach(rec, target)
        ids = torch.tensor([t for s in sequences for t in s.input_ids])
        batch = sh.forward_batch("EXTEND", ids, [len(s.input_ids) for s in sequences], [s.key for s in sequences])
        sh.run_model(target, batch)
    return store


def test_sglang_vs_vllm_with_the_same_numeric_ids_gives_the_fix_in_vllms_numbering(sglang_store, offline,
                                                                                   models) -> None:
    out = models["root"] / "cross.json"
    result = tracediff("compare", sglang_store, offline["store"], "--ref-tap", "aux_hidden", "--cand-tap", "fc_in",
                       "--json", out)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "mismatch"
    fixes = [f["evidence"]["fix"] for f in report["findings"] if "fix" in f["evidence"]]
    assert len(fixes) == 1, fixes
    fix = fixes[0]
    # SGLang's [1, 3, 4] are physical [2, 4, 5]; the same numbers in vLLM are [1, 3, 4]: set [2, 4, 5].
    assert fix["target_layers"] == [2, 4, 5] and fix["candidate_layers"] == [1, 3, 4], fix
    assert fix["engine"] == "vllm" and fix["value"] == [2, 4, 5]
    assert fix["numbering_mixup"]["convention"] == "sglang"


def test_sglang_vs_vllm_with_each_engines_own_ids_for_the_same_layers_match(sglang_store, live, models) -> None:
    out = models["root"] / "cross_right.json"
    result = tracediff("compare", sglang_store, live["store"], "--ref-tap", "aux_hidden", "--cand-tap", "fc_in",
                       "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "match"
    notes = [f for f in report["findings"] if f["kind"] == "config" and "same physical layers" in f["message"]]
    assert notes, [f["message"] for f in report["findings"]]


# ------------------------------------------------------------------------------------ replay, live
def test_replay_on_the_servers_rows_predicts_the_engines_own_accept_length(live, models) -> None:
    """(d) is what vLLM measured; replay of the same draft on the rows vLLM recorded gives the same
    accepted count at every drafting step: b' - d = 0, nothing past the fc input costs anything."""
    out = models["root"] / "replay.json"
    result = tracediff("replay", models["train"], live["store"], "--draft", models["draft_vllm"], "--target",
                       models["target"], "--send-report", models["root"] / "send.json", "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    r = json.loads(out.read_text())["replay"]
    d, b_engine = r["d"], r["b_engine"]
    assert d["engine"] == "vllm" and d["requests"] == 4
    assert d["replay_agrees"]["steps"] == d["verify_steps"] > 0
    assert d["replay_agrees"]["rate"] == 1.0, d["replay_agrees"]
    assert b_engine["accept_engine"] == pytest.approx(d["accept_engine"], abs=1e-9)
    assert d["accept_engine"] > 1.0  # the engine accepted drafts: the check is not vacuous
    assert "nothing past the fc input costs more" in r["conclusion"]
    # The engine's own draft tokens (draft_steps tap): replay proposes the same ones from the same rows.
    steps = r["engine_drafts"]["steps"]
    assert steps[0]["compared"] >= d["verify_steps"] and steps[0]["same"] == steps[0]["compared"], steps
    assert all(s["unrelated"] == 0 for s in steps)


def test_the_draft_steps_tap_holds_what_the_draft_proposed_per_step(live) -> None:
    from tracediff.store import PHASES, decode_values, open_store

    with open_store(live["store"]) as s:
        (stream,) = s.tap_streams("draft_steps")
        labels, names = stream.labels(), stream.seq_names
        top = decode_values(stream.read(), stream.dtype)
    assert stream.width == 4
    assert (top[:, 0] == labels["next_token_id"]).all()  # the proposed token is the top-1
    assert len(names) == 4
    for code in names:
        mine = labels["seq"] == code
        for step in np.unique(labels["step"][mine]):
            rows = np.flatnonzero(mine & (labels["step"] == step))
            assert len(rows) == 3  # K = 3 draft steps per drafter call
            assert labels["phase"][rows].tolist() == [PHASES.index("draft_extend")] + [PHASES.index("decode")] * 2
            pos = labels["position"][rows]
            assert (np.diff(pos) == 1).all()
            # Step k's input is step k-1's proposal.
            assert (labels["token_id"][rows[1:]] == labels["next_token_id"][rows[:-1]]).all()


def test_the_servers_absolute_d2t_is_flagged_from_its_own_provenance(offline, models) -> None:
    from tracediff.store import open_store

    with open_store(offline["store"]) as s:
        (stream,) = s.tap_streams("fc_in")
        d2t = stream.attrs["meta"]["vllm"]["draft"]["d2t"]
    assert d2t["present"] and d2t["size"] == 100 and d2t["kind"].startswith("absolute ids")
    out = models["root"] / "abs.json"
    result = tracediff("compare", models["train"], offline["store"], "--draft", models["draft_vllm"], "--target",
                       models["target"], "--json", out)
    assert result.returncode == 1
    findings = json.loads(out.read_text())["findings"]
    vocab = [f for f in findings if f["kind"] == "draft_vocabulary"]
    assert len(vocab) == 1 and vocab[0]["severity"] == "error", findings  # once, not per source
    assert "d2t is absolute ids" in vocab[0]["message"], findings
    # compare alone (no draft to replay) reads it from the server's recorded provenance too.
    plain = models["root"] / "abs_plain.json"
    tracediff("compare", models["train"], offline["store"], "--json", plain)
    kinds = {(f["kind"], f["severity"]) for f in json.loads(plain.read_text())["findings"]}
    assert ("draft_vocabulary", "error") in kinds
