"""Attribution against exact oracles: byte counts worked out by hand or counted independently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import (
    FLOAT32,
    NETWORKS,
    OPTIMIZERS,
    PARAMETER_COUNTS,
    Classifier,
    dataset_for,
    loader,
    saved_storage_bytes,
    trainer,
)
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.ledgers import ActivationLedger
from lightning_vram.measure.storages import gradient_storages, optimizer_state_storages, parameter_storages
from lightning_vram.records import Phase

# (multiple of the parameter bytes, 4-byte `step` tensors per parameter tensor) per optimizer (DOMAIN.md).
OPTIMIZER_STATE_SHAPE = {
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
    "adam": (2, 1),
    "adamw": (2, 1),
    "adagrad": (1, 1),
}


def reference_saved_bytes(module: Classifier, batch: Any) -> int:
    """Bytes autograd saves in one training_step, counted directly: unique storages, parameters excluded."""
    return saved_storage_bytes(lambda: module.training_step(batch, 0), exclude=list(module.parameters()))


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("network_name", list(NETWORKS))
def test_forward_breakdown_matches_hand_counts(tmp_path: Path, network_name: str, optimizer_name: str) -> None:
    torch.manual_seed(0)
    module = Classifier(NETWORKS[network_name](), OPTIMIZERS[optimizer_name])
    data = dataset_for(network_name)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=3)
    fit.fit(module, loader(data))

    assert monitor.report is not None
    forward = monitor.report.phases[Phase.FORWARD]
    assert forward.step == 1
    breakdown = forward.breakdown
    assert breakdown is not None
    parameter_bytes = PARAMETER_COUNTS[network_name] * FLOAT32
    assert breakdown.parameters == parameter_bytes
    # Lightning zeroes gradients after training_step: step 0's gradients are alive during step 1's forward.
    assert breakdown.gradients == parameter_bytes
    # The optimizer's own tensors, summed directly.
    optimizer = fit.optimizers[0]
    own_state = sum(
        t.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    assert breakdown.optimizer_state == own_state
    multiple, step_tensors = OPTIMIZER_STATE_SHAPE[optimizer_name]
    parameter_tensors = len(list(module.parameters()))
    assert own_state == multiple * parameter_bytes + step_tensors * parameter_tensors * FLOAT32
    # Activations: an independent count of the tensors saved for backward in one step of the same shape.
    assert breakdown.activations == reference_saved_bytes(module, next(iter(loader(data))))
    # CPU: the peak is every tensor alive (the batch, the logits, temporaries); the counted parts explain it, "other"
    # the rest (tests/test_live_peak.py checks the live peak against torch's MemTracker).
    assert breakdown.other is not None and breakdown.other > 0
    assert forward.peak_bytes == breakdown.counted_bytes + breakdown.other


def test_backward_phase_holds_activations_then_gradients(tmp_path: Path) -> None:
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.Sigmoid(), nn.Linear(256, 10)), OPTIMIZERS["adam"])
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=2).fit(module, loader(dataset_for_width(64), batch_size=32))
    assert monitor.report is not None
    forward = monitor.report.phases[Phase.FORWARD].breakdown
    backward = monitor.report.phases[Phase.BACKWARD].breakdown
    optimizer = monitor.report.phases[Phase.OPTIMIZER].breakdown
    assert forward is not None and backward is not None and optimizer is not None
    parameter_bytes = (64 * 256 + 256 + 256 * 10 + 10) * FLOAT32
    # zero_grad(set_to_none=True) ran before backward: at its start all activations are alive and no gradient.
    assert backward.activations + backward.gradients >= forward.activations
    assert backward.activations <= forward.activations
    assert 0 < backward.gradients <= parameter_bytes
    # After the update: every gradient, Adam's two moments (+ step counters), no activations left.
    assert optimizer.gradients == parameter_bytes
    assert optimizer.optimizer_state == 2 * parameter_bytes + 4 * FLOAT32
    assert optimizer.activations == 0
    assert monitor.report.recomputed_units == ()  # no activation checkpointing: nothing re-ran in backward


def dataset_for_width(width: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(64, width, generator=generator), torch.randint(0, 10, (64,)))


def test_tied_weights_and_views_count_once() -> None:
    embedding = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = embedding.weight  # tied
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    storages = parameter_storages(model, torch.device("cpu"))
    assert sum(storages.values()) == 100 * 8 * FLOAT32
    embedding.weight.grad = torch.zeros(100, 8)
    assert sum(gradient_storages(model, torch.device("cpu")).values()) == 100 * 8 * FLOAT32


def test_optimizer_state_on_another_device_is_not_counted() -> None:
    parameter = nn.Parameter(torch.zeros(10))
    optimizer = torch.optim.Adam([parameter])
    parameter.grad = torch.ones(10)
    optimizer.step()
    on_cpu = optimizer_state_storages([optimizer], torch.device("cpu"), exclude=())
    assert sum(on_cpu.values()) == 2 * 10 * FLOAT32 + FLOAT32
    on_meta = optimizer_state_storages([optimizer], torch.device("meta"), exclude=())
    assert on_meta == {}


def test_activation_ledger_counts_a_storage_once_until_its_last_reference_goes() -> None:
    ledger = ActivationLedger()
    ledger.acquire(1, 100, "a")
    ledger.acquire(1, 100, "b")
    ledger.acquire(2, 50, "b")
    assert (ledger.live_bytes, ledger.peak_live_bytes) == (150, 150)
    assert ledger.saved_bytes_by_module == {"a": 100, "b": 50}
    ledger.release(1)
    assert ledger.live_bytes == 150
    ledger.release(1)
    ledger.release(2)
    assert (ledger.live_bytes, ledger.peak_live_bytes) == (0, 150)


def test_inplace_would_break_backward_where_the_input_was_saved() -> None:
    network = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.ReLU())  # sigmoid saves its output
    attributor = StepAttributor(0, network, [], torch.device("cpu"))
    attributor.begin_forward()
    try:
        network(torch.randn(2, 4)).sum()
    finally:
        attributor.close()
    relu = next(profile for profile in attributor.finish().modules if profile.name == "2")
    assert (relu.inplace, relu.input_saved_for_backward) == (False, True)


def test_module_table_names_the_module_that_saved_each_tensor() -> None:
    network = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    attributor = StepAttributor(0, network, [], torch.device("cpu"))
    inputs = torch.randn(8, 16)
    attributor.begin_forward()
    loss = network(inputs).square().sum()
    attributor.before_backward()
    loss.backward()
    attribution = attributor.finish()
    by_name = {row.name: row for row in attribution.modules}
    # Linear 0 saves its input (8x16); ReLU saves its output (8x32), which Linear 2 saves again (counted once);
    # the square saves the network's output (8x4) outside any module.
    assert by_name["0"].activation_bytes == 8 * 16 * FLOAT32
    assert by_name["1"].activation_bytes == 8 * 32 * FLOAT32
    assert by_name["1"].type == "ReLU"
    assert by_name["2"].activation_bytes == 0
    # What each module took and gave, and whether an inplace ReLU would have broken backward.
    assert (by_name["0"].input_bytes, by_name["0"].output_bytes) == (8 * 16 * FLOAT32, 8 * 32 * FLOAT32)
    assert (by_name["1"].inplace, by_name["1"].input_saved_for_backward) == (False, False)
    assert by_name["(root)"].input_bytes == 8 * 16 * FLOAT32
    assert [profile.name for profile in attribution.modules] == ["(root)", "0", "1", "2", "(training_step)"]
    assert by_name["(training_step)"].activation_bytes == 8 * 4 * FLOAT32
    assert attribution.phases[Phase.FORWARD].activations == (8 * 16 + 8 * 32 + 8 * 4) * FLOAT32
    with torch.autograd.graph.disable_saved_tensors_hooks("no hook may be left behind"):
        pass
