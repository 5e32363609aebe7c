"""Advice for one run: the preflight check before step 0, the replay of the first sampled step, the OOM diagnosis.

Replays run the user's step under fake tensors (host time only, within ``replay_budget_seconds``); the advice itself
comes from :func:`~lightning_vram.advice.rules.advise` on the run's summary, set-up and replay. A batch larger than
any replayed (by :data:`GROWTH`) is replayed too, at most :data:`MAX_WORST_REPLAYS` times a run: the advice then
refers to it, and on CUDA a replayed peak beyond the device's memory warns at that step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_vram._guard import Guard, Part
from lightning_vram.advice.catalogue import SHARDING_STRATEGIES
from lightning_vram.advice.oom import diagnose
from lightning_vram.advice.preflight import candidate_changes, preflight, replay_resized
from lightning_vram.advice.rules.registry import advise
from lightning_vram.advice.trials import try_changes, try_rank_changes, unsupported
from lightning_vram.config import MonitorConfig
from lightning_vram.exceptions import warn
from lightning_vram.measure.compiled import compiled_module_names
from lightning_vram.measure.ddp import find_ddp, predicted_buckets, replay_refusal
from lightning_vram.measure.live import outside_dispatch_modes
from lightning_vram.measure.probes import Probe
from lightning_vram.measure.saved_hooks import saved_tensor_hooks_active
from lightning_vram.measure.storages import model_state_bytes
from lightning_vram.measure.tensors import batch_size_of, iter_tensors
from lightning_vram.measure.tracker import MemoryTracker
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.batches import length_shape, reference_shape, shape_dimension, shape_length
from lightning_vram.prediction.replay.known_values import TakenValues
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.replay.step import StepFunction
from lightning_vram.prediction.strategies.live import LiveSharding, live_sharding, unsharded_optimizer
from lightning_vram.prediction.strategies.rank_replays import RankReplays
from lightning_vram.records import (
    Advice,
    AllocatorReading,
    Attribution,
    BatchShapes,
    Breakdown,
    DeviceInfo,
    LengthPeak,
    OomDiagnosis,
    Phase,
    PhasePeak,
    PreflightVerdict,
    RankPreflight,
    ReplayedStep,
    RunSummary,
    Simulation,
    StrategyBuffers,
    TrainingSetup,
)
from lightning_vram.render.text import (
    preflight_warning,
    ranks_preflight_warning,
    shape_mismatch_warning,
    worst_batch_warning,
)
from lightning_vram.session.context import RunContext

GROWTH = 1.1
"""How much larger (in elements) than every batch replayed so far a batch must be to be replayed too."""
MAX_WORST_REPLAYS = 3
"""How many times a run replays a new largest batch after its first replay."""
DDP_NAME = "ddp"
"""A DDP rank's strategy as the simulation names it (``Simulation.strategy_name``, as ``StrategySpec`` names it)."""


class Advisor:
    """The run's replays and advice.

    Args:
        config: the monitor's settings (``preflight``, ``replay_budget_seconds``, ``attribution_start_step``).
        guard: the run's guard (:attr:`~lightning_vram._guard.Part.REPLAY`).
        context: the run's model, optimizers, device, set-up and step function.
    """

    def __init__(self, config: MonitorConfig, guard: Guard, context: RunContext) -> None:
        self._config, self._guard, self._context = config, guard, context
        self.simulation: Simulation | None = None
        """The replay of the run's sampled step and of each change tried on it (``None`` before it ran)."""
        self.preflight_verdict: PreflightVerdict | None = None
        """The first step replayed against the device's free memory before it ran (CUDA, ``preflight=True``)."""
        self.preflight_ranks: tuple[RankPreflight, ...] = ()
        """Every rank's preflight verdict as the ranks agreed on it before step 0 (this rank's alone without a
        gather); empty before preflight."""
        self._preflight_warning: str | None = None  # this rank's own warning, given once the ranks have agreed
        self._preflight_shape: tuple[tuple[int, ...] | None, int | None] = (None, None)
        self._preflight_batch_bytes = 0  # the first batch's own bytes, alive beside its resized copy in preflight
        self._shape_dimension: int | None = None  # the dimension max_shape's predicted row is read along
        self.replayed_step: int | None = None
        """The step whose batch :attr:`simulation` replayed."""
        self.lengths: list[LengthPeak] = []
        """Each batch length replayed (or predicted for ``max_length`` or ``max_shape``) with its peak."""
        self._taken_elements: int | None = None  # the most elements of a batch counted (and replayed) so far
        self._worst_replays = 0

    def preflight(
        self, batch: Any, reading: AllocatorReading | None, probe: Probe | None, device: DeviceInfo
    ) -> RankPreflight:
        """Before the first step: replay it (resized to the largest shape expected) and on CUDA judge if it fits.

        The largest shape is ``max_shape``, else the one the longest length means: ``max_length``, else the
        DataLoader's own (see :meth:`_expected`). On the CPU only that shape is replayed, for the report's peak per
        length: nothing is said about fitting. Under several processes this rank's own step is replayed: DDP's with
        its gradient buckets held, a DeepSpeed ZeRO, FSDP2 or FSDP1 rank's as :class:`RankReplays` predicts it. Returns
        this rank's row for the ranks to agree on; :meth:`warn_preflight` warns once they have.
        """
        with outside_dispatch_modes():  # a dispatch mode of the user's spanning the step sees none of the replay's ops
            outcome = self._preflight(batch, reading, probe, device)
        verdict = outcome if isinstance(outcome, PreflightVerdict) else None
        self.preflight_verdict = verdict
        self._preflight_warning = None
        if verdict is not None and not verdict.fits:
            shape, length = self._preflight_shape
            where = f"{device.name} ({device.type}:{device.index})"
            if self._config.max_shape is not None:
                self._preflight_warning = preflight_warning(verdict, where, shape=shape)
            else:
                self._preflight_warning = preflight_warning(verdict, where, length)
        if isinstance(outcome, ReplayedStep):
            outcome = "no free memory to fit on: the step was replayed for the peak per length only"
        return RankPreflight.of(self._context.rank, outcome)

    def warn_preflight(self, agreed: tuple[RankPreflight, ...]) -> None:
        """Warn once, as every rank agreed: the ranks predicted not to fit, then this rank's own verdict and remedies.

        One process (or ranks that could not gather): this rank's own warning alone. Every rank of a gathered run
        warns the same first sentence, naming each rank that does not fit with its figures.
        """
        self.preflight_ranks = agreed
        own = self._preflight_warning
        if len(agreed) > 1 and any(row.fits is False for row in agreed):
            text = ranks_preflight_warning(agreed, self._context.rank, own)
            warn(f"{self._guard.owner}: {text}")
        elif own is not None:
            warn(f"{self._guard.owner}: {own}")

    def _preflight(
        self, batch: Any, reading: AllocatorReading | None, probe: Probe | None, device: DeviceInfo
    ) -> PreflightVerdict | ReplayedStep | str:
        """The rank's first step replayed against its device's memory; on the CPU, resized; or why it was not."""
        context, config = self._context, self._config
        budget, on_cuda = config.replay_budget_seconds, device.type == "cuda"
        if not config.preflight or budget <= 0:
            return "preflight is off (preflight=False or replay_budget_seconds=0)"
        model, step_function = context.model, context.step_function
        if probe is None or model is None or context.read_setup is None or step_function is None:
            return "no step to replay (no probe, model, set-up or step function)"
        if compiled_module_names(model):  # replaying compiled graphs on fake tensors would make them recompile
            return "torch.compile: replaying compiled graphs under fake tensors would make them recompile"
        if saved_tensor_hooks_active():  # the user's pair would pack the replay's fake tensors
            return "a saved-tensor-hook pair of the user's is active: it would pack the replay's fake tensors"
        training = self._guard.call(Part.REPLAY, context.setup)
        if training is None:
            return "the training set-up could not be read"
        shape, length = self._preflight_shape = self._expected(batch, training)
        self._preflight_batch_bytes = _batch_bytes(batch)
        if not (on_cuda or length is not None):
            return f"no device memory to fit on ({device.type}) and no longest batch to replay"

        def replay() -> PreflightVerdict | ReplayedStep | str:
            predictor = self._preflight_replays(batch, training, shape, device)
            if isinstance(predictor, str):
                return predictor
            free = probe.free_bytes() if on_cuda else None
            if free is None or reading is None:
                if length is None:
                    return "the device's free memory is not known"
                return replay_resized(predictor)
            changes = candidate_changes(
                training.precision,
                batch_size_of(batch),
                device.compute_capability,
                training.lightning_zeroes_gradients,
            )
            return preflight(
                predictor,
                reading=reading,
                free_bytes=free,
                changes=changes,
                own_accumulation=not training.lightning_accumulates,
            )

        result = self._guard.call(Part.REPLAY, replay)
        if result is None:
            return "the replay failed, or replays were switched off by an earlier failure (warned)"
        step = result.step if isinstance(result, PreflightVerdict) else result
        if isinstance(step, ReplayedStep) and length is not None:
            self.lengths.append(LengthPeak(length, step.reported_bytes(step.reported_peak), None))
        return result

    def _preflight_replays(
        self, batch: Any, training: TrainingSetup, shape: tuple[int, ...] | None, device: DeviceInfo
    ) -> Predictor | RankReplays | str:
        """The rank's first step to replay: one process's, DDP's with its buckets, a sharded rank's; or why not.

        A sharded rank is a ZeRO, FSDP2 or FSDP1 one, as :class:`RankReplays` predicts it.

        Each replay warms up one step of its own first, so the gradients and optimizer state of step 1 on exist.
        """
        context, budget = self._context, self._config.replay_budget_seconds
        model, step_function = context.model, context.step_function
        assert model is not None
        assert step_function is not None
        sharding = live_sharding(context.current_optimizers(), model, context.rank)
        if isinstance(sharding, str):
            return sharding
        if isinstance(sharding, LiveSharding):
            optimizers = _unsharded_optimizers(sharding, model)
            strategy: StrategyBuffers | None = None
        elif training.world_size > 1 and training.strategy in SHARDING_STRATEGIES:
            return (
                f"{training.strategy}: a live rank of this sharded strategy is not predicted yet"
                " (ZeRO, FSDP2 and FSDP1 are)"
            )
        else:
            buffers = self._strategy(training)
            if isinstance(buffers, str):
                return buffers
            optimizers, strategy = context.current_optimizers(), buffers
        predictor = Predictor(
            model,
            optimizers,
            batch,
            precision=training.precision,
            step_function=step_function,
            warm_up=True,
            shape=shape,
            budget_seconds=budget,
            compute_capability=device.compute_capability,
            strategy=strategy,
            accumulate=training.accumulate_grad_batches,
            autocast_cache=training.autocast_caches,
            fabric_forward=training.fabric_forward,
        )
        if isinstance(sharding, LiveSharding):
            return RankReplays(predictor, sharding.spec, sharding.settings, context.rank, sharding.units)
        return predictor

    def _expected(self, batch: Any, training: TrainingSetup) -> tuple[tuple[int, ...] | None, int | None]:
        """The largest shape expected past the batch dimension, and its length in the report's peak per length.

        ``max_shape``; else the shape the longest length means (``max_length``, else the DataLoader's own: a sampler
        that lists every sample's length, a transformers collator padding to its ``max_length``). ``(None, None)``
        when none is known, or when ``max_shape`` does not fit the batch's dimensions (warned once: the first step
        is checked as it is). A length without a shape (a batch of vectors) is replayed as it is.
        """
        config = self._config
        if config.max_shape is None:
            length = config.max_length or training.longest_sample
            return (length_shape(batch, length) if length is not None else None), length
        old = reference_shape(batch)
        if old is None or len(old) != len(config.max_shape):
            warning = shape_mismatch_warning(config.max_shape, old)
            warn(f"{self._guard.owner}: {warning}")
            return None, None
        self._shape_dimension = shape_dimension(old, config.max_shape)
        return config.max_shape, shape_length(old, config.max_shape)

    def _along_max_shape(self, batch: Any, length: int | None) -> int | None:
        """A replayed batch's ``length`` in the report's peak per length, read as ``max_shape``'s row is read.

        Under ``max_shape`` the predicted row holds the size along the first dimension it changes
        (:func:`~lightning_vram.prediction.replay.batches.shape_length`): a U-Net's images ``(8, 3, 64, 64)`` under
        ``max_shape=(3, 128, 128)`` were listed as "128" (height) beside "3" (their channels, the batch's dimension
        1). The replayed batch's row is its size along that same dimension (64), the one the first batch's preflight
        read; ``length`` without ``max_shape``.
        """
        expected = self._config.max_shape
        shape = reference_shape(batch)
        if expected is None or shape is None or len(shape) != len(expected):
            return length
        dimension = self._shape_dimension
        return shape[shape_dimension(shape, expected) if dimension is None else dimension]

    def worth_counting(self, elements: int) -> bool:
        """Whether a new largest batch of ``elements`` is worth counting (and replaying, where replays run).

        After the run's first sampled step, one at least :data:`GROWTH` times the largest taken so far, at most
        :data:`MAX_WORST_REPLAYS` times a run. It is counted even where the replay is off or cannot run the step,
        so that the report's peak is the worst batch's.
        """
        taken = self._taken_elements
        return taken is not None and self._worst_replays < MAX_WORST_REPLAYS and elements >= GROWTH * taken

    def _replays(self) -> bool:
        """Whether a replay may run now: a budget, the part on, and not a set-up the replay already could not run."""
        simulation = self.simulation
        cannot_run = simulation is not None and simulation.baseline is None
        return self._config.replay_budget_seconds > 0 and self._guard.enabled(Part.REPLAY) and not cannot_run

    def refuse(self, reason: str) -> None:
        """No step of this run may be replayed, for ``reason``: the report's simulation says so (unless one ran)."""
        if self.simulation is None:
            self.simulation = Simulation(self._context.device.type, None, None, reason, (), 0.0)

    def replay(
        self,
        attribution: Attribution,
        batch: Any,
        summary: Callable[[], RunSummary],
        size: tuple[int, int | None],
        worst: bool,
        released_late: Callable[[], Mapping[Phase, int]],
        values: TakenValues | None = None,
    ) -> None:
        """Replay a counted step and every change the rules could advise.

        The first sampled step past step 0 (under gradient accumulation, past the first window: its optimizer state
        exists), then a step whose batch is larger than any replayed (``worst``).

        ``size`` is the batch's elements and its length (``None``: no varying dimension), for the per-length table.
        ``released_late``: of each of the step's live peaks, the bytes another thread freed late (read when the
        replay is set against the step: :attr:`~lightning_vram.prediction.predictor.Predictor.released_late`).
        ``values``: the batch's values as the step started (``Predictor(batch_values=...)``).
        """
        context, budget = self._context, self._config.replay_budget_seconds
        model = context.model
        elements, length = size
        self._taken_elements = max(elements, self._taken_elements or 0)
        self._worst_replays += worst
        if model is None or context.read_setup is None or attribution.step < 1 or not self._replays():
            return

        def replay() -> Simulation | None:
            training = context.setup()
            if training is None or attribution.step < training.accumulate_grad_batches:
                return None  # under accumulation, a micro-batch after the first optimizer step: its state exists
            step_function = context.step_function
            sharding = live_sharding(context.current_optimizers(), model, context.rank)
            if isinstance(sharding, LiveSharding):
                name = sharding.spec.name  # the report names the strategy for lightning-vram diff
                reason = unsupported(model, training, step_function, per_rank=True)
                if reason is not None or step_function is None:
                    return Simulation(context.device.type, None, None, reason, (), 0.0, strategy_name=name)
                simulated = self._rank_simulation(
                    sharding, attribution, batch, summary(), training, step_function, released_late
                )
                return replace(simulated, strategy_name=name)
            strategy = self._strategy(training)
            reason = (
                (sharding if isinstance(sharding, str) else None)
                or unsupported(model, training, step_function)
                or (strategy if isinstance(strategy, str) else None)
            )
            if reason is not None or step_function is None:
                return Simulation(context.device.type, None, None, reason, (), 0.0)
            run = summary()
            measured = _sampled_peaks(run, attribution.step)
            settings = run_settings() if measured is not None else None
            predictor = Predictor(
                model,
                context.current_optimizers(),
                batch,
                precision=training.precision,
                device=context.device,
                step_function=step_function,
                budget_seconds=budget,
                calibration=attribution,
                released_late=released_late,
                compute_capability=run.device.compute_capability,
                allocator=settings if isinstance(settings, AllocatorSettings) else None,
                measured=measured,
                strategy=strategy if isinstance(strategy, StrategyBuffers) else None,
                accumulate=training.accumulate_grad_batches,
                autocast_cache=training.autocast_caches,
                fabric_forward=training.fabric_forward,
                batch_values=values,
            )
            simulated = try_changes(predictor, run, training, context.rank)
            return replace(simulated, strategy_name=DDP_NAME) if isinstance(strategy, StrategyBuffers) else simulated

        with outside_dispatch_modes():  # a dispatch mode of the user's spanning the step sees none of the replay's ops
            simulation = self._guard.call(Part.REPLAY, replay)
        if simulation is None:
            return
        baseline = simulation.baseline
        if self.simulation is None or (baseline is not None and simulation.skipped is None):
            self.simulation, self.replayed_step = simulation, attribution.step  # the advice follows the worst batch
        if baseline is None:
            return
        peak_bytes = baseline.reported_bytes(baseline.reported_peak)
        length = self._along_max_shape(batch, length)
        if length is not None:
            self.lengths.append(LengthPeak(length, peak_bytes, attribution.step))
        run = summary()
        if worst:
            self._expected_again(batch, run.device)
        total = run.device.total_bytes
        if worst and run.on_cuda and total and baseline.peak.peak_bytes > total:
            warning = worst_batch_warning(attribution.step, length, baseline.peak.peak_bytes, total)
            warn(f"{self._guard.owner}: {warning}")

    def _expected_again(self, batch: Any, device: DeviceInfo) -> None:
        """The largest shape expected (``max_length``, ``max_shape``) replayed again from a worst batch's values.

        Preflight resized the first batch, tiling its values: a step that reads them takes that batch's branch. A
        trial's GPT-NeoX, whose first batch had no padding (a mask of ones: transformers builds no attention mask),
        was predicted at 132.2 MiB for 512 tokens where its padded batches of 512 measured 148.2 MiB. The predicted
        row keeps the higher of the two replays, each with the first batch alive beside the resized one, as preflight
        counts it (this replay's own batch, alive instead, is exchanged for it): where the values choose no branch
        (images), the two agree and the row stays.
        """
        shape, expected = self._preflight_shape
        rows = [index for index, row in enumerate(self.lengths) if row.step is None]
        context = self._context
        if shape is None or expected is None or not rows or context.model is None or context.step_function is None:
            return
        training = self._guard.call(Part.REPLAY, context.setup)
        if training is None:
            return

        def replay() -> int | None:
            predictor = self._preflight_replays(batch, training, shape, device)
            if isinstance(predictor, str):
                return None
            step = replay_resized(predictor)
            if not isinstance(step, ReplayedStep):
                return None
            return step.reported_bytes(step.reported_peak) - _batch_bytes(batch) + self._preflight_batch_bytes

        with outside_dispatch_modes():
            peak_bytes = self._guard.call(Part.REPLAY, replay)
        index = rows[0]
        if peak_bytes is not None and peak_bytes > self.lengths[index].peak_bytes:
            self.lengths[index] = replace(self.lengths[index], peak_bytes=peak_bytes)

    def _rank_simulation(
        self,
        sharding: LiveSharding,
        attribution: Attribution,
        batch: Any,
        run: RunSummary,
        training: TrainingSetup,
        step_function: StepFunction,
        released_late: Callable[[], Mapping[Phase, int]],
    ) -> Simulation:
        """A rank of a sharded run, this process's: the unsharded step replayed, as the per-rank model predicts it.

        Each rank decides on its own, with no collective; the replay warms up one step of its own so that the
        optimizer state the model sizes exists.
        """
        model = self._context.model
        assert model is not None
        predictor = Predictor(
            model,
            _unsharded_optimizers(sharding, model),
            batch,
            precision=training.precision,
            device=self._context.device,
            step_function=step_function,
            warm_up=True,
            budget_seconds=self._config.replay_budget_seconds,
            calibration=attribution,
            released_late=released_late,
            compute_capability=run.device.compute_capability,
            accumulate=training.accumulate_grad_batches,
            autocast_cache=training.autocast_caches,
            fabric_forward=training.fabric_forward,
        )
        replays = RankReplays(predictor, sharding.spec, sharding.settings, self._context.rank, sharding.units)
        return try_rank_changes(replays, run, training)

    def _strategy(self, training: TrainingSetup) -> StrategyBuffers | str | None:
        """What the strategy holds beyond the step for a replay to hold, or why the replay cannot add it.

        ``None`` for one process; DDP's gradient buckets by its arithmetic; a multi-process run without a DDP
        wrapper (or one whose buffers are not modelled) cannot be replayed per rank.
        """
        if training.world_size <= 1:
            return None
        ddp = find_ddp(self._context.wrapped_by())
        if ddp is None:
            return "distributed training: the replay runs one process"
        return replay_refusal(ddp) or predicted_buckets(ddp)

    def length_peaks(self) -> tuple[tuple[int, int], ...]:
        """Each batch length replayed on a training step (tokens) with its replayed peak (bytes), shortest first."""
        return tuple(sorted((row.length, row.peak_bytes) for row in self.lengths if row.step is not None))

    def shapes(self, recorded: BatchShapes | None) -> BatchShapes | None:
        """``recorded`` with the step the advice refers to and the peak per length, shortest first."""
        if recorded is None:
            return None
        lengths = sorted(self.lengths, key=lambda row: (row.length, row.step is None, row.step or 0))
        simulation = self.simulation
        trusted = simulation is not None and simulation.skipped is None  # else the advice is modelled, from no replay
        return replace(recorded, replayed_step=self.replayed_step if trusted else None, lengths=tuple(lengths))

    def advice(self, summary: RunSummary, setup: TrainingSetup) -> tuple[Advice, ...]:
        """The advice so far."""
        return tuple(advise(summary, setup, self.simulation))

    def diagnose_oom(
        self,
        error: BaseException,
        where: str,
        phase: Phase | None,
        tracker: MemoryTracker,
        summary: RunSummary,
        snapshot: tuple[Path | None, tuple[str, ...]] | None,
        evaluation_batch: int | None = None,
    ) -> OomDiagnosis | None:
        """The rank's diagnosis of a CUDA out-of-memory ``error`` raised in ``where`` (``None`` after close).

        ``snapshot`` is the allocator history saved beside it and the notes on saving it (``None``: not recorded);
        ``evaluation_batch``: the size of the evaluation batch that ran out, where one did and it is known.
        """
        context = self._context
        model, setup = context.model, context.setup()
        if model is None or setup is None:
            return None
        parameters, gradients, state = model_state_bytes(model, context.current_optimizers(), context.device)
        latest = tracker.latest_attribution
        sampled = latest.phases.get(phase) if latest is not None and phase is not None else None
        notes: tuple[str, ...] = ()
        if sampled is None:
            notes += (
                "activations are counted in 'other': no sampled step measured this phase before the failure"
                f" (attribution_start_step={self._config.attribution_start_step})",
            )
        elif latest is not None:
            notes += (f"activations as counted on sampled step {latest.step}",)
        return diagnose(
            error_text=str(error),
            where=where,
            step=tracker.steps,
            rank=context.rank,
            model_state=Breakdown(parameters, gradients, state, sampled.activations if sampled else 0, None),
            last_reading=tracker.boundary,
            summary=summary,
            setup=setup,
            notes=notes + (snapshot[1] if snapshot is not None else ()),
            snapshot=snapshot[0] if snapshot is not None else None,
            simulation=self.simulation,
            preflight=self.preflight_verdict,
            evaluation_batch=evaluation_batch,
        )


def _unsharded_optimizers(sharding: LiveSharding, model: nn.Module) -> list[torch.optim.Optimizer] | None:
    """ZeRO's user optimizer over the unsharded parameters; ``None`` for FSDP2 and FSDP1 (built on the copy)."""
    if sharding.optimizer is None:
        return None
    return [unsharded_optimizer(sharding.optimizer, list(model.parameters()))]


def _batch_bytes(batch: Any) -> int:
    """The bytes of the batch's own tensors."""
    return sum(tensor.numel() * tensor.element_size() for tensor in iter_tensors(batch))


def _sampled_peaks(summary: RunSummary, step: int) -> dict[Phase, PhasePeak] | None:
    """The allocator's peaks of sampled step ``step`` per phase, on CUDA (``None`` elsewhere, or when not measured).

    Read from the run's last measured step, which is the sampled one when the replay runs (it is folded first).
    """
    if not summary.on_cuda:
        return None
    peaks = {peak.phase: peak for peak in summary.last_step if peak.step == step and peak.reserved_bytes is not None}
    return peaks or None
