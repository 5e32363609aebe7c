"""Host seconds of what the monitor replays in training, next to one real training step of the same model.

For a GPT-2-class and a Llama-class language model built from transformers' config classes (random weights,
nothing downloaded), prints the seconds of: one real CPU training step (forward, backward, AdamW step, on real
tensors); the baseline replay under fake tensors; each change the rules replay (a variant); and the fit table's
search over the common GPUs (:func:`~lightning_vram.prediction.replay.fit_table.replayed_fit_table`, with the
baseline's peak reused as in training), each also as a multiple of one baseline replay, with the replays it ran.
The total is what one in-training simulation costs on a CUDA run (the fit table is searched there only). Ratios are
printed, not asserted.

    python benchmarks/replay_cost.py            # GPT-2 124M and a 220M Llama-class model, batch 8 x 128 tokens
    python benchmarks/replay_cost.py --small    # 4-layer versions (a minute on two cores)
    python benchmarks/replay_cost.py --rounds 3 # median of three of each timing
    python benchmarks/replay_cost.py --verify   # also replay each row's batch and the next: fits, next does not
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

from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, COMMON_GPUS
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import (
    BatchSizeChange,
    CheckpointChange,
    CheckpointPlan,
    FitRow,
    FreeGradientsChange,
    PrecisionChange,
    ReplayedStep,
    StepChange,
)

WIDTH = 46
"""Width of the label column."""


class LanguageModel(pl.LightningModule):
    """A causal language model trained with AdamW on its own tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def gpt2(small: bool) -> tuple[str, nn.Module, str]:
    """GPT-2 124M (12 x 768, vocab 50,257), or 4 x 256 with vocab 8,000; its name and its blocks' container."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, vocab = (4, 256, 8000) if small else (12, 768, 50257)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=vocab)
    return f"gpt2-class ({layers} x {width}, vocab {vocab:,})", GPT2LMHeadModel(config), "transformer.h"


def llama(small: bool) -> tuple[str, nn.Module, str]:
    """A 220M Llama-class model (16 x 1024, 4 key/value heads of 16, vocab 32,000), or 4 x 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width, vocab = (4, 256, 8000) if small else (16, 1024, 32000)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=int(width * 8 / 3) // 64 * 64,
        num_attention_heads=width // 64,
        num_key_value_heads=max(width // 256, 1),
        vocab_size=vocab,
    )
    return f"llama-class ({layers} x {width}, vocab {vocab:,})", LlamaForCausalLM(config), "model.layers"


def changes(module: LanguageModel, blocks: str) -> list[StepChange]:
    """The changes the rules replay on a 32-bit language model: precision, checkpointing, free gradients, batch."""
    container = f"model.{blocks}"
    units = tuple((f"{container}.{name}",) for name, _ in module.get_submodule(container).named_children())
    return [
        PrecisionChange("bf16-mixed"),
        CheckpointChange(CheckpointPlan(container, units, None, 0, container.rsplit(".", 1)[0])),
        FreeGradientsChange(),
        BatchSizeChange(4),
    ]


def median_seconds(run: Callable[[], float], rounds: int) -> float:
    return statistics.median(run() for _ in range(rounds))


def real_step_seconds(module: LanguageModel, batch: Any, rounds: int) -> float:
    """Median seconds of one real training step (after a warm-up step)."""
    optimizer = module.configure_optimizers()

    def step() -> float:
        started = time.perf_counter()
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated
        optimizer.step()
        return time.perf_counter() - started

    step()
    return median_seconds(step, rounds)


def replay_seconds(predictor: Predictor, change: StepChange | None, rounds: int) -> tuple[float, ReplayedStep]:
    """Median seconds of a replay with ``change`` and the step it replayed; raises where it was skipped."""
    results = []
    for _ in range(rounds):
        result = predictor.replay(change)
        if not isinstance(result, ReplayedStep):
            raise RuntimeError(f"{change.label if change else 'baseline'} was not replayed: {result.reason}")
        results.append(result)
    return statistics.median(result.seconds for result in results), results[-1]


def verified(predictor: Predictor, rows: tuple[FitRow, ...]) -> str:
    """Whether each row's batch fits its GPU and the next batch does not, by replaying both."""
    for row in rows:
        budget = int(row.capacity_bytes * (1 - BATCH_SAFETY_MARGIN))
        sizes = (row.max_batch_size,) if row.at_least else (row.max_batch_size, row.max_batch_size + 1)
        peaks = []
        for size in sizes:
            result = predictor.batch_size(size)
            if not isinstance(result, ReplayedStep):
                return f"not replayed at {size}: {result.reason}"
            peaks.append(result.peak.peak_bytes)
        if peaks[0] > budget or (len(peaks) > 1 and peaks[1] <= budget):
            return f"no: {row.device} {row.batch_text} (peaks {peaks}, budget {budget})"
    return f"yes ({len(rows)} rows)"


def line(label: str, seconds: float, one_replay: float, extra: str = "") -> None:
    label = label if len(label) < WIDTH else label[: WIDTH - 2] + "…"
    print(f"  {label:<{WIDTH}}{seconds:7.2f} s  {seconds / one_replay:5.1f}x one replay{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=1, help="repetitions of each timing (median)")
    parser.add_argument("--small", action="store_true", help="4-layer, 256-wide versions of both models")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--verify", action="store_true", help="replay each row's batch and the next one")
    parser.add_argument("--only", choices=("gpt2", "llama"), help="one of the two models")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    for build in (gpt2, llama) if arguments.only is None else (gpt2 if arguments.only == "gpt2" else llama,):
        name, model, blocks = build(arguments.small)
        module = LanguageModel(model)
        vocab = int(getattr(model.config, "vocab_size"))  # noqa: B009 -- transformers' configs are untyped
        batch = (torch.randint(0, vocab, (arguments.batch, arguments.tokens)),)
        millions = sum(parameter.numel() for parameter in module.parameters()) / 1e6
        print(
            f"{name}, {millions:.0f}M parameters, batch {arguments.batch} x {arguments.tokens} tokens"
            f"  (torch {torch.__version__}, CPU, {torch.get_num_threads()} threads)"
        )
        real = real_step_seconds(module, batch, arguments.rounds)
        predictor = Predictor(module, None, batch, warm_up=True)
        baseline = predictor.baseline()
        if not isinstance(baseline, ReplayedStep):
            print(f"  not replayed: {baseline.reason}")
            continue
        one, _ = replay_seconds(predictor, None, arguments.rounds)
        print(f"  {'real training step':<{WIDTH}}{real:7.2f} s  (one replay is {one / real:.2f}x of it)")
        line("baseline replay", one, one)
        variants = 0.0
        tried = changes(module, blocks)
        known = {arguments.batch: baseline}  # as in training: the batch-size change's step too
        for change in tried:
            seconds, replayed = replay_seconds(predictor, change, arguments.rounds)
            variants += seconds
            if isinstance(change, BatchSizeChange):
                known[change.batch_size] = replayed
            line(change.label, seconds, one)
        line(f"variants ({len(tried)})", variants, one)
        started = time.perf_counter()
        search = predictor.fit_table(0, known_steps=known)
        fit = time.perf_counter() - started
        rows = ", ".join(f"{row.batch_text}" for row in search.found)
        line(f"fit table ({len(COMMON_GPUS)} GPUs, {search.replays} replays)", fit, one, f"  batches: {rows}")
        total = one + variants + fit
        replays = 1 + len(tried) + search.replays
        line(f"total ({replays} replays)", total, one, f"  ({total / real:.1f}x a real step)")
        if arguments.verify:
            print(f"  {'each row the largest batch that fits':<{WIDTH}}{verified(predictor, search.found)}")


if __name__ == "__main__":
    main()
