"""Trace stores on object storage: every store command on ``s3://`` URLs, recording into a bucket,
``tracediff push``, and what a failing object store does to them.

The object store is moto's S3 server on 127.0.0.1 (tests/object_store.py), reached by s3fs with
the standard ``AWS_*`` environment; faults come from a real TCP proxy that resets connections mid
response. The stores are the shipped samples, pushed, or recorded by real ``tracediff record``
processes; nothing mocks the store.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, cli_env, invoke_tracediff, report_without_paths
from object_store import KILL_WIDTH, NODE_SCRIPT, FaultProxy, ObjectStore, object_store, record_to_url_until_killed
from reliability_children import race_group_creation
from test_send import SEQS, FakeServer, write_trace

from tracediff.errors import CorruptStoreError, UsageError
from tracediff.store import TraceWriter, create_store, open_store
from tracediff.store.location import Location, parse_storage_options
from tracediff.store.push import push_store

__all__ = ["object_store"]  # the fixture, used by name

SAMPLES = REPO / "samples"


def _one_line_error(result: Any, *names: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bucket_samples(object_store: ObjectStore) -> dict[str, str]:
    """The shipped sample stores, pushed to one bucket: name -> URL."""
    bucket = object_store.bucket()
    urls = {}
    for name in ("train", "server_broken", "server_fixed", "bank"):
        urls[name] = f"s3://{bucket}/{name}.zarr"
        push_store(SAMPLES / f"{name}.zarr", urls[name])
    return urls


# ------------------------------------------------------------------------------ reading URLs
def test_a_pushed_store_inspects_like_the_local_one(bucket_samples: dict[str, str]) -> None:
    remote = invoke_tracediff("inspect", "--json", "-", bucket_samples["train"])
    local = invoke_tracediff("inspect", "--json", "-", SAMPLES / "train.zarr")
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr
    there, here = json.loads(remote.stdout), json.loads(local.stdout)
    assert there.pop("path") == bucket_samples["train"]
    here.pop("path")
    assert there == here


@pytest.mark.parametrize("reference_remote", [True, False])
def test_compare_of_urls_gives_the_same_json_report_as_of_local_folders(
    bucket_samples: dict[str, str], tmp_path: Path, reference_remote: bool
) -> None:
    ref = bucket_samples["train"] if reference_remote else SAMPLES / "train.zarr"
    remote = invoke_tracediff("compare", ref, bucket_samples["server_broken"], "--json", tmp_path / "r.json", "-q")
    local = invoke_tracediff(
        "compare", SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr", "--json", tmp_path / "l.json", "-q"
    )
    assert remote.returncode == local.returncode == 1, remote.stderr
    there, here = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("r", "l"))
    assert there["candidate"]["path"] == bucket_samples["server_broken"]
    assert report_without_paths(there) == report_without_paths(here)
    assert there["verdict"] == "mismatch" and there["findings"] and there["metrics"]


def test_identify_against_a_bank_in_the_bucket_names_the_same_layers(
    bucket_samples: dict[str, str], tmp_path: Path
) -> None:
    remote = invoke_tracediff("identify", bucket_samples["server_broken"], "--bank", bucket_samples["bank"],
                              "--json", tmp_path / "r.json")  # fmt: skip
    local = invoke_tracediff("identify", SAMPLES / "server_broken.zarr", "--bank", SAMPLES / "bank.zarr",
                             "--json", tmp_path / "l.json")  # fmt: skip
    assert remote.returncode == local.returncode == 0, remote.stderr
    there, here = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("r", "l"))
    assert [s for s in there["segments"]] == [s for s in here["segments"]]


def test_pack_of_a_bucket_store_is_a_local_zip_that_compares_like_the_folder(
    bucket_samples: dict[str, str], tmp_path: Path
) -> None:
    packed = tmp_path / "train.zarr.zip"
    result = invoke_tracediff("pack", bucket_samples["train"], packed)
    assert result.returncode == 0, result.stderr
    assert (
        invoke_tracediff("compare", packed, SAMPLES / "train.zarr", "--json", tmp_path / "z.json", "-q").returncode == 0
    )
    report = json.loads((tmp_path / "z.json").read_text())
    assert report["verdict"] == "match"


def test_a_store_recorded_to_a_bucket_in_process_replays_its_sequences_with_send(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    url = f"s3://{object_store.bucket()}/t.zarr"
    write_trace(url, SEQS)  # tracediff.record(URL): the in-process recorder writing objects
    server = FakeServer()
    try:
        result = invoke_tracediff("send", url, "--url", server.url, "--no-progress")
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert {r["rid"]: r["input_ids"] for r in server.requests} == SEQS


# ------------------------------------------------------------------------------------- push
def _local_store(tmp_path: Path, rows: list[int], chunk_rows: int = 16) -> Path:
    path = create_store(tmp_path / "local.zarr", role="trainer")
    writer = TraceWriter(path, "fc_in", "rank0", width=12, dtype="float32", chunk_rows=chunk_rows)
    start = 0
    for n in rows:
        values = np.arange(start * 12, (start + n) * 12, dtype=np.float32).reshape(n, 12)
        writer.append(values, {"seq": np.full(n, start), "position": np.arange(n), "token_id": np.arange(n) + 3})
        start += n
    writer.close()
    return path


def _stream_arrays(location: str | Path) -> dict[str, np.ndarray]:
    with open_store(location) as store:
        (stream,) = store.streams["fc_in"]
        return {"values": stream.read(), **stream.labels()}


def test_push_resumes_after_a_crash_skipping_the_objects_already_there(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    local = _local_store(tmp_path, [40, 40, 7])
    url = f"s3://{object_store.bucket()}/pushed.zarr"
    first = push_store(local, url)
    assert first.groups == {"fc_in/rank0": 87} and first.skipped == 0
    # What a push killed after some chunk objects leaves: no commit record, no array metadata,
    # part of the chunks. Readers see the store without the group, never a torn one.
    fs, root = object_store.fs, url.removeprefix("s3://")
    fs.rm(f"{root}/fc_in/rank0/zarr.json")
    for name in ("values", "seq"):
        fs.rm(f"{root}/fc_in/rank0/{name}/zarr.json")
    chunks = sorted(fs.find(f"{root}/fc_in/rank0/values/c"))
    fs.rm(chunks[: len(chunks) // 2])
    with open_store(url) as store:
        assert store.streams["fc_in"] == []
    result = invoke_tracediff("push", local, url)
    assert result.returncode == 0, result.stderr
    kept = re.search(r"(\d+) already there", result.stdout)
    assert kept and int(kept[1]) > 0, result.stdout  # the chunks left by the first push were not sent again
    assert "87 committed rows" in result.stdout
    there, here = _stream_arrays(url), _stream_arrays(local)
    assert there.keys() == here.keys() and all(np.array_equal(there[k], here[k]) for k in here)


def test_push_uploads_committed_rows_only(object_store: ObjectStore, tmp_path: Path) -> None:
    """A local store whose last batch was killed before its commit record (shapes past commit.rows,
    chunks written): the bucket gets the committed rows, with shapes that say so."""
    local = _local_store(tmp_path, [40, 40])
    group = local / "fc_in" / "rank0" / "zarr.json"
    doc = json.loads(group.read_text())
    doc["attributes"]["commit"]["rows"] = 40
    group.write_text(json.dumps(doc))
    url = f"s3://{object_store.bucket()}/committed.zarr"
    push_store(local, url)
    root = url.removeprefix("s3://")
    values_doc = json.loads(object_store.fs.cat_file(f"{root}/fc_in/rank0/values/zarr.json"))
    assert values_doc["shape"] == [40, 12]
    assert len(object_store.fs.find(f"{root}/fc_in/rank0/values/c")) == 3  # rows 0..47: chunks 0, 1, 2
    assert np.array_equal(_stream_arrays(url)["values"], _stream_arrays(local)["values"])


def test_push_prints_a_status_line_with_bytes_objects_and_rate_every_few_seconds_in_a_log(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    """The status line of compare's progress (tracediff/progress.py), in MiB and objects: every
    TRACEDIFF_PROGRESS_SECONDS (5 s by default) while the objects go up, then "done"."""
    local = _local_store(tmp_path, [200] * 4, chunk_rows=4)  # 200 values chunks, 300+ objects
    url = f"s3://{object_store.bucket()}/progress.zarr"
    proc = subprocess.run([sys.executable, "-m", "tracediff", "push", str(local), url], capture_output=True, text=True,
                          env=cli_env(TRACEDIFF_PROGRESS_SECONDS="0.05"), timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("tracediff push: ") for line in lines), proc.stderr
    assert re.fullmatch(r"tracediff push: done in \d+ s", lines[-1])
    status = r"uploading, ([\d.]+) of ([\d.]+) MiB \((\d+)%\), (\d+) of (\d+) objects, ([\d.]+) MiB/s, \d+ s"
    uploading = [m for m in (re.fullmatch(f"tracediff push: {status}", line) for line in lines) if m]
    assert uploading, proc.stderr
    uploaded = re.search(r": (\d+) objects \(([\d.]+) MiB\) uploaded, 0 already there", proc.stdout)
    assert uploaded, proc.stdout
    for m in uploading:  # the totals are what the push uploads; the counts never pass them
        assert int(m.group(5)) == int(uploaded.group(1)) and int(m.group(4)) <= int(m.group(5))
        assert float(m.group(1)) <= float(m.group(2)) and abs(float(m.group(2)) - float(uploaded.group(2))) < 0.1
    assert int(uploading[-1].group(4)) > 0


def test_push_refuses_to_replace_another_store_without_overwrite(object_store: ObjectStore, tmp_path: Path) -> None:
    url = f"s3://{object_store.bucket()}/taken.zarr"
    push_store(SAMPLES / "train.zarr", url)
    _one_line_error(invoke_tracediff("push", SAMPLES / "server_fixed.zarr", url), url, "--overwrite")
    assert invoke_tracediff("push", "--overwrite", SAMPLES / "server_fixed.zarr", url).returncode == 0
    with open_store(url) as store:
        assert store.source["role"] == "server"


# ---------------------------------------------------------------------- recording to a bucket
RACE_PROCESSES = 6
RACE_ROUNDS = 5


@pytest.mark.slow
def test_processes_that_create_their_groups_at_the_same_moment_all_get_one(object_store: ObjectStore) -> None:
    """Six processes released by one barrier join a store at a URL and create their writer groups
    in its one tap, five rounds (a fresh store each): the root and the tap group are created by
    whichever comes first, and finding them made (or being made) by another is no error."""
    bucket = object_store.bucket()
    outcomes = race_group_creation(f"s3://{bucket}", RACE_PROCESSES, RACE_ROUNDS)
    assert [o for o in outcomes if o[3] is not None] == []
    for r in range(RACE_ROUNDS):
        with open_store(f"s3://{bucket}/r{r}.zarr") as store:
            streams = store.streams["fc_in"]
            assert sorted(s.writer for s in streams) == [f"p{p}" for p in range(RACE_PROCESSES)]
            assert all(s.rows == 5 and s.commit["status"] == "closed" for s in streams)


NODES = 6


@pytest.mark.slow
def test_several_record_processes_writing_to_one_bucket_make_one_store(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    """A multi-node recording: each node runs `tracediff record --append -o s3://...`, its first
    batch released by a barrier with the other nodes'; the store holds every node's writer group,
    each bit for bit what that node fed its layer. (Issue #24: a node that found the tap group
    being created by another lost all its rows and still exited 0.)"""
    (tmp_path / "node.py").write_text(NODE_SCRIPT)
    url = f"s3://{object_store.bucket()}/server.zarr"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tracediff",
                "record",
                "--append",
                "--tap",
                "Head.fc:input",
                "--role",
                "server",
                "-o",
                url,
                "--",
                sys.executable,
                "node.py",
                str(node),
                str(NODES),
            ],
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in range(NODES)
    ]
    outcomes = [proc.communicate(timeout=300) for proc in nodes]
    for proc, (_out, err) in zip(nodes, outcomes, strict=True):
        assert proc.returncode == 0 and "tracediff: error" not in err and "warning" not in err, err
    with open_store(url) as store:
        streams = store.streams["fc_in"]
        assert len(streams) == NODES
        # Which group came out short, and what its node logged (the recorder logs, the host goes on).
        logs = "\n".join(err[-2000:] for _out, err in outcomes)
        assert all(s.rows > 0 for s in streams), ([(s.writer, s.rows, s.commit) for s in streams], logs)
        for stream in streams:
            node = int(stream.label("seq")[0]) // 10
            assert np.array_equal(stream.read(), np.load(tmp_path / f"node{node}.npy"))
            assert stream.commit["status"] == "closed"


@pytest.mark.slow
def test_a_writer_killed_mid_upload_leaves_every_committed_batch_readable(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    url = f"s3://{object_store.bucket()}/killed.zarr"
    log = tmp_path / "committed.log"
    sizes = np.random.default_rng(3).integers(1, 40, size=400).tolist()
    child = multiprocessing.get_context("spawn").Process(target=record_to_url_until_killed, args=(url, str(log), sizes))
    child.start()
    try:
        deadline = time.monotonic() + 120
        while (len(log.read_text().split()) if log.exists() else 0) < 6:
            assert child.is_alive() and time.monotonic() < deadline, "the child never committed 6 batches"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)  # while it uploads the batches after the logged ones
    finally:
        child.join(timeout=30)
    logged = len(log.read_text().split())
    with open_store(url) as store:  # the strict reader: nothing torn, no chunk missing
        (stream,) = store.streams["fc_in"]
        batches = stream.commit["batches"]
        assert batches >= logged
        assert stream.rows == sum(sizes[:batches])
        seq, values = stream.label("seq"), stream.read_float32()
    assert values.shape == (stream.rows, KILL_WIDTH)
    assert np.array_equal(seq, np.repeat(np.arange(batches), sizes[:batches]))
    assert np.array_equal(values, np.repeat(seq[:, None] + 1.0, KILL_WIDTH, axis=1))


# --------------------------------------------------------------------------- faults and errors
# Slow: retries through dropped connections wait out their backoff (~10 s on two cores).
@pytest.mark.slow
def test_connections_dropped_mid_response_are_retried_into_the_same_report(
    bucket_samples: dict[str, str], tmp_path: Path, object_store: ObjectStore
) -> None:
    direct = invoke_tracediff("compare", bucket_samples["train"], bucket_samples["server_broken"],
                              "--json", tmp_path / "d.json", "-q")  # fmt: skip
    with FaultProxy(object_store.endpoint, faults=6, seed=5) as proxy:
        flaky = invoke_tracediff("compare", bucket_samples["train"], bucket_samples["server_broken"],
                                 "--storage-option", f"endpoint_url={proxy.endpoint}",
                                 "--json", tmp_path / "f.json", "-q")  # fmt: skip
        assert proxy.cuts > 0, "the proxy dropped no connection: the test tested nothing"
    assert direct.returncode == 1, direct.stderr
    # Six dropped connections are fewer than one request's retries (s3fs's 5 times botocore's): the
    # report must come through, the same as the direct one. An error here means a request was not retried.
    assert flaky.returncode == 1, flaky.stderr
    assert json.loads((tmp_path / "f.json").read_text()) == json.loads((tmp_path / "d.json").read_text())


def test_an_endpoint_that_drops_every_connection_is_a_one_line_error(
    bucket_samples: dict[str, str], object_store: ObjectStore
) -> None:
    with FaultProxy(object_store.endpoint, faults=None) as proxy:
        result = invoke_tracediff("inspect", bucket_samples["train"], "--storage-option", f"endpoint_url={proxy.endpoint}",
                                  "--storage-option", "config_kwargs.retries.max_attempts=1", "--storage-option", "retries=2",
                                  "--storage-option", "key=testing",
                                  "--storage-option", "secret=SUPERSECRET-NEVER-PRINTED")  # fmt: skip
    line = _one_line_error(result, bucket_samples["train"] + "/zarr.json", "endpoint")
    assert "SUPERSECRET" not in line


@pytest.mark.slow
def test_an_endpoint_that_never_answers_times_out_into_a_one_line_error(
    bucket_samples: dict[str, str], object_store: ObjectStore
) -> None:
    with FaultProxy(object_store.endpoint, faults=0, hang=True) as proxy:
        result = invoke_tracediff("inspect", bucket_samples["train"], "--storage-option", f"endpoint_url={proxy.endpoint}",
                                  "--storage-option", "config_kwargs.read_timeout=0.5", "--storage-option", "retries=1",
                                  "--storage-option", "config_kwargs.retries.max_attempts=1")  # fmt: skip
    _one_line_error(result, bucket_samples["train"] + "/zarr.json", "Timeout", "read_timeout")


def test_a_partial_set_of_credentials_is_a_one_line_error_saying_what_to_check(bucket_samples: dict[str, str]) -> None:
    result = invoke_tracediff("inspect", bucket_samples["train"], "--storage-option", "secret=only-half")
    line = _one_line_error(result, bucket_samples["train"], "credentials")
    assert "only-half" not in line


def test_a_refused_connection_is_a_one_line_error_naming_the_url(bucket_samples: dict[str, str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = invoke_tracediff("compare", bucket_samples["train"], bucket_samples["server_fixed"],
                              "--storage-option", f"endpoint_url={dead}",
                              "--storage-option", "config_kwargs.retries.max_attempts=1", "--storage-option", "retries=2")  # fmt: skip
    _one_line_error(result, bucket_samples["train"], "EndpointConnectionError")


def test_missing_buckets_stores_and_objects_are_one_line_errors_naming_the_url(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    _one_line_error(invoke_tracediff("inspect", "s3://no-such-bucket-td/x.zarr"), "s3://no-such-bucket-td/x.zarr",
                    "bucket does not exist")  # fmt: skip
    bucket = object_store.bucket()
    _one_line_error(invoke_tracediff("inspect", f"s3://{bucket}/nothing.zarr"), f"s3://{bucket}/nothing.zarr",
                    "no such trace store")  # fmt: skip
    _one_line_error(invoke_tracediff("push", SAMPLES / "train.zarr", "s3://no-such-bucket-td/x.zarr"),
                    "s3://no-such-bucket-td/x.zarr")  # fmt: skip
    url = f"s3://{bucket}/holed.zarr"
    push_store(SAMPLES / "train.zarr", url)
    object_store.fs.rm(f"{bucket}/holed.zarr/fc_in/rank0/values/c/0/0")
    _one_line_error(invoke_tracediff("inspect", url), f"{url}/fc_in/rank0/values/c")


@pytest.mark.parametrize("damage", ["pickle_codec", "oversized_metadata", "short_chunk"])
def test_a_hostile_remote_store_is_refused_like_a_local_one(object_store: ObjectStore, damage: str) -> None:
    bucket = object_store.bucket()
    url = f"s3://{bucket}/hostile.zarr"
    push_store(SAMPLES / "train.zarr", url)
    fs, group = object_store.fs, f"{bucket}/hostile.zarr/fc_in/rank0"
    if damage == "pickle_codec":
        doc = json.loads(fs.cat_file(f"{group}/seq/zarr.json"))
        doc["codecs"].append({"name": "numcodecs.pickle", "configuration": {}})
        fs.pipe(f"{group}/seq/zarr.json", json.dumps(doc).encode())
        expect = f"{url}/fc_in/rank0/seq/zarr.json"
    elif damage == "oversized_metadata":
        fs.pipe(f"{group}/zarr.json", b"{" + b" " * (65 << 20) + b"}")
        expect = f"{url}/fc_in/rank0/zarr.json"
    else:  # a label chunk cut short (what a dropped upload of a foreign tool could leave)
        chunk = f"{group}/seq/c/0"
        fs.pipe(chunk, fs.cat_file(chunk)[:-10])
        expect = f"{url}/fc_in/rank0/seq/c/0"
    line = _one_line_error(invoke_tracediff("inspect", url), expect)
    assert damage != "oversized_metadata" or "metadata" in line


# ---------------------------------------------------------------------------- the location
def test_storage_options_parse_as_json_when_they_can_and_nest_on_dots() -> None:
    assert parse_storage_options(
        [
            "anon=true",
            "endpoint_url=http://127.0.0.1:9000",
            "config_kwargs.read_timeout=5",
            "config_kwargs.retries.max_attempts=2",
            "profile=dev",
        ]
    ) == {  # fmt: skip
        "anon": True,
        "endpoint_url": "http://127.0.0.1:9000",
        "config_kwargs": {"read_timeout": 5, "retries": {"max_attempts": 2}},
        "profile": "dev",
    }
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_storage_options(["endpoint_url"])
    _one_line_error(invoke_tracediff("inspect", "s3://b/x", "--storage-option", "=3"), "KEY=VALUE")


def test_a_location_prints_without_credentials_and_keeps_local_paths_local(tmp_path: Path) -> None:
    loc = Location.of("s3://AKIA:secret@bucket/train.zarr?X-Amz-Signature=abc", {"secret": "s3cr3t"})
    assert loc.display == "s3://bucket/train.zarr" and str(loc) == loc.display and "s3cr3t" not in repr(loc)
    assert loc.remote and loc.name == "train.zarr"
    assert Location.of(f"file://{tmp_path}/a.zarr").local == tmp_path / "a.zarr"
    assert Location.of(tmp_path / "a.zarr").local == tmp_path / "a.zarr"


def test_a_location_pickles_with_its_options_for_worker_processes(bucket_samples: dict[str, str]) -> None:
    import pickle

    loc = Location.of(bucket_samples["train"], {"use_ssl": False})
    with open_store(loc) as store:
        rows = store.rows("fc_in")
    again = pickle.loads(pickle.dumps(loc))
    assert again == loc and again.storage_options == {"use_ssl": False}
    with open_store(again) as store:
        assert store.rows("fc_in") == rows


def test_open_values_of_a_url_is_the_same_dask_array_as_of_the_folder(bucket_samples: dict[str, str]) -> None:
    import pickle

    import tracediff

    remote = tracediff.open_values(bucket_samples["train"])
    local = tracediff.open_values(SAMPLES / "train.zarr")
    assert np.array_equal(remote.compute(), local.compute())
    assert np.array_equal(pickle.loads(pickle.dumps(remote)).compute(), local.compute())  # what a worker gets


def test_record_to_a_url_refuses_an_existing_store_and_leaves_no_empty_one(
    bucket_samples: dict[str, str], object_store: ObjectStore
) -> None:
    taken = bucket_samples["train"]
    _one_line_error(invoke_tracediff("record", "--tap", "NoSuchClass.fc", "-o", taken, "--", sys.executable, "-c", "pass"),
                    taken, "--overwrite")  # fmt: skip
    _one_line_error(invoke_tracediff("record", "--append", "--overwrite", "--tap", "X.fc", "-o", taken, "--", "true"),
                    "--append")  # fmt: skip
    url = f"s3://{object_store.bucket()}/empty.zarr"
    result = invoke_tracediff("record", "--tap", "NoSuchClass.fc", "-o", url, "--", sys.executable, "-c", "pass")
    assert result.returncode == 2 and f"tracediff: removed {url}: it held no rows" in result.stderr, result.stderr
    assert object_store.fs.find(url.removeprefix("s3://")) == []


def test_rows_of_a_remote_store_read_as_from_the_folder_whatever_the_access(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    """Whole chunks, chunks read ahead, scattered rows by ranged GETs: the same bits as locally."""
    local = _local_store(tmp_path, [40, 40, 7, 33])
    url = f"s3://{object_store.bucket()}/rows.zarr"
    push_store(local, url)
    rows = np.array([119, 0, 5, 6, 7, 64, 3, 119, 100, 101, 102, 103, 104, 105, 106, 107, 108, 31])
    with open_store(url) as there, open_store(local) as here:
        (r,), (h,) = there.streams["fc_in"], here.streams["fc_in"]
        assert r.rows == h.rows == 120
        assert np.array_equal(r.take(rows), h.take(rows))
        assert np.array_equal(r.read(13, 77), h.read(13, 77))
        for c in (7, 0, 1, 2, 6):
            assert np.array_equal(r.read_chunk(c), h.read_chunk(c))
        out = np.zeros((4, 12), np.float32)
        assert np.array_equal(
            r.read_rows(np.array([9, 2]), out=out, dest=np.array([3, 0]))[[3, 0]], h.take(np.array([9, 2]))
        )
        chunk = f"{url.removeprefix('s3://')}/fc_in/rank0/values/c/6/0"
        object_store.fs.pipe(chunk, b"\0" * 100)  # cut short after the store was opened
        with pytest.raises(CorruptStoreError, match=r"values/c/6/0: the object is shorter .* \(truncated\?\)"):
            r.take(np.array([100]))
        object_store.fs.pipe(chunk, b"\0" * (16 * 12 * 4 + 96))  # a foreign object, longer
        with pytest.raises(CorruptStoreError, match=r"values/c/6/0: chunk holds more than 768 bytes, expected 768"):
            r.read(96, 100)


# Slow: retries through dropped connections wait out their backoff (~9 s on two cores).
@pytest.mark.slow
def test_a_push_through_dropped_connections_is_complete_or_a_one_line_error(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    local = _local_store(tmp_path, [40, 40, 7, 33])
    url = f"s3://{object_store.bucket()}/flaky.zarr"
    with FaultProxy(object_store.endpoint, faults=6, seed=11) as proxy:
        result = invoke_tracediff("push", local, url, "--storage-option", f"endpoint_url={proxy.endpoint}")
        assert proxy.cuts > 0
    if result.returncode == 2:
        _one_line_error(result, url)
        result = invoke_tracediff("push", local, url)  # and the rerun resumes
    assert result.returncode == 0, result.stderr
    there, here = _stream_arrays(url), _stream_arrays(local)
    assert all(np.array_equal(there[k], here[k]) for k in here)


@pytest.mark.slow
def test_a_push_killed_midway_leaves_a_readable_store_and_the_rerun_completes_it(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    local = _local_store(tmp_path, [200] * 4, chunk_rows=4)  # 200 values chunks, 300+ objects
    url = f"s3://{object_store.bucket()}/killed-push.zarr"
    root = url.removeprefix("s3://")
    proc = subprocess.Popen([sys.executable, "-m", "tracediff", "push", str(local), url], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(object_store.fs.find(f"{root}/fc_in/rank0/values/c")) < 30:
            assert proc.poll() is None and time.monotonic() < deadline, "the push ended before it could be killed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    with open_store(url) as store:  # the strict reader: the group is invisible until its commit record
        assert [s.rows for s in store.streams.get("fc_in", [])] in ([], [800])
        assert store.incomplete is not None
    # What is there is part of a trace: inspect says so, and every command that reads rows refuses
    # it with one line naming the push to rerun (not "0 rows from 0 writers").
    rerun = f"rerun `tracediff push {local} {url}`"
    shown = invoke_tracediff("inspect", url)
    assert shown.returncode == 0, shown.stderr
    status = [line for line in shown.stdout.splitlines() if line.startswith("status  incomplete: a push from ")]
    assert len(status) == 1 and rerun in status[0] and "warning: incomplete: a push" in shown.stdout
    assert rerun in json.loads(invoke_tracediff("inspect", "--json", "-", url).stdout)["incomplete"]
    _one_line_error(invoke_tracediff("compare", local, url), url, "incomplete", rerun)
    _one_line_error(invoke_tracediff("compare", url, local), url, "incomplete", rerun)
    _one_line_error(invoke_tracediff("identify", url, "--bank", SAMPLES / "bank.zarr"), url, rerun)
    result = invoke_tracediff("push", local, url)
    assert result.returncode == 0, result.stderr
    with open_store(url) as store:
        assert store.incomplete is None
        store.require_complete()
    skipped = int(result.stdout.split(" already there")[0].rsplit(" ", 1)[-1])
    assert skipped >= 30
    there, here = _stream_arrays(url), _stream_arrays(local)
    assert all(np.array_equal(there[k], here[k]) for k in here)


def test_an_orphaned_request_task_whose_connection_reset_stays_off_stderr(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's body-writing task of a request whose connection resets ends with the request's own
    error, and no one awaits it: asyncio logged "Task exception was never retrieved" with a
    traceback on the host's stderr (seen in CI while an endpoint was away). On fsspec's and zarr's
    loops, once a URL is opened, such a transport error goes to tracediff's debug log; any other
    orphaned exception still reaches asyncio's handler, and a handler the host set stays in front."""
    import asyncio
    import logging

    import aiohttp
    from fsspec.asyn import get_loop, sync
    from zarr.core.sync import _get_loop

    seen_by_host: list[str] = []
    zarr_loop = _get_loop()
    zarr_loop.set_exception_handler(lambda loop, context: seen_by_host.append(context["message"]))
    Location("s3://bucket/x.zarr").zarr_store(read_only=True)  # what a URL store does first

    async def fail(exc: BaseException) -> None:
        raise exc

    def orphan(loop: asyncio.AbstractEventLoop, exc: BaseException) -> None:
        async def spawn() -> None:
            asyncio.ensure_future(fail(exc))  # dropped unawaited, as aiohttp drops write_bytes
            await asyncio.sleep(0.01)

        sync(loop, spawn)

    reset = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    try:
        with caplog.at_level(logging.DEBUG):
            orphan(get_loop(), reset)
            orphan(get_loop(), ConnectionRefusedError(111, "refused"))
            orphan(get_loop(), aiohttp.ServerDisconnectedError())
            orphan(get_loop(), ValueError("a bug stays loud"))
            orphan(get_loop(), aiohttp.InvalidURL("not a transport error: loud too"))
            orphan(zarr_loop, reset)
            orphan(zarr_loop, KeyError("also loud"))
    finally:
        zarr_loop.set_exception_handler(None)  # the stand-in host handler goes (the next URL opened reinstalls ours)
    loud = [r for r in caplog.records if r.name == "asyncio"]
    assert [str(r.exc_info[1]) for r in loud if r.exc_info] == ["a bug stays loud", "not a transport error: loud too"], caplog.text
    assert len(seen_by_host) == 1 and "never retrieved" in seen_by_host[0]  # the KeyError, via the host's handler
    quiet = [r.getMessage() for r in caplog.records if r.name == "tracediff"]
    assert len(quiet) == 4 and all("helper task ended with" in m for m in quiet), quiet


def test_record_overwrite_to_a_url_says_before_the_command_that_it_deletes_the_old_store(
    object_store: ObjectStore,
) -> None:
    url = f"s3://{object_store.bucket()}/replaced.zarr"
    push_store(SAMPLES / "server_fixed.zarr", url)
    result = invoke_tracediff("record", "--overwrite", "--tap", "NoSuchClass.fc", "-o", url, "--",
                              sys.executable, "-c", "pass")  # fmt: skip
    lines = result.stderr.splitlines()
    said = [k for k, line in enumerate(lines) if line.startswith(f"tracediff: deleting the previous store at {url} "
                                                                 "before the command starts")]
    assert said == [0], result.stderr  # the first thing record says, before it runs the command
