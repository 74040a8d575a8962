"""The recorder never harms its host, whatever the host feeds a tap or however a stage fails.

Faults are injected at every stage: what a hook picks (shapes, dtypes, strided views, meta tensors,
keyword-only calls, tuple and mapping outputs, autograd), the label provider, the writer thread, and
``close()`` (twice, from another thread, racing a forward). For each, the host's outputs (and
gradients) are bit for bit those of the same code run without a recorder, and the recorder either
records the rows correctly or stops that tap (or itself) with one log line naming the tap and the
field at fault, keeping every row committed before.

Everything is real: torch modules and forward passes (nn.Linear stacks, the tiny Llama), zarr stores
in ``tmp_path`` read back with plain zarr + numpy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import read_plain, stored_bits, writer_json
from torch import nn

import tracediff
from tracediff.store import TraceStore, TraceWriter

W = 8  # row width of the small stacks


# ------------------------------------------------------------------------------------------ helpers
def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """A module with seeded weights, leaving the global RNG alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def stack(width: int = W, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    return seeded(lambda: nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3)).to(dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bytes (NaN payloads and signed zeros included)."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    if a.is_meta:
        return True
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def assert_same_outputs(got: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert same_bits(a, b), f"host output {i} differs from the unrecorded run"


def groups(store: Path, tap: str) -> dict[str, Any]:
    """The tap's writer groups (none when nothing was ever written for it)."""
    import zarr  # noqa: PLC0415

    return read_plain(store, tap) if tap in zarr.open_group(str(store), mode="r") else {}


def only_group(store: Path, tap: str):
    (group,) = groups(store, tap).values()
    return group


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    unsigned = np.dtype(f"u{got.dtype.itemsize}")
    assert np.array_equal(got.view(unsigned), expected.view(unsigned))


def tracediff_lines(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "tracediff" and r.levelno >= level]
    assert all("\n" not in line for line in lines), lines  # one line each
    return lines


# ----------------------------------------------------------------------------- shapes and dtypes
def test_every_shape_a_tap_sees_is_recorded_or_skipped_with_one_warning(tmp_path: Path, caplog) -> None:
    """2-D, 1-D (one row), 0-row and 3-D batches are rows of the same width; a batch whose width
    changes is skipped (its rows could not share the group), once warned, and recording goes on."""
    act = nn.GELU()  # any shape goes through it
    feeds = [
        torch.randn(4, W),
        torch.randn(W),  # one row
        torch.randn(0, W),  # nothing to record
        torch.randn(2, 3, W),  # two sequences of three positions
        torch.randn(3, 2 * W),  # width changes: skipped
        torch.randn(5, W),
        torch.randn(1, 2 * W),  # again: no second warning
    ]
    reference = [act(x) for x in feeds]
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(act, "probe")
        outputs = [act(x) for x in feeds]
        assert rec.enabled and rec.error is None
    assert_same_outputs(outputs, reference)

    group = only_group(tmp_path / "s.zarr", "probe")
    kept = [x for x in feeds if x.shape[-1] == W]
    assert_bits_equal(group.values, np.concatenate([stored_bits(x) for x in kept]))
    assert group.commit["status"] == "closed" and group.rows == 4 + 1 + 0 + 6 + 5
    # Default labels: one sequence per leading index of a 3-D batch, one per 1-D/2-D batch.
    assert group.labels["seq"].tolist() == [0] * 4 + [1] + [2] * 3 + [3] * 3 + [4] * 5
    assert group.labels["position"].tolist() == [0, 1, 2, 3, 0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]
    (warning,) = tracediff_lines(caplog)
    assert "'probe'" in warning and f"width {2 * W}" in warning and f"after {W}" in warning


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_a_non_float_tensor_is_skipped_with_one_warning_naming_the_tap_and_its_dtype(
    tmp_path: Path, caplog, dtype: torch.dtype
) -> None:
    """Token ids into an embedding, masks, complex rotary factors: not rows of activations."""
    ident = nn.Identity()
    lin = stack()
    make = (
        (lambda: torch.randn(3, W).to(dtype)) if dtype.is_complex else (lambda: torch.randint(0, 2, (3, W)).to(dtype))
    )
    feeds = [make() for _ in range(3)]
    xs = [torch.randn(3, W) for _ in range(3)]
    reference = [ident(f) for f in feeds] + [lin(x) for x in xs]
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(ident, "odd")
        rec.tap(lin[0], "fc_in")
        outputs = [ident(f) for f in feeds] + [lin(x) for x in xs]
        assert rec.enabled and rec.error is None
    assert_same_outputs(outputs, reference)
    assert groups(tmp_path / "s.zarr", "odd") == {}
    assert_bits_equal(only_group(tmp_path / "s.zarr", "fc_in").values, np.concatenate([x.numpy() for x in xs]))
    (warning,) = tracediff_lines(caplog)
    assert "'odd'" in warning and "dtype" in warning and str(dtype) in warning


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_float_dtype_is_recorded_bit_for_bit_including_nan_inf_and_signed_zero(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    lin = stack(dtype=dtype)
    x = torch.randn(6, W).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    x[1, 0] = torch.finfo(dtype).tiny / 4  # subnormal
    reference = lin(x)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(lin[0], "fc_in")
        output = lin(x)
    assert same_bits(output, reference)
    group = only_group(tmp_path / "s.zarr", "fc_in")
    assert group.attrs["dtype"] == str(dtype).removeprefix("torch.")
    assert_bits_equal(group.values, stored_bits(x))


# ----------------------------------------------------------------------------- non-contiguous views
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transposed": lambda base: base[:W, :12].t(),  # [12, W], column-major
    "every_other_column": lambda base: base[:5, : 2 * W : 2],
    "every_other_row": lambda base: base[::2, :W],
    "expanded_row": lambda base: base[:1, :W].expand(7, W),  # stride 0: one row seen 7 times
    "expanded_3d": lambda base: base[:2, :W].unsqueeze(1).expand(2, 4, W),
    "permuted_3d": lambda base: base[:12, :W].reshape(3, 4, W).permute(1, 0, 2),
    "offset_narrow": lambda base: base[3:9, 5 : 5 + W],
}


@pytest.mark.parametrize("how", ["hook", "capture", "capture_fresh"])
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_non_contiguous_view_is_recorded_as_its_contiguous_rows(
    tmp_path: Path, view: str, how: str, dtype: torch.dtype
) -> None:
    base = torch.randn(16, 3 * W, generator=torch.Generator().manual_seed(0)).to(dtype)
    x = VIEWS[view](base)
    assert not x.is_contiguous()
    before = base.clone()
    lin = stack(dtype=dtype)
    reference = lin(x)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        if how == "hook":
            rec.tap(lin[0], "fc_in")
        else:
            rec.capture("fc_in", x, fresh=how == "capture_fresh")
        output = lin(x)
    assert same_bits(output, reference) and torch.equal(base, before)
    assert_bits_equal(only_group(tmp_path / "s.zarr", "fc_in").values, stored_bits(x.contiguous()))


def test_a_meta_tensor_is_skipped_and_the_forward_on_meta_is_untouched(tmp_path: Path, caplog) -> None:
    """Shape-only forwards (init on the meta device, FLOP counters) hold no data to record."""
    meta_lin = nn.Linear(W, 3, device="meta")
    lin = stack()
    x = torch.randn(4, W)
    reference = [meta_lin(torch.empty(4, W, device="meta")), lin(x)]
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(meta_lin, "meta_in")
        rec.tap(lin[0], "fc_in")
        outputs = [meta_lin(torch.empty(4, W, device="meta")), lin(x)]
        assert rec.enabled
    assert_same_outputs(outputs, reference)
    assert groups(tmp_path / "s.zarr", "meta_in") == {}
    assert_bits_equal(only_group(tmp_path / "s.zarr", "fc_in").values, x.numpy())
    (warning,) = tracediff_lines(caplog)
    assert "'meta_in'" in warning and "meta device" in warning


# ------------------------------------------------------------------- calls by keyword, odd outputs
class Block(nn.Module):
    """A block called the way HF calls layers: keywords, a mask the same shape as the states."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0):
        out = self.proj(hidden_states) * scale
        return out if mask is None else out * mask


@pytest.mark.parametrize("arg", [0, "hidden_states"])
@pytest.mark.parametrize(
    "call",
    ["positional", "keyword", "keywords_mask_first", "positional_mask_keyword"],
)
def test_the_tapped_input_is_found_however_the_forward_is_called(tmp_path: Path, arg: int | str, call: str) -> None:
    """By position or keyword, in any keyword order: never the mask instead of the states."""
    block = seeded(Block)
    states, mask = torch.randn(5, W), torch.rand(5, W)  # same shape and dtype: a wrong pick would store
    calls = {
        "positional": lambda: block(states, mask),
        "keyword": lambda: block(hidden_states=states, mask=mask),
        "keywords_mask_first": lambda: block(scale=2.0, mask=mask, hidden_states=states),
        "positional_mask_keyword": lambda: block(states, mask=mask),
    }
    reference = calls[call]()
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(block, "block_in", arg=arg)
        output = calls[call]()
        assert rec.enabled and rec.stats()["block_in"]["error"] is None
    assert same_bits(output, reference)
    assert_bits_equal(only_group(tmp_path / "s.zarr", "block_in").values, states.numpy())


def test_a_decoder_layer_input_named_by_keyword_is_found_when_hf_passes_it_by_position(
    tmp_path: Path, tiny, seqs
) -> None:
    ids = torch.tensor([seqs[0]])
    with torch.no_grad():
        reference = tiny.model(ids, output_hidden_states=True)
    with tracediff.record(tmp_path / "s.zarr") as rec, torch.no_grad():
        rec.tap(tiny.model.model.layers[1], "layer1_in", arg="hidden_states")
        output = tiny.model(ids, output_hidden_states=True)
    assert same_bits(output.logits, reference.logits)
    # HF's hidden_states[1] is what decoder layer 1 receives.
    assert_bits_equal(only_group(tmp_path / "s.zarr", "layer1_in").values, stored_bits(reference.hidden_states[1]))


class Pair(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.proj(x)
        if self.kind == "none_first":
            return (None, y, y * 2)
        if self.kind == "dict":
            return {"steps": 3, "hidden": y, "aux": y * 2}
        if self.kind == "list":
            return [y, y * 2]
        return {"steps": 3, "names": ["a", "b"]}  # no tensor at all


@pytest.mark.parametrize("kind", ["none_first", "dict", "list"])
def test_a_tuple_or_mapping_output_records_its_first_tensor(tmp_path: Path, kind: str) -> None:
    pair = seeded(lambda: Pair(kind))
    x = torch.randn(4, W)
    expected = pair.proj(x)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(pair, "pair_out", capture="output")
        pair(x)
        assert rec.enabled
    assert_bits_equal(only_group(tmp_path / "s.zarr", "pair_out").values, expected.detach().numpy())


def test_hf_tuple_and_model_output_outputs_record_their_first_tensor(tmp_path: Path, tiny, seqs) -> None:
    """Llama's attention returns (attn_output, attn_weights); the model returns a ModelOutput."""
    ids = torch.tensor([seqs[1]])
    attn = tiny.model.model.layers[2].self_attn
    seen: dict[str, torch.Tensor] = {}
    handles = [
        attn.register_forward_hook(lambda _m, _a, out: seen.__setitem__("attn", out[0].clone())),
        tiny.model.model.register_forward_hook(
            lambda _m, _a, out: seen.__setitem__("model", out.last_hidden_state.clone())
        ),
    ]
    try:
        with torch.no_grad():
            reference = tiny.model(ids).logits
        with tracediff.record(tmp_path / "s.zarr") as rec, torch.no_grad():
            rec.tap(attn, "attn_out", capture="output")
            rec.tap(tiny.model.model, "model_out", capture="output")
            logits = tiny.model(ids).logits
            assert rec.enabled
    finally:
        for handle in handles:
            handle.remove()
    assert same_bits(logits, reference)
    assert_bits_equal(only_group(tmp_path / "s.zarr", "attn_out").values, stored_bits(seen["attn"]))
    assert_bits_equal(only_group(tmp_path / "s.zarr", "model_out").values, stored_bits(seen["model"]))


def test_an_output_holding_no_tensor_stops_that_tap_only(tmp_path: Path, caplog) -> None:
    pair = seeded(lambda: Pair("nothing"))
    lin = stack()
    xs = [torch.randn(3, W) for _ in range(3)]
    reference = [pair(x) for x in xs] + [lin(x) for x in xs]
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(pair, "pair_out", capture="output")
        rec.tap(lin[0], "fc_in")
        outputs = [pair(x) for x in xs] + [lin(x) for x in xs]
        assert rec.enabled and rec.error is None
        assert "holds no tensor" in rec.stats()["pair_out"]["error"]
    assert outputs[:3] == reference[:3]
    assert_same_outputs(outputs[3:], reference[3:])
    assert_bits_equal(only_group(tmp_path / "s.zarr", "fc_in").values, np.concatenate([x.numpy() for x in xs]))
    (line,) = tracediff_lines(caplog)
    assert "'pair_out'" in line and "its output" in line and "holds no tensor" in line


# ------------------------------------------------------------------------------------------ autograd
def train_steps(
    rec: tracediff.Recorder | None, steps: int = 4
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A real training loop; a ReLU(inplace) right after the tapped input modifies it in place."""
    model = seeded(
        lambda: nn.Sequential(nn.Linear(W, 16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    )
    if rec is not None:
        rec.tap(model[3], "relu_in")  # its input requires grad and is then overwritten in place
        rec.tap(model[2], "fc_out", capture="output")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, fed = [], [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(6, W, generator=gen, requires_grad=True)
        y = torch.randn(6, 1, generator=gen)
        handle = model[3].register_forward_pre_hook(lambda _m, a: fed.append(a[0].detach().clone()))
        loss = nn.functional.mse_loss(model(x), y)
        handle.remove()
        opt.zero_grad()
        loss.backward()
        grads.extend([x.grad.clone(), *(p.grad.clone() for p in model.parameters())])
        opt.step()
        losses.append(loss.detach())
    return losses, grads, fed


def test_recording_inside_autograd_leaves_losses_and_gradients_identical(tmp_path: Path) -> None:
    ref_losses, ref_grads, fed = train_steps(None)
    with tracediff.record(tmp_path / "s.zarr") as rec:
        losses, grads, _ = train_steps(rec)
        assert rec.enabled and rec.error is None
    assert_same_outputs(losses, ref_losses)
    assert_same_outputs(grads, ref_grads)
    # The rows are the values before ReLU overwrote them, and fc's output is the same tensor.
    expected = np.concatenate([f.numpy() for f in fed])
    assert_bits_equal(only_group(tmp_path / "s.zarr", "relu_in").values, expected)
    assert_bits_equal(only_group(tmp_path / "s.zarr", "fc_out").values, expected)


def test_a_buffer_first_used_under_inference_mode_is_reused_outside_it(tmp_path: Path) -> None:
    """An eval loop under ``inference_mode`` then a training step: the pooled copy buffer the eval
    capture made must not be an inference tensor (writing into one later raises)."""
    lin = stack()
    xs = [torch.randn(5, W) for _ in range(3)]
    store = tmp_path / "s.zarr"
    with tracediff.record(store) as rec:
        rec.tap(lin[0], "fc_in")
        with torch.inference_mode():
            lin(xs[0])
        wait_for(lambda: rec._queued_bytes == 0)  # written, and its buffer back in the pool
        lin(xs[1]).sum().backward()
        wait_for(lambda: rec._queued_bytes == 0)
        with torch.inference_mode():
            lin(xs[2])
        assert rec.enabled and rec.stats()["fc_in"]["error"] is None
    assert_bits_equal(only_group(store, "fc_in").values, np.concatenate([x.numpy() for x in xs]))


# ------------------------------------------------------------------------------- label providers
def test_a_label_provider_that_raises_stops_only_its_tap_and_counts_what_it_lost(tmp_path: Path, caplog) -> None:
    lin = stack()
    xs = [torch.randn(n, W) for n in (3, 4, 5, 6)]
    reference = [lin(x) for x in xs]

    def provider(_mod, _args, _kwargs, tensor):
        provider.calls += 1
        if provider.calls == 2:
            raise KeyError("no request id in this batch")
        return {"seq": 7}

    provider.calls = 0
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(lin[0], "fc_in", labels=provider)
        rec.tap(lin[2], "fc2_in")
        outputs = [lin(x) for x in xs]
        assert rec.enabled and rec.error is None  # the recorder and its other taps go on
    assert_same_outputs(outputs, reference)
    failed = only_group(tmp_path / "s.zarr", "fc_in")
    assert failed.commit["status"] == "failed" and "no request id" in failed.commit["error"]
    assert failed.rows == 3 and set(failed.labels["seq"]) == {7}  # the batch committed before stays
    assert (failed.commit["dropped_rows"], failed.commit["dropped_batches"]) == (4 + 5 + 6, 3)
    other = only_group(tmp_path / "s.zarr", "fc2_in")
    assert other.commit["status"] == "closed" and other.rows == 18
    (line,) = tracediff_lines(caplog)
    assert "'fc_in'" in line and "label provider" in line and "no request id" in line


def test_a_label_field_of_the_wrong_type_stops_its_tap_naming_the_field(tmp_path: Path, caplog) -> None:
    lin = stack()
    xs = [torch.randn(3, W) for _ in range(3)]
    reference = [lin(x) for x in xs]
    provider = lambda _m, _a, _k, _t: {"position": "first"}  # noqa: E731
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(lin[0], "fc_in", labels=provider)
        outputs = [lin(x) for x in xs]
    assert_same_outputs(outputs, reference)
    (line,) = tracediff_lines(caplog)
    assert "'fc_in'" in line and "'position'" in line and "numeric" in line
    assert rec.stats()["fc_in"]["dropped_rows"] == 9


# ---------------------------------------------------------------------------------- writer thread
def committed(store: Path, writer: str, tap: str = "fc_in") -> int:
    try:
        return int(writer_json(store, tap, writer)["batches"])
    except FileNotFoundError:
        return 0


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.mark.parametrize(
    "fault",
    [RuntimeError("codec exploded\n  while encoding chunk 3"), SystemExit(3)],
    ids=["runtime_error", "system_exit"],
)
@pytest.mark.parametrize("on_full", ["drop", "block"])
def test_an_exception_in_the_writer_thread_keeps_committed_rows_and_is_logged_once(
    tmp_path: Path, caplog, monkeypatch: pytest.MonkeyPatch, fault: BaseException, on_full: str
) -> None:
    real_append = TraceWriter.append

    def append(self: TraceWriter, values: np.ndarray, labels: dict[str, Any]) -> None:
        if self.counts.batches == 2:
            raise fault
        real_append(self, values, labels)

    monkeypatch.setattr(TraceWriter, "append", append)
    lin = stack()
    xs = [torch.randn(n, W) for n in (2, 3, 4, 5, 6)]
    reference = [lin(x) for x in xs]
    store = tmp_path / "s.zarr"
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(store, on_full=on_full, max_queue_batches=2, block_timeout=60) as rec:
        rec.tap(lin[0], "fc_in")
        outputs = []
        for x in xs:
            outputs.append(lin(x))
            if len(outputs) == 2:
                wait_for(lambda: committed(store, rec.writer_name) == 2)
    assert_same_outputs(outputs, reference)
    assert not rec.enabled and rec.error is not None
    group = only_group(store, "fc_in")
    assert group.commit["status"] == "failed" and group.rows == 5 and group.commit["batches"] == 2
    assert_bits_equal(group.values, np.concatenate([x.numpy() for x in xs[:2]]))
    assert (group.commit["dropped_rows"], group.commit["dropped_batches"]) == (4 + 5 + 6, 3)
    (line,) = tracediff_lines(caplog)
    assert "'fc_in'" in line and type(fault).__name__ in line
    assert "codec exploded while encoding chunk 3" in group.commit["error"] or isinstance(fault, SystemExit)


# ------------------------------------------------------------------------------------------ close()
def test_close_twice_is_harmless_and_later_forwards_are_untouched(tmp_path: Path) -> None:
    lin = stack()
    xs = [torch.randn(3, W) for _ in range(4)]
    reference = [lin(x) for x in xs]
    rec = tracediff.record(tmp_path / "s.zarr")
    rec.tap(lin[0], "fc_in")
    outputs = [lin(x) for x in xs[:2]]
    rec.close()
    rec.close()
    outputs += [lin(x) for x in xs[2:]]
    rec.close()
    assert_same_outputs(outputs, reference)
    group = only_group(tmp_path / "s.zarr", "fc_in")
    assert group.commit["status"] == "closed" and group.rows == 6 and group.commit["dropped_rows"] == 0


def test_close_from_another_thread_returns_only_when_the_store_is_closed(tmp_path: Path, monkeypatch) -> None:
    """Two threads close at once while the writer is still busy: whichever returns second, the store
    is closed when it does (an early return would let a caller read a store still being written)."""
    real_append = TraceWriter.append

    def slow_append(self: TraceWriter, values: np.ndarray, labels: dict[str, Any]) -> None:
        time.sleep(0.05)
        real_append(self, values, labels)

    monkeypatch.setattr(TraceWriter, "append", slow_append)
    lin = stack()
    xs = [torch.randn(3, W) for _ in range(6)]
    store = tmp_path / "s.zarr"
    rec = tracediff.record(store)
    rec.tap(lin[0], "fc_in")
    for x in xs:
        lin(x)
    statuses: list[str] = []

    def close_and_look() -> None:
        rec.close()
        statuses.append(writer_json(store, "fc_in", rec.writer_name)["status"])

    threads = [threading.Thread(target=close_and_look) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert statuses == ["closed", "closed"]
    group = only_group(store, "fc_in")
    assert group.rows == 18 and group.commit["dropped_rows"] == 0


def test_close_racing_forwards_on_another_thread_leaves_whole_batches_and_the_host_untouched(tmp_path: Path) -> None:
    lin = stack()
    xs = [torch.randn(n % 7 + 1, W) for n in range(300)]
    reference = [lin(x) for x in xs]
    store = tmp_path / "s.zarr"
    rec = tracediff.record(store)
    rec.tap(lin[0], "fc_in")
    started = threading.Event()
    closer = threading.Thread(target=lambda: (started.wait(), rec.close()))
    closer.start()
    outputs = []
    for i, x in enumerate(xs):
        if i == 50:
            started.set()  # close lands somewhere in the next forwards
        outputs.append(lin(x))
    closer.join(60)
    assert_same_outputs(outputs, reference)
    group = only_group(store, "fc_in")
    assert group.commit["status"] == "closed"
    # Whatever was captured before the hooks went is stored whole and in order: a prefix of the feed.
    sizes = np.cumsum([0] + [x.shape[0] for x in xs])
    assert group.rows in set(sizes.tolist()) and group.rows >= sizes[50]
    assert_bits_equal(group.values, np.concatenate([x.numpy() for x in xs])[: group.rows])
    assert (
        group.labels["step"].tolist() == np.repeat(np.arange(len(xs)), [x.shape[0] for x in xs])[: group.rows].tolist()
    )


@pytest.mark.parametrize(
    ("layout", "field"),
    [({"segment_size": 7}, "segment_size"), ({"segment_size": 8, "segment_labels": ["a", "b"]}, "segment_labels")],
)
def test_a_segment_layout_that_does_not_fit_the_width_is_dropped_and_the_rows_kept(
    tmp_path: Path, caplog, layout: dict[str, Any], field: str
) -> None:
    """Readers refuse a segment layout that does not fit the width; the recorder stores the rows
    without it (one warning naming the tap and the field) rather than a store nobody can open."""
    act = nn.GELU()
    feeds = [torch.randn(3, W), torch.randn(2, W)]
    caplog.set_level(logging.WARNING, logger="tracediff")
    with tracediff.record(tmp_path / "s.zarr") as rec:
        rec.tap(act, "probe", **layout)
        outputs = [act(x) for x in feeds]
    assert_same_outputs(outputs, [act(x) for x in feeds])
    group = only_group(tmp_path / "s.zarr", "probe")
    assert_bits_equal(group.values, np.concatenate([stored_bits(x) for x in feeds]))
    assert group.commit["status"] == "closed"
    (warning,) = tracediff_lines(caplog)
    assert "'probe'" in warning and field in warning
    with TraceStore(tmp_path / "s.zarr") as opened:  # the store opens: no layout that misfits
        (stream,) = opened.streams["probe"]
        assert stream.rows == 5 and stream.segment_labels is None
