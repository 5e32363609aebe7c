"""Advice that fits the run it is given to: nothing to shard on one device, SGD offered to a language model with a
word on convergence."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from advice_summaries import CPU, GIB, HEALTHY_BREAKDOWN, MIB, healthy_setup, healthy_summary, peak
from torch import nn

from lightning_vram.advice.rules.near_capacity import near_capacity
from lightning_vram.advice.rules.optimizer_state import optimizer_state
from lightning_vram.measure.setup import language_model, training_setup
from lightning_vram.records import Breakdown, Phase, RunSummary

STATE_HEAVY = replace(HEALTHY_BREAKDOWN, optimizer_state=4 * GIB, activations=GIB, other=GIB)


def near_capacity_summary() -> RunSummary:
    # 15 GiB of a 16 GiB device, the optimizer state the largest part.
    full = Breakdown(parameters=2 * GIB, gradients=2 * GIB, optimizer_state=6 * GIB, activations=4 * GIB, other=GIB)
    return healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full, reserved=15 * GIB + 256 * MIB))


def test_one_device_is_offered_no_sharding() -> None:
    # SGD with momentum on one process and one device: its state can only be sharded across devices it lacks.
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, STATE_HEAVY))
    assert optimizer_state(summary, healthy_setup(precision="32-true", visible_devices=1)) is None
    near = near_capacity(near_capacity_summary(), healthy_setup(precision="32-true", visible_devices=1))
    assert near is not None
    assert "optimizer-state" not in near.detail and "shard" not in near.detail.lower()
    assert "halve the batch to 16" in near.detail  # what applies on one device is still offered
    # Adam on one device: 8-bit Adam and SGD with momentum, no sharding.
    adam = optimizer_state(summary, healthy_setup(optimizers=("AdamW",), visible_devices=1))
    assert adam is not None and adam.estimated_saving_bytes == 3 * GIB
    assert "shard" not in (adam.title + adam.detail).lower() and "fsdp" not in adam.detail.lower()
    assert "one process on one device: nothing to shard across" in adam.evidence


def test_several_visible_devices_are_offered_sharding() -> None:
    # One process, but four GPUs visible: sharding across them keeps 1/4 of the state on each.
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, STATE_HEAVY))
    advice = optimizer_state(summary, healthy_setup(precision="32-true", visible_devices=4))
    assert advice is not None and advice.estimated_saving_bytes == 3 * GIB
    assert "shard it across 4 devices" in advice.detail and "devices=4)" in advice.detail
    near = near_capacity(near_capacity_summary(), healthy_setup(precision="32-true", visible_devices=4))
    assert near is not None and "optimizer-state: about 4.50 GiB (modelled)" in near.detail


def test_ddp_ranks_on_the_cpu_are_offered_the_sharding_lightning_takes_there() -> None:
    # Two DDP ranks on the CPU: Trainer(strategy="fsdp") raises "requires a GPU accelerator" there; FSDP2 under
    # ModelParallelStrategy trains on gloo ranks (tests/sharded_train.py). The advice names that, and prints no code
    # Lightning refuses.
    summary = healthy_summary(device=CPU, peak=peak(Phase.BACKWARD, 8 * GIB, STATE_HEAVY))
    advice = optimizer_state(summary, healthy_setup(optimizers=("AdamW",), world_size=2, strategy="DDPStrategy"))
    assert advice is not None and 'strategy="fsdp"' not in advice.detail and "```" not in advice.detail
    assert (
        "shard it across 2 devices (FSDP2: fully_shard in configure_model under Lightning's ModelParallelStrategy;"
        " its fsdp and deepspeed strategies refuse the cpu): saves 2.00 GiB" in advice.detail
    )


def test_visible_devices_read_from_torch() -> None:
    setup = training_setup(nn.Linear(2, 2), ())
    assert setup.visible_devices == torch.cuda.device_count()


class TinyLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.head = nn.Linear(8, 50)


def test_language_models_are_recognised() -> None:
    assert language_model(TinyLanguageModel()) == "attention modules (TransformerEncoderLayer)"
    assert language_model(nn.Sequential(nn.Embedding(512, 8), nn.Linear(8, 512))) == (
        "an embedding and a head over its 512 tokens (1)"
    )
    assert language_model(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))) is None  # a class embedding
    assert language_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 10))) is None
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    assert language_model(transformers.GPT2LMHeadModel(config)) == "a transformers model (GPT2LMHeadModel)"


def test_sgd_offered_to_a_language_model_says_it_changes_convergence() -> None:
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, STATE_HEAVY))
    setup = healthy_setup(optimizers=("AdamW",), language_model="attention modules (GPT2Attention)")
    advice = optimizer_state(summary, setup)
    assert advice is not None
    assert advice.estimated_saving_bytes == 3 * GIB  # the savings are the same; only the words differ
    assert "SGD with momentum" in advice.detail
    assert (
        "SGD changes convergence: this model looks like a transformer or language model (attention modules"
        " (GPT2Attention))"
    ) in advice.detail
    assert "What keeps Adam's update and still saves memory: 8-bit Adam" in advice.detail
    assert "faster, not smaller" in advice.detail  # fused AdamW is named for what it is, not as a saving
    assert "it looks like a language model: attention modules (GPT2Attention)" in advice.evidence
    # With devices to shard across, exact sharding is named as keeping Adam's update too.
    several = optimizer_state(summary, replace(setup, world_size=4))
    assert several is not None
    assert "or sharding the state across devices (FSDP, DeepSpeed ZeRO: exact)" in several.detail
    # A model that does not look like a language model: no word on convergence.
    plain = optimizer_state(summary, healthy_setup(optimizers=("AdamW",)))
    assert plain is not None and "convergence" not in plain.detail
