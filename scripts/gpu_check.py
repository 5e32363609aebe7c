"""Check the whole CUDA path on one GPU in one command, and print one Markdown table (issue 24, item 6).

Rows, each time-boxed (a row whose budget is spent says so and the script goes on; a row that raises prints its
error in the table):

- the GPU tests (``pytest -m gpu``), one row a test;
- the overhead benchmark (``benchmarks/overhead.py``), its ratios to bare;
- GPT-2 124M (fp32, AdamW, 8 x 512 tokens), an 8-layer Llama (bf16-mixed, AdamW, 4 x 1024) and a ResNet-50 (SGD
  momentum, 64 x 3x224x224): the replayed vs the measured allocated and reserved peak per phase (the report's
  ``simulation.calibration``), with the error;
- the predicted largest batch for this GPU trained for real (must fit) and 5% above it (should not);
- with ``--traces DIR``, each of those fits recorded as an allocator trace (tests/data/gpu-traces' format) and
  replayed through the allocator model at the device's capacity: its reserved peak, and whether the model agrees
  that the run fit or ran out of memory (the monitored fits are recorded too, without a row);
- each preflight remedy at a batch that does not fit, trained for real.

pytest's whole output is written beside ``--out`` as ``gpu_tests.log`` (a failure's traceback).

``--cpu-dry-run`` runs every row on the CPU with tiny models and asserts no GPU figure: CI's guard against rot
(``tests/test_gpu_check.py``). Run it as ``.venv/bin/python scripts/gpu_check.py --out docs/gpu-validation-run.md``
(``make gpu-check``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lightning_vram.session.recorder import PHASE_READ_STEPS

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ("tests/test_gpu.py", "tests/hostile/test_on_a_gpu.py")
COLUMNS = ("section", "row", "predicted", "measured", "error", "outcome")
MIB = 1024**2
MONITORED_STEPS = 3
"""A monitored fit's steps: step 1 sampled and replayed; each read phase by phase, as :class:`PhaseMarks` needs."""
assert MONITORED_STEPS <= PHASE_READ_STEPS
MODEL_WEIGHTS = (0.4, 0.35, 0.25)
"""Each model's share of the time the models have (GPT-2's rows, the largest batch's above all, take the longest)."""


@dataclass(frozen=True)
class Row:
    """One line of the table: figures in bytes are printed as MiB; ``error`` is (predicted - measured) / measured."""

    section: str
    row: str
    predicted: str = ""
    measured: str = ""
    error: str = ""
    outcome: str = ""


class Budget:
    """A row's wall-clock seconds: ``left()`` counts down; ``spent()`` once it is gone."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (never negative)."""
        return max(self.deadline - time.monotonic(), 0.0)

    def spent(self) -> bool:
        """Whether no time is left."""
        return self.left() <= 0.0


def mib(value: int | None) -> str:
    """Bytes as MiB with one decimal, or ``n/a``."""
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def percent(predicted: int | None, measured: int | None) -> str:
    """``(predicted - measured) / measured`` as a signed percentage, or ``n/a``."""
    if predicted is None or not measured:
        return "n/a"
    return f"{100 * (predicted - measured) / measured:+.2f}%"


def within(predicted: int | None, measured: int | None, tolerance: float) -> str:
    """``ok`` when within ``tolerance`` (a fraction), ``OFF`` when not, ``n/a`` when unknown."""
    if predicted is None or not measured:
        return "n/a"
    return "ok" if abs(predicted - measured) <= tolerance * measured else "OFF"


# ---- the GPU tests and the benchmark: subprocesses with a timeout --------------------------------------------------


def environment() -> dict[str, str]:
    """This process's environment with the worktree first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def gpu_test_rows(budget: Budget, log: Path | None = None, traces: Path | None = None) -> list[Row]:
    """Run the gpu-marked tests in a subprocess; one row a test (its outcome, and a failure's first line).

    ``log``: pytest's whole output is written there too (a failure's traceback, for the next session to read).
    ``traces``: the tests that compare the replay with the allocator record their fits' traces there
    (``LIGHTNING_VRAM_GPU_TEST_TRACES``, with Python stacks).
    """
    env = environment()
    if traces is not None:
        env["LIGHTNING_VRAM_GPU_TEST_TRACES"] = str(traces / "gpu-tests")
    with tempfile.TemporaryDirectory() as root:
        junit = Path(root) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", *GPU_TESTS, "-v", "-p", "no:cacheprovider"]
        command += [f"--junitxml={junit}", "-s"]
        try:
            run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget.left())
        except subprocess.TimeoutExpired as stopped:
            # No junit file from a killed run: the tests that ended, from its verbose lines.
            partial = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
            if log is not None:
                log.write_text(partial)
            ended = [
                Row("GPU tests", match["name"], outcome=match["outcome"].lower())
                for match in VERBOSE_LINE.finditer(partial)
            ]
            return [*ended, Row("GPU tests", "pytest -m gpu", outcome="timed out: budget spent")]
        if log is not None:
            log.write_text(run.stdout + run.stderr)
        if not junit.exists():
            return [Row("GPU tests", "pytest -m gpu", outcome=f"no results (exit {run.returncode}): {tail(run)}")]
        rows = []
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                element = case.find(kind)
                if element is not None:
                    message = (element.get("message") or "").splitlines()
                    outcome = f"{kind}: {message[0][:160] if message else ''}"
            rows.append(Row("GPU tests", name, outcome=outcome))
        # The per-phase figures the replay test prints, for docs/gpu-validation.md.
        rows += [
            Row("GPU tests", "printed", outcome=line)
            for line in run.stdout.splitlines()
            if "replayed" in line and not VERBOSE_LINE.match(line)
        ]
        return rows or [Row("GPU tests", "pytest -m gpu", outcome=f"no tests ran: {tail(run)}")]


VERBOSE_LINE = re.compile(r"^tests/\S*?(?P<name>\w+\.py::\w+)\S* (?P<outcome>PASSED|FAILED|SKIPPED|ERROR)", re.M)
"""A test's outcome as ``pytest -v`` prints it."""


def tail(run: subprocess.CompletedProcess[str]) -> str:
    """The last line of a subprocess's output, for a table cell."""
    lines = (run.stdout + run.stderr).strip().splitlines()
    return lines[-1][:200].replace("|", "/") if lines else "(no output)"


BENCHMARK_LINE = re.compile(
    r"^(?P<name>\S+)\s+(?P<ms>[\d.]+) ms\s+(?P<ratio>[\d.]+) \[(?P<low>[\d.]+), (?P<high>[\d.]+)\]"
)


def benchmark(script: str, arguments: list[str], budget: Budget, dry_run: bool) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` on this device (the CPU under ``dry_run``), within the budget.

    Raises:
        subprocess.TimeoutExpired: the budget ran out first.
    """
    accelerator = "cpu" if dry_run else "gpu"
    command = [sys.executable, f"benchmarks/{script}", "--accelerator", accelerator, *arguments]
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=budget.left())


def overhead_rows(budget: Budget, dry_run: bool) -> list[Row]:
    """``benchmarks/overhead.py`` with few rounds: each configuration's step time and ratio to bare."""
    sizes = ["--rounds", "1", "--steps", "12", "--warmup", "2"] if dry_run else ["--rounds", "3", "--steps", "120"]
    try:
        run = benchmark("overhead.py", sizes, budget, dry_run)
    except subprocess.TimeoutExpired:
        return [Row("overhead", "benchmarks/overhead.py", outcome="timed out: budget spent")]
    rows = []
    for line in run.stdout.splitlines():
        match = BENCHMARK_LINE.match(line)
        if match:
            ratio = f"{match['ratio']}x [{match['low']}-{match['high']}]"
            target = " (target <= 1.02x)" if match["name"] == "VramMonitor" else ""
            rows.append(Row("overhead", match["name"], measured=f"{match['ms']} ms/step", outcome=ratio + target))
    rows = rows or [
        Row("overhead", "benchmarks/overhead.py", outcome=f"no figures (exit {run.returncode}): {tail(run)}")
    ]
    return rows + hot_path_rows(budget, dry_run)


HOT_PATH_LINE = re.compile(
    r"^\s+(?P<what>over the empty callback|inside its hooks)\s+(?P<us>-?[\d.]+) us \[(?P<range>[^]]*)\]"
)
HOT_PATH_TARGET_US = 50
"""Issue 24's target for the monitor's host time on an ordinary step (1.02x of a 2.5 ms step), microseconds."""


def hot_path_rows(budget: Budget, dry_run: bool) -> list[Row]:
    """``benchmarks/hot_path.py`` on this device: the monitor's host time inside its hooks per ordinary step.

    Kernels run asynchronously: that time (the allocator reads included) is what the monitor takes from each step,
    where the step-time ratio above moves by more between runs than the monitor costs. Beside it, the monitored
    run's step time less the empty callback's.
    """
    sizes = (
        ["--rounds", "1", "--steps", "30", "--warmup-steps", "12"] if dry_run else ["--rounds", "3", "--steps", "400"]
    )
    try:
        run = benchmark("hot_path.py", sizes, budget, dry_run)
    except subprocess.TimeoutExpired:
        return [Row("overhead", "benchmarks/hot_path.py", outcome="timed out: budget spent")]
    path = "CUDA path, scripted probe" if dry_run else "CUDA path, this GPU"
    lines = run.stdout.splitlines()
    start = next((index for index, line in enumerate(lines) if path in line), None)
    rows = []
    for line in lines[start + 1 : start + 3] if start is not None else []:
        match = HOT_PATH_LINE.match(line)
        if match:
            inside = match["what"] == "inside its hooks"
            target = f" (target <= {HOT_PATH_TARGET_US} us)" if inside else ""
            rows.append(
                Row(
                    "overhead",
                    f"VramMonitor {match['what']}",
                    measured=f"{match['us']} us/step",
                    outcome=f"[{match['range']}]{target}",
                )
            )
    return rows or [
        Row("overhead", "benchmarks/hot_path.py", outcome=f"no figures (exit {run.returncode}): {tail(run)}")
    ]


# ---- the three models ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One model to check: how to build it and a batch, its precision, batch size and the input's shape."""

    name: str
    build: Callable[[], Any]
    inputs: Callable[[int], Any]
    precision: str
    batch_size: int


def language_model_case(name: str, config: Any, precision: str, batch_size: int, length: int) -> Case:
    """A transformers causal LM with random weights (no download), AdamW, batches of ``length`` random tokens."""

    def build() -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # transformers is untyped
        return LanguageModel(model, torch.optim.AdamW)

    def inputs(batch: int) -> Any:
        return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))

    return Case(name, build, inputs, precision, batch_size)


def cases(dry_run: bool) -> list[Case]:
    """GPT-2 124M, the 8-layer Llama and ResNet-50; under ``dry_run``, tiny versions of each."""
    from transformers import GPT2Config, LlamaConfig

    if dry_run:
        gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
        llama = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512,
        )  # fmt: skip
        width, layers, side = 8, (1, 1, 1, 1), 64
        sizes = (2, 2, 2, 32, 32)
    else:
        gpt2 = GPT2Config()
        llama = LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000,
        )  # fmt: skip
        width, layers, side = 64, (3, 4, 6, 3), 224
        sizes = (8, 4, 64, 512, 1024)
    gpt2.attn_implementation = llama.attn_implementation = "eager" if dry_run else "sdpa"

    def resnet() -> Any:
        return ImageClassifier(resnet50(width, layers), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))

    def images(batch: int) -> Any:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(batch, 3, side, side, generator=generator), torch.randint(
            0, 1000, (batch,), generator=generator
        )

    return [
        language_model_case("GPT-2 124M fp32" if not dry_run else "tiny GPT-2", gpt2, "32-true", sizes[0], sizes[3]),
        language_model_case("Llama 8L bf16" if not dry_run else "tiny Llama", llama, "bf16-mixed", sizes[1], sizes[4]),
        Case("ResNet-50 SGD" if not dry_run else "tiny ResNet", resnet, images, "32-true", sizes[2]),
    ]


class LanguageModel(pl.LightningModule):
    """A causal LM trained on its own tokens (labels = inputs)."""

    def __init__(self, model: Any, optimizer: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        tokens = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters(), lr=1e-4)


class ImageClassifier(pl.LightningModule):
    """A network trained with cross-entropy on ``(images, labels)``."""

    def __init__(self, network: Any, optimizer: Callable[..., Any]) -> None:
        super().__init__()
        self.network = network
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> Any:

        images, labels = batch
        return torch.nn.functional.cross_entropy(self.network(images), labels)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters())


def resnet50(width: int, layers: tuple[int, ...], classes: int = 1000) -> Any:
    """ResNet-50 from plain torch (torchvision's layout: Bottleneck blocks, expansion 4); ``width`` 64 is the real."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            out = planes * 4
            self.body = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
                nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
                nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
            )  # fmt: skip
            self.shortcut: nn.Module = nn.Identity()
            if stride != 1 or inplanes != out:
                self.shortcut = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.shortcut(x))

    stages: list[nn.Module] = []
    inplanes = width
    for index, blocks in enumerate(layers):
        planes = width * 2**index
        for block in range(blocks):
            stages.append(Bottleneck(inplanes, planes, 2 if block == 0 and index > 0 else 1))
            inplanes = planes * 4
    return nn.Sequential(
        nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, classes),
    )  # fmt: skip


class Training:
    """Trains ``case`` for a few steps on the device, in a fresh Trainer; frees the device's cache afterwards."""

    def __init__(self, case: Case, dry_run: bool) -> None:
        self.case = case
        self.dry_run = dry_run
        self.accelerator = "cpu" if dry_run else "gpu"

    def fit(self, batch_size: int, steps: int, callbacks: list[Any], precision: str | None = None) -> Any:
        """Train ``steps`` steps at ``batch_size``; the module trained (for its monitor's report)."""
        chosen: Any = precision or self.case.precision  # Lightning's precision is a Literal of names
        from torch.utils.data import DataLoader, TensorDataset

        data = self.case.inputs(batch_size * steps)
        dataset = TensorDataset(*data) if isinstance(data, tuple) else TensorDataset(data)
        module = self.case.build()
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator=self.accelerator, devices=1, max_steps=steps, precision=chosen,
                default_root_dir=root, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=callbacks,
            )  # fmt: skip
            trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True))
        del trainer
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return module

    def fits(self, batch_size: int, steps: int = 2, trace: Path | None = None, **options: Any) -> bool:
        """Whether ``steps`` steps at ``batch_size`` ran without a CUDA out-of-memory error.

        ``trace``: record the allocator's events from an empty device into ``trace`` (a ``.pickle`` snapshot and its
        ``.json`` measurements beside it, the format of tests/data/gpu-traces), on a GPU only.
        """
        options = {"callbacks": [], **options}
        recorder = TraceRecorder(self.case, batch_size, trace) if trace is not None and not self.dry_run else None
        if recorder is not None:
            options["callbacks"] = [*options["callbacks"], recorder.marks]
        with recorder if recorder is not None else contextlib.nullcontext():
            try:
                self.fit(batch_size, steps, **options)
                return True
            except torch.cuda.OutOfMemoryError:
                return False
            finally:
                free_device()


def free_device() -> None:
    """Drop what the last run left: collect its garbage and return the cached blocks to the driver.

    Nothing on the CPU (the dry run), where no cache holds blocks: its 20 full collections, in a process with torch,
    Lightning and transformers imported, took a quarter of the models' CPU time (18 s of it, 13 s without them).
    """
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class PhaseMarks(pl.Callback):
    """At each phase boundary: the allocator's peaks read and reset, then one marker allocation of a unique size.

    Beside a VramMonitor (``reset=False``, listed before it) the marks read the peaks and leave the reset to the
    monitor, which resets them at every boundary of a step it reads phase by phase (each of a fit's first
    ``PHASE_READ_STEPS``). Where the marks reset them too, the monitor, reading after them, found the boundary's
    current bytes for the phase's peak (the second H100 session of 2026-11-27, run 1: GPT-2's backward "peak"
    1,987.6 MiB, its gradients and optimizer state).

    The markers cut a recorded trace into steps and phases as tests/allocator_traces.py reads them (``forward``
    from the batch's start to ``on_before_backward``, ``backward`` to ``on_before_optimizer_step``, ``optimizer`` to
    the batch's end); ``truth`` holds each phase's ``allocated_peak``, ``reserved_peak``, current values, segment
    count and ``num_alloc_retries`` as ``torch.cuda.memory_stats()`` gave them.
    """

    FIRST_MARKER_BYTES = 512_512
    CLOSES: ClassVar[dict[str, str]] = {
        "before_backward": "forward",
        "before_optimizer_step": "backward",
        "batch_end": "optimizer",
    }

    def __init__(self, reset: bool = True) -> None:
        self.reset = reset
        self.markers: list[dict[str, Any]] = []
        self.truth: list[dict[str, Any]] = []
        self.step = 0

    def _mark(self, at: str) -> None:
        stats = torch.cuda.memory_stats()
        closed = self.CLOSES.get(at)
        if closed is not None:
            if closed == "forward":
                self.truth.append({"step": self.step})
            self.truth[-1][closed] = {
                "allocated_peak": stats["allocated_bytes.all.peak"],
                "reserved_peak": stats["reserved_bytes.all.peak"],
                "allocated": stats["allocated_bytes.all.current"],
                "reserved": stats["reserved_bytes.all.current"],
                "segments": stats["segment.all.current"],
                "num_alloc_retries": stats["num_alloc_retries"],
            }
        if self.reset:
            torch.cuda.reset_peak_memory_stats()
        size = self.FIRST_MARKER_BYTES + 512 * len(self.markers)
        self.markers.append({"bytes": size, "step": self.step, "at": at})
        marker = torch.empty(size, dtype=torch.uint8, device="cuda")
        del marker

    def on_train_batch_start(self, *_: Any) -> None:
        self._mark("batch_start")

    def on_before_backward(self, *_: Any) -> None:
        self._mark("before_backward")

    def on_before_optimizer_step(self, *_: Any) -> None:
        self._mark("before_optimizer_step")

    def on_train_batch_end(self, *_: Any) -> None:
        self._mark("batch_end")
        self.step += 1


class TraceRecorder:
    """Records a fit's allocator events from an empty device (``with recorder:``), as the shared H200 traces were.

    On exit, writes ``path`` (``torch.cuda.memory._snapshot()``: the events, no stack frames) and ``path`` with
    ``.json`` (the markers, each phase's measured peaks, the device, the allocator settings, the OOM if one came).
    """

    def __init__(self, case: Case, batch_size: int, path: Path, beside_monitor: bool = False) -> None:
        self.case = case
        self.batch_size = batch_size
        self.path = path
        self.marks = PhaseMarks(reset=not beside_monitor)
        self.from_empty = False
        self.free_at_start = 0

    def __enter__(self) -> None:
        free_device()
        torch._C._cuda_clearCublasWorkspaces()  # live blocks of earlier fits: the trace starts from an empty device
        torch.cuda.empty_cache()
        self.from_empty = torch.cuda.memory_reserved() == 0
        self.free_at_start = torch.cuda.mem_get_info()[0]
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")

    def __exit__(self, *_: object) -> None:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        stats = torch.cuda.memory_stats()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("wb") as file:
            pickle.dump(snapshot, file)
        measured = {
            "case": self.path.stem,
            "model": self.case.name,
            "batch": self.batch_size,
            "precision": self.case.precision,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
            "from_empty": self.from_empty,
            "free_at_start_bytes": self.free_at_start,
            "markers": self.marks.markers,
            "truth": [step for step in self.marks.truth if "optimizer" in step],
            "oom": next(  # torch's own record of the request that failed (the error itself is caught by fits())
                (
                    {"size": event["size"], "device_free": event.get("device_free")}
                    for event in snapshot["device_traces"][torch.cuda.current_device()]
                    if event["action"] == "oom"
                ),
                None,
            ),
            "reserved_peak": stats["reserved_bytes.all.peak"],
            "events": len(snapshot["device_traces"][torch.cuda.current_device()]),
        }
        self.path.with_suffix(".json").write_text(json.dumps(measured, indent=1))


def trace_row(section: str, label: str, path: Path) -> Row:
    """A recorded trace replayed through the allocator model: its reserved peak against the allocator's own."""
    from lightning_vram.prediction.allocator.snapshot import read_snapshot, replay, trace_from_snapshot

    measured = json.loads(path.with_suffix(".json").read_text())
    trace = trace_from_snapshot(read_snapshot(path))
    # At the device's capacity (what it had free when the fit began), as the run was: near it the allocator
    # releases its cached segments and retries, which an uncapped replay never does.
    capacity = measured["free_at_start_bytes"]
    simulated = replay(trace, capacity_bytes=capacity).peak_reserved_bytes
    recorded = trace.recorded_reserved_peak_bytes
    # Whether the model serves the run in that capacity (the failed request too).
    fits = replay(trace, capacity_bytes=capacity, serve_failed_request=True).out_of_memory is None
    ran = "OOM" if trace.failed is not None else "fit"  # torch's own oom event in the trace
    agrees = "agrees" if fits == (ran == "fit") else "DISAGREES"
    outcome = f"{within(simulated, recorded, 0.001)} (target 0.1%); model at capacity: {'fit' if fits else 'OOM'}"
    outcome += f", ran: {ran} ({agrees}); {trace.events} events, from empty: {trace.from_empty}"
    figures = (mib(simulated), mib(recorded), percent(simulated, recorded))
    return Row(section, f"trace {label}: reserved peak", *figures, outcome)


def monitored(case: Case, training: Training, budget: Budget, trace: Path | None = None) -> tuple[Any, list[Row]]:
    """A 3-step fit with VramMonitor (step 1 sampled and replayed): the simulation, and a row per phase.

    ``trace``: the fit is recorded there too (:class:`TraceRecorder`; on a GPU), what the allocator did beside the
    replay's figures.
    """
    from lightning_vram import VramMonitor

    section = case.name
    replay_seconds = max(min(budget.left() - 20.0, 90.0), 5.0)
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=None, console_summary=True,
        replay_budget_seconds=replay_seconds, preflight=False,
    )  # fmt: skip
    recorder = (
        TraceRecorder(case, case.batch_size, trace, beside_monitor=True)
        if trace is not None and not training.dry_run
        else None
    )
    # The marks read the allocator's peaks before the monitor reads and resets them at the same boundary (they come
    # first, and leave the resets to the monitor).
    callbacks: list[Any] = [monitor] if recorder is None else [recorder.marks, monitor]
    try:
        with recorder if recorder is not None else contextlib.nullcontext():
            training.fit(case.batch_size, MONITORED_STEPS, callbacks)
    finally:
        free_device()
    report = monitor.report
    simulation = report.simulation if report is not None else None
    if report is None or simulation is None or simulation.baseline is None:
        why = simulation.skipped if simulation is not None else "no report or no replay"
        return simulation, [Row(section, "replay", outcome=f"not replayed: {why}")]
    rows = []
    calibration = simulation.calibration
    if calibration is not None:
        for pair in calibration.phases:
            for kind, predicted, measured in (
                ("allocated", pair.replayed_allocated_bytes, pair.measured_allocated_bytes),
                ("reserved", pair.replayed_reserved_bytes, pair.measured_reserved_bytes),
            ):
                rows.append(
                    Row(
                        section,
                        f"{pair.phase.value} {kind} peak",
                        mib(predicted),
                        mib(measured),
                        percent(predicted, measured),
                        within(predicted, measured, 0.02) + " (target 2%)",
                    )
                )
        return simulation, rows
    # No allocator readings (the CPU): the replayed live peak against the measured one, allocated only.
    for phase, replayed in simulation.baseline.phases.items():
        measured = report.phases[phase].peak_bytes if phase in report.phases else None
        outcome = "no allocator: not checked"
        row = f"{phase.value} live peak"
        rows.append(
            Row(section, row, mib(replayed.peak_bytes), mib(measured), percent(replayed.peak_bytes, measured), outcome)
        )
    return simulation, rows


DEVICELESS_PREDICT = """
import json, sys
sys.path.insert(0, "scripts")
import gpu_check
from lightning_vram import predict
for case in gpu_check.cases({dry_run}):
    try:
        data = case.inputs(case.batch_size)
        batch = list(data) if isinstance(data, tuple) else [data]  # as the DataLoader of Training.fit collates it
        prediction = predict(case.build(), batch, precision=case.precision, device_type="cuda", fit_table=False)
        found = {{"step": prediction.to_dict()["step"]}}
    except Exception as error:  # one model's failure is its row's; the others are still predicted
        found = {{"error": f"{{type(error).__name__}}: {{error}}"[:200]}}
    print("DEVICELESS " + json.dumps({{"case": case.name, **found}}), flush=True)
"""
"""``predict()`` for CUDA in a process that sees no CUDA device: each case's step replayed as a laptop would, one
line a case as it is predicted."""


class Deviceless:
    """Every case predicted for CUDA in one process that sees no device (``CUDA_VISIBLE_DEVICES=""``).

    Started as the models' section begins, beside the GPU's work (its replays take only host time): one interpreter's
    imports for the three models where each model started its own, and each model reads its line when its rows need
    it, waiting at most its own budget.
    """

    def __init__(self, dry_run: bool) -> None:
        env = dict(environment(), CUDA_VISIBLE_DEVICES="")
        code = DEVICELESS_PREDICT.format(dry_run=dry_run)
        self._process = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._found: dict[str, dict[str, Any]] = {}
        self._ended = threading.Event()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("DEVICELESS "):
                found = json.loads(line.removeprefix("DEVICELESS "))
                self._found[found.pop("case")] = found
        self._process.wait()
        self._ended.set()

    def _read_errors(self) -> None:
        assert self._process.stderr is not None
        self._stderr.extend(self._process.stderr)

    def step(self, name: str, budget: Budget) -> dict[str, Any] | str:
        """The case's predicted step (``Prediction.to_dict()["step"]``), or why there is none."""
        while name not in self._found and not self._ended.is_set() and not budget.spent():
            self._ended.wait(min(budget.left(), 0.2))
        found = self._found.get(name)
        if found is None:
            if not self._ended.is_set():
                return "timed out: budget spent"
            return f"no prediction (exit {self._process.returncode}): {''.join(self._stderr)[-300:]}"
        return found["step"] if "step" in found else f"no prediction: {found['error']}"

    def stop(self) -> None:
        """End the process if it still runs (the budget ran out before every case was predicted)."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def deviceless_rows(case: Case, simulation: Any, deviceless: Deviceless, budget: Budget, dry_run: bool) -> list[Row]:
    """``predict()`` for CUDA where no device is visible (:class:`Deviceless`), against the allocator.

    Without a device the replay emulates CUDA's dropout and attention kernels (lightning_vram/prediction/replay/
    cuda_kernels.py); each phase's predicted allocated peak is set against the monitored fit's measured one.
    """
    section = case.name
    step = deviceless.step(case.name, budget)
    if isinstance(step, str):
        return [Row(section, "predict without the device", outcome=step)]
    calibration = getattr(simulation, "calibration", None)
    measured = {pair.phase.value: pair.measured_allocated_bytes for pair in calibration.phases} if calibration else {}
    rows = []
    for phase, peak in step["phases"].items():
        predicted, actual = peak["peak_bytes"], measured.get(phase)
        outcome = "dry run: not checked" if dry_run else within(predicted, actual, 0.03) + " (target 3%)"
        label = f"{phase} allocated peak, predicted without the device"
        rows.append(Row(section, label, mib(predicted), mib(actual), percent(predicted, actual), outcome))
    return rows


def largest_batch(simulation: Any, dry_run: bool, case: Case) -> tuple[int | None, int | None, str]:
    """The predicted largest batch on this device, and with expandable segments; where each came from.

    The run's own device: ``simulation.device_max_batch_size`` (searched in the simulated allocator with the run's
    settings). With expandable segments: the common GPU's fit row whose capacity is within 2% of this device's
    (``FitRow.expandable_max_batch_size``), ``None`` without one.
    """
    if dry_run:
        return case.batch_size, None, "dry run: the case's own batch"
    if simulation is None:
        return None, None, "no simulation"
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    near = [row for row in simulation.fit if abs(row.capacity_bytes - capacity) <= 0.02 * capacity]
    expandable = near[0].expandable_max_batch_size if near else None
    if simulation.device_max_batch_size is not None:
        return simulation.device_max_batch_size, expandable, "this device"
    if near:
        return near[0].max_batch_size, expandable, f"fit row {near[0].device}"
    return None, None, simulation.fit_note or "no fit row near this device's capacity"


def batch_rows(
    case: Case, training: Training, simulation: Any, budget: Budget, dry_run: bool, traces: Path | None
) -> list[Row]:
    """The predicted largest batch trained for 2 steps (must fit) and 5% above it (should not).

    ``traces``: each of these fits is recorded there (:class:`TraceRecorder`), and its trace replayed through the
    allocator model in a row of its own.
    """
    section = case.name
    slug = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
    recorded: list[tuple[str, Path]] = []

    def trace(size: int, settings: bool | None) -> Path | None:
        if traces is None or dry_run:
            return None
        path = traces / f"{slug}-b{size}{'-expandable' if settings else ''}.pickle"
        recorded.append((f"b{size}{', expandable' if settings else ''}", path))
        return path

    best, expandable, source = largest_batch(simulation, dry_run, case)
    if best is None:
        return [Row(section, "largest batch", outcome=f"not predicted: {source}")]
    rows = []
    for label, size, settings in (("largest batch", best, None), ("largest batch, expandable", expandable, True)):
        if size is None:
            continue
        if budget.spent():
            rows.append(Row(section, label, str(size), outcome="skipped: budget spent"))
            continue
        with allocator_settings(settings, dry_run):
            fits = training.fits(size, trace=trace(size, settings))
            above = max(math.ceil(size * 1.05), size + 1)
            above_fits = training.fits(above, trace=trace(above, settings)) if not budget.spent() else None
        rows.append(Row(section, f"{label} ({source})", str(size), "fit" if fits else "OOM", outcome=must_fit(fits)))
        if above_fits is None:
            rows.append(Row(section, f"{label} +5%", str(above), outcome="skipped: budget spent"))
        else:
            verdict = "OOM as predicted"
            if above_fits:  # a dry run's batch is the case's own, no prediction: nothing to call conservative
                verdict = (
                    "fit (dry run: no prediction to judge)"
                    if dry_run
                    else f"fit: the prediction was at least {100 * (above - size) / size:.0f}% conservative"
                )
            rows.append(Row(section, f"{label} +5%", str(above), "fit" if above_fits else "OOM", outcome=verdict))
    for label, path in recorded:
        if path.is_file():
            rows += guarded(section, f"trace {label}", functools.partial(trace_rows, section, label, path))
    return rows


def trace_rows(section: str, label: str, path: Path) -> list[Row]:
    """:func:`trace_row` as a list, for :func:`guarded`."""
    return [trace_row(section, label, path)]


def must_fit(fits: bool) -> str:
    """The outcome of the batch that must fit."""
    return "ok: fits" if fits else "FAILED: predicted to fit, ran out of memory"


class allocator_settings:  # used as a statement: with allocator_settings(...)
    """Turn ``expandable_segments`` on for a block (``None``: leave the allocator as it is; the CPU: nothing)."""

    def __init__(self, expandable: bool | None, dry_run: bool) -> None:
        self.expandable = expandable if not dry_run else None

    def __enter__(self) -> None:
        self._set(self.expandable)

    def __exit__(self, *_: object) -> None:
        self._set(False if self.expandable else None)

    @staticmethod
    def _set(expandable: bool | None) -> None:
        if expandable is None:
            return

        free_device()
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")


def remedy_options(label: str) -> dict[str, Any] | None:
    """How to apply a preflight remedy for real, from its label; ``None`` when it cannot be applied mechanically.

    >>> remedy_options("batch size 12")
    {'batch_size': 12}
    >>> remedy_options('precision="bf16-mixed"')
    {'precision': 'bf16-mixed'}
    >>> remedy_options("gradients set to None before forward")
    {'free_gradients': True}
    >>> remedy_options("the model.gradient_checkpointing_enable() (12 layers)") is None
    True
    """
    if match := re.fullmatch(r"batch size (\d+)", label):
        return {"batch_size": int(match[1])}
    if match := re.fullmatch(r'precision="([^"]+)"', label):
        return {"precision": match[1]}
    if label == "gradients set to None before forward":
        return {"free_gradients": True}
    return None


class FreeGradients(pl.Callback):
    """Sets every gradient to None before each forward pass (preflight's "gradients set to None before forward")."""

    def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)


def preflight_rows(case: Case, training: Training, best: int | None, budget: Budget, dry_run: bool) -> list[Row]:
    """At 1.2x the largest batch, preflight's verdict; each remedy it offers trained for 2 steps."""

    from lightning_vram import VramMonitor
    from lightning_vram.advice.preflight import candidate_changes

    section = case.name
    if best is None:
        return [Row(section, "preflight", outcome="skipped: no predicted largest batch")]
    size = math.ceil(best * 1.2)
    replay_seconds = max(min(budget.left() / 3, 30.0), 5.0)
    monitor = VramMonitor(
        console_summary=False, preflight=True, attribution_start_step=100, replay_budget_seconds=replay_seconds
    )
    outcome = "fit"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            training.fit(size, 1, [monitor])
        except torch.cuda.OutOfMemoryError:
            outcome = "OOM"
        finally:
            free_device()
    warned = any("predicted to run out of memory" in str(item.message) for item in caught)
    verdict = monitor.session.preflight_verdict
    if verdict is not None:
        labels = [(remedy.label, remedy.served is not False) for remedy in verdict.remedies]
        summary = f"needed {mib(verdict.needed_bytes)} of {mib(verdict.available_bytes)}; warned: {warned}"
    elif dry_run:  # no preflight off CUDA: the changes it would try, to exercise the path that applies them
        labels = [(change.label, True) for change in candidate_changes(case.precision, size, None, True)]
        summary = "dry run: no preflight off CUDA; its candidate changes applied"
    else:
        return [Row(section, f"preflight at batch {size}", measured=outcome, outcome="no verdict (replay skipped?)")]
    expected = "OOM" if verdict is not None and not verdict.fits else "fit"
    rows = [Row(section, f"preflight at batch {size}", expected, outcome, outcome=summary)]
    for label, served in labels:
        options = remedy_options(label)
        if options is None:
            rows.append(Row(section, f"remedy: {label}", outcome="not applied: no mechanical form"))
            continue
        if budget.spent():
            rows.append(Row(section, f"remedy: {label}", outcome="skipped: budget spent"))
            continue
        callbacks = [FreeGradients()] if options.get("free_gradients") else []
        precision = options.get("precision")
        fits = training.fits(options.get("batch_size", size), callbacks=callbacks, precision=precision)
        judged = must_fit(fits) if served else ("OOM as predicted" if not fits else "fit: predicted not to")
        rows.append(
            Row(section, f"remedy: {label}", "fit" if served else "OOM", "fit" if fits else "OOM", outcome=judged)
        )
    return rows


def model_rows(
    case: Case, seconds: float, dry_run: bool, deviceless: Deviceless, traces: Path | None = None
) -> list[Row]:
    """Every row of one model, within ``seconds``; a row that raises is printed as its error and the rest goes on.

    ``deviceless``: the models' predictions without the device, read for this one's rows.
    """
    budget = Budget(seconds)
    training = Training(case, dry_run)
    rows: list[Row] = []
    simulation = None
    steps: list[tuple[str, Callable[[], list[Row]]]] = []

    def calibration() -> list[Row]:
        nonlocal simulation
        slug = re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-")
        trace = traces / f"{slug}-b{case.batch_size}-monitored.pickle" if traces is not None else None
        simulation, found = monitored(case, training, budget, trace)
        return found

    steps.append(("per-phase peaks", calibration))
    steps.append(("predict without the device", lambda: deviceless_rows(case, simulation, deviceless, budget, dry_run)))
    steps.append(("largest batch", lambda: batch_rows(case, training, simulation, budget, dry_run, traces)))
    steps.append(
        (
            "preflight",
            lambda: preflight_rows(case, training, largest_batch(simulation, dry_run, case)[0], budget, dry_run),
        )
    )
    for name, step in steps:
        if budget.spent():
            rows.append(Row(case.name, name, outcome="skipped: the model's budget is spent"))
            continue
        rows += guarded(case.name, name, step)
    return rows


def guarded(section: str, name: str, step: Callable[[], list[Row]]) -> list[Row]:
    """``step``'s rows, or one row with the error it raised (the check goes on)."""
    try:
        return step()
    except Exception as error:  # noqa: BLE001  # a check of everything: one row's failure is that row's result
        free_device()
        return [
            Row(
                section,
                name,
                outcome=f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}",
            )
        ]


# ---- the table -------------------------------------------------------------------------------------------------


def markdown(rows: list[Row], header: str) -> str:
    """The rows as one Markdown table under ``header``."""
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = (row.section, row.row, row.predicted, row.measured, row.error, row.outcome)
        lines.append("| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> Iterator[dict[str, str]]:
    """The rows of a table :func:`markdown` wrote, each as ``{column: cell}`` (for the dry run's test)."""
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| section |"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            yield dict(zip(COLUMNS, cells, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument(
        "--traces",
        type=Path,
        help="record an allocator trace of each monitored fit, largest-batch fit and fit 5%% above it in this folder"
        " (tests/data/gpu-traces' format); each but the monitored fits' is replayed through the allocator model in"
        " a row of its own; the GPU tests that compare the replay with the allocator write theirs (with Python"
        " stacks) under gpu-tests/; GPU only",
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="every row on the CPU with tiny models (no GPU)")
    parser.add_argument(
        "--total-seconds", type=float, default=420.0, help="wall budget for everything, seconds (default 420)"
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["tests", "overhead", "models"], help="sections to leave out"
    )
    arguments = parser.parse_args()

    dry_run = arguments.cpu_dry_run
    if not dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU, or pass --cpu-dry-run")
    warnings.filterwarnings("ignore")
    started = time.monotonic()
    total = arguments.total_seconds
    device = "CPU dry run (no GPU figure asserted)" if dry_run else torch.cuda.get_device_name()
    rows: list[Row] = []

    def table() -> str:
        header = (
            f"### gpu_check: {device}; torch {torch.__version__};"
            f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {time.monotonic() - started:.0f} s"
        )
        return markdown(rows, header)

    def publish() -> None:  # after each section, so that a run stopped from outside keeps what it found
        if arguments.out is not None:
            arguments.out.write_text(table())

    if "tests" not in arguments.skip:
        log = arguments.out.with_name("gpu_tests.log") if arguments.out is not None else None
        rows += guarded("GPU tests", "pytest", lambda: gpu_test_rows(Budget(0.25 * total), log, arguments.traces))
        publish()
    if "overhead" not in arguments.skip:
        rows += guarded("overhead", "benchmark", lambda: overhead_rows(Budget(0.2 * total), dry_run))
        publish()
    if "models" not in arguments.skip:
        models = cases(dry_run)
        deviceless = Deviceless(dry_run)
        try:
            for index, case in enumerate(models):
                left = total - (time.monotonic() - started)
                share = MODEL_WEIGHTS[index] / sum(MODEL_WEIGHTS[index:])
                rows += model_rows(case, max(left * share, 1.0), dry_run, deviceless, arguments.traces)
                publish()
        finally:
            deviceless.stop()
    print(table())
    publish()


if __name__ == "__main__":
    main()
