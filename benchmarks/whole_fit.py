"""Wall time of a whole fit, bare and with VramMonitor (default options), in one process.

Two models: the quickstart's small CNN (``examples/quickstart.py``) and a small GPT-2-class language model
(transformers' ``GPT2Config``, random weights, nothing downloaded). For each, runs are paired: every round fits the
model bare and with the monitor, in alternating order, after one unrecorded warm-up pair; each fit is timed from the
Trainer's construction to ``fit``'s return, so the monitor's sampled step, its replays, its end-of-run report, files
and figures are all in it. Both runs log to the Trainer's default logger (TensorBoard where installed) under a
temporary folder. Prints seconds (median over rounds) and the per-round ratio monitor / bare (median [min, max]), and
the monitor's seconds more than bare. On the CPU, and on CUDA when there is a GPU. A benchmark: it prints, it asserts
nothing.

    python benchmarks/whole_fit.py [--steps 45] [--rounds 3] [--models quickstart gpt2] [--accelerator auto]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def quickstart_module() -> Any:
    """``examples/quickstart.py`` as a module (its ``SmallCNN`` and ``synthetic_images``)."""
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {QUICKSTART}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = module
    spec.loader.exec_module(module)
    return module


class Gpt2(pl.LightningModule):
    """GPT-2's language model from a config (random weights), trained with AdamW on random tokens."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def quickstart_case(batch_size: int) -> tuple[Callable[[], pl.LightningModule], DataLoader[Any]]:
    """The quickstart's CNN and its synthetic images."""
    quickstart = quickstart_module()
    data = quickstart.synthetic_images(batch_size * 16)
    return quickstart.SmallCNN, DataLoader(data, batch_size=batch_size, shuffle=True)


def gpt2_case(batch_size: int, on_gpu: bool) -> tuple[Callable[[], pl.LightningModule], DataLoader[Any]]:
    """GPT-2 124M's shape on a GPU; on the CPU a smaller one of the same class (2 layers of 128, 64 tokens)."""
    from transformers import GPT2Config

    if on_gpu:
        config, tokens = GPT2Config(), 512
    else:
        config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=4096, n_positions=256)
        tokens = 64
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, config.vocab_size, (batch_size * 16, tokens), generator=generator))
    return (lambda: Gpt2(config)), DataLoader(data, batch_size=batch_size, shuffle=True)


def fit_seconds(
    build: Callable[[], pl.LightningModule], loader: DataLoader[Any], monitored: bool, steps: int, root: str
) -> float:
    """Seconds from the Trainer's construction to ``fit``'s return."""
    torch.manual_seed(0)
    module = build()
    start = time.perf_counter()
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        log_every_n_steps=10,
        default_root_dir=root,
        callbacks=[VramMonitor()] if monitored else [],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the console summary is printed (and timed), not shown
        trainer.fit(module, loader)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=45, help="training batches per fit")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of fits (bare, monitored) per model")
    parser.add_argument("--models", nargs="+", default=["quickstart", "gpt2"], choices=["quickstart", "gpt2"])
    parser.add_argument("--batch-size", type=int, default=8)
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")  # the monitor's and Lightning's advice on these set-ups is not the point
    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"device: {device}; torch {torch.__version__}; lightning {lightning.__version__}")
    print(f"{arguments.rounds} rounds of paired fits, {arguments.steps} steps each; ratio per round, median [min, max]")
    print(f"{'model':<12} {'bare':>9} {'monitor':>9} {'more':>8} {'ratio':>22}")
    for name in arguments.models:
        build, loader = quickstart_case(64) if name == "quickstart" else gpt2_case(arguments.batch_size, on_gpu)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        with tempfile.TemporaryDirectory() as root:
            for monitored in (False, True):  # warm-up: imports, kernels, allocator
                fit_seconds(build, loader, monitored, arguments.steps, root)
            for round_index in range(arguments.rounds):
                order = (False, True) if round_index % 2 == 0 else (True, False)
                for monitored in order:
                    seconds[monitored].append(fit_seconds(build, loader, monitored, arguments.steps, root))
        bare, monitor = statistics.median(seconds[False]), statistics.median(seconds[True])
        ratios = [with_it / without for with_it, without in zip(seconds[True], seconds[False], strict=True)]
        print(
            f"{name:<12} {bare:>8.2f}s {monitor:>8.2f}s {monitor - bare:>+7.2f}s"
            f" {statistics.median(ratios):>8.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
