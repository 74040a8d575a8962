"""An S3-compatible object store for the remote-store tests, on 127.0.0.1 only: moto's server mode
(the one zarr's own tests use), a TCP proxy in front of it that drops connections on purpose, and
the children that record into a bucket.

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
