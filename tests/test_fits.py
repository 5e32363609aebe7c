""" "Fits" on CUDA means the simulated caching allocator serves the whole step at the device's memory.

CPU replays with allocator settings given explicitly keep their allocation sequence; the oracle is the same
sequence run through :class:`CachingAllocatorModel` without a cap (its peak allocated and reserved bytes): at the
reserved peak the step is served, below the allocated peak it cannot be. The fit table's answer at a small
synthetic GPU is served, and the batch above it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram import predict
from lightning_vram.advice.preflight import preflight
from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.devices import COMMON_GPUS
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import (
    AllocationSequence,
    AllocatorReading,
    BatchSizeChange,
    FitRow,
    Phase,
    ReplayedStep,
    SavingBasis,
)
from lightning_vram.records.advice_json import fit_row_from_dict, fit_row_to_dict
from lightning_vram.render.text import preflight_warning

MIB = 1024**2
SETTINGS = {"defaults": AllocatorSettings(), "expandable": AllocatorSettings(expandable_segments=True)}


def _mlp() -> nn.Module:
    """Weights of 2 and 4 MiB, activations of 1.5 MiB at batch 384: both pools, large segments split."""
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _conv() -> nn.Module:
    """Activations of 8 MiB at batch 32 (16 channels of 64 x 64): requests over 10 MiB-segment rounding."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any]] = {
    "mlp": (_mlp, lambda: (torch.randn(384, 512), torch.randint(0, 10, (384,))), OPTIMIZERS["adam"]),
    "conv-batchnorm": (
        _conv,
        lambda: (torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))),
        OPTIMIZERS["sgd_momentum"],
    ),
}


def _predictor(name: str, settings: AllocatorSettings) -> Predictor:
    build, data, optimizer = MODELS[name]
    torch.manual_seed(0)
    return Predictor(Classifier(build(), optimizer), None, data(), warm_up=True, allocator=settings)


def _uncapped(allocations: AllocationSequence, settings: AllocatorSettings) -> tuple[int, int]:
    """The oracle: the sequence through an uncapped model, its peak allocated and reserved bytes."""
    model = CachingAllocatorModel(settings)
    for event in allocations:
        if isinstance(event, Phase):
            continue
        if event[0] == "malloc":
            model.malloc(event[1], event[2], event[3])
        else:
            model.free(event[1])
    return model.peak_allocated_bytes, model.peak_reserved_bytes


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_step_is_served_at_its_reserved_peak_and_not_below_its_allocated_peak(name: str, setting: str) -> None:
    settings = SETTINGS[setting]
    with round_of_replays():
        step = _predictor(name, settings).baseline()
    assert isinstance(step, ReplayedStep) and step.allocations is not None
    allocated, reserved = _uncapped(step.allocations, settings)
    # The sequence is the one the phases' reserved peaks came from.
    assert reserved == max(peak.reserved_bytes or 0 for peak in step.phases.values())
    assert allocated >= 8 * MIB and reserved >= allocated
    at_peak = serve(step.allocations, settings, reserved)
    assert at_peak.served and at_peak.reserved_peak_bytes == reserved
    short = serve(step.allocations, settings, allocated - 512)
    assert not short.served and short.shortfall is not None
    assert short.reserved_peak_bytes <= allocated - 512
    assert short.shortfall.reserved_bytes + short.shortfall.allocation_bytes > allocated - 512  # the cap refused it
    # What the replay cannot see, held through backward, takes the room the step had at its reserved peak.
    unseen = serve(step.allocations, settings, reserved, {Phase.BACKWARD: reserved})
    assert not unseen.served and unseen.shortfall is not None and unseen.shortfall.phase is Phase.BACKWARD


@pytest.mark.parametrize("name", list(MODELS))
def test_the_fit_tables_batch_is_served_at_a_small_gpu_and_the_next_is_not(name: str) -> None:
    settings = SETTINGS["defaults"]
    predictor = _predictor(name, settings)
    with round_of_replays():
        own = predictor.baseline()
        assert isinstance(own, ReplayedStep) and own.batch_size is not None and own.allocations is not None
        _, reserved = _uncapped(own.allocations, settings)
        context = 64 * MIB
        capacity = context + 3 * reserved  # room for about three times the run's batch, no margin
        search = predictor.fit_table(context, gpus=[("tiny", capacity)], known_steps={own.batch_size: own})
        assert search.missing is None
        (row,) = search.found
        assert row.allocator == "" and row.basis is SavingBasis.SIMULATED and not row.at_least
        assert own.batch_size < row.max_batch_size
        expandable = row.expandable_max_batch_size
        assert expandable is not None
        for batch, with_settings in ((row.max_batch_size, settings), (expandable, SETTINGS["expandable"])):
            served = predictor.replay(BatchSizeChange(batch))
            above = predictor.replay(BatchSizeChange(batch + 1))
            assert isinstance(served, ReplayedStep) and isinstance(above, ReplayedStep)
            assert served.allocations is not None and above.allocations is not None
            assert serve(served.allocations, with_settings, capacity - context).served
            assert not serve(above.allocations, with_settings, capacity - context).served


def test_a_fit_row_round_trips_its_allocator_fields_and_reads_without_them() -> None:
    row = FitRow("H200", 150_109_208_576, 150, SavingBasis.SIMULATED, allocator="", expandable_max_batch_size=162)
    written = fit_row_to_dict(row)
    assert written["allocator"] == "" and written["expandable_max_batch_size"] == 162
    assert fit_row_from_dict(written, "fit[0]") == row
    old = {key: value for key, value in written.items() if key not in ("allocator", "expandable_max_batch_size")}
    read = fit_row_from_dict(old, "fit[0]")
    assert read.allocator is None and read.expandable_max_batch_size is None
    assert read.max_batch_size == 150 and read.expandable_text == "n/a"


def test_preflight_does_not_offer_a_change_whose_tensors_fit_but_whose_reserved_memory_does_not() -> None:
    """H200's "batch size 80: peak 128.15 GiB (fits)": the halved batch's tensors fit the free memory, the memory
    the allocator reserves around them does not, so it is listed as still short, not as a fix."""
    settings = SETTINGS["defaults"]
    predictor = _predictor("conv-batchnorm", settings)
    with round_of_replays():
        half = predictor.replay(BatchSizeChange(16))
    assert isinstance(half, ReplayedStep) and half.allocations is not None
    allocated, reserved = _uncapped(half.allocations, settings)
    assert reserved > allocated + 2 * MIB  # the holes around the tensors
    # Nothing is allocated yet: the device's free memory is all the allocator may hold. The tensor peak of the
    # halved batch fits it; its reserved peak does not, and at this capacity it is not served.
    free = allocated + MIB
    assert not serve(half.allocations, settings, free).served
    verdict = preflight(
        _predictor("conv-batchnorm", settings),
        reading=AllocatorReading(0, 0, 0, 0),
        free_bytes=free,
        changes=[BatchSizeChange(16)],
    )
    assert not isinstance(verdict, str)
    assert verdict.served is False and not verdict.fits and verdict.shortfall is not None
    (remedy,) = verdict.remedies
    assert remedy.peak_bytes <= verdict.available_bytes  # the tensors alone would have been called a fit
    assert remedy.served is False and remedy.reserved_peak_bytes is not None
    assert not verdict.remedy_fits(remedy)
    warning = preflight_warning(verdict, "tiny GPU")
    assert "No replayed change makes it fit." in warning
    assert "still do not fit: batch size 16" in warning and "reserved" in warning
    # At the halved batch's reserved peak it is served, and offered as the fix.
    roomy = preflight(
        _predictor("conv-batchnorm", settings),
        reading=AllocatorReading(0, 0, 0, 0),
        free_bytes=reserved,
        changes=[BatchSizeChange(16)],
    )
    assert not isinstance(roomy, str) and not roomy.fits
    assert [remedy.served for remedy in roomy.remedies] == [True]
    assert "Replayed changes that fit, largest saving first: batch size 16" in preflight_warning(roomy, "tiny GPU")


def test_predict_for_cuda_gives_each_row_served_with_the_runs_settings_and_with_expandable_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    context = 512 * MIB
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    module = Classifier(nn.Sequential(nn.Linear(64, 65536), nn.ReLU(), nn.Linear(65536, 10)), OPTIMIZERS["adam"])
    prediction = predict(module, batch, cuda_context_bytes=context)
    assert len(prediction.fit) == len(COMMON_GPUS)
    assert all(row.allocator == "" and row.expandable_max_batch_size is not None for row in prediction.fit)
    first = prediction.fit[0]  # 12 GiB
    assert first.expandable_max_batch_size is not None and not first.at_least
    predictor = Predictor(module, None, batch, warm_up=True, allocator=SETTINGS["defaults"], for_cuda=True)
    with round_of_replays():
        for largest, settings in ((first.max_batch_size, "defaults"), (first.expandable_max_batch_size, "expandable")):
            served, above = (predictor.replay(BatchSizeChange(size)) for size in (largest, largest + 1))
            assert isinstance(served, ReplayedStep) and isinstance(above, ReplayedStep)
            assert served.allocations is not None and above.allocations is not None
            assert serve(served.allocations, SETTINGS[settings], first.capacity_bytes - context).served
            assert not serve(above.allocations, SETTINGS[settings], first.capacity_bytes - context).served
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    (row, *_) = predict(module, batch, cuda_context_bytes=context).fit
    assert row.allocator == "expandable_segments:True" and row.expandable_max_batch_size == row.max_batch_size
    assert row.max_batch_size == first.expandable_max_batch_size
