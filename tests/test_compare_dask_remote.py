"""compare --dask of stores in an S3 bucket: the workers read the bucket themselves.

Real parts only: moto's S3 server on 127.0.0.1 (tests/object_store.py), the shipped samples pushed
to it with ``tracediff push``'s own code, and ``tracediff compare --dask local:2`` run as a real
program whose LocalCluster workers are separate processes. The endpoint is given only by
``--storage-option``, not by the environment, so the workers can find the bucket only if the
command's storage options travel with their tasks.
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

from object_store import ObjectStore, object_store  # noqa: E402

from tracediff.store.push import push_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "samples"

__all__ = ["object_store"]  # the fixture, used by name


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
