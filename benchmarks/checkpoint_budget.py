"""A memory budget's checkpointing plan against checkpointing every block, on a GPT-2-class model.

For a few budgets (fractions of the unchanged step's predicted peak), prints the plan ``predict(...,
memory_budget=...)`` chooses (what it checkpoints, whole or selectively), its predicted peak and the FLOPs its
recomputation adds (and their share of the step), beside checkpointing every transformer block whole and every block
selectively (matrix products and attention kept), each replayed once. Peaks are those the budget is held to: on
``--device cuda`` (the default) the simulated caching allocator's reserved peak (replayed on the CPU's kernels where
there is no GPU), on ``--device cpu`` the live peak. Figures are printed, not asserted.

torch's own budget solver, ``torch._functorch.config.activation_memory_budget``, is read by AOTAutograd's min-cut
partitioner (``torch._functorch.partitioners.min_cut_rematerialization_partition``) when ``torch.compile`` builds a
joint forward-backward graph: it decides what a compiled graph saves. A model trained eagerly (as here, and as the
replay requires) never reaches it: setting it changes nothing, so it has no row; the output says so.

    python benchmarks/checkpoint_budget.py            # GPT-2 124M-class (12 x 768), batch 4 x 512 (22 min here)
    python benchmarks/checkpoint_budget.py --small    # 4 x 256, vocab 8,000, batch 8 x 128 (3 min here)

"here": two CPU cores shared with other work, where one replay of the 124M-class step took about 25 s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_vram import predict
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.serves import serves_step
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplayedStep
from lightning_vram.units import format_bytes, format_percent

FRACTIONS = (0.9, 0.75, 0.6, 0.45, 0.3)
"""Budgets, as fractions of the unchanged step's predicted peak."""
TORCH_SOLVER = (
    "torch's activation_memory_budget: not applicable to this eager training; it is read only by AOTAutograd's"
    " min-cut partitioner when torch.compile compiles the training step (a compiled model's saved tensors), and the"
    " replay (and this model) trains eagerly"
)


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


def gpt2(small: bool) -> tuple[str, LanguageModel, tuple[torch.Tensor]]:
    """GPT-2 124M-class (12 x 768, vocab 50,257) at batch 4 x 512, or 4 x 256 (vocab 8,000) at 8 x 128."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, vocab, batch, length = (4, 256, 8000, 8, 128) if small else (12, 768, 50257, 4, 512)
    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=width // 64,
        vocab_size=vocab,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    name = f"gpt2-class ({layers} x {width}, vocab {vocab:,}), batch {batch} x {length}"
    return name, LanguageModel(GPT2LMHeadModel(config)), (torch.randint(0, vocab, (batch, length)),)


def peak_of(step: ReplayedStep, reserved: bool) -> int:
    """The peak a budget is held to: the simulated allocator's reserved peak (unbounded), or the live peak."""
    if reserved:
        serving = serves_step(step, 2**50)
        assert serving is not None
        return serving.reserved_peak_bytes
    return step.peak.peak_bytes


def every_block(predictor: Predictor, module: LanguageModel, selective: bool) -> tuple[int, int]:
    """Every block checkpointed (whole, or selectively): the replayed step's FLOPs and the step."""
    container = "model.transformer.h"
    names = tuple(f"{container}.{name}" for name, _ in module.get_submodule(container).named_children())
    plan = CheckpointPlan(
        container, tuple((name,) for name in names), None, 0, "model.transformer", selective=names if selective else ()
    )
    step = predictor.replay(CheckpointChange(plan), count_flops=True)
    if not isinstance(step, ReplayedStep) or step.flops is None:
        raise RuntimeError(f"every block checkpointed was not replayed: {step}")
    return step.flops, peak_of(step, predictor.allocator is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a 4-layer model (3 minutes on two cores)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device predicted for")
    parser.add_argument("--seconds", type=float, default=300.0, help="predict()'s budget_seconds per budget")
    arguments = parser.parse_args()
    name, module, batch = gpt2(arguments.small)
    reserved = arguments.device == "cuda"
    predictor = Predictor(
        module,
        None,
        batch,
        placement=torch.device("cpu"),
        warm_up=True,
        allocator=AllocatorSettings() if reserved else None,
    )
    baseline = predictor.replay(None, count_flops=True)
    if not isinstance(baseline, ReplayedStep) or baseline.flops is None:
        raise RuntimeError(f"the step was not replayed: {baseline}")
    unchanged = peak_of(baseline, reserved)
    basis = "reserved, simulated caching allocator" if reserved else "live peak"
    print(f"{name}, predicted for {arguments.device} ({basis}; replayed on the CPU)")
    print(f"  unchanged: peak {format_bytes(unchanged)}, {baseline.flops:,} FLOPs a step")
    for label, selective in (("every block whole", False), ("every block selectively", True)):
        flops, peak = every_block(predictor, module, selective)
        added = flops - baseline.flops
        print(
            f"  {label + ':':<26} peak {format_bytes(peak):>10}, {added:>16,} FLOPs recomputed"
            f" ({format_percent(added / baseline.flops)})"
        )
    print(f"  {TORCH_SOLVER}")
    print(f"  {'budget':>10}  {'chosen plan':<14} {'peak':>10} {'recomputed FLOPs':>18} {'share':>6} {'s':>5}")
    for fraction in FRACTIONS:
        budget = int(unchanged * fraction)
        started = time.perf_counter()
        found = predict(
            module,
            batch,
            device_type=arguments.device,
            fit_table=False,
            memory_budget=budget,
            budget_seconds=arguments.seconds,
        ).budget
        seconds = time.perf_counter() - started
        if found is None:
            print(f"  {format_bytes(budget):>10}  not searched")
            continue
        verdict = ("checkpoint " + found.what if found.what else "nothing") if found.fits else "no plan fits"
        recomputed = f"{found.recomputed_flops:,}" if found.recomputed_flops is not None else "-"
        print(
            f"  {format_bytes(budget):>10}  {'fits' if found.fits else 'does not fit':<14} "
            f"{format_bytes(found.peak_bytes):>10} {recomputed:>18} {format_percent(found.recomputed_share):>6}"
            f" {seconds:>5.1f}"
        )
        print(f"  {'':>10}  {verdict}")
        print(f"  {'':>10}  ({found.replays} replays) {found.reason}")


if __name__ == "__main__":
    main()
