"""``--sample-requests RATE`` / ``--max-requests N``: whole requests chosen by a documented hash of their
prompt's token ids (``tracediff.sampled``), every row of a chosen request kept, the others skipped
(left out on purpose, never lost); the same prompts chosen in every recording (tracediff.record.sampling)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import tracediff
from tracediff.errors import UsageError
from tracediff.record.limits import Limits
from tracediff.store import TraceStore

RATE = 0.5
WIDTH = 8


def _by_hand(ids: list[int], rate: float) -> bool:
    """The rule as docs/recording.md states it."""
    digest = hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rate


def _prompts(n: int = 16) -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    return {f"req-{i}": rng.integers(0, 1000, size=int(rng.integers(3, 9))).tolist() for i in range(n)}


def test_sampled_is_the_documented_hash_of_the_prompt_ids() -> None:
    prompts = _prompts(64)
    chosen = [k for k, ids in prompts.items() if tracediff.sampled(ids, RATE)]
    assert chosen == [k for k, ids in prompts.items() if _by_hand(ids, RATE)]
    assert 0 < len(chosen) < len(prompts)
    ids = prompts["req-0"]
    assert tracediff.sampled(ids, RATE) == tracediff.sampled(np.array(ids), RATE) == tracediff.sampled(
        torch.tensor(ids), RATE)
    assert all(tracediff.sampled(p, 1.0) for p in prompts.values())
    for bad in (0, -0.1, 1.5, "0.5"):
        with pytest.raises(ValueError, match="0 < rate <= 1"):
            tracediff.sampled(ids, bad)
        with pytest.raises(UsageError, match="sample_requests"):
            Limits(sample_requests=bad)


def _serve(store, prompts: dict[str, list[int]], **limits: object) -> dict[str, int]:
    """A server's rows as the vLLM adapter hands them over: each request's prompt registered, its
    prefill rows (the prompt's tokens), then decode steps of all running requests in one batch (the
    generated tokens, unrelated to the prompt), on two taps. Returns the rows each request produced."""
    produced: dict[str, int] = {}
    keys = list(prompts)
    with tracediff.record(store, **limits) as rec:
        for start in range(0, len(keys), 4):  # four requests at a time
            running = keys[start:start + 4]
            sampler = rec.request_sampler()
            for key in running:
                sampler.prompt(key, prompts[key])
                n = len(prompts[key])
                labels = {"seq": np.array([key] * n, dtype=object), "position": np.arange(n),
                          "token_id": np.array(prompts[key]), "phase": "prefill"}
                rec.capture("aux_hidden", torch.randn(n, WIDTH), labels=labels)
                rec.capture("fc_in", torch.randn(n, WIDTH), labels=labels)
                produced[key] = n
            for step in range(3):
                seq = np.array(running, dtype=object)
                # every running request is registered: decided without reading the batch's token ids
                # (capture then waits for no device copy of them)
                assert sampler.decides(seq) and not sampler.decides(np.array([*running, "unregistered"], dtype=object))
                labels = {"seq": seq, "position": np.array([len(prompts[k]) + step for k in running]),
                          "token_id": np.array([5000 + step] * len(running)), "phase": "decode"}
                rec.capture("aux_hidden", torch.randn(len(running), WIDTH), labels=labels)
                rec.capture("fc_in", torch.randn(len(running), WIDTH), labels=labels)
                for key in running:
                    produced[key] += 1
            sampler.forget([])  # the requests ended
            assert len(sampler) == 0
    return produced


def _requests_in(store) -> dict[str, dict[str, int]]:
    """Per tap: request -> rows stored."""
    out = {}
    with TraceStore(store) as st:
        for tap, (stream,) in st.streams.items():
            seq = stream.labels(("seq",))["seq"]
            names = stream.seq_names
            keys, counts = np.unique(seq, return_counts=True)
            out[tap] = {names[int(k)]: int(c) for k, c in zip(keys, counts, strict=True)}
    return out


def test_the_same_whole_requests_are_recorded_in_two_recordings_and_sampled_says_which(tmp_path) -> None:
    prompts = _prompts()
    chosen = {k for k, ids in prompts.items() if tracediff.sampled(ids, RATE)}
    assert 0 < len(chosen) < len(prompts)
    seen = []
    for name in ("a.zarr", "b.zarr"):
        produced = _serve(tmp_path / name, prompts, sample_requests=RATE)
        stored = _requests_in(tmp_path / name)
        for tap in ("aux_hidden", "fc_in"):
            # exactly the chosen requests, each with every row it produced (prefill and decode)
            assert stored[tap] == {k: produced[k] for k in chosen}
        seen.append(set(stored["fc_in"]))
        with TraceStore(tmp_path / name) as st:
            stream = st.streams["fc_in"][0]
            left_out = sum(produced[k] for k in prompts if k not in chosen)
            assert stream.commit["skipped_rows"] == left_out and stream.commit["dropped_rows"] == 0
            assert stream.attrs["limits"]["sample_requests"] == RATE
            assert "sha256" in stream.attrs["limits"]["sample_rule"]
    assert seen[0] == seen[1] == chosen


def test_max_requests_keeps_the_first_requests_whole(tmp_path) -> None:
    prompts = _prompts(8)
    produced = _serve(tmp_path / "cap.zarr", prompts, max_requests=3)
    stored = _requests_in(tmp_path / "cap.zarr")
    # The first three requests, with their decode rows recorded after the fourth had started.
    assert stored["fc_in"] == {k: produced[k] for k in list(prompts)[:3]}


def test_a_trainer_sample_is_chosen_by_its_own_known_token_ids(tmp_path) -> None:
    """No prompt registered (a trainer): a sample's rows are decided by the token ids its rows carry
    (>= 0, in row order; a trainer's first row has none), batch by batch."""
    rng = np.random.default_rng(3)
    samples = [rng.integers(0, 1000, size=6).tolist() for _ in range(12)]
    store = tmp_path / "train.zarr"
    with tracediff.record(store, sample_requests=RATE) as rec:
        for step in range(0, 12, 3):  # three samples a batch, seq = the sample's index in the batch
            batch = samples[step:step + 3]
            token = np.concatenate([[-1, *s[:-1]] for s in batch])  # token_id = x_p, unknown at p = 0
            labels = {"seq": np.repeat(np.arange(3), 6), "position": np.tile(np.arange(6), 3), "token_id": token,
                      "step": step}
            rec.capture("fc_in", torch.randn(18, WIDTH), labels=labels)
    with TraceStore(store) as st:
        got = st.streams["fc_in"][0].labels(("token_id", "position"))
    kept = [got["token_id"][i + 1:i + 6].tolist() for i in np.flatnonzero(got["position"] == 0)]
    assert kept == [s[:-1] for s in samples if tracediff.sampled(s[:-1], RATE)]


def test_record_refuses_a_rate_outside_0_1_before_running_anything(tmp_path) -> None:
    import subprocess
    import sys

    from conftest import cli_env

    out = subprocess.run([sys.executable, "-m", "tracediff", "record", "--tap", "Linear:input", "--sample-requests",
                          "1.5", "-o", tmp_path / "x.zarr", "--", sys.executable, "-c", "pass"], capture_output=True,
                         text=True, env=cli_env(), timeout=60)
    assert out.returncode == 2 and "--sample-requests" in out.stderr and "0 < rate <= 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.zarr").exists()
