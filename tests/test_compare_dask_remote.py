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
from typing import Any

import pytest

pytest.importorskip("distributed")
pytest.importorskip("s3fs")

from object_store import ObjectStore, object_store  # noqa: E402

from tracediff.store.push import push_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "samples"

__all__ = ["object_store"]  # the fixture, used by name


def _without_paths(report: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(report))
    for side in ("reference", "candidate"):
        out[side].pop("path")
    return out


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
    assert _without_paths(there) == _without_paths(here)
    assert there["verdict"] == "mismatch" and there["findings"]
