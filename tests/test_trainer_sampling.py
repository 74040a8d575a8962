"""``--sample-requests`` with the trainer adapters on real speculators and SpecForge training steps (CPU):
a trainer sample does not say where its prompt ends, so each sample is decided by the token ids its
rows carry, and docs/recording.md says which ids of the dataset sample those are: speculators
``input_ids[1:-1]``, SpecForge ``input_ids[1:]``. ``tracediff.sampled`` on those ids picks exactly
the samples recorded."""

from __future__ import annotations

from pathlib import Path

from conftest import skip_unless_installed

skip_unless_installed("speculators", reason="speculators is not installed (requirements/frameworks-trainers.sh)")
skip_unless_installed("specforge", reason="specforge is not installed (requirements/frameworks-trainers.sh)")

import torch  # noqa: E402
import trainer_runs as tr  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import tracediff  # noqa: E402
from tracediff.record.sampling import prompt_hash  # noqa: E402
from tracediff.store import TraceStore  # noqa: E402


def _rate_between(hashed: list[list[int]]) -> float:
    """A rate that chooses some of the samples and not others (there are three)."""
    points = sorted(prompt_hash(ids) for ids in hashed)
    return (points[0] + points[-1]) / 2


def _recorded(store: Path) -> dict[int, list[int]]:
    """Per recorded sample (seq): its known token ids in row order (valid rows)."""
    with TraceStore(store) as st:
        (stream,) = st.streams["fc_in"]
        lab = stream.labels(("seq", "token_id", "valid"))
    out: dict[int, list[int]] = {}
    for seq, token, valid in zip(lab["seq"].tolist(), lab["token_id"].tolist(), lab["valid"].tolist(), strict=True):
        if valid and token >= 0:
            out.setdefault(seq, []).append(token)
    return out


def test_speculators_samples_are_chosen_by_their_input_ids_without_the_first_and_last(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tr.write_speculators_data(data)
    samples = [load_file(data / "hidden_states" / f"hs_{s}.safetensors")["token_ids"].tolist()
               for s in range(len(tr.SPECULATORS_LENGTHS))]
    hashed = [ids[1:-1] for ids in samples]
    rate = _rate_between(hashed)
    model = tr.build_speculators_draft()
    store = tmp_path / "train.zarr"
    with tracediff.record(store, role="trainer", adapter="speculators", sample_requests=rate) as rec:
        tr.train_speculators(model, tr.speculators_batches(data))
    assert rec.error is None
    got = sorted(_recorded(store).values())
    assert got == sorted(ids for ids in hashed if tracediff.sampled(ids, rate))
    assert 0 < len(got) < len(samples)


def test_specforge_samples_are_chosen_by_their_input_ids_without_the_first(tmp_path: Path) -> None:
    tr.install_cpu_loss()
    import specforge.algorithms.eagle3.model  # noqa: F401, PLC0415

    data = tmp_path / "data"
    tr.write_specforge_data(data)
    samples = [torch.load(data / "hidden_states" / "rows_0-5000" / f"data_{s}.ckpt", weights_only=True)
               ["input_ids"].tolist() for s in range(len(tr.SPECFORGE_LENGTHS))]
    hashed = [ids[1:] for ids in samples]
    rate = _rate_between(hashed)
    batches = tr.specforge_batches(data)
    store = tmp_path / "train.zarr"
    with tracediff.record(store, role="trainer", adapter="specforge", sample_requests=rate) as rec:
        strategy, _model, draft = tr.build_specforge(data)
        tr.train_specforge(strategy, draft, batches)
    assert rec.error is None
    got = sorted(_recorded(store).values())
    assert got == sorted(ids for ids in hashed if tracediff.sampled(ids, rate))
    assert 0 < len(got) < len(samples)

