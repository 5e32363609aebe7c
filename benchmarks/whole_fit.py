"""Wall time of a whole fit, bare and with VramMonitor (default options), in one process.

Models: the quickstart's small CNN (``examples/quickstart.py``), a GPT-2-class language model (transformers'
``GPT2Config``, random weights, nothing downloaded: GPT-2 124M's shape on a GPU, 2 layers of 128 on the CPU) and
``gpt2-124m``, GPT-2 124M's shape on either (``GPT2Config()``'s defaults, ``--tokens`` per sequence). For each, runs
are paired: every round fits the model bare and with the monitor, in alternating order, after one unrecorded warm-up
pair; each fit is timed from the Trainer's construction to ``fit``'s return, so the monitor's sampled step, its
replays, its end-of-run report, files and figures are all in it. Both runs log to the Trainer's default logger
(TensorBoard where installed) under a temporary folder. Prints wall seconds (median over rounds), the per-round ratio
monitor / bare (median [min, max]), the monitor's seconds more than bare, and the same in the process's CPU seconds
(every thread's: on a machine other work shares, the steadier figure). On the CPU, and on CUDA when there is a GPU.
With ``--parts``, each monitored fit is also timed part by part (:data:`PARTS`: preflight, the sampled step's replays
and trials, the fit table's searches in the simulator, the end-of-run report and its figures), with how often each
ran, per monitored fit: where the monitor's extra seconds go. A benchmark: it prints, it asserts nothing.

    python benchmarks/whole_fit.py [--steps 45] [--rounds 3] [--models quickstart gpt2 gpt2-124m]
        [--batch-size 8] [--tokens 128] [--parts]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"

PARTS: tuple[tuple[str, str, str | None, str], ...] = (
    ("preflight (before step 0)", "lightning_vram.session.advisor", "Advisor", "preflight"),
    ("sampled step: replays and trials", "lightning_vram.session.advisor", "Advisor", "replay"),
    ("  the step and each change", "lightning_vram.prediction.predictor", "Predictor", "simulate"),
    ("  fit table", "lightning_vram.prediction.predictor", "Predictor", "fit_table"),
    ("    searches in the simulator", "lightning_vram.prediction.replay.fit_table", None, "largest_served"),
    ("    scans in the simulator", "lightning_vram.prediction.replay.fit_table", None, "served_range"),
    ("replays (each; preflight's too)", "lightning_vram.prediction.predictor", "Predictor", "replay"),
    ("end-of-run report", "lightning_vram.session.core", "VramSession", "_finish"),
    ("  figures", "lightning_vram.session.sinks", None, "report_pngs"),
    ("  files", "lightning_vram.session.sinks", "Sinks", "_write_files"),
)
"""The monitor's parts ``--parts`` times: (label, module, class or ``None`` for the module's own name, attribute). A
part is timed where it is called from (a function by the name the calling module holds it under); a call inside
another call of the same part (a replay that replays the baseline first) counts once."""


@dataclass
class PartTime:
    """One part's wall and CPU seconds (the process's) and its calls, summed over the fits timed."""

    wall: float = 0.0
    cpu: float = 0.0
    calls: int = 0


@contextlib.contextmanager
def part_timers() -> Iterator[dict[str, PartTime]]:
    """Time each of :data:`PARTS` while the block runs (its functions wrapped, then put back); yields the times."""
    times = {label: PartTime() for label, *_ in PARTS}
    restore: list[tuple[object, str, object]] = []
    for label, module_name, owner_name, name in PARTS:
        module = importlib.import_module(module_name)
        owner: object = module if owner_name is None else getattr(module, owner_name)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        restore.append((owner, name, original))
        setattr(owner, name, _timed(original, times[label]))
    try:
        yield times
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


def _timed(function: Any, into: PartTime) -> Any:
    depth = 0

    @functools.wraps(function)
    def timed(*arguments: Any, **keywords: Any) -> Any:
        nonlocal depth
        if depth:
            return function(*arguments, **keywords)
        depth += 1
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return function(*arguments, **keywords)
        finally:
            depth -= 1
            into.wall += time.perf_counter() - wall
            into.cpu += time.process_time() - cpu
            into.calls += 1

    return timed


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


def gpt2_case(
    batch_size: int, on_gpu: bool, full: bool = False, tokens: int | None = None
) -> tuple[Callable[[], pl.LightningModule], DataLoader[Any]]:
    """GPT-2 124M's shape on a GPU (or where ``full``); on the CPU a smaller one of the same class (2 layers of 128).

    ``tokens`` per sequence; default 512 for GPT-2 124M's shape, 64 for the smaller one.
    """
    from transformers import GPT2Config

    if on_gpu or full:
        config, tokens = GPT2Config(), tokens or 512
    else:
        config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=4096, n_positions=256)
        tokens = tokens or 64
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, config.vocab_size, (batch_size * 16, tokens), generator=generator))
    return (lambda: Gpt2(config)), DataLoader(data, batch_size=batch_size, shuffle=True)


def fit_seconds(
    build: Callable[[], pl.LightningModule],
    loader: DataLoader[Any],
    monitored: bool,
    steps: int,
    root: str,
    parts: dict[str, PartTime] | None = None,
) -> tuple[float, float]:
    """Wall and CPU seconds (the process's, every thread's) from the Trainer's construction to ``fit``'s return.

    ``parts``: a monitored fit's parts (:data:`PARTS`) are added to these.
    """
    if parts is not None and monitored:
        with part_timers() as timed:
            seconds = fit_seconds(build, loader, monitored, steps, root)
        for label, part in timed.items():
            total = parts.setdefault(label, PartTime())
            total.wall, total.cpu, total.calls = total.wall + part.wall, total.cpu + part.cpu, total.calls + part.calls
        return seconds
    torch.manual_seed(0)
    module = build()
    start, cpu = time.perf_counter(), time.process_time()
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
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=45, help="training batches per fit")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of fits (bare, monitored) per model")
    parser.add_argument("--models", nargs="+", default=["quickstart", "gpt2"], choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per sequence of the GPT-2 models")
    parser.add_argument("--parts", action="store_true", help="also time the monitor's parts (PARTS) per monitored fit")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")  # the monitor's and Lightning's advice on these set-ups is not the point
    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"device: {device}; torch {torch.__version__}; lightning {lightning.__version__}")
    print(f"{arguments.rounds} rounds of paired fits, {arguments.steps} steps each; ratio per round, median [min, max]")
    print(f"{'model':<12} {'':<4} {'bare':>9} {'monitor':>9} {'more':>8} {'ratio':>22}")
    for name in arguments.models:
        build, loader = MODELS[name](arguments.batch_size, on_gpu, arguments.tokens)
        seconds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        parts: dict[str, PartTime] | None = {} if arguments.parts else None
        with tempfile.TemporaryDirectory() as root:
            for monitored in (False, True):  # warm-up: imports, kernels, allocator
                fit_seconds(build, loader, monitored, arguments.steps, root)
            for round_index in range(arguments.rounds):
                order = (False, True) if round_index % 2 == 0 else (True, False)
                for monitored in order:
                    seconds[monitored].append(fit_seconds(build, loader, monitored, arguments.steps, root, parts))
        for column, clock in ((0, "wall"), (1, "cpu")):
            bare_runs = [run[column] for run in seconds[False]]
            monitor_runs = [run[column] for run in seconds[True]]
            bare, monitor = statistics.median(bare_runs), statistics.median(monitor_runs)
            ratios = [with_it / without for with_it, without in zip(monitor_runs, bare_runs, strict=True)]
            print(
                f"{name:<12} {clock:<4} {bare:>8.2f}s {monitor:>8.2f}s {monitor - bare:>+7.2f}s"
                f" {statistics.median(ratios):>8.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            )
        for label, part in (parts or {}).items():
            rounds = arguments.rounds
            print(
                f"  {label:<36} wall {part.wall / rounds:6.2f}s  cpu {part.cpu / rounds:6.2f}s"
                f"  calls {part.calls / rounds:g}"
            )


Case = Callable[[int, bool, "int | None"], tuple[Callable[[], pl.LightningModule], DataLoader[Any]]]
MODELS: dict[str, Case] = {
    "quickstart": lambda batch_size, on_gpu, tokens: quickstart_case(64),
    "gpt2": lambda batch_size, on_gpu, tokens: gpt2_case(batch_size, on_gpu, tokens=tokens),
    "gpt2-124m": lambda batch_size, on_gpu, tokens: gpt2_case(batch_size, on_gpu, full=True, tokens=tokens),
}
"""Each model's case by name: (batch size, on a GPU, tokens per sequence or ``None``) -> (build, loader)."""


if __name__ == "__main__":
    main()
