"""Recording child processes of tests/test_disk_faults.py: a real host loop under a failing disk.

Run as ``python tests/disk_fault_children.py full_disk|slow_disk ARGS_JSON``. Each child first runs
its host loop without recording (the reference: what the host computes when nobody watches), then
the same loop with a recorder, in the same process and thread settings so that results compare bit
for bit. Everything the test needs is written to ``out`` (a normal folder): ``result.json``, the rows
the tap really received (``fed_*.npy``) and, for the full disk, a copy of the store, because the
tmpfs it was recorded on vanishes with the mount namespace when this process exits.

Only torch, numpy, psutil and tracediff are imported (no transformers, no pytest): start-up is short.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _host_setup() -> None:
    torch.set_num_threads(1)  # one fixed thread count: results are bit-reproducible within the process
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def _tap_feed(module: torch.nn.Module) -> tuple[list[np.ndarray], Any]:
    """Keep what ``module`` receives (a private copy, as the test's ground truth)."""
    fed: list[np.ndarray] = []
    handle = module.register_forward_pre_hook(lambda _m, args: fed.append(args[0].detach().numpy().copy()))
    return fed, handle


# ------------------------------------------------------------------------------------ full disk
def _training_model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.GELU(),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, width),  # the tapped layer: its input needs grad (LayerNorm's output)
        torch.nn.GELU(),
        torch.nn.Linear(width, 1),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int, on_step: Callable[[int], None]
) -> dict[str, Any]:
    """A real training loop (forward, backward, optimizer step); returns what the host computed."""
    losses: list[str] = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(batch, 16, generator=gen)
        y = torch.randn(batch, 1, generator=gen)
        on_step(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss).hex())
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"losses": losses, "params_sha256": params}


def full_disk(
    store: str,
    out: str,
    steps: int,
    batch: int,
    width: int,
    chunk_rows: int,
    compressor: str = "none",
    durable: bool = False,
) -> None:
    """Train without, then with a recorder whose store lies on a small tmpfs that fills up (uncompressed:
    the writer's direct chunk files; a compressor: zarr's write path)."""
    import tracediff  # noqa: PLC0415

    _host_setup()
    out_dir = Path(out)
    model, opt = _training_model(width)
    fed, handle = _tap_feed(model[3])
    reference = _train(model, opt, steps, batch, lambda _s: None)
    handle.remove()
    np.save(out_dir / "fed.npy", np.concatenate(fed))

    model, opt = _training_model(width)
    started = time.monotonic()
    # block: the queue never drops, so the store holds exactly a prefix of what was fed.
    rec = tracediff.record(
        store, role="trainer", on_full="block", chunk_rows=chunk_rows, compressor=compressor, durable=durable
    )
    rec.tap(model[3], "fc_in", capture="input")
    recorded = _train(model, opt, steps, batch, lambda s: rec.labels(step=s, seq=s))
    loop_s = time.monotonic() - started
    rec.close()
    total_s = time.monotonic() - started
    usage = shutil.disk_usage(os.path.dirname(store))
    shutil.copytree(store, out_dir / "store.zarr")  # the tmpfs goes away with this process
    result = {
        "reference": reference,
        "recorded": recorded,
        "error": rec.error,
        "stats": rec.stats(),
        "writer": rec.writer_name,
        "loop_s": loop_s,
        "total_s": total_s,
        "fs_total": usage.total,
        "fs_free_after": usage.free,
    }
    (out_dir / "result.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ slow disk
class _PeakRss:
    """Peak resident memory of this process since :meth:`reset`: the kernel's high-water mark
    (``VmHWM``, reset through ``/proc/self/clear_refs``) when it can be reset, else psutil sampled
    every millisecond by a thread."""

    def __init__(self) -> None:
        import psutil  # noqa: PLC0415

        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = "VmHWM"

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def reset(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.method = "psutil-1ms"
            self._peak = self.rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, self.rss())

    def peak(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return self._peak
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")


def _digest(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.detach().contiguous().numpy()):08x}"


def _inference_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)).eval()


def _serve(model: torch.nn.Module, steps: int, rows: int, width: int) -> tuple[list[str], list[float]]:
    """An inference loop: one batch of ``rows`` tokens per step (a fresh tensor each step, like a
    server's activations); returns output digests and step times."""
    digests: list[str] = []
    times: list[float] = []
    base = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for step in range(steps):
            x = base * (1.0 + step / steps)
            t0 = time.perf_counter()
            y = model(x)
            times.append(time.perf_counter() - t0)
            digests.append(_digest(y))
    return digests, times


def slow_disk(folder: str, write_delay: float, drop: dict[str, int], block: dict[str, int] | None = None) -> None:
    """A slow disk under a recorder in drop mode (memory must stay bounded) and, when ``block`` is
    given, in block mode (every row must land). The disk is slowed by a sleep before each batch's
    real write (the store code itself runs unchanged)."""
    import tracediff  # noqa: PLC0415
    from tracediff.store import TraceWriter  # noqa: PLC0415

    _host_setup()
    real_append = TraceWriter.append

    def slow_append(self: TraceWriter, values: np.ndarray, labels: dict[str, Any]) -> None:
        time.sleep(write_delay)
        real_append(self, values, labels)

    TraceWriter.append = slow_append  # type: ignore[method-assign]
    out = Path(folder)
    result: dict[str, Any] = {}

    # Drop mode: far more data than the queue may hold.
    width, steps, rows = drop["width"], drop["steps"], drop["rows"]
    model = _inference_model(width)
    fed_digests: list[str] = []
    handle = model[2].register_forward_pre_hook(lambda _m, args: fed_digests.append(_digest(args[0])))
    reference, ref_times = _serve(model, steps, rows, width)  # also warms the allocator up
    handle.remove()
    rec = tracediff.record(out / "drop.zarr", on_full="drop", max_queue_bytes=drop["max_queue_bytes"])
    rec.tap(model[2], "fc_in")
    meter = _PeakRss()
    baseline = meter.rss()
    meter.reset()
    started = time.monotonic()
    outputs, times = _serve(model, steps, rows, width)
    loop_s = time.monotonic() - started
    peak = meter.peak()  # before close: the queue is at its fullest while the host runs
    rec.close()
    result["drop"] = {
        "reference": reference,
        "fed_digests": fed_digests,
        "outputs": outputs,
        "stats": rec.stats()["fc_in"],
        "writer": rec.writer_name,
        "produced_bytes": steps * rows * width * 4,
        "rss_baseline": baseline,
        "rss_peak": peak,
        "rss_method": meter.method,
        "loop_s": loop_s,
        "total_s": time.monotonic() - started,
        "step_ms_max": 1000 * max(times),
        "step_ms_median": 1000 * float(np.median(times)),
        "reference_step_ms_max": 1000 * max(ref_times),
        "reference_step_ms_median": 1000 * float(np.median(ref_times)),
    }

    if block is None:
        (out / "result.json").write_text(json.dumps(result))
        return
    # Block mode: the host waits for the slow writer; every row lands.
    width, steps, rows = block["width"], block["steps"], block["rows"]
    model = _inference_model(width)
    reference, _ = _serve(model, steps, rows, width)
    fed, handle = _tap_feed(model[2])
    rec = tracediff.record(
        out / "block.zarr", on_full="block", max_queue_bytes=block["max_queue_bytes"], block_timeout=60.0
    )
    rec.tap(model[2], "fc_in")
    started = time.monotonic()
    outputs, _ = _serve(model, steps, rows, width)
    rec.close()
    handle.remove()
    np.save(out / "fed_block.npy", np.concatenate(fed))
    result["block"] = {
        "reference": reference,
        "outputs": outputs,
        "stats": rec.stats()["fc_in"],
        "writer": rec.writer_name,
        "total_s": time.monotonic() - started,
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    globals()[sys.argv[1]](**json.loads(sys.argv[2]))
