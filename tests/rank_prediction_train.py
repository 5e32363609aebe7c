"""One training run per rank on the CPU (gloo), measured by the monitor, for tests/test_rank_prediction_distributed.py:
``python tests/rank_prediction_train.py OUT_DIR WORLD_SIZE STRATEGY MODEL [ACCUMULATE [SAMPLED]]``.

STRATEGY is ``ddp`` or ``fsdp2`` (Lightning's ``ModelParallelStrategy``, the model's ``configure_model`` calling
``fully_shard``); MODEL is ``gpt`` (a 2-block GPT-2-class language model from a transformers config), ``cnn`` (the
quickstart's CNN), ``blocks``, ``resnet`` or ``head`` (:class:`WideHead`; these three under the plan's printed FSDP2
code). Two optimizer steps of ACCUMULATE micro-batches each (``accumulate_grad_batches``, 1 unless
given); one micro-batch sampled (the monitor counts a micro-batch as a step): SAMPLED, by default the last (the
second window's, with the optimizer step); replays off, the ranks only measure. A sampled micro-batch that does not
step ends the run (the monitor would sample its window's stepping one too, and the report's phases would be that
one's). Rank ``r`` writes ``rank<r>.json``: each phase's live peak and counted parts as its report has them, of each
live peak the bytes gloo's worker thread released late, and the peak without gloo's reduce-scatter clones (``Record``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from forked_ranks import lightning_ranks
from gloo_clones import peaks_without_gloo_clones
from late_releases import released_late_of
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor

VOCAB, LENGTH = 1000, 32
BATCH = {"gpt": 4, "cnn": 16, "blocks": 16, "resnet": 16, "head": 8}
"""Samples per rank and step."""


class TinyGPT(LightningModule):
    """A GPT-2-class language model (2 blocks of width 64), AdamW; each block and the model are FSDP2 units."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]

    def configure_model(self) -> None:
        if self.device_mesh is None:  # DDP
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def quickstart_cnn() -> nn.Sequential:
    """The quickstart's features (conv, BatchNorm, ReLU, pooling twice), Dropout, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


class QuickstartCNN(LightningModule):
    """The quickstart's CNN, Adam; each convolution and the head are FSDP2 units, then the network."""

    def __init__(self) -> None:
        super().__init__()
        self.network = quickstart_cnn()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.network(images), labels)

    def configure_model(self) -> None:
        if self.device_mesh is None:  # DDP
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.network:
            if isinstance(layer, nn.Conv2d | nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.network, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs + self.down(torch.relu(self.up(self.norm(inputs))))


class BlocksNet(nn.Module):
    """Blocks without an ``nn.ModuleList``: two as attributes, two in an ``nn.Sequential`` stage."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Linear(32, width)
        self.block1 = Block(width)
        self.block2 = Block(width)
        self.stage = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.block2(self.block1(self.stem(inputs)))))


class Blocks(LightningModule):
    """:class:`BlocksNet`, Adam; no ``configure_model``: planned under FSDP2's usual policy, trained under the code
    the plan prints for it (:func:`printed_code_applied`)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = BlocksNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self.model(inputs), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WideHead(LightningModule):
    """Two blocks and a wide head left in the root unit (the step calls ``self``), Adam: the root's reduce-scatter,
    the last of backward, is the largest unit's (270,336 bytes), where backward peaks; under the printed FSDP2 code."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(32), Block(32))
        self.head = nn.Linear(32, 2048)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(inputs))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self(inputs)[:, :10], labels)  # a view of the root's output, not returned

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Basic(nn.Module):
    """A ResNet basic block, a downsampling ``nn.Sequential`` of its own where it changes the width."""

    def __init__(self, into: int, out: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(into, out, 3, padding=1, bias=False), nn.BatchNorm2d(out)
        self.conv2, self.bn2 = nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(into, out, 1, bias=False), nn.BatchNorm2d(out)) if into != out else None
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        skip = inputs if self.downsample is None else self.downsample(inputs)
        return torch.relu(skip + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(inputs))))))


class ResNet(LightningModule):
    """torchvision's ResNet's layout (a stem, stages of blocks in ``nn.Sequential`` s, a head), SGD with momentum; no
    ``configure_model``: planned under FSDP2's usual policy, trained under the code the plan prints for it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(Basic(16, 16), Basic(16, 16))
        self.layer2 = nn.Sequential(Basic(16, 32), Basic(32, 32))
        self.fc = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(images)))))
        return self.fc(features.mean((2, 3)))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def printed_code_applied(module: LightningModule) -> LightningModule:
    """``module`` rebuilt (the same seed) as a class whose ``configure_model`` is the plan's printed FSDP2 code."""
    from lightning_vram.prediction.strategies.fsdp2 import usual_policy_code

    code = usual_policy_code(module)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    sharded = type(
        f"{type(module).__name__}Sharded", (type(module),), {"configure_model": namespace["configure_model"]}
    )
    torch.manual_seed(0)
    return sharded()  # type: ignore[no-any-return]


def model_named(name: str) -> LightningModule:
    torch.manual_seed(0)
    return {"gpt": TinyGPT, "cnn": QuickstartCNN, "blocks": Blocks, "resnet": ResNet, "head": WideHead}[name]()


def samples(name: str, count: int) -> TensorDataset:
    """``count`` samples of the model's data: token sequences, or 32x32 images with their classes."""
    generator = torch.Generator().manual_seed(0)
    if name == "gpt":
        return TensorDataset(torch.randint(0, VOCAB, (count, LENGTH), generator=generator))
    if name in ("blocks", "head"):
        return TensorDataset(torch.randn(count, 32, generator=generator), torch.randint(0, 10, (count,)))
    return TensorDataset(torch.randn(count, 3, 32, 32, generator=generator), torch.randint(0, 10, (count,)))


def one_batch(name: str) -> list[torch.Tensor]:
    """One rank's batch, as its DataLoader gives it."""
    return next(iter(DataLoader(samples(name, BATCH[name]), batch_size=BATCH[name])))  # type: ignore[no-any-return]


class Record(Callback):
    """After the monitor's own train-end hook, in each rank's process: its report's phases, of each phase's live peak
    the bytes gloo's worker thread released late (tests/late_releases.py), and each phase's highest live bytes less
    gloo's reduce-scatter clones alive at each instant (tests/gloo_clones.py)."""

    def __init__(self, out: Path, monitor: VramMonitor) -> None:
        self.out = out
        self.monitor = monitor
        self.late = released_late_of(monitor.session)
        self.without_clones = peaks_without_gloo_clones()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = self.monitor.report
        assert report is not None
        record = {
            phase.value: {
                "live peak": peak.peak_bytes,
                "released late": self.late.get(phase.value, 0),
                "without gloo's clones": self.without_clones.get(phase.value, peak.peak_bytes),
                "parameters": b.parameters,
                "gradients": b.gradients,
                "optimizer_state": b.optimizer_state,
                "activations": b.activations,
            }
            for phase, peak in report.phases.items()
            if (b := peak.breakdown) is not None
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class StopAfter(Callback):
    """After the monitor's own batch-end hook: stop the run once batch ``step`` (0-based, one epoch) has ended."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.step:
            trainer.should_stop = True


def strategy_named(name: str, world_size: int) -> Strategy | str:
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    return name


def main() -> None:
    out, world_size, strategy, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    accumulate = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    sampled = int(sys.argv[6]) if len(sys.argv) > 6 else 2 * accumulate - 1
    torch.set_num_threads(1)
    monitor = VramMonitor(
        attribution_start_step=sampled, attribution_every_n_steps=None, console_summary=False, replay_budget_seconds=0
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy_named(strategy, world_size),
        max_steps=2,
        accumulate_grad_batches=accumulate,
        logger=False,
        default_root_dir=out,
        callbacks=[monitor, Record(out, monitor), *([StopAfter(sampled)] if (sampled + 1) % accumulate else [])],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    dataset = samples(name, 2 * accumulate * BATCH[name] * world_size)
    module = model_named(name)
    if name in ("blocks", "resnet", "head") and strategy == "fsdp2":
        module = printed_code_applied(module)
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH[name]))


if __name__ == "__main__":
    lightning_ranks(main, int(sys.argv[2]), ("deepspeed",) if sys.argv[3].startswith("deepspeed") else ())
