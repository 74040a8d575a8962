"""compare --dask of stores in an S3 bucket: the workers read the bucket themselves.

Real parts only: moto's S3 server on 127.0.0.1 (tests/object_store.py), the shipped samples pushed
to it with ``tracediff push``'s own code, and ``tracediff compare --dask local:2`` run as a real
program whose LocalCluster workers are separate processes. The endpoint is given only by
``--storage-option``, not by the environment, so the workers can find the bucket only if the
command's storage options travel with their tasks. A long-lived LocalCluster runs compare after
compare, and what its workers still hold between them is counted in the worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import report_without_paths, skip_unless_installed

skip_unless_installed("distributed", "s3fs")

import cloudpickle  # noqa: E402  (a dependency of distributed)
from object_store import ObjectStore, object_store  # noqa: E402

from tracediff.compare import CompareOptions, compare_stores  # noqa: E402
from tracediff.compare.stream.cluster import DaskRunner  # noqa: E402
from tracediff.store.push import push_store  # noqa: E402
from tracediff.testing.stores import write_small_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "samples"

__all__ = ["object_store"]  # the fixture, used by name

# _held_by_worker travels to the workers by value (they cannot import this test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _compare(env: dict[str, str], out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracediff", "compare", *args, "--json", str(out), "-q"],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_compare_dask_of_bucket_stores_gives_the_report_of_the_local_folders(object_store: ObjectStore, tmp_path: Path):
    bucket = object_store.bucket()
    urls = {}
    for name in ("train", "server_broken"):
        urls[name] = f"s3://{bucket}/{name}.zarr"
        push_store(SAMPLES / f"{name}.zarr", urls[name])
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env["PYTHONPATH"] = str(REPO)
    local = _compare(env, tmp_path / "local.json", str(SAMPLES / "train.zarr"), str(SAMPLES / "server_broken.zarr"))
    remote = _compare(env, tmp_path / "dask.json", urls["train"], urls["server_broken"], "--dask", "local:2",
                      "--storage-option", f"endpoint_url={object_store.endpoint}")
    assert local.returncode == 1, local.stderr
    assert remote.returncode == 1, remote.stderr
    assert "Traceback" not in remote.stderr
    there = json.loads((tmp_path / "dask.json").read_text())
    here = json.loads((tmp_path / "local.json").read_text())
    assert there["candidate"]["path"] == urls["server_broken"]
    assert report_without_paths(there) == report_without_paths(here)
    assert there["verdict"] == "mismatch" and there["findings"]


def test_a_url_glob_names_every_node_store_in_the_bucket(object_store: ObjectStore, tmp_path: Path):
    """One store per node, pushed to one bucket: a quoted URL glob is the whole trace, as the local
    glob of the same stores is; a glob matching nothing is one line naming it."""
    from conftest import invoke_tracediff  # noqa: PLC0415
    from store_parts import split_store  # noqa: PLC0415

    bucket = object_store.bucket()
    parts = split_store(SAMPLES / "server_broken.zarr", [tmp_path / f"server-node{i}.zarr" for i in range(3)])
    for part in parts:
        push_store(part, f"s3://{bucket}/{part.name}")
    push_store(SAMPLES / "train.zarr", f"s3://{bucket}/train.zarr")
    local = invoke_tracediff("compare", SAMPLES / "train.zarr", tmp_path / "server-node*.zarr",
                             "--json", tmp_path / "local.json", "-q")
    remote = invoke_tracediff("compare", f"s3://{bucket}/train.zarr", f"s3://{bucket}/server-node*.zarr",
                              "--json", tmp_path / "remote.json", "-q")
    assert local.returncode == remote.returncode == 1, remote.stderr
    there = json.loads((tmp_path / "remote.json").read_text())
    here = json.loads((tmp_path / "local.json").read_text())
    assert there["candidate"]["meta"]["stores"] == [f"s3://{bucket}/server-node{i}.zarr" for i in range(3)]
    assert there["verdict"] == here["verdict"] == "mismatch"
    assert [f["kind"] for f in there["findings"]] == [f["kind"] for f in here["findings"]]
    assert [(m["candidate"], m["reference"], m["rows"]) for m in there["metrics"]] == \
        [(m["candidate"], m["reference"], m["rows"]) for m in here["metrics"]]
    none = invoke_tracediff("compare", f"s3://{bucket}/train.zarr", f"s3://{bucket}/nothing-*.zarr")
    assert none.returncode == 2
    lines = none.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing-*.zarr" in lines[0] and "no store matches" in lines[0], none.stderr


def _held_by_worker() -> dict[str, int]:
    """Run in a worker process between compares: what it holds of the compares it ran, counted
    without a garbage collection (one would hide what only the collector would free)."""
    import gc  # noqa: PLC0415

    import s3fs  # noqa: PLC0415

    from tracediff.compare.rows.gather import ChunkReader  # noqa: PLC0415
    from tracediff.store import TraceStream  # noqa: PLC0415

    live = gc.get_objects()
    return {
        "chunks in caches": sum(len(o.cache) for o in live if isinstance(o, ChunkReader)),
        "chunks read ahead": sum(len(o.__dict__.get("_ahead_state", (None, ()))[1])
                                 for o in live if isinstance(o, TraceStream)),
        "s3 filesystems": sum(isinstance(o, s3fs.S3FileSystem) for o in live),
    }


@pytest.mark.slow
def test_a_worker_keeps_nothing_of_a_finished_compare_of_bucket_stores(object_store: ObjectStore, tmp_path: Path):
    """Four compares on one LocalCluster of two workers reading a bucket: between them, no worker
    holds a chunk of rows (cached or read ahead) of a compare that ended, and none makes a new
    filesystem per compare (on a long-lived cluster, rows kept by finished compares were the worker
    memory that grew from compare to compare: benchmarks/RESULTS.md ## bench_compare_dask_s3)."""
    bucket = object_store.bucket()
    urls = []
    for name in ("train", "server"):
        # 400 rows in uncompressed chunks of 16: a remote read fetches chunks ahead of the one asked for.
        local = write_small_store(tmp_path / f"{name}.zarr", chunk_rows=16, seq_lengths=(50,) * 8)
        urls.append(f"s3://{bucket}/{name}.zarr")
        push_store(local, urls[-1])
    options = {"endpoint_url": object_store.endpoint}
    held = []
    # Tasks of one 64-row block each: the workers share the blocks, each reading some of the chunks.
    with DaskRunner("local:2", storage_options=options, task_bytes=1) as runner:
        for _ in range(4):
            report = compare_stores(*urls, CompareOptions(storage_options=options, runner=runner, block_bytes=1))
            assert report.plan.pairs == 400
            held.append(runner.client.run(_held_by_worker))
    assert len(held[0]) == 2
    for after in held:
        for worker in after.values():
            assert worker["chunks in caches"] == 0, held
            assert worker["chunks read ahead"] == 0, held
            # fsspec's instances for these storage options (a synchronous one for listings and objects,
            # an asynchronous one under zarr), whatever the number of compares run.
            assert worker["s3 filesystems"] <= 2, held
