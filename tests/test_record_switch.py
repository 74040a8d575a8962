"""Recording switched off and on without a restart (tracediff.record.switch, .control, `tracediff control`),
and the recorder's threads placed off the engine's cores (tracediff.record.cores).

Real recorders writing real stores, real HTTP on loopback, real signals, real `tracediff record -- python
script.py` subprocesses toggled by `tracediff control STORE off|on` while they run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_env, invoke_tracediff, run_tracediff

from tracediff.adapters.vllm_cores import engine_cores
from tracediff.record.control import CONTROL_DIR, ask, install_signals, serve
from tracediff.record.cores import parse_cpu_list
from tracediff.record.recorder import Recorder

LINUX_2_CORES = pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                                   reason="thread placement needs Linux and two cores")


def _writer_attrs(store: Path, tap: str = "fc_in") -> dict:
    (doc,) = sorted((store / tap).glob("*/zarr.json"))
    return json.loads(doc.read_text())["attributes"]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the recorded command ended before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _http(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ------------------------------------------------------------------------------- the switch, in process
def test_rows_seen_while_off_are_skipped_not_lost_and_the_history_has_each_change(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 4)
    with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
        rec.tap(layer)
        layer(torch.full((3, 8), 1.0))
        assert rec.switch(False, by="test") and not rec.recording_on
        assert not rec.switch(False, by="test")  # already off: no change, no history entry
        layer(torch.full((5, 8), 2.0))
        rec.capture("fc_in", torch.full((2, 8), 2.0))
        off = rec.switch_status()
        assert rec.switch(True, by="test")
        layer(torch.full((7, 8), 3.0))
    assert off["state"] == "off" and off["by"] == "test"
    assert off["rows"]["skipped"] == off["rows"]["switched_off"] == 7 and off["rows"]["lost"] == 0
    attrs = _writer_attrs(tmp_path / "s.zarr")
    assert attrs["commit"]["rows"] == 10 and attrs["commit"]["skipped_rows"] == 7
    assert attrs["commit"]["dropped_rows"] == 0
    assert attrs["skip_reasons"] == {"switched off": 7}
    states = [(e["state"], e["by"]) for e in attrs["switch"]]
    assert states == [("on", "start"), ("off", "test"), ("on", "test")]
    times = [e["time"] for e in attrs["switch"][1:]]
    assert times == sorted(times) and all(t.endswith("+0000") for t in times)
    stored = _stored_values(tmp_path / "s.zarr")
    assert sorted(set(stored[:, 0].tolist())) == [1.0, 3.0]  # nothing of what came while off


def _stored_values(store: Path, tap: str = "fc_in") -> np.ndarray:
    import tracediff  # noqa: PLC0415

    with tracediff.open_store(store) as opened:
        return np.asarray(tracediff.open_values(opened, tap)[:], dtype=np.float32)


def test_start_off_begins_the_history_off_and_inspect_shows_the_switch(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 4)
    with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
        rec.start_off()
        rec.tap(layer)
        layer(torch.ones(4, 8))
        rec.switch(True, by="test")
        layer(torch.ones(6, 8))
    attrs = _writer_attrs(tmp_path / "s.zarr")
    assert [(e["state"], e["by"]) for e in attrs["switch"]] == [("off", "--start-off"), ("on", "test")]
    assert attrs["commit"]["rows"] == 6 and attrs["commit"]["skipped_rows"] == 4
    shown = invoke_tracediff("inspect", tmp_path / "s.zarr")
    assert shown.returncode == 0, shown.stderr
    assert "switched off 4 rows" in shown.stdout and "on at" in shown.stdout, shown.stdout


def test_compare_takes_a_switch_history_and_the_writer_cores_for_no_configuration_difference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rows = torch.randn(40, 64)
    for name, switched in (("a.zarr", False), ("b.zarr", True)):
        with Recorder(tmp_path / name, handle_sigterm=False) as rec:
            rec.declare("fc_in", segment_size=32)
            if switched:
                rec.switch(False, by="test")
                rec.capture("fc_in", rows[:5])
                rec.switch(True, by="test")
            rec.labels(seq=[0] * 40, position=list(range(40)), token_id=list(range(40)))
            rec.capture("fc_in", rows)
    result = invoke_tracediff("compare", tmp_path / "a.zarr", tmp_path / "b.zarr", "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [f for f in report["findings"] if f["kind"] == "config"] == [], report["findings"]


# ----------------------------------------------------------------------------- the endpoint, in process
def test_the_endpoint_switches_and_answers_status_over_loopback(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 4)
    rec = Recorder(tmp_path / "s.zarr", handle_sigterm=False)
    try:
        rec.tap(layer)
        control = serve(rec, 0)
        assert control.url.startswith("http://127.0.0.1:")
        note = json.loads((tmp_path / "s.zarr" / CONTROL_DIR / f"{rec.writer_name}.json").read_text())
        assert note["url"] == control.url and note["pid"] == os.getpid()
        layer(torch.ones(3, 8))
        assert rec.flush()
        code, status = _http(control.url + "/status")
        assert code == 200 and status["state"] == "on" and status["rows"]["recorded"] == 3
        assert set(status["threads"]) >= {"engine_cores", "writer_cores"}  # where the writer runs, live
        code, answer = _http(control.url + "/off", "POST", b"")
        assert code == 200 and answer["changed"] and answer["state"] == "off" and answer["by"] == "http 127.0.0.1"
        layer(torch.ones(5, 8))
        status = ask(control.url, "status")
        assert status["rows"] == {"recorded": 3, "skipped": 5, "switched_off": 5, "lost": 0}
        assert status["since"] == answer["since"]
        assert ask(control.url, "on")["changed"] is True
        layer(torch.ones(2, 8))
        assert rec.flush()
        assert ask(control.url, "status")["rows"]["recorded"] == 5
        assert _http(control.url + "/nothing")[0] == 404
        assert _http(control.url + "/on", "POST", b"x" * 5000)[0] == 413  # a body past the bound is refused
        assert _http(control.url + "/status")[0] == 200  # and the endpoint still answers
    finally:
        rec.close()
    control.thread.join(10)
    assert not control.thread.is_alive()  # stops with its recorder, and takes its file out of the store
    assert not (tmp_path / "s.zarr" / CONTROL_DIR / f"{rec.writer_name}.json").exists()
    assert [e["by"] for e in _writer_attrs(tmp_path / "s.zarr")["switch"]] == ["start", "http 127.0.0.1",
                                                                            "http 127.0.0.1"]


def test_a_client_that_connects_and_sends_nothing_does_not_keep_the_endpoint(tmp_path: Path) -> None:
    with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
        control = serve(rec, 0)
        port = int(control.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as idle:  # holds the one-at-a-time server
            assert ask(control.url, "status", timeout=60)["state"] == "on"  # answered once it timed out
            assert idle.recv(1) == b""  # the idle connection was closed by the endpoint


def test_control_command_talks_to_one_url_and_to_every_endpoint_of_a_store(tmp_path: Path) -> None:
    layer = torch.nn.Linear(8, 4)
    with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
        rec.tap(layer)
        control = serve(rec, 0)
        off = invoke_tracediff("control", tmp_path / "s.zarr", "off")
        assert off.returncode == 0, off.stderr
        assert "switched off" in off.stdout and f"pid {os.getpid()}" in off.stdout
        layer(torch.ones(4, 8))
        status = invoke_tracediff("control", control.url, "status", "--json", "-")
        assert status.returncode == 0, status.stderr
        (answer,) = json.loads(status.stdout)["endpoints"]
        assert answer["state"] == "off" and answer["rows"]["switched_off"] == 4
        on = invoke_tracediff("control", control.url, "on", "--json", tmp_path / "on.json")
        assert on.returncode == 0 and "switched on" in on.stdout
        assert json.loads((tmp_path / "on.json").read_text())["endpoints"][0]["changed"] is True


def test_control_store_switches_every_recording_process_of_the_store(tmp_path: Path) -> None:
    first = Recorder(tmp_path / "s.zarr", handle_sigterm=False, writer_name="rank0")  # two ranks of one run
    second = Recorder(tmp_path / "s.zarr", handle_sigterm=False, writer_name="rank1", append=True)
    try:
        for rec in (first, second):
            serve(rec, 0)
        off = invoke_tracediff("control", tmp_path / "s.zarr", "off")
        assert off.returncode == 0, off.stderr
        assert len(off.stdout.strip().splitlines()) == 2 and "(rank0)" in off.stdout and "(rank1)" in off.stdout
        assert not first.recording_on and not second.recording_on
    finally:
        first.close()
        second.close()


def test_control_command_names_an_endpoint_it_cannot_reach_and_exits_2(tmp_path: Path) -> None:
    with Recorder(tmp_path / "s.zarr", handle_sigterm=False):
        pass
    with socket.socket() as sock:  # a port nobody listens on once this socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = tmp_path / "s.zarr" / CONTROL_DIR
    folder.mkdir()
    note = {"url": f"http://127.0.0.1:{port}", "pid": os.getpid(), "host": socket.gethostname(), "writer": "w"}
    (folder / "w.json").write_text(json.dumps(note))
    result = invoke_tracediff("control", tmp_path / "s.zarr", "status")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracediff: error: ") and f"127.0.0.1:{port}" in lines[0], lines
    one = invoke_tracediff("control", f"http://127.0.0.1:{port}", "off")
    assert one.returncode == 2 and "unreachable" in one.stderr
    # A process that has ended (its pid gone): not asked; nothing else left: an error naming the store.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / "w.json").write_text(json.dumps(dict(note, pid=int(dead.stdout))))
    ended = invoke_tracediff("control", tmp_path / "s.zarr", "on")
    assert ended.returncode == 2 and "has ended" in ended.stderr
    assert invoke_tracediff("control", "http://example.com:80", "on").returncode == 2  # loopback only
    nothing = invoke_tracediff("control", tmp_path / "nowhere.zarr", "status")
    assert nothing.returncode == 2 and "no trace store" in nothing.stderr


# ------------------------------------------------------------------------------------------- signals
def test_sigusr1_and_sigusr2_switch_and_a_hosts_handler_is_chained(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))  # the host's own handler
    try:
        with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
            assert install_signals(rec) == ["SIGUSR1", "SIGUSR2"]
            os.kill(os.getpid(), signal.SIGUSR2)
            assert not rec.recording_on
            os.kill(os.getpid(), signal.SIGUSR1)
            assert rec.recording_on and seen == [signal.SIGUSR1]  # ours switched, theirs still ran
            assert [e["by"] for e in rec.switch_history()] == ["start", "SIGUSR2", "SIGUSR1"]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_an_ignored_signal_is_left_to_the_host(tmp_path: Path) -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with Recorder(tmp_path / "s.zarr", handle_sigterm=False) as rec:
            assert install_signals(rec) == ["SIGUSR1"]
            assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------ record -- CMD, toggled live
SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time

    import torch

    import tracediff


    class Proj(torch.nn.Linear):
        pass


    flags = sys.argv[1]
    model = Proj(16, 4)
    for phase in range(3):
        while not os.path.exists(os.path.join(flags, f"go{phase}")):
            time.sleep(0.02)
        tracediff.labels(seq=[phase] * 5, position=list(range(5)))
        model(torch.full((5, 16), float(phase)))
        open(os.path.join(flags, f"done{phase}"), "w").close()
    """
)


def test_record_toggled_by_control_store_off_and_on_while_the_command_runs(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    flags = tmp_path / "flags"
    flags.mkdir()
    store = tmp_path / "run.zarr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracediff", "record", "--tap", "Proj:input", "--control-port", "0", "-o", str(store),
         "--", sys.executable, str(script), str(flags)],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (flags / "go0").touch()
        _wait_for(flags / "done0", proc)
        off = run_tracediff("control", store, "off")
        assert off.returncode == 0, off.stderr
        assert "switched off" in off.stdout
        (flags / "go1").touch()
        _wait_for(flags / "done1", proc)
        status = run_tracediff("control", store, "status", "--json", "-")
        assert status.returncode == 0, status.stderr
        (answer,) = json.loads(status.stdout)["endpoints"]
        assert answer["state"] == "off" and answer["rows"]["switched_off"] == 5
        on = run_tracediff("control", store, "on")
        assert on.returncode == 0, on.stderr
        (flags / "go2").touch()
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "skipped 5" in stderr, stderr
    assert "switched off 5 rows: on at " in stderr, stderr  # the summary says when and by whom
    import tracediff  # noqa: PLC0415

    with tracediff.open_store(store) as opened:
        seqs = np.asarray(tracediff.open_labels(opened, "proj_in")["seq"][:])
    assert sorted(set(seqs.tolist())) == [0, 2]  # the rows of phase 1, sent while off, are absent
    attrs = _writer_attrs(store, "proj_in")
    assert [e["state"] for e in attrs["switch"]] == ["on", "off", "on"]
    assert attrs["skip_reasons"] == {"switched off": 5} and attrs["commit"]["dropped_rows"] == 0
    assert not list((store / CONTROL_DIR).glob("*.json"))  # each process took its endpoint out at close


def test_record_start_off_never_switched_on_says_so_and_exits_with_the_commands_code(tmp_path: Path) -> None:
    """Off the whole time is what --start-off asks for until someone switches it on (a production
    server that needed no recording): one note line, the command's own exit code, never an error."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    flags = tmp_path / "flags"
    flags.mkdir()
    for phase in range(3):
        (flags / f"go{phase}").touch()
    result = run_tracediff("record", "--tap", "Proj:input", "--start-off", "-o", tmp_path / "off.zarr", "--",
                           sys.executable, script, flags)
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("tracediff: error:")], result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("tracediff: note:")]
    assert len(notes) == 1 and "switched off the whole time (15 rows skipped while off" in notes[0], notes
    assert not (tmp_path / "off.zarr").exists()  # a store without one row is not left behind


# ----------------------------------------------------------------------------------- thread placement
PINNED = textwrap.dedent(
    """
    import json
    import os
    import sys
    import threading

    import torch

    from tracediff.record.recorder import Recorder

    os.sched_setaffinity(0, {int(sys.argv[2])})  # the "engine": this thread pinned to one core
    rec = Recorder(sys.argv[1], handle_sigterm=False)
    rec.capture("fc_in", torch.ones(2, 8))
    rec.flush()
    (writer,) = [t for t in threading.enumerate() if t.name == "tracediff-writer"]
    with open(f"/proc/self/task/{writer.native_id}/status") as fh:
        allowed = [line.split(":", 1)[1].strip() for line in fh if line.startswith("Cpus_allowed_list")][0]
    rec.close()
    print(json.dumps({"allowed": allowed, "threads": rec.threads}))
    """
)


def _run_pinned(tmp_path: Path, core: int, **env: str) -> dict:
    script = tmp_path / "pinned.py"
    script.write_text(PINNED)
    store = tmp_path / f"p{core}{len(env)}.zarr"
    done = subprocess.run([sys.executable, str(script), str(store), str(core)], env=cli_env(**env),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert _writer_attrs(store)["threads"] == out["threads"]  # the choice is in the writer's metadata
    return out


@LINUX_2_CORES
def test_the_writer_thread_runs_on_the_core_the_engine_did_not_pin(tmp_path: Path) -> None:
    for core, other in ((0, "1"), (1, "0")):
        out = _run_pinned(tmp_path, core)
        assert out["allowed"] == other
        assert out["threads"]["engine_cores"] == [core] and out["threads"]["writer_cores"] == [int(other)]


@LINUX_2_CORES
def test_writer_cores_can_be_named_and_an_unpinned_engine_leaves_the_writer_where_it_was(tmp_path: Path) -> None:
    named = _run_pinned(tmp_path, 1, TRACEDIFF_WRITER_CORES="1")
    assert named["allowed"] == "1" and "TRACEDIFF_WRITER_CORES" in named["threads"]["how"]
    with Recorder(tmp_path / "free.zarr", handle_sigterm=False) as rec:  # this process pins nothing
        rec.capture("fc_in", torch.ones(2, 8))
        rec.flush()
    everything = sorted(os.sched_getaffinity(0))
    assert rec.threads["engine_cores"] == everything and rec.threads["writer_cores"] == everything
    assert "kept the inherited" in rec.threads["how"]


def test_core_lists_and_vllms_openmp_binding_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_cpu_list("a,b")
    for name in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    assert engine_cores() is None
    monkeypatch.setenv("OMP_PLACES", "{0,1,2}")  # what vLLM 0.32 writes without a preloaded OpenMP
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    assert engine_cores() == [0, 1, 2]
    monkeypatch.setenv("OMP_PLACES", "{4:3}")
    assert engine_cores() == [4, 5, 6]
    monkeypatch.delenv("OMP_PLACES")
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "3 4")
    assert engine_cores() == [3, 4]
    monkeypatch.delenv("GOMP_CPU_AFFINITY")
    monkeypatch.setenv("KMP_AFFINITY", "granularity=fine,explicit,proclist=[6,7]")
    assert engine_cores() == [6, 7]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert engine_cores() is None
