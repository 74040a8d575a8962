"""An S3-compatible object store for the remote-store tests, on 127.0.0.1 only: moto's server mode
(the one zarr's own tests use), a TCP proxy in front of it that drops connections on purpose, a
relay in front of it that goes away (or stops answering) and comes back on the same port, and the
children that record into a bucket.

The server runs in a thread of the test process and is stopped by the fixture that started it;
the proxy's threads are the test's own. Credentials are moto's dummies, set in this process's
environment (subprocesses inherit them); no real AWS config file is read.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class ObjectStore:
    """A running moto server: its endpoint, and a fresh bucket per call of :meth:`bucket`."""

    endpoint: str
    _fs: object = field(default=None, repr=False)

    @property
    def fs(self):
        import s3fs  # noqa: PLC0415

        if self._fs is None:
            self._fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, use_listings_cache=False, skip_instance_cache=True)
        return self._fs

    def bucket(self) -> str:
        name = f"td-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)
        return name


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """moto's S3 server on a free port of 127.0.0.1, found by s3fs through ``AWS_ENDPOINT_URL``
    (botocore's standard variable), as a user's endpoint would be."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    home = tmp_path_factory.mktemp("aws")
    env = {
        **ENV,
        "AWS_CONFIG_FILE": str(home / "config"),  # absent: nothing from the machine's own ~/.aws
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
    }
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield ObjectStore(endpoint=env["AWS_ENDPOINT_URL"])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` that drops connections: the first
    ``faults`` connections are reset (RST, no FIN) after a random number of response bytes, mid
    response; the connections after them pass through. ``faults=None``: every connection is reset
    as soon as its request arrives; ``hang=True``: every request is read and never answered (an
    endpoint that times out)."""

    def __init__(self, upstream: str, faults: int | None, seed: int = 0, *, hang: bool = False) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.faults = faults
        self.hang = hang
        self.cuts = 0
        self._held: list[socket.socket] = []
        self._rng = random.Random(seed)
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._server.close()
        for sock in self._held:
            self._reset(sock)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            index = next(self._count)
            if self.hang:
                self._held.append(client)  # read by nobody, answered never
                continue
            with self._lock:
                if self.faults is None:
                    budget: int | None = 0
                elif index < self.faults:
                    budget = self._rng.randint(20, 600)
                else:
                    budget = None
            threading.Thread(target=self._relay, args=(client, budget), daemon=True).start()

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        """Abort the connection: RST (linger 0). SHUT_RD first wakes the thread blocked reading it,
        without which the kernel keeps the socket open until that read ends."""
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        sock.close()

    def _relay(self, client: socket.socket, budget: int | None) -> None:
        if budget == 0:
            with contextlib.suppress(OSError):
                client.recv(65536)
            with self._lock:
                self.cuts += 1
            self._reset(client)
            return
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            self._reset(client)
            return
        done = threading.Event()

        def up() -> None:
            try:
                while data := client.recv(65536):
                    upstream.sendall(data)
            except OSError:
                pass
            done.set()

        threading.Thread(target=up, daemon=True).start()
        sent = 0
        try:
            while data := upstream.recv(65536):
                if budget is not None and sent + len(data) >= budget:
                    client.sendall(data[: max(budget - sent, 1)])
                    with self._lock:
                        self.cuts += 1
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        self._reset(client)
        self._reset(upstream)
        done.wait(timeout=5)


class Endpoint:
    """The object store's endpoint as a TCP relay on 127.0.0.1 in front of ``upstream`` (the moto
    server) that can go away and come back on the same port: :meth:`go_away` closes the listening
    socket (new connections are refused, as by a server that stopped) and resets every open one
    (pooled keep-alive connections die too); :meth:`come_back` listens on the port again. The
    buckets live on behind it, as on a real service whose front end restarts. :meth:`go_silent`:
    the endpoint hangs instead."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.silent = False
        self.come_back()
        self.url = f"http://127.0.0.1:{self.port}"

    def come_back(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the same port again
        listener.settimeout(0.1)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def go_away(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            held, self._open = self._open, set()
        if listener is not None:
            listener.close()
            assert self._thread is not None
            self._thread.join(timeout=5)
        for sock in held:
            FaultProxy._reset(sock)

    def go_silent(self) -> None:
        """The endpoint stops answering (a hung front end, a black-holed route): open connections
        are reset, new ones are accepted and never answered."""
        self.silent = True
        with self._lock:
            held, self._open = self._open, set()
        for sock in held:
            FaultProxy._reset(sock)

    def close(self) -> None:
        self.go_away()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            with self._lock:
                if self._listener is not listener:
                    return
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if self.silent:
                with self._lock:
                    self._open.add(client)  # read by nobody, answered never
                continue
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                FaultProxy._reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # went away meanwhile
                    FaultProxy._reset(client)
                    FaultProxy._reset(upstream)
                    return
                self._open |= {client, upstream}
            ends: list[int] = []
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, ends), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        """Relay one direction; its end is passed on as an end (FIN: a response sent before the server
        closed arrives whole), a failure as a reset; the second direction to finish closes both."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            FaultProxy._reset(src)
            FaultProxy._reset(dst)
        with self._lock:
            ends.append(1)
            last = len(ends) == 2  # the other direction is done too
            if last:
                self._open -= {src, dst}
        if last:
            src.close()
            dst.close()


# ------------------------------------------------------------------------- recording children
KILL_WIDTH = 64


def record_to_url_until_killed(url: str, log: str, sizes: list[int]) -> None:
    """Record batch i (every value i + 1) into the store at ``url`` through a real forward hook; log
    i once the recorder says it is committed (flush returns after the commit record's PUT)."""
    import torch  # noqa: PLC0415

    import tracediff  # noqa: PLC0415

    layer = torch.nn.Linear(KILL_WIDTH, 2)
    rec = tracediff.record(url, role="killed", chunk_rows=16, on_full="block")
    rec.tap(layer, "fc_in")
    with open(log, "a") as out:
        for i, n in enumerate(sizes):
            rec.labels(seq=i, position=np.arange(n), step=i)
            layer(torch.full((n, KILL_WIDTH), float(i + 1)))
            if not rec.flush(timeout=60) or rec.error:
                raise RuntimeError(f"batch {i} was not committed: {rec.error}")
            out.write(f"{i}\n")
            out.flush()
    time.sleep(600)  # the parent kills this process


NODE_SCRIPT = """
import os
import sys
import time

import numpy as np
import torch

import tracediff


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(24, 8)

    def forward(self, x):
        return self.fc(x)


node, nodes = int(sys.argv[1]), int(sys.argv[2])
head = Head()
# A barrier of files: every node's first batch (its writer group, the tap group) at the same moment.
open(f"ready{node}", "w").close()
deadline = time.monotonic() + 120
while not all(os.path.exists(f"ready{n}") for n in range(nodes)) and time.monotonic() < deadline:
    time.sleep(0.005)
fed = []
for step in range(3):
    x = torch.randn(5 + step, 24, generator=torch.Generator().manual_seed(100 * node + step))
    tracediff.labels(seq=10 * node + step, position=np.arange(x.shape[0]), step=step)
    head(x)
    fed.append(x.numpy())
np.save(f"node{node}.npy", np.concatenate(fed))
"""


ENDING_WIDTH = 32


def ending_batch_rows(i: int) -> int:
    """Rows of batch ``i`` of :data:`ENDING_SCRIPT` (3..7: batches straddle the 16-row chunks)."""
    return 3 + i % 5


ENDING_SCRIPT = """
import os
import sys
import time

import numpy as np
import torch

import tracediff
from tracediff.record.recorder import active_recorder


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(x)


# pace: seconds between batches; commit: 1 = wait until each batch is committed (flush) and log it
# to committed.log; batches: how many to feed at least; then go on until the file "last" exists.
pace, commit, batches = float(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
head = Head()
with open("pid.tmp", "w") as out:
    out.write(str(os.getpid()))
os.replace("pid.tmp", "pid")
fed, committed = open("fed.log", "a"), open("committed.log", "a")
i = 0
while i < batches or not os.path.exists("last"):
    n = 3 + i % 5
    tracediff.labels(seq=i, position=np.arange(n), step=i)
    head(torch.full((n, 32), float(i + 1)))
    fed.write(f"{i}\\n")
    fed.flush()
    if commit:
        rec = active_recorder()
        if rec.flush(timeout=60) and rec.error is None:
            committed.write(f"{i}\\n")
            committed.flush()
    i += 1
    time.sleep(pace)
"""


def record_until_close_times_out(url: str, endpoint: str, folder: str) -> None:
    """Record batch 0 of the ENDING_SCRIPT data through ``endpoint`` and, once it is committed, say
    so (file ``committed``); when the file ``go`` appears (the endpoint has stopped answering), feed
    batches 1..3 and close with a 3 s timeout. What ``on_close`` was given goes to reports.json."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from tracediff.record.recorder import Recorder  # noqa: PLC0415

    reports: list[dict] = []
    layer = torch.nn.Linear(ENDING_WIDTH, 2)
    rec = Recorder(url, storage_options={"endpoint_url": endpoint}, chunk_rows=16,
                   on_close=lambda r: reports.append(r.outcome()))  # fmt: skip
    rec.tap(layer, "fc_in")

    def feed(i: int) -> None:
        n = ending_batch_rows(i)
        rec.labels(seq=i, position=np.arange(n), step=i)
        layer(torch.full((n, ENDING_WIDTH), float(i + 1)))

    feed(0)
    if not rec.flush(timeout=60) or rec.error:
        raise RuntimeError(f"batch 0 was not committed: {rec.error}")
    Path(folder, "committed").touch()
    deadline = time.monotonic() + 120
    while not Path(folder, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(1, 4):
        feed(i)
    rec.close(timeout=3)
    Path(folder, "reports.json").write_text(json.dumps(reports))
