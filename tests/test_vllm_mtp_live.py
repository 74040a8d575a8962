"""End to end with a real vLLM 0.32 engine on CPU drafting with DeepSeek's MTP head: record, compare.

A tiny random DeepSeek-V3 target (4 layers, hidden 128, MLA, 4 routed experts) with one MTP layer at
``model.layers.4.*`` is written to disk (:mod:`tracediff.testing.deepseek_mtp`) and served by vLLM's
OpenAI server with ``{"method": "mtp", "num_speculative_tokens": 2}`` under ``tracediff record
--adapter vllm``; ``tracediff send`` replays the trainer's sequences (8 new tokens each, so decode
steps verify drafts, some rejected).

The trainer side is a real forward of the same checkpoint in transformers (``DeepseekV3ForCausalLM``)
and the MTP layer's own ``enorm`` / ``hnorm`` / embedding from the checkpoint: row p =
``[enorm(embed(x_{p+1})) | hnorm(h_p)]``, recorded with tracediff's recorder under the MTP row model,
once with ``h_p`` after the target's final norm (what vLLM feeds: a match) and once before it (a
mismatch). The sequences are random prompts followed by the target's greedy token, so that the
server's last prompt row (whose next token is the one it samples) is the trainer's last row.

The server listens on 127.0.0.1 only and is stopped through the pid of the ``tracediff record``
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
import torch
import vllm_harness as h

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
K = 2


def tracediff(*args: object, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracediff", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=h.vllm_env())


def _record_reference(path: Path, target: Path, sequences: list[list[int]], *, post_norm: bool) -> Path:
    """The trainer's MTP head input for every position with a next token, from a transformers forward."""
    import tracediff as td
    from tracediff.store.row_model import mtp
    from tracediff.testing.deepseek_mtp import HIDDEN, mtp_head_inputs

    rows = mtp_head_inputs(target, sequences, final_norm="post" if post_norm else "pre")
    with td.record(path, role="trainer", on_full="block") as rec:
        rec.declare("fc_in", segment_size=HIDDEN, segment_labels=["embed_next", "hidden"],
                    row_model=mtp(final_norm=post_norm))
        for i, (ids, values) in enumerate(zip(sequences, rows, strict=True)):
            n = len(ids) - 1
            rec.capture("fc_in", values, labels={
                "seq": np.array([str(i)] * n, dtype=object), "position": np.arange(n), "token_id": np.array(ids[:-1]),
                "next_token_id": np.array(ids[1:]), "phase": "train", "step": i, "valid": True})
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from tracediff.testing.deepseek_mtp import VOCAB, greedy_continuation, write_deepseek_mtp
    from tracediff.testing.tiny_llama import make_sequences

    python = h.vllm_python()
    root = tmp_path_factory.mktemp("vllm_mtp")
    target = write_deepseek_mtp(root / "target")
    prompts = make_sequences(n_seqs=4, min_len=6, max_len=16, vocab_size=VOCAB, seed=1)
    sequences = greedy_continuation(target, [[int(t) for t in p] for p in prompts])
    post = _record_reference(root / "train_post.zarr", target, sequences, post_norm=True)
    pre = _record_reference(root / "train_pre.zarr", target, sequences, post_norm=False)
    store, port = root / "server.zarr", h.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    cmd = [str(Path(python).parent / "tracediff"), "record", "--adapter", "vllm", "-o", str(store), "--",
           str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--skip-tokenizer-init",
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
           "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--per-request-spec-decode-metrics", "detailed", "--shutdown-timeout", "10",
           "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": K})]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.vllm_env(), start_new_session=True)
        try:
            servers.wait_healthy(url, proc, log_path)
            sent = tracediff("send", post, "--url", url, "--engine", "vllm", "--max-new-tokens", NEW_TOKENS,
                             "--json", root / "send.json")
        finally:
            servers.stop(proc)
    report = json.loads((root / "send.json").read_text()) if (root / "send.json").is_file() else {}
    return {"root": root, "target": target, "sequences": sequences, "store": store, "post": post, "pre": pre,
            "sent": sent, "report": report, "returncode": proc.returncode, "log": log_path.read_text()}


def _stream(store: Path):
    from tracediff.store import open_store

    (stream,) = open_store(store).tap_streams("fc_in")
    return stream


def test_the_server_answers_every_trainer_sequence_drafting_with_mtp(run) -> None:
    sent = run["sent"]
    assert sent.returncode == 0, sent.stdout + sent.stderr + run["log"][-3000:]
    assert "sent 4 of 4 sequences" in sent.stdout
    assert run["returncode"] == 0, run["log"][-3000:]
    for key, r in run["report"]["responses"].items():
        assert len(r["output_ids"]) == NEW_TOKENS, key
        assert r["spec_decoding"]["num_spec_steps"] > 0, r


def test_mtp_rows_are_labelled_by_request_position_and_next_token(run) -> None:
    """The first drafter call of each request: rows p = 0..n-1 of its prompt, token x_p, next x_{p+1}
    (the token vLLM samples at the last row, which is the trainer's greedy token)."""
    stream = _stream(run["store"])
    labels, names = stream.labels(), dict(stream.seq_names)
    assert sorted(names.values()) == ["0", "1", "2", "3"]
    outputs = {k: r["output_ids"] for k, r in run["report"]["responses"].items()}
    for i, full in enumerate(run["sequences"]):
        key, prompt = str(i), full[:-1]
        code = next(c for c, k in names.items() if k == key)
        first = (labels["seq"] == code) & (labels["step"] == labels["step"][labels["seq"] == code].min())
        assert labels["position"][first].tolist() == list(range(len(prompt)))
        assert labels["token_id"][first].tolist() == prompt
        assert labels["next_token_id"][first].tolist() == full[1:]
        assert outputs[key][0] == full[-1]  # vLLM's greedy token is transformers'
        assert labels["valid"][first].all()


def test_the_stored_row_model_is_mtp_with_the_hidden_state_after_the_final_norm(run) -> None:
    stream = _stream(run["store"])
    model = stream.row_model
    assert model is not None and model.name == "mtp"
    assert [s.kind for s in model.slots] == ["embedding", "hidden"]
    assert model.slots[0].token_offset == 1 and model.slots[1].final_norm is True
    assert stream.segment_size == 128 and stream.segment_labels == ["embed_next", "hidden"]
    assert stream.attrs["zeroed_slots"][0]["slot"] == 0 and stream.attrs["zeroed_slots"][0]["positions"] == [0]
    # The declared zeros are not counted by record's light lint, so its summary warns of none.
    assert stream.attrs["row_checks"]["zero_rows"] == [0, 0]
    assert "rows are all zeros" not in run["log"]
    v = stream.attrs["meta"]["vllm"]
    assert v["method"] == "mtp" and v["num_speculative_tokens"] == K
    mtp = v["mtp"]
    assert mtp["layers"] == [4] and mtp["hidden_final_norm"] == "after"
    # Measured on the rows, not only read from vLLM's code: h / final-norm weight has RMS 1.
    assert mtp["hidden_final_norm_measured"]["final_norm"] == "after"
    assert abs(mtp["hidden_final_norm_measured"]["rms_over_norm_weight"] - 1) < 1e-3
    assert mtp["embed_tokens_from"] == "target" and mtp["shared_head_from"] == {"4": "target"}


def test_rejected_slots_are_invalid_as_the_engine_counted_them(run) -> None:
    """Per request and decode step, valid rows = 1 + the drafts the engine accepted at that step."""
    stream = _stream(run["store"])
    labels, names = stream.labels(), dict(stream.seq_names)
    seen = set()
    for code, key in names.items():
        mine = labels["seq"] == code
        steps = np.unique(labels["step"][mine])[1:]  # after the prompt's call
        valid = [int(labels["valid"][mine & (labels["step"] == t)].sum()) for t in steps]
        accepted = run["report"]["responses"][key]["spec_decoding"]["per_step_accepted"]
        assert valid == [1 + a for a in accepted], key
        seen |= set(accepted)
        assert all(int((mine & (labels["step"] == t)).sum()) == 1 + K for t in steps)
    assert 0 in seen and max(seen) > 0, seen  # both rejected and accepted drafts


def test_valid_rows_are_the_mtp_input_of_the_served_tokens_and_rejected_ones_stale(run) -> None:
    """Every valid row (prompt and decode) is the reference row of the served sequence (prompt +
    output) at its position: the embedding half exactly (zero at position 0, as vLLM feeds it), the
    hidden half as the target's state after its final norm (vLLM's CPU kernels differ from
    transformers' by ~1% there), far from the state before it. Rejected slots hold the tokens of
    drafts the target did not take."""
    from tracediff.testing.deepseek_mtp import HIDDEN, mtp_head_inputs

    stream = _stream(run["store"])
    labels, names = stream.labels(), dict(stream.seq_names)
    values = torch.from_numpy(np.asarray(stream.read(), dtype=np.float32))
    served = {k: run["sequences"][int(k)][:-1] + r["output_ids"] for k, r in run["report"]["responses"].items()}
    keys = sorted(served)
    refs = {norm: dict(zip(keys, mtp_head_inputs(run["target"], [served[k] for k in keys], final_norm=norm,
                                                 zero_position0=True), strict=True)) for norm in ("post", "pre")}
    stale = checked = 0
    for code, key in names.items():
        for row in np.flatnonzero(labels["seq"] == code):
            p = int(labels["position"][row])
            if not labels["valid"][row]:
                stale += int(p < len(served[key]) and labels["token_id"][row] != served[key][p])
                continue
            assert labels["token_id"][row] == served[key][p]
            if p + 1 == len(served[key]):
                continue  # the last output token's row: its next token is one the response did not return
            assert labels["next_token_id"][row] == served[key][p + 1]
            got, post, pre = values[row], refs["post"][key][p], refs["pre"][key][p]
            assert torch.allclose(got[:HIDDEN], post[:HIDDEN], atol=1e-4), (key, p)
            if p == 0:
                assert (got[:HIDDEN] == 0).all()
            cos = torch.nn.functional.cosine_similarity(got[HIDDEN:], post[HIDDEN:], dim=0)
            assert cos > 0.99, (key, p, float(cos))
            assert (got[HIDDEN:] - post[HIDDEN:]).norm() < 0.5 * (got[HIDDEN:] - pre[HIDDEN:]).norm(), (key, p)
            checked += 1
    assert checked > sum(len(s) - 1 for s in run["sequences"])  # decode rows too
    assert stale > 0


def test_compare_matches_the_trainer_that_feeds_the_state_after_the_final_norm(run) -> None:
    out = run["root"] / "post.json"
    result = tracediff("compare", run["post"], run["store"], "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "match"


def test_compare_finds_a_trainer_that_fed_the_state_before_the_final_norm(run) -> None:
    out = run["root"] / "pre.json"
    result = tracediff("compare", run["pre"], run["store"], "--json", out)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "mismatch"
    assert "CANNOT TELL" not in result.stdout.upper()
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    # The hidden slot is what differs (the embedding slot still matches).
    assert errors and any("segment 1 (hidden)" in f["message"] for f in errors), report["findings"]
    assert not any("segment 0 (embed_next)" in f["message"] for f in errors), report["findings"]


def test_preflight_predicted_the_row_model_vllm_recorded(run) -> None:
    """What `tracediff preflight` says vLLM builds for this checkpoint, from configs and vLLM's rule,
    is what vLLM really fed: the recorded row model and zeroed positions."""
    from tracediff.preflight import run_preflight

    stream = _stream(run["store"])
    (view,) = run_preflight(run["target"], None, ("vllm",), versions={"vllm": "0.32.0"}).engines
    assert view.row_model["row_model"] == stream.row_model.to_json()
    assert view.row_model["zeroed_embedding_positions"] == stream.attrs["zeroed_slots"][0]["positions"]
