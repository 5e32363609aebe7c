"""Models the advice tests apply advice to (a ResNet-style CNN, a tiny GPT, MLPs), their data, a plan applier, the
stale-gradients advice's printed callbacks."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import torch
from models import OPTIMIZERS, BasicBlock, OptimizerFactory
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram.prediction.replay.buffer_copies import checkpoint_keeping_buffers
from lightning_vram.records import Advice, CheckpointPlan


class ResNetStyle(nn.Module):
    """A torchvision-style ResNet: a stem whose ReLU is inplace, stages of basic blocks, pooling and a head."""

    def __init__(self, width: int = 8, blocks: int = 2, stages: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        for stage in range(1, stages + 1):
            self.add_module(f"layer{stage}", nn.Sequential(*(BasicBlock(width) for _ in range(blocks))))
        self.stages = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(inputs)))
        for stage in range(1, self.stages + 1):
            x = getattr(self, f"layer{stage}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


class DownsamplingBlock(nn.Module):
    """torchvision's basic block: conv-BN-ReLU(inplace)-conv-BN, the input added back through a strided 1x1 conv and
    BatchNorm where the block halves the resolution and widens the channels, ReLU(inplace)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample: nn.Module | None = None
        if stride != 1 or inputs != outputs:
            shortcut = nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)
            self.downsample = nn.Sequential(shortcut, nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)  # type: ignore[no-any-return]


class DownsamplingResNet(nn.Module):
    """A torchvision-style ResNet on small images: a stem (conv, BatchNorm, inplace ReLU), stages of basic blocks,
    each after the first halving the resolution and doubling the channels, global pooling and a linear head."""

    def __init__(self, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        inputs = width
        for stage, count in enumerate(blocks):
            outputs = width * 2**stage
            first = DownsamplingBlock(inputs, outputs, 1 if stage == 0 else 2)
            rest = [DownsamplingBlock(outputs, outputs, 1) for _ in range(count - 1)]
            self.add_module(f"layer{stage + 1}", nn.Sequential(first, *rest))
            inputs = outputs
        self.stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(inputs)))
        for stage in range(1, self.stages + 1):
            x = getattr(self, f"layer{stage}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


class ResidualBlocks(nn.Module):
    """A user's ResNet-style model in plain torch: a stem (conv, BatchNorm, inplace ReLU), four residual blocks with
    BatchNorm and inplace ReLUs, each an attribute of its own, global pooling and a linear head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.block1 = BasicBlock(width)
        self.block2 = BasicBlock(width)
        self.block3 = BasicBlock(width)
        self.block4 = BasicBlock(width)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(inputs)))
        x = self.block4(self.block3(self.block2(self.block1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: attention and an MLP, each added back to its input."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(x)
        x = x + self.attn(normed, normed, normed, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """GPT-2-like: an ``nn.ModuleList`` of blocks looped in this forward, and ``lm_head`` tied to ``wte``."""

    def __init__(self, vocab: int = 512, width: int = 32, layers: int = 4, context: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(TransformerBlock(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


class LanguageModel(pl.LightningModule):
    """Next-token prediction over ``(ids, targets)`` batches."""

    def __init__(self, network: nn.Module, optimizer: OptimizerFactory = OPTIMIZERS["sgd"]) -> None:
        super().__init__()
        self.network = network
        self.optimizer_factory = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self.network(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


class ChunkedLanguageModel(LanguageModel):
    """Next-token prediction with its loss computed by the chunked-loss advice's printed function."""

    def __init__(self, network: TinyGPT, chunked_cross_entropy: Any, optimizer: OptimizerFactory) -> None:
        super().__init__(network, optimizer)
        self.chunked_cross_entropy = chunked_cross_entropy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        network = self.network
        assert isinstance(network, TinyGPT)
        x = network.wte(ids) + network.wpe(torch.arange(ids.shape[1]))
        for block in network.h:
            x = block(x)
        hidden = network.ln_f(x).flatten(0, 1)
        return self.chunked_cross_entropy(hidden, network.lm_head, targets.flatten())  # type: ignore[no-any-return]


def sequential_cnn(width: int = 8, blocks: int = 4) -> nn.Sequential:
    """Conv-BN-ReLU(inplace) blocks in one ``nn.Sequential``, pooled, and a head."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1)]
    layers += [nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
    for _ in range(blocks - 1):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def images(samples: int, size: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 3, size, size, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def tokens(samples: int, length: int = 32, vocab: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (samples, length + 1), generator=generator)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


class Checkpointed(nn.Module):
    """``checkpoint_keeping_buffers([unit], unit, x)`` in place of the unit's call, as the advice prints it."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_keeping_buffers([self.unit], self.unit, x)  # type: ignore[no-any-return]


class CheckpointedSequential(nn.Module):
    """The advice's loop in place of the Sequential's call: its segments as ``checkpoint_sequential`` splits them,
    each through ``checkpoint_keeping_buffers``, the last one without checkpointing."""

    def __init__(self, sequential: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.sequential = sequential
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = len(self.sequential) // self.segments
        for start in range(0, size * (self.segments - 1), size):
            segment = self.sequential[start : start + size]
            x = checkpoint_keeping_buffers(segment, segment, x)
        return self.sequential[size * (self.segments - 1) :](x)  # type: ignore[no-any-return]


def apply_plan(module: nn.Module, plan: CheckpointPlan) -> None:
    """Apply the plan as its advice says: each unit's call becomes ``checkpoint_keeping_buffers(..., unit, x)`` (a
    unit of several modules runs them in order inside one checkpoint, the later ones' own calls becoming the
    identity), or the Sequential's call becomes the loop over the plan's segments."""
    if plan.sequential_segments is not None:
        sequential = module.get_submodule(plan.container)
        assert isinstance(sequential, nn.Sequential)
        module.set_submodule(plan.container, CheckpointedSequential(sequential, plan.sequential_segments))
        return
    for unit in plan.units:
        modules = [module.get_submodule(name) for name in unit]
        module.set_submodule(unit[0], Checkpointed(modules[0] if len(modules) == 1 else nn.Sequential(*modules)))
        for name in unit[1:]:
            module.set_submodule(name, nn.Identity())


def features(samples: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, width, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def activation_mlp(
    activation: type[nn.Module], inplace: bool = False, depth: int = 4, width: int = 256
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), activation(inplace=inplace)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def printed_callbacks(advice: Advice, monitor: pl.Callback | None) -> list[pl.Callback]:
    """The Trainer's callbacks as the stale-gradients advice's printed code lists them, run as printed.

    ``monitor`` takes VramMonitor's place in the list (the test's own settings); ``None`` leaves it out (a run
    without the monitor). The code's ``Trainer(callbacks=...)`` line hands back its list, in the printed order.
    """
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    namespace: dict[str, Any] = {
        "Callback": pl.Callback,
        "Trainer": lambda callbacks: callbacks,
        "VramMonitor": lambda: monitor,
    }
    exec(code, namespace)  # the advice's own code, as the user pastes it
    return [callback for callback in namespace["trainer"] if callback is not None]
