"""Replay a reference trace's token sequences to a running SGLang or vLLM server, so that the
server records exactly the tokens the trainer saw.

Plan, then send: :func:`sequences_from_trace` rebuilds each sequence's token ids from the trace's
labels (``token_id`` at each position, ``next_token_id`` of the position before filling a gap),
without reading any values; :func:`send_sequences` posts them as token ids (no chat template is
rendered again), greedy, one new token by default, a bounded number in flight, with retries:

* SGLang: ``/generate`` with ``input_ids`` and ``rid`` = the sequence key;
* vLLM: ``/v1/completions`` with ``prompt`` = the token ids and ``request_id`` = the sequence key
  (vLLM's engine id becomes ``cmpl-<key>-0-<random>``; its adapter records ``<key>``).

Each response's generated token ids and the engine's own speculative-decoding numbers for that
request (SGLang ``meta_info``, vLLM ``metrics.speculative_decoding`` with
``--per-request-spec-decode-metrics``) are kept in :attr:`SendResult.responses`. A server that
cannot be reached is a :class:`SendError` before anything is sent.

Only the standard library does HTTP here (``urllib`` + a thread pool): the requests are small and
few, and the command must work in the trimmed environments serving boxes have.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracediff.errors import SendError, UsageError
from tracediff.store import TraceStore, open_store

#: HTTP statuses worth retrying: the server is starting, overloaded or restarting.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class ReplaySequence:
    """One sequence to send: its key (the request id the server will record) and its tokens."""

    key: str
    input_ids: list[int]


@dataclass
class SendOptions:
    url: str
    concurrency: int = 4
    max_new_tokens: int = 1
    timeout: float = 300.0
    retries: int = 3
    backoff: float = 0.5
    connect_timeout: float = 5.0
    rid_prefix: str = ""
    extra_body: dict[str, Any] = field(default_factory=dict)
    engine: str = "sglang"  # "sglang" | "vllm"
    model: str | None = None  # vLLM: the served model name (default: the server's first model)


@dataclass
class SendResult:
    """What was sent; ``failures`` maps a sequence key to the error that ended it."""

    url: str
    sequences: int = 0
    tokens: int = 0
    succeeded: int = 0
    retried: int = 0
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)
    engine: str = "sglang"
    #: sequence key -> {"request_id", "output_ids", "finish_reason", "spec_decoding"}: what the engine said
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "url": self.url,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "succeeded": self.succeeded,
            "retried": self.retried,
            "seconds": round(self.seconds, 3),
            "failures": dict(self.failures),
            "responses": {k: dict(v) for k, v in self.responses.items()},
        }


# ------------------------------------------------------------------------------------------ plan
def sequences_from_trace(path: str | Path, tap: str | None = None, limit: int | None = None) -> list[ReplaySequence]:
    """The token sequences of a trace's ``tap`` (default ``fc_in``, else its only tap with token
    labels), one per (writer, sequence), in first-seen order. Reads labels only."""
    store = open_store(path)
    try:
        store.require_complete()  # replaying part of the sequences would look like a full replay
        return _sequences(store, _pick_tap(store, tap), limit)
    finally:
        store.close()


def _pick_tap(store: TraceStore, tap: str | None) -> str:
    if tap is not None:
        store.tap_streams(tap)  # UsageError naming the taps when absent
        return tap
    with_rows = [t for t in store.taps if store.rows(t)]
    if not with_rows:
        raise UsageError(f"{store.path}: the trace has no rows to replay")
    if "fc_in" in with_rows:
        return "fc_in"
    candidates = [t for t in with_rows if not t.startswith("bank")] or with_rows
    return candidates[0]


def _sequences(store: TraceStore, tap: str, limit: int | None) -> list[ReplaySequence]:
    streams = [s for s in store.tap_streams(tap) if s.rows]
    if not streams:
        raise UsageError(f"{store.path}/{tap}: the tap has no rows to replay")
    out: list[ReplaySequence] = []
    used: set[str] = set()
    for stream in streams:
        labels = stream.labels(("seq", "position", "token_id", "next_token_id", "valid"))
        ok = labels["valid"] & (labels["position"] >= 0)
        if not ok.any():
            continue
        names = stream.seq_names
        seq = labels["seq"][ok]
        _, first = np.unique(seq, return_index=True)
        for s in seq[np.sort(first)]:
            rows = ok & (labels["seq"] == s)
            tokens = _tokens_of(labels["position"][rows], labels["token_id"][rows], labels["next_token_id"][rows])
            key = names.get(int(s), str(int(s)))
            if tokens is None:
                raise UsageError(
                    f"{store.path}/{tap}/{stream.writer}: sequence {key} has no token label at some position "
                    f"(token_id -1 and no next_token_id before it); record the trainer with token labels"
                )
            if key in used:  # two writers (processes) used the same key: keep rids unique
                key = f"{stream.writer}/{key}"
            used.add(key)
            out.append(ReplaySequence(key=key, input_ids=tokens))
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise UsageError(f"{store.path}/{tap}: no valid rows with positions to replay")
    return out


def _tokens_of(position: np.ndarray, token_id: np.ndarray, next_token_id: np.ndarray) -> list[int] | None:
    """x_0..x_P from rows (position p, token x_p, next x_{p+1}); None when a token is unknown."""
    length = int(position.max()) + 1
    tokens = np.full(length, -1, dtype=np.int64)
    later = np.full(length, -1, dtype=np.int64)
    # next_token_id of position p-1 is x_p: fills rows the trace lacks (e.g. a trainer labelled at p+1).
    shifted = position + 1
    inside = (shifted < length) & (next_token_id >= 0)
    later[shifted[inside]] = next_token_id[inside]
    known = token_id >= 0
    tokens[position[known]] = token_id[known]
    tokens = np.where(tokens >= 0, tokens, later)
    if (tokens < 0).any():
        return None
    return tokens.tolist()


# ------------------------------------------------------------------------------------------ send
ENGINES = ("sglang", "vllm")


def check_server(url: str, timeout: float = 5.0, retries: int = 3, backoff: float = 0.5,
                 engine: str = "sglang") -> dict[str, Any]:
    """GET ``/health`` (a server still starting answers 503: retried), then what the engine says
    about its model (best effort): SGLang ``/model_info``, vLLM ``/v1/models`` (its ``served_model``
    and ``max_model_len``). SendError when nothing answers."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: one of {', '.join(ENGINES)}")
    base = url.rstrip("/")
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=timeout) as resp:
                resp.read()
            break
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 405):  # an old server without /health still answers
                break
            if exc.code not in RETRY_STATUSES or attempt == retries:
                raise SendError(f"{base}/health answered HTTP {exc.code}: the server is not ready; try again "
                                f"when it is") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise SendError(
                f"cannot reach the server at {base}: {_reason(exc)}; is it running, and is the URL right?"
            ) from exc
        time.sleep(backoff * (2**attempt))
    path = "/model_info" if engine == "sglang" else "/v1/models"
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as resp:
            info = json.loads(resp.read() or b"{}")
    except Exception:  # noqa: BLE001  (optional: only used to check token ids and name the model)
        return {}
    if not isinstance(info, dict):
        return {}
    if engine == "vllm":
        models = [m for m in info.get("data") or [] if isinstance(m, dict)]
        if models:
            info["served_model"] = models[0].get("id")
            if isinstance(models[0].get("max_model_len"), int):
                info["max_model_len"] = models[0]["max_model_len"]
    return info


def _request(engine: str, seq: ReplaySequence, opts: SendOptions) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one greedy request for ``seq`` in ``engine``'s API."""
    rid = f"{opts.rid_prefix}{seq.key}"
    if engine == "vllm":
        body: dict[str, Any] = {"prompt": seq.input_ids, "request_id": rid, "max_tokens": opts.max_new_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": False, "return_token_ids": True}
        if opts.model:
            body["model"] = opts.model
        return "/v1/completions", {**body, **opts.extra_body}
    return "/generate", {
        "input_ids": seq.input_ids,
        "rid": rid,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": opts.max_new_tokens},
        "stream": False,
        **opts.extra_body,
    }


def response_summary(engine: str, rid: str, doc: Any) -> dict[str, Any]:
    """The generated token ids and the engine's own speculative-decoding numbers for one request."""
    out: dict[str, Any] = {"request_id": rid}
    if not isinstance(doc, dict):
        return out
    if engine == "vllm":
        choice = (doc.get("choices") or [{}])[0] if isinstance(doc.get("choices"), list) else {}
        out["output_ids"] = choice.get("token_ids") if isinstance(choice, dict) else None
        out["finish_reason"] = choice.get("finish_reason") if isinstance(choice, dict) else None
        spec = (doc.get("metrics") or {}).get("speculative_decoding") if isinstance(doc.get("metrics"), dict) else None
        out["spec_decoding"] = spec if isinstance(spec, dict) else None
        return out
    meta = doc.get("meta_info") if isinstance(doc.get("meta_info"), dict) else {}
    out["output_ids"] = doc.get("output_ids")
    out["finish_reason"] = (meta.get("finish_reason") or {}).get("type") if isinstance(
        meta.get("finish_reason"), dict) else meta.get("finish_reason")
    spec = {k: v for k, v in meta.items() if k.startswith("spec_") or k in ("completion_tokens", "accept_length")}
    out["spec_decoding"] = spec or None
    return out


def send_sequences(
    sequences: Sequence[ReplaySequence],
    opts: SendOptions,
    *,
    progress: Callable[[int], None] | None = None,
) -> SendResult:
    """POST every sequence to ``opts.url`` (``/generate`` or ``/v1/completions``), at most
    ``opts.concurrency`` at a time.

    A request that fails with a connection error or a retryable status is retried ``opts.retries``
    times with exponential backoff. When the server stops answering altogether, the remaining
    sequences are not sent and :class:`SendError` says how many were. Other failures (HTTP 400 for
    a token id out of range...) are collected in the result.
    """
    if opts.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {opts.concurrency}")
    if opts.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
    if opts.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {opts.retries}")
    base = opts.url.rstrip("/")
    result = SendResult(url=base, sequences=len(sequences), tokens=sum(len(s.input_ids) for s in sequences))
    start = time.monotonic()
    lock = threading.Lock()
    down = threading.Event()

    if opts.engine not in ENGINES:
        raise UsageError(f"--engine {opts.engine!r}: one of {', '.join(ENGINES)}")
    result.engine = opts.engine

    def one(seq: ReplaySequence) -> None:
        path, body = _request(opts.engine, seq, opts)
        data = json.dumps(body).encode()
        attempt = 0
        while True:
            if down.is_set():
                raise _ServerDownError("not sent: the server stopped answering")
            try:
                req = urllib.request.Request(f"{base}{path}", data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=opts.timeout) as resp:
                    raw = resp.read()
                try:
                    doc = json.loads(raw or b"{}")
                except ValueError:
                    doc = None
                summary = response_summary(opts.engine, str(body.get("rid") or body.get("request_id")), doc)
                with lock:
                    result.responses[seq.key] = summary
                return
            except urllib.error.HTTPError as exc:
                detail = _http_detail(exc)
                if exc.code == 404 and attempt == 0:
                    other = "vllm" if opts.engine == "sglang" else "sglang"
                    raise _RequestFailedError(f"HTTP 404 on {path}: is this a {opts.engine} server? (for "
                                              f"{other}, pass --engine {other})") from exc
                if exc.code not in RETRY_STATUSES or attempt >= opts.retries:
                    raise _RequestFailedError(f"HTTP {exc.code}: {detail}") from exc
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                if attempt >= opts.retries:
                    if _is_connection_error(exc):
                        down.set()
                        raise _ServerDownError(_reason(exc)) from exc
                    raise _RequestFailedError(_reason(exc)) from exc
            attempt += 1
            with lock:
                result.retried += 1
            time.sleep(opts.backoff * (2 ** (attempt - 1)))

    pending: dict[Future[None], ReplaySequence] = {}
    queue = list(sequences)
    down_reason = ""
    with ThreadPoolExecutor(max_workers=opts.concurrency, thread_name_prefix="tracediff-send") as pool:
        while queue or pending:
            while queue and len(pending) < opts.concurrency and not down.is_set():
                seq = queue.pop(0)
                pending[pool.submit(one, seq)] = seq
            if not pending:
                break
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in done:
                seq = pending.pop(fut)
                exc = fut.exception()
                if exc is None:
                    result.succeeded += 1
                else:
                    result.failures[seq.key] = str(exc)
                    if isinstance(exc, _ServerDownError) and not down_reason:
                        down_reason = str(exc)
                if progress is not None:
                    progress(1)
            if down.is_set():
                queue.clear()
    result.seconds = time.monotonic() - start
    if down_reason:
        raise SendError(
            f"the server at {base} stopped answering ({down_reason}) after {result.succeeded} of "
            f"{result.sequences} sequences; the store has the rows of those sent, re-send to complete it"
        )
    return result


def check_vocabulary(sequences: Sequence[ReplaySequence], info: dict[str, Any], url: str) -> None:
    """Refuse token ids the served model cannot have (a trace of another model) before sending."""
    vocab = _vocab_size(info)
    if vocab is None:
        return
    worst = max((max(s.input_ids) for s in sequences if s.input_ids), default=-1)
    if worst >= vocab:
        bad = next(s.key for s in sequences if s.input_ids and max(s.input_ids) == worst)
        raise SendError(
            f"the trace has token id {worst} (sequence {bad}) but the model served at {url} has a vocabulary of "
            f"{vocab}: the trace was recorded with another model or tokenizer"
        )


def _vocab_size(info: dict[str, Any]) -> int | None:
    for key in ("vocab_size",):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    for nested in ("hf_config", "model_config", "config"):
        sub = info.get(nested)
        if isinstance(sub, dict) and isinstance(sub.get("vocab_size"), int):
            return int(sub["vocab_size"])
    return None


class _RequestFailedError(Exception):
    pass


class _ServerDownError(Exception):
    pass


def _is_connection_error(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, (ConnectionError, socket.gaierror)) or (
        isinstance(reason, OSError) and not isinstance(reason, (socket.timeout, TimeoutError))
    )


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    text = getattr(reason, "strerror", None) or str(reason)
    return str(text)


def _http_detail(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()[:2000].decode(errors="replace")
    except Exception:  # noqa: BLE001
        return exc.reason or ""
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict):
            err = doc.get("error") or doc.get("message") or doc.get("detail")
            if isinstance(err, dict):
                err = err.get("message") or err
            return str(err or raw).strip()
    except ValueError:
        pass
    return raw.strip() or str(exc.reason or "")


__all__ = [
    "ReplaySequence",
    "SendOptions",
    "SendResult",
    "check_server",
    "check_vocabulary",
    "response_summary",
    "send_sequences",
    "sequences_from_trace",
]
