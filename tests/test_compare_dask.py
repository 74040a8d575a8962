"""compare --dask: the streaming pass as dask.distributed tasks gives the same report as in-process.

Everything is real: a LocalCluster of two worker processes on 127.0.0.1, workers that open the
stores on disk themselves, traces recorded from real tiny models (the shipped samples, and a Llama
pair recorded here with the real recorder), worker processes really killed. Blocks are made small
(64 rows) so that a compare is many tasks whose partial results arrive in any order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("distributed")

import cloudpickle  # noqa: E402
import dask  # noqa: E402
import distributed  # noqa: E402
from store_parts import split_store  # noqa: E402
from wide_traces import write_wide_traces  # noqa: E402

import tracediff  # noqa: E402
from tracediff.compare import CompareOptions, compare_stores  # noqa: E402
from tracediff.compare.align.rowpairs import pair_rows  # noqa: E402
from tracediff.compare.align.sequences import align_sequences  # noqa: E402
from tracediff.compare.rows.index import RowIndex  # noqa: E402
from tracediff.compare.stream.cluster import DaskRunner, parse_dask_target  # noqa: E402
from tracediff.compare.stream.one_pass import stream_metrics  # noqa: E402
from tracediff.errors import CompareError, UsageError  # noqa: E402
from tracediff.store import open_store  # noqa: E402
from tracediff.testing.stores import write_small_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "samples"
SMALL_BLOCKS = 1  # block_bytes: the smallest blocks (64 rows), so a compare is many blocks

# The kill plugin below travels to the workers by value (they cannot import this test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Tests on a cluster are slow: starting worker processes that import torch takes ~10 s here.
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    # One retry of a task whose worker died, then KilledWorker: the kill tests stay short.
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                     dashboard_address=None, silence_logs=50) as lc:
        yield lc


@pytest.fixture
def runner(cluster):
    # Tasks of one block each: partial results come back out of order from two processes.
    with DaskRunner(cluster.scheduler_address, task_bytes=1) as r:
        yield r


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> tuple[Path, Path]:
    """An fp32 trainer and a bf16 engine run of a real tiny Llama whose server reads the
    neighbouring layers (aux ids off by one): ~250 rows, engine order."""
    import torch  # noqa: PLC0415

    from tracediff.testing.models import build_tiny_model, server_model  # noqa: PLC0415
    from tracediff.testing.pipelines import run_engine, run_trainer  # noqa: PLC0415
    from tracediff.testing.tiny_llama import DraftHead, make_sequences  # noqa: PLC0415

    root = tmp_path_factory.mktemp("llama-pair")
    trainer = build_tiny_model("llama", hidden_size=64, num_layers=8)
    seqs = make_sequences(n_seqs=8, min_len=20, max_len=40, seed=3)
    out = []
    for name, runner_fn, model, layers, dtype, kw in (
        ("ref", run_trainer, trainer, ["hs2", "hs4", "hs6"], torch.float32, {}),
        ("cand", run_engine, server_model(trainer, "bf16"), ["hs3", "hs5", "hs7"], torch.bfloat16, {"max_running": 3}),
    ):
        draft = DraftHead(trainer.hidden_size, 3)
        path = root / f"{name}.zarr"
        with tracediff.record(path, role=name, meta={"num_hidden_layers": 8}) as rec:
            rec.tap(draft.fc, "fc_in", segment_size=trainer.hidden_size)
            runner_fn(model, draft, seqs, layers, dtype=dtype, on_batch=lambda lab, rec=rec: rec.labels(**lab), **kw)
        assert rec.error is None
        out.append(path)
    return out[0], out[1]


def _json(report) -> str:
    return json.dumps(report.to_dict(), sort_keys=True, default=str)


def _kinds(report) -> list[tuple[str, str]]:
    return sorted((f.kind, f.severity) for f in report.findings)


@slow
@pytest.mark.parametrize("pair", ["samples_broken", "samples_fixed", "llama_adjacent", "split_over_stores",
                                  "wide_by_parts"])
def test_dask_compare_gives_the_in_process_report(pair, runner, llama_pair, tmp_path, monkeypatch):
    if pair == "split_over_stores":  # workers open every store of each side by its own location
        ref = split_store(SAMPLES / "train.zarr", [tmp_path / f"train-{i}.zarr" for i in range(2)])
        cand = split_store(SAMPLES / "server_broken.zarr", [tmp_path / f"server-{i}.zarr" for i in range(3)])
    elif pair == "wide_by_parts":  # rows of 6 KiB a side: the workers read and measure them a part at a time
        monkeypatch.setenv("TRACEDIFF_KERNEL", "fused")  # (the client's plan decides; workers load the kernel)
        ref, cand = write_wide_traces(tmp_path, seed=3)
    else:
        ref, cand = {
            "samples_broken": (SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr"),
            "samples_fixed": (SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr"),
            "llama_adjacent": llama_pair,
        }[pair]
    local = compare_stores(ref, cand, CompareOptions(block_bytes=SMALL_BLOCKS))
    done: list[int] = []
    remote = compare_stores(ref, cand, CompareOptions(block_bytes=SMALL_BLOCKS, runner=runner, progress=done.append))
    assert remote.verdict == local.verdict
    assert _kinds(remote) == _kinds(local)
    assert [f.message for f in remote.findings] == [f.message for f in local.findings]
    for a, b in zip(remote.metrics, local.metrics, strict=True):
        assert (a.candidate, a.reference, a.rows, a.nonfinite_candidate) == (b.candidate, b.reference, b.rows,
                                                                           b.nonfinite_candidate)
        assert a.cos_mean == pytest.approx(b.cos_mean, rel=1e-12, abs=1e-12)
        assert a.std_rel_error == pytest.approx(b.std_rel_error, rel=1e-12, abs=1e-12)
        assert a.worst_rows == b.worst_rows
    # Same function per block, merged in block order: not just close, the same report.
    assert _json(remote) == _json(local)
    assert sum(done) == remote.plan.pairs > 64  # several blocks, every row reported once
    if pair not in ("samples_fixed", "wide_by_parts"):
        assert remote.verdict == "mismatch"


@slow
def test_partial_results_merge_exactly_whatever_order_they_arrive_in(runner, llama_pair):
    """The pass alone, on 64-row blocks: per-row arrays, sums and profiles are the same bits."""
    ref_store, cand_store = open_store(llama_pair[0]), open_store(llama_pair[1])
    ref, cand = RowIndex.load(ref_store, "fc_in"), RowIndex.load(cand_store, "fc_in")
    pairs = pair_rows(align_sequences(ref, cand))
    matches = [(0, 0), (1, 1), (2, 2), (0, 1)]
    local = stream_metrics(pairs, ref, cand, matches, 64, block_bytes=SMALL_BLOCKS, workers=2)
    remote = stream_metrics(pairs, ref, cand, matches, 64, block_bytes=SMALL_BLOCKS, runner=runner)
    assert len(pairs) > 3 * 64
    for key in local.row_errors:
        np.testing.assert_array_equal(remote.row_errors[key], local.row_errors[key])
        np.testing.assert_array_equal(remote.row_cosines[key], local.row_cosines[key])
        np.testing.assert_array_equal(remote.row_norm_ratios[key], local.row_norm_ratios[key])
    as_json = lambda ms: json.dumps([dataclasses.asdict(m) for m in ms], default=str)  # noqa: E731  (NaN == NaN here)
    assert as_json(remote.metrics) == as_json(local.metrics)
    assert remote.bytes_read == local.bytes_read > 0


@slow
def test_a_worker_killed_mid_pass_is_retried_and_the_report_is_unchanged(cluster, tmp_path, llama_pair):
    """The first block task kills its worker process (the nanny restarts it); the scheduler runs
    the block again elsewhere and the report is the in-process one."""
    local = compare_stores(*llama_pair, CompareOptions(block_bytes=SMALL_BLOCKS))
    with distributed.Client(cluster, set_as_default=False) as client:
        client.register_plugin(_KillOnBlock(str(tmp_path / "killed"), times=1), name="kill-once")
        try:
            with DaskRunner(cluster.scheduler_address, task_bytes=1) as runner:
                remote = compare_stores(*llama_pair, CompareOptions(block_bytes=SMALL_BLOCKS, runner=runner))
        finally:
            client.unregister_worker_plugin("kill-once")
    assert (tmp_path / "killed").exists()  # a worker did die
    assert _json(remote) == _json(local)
    cluster.wait_for_workers(2)


@slow
def test_workers_that_keep_dying_are_one_clean_error_and_no_report(cluster, tmp_path, llama_pair):
    with distributed.Client(cluster, set_as_default=False) as client:
        client.register_plugin(_KillOnBlock(str(tmp_path / "killed"), times=100), name="kill-always")
        try:
            with DaskRunner(cluster.scheduler_address, task_bytes=1) as runner, \
                    pytest.raises(CompareError) as err:
                compare_stores(*llama_pair, CompareOptions(block_bytes=SMALL_BLOCKS, runner=runner))
        finally:
            client.unregister_worker_plugin("kill-always")
    message = str(err.value)
    assert "\n" not in message
    assert "was lost" in message and "killed" in message and "no report was written" in message
    assert str(llama_pair[1]) in message and str(llama_pair[0]) in message  # names the stores
    assert "block" in message
    client_wait = distributed.Client(cluster, set_as_default=False)
    try:
        client_wait.wait_for_workers(2, timeout=120)
    finally:
        client_wait.close()


@slow
def test_a_store_gone_from_the_workers_is_an_error_naming_it(runner, tmp_path):
    """The candidate disappears between the plan and the pass: the workers cannot open it."""
    cand = tmp_path / "server.zarr"
    shutil.copytree(SAMPLES / "server_broken.zarr", cand)

    def stage(name: str) -> None:
        if name == "comparing rows":
            shutil.rmtree(cand)

    with pytest.raises(CompareError) as err:
        compare_stores(SAMPLES / "train.zarr", cand, CompareOptions(runner=runner, stage=stage))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("dask worker failed on block 0")
    assert f"candidate {cand}" in message and "no such trace store" in message


def _open_files_under(folder: str) -> list[str]:
    """Run in a worker process: the files below ``folder`` it holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(folder):
                out.append(target)
    return out


@slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc (Linux)")
def test_a_worker_keeps_no_chunk_file_of_a_finished_compare_open(runner, tmp_path):
    """Chunk files are read in place, kept open from block to block; once the compare is over no
    worker holds one (a store deleted after its compare frees its disk space at once)."""
    ref = write_small_store(tmp_path / "train.zarr", chunk_rows=16, seq_lengths=(50,) * 8)
    cand = write_small_store(tmp_path / "server.zarr", chunk_rows=16, seq_lengths=(50,) * 8)
    for _ in range(2):
        report = compare_stores(ref, cand, CompareOptions(block_bytes=SMALL_BLOCKS, runner=runner))
        assert report.plan.pairs == 400
        held = runner.client.run(_open_files_under, str(tmp_path))
        assert held and not any(held.values()), held


@slow
def test_cli_compare_dask_local_cluster_writes_the_same_report(tmp_path):
    # A status line for every stage that lasts 50 ms (starting the cluster takes seconds).
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRACEDIFF_PROGRESS_SECONDS": "0.05"}
    reports = {}
    for name, extra in (("local", []), ("dask", ["--dask", "local:2"])):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(SAMPLES / "train.zarr"),
                               str(SAMPLES / "server_broken.zarr"), "--json", str(out), "-q", *extra],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 1, proc.stderr
        reports[name] = json.loads(out.read_text())
        if extra:
            assert "starting dask (local:2)" in proc.stderr
            assert "Traceback" not in proc.stderr
            assert "Warning" not in proc.stderr  # dask's own warnings (a port in use...) stay quiet
    assert reports["dask"] == reports["local"]


@pytest.mark.parametrize("text, expected", [("local:2", ("local", 2)), ("tcp://127.0.0.1:8786", ("address", "tcp://127.0.0.1:8786"))])
def test_dask_targets_parse(text, expected):
    assert parse_dask_target(text) == expected


@pytest.mark.parametrize("text", ["local:0", "local:two", "local", "", "tcp://a b"])
def test_bad_dask_targets_are_usage_errors(text):
    with pytest.raises(UsageError, match="--dask"):
        parse_dask_target(text)


def test_an_unreachable_scheduler_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "tracediff", "compare", str(SAMPLES / "train.zarr"),
                           str(SAMPLES / "server_broken.zarr"), "--dask", "tcp://127.0.0.1:9", "--no-progress"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "cannot start dask scheduler tcp://127.0.0.1:9" in proc.stderr


class _KillOnBlock(distributed.WorkerPlugin):
    """Kills its worker process as a block task starts, ``times`` times across the cluster (counted
    in files next to ``flag``)."""

    def __init__(self, flag: str, times: int) -> None:
        self.flag, self.times = flag, times

    def transition(self, key, start, finish, **kwargs) -> None:
        name = key if isinstance(key, str) else str(key)
        if finish != "executing" or "-blocks-" not in name:
            return
        for k in range(self.times):
            try:
                fd = os.open(f"{self.flag}.{k}" if k else self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            os._exit(1)
