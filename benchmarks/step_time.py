"""Predicted against measured step time on this CPU: the README's quickstart CNN, a small GPT-2 and an LSTM LM.

Each model's step is replayed once under fake tensors with its ops counted, then measured for real (a plain loop:
``training_step``, ``zero_grad``, ``backward``, the optimizer's step; after warm-up steps) in rounds, each round
measuring the CPU's peaks (:func:`~lightning_vram.prediction.timing.host.measure_host`) right before its steps,
so that a machine busy with other work is as busy for both. On one torch thread, timed by this process's CPU time
(``--wall``: the wall clock): on a shared machine, wall time measures how long the scheduler kept the process
waiting. Prints each round's figures and the medians.

    python benchmarks/step_time.py [--rounds 5] [--steps 3] [--wall]
    python benchmarks/step_time.py --cuda   # on a GPU: the table's published peaks against the real step
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.timing import gpu_peaks, measure_host, predict_step_time
from lightning_vram.prediction.timing.host import Clock
from lightning_vram.records import ReplayedStep, StepTime

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
GPT2_LENGTH = 128
"""Tokens in each sample of the GPT-2 batch."""
LSTM_LENGTH = 64
"""Tokens in each sample of the LSTM LM's batch."""
LSTM_VOCABULARY = 8000
"""The LSTM LM's vocabulary."""


def quickstart_module() -> type[pl.LightningModule]:
    """The quickstart's ``SmallCNN`` (examples/quickstart.py, loaded by path)."""
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    small_cnn: type[pl.LightningModule] = module.SmallCNN
    return small_cnn


def quickstart() -> tuple[pl.LightningModule, Any, int | None]:
    """The quickstart's model (its ``self.log`` without a Trainer does nothing) and a batch of 64 images."""

    class Quickstart(quickstart_module()):  # type: ignore[misc]  # a class loaded by path
        def log(self, *args: Any, **kwargs: Any) -> None:
            """No Trainer to log to: nothing (Lightning would warn)."""

    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 3, 32, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator))
    return Quickstart(), batch, None


class SmallGpt2(pl.LightningModule):
    """A GPT-2 (transformers' ``GPT2LMHeadModel``) of 2 layers, width 128, a vocabulary of 2,048: built, not loaded."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=2048, n_positions=GPT2_LENGTH, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def gpt2() -> tuple[pl.LightningModule, Any, int | None]:
    """The small GPT-2 and a batch of 4 sequences of :data:`GPT2_LENGTH` tokens."""
    torch.manual_seed(0)
    batch = torch.randint(0, 2048, (4, GPT2_LENGTH), generator=torch.Generator().manual_seed(0))
    return SmallGpt2(), batch, GPT2_LENGTH


class LstmLm(pl.LightningModule):
    """A word-level LSTM LM: Embedding(8000, 128), 2-layer LSTM(128, 256) with dropout 0.1, Linear(256, 8000); Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(LSTM_VOCABULARY, 128)
        self.lstm = torch.nn.LSTM(128, 256, num_layers=2, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(256, LSTM_VOCABULARY)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        hidden, _ = self.lstm(self.embedding(tokens))
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def lstm_lm() -> tuple[pl.LightningModule, Any, int | None]:
    """The LSTM LM and a batch of 16 sequences of :data:`LSTM_LENGTH` tokens, with their next tokens as targets."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, LSTM_VOCABULARY, (16, LSTM_LENGTH + 1), generator=generator)
    return LstmLm(), (tokens[:, :-1], tokens[:, 1:]), LSTM_LENGTH


MODELS: dict[str, Callable[[], tuple[pl.LightningModule, Any, int | None]]] = {
    "quickstart CNN": quickstart,
    "GPT-2 (2 layers, 128 wide)": gpt2,
    "LSTM LM (2 layers, 256 wide)": lstm_lm,
}


@dataclass(frozen=True)
class Comparison:
    """One model's rounds: the predicted and measured step seconds of each, in the same order."""

    name: str
    predicted: tuple[StepTime, ...]
    measured: tuple[float, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """Each round's predicted over measured seconds."""
        return tuple(step.seconds / seconds for step, seconds in zip(self.predicted, self.measured, strict=True))

    @property
    def ratio(self) -> float:
        """The median of the rounds' ratios."""
        return statistics.median(self.ratios)

    def summary(self) -> str:
        """One line: the medians and the ratios' spread."""
        predicted = statistics.median(step.seconds for step in self.predicted)
        measured = statistics.median(self.measured)
        return (
            f"{self.name}: predicted {1000 * predicted:.1f} ms, measured {1000 * measured:.1f} ms (medians);"
            f" predicted/measured {self.ratio:.2f} (rounds {min(self.ratios):.2f} to {max(self.ratios):.2f})"
        )


def replayed(module: pl.LightningModule, batch: Any, device: str = "cpu") -> ReplayedStep:
    """The module's step replayed on ``device`` under fake tensors, its ops counted."""
    predictor = Predictor(module, None, batch, placement=torch.device(device), warm_up=True)
    with round_of_replays():
        step = predictor.replay(None, count_flops=True)
    if not isinstance(step, ReplayedStep):
        raise RuntimeError(f"the replay was skipped: {step.reason}")
    return step


def _real_step(module: pl.LightningModule, batch: Any, optimizer: torch.optim.Optimizer, clock: Clock) -> float:
    """Seconds by ``clock`` one real training step takes: forward and loss, ``zero_grad``, backward, the step."""
    started = clock()
    loss = module.training_step(batch, 0)
    assert isinstance(loss, torch.Tensor)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return clock() - started


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compare(
    name: str, rounds: int = 5, steps: int = 3, warm_up: int = 3, clock: Clock = time.process_time
) -> Comparison:
    """Model ``name`` of :data:`MODELS`: its replay's predicted step time against ``steps`` real steps, by round.

    On one torch thread: with ``clock=time.process_time`` (the default) both the CPU's peaks and the steps are
    seconds of this process's CPU time, which other work on a shared machine changes far less than wall time.
    """
    module, batch, length = MODELS[name]()
    step = replayed(module, batch)
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    predicted, measured = [], []
    with torch_threads(1):
        for _ in range(warm_up):
            _real_step(module, batch, optimizer, clock)
        for _ in range(rounds):
            peaks = measure_host(repeats=3, clock=clock)
            measured.append(statistics.median(_real_step(module, batch, optimizer, clock) for _ in range(steps)))
            predicted.append(predict_step_time(step, peaks, sequence_length=length))
    return Comparison(name, tuple(predicted), tuple(measured))


def _cuda_step(module: pl.LightningModule, batch: Any, optimizer: torch.optim.Optimizer) -> float:
    """Wall seconds of one real step on the GPU, from a synchronised start to a synchronised end."""
    torch.cuda.synchronize()
    return _real_step(module, batch, optimizer, _synchronised_clock)


def _synchronised_clock() -> float:
    """The wall clock once the GPU has finished what it was given."""
    torch.cuda.synchronize()
    return time.perf_counter()


def compare_cuda(name: str, steps: int = 20, warm_up: int = 5) -> tuple[StepTime, float]:
    """Model ``name`` on this machine's GPU: its prediction from the table's peaks against the median real step."""
    module, batch, length = MODELS[name]()
    module = module.cuda()
    batch = tuple(part.cuda() for part in batch) if isinstance(batch, tuple) else batch.cuda()
    peaks = gpu_peaks(torch.cuda.get_device_name())
    if peaks is None:
        raise RuntimeError(f"no published peaks for {torch.cuda.get_device_name()}")
    step = replayed(module, batch, "cuda")
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    for _ in range(warm_up):
        _cuda_step(module, batch, optimizer)
    measured = statistics.median(_cuda_step(module, batch, optimizer) for _ in range(steps))
    return predict_step_time(step, peaks, sequence_length=length), measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of peaks and steps measured in turn")
    parser.add_argument("--steps", type=int, default=3, help="real steps a round (their median is the round's)")
    parser.add_argument("--wall", action="store_true", help="time by the wall clock, not this process's CPU time")
    parser.add_argument("--cuda", action="store_true", help="on this machine's GPU, priced by its published peaks")
    arguments = parser.parse_args()
    if arguments.cuda:
        for name in MODELS:
            predicted, measured = compare_cuda(name)
            print(f"{name}: predicted {predicted}; measured {1000 * measured:.2f} ms (median)")
            print(f"  predicted/measured {predicted.seconds / measured:.2f}")
        return
    clock = time.perf_counter if arguments.wall else time.process_time
    for name in MODELS:
        comparison = compare(name, arguments.rounds, arguments.steps, clock=clock)
        for step, seconds in zip(comparison.predicted, comparison.measured, strict=True):
            print(f"  {name}: predicted {step}; measured {1000 * seconds:.1f} ms")
        print(comparison.summary())


if __name__ == "__main__":
    main()
