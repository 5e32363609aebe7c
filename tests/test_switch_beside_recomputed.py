"""A transformers model's own checkpointing switch is not advised over layers the step recomputes already.

A trial's tiny ViT (4 layers, bf16-mixed on the CPU) trained with the plan ``predict(memory_budget=...)`` printed
(layer 0 in a ``Checkpointed`` wrapper, layer 1 in a ``SelectivelyCheckpointed`` one) was advised
``model.activation_checkpointing_enable()`` over ``model.vit.layers.0.block, model.vit.layers.1.block and
model.vit.layers.2-3``: applied, layer 0 was checkpointed inside its wrapper again (recomputed twice in backward)
and layer 1's selective plan was checkpointed whole, which docs/advice.md says no advice does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import loader, trainer
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.records import CheckpointSwitch, ModuleProfile

MIB = 1 << 20
LAYERS = "model.vit.layers"


def _profiles() -> tuple[ModuleProfile, ...]:
    """Layers 0 and 1 in an applied plan's wrappers (each keeps its 1 MiB input); layers 2 and 3 save 10 MiB each."""
    return (
        ModuleProfile("model", "ViTForImageClassification", 0, input_bytes=MIB),
        ModuleProfile(f"{LAYERS}.0", "Checkpointed", MIB, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.0.block", "ViTLayer", 0, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.1", "SelectivelyCheckpointed", 4 * MIB, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.1.block", "ViTLayer", 0, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.2", "ViTLayer", 10 * MIB, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.3", "ViTLayer", 10 * MIB, input_bytes=MIB, output_bytes=MIB),
    )


SWITCH = CheckpointSwitch(
    "model",
    "activation_checkpointing_enable",
    (f"{LAYERS}.0.block", f"{LAYERS}.1.block", f"{LAYERS}.2", f"{LAYERS}.3"),
)
RECOMPUTED = (f"{LAYERS}.0.block", f"{LAYERS}.1.block")


def test_the_switch_is_not_offered_over_layers_recomputed_already() -> None:
    plans = checkpoint_candidates(_profiles(), (SWITCH,), checkpointed=RECOMPUTED)
    assert plans, "layers 2 and 3 are still worth checkpointing"
    assert all(plan.switch is None for plan in plans), [plan.switch for plan in plans]
    for plan in plans:
        for unit in plan.units:
            assert not any(name.startswith((f"{LAYERS}.0", f"{LAYERS}.1")) for name in unit), plan.units
    assert any(set(plan.units) == {(f"{LAYERS}.2",), (f"{LAYERS}.3",)} for plan in plans), [p.units for p in plans]


def test_the_switch_is_offered_where_nothing_is_recomputed() -> None:
    # The user's idiom stays the advice on a model without checkpointing.
    kept = [profile for profile in _profiles() if profile.name in ("model", f"{LAYERS}.2", f"{LAYERS}.3")]
    plain = (
        kept[0],
        ModuleProfile(f"{LAYERS}.0", "ViTLayer", 10 * MIB, input_bytes=MIB, output_bytes=MIB),
        ModuleProfile(f"{LAYERS}.1", "ViTLayer", 10 * MIB, input_bytes=MIB, output_bytes=MIB),
        *kept[1:],
    )
    switch = CheckpointSwitch("model", "activation_checkpointing_enable", tuple(f"{LAYERS}.{i}" for i in range(4)))
    (plan,) = checkpoint_candidates(plain, (switch,))
    assert plan.switch == "activation_checkpointing_enable"


class _Recomputed(nn.Module):
    """A layer run under ``torch.utils.checkpoint`` (the user's own checkpointing, as an applied plan's wrapper)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


class _ViT(pl.LightningModule):
    """A 4-layer ViT from its config (nothing downloaded), layers 0 and 1 checkpointed by the user already."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, image_size=32,
            patch_size=4, num_labels=10, attn_implementation="eager",
        )  # fmt: skip
        self.model = ViTForImageClassification(config)
        layers = self.model.vit.layers
        for index in (0, 1):
            layers[index] = _Recomputed(layers[index])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss: Tensor = self.model(pixel_values=batch[0], labels=batch[1]).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.replay  # the advice is chosen among replayed plans
def test_a_vit_with_two_layers_recomputed_is_not_advised_its_switch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = _ViT()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(96, 3, 32, 32, generator=generator), torch.randint(0, 10, (96,), generator=generator)
    )
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(data, 32))
    assert monitor.report is not None
    assert sorted(monitor.report.recomputed_units or ()) == [(f"{LAYERS}.0.block",), (f"{LAYERS}.1.block",)]
    advice = next(item for item in monitor.report.advice if item.id == "activation-checkpointing")
    # Before: "Checkpoint every layer of `model` (model.vit.layers.0.block, model.vit.layers.1.block and
    # model.vit.layers.2-3) with its own switch", and the code called model.activation_checkpointing_enable().
    assert "activation_checkpointing_enable" not in advice.detail, advice.title
    assert ".0.block" not in advice.title and ".1.block" not in advice.title, advice.title
    assert advice.saving_basis == "simulated", advice.evidence
