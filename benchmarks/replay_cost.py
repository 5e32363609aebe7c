"""Host seconds of the step replay under fake tensors, next to one real training step of the same model.

For a few example models (an MLP, a ResNet-style CNN, a transformer encoder, an LSTM and, when transformers is
installed, a GPT-2-class language model), prints the median seconds of: one real CPU training step (forward,
backward, optimizer step, on real tensors); the baseline replay; each variant (a replay with one change); and
:func:`lightning_vram.predict` with its fit table (a replay per batch size the search tries). The replay costs host
time only, whatever the batch: the ratio to a real step falls as models and batches grow.

    python benchmarks/replay_cost.py            # three rounds
    python benchmarks/replay_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_vram import predict
from lightning_vram.advice.replay.step import replay_step
from lightning_vram.records import (
    BatchSizeChange,
    CheckpointChange,
    CheckpointPlan,
    FreeGradientsChange,
    PrecisionChange,
    ReplayedStep,
    StepChange,
)


class Classifier(pl.LightningModule):
    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.network(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(inputs)))))
        return self.relu(out + inputs)  # type: ignore[no-any-return]


class LastStep(nn.Module):
    def forward(self, outputs: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return outputs[0][:, -1]


class MeanOverTime(nn.Module):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.mean(dim=1)


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


WIDTH = 44
"""Width of the label column."""

Example = tuple[Callable[[], pl.LightningModule], Callable[[], Any], list[StepChange]]


def examples() -> dict[str, Example]:
    """Each example: the model, one batch, and the changes replayed on it."""
    common: list[StepChange] = [
        PrecisionChange("bf16-mixed"),
        PrecisionChange("bf16-true"),
        FreeGradientsChange(),
        BatchSizeChange(32),
    ]
    found: dict[str, Example] = {
        "mlp (3 x 1024)": (
            lambda: Classifier(
                nn.Sequential(*(layer for _ in range(3) for layer in (nn.Linear(1024, 1024), nn.ReLU())))
            ),
            lambda: (torch.randn(16, 1024), torch.randint(0, 10, (16,))),
            [*common, CheckpointChange(CheckpointPlan("network", (), 2, 0, ""))],
        ),
        "resnet-style (64 ch, 4 blocks, 64x64)": (
            lambda: Classifier(
                nn.Sequential(
                    nn.Conv2d(3, 64, 3, padding=1),
                    *(Block(64) for _ in range(4)),
                    nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(),
                    nn.Linear(64, 10),
                )
            ),
            lambda: (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))),
            [*common, CheckpointChange(CheckpointPlan("network", (), 3, 0, ""))],
        ),
        "transformer encoder (4 x 256, 128 tokens)": (
            lambda: Classifier(
                nn.Sequential(
                    nn.TransformerEncoder(
                        nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4, enable_nested_tensor=False
                    ),
                    MeanOverTime(),
                    nn.Linear(256, 10),
                )
            ),
            lambda: (torch.randn(16, 128, 256), torch.randint(0, 10, (16,))),
            common,
        ),
        "lstm (2 x 256, 64 steps)": (
            lambda: Classifier(
                nn.Sequential(
                    nn.Embedding(1000, 256), nn.LSTM(256, 256, 2, batch_first=True), LastStep(), nn.Linear(256, 10)
                )
            ),
            lambda: (torch.randint(0, 1000, (16, 64)), torch.randint(0, 10, (16,))),
            common,
        ),
    }
    try:
        import transformers  # noqa: F401 -- only to know whether the language model can be built
    except ImportError:
        return found
    found["gpt2-class (4 x 256, vocab 8000, 128 tokens)"] = (
        CausalLM,
        lambda: (torch.randint(0, 8000, (16, 128)),),
        [*common, CheckpointChange(CheckpointPlan("model.transformer.h", (), None, 0, "model.transformer"))],
    )
    return found


def real_step_seconds(module: pl.LightningModule, batch: Any, rounds: int) -> float:
    """Median seconds of one real training step (after a warm-up step)."""
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    times = []
    for index in range(rounds + 1):
        started = time.perf_counter()
        loss = module.training_step(batch, 0)
        assert isinstance(loss, torch.Tensor)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated
        optimizer.step()
        if index:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def replay_seconds(module: pl.LightningModule, batch: Any, change: StepChange | None, rounds: int) -> str:
    """Median seconds of a replay with ``change``, or why it was skipped."""
    times = []
    for _ in range(rounds):
        result = replay_step(module, None, batch, change=change, warm_up=True)
        if not isinstance(result, ReplayedStep):
            return f"skipped: {result.reason[:60]}"
        times.append(result.seconds)
    return f"{statistics.median(times):7.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of each measurement (median)")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    for name, (build, make_batch, changes) in examples().items():
        module, batch = build(), make_batch()
        if name.startswith("gpt2"):
            blocks = tuple((f"model.transformer.h.{index}",) for index in range(4))
            changes = [
                change
                if not isinstance(change, CheckpointChange)
                else CheckpointChange(CheckpointPlan("model.transformer.h", blocks, None, 0, "model.transformer"))
                for change in changes
            ]
        print(f"{name}  (torch {torch.__version__}, CPU)")
        real = real_step_seconds(module, batch, arguments.rounds)
        print(f"  {'real training step':<{WIDTH}}{real:7.3f} s")
        print(f"  {'baseline replay (warm-up)':<{WIDTH}}{replay_seconds(module, batch, None, arguments.rounds)}")
        for change in changes:
            print(f"  {change.label:<{WIDTH}}{replay_seconds(module, batch, change, arguments.rounds)}")
        started = time.perf_counter()
        prediction = predict(module, batch, device_type="cpu")
        searched = f"{len(prediction.fit)} GPUs" if prediction.fit else prediction.skipped
        print(f"  {'predict() with fit table':<{WIDTH}}{time.perf_counter() - started:7.3f} s ({searched})")


if __name__ == "__main__":
    main()
