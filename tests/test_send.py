"""`tracediff send`: replaying a reference trace's token ids to a server's /generate.

The server here is a small stdlib HTTP server on 127.0.0.1 that answers like SGLang's /health,
/model_info and /generate and keeps every request it got; it can refuse, fail or vanish on demand.
No SGLang needed: these run everywhere.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import invoke_tracediff

import tracediff
from tracediff.errors import SendError, UsageError
from tracediff.send import ReplaySequence, SendOptions, send_sequences, sequences_from_trace

SEQS = {"req-a": [5, 6, 7, 8], "req-b": [9, 10, 11], "req-c": [1, 2, 3, 4, 5, 6]}


class FakeServer:
    """What the test controls: the vocabulary, per-request failures, latency; what it saw."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.vocab_size: int | None = 128
        self.fail_first: dict[str, int] = {}  # rid -> number of 503s before success
        self.reject: set[str] = set()  # rids answered with HTTP 400
        self.delay = 0.0
        self.health_503 = 0  # /health answers 503 this many times (a server still starting)
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    with server.lock:
                        starting = server.health_503 > 0
                        server.health_503 -= 1 if starting else 0
                    self._reply(503 if starting else 200, {})
                elif self.path == "/model_info":
                    self._reply(200, {"model_path": "tiny", **({"vocab_size": server.vocab_size}
                                                             if server.vocab_size else {})})
                else:
                    self._reply(404, {"error": "no"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rid = body.get("rid")
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(server.delay)
                    with server.lock:
                        left = server.fail_first.get(rid, 0)
                        if left:
                            server.fail_first[rid] = left - 1
                    if left:
                        self._reply(503, {"error": "busy"})
                        return
                    if rid in server.reject:
                        self._reply(400, {"error": {"message": f"token id out of range in {rid}"}})
                        return
                    with server.lock:
                        server.requests.append(body)
                    self._reply(200, {"output_ids": [0], "meta_info": {"id": rid}})
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.stop()


def write_trace(path: Path, seqs: dict[str, list[int]], *, drop_position: int | None = None) -> Path:
    """A trainer-like trace: one row per position, string sequence keys, token labels."""
    import torch

    with tracediff.record(path, role="trainer") as rec:
        for key, toks in seqs.items():
            positions = [p for p in range(len(toks)) if p != drop_position]
            rec.labels(seq=np.array([key] * len(positions), dtype=object), position=positions,
                       token_id=[toks[p] for p in positions],
                       next_token_id=[toks[p + 1] if p + 1 < len(toks) else -1 for p in positions])
            rec.capture("fc_in", torch.ones(len(positions), 8))
    return path


def dead_url() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ------------------------------------------------------------------------------------------ plan
def test_sequences_are_rebuilt_from_token_labels_with_their_keys(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    got = sequences_from_trace(trace)
    assert [(s.key, s.input_ids) for s in got] == list(SEQS.items())


def test_a_missing_row_is_filled_from_the_previous_rows_next_token(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.zarr", SEQS, drop_position=1)
    assert [s.input_ids for s in sequences_from_trace(trace)] == list(SEQS.values())


def test_a_trace_without_token_labels_is_refused(tmp_path: Path) -> None:
    import torch

    with tracediff.record(tmp_path / "t.zarr") as rec:
        rec.capture("fc_in", torch.ones(3, 8))  # default labels: positions, no tokens
    with pytest.raises(UsageError, match="has no token label"):
        sequences_from_trace(tmp_path / "t.zarr")


# ------------------------------------------------------------------------------------------ send
def test_send_posts_input_ids_with_the_sequence_key_as_rid_greedily(tmp_path: Path, server: FakeServer) -> None:
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, "--url", server.url, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "sent 3 of 3 sequences (13 tokens)" in result.stdout
    by_rid = {r["rid"]: r for r in server.requests}
    assert {rid: r["input_ids"] for rid, r in by_rid.items()} == SEQS
    for r in server.requests:
        assert r["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 1}
        assert "text" not in r  # token ids only: no chat template is rendered again


def test_send_keeps_at_most_concurrency_requests_in_flight(server: FakeServer) -> None:
    server.delay = 0.2  # long enough for requests to overlap even on a busy machine
    seqs = [ReplaySequence(f"s{i}", [1, 2, 3]) for i in range(9)]
    result = send_sequences(seqs, SendOptions(url=server.url, concurrency=3))
    assert result.succeeded == 9 and not result.failures
    assert 1 < server.max_in_flight <= 3


def test_send_retries_a_busy_server(server: FakeServer) -> None:
    server.fail_first = {"s0": 2}
    result = send_sequences([ReplaySequence("s0", [1, 2])], SendOptions(url=server.url, retries=3, backoff=0.01))
    assert result.succeeded == 1 and result.retried == 2


def test_a_server_still_starting_is_waited_for(tmp_path: Path, server: FakeServer) -> None:
    server.health_503 = 2
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, "--url", server.url, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert len(server.requests) == 3


def test_a_refused_request_is_reported_and_the_others_are_sent(tmp_path: Path, server: FakeServer) -> None:
    server.reject = {"req-b"}
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, "--url", server.url, "--no-progress")
    assert result.returncode == 1
    assert "sent 2 of 3 sequences" in result.stdout
    assert "sequence req-b: HTTP 400: token id out of range in req-b" in result.stderr


def test_send_to_an_unreachable_server_is_a_one_line_error(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, "--url", dead_url())
    assert result.returncode == 2
    assert result.stderr.startswith("tracediff: error: cannot reach the server at http://127.0.0.1:")
    assert "connection refused" in result.stderr and result.stderr.strip().count("\n") == 0


def test_a_server_that_goes_away_stops_the_replay_with_a_clear_error(server: FakeServer) -> None:
    seqs = [ReplaySequence(f"s{i}", [1, 2]) for i in range(3)]
    url = server.url
    server.stop()
    with pytest.raises(SendError, match=r"stopped answering \(connection refused\) after 0 of 3 sequences"):
        send_sequences(seqs, SendOptions(url=url, retries=1, backoff=0.01, concurrency=1))


def test_a_trace_of_another_model_is_refused_before_sending(tmp_path: Path, server: FakeServer) -> None:
    server.vocab_size = 8
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, "--url", server.url)
    assert result.returncode == 2
    assert "token id 11 (sequence req-b)" in result.stderr and "vocabulary of 8" in result.stderr
    assert server.requests == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--url", "127.0.0.1:30000"), "give a base URL"),
        (("--url", "http://127.0.0.1:1", "--concurrency", "0"), "--concurrency"),
        (("--url", "http://127.0.0.1:1", "--limit", "0"), "--limit must be positive"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    trace = write_trace(tmp_path / "t.zarr", SEQS)
    result = invoke_tracediff("send", trace, *args)
    assert result.returncode == 2 and message in result.stderr


def test_a_missing_trace_is_a_one_line_error(tmp_path: Path) -> None:
    result = invoke_tracediff("send", tmp_path / "nope.zarr", "--url", "http://127.0.0.1:1")
    assert result.returncode == 2 and "no such trace store" in result.stderr
