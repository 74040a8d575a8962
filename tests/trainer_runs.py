"""Tiny real training runs of speculators and SpecForge on CPU, for tests/test_adapters_trainers.py.

Imported both by the tests and by the scripts they run under ``tracediff record -- python``. The
frameworks' own classes and data pipelines do the work; what this module adds is only what a CPU
needs: tiny random configs, parameters speculators leaves uninitialised (NaN), eager / sdpa
attention, and a torch loss in place of SpecForge's Triton kernel (``install_cpu_loss``).

Offline files: speculators' ``hs_<i>.safetensors`` are written by vLLM's hidden-states connector,
which does not run here, so they are written with ``safetensors.torch.save_file`` in the documented
layout (``hidden_states [T, n_layers, H]``, ``token_ids [T]``); SpecForge's ``data_<i>.ckpt`` with
``torch.save`` of the dict its ``scripts/prepare_hidden_states.py`` saves (that script is not in the
wheel). Both are then read back by the frameworks' own readers (``ArrowDataset`` +
``FileTransfer``; ``load_feature_file`` + ``normalize_offline_sample``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import torch

HIDDEN = 32
VOCAB = 128
SPECULATORS_LAYER_IDS = [1, 2, 3]  # vLLM ids (= HF hidden_states indices) of the aux slots
SPECFORGE_LAYER_IDS = [0, 1, 2]  # SGLang config ids in the draft's nested eagle_config
SPECULATORS_LENGTHS = [10, 7, 12]  # tokens per sample; packs of (0, 1) then (2,)
SPECFORGE_LENGTHS = [9, 6, 11]  # tokens per sample; batches of (0, 1) then (2,)
MAX_LEN = 24


# ---------------------------------------------------------------------------------------- speculators
def write_speculators_data(folder: Path, seed: int = 0) -> None:
    """A preprocessed dataset (``datasets.save_to_disk``) with its ``hidden_states/hs_<i>.safetensors``."""
    from datasets import Dataset  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    (folder / "hidden_states").mkdir(parents=True, exist_ok=True)
    slots = len(SPECULATORS_LAYER_IDS) + 1  # the aux layers, then the verifier's last layer
    for i, length in enumerate(SPECULATORS_LENGTHS):
        tokens = torch.randint(0, VOCAB, (length,), generator=gen)
        states = torch.randn(length, slots, HIDDEN, generator=gen).to(torch.bfloat16)
        save_file({"hidden_states": states, "token_ids": tokens}, str(folder / "hidden_states" / f"hs_{i}.safetensors"))
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append([1] * length)
        rows["seq_len"].append(length)
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(folder))


def build_speculators_draft(seed: int = 0, **layer_config: Any) -> torch.nn.Module:
    """speculators' Eagle3DraftModel with a one-layer Llama decoder; ``layer_config``: more fields of
    that layer's config (``layer_types``, ``sliding_window``; ``vocab_size``: the target's vocabulary,
    which the draft's ``VOCAB`` then prunes)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: PLC0415
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: PLC0415
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: PLC0415
    from transformers import LlamaConfig  # noqa: PLC0415

    layer = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, **{"vocab_size": VOCAB, **layer_config})
    layer._attn_implementation = "sdpa"  # flex attention has no CPU backward
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=VOCAB,
        eagle_aux_hidden_state_layer_ids=list(SPECULATORS_LAYER_IDS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    with torch.no_grad():  # embeddings and heads start as NaN until the verifier's weights are loaded
        for param in model.parameters():
            if not torch.isfinite(param).all():
                param.normal_(0.0, 0.02)
    return model


def speculators_batches(folder: Path) -> list[dict[str, Any]]:
    """Packed batches from speculators' own reader and collate function (with ``shift_batch``)."""
    from speculators.models.eagle3 import shift_batch  # noqa: PLC0415
    from speculators.train.data import ArrowDataset, CollateFn  # noqa: PLC0415

    dataset = ArrowDataset(max_len=MAX_LEN, datapath=str(folder), on_missing="raise",
                           hidden_states_dtype=torch.float32)
    collate = CollateFn(max_len=MAX_LEN, hidden_size=HIDDEN, num_target_layers=len(SPECULATORS_LAYER_IDS),
                        dtype=torch.float32, preprocess=shift_batch)
    return [collate([dataset[0], dataset[1]]), collate([dataset[2]])]


def train_speculators(model: torch.nn.Module, batches: list[dict[str, Any]]) -> list[torch.Tensor]:
    """One optimizer step per batch, as speculators' Trainer runs it; returns what ``fc`` received."""
    from speculators.losses import resolve_loss_config  # noqa: PLC0415

    seen: list[torch.Tensor] = []
    handle = model.fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    loss_config = resolve_loss_config("kl_div", "eager")  # the default ("fused") needs Triton
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for batch in batches:
        _tokens, loss, _metrics = model(**batch, ttt_steps=2, ttt_step_loss_decay=1.0, loss_config=loss_config)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    handle.remove()
    return seen


# ------------------------------------------------------------------------------------------ SpecForge
def install_cpu_loss() -> None:
    """``specforge.core.loss`` imports Triton and launches a kernel: put a torch loss in its place."""
    if "specforge.core.loss" in sys.modules:
        return
    module = types.ModuleType("specforge.core.loss")

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(logits.float(), dim=-1)
            return -(position_mask * target_p * logp).sum(-1).mean()

    module.LogSoftmaxLoss = LogSoftmaxLoss  # type: ignore[attr-defined]
    sys.modules["specforge.core.loss"] = module


def write_specforge_data(folder: Path, seed: int = 1) -> None:
    """``rows_0-5000/data_<i>.ckpt`` as prepare_hidden_states.py saves them, and the target's config."""
    from transformers import LlamaConfig  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    (folder / "hidden_states" / "rows_0-5000").mkdir(parents=True, exist_ok=True)
    for i, length in enumerate(SPECFORGE_LENGTHS):
        torch.save(
            {
                "input_ids": torch.randint(0, VOCAB, (length,), generator=gen),
                "loss_mask": torch.ones(length, dtype=torch.long),
                "hidden_state": torch.randn(1, length, HIDDEN, generator=gen).to(torch.bfloat16),
                "aux_hidden_state": torch.randn(1, length, 3 * HIDDEN, generator=gen).to(torch.bfloat16),
            },
            folder / "hidden_states" / "rows_0-5000" / f"data_{i}.ckpt",
        )
    LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB).save_pretrained(folder / "target")


def build_specforge(folder: Path, seed: int = 0) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """(Eagle3TrainStrategy, OnlineEagle3Model, LlamaForCausalLMEagle3), bf16 like SpecForge trains."""
    install_cpu_loss()
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: PLC0415
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: PLC0415
    from specforge.modeling.target.target_head import TargetHead  # noqa: PLC0415
    from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: PLC0415
    from transformers import LlamaConfig  # noqa: PLC0415

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, draft_vocab_size=VOCAB,
                         eagle_config={"eagle_aux_hidden_state_layer_ids": list(SPECFORGE_LAYER_IDS)})
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").to(torch.bfloat16)
    model = OnlineEagle3Model(draft, length=2, attention_backend="sdpa")
    head = TargetHead(str(folder / "target")).to(torch.bfloat16)
    head.freeze_weights()
    return Eagle3TrainStrategy(model, target_head=head), model, draft


def specforge_batches(folder: Path) -> list[dict[str, torch.Tensor]]:
    """Batches from SpecForge's own offline reader, normaliser and collator."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: PLC0415
    from specforge.data.utils import DataCollatorWithPadding  # noqa: PLC0415
    from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: PLC0415

    files = [folder / "hidden_states" / "rows_0-5000" / f"data_{i}.ckpt" for i in range(len(SPECFORGE_LENGTHS))]
    features = [normalize_offline_sample(load_feature_file(str(f)), MAX_LEN) for f in files]
    collate = DataCollatorWithPadding()
    return [collate(features[:2]), collate(features[2:])]


def train_specforge(strategy: Any, draft: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """One optimizer step per batch through ``Eagle3TrainStrategy.forward_loss``; returns fc's inputs."""
    from specforge.runtime.contracts import TrainBatch  # noqa: PLC0415

    seen: list[torch.Tensor] = []
    handle = draft.fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    for i, batch in enumerate(batches):
        out = strategy.forward_loss(TrainBatch([f"s{i}"], "eagle3", batch, {"target_repr": "hidden_state"}))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    handle.remove()
    return seen
