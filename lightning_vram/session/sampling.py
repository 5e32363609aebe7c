"""Sampled steps: the tensors of a few steps counted one by one (parameters, gradients, optimizer state, activations).

A :class:`Sampler` opens a :class:`~lightning_vram.measure.accounting.StepAttributor` at the start of a sampled step,
passes it the step's phase boundaries and closes it at the step's end; what sampled steps skipped is listed in
:meth:`Sampler.notes`. On the CPU, where no allocator measures a peak, a
:class:`~lightning_vram.measure.live.LiveTensors` counts every tensor alive during the same step: each phase's live
peak, which the counted parts explain with ``other`` for the rest. Under DDP that includes its gradient buckets
(:mod:`~lightning_vram.measure.ddp`), alive from the step's start.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_vram._guard import Guard, Part
from lightning_vram.config import MonitorConfig
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.compiled import compiled_in_place
from lightning_vram.measure.ddp import find_ddp, live_buckets
from lightning_vram.measure.live import LiveTensors, dispatch_mode_active, leave_abandoned, state_tensors
from lightning_vram.measure.saved_hooks import saved_tensor_hooks_active
from lightning_vram.measure.scripted import traced_modules
from lightning_vram.prediction.containment.code_roots import code_roots, data_roots, inside_ids, instance_roots
from lightning_vram.prediction.containment.reach import reach_of
from lightning_vram.prediction.replay.step import compiled_refusal
from lightning_vram.records import Attribution, NotMeasured, Phase
from lightning_vram.session.context import RunContext

_ATTRIBUTING: weakref.WeakSet[Sampler] = weakref.WeakSet()
"""Samplers whose attributor is counting a step now (one at a time per process); a sampler dropped mid-step leaves."""

BUSY = NotMeasured(
    "tensor-by-tensor attribution on some sampled steps",
    "another monitor in this process was counting the same step (saved-tensor hooks do not nest);"
    " those steps were not counted here",
)
USER_MODE = NotMeasured(
    "tensor-by-tensor attribution on some sampled steps",
    "a dispatch mode of the training code's (an op counter, a FlopCounterMode) was active when the step began: the"
    " monitor's saved-tensor hooks would change the ops it sees (autograd saves tensors differently under them);"
    " those steps were not counted",
)
USER_HOOKS = NotMeasured(
    "tensor-by-tensor attribution on some sampled steps",
    "saved-tensor hooks of the training code's (around fit, a callback's, save_on_cpu) were active when the step"
    " began: torch runs only the innermost pair, and the monitor's would replace them; those steps were not counted",
)
LIVE_PEAK = "the live peak (every tensor alive) of some sampled steps"
"""What a sampled step whose live count stood aside did not measure: its peaks are the sums of the counted parts."""


class Sampler:
    """Counts the sampled steps of one run tensor by tensor.

    Args:
        config: the monitor's settings (which steps are sampled).
        guard: the run's guard (:attr:`~lightning_vram._guard.Part.ATTRIBUTION`).
        context: the run's model, optimizers, device and step function.
    """

    def __init__(self, config: MonitorConfig, guard: Guard, context: RunContext) -> None:
        self._config, self._guard, self._context = config, guard, context
        self.attributor: StepAttributor | None = None
        """The attributor counting a step now."""
        self._live: LiveTensors | None = None  # the CPU's live count of the same step
        self._stopped_live: LiveTensors | None = None  # the last step's, watching for late releases until forgotten
        self._live_phase = Phase.FORWARD
        self._notes: dict[str, NotMeasured] = {}  # what sampled steps skipped, shared with the attributors
        self._compiled_note: NotMeasured | None = None
        self._aside: bool | None = None  # whether the training code rules counting out (decided once, then noted)
        self._compiled_code: tuple[str, ...] = ()  # what torch.compile made that the training code calls, once read
        self.replay_refusal: str | None = None
        """Why no step of this run may be replayed, found by the walk :meth:`begin` makes (``None``: none found)."""
        self.next_step: int | None = config.attribution_start_step
        """The next sampled step (``None``: none): :meth:`begin` returns ``False`` on any step before it."""

    def sample_at(self, step: int) -> None:
        """Sample ``step`` too, unless a step scheduled before it comes first (the schedule goes on after it)."""
        scheduled = self.next_step
        self.next_step = step if scheduled is None else min(step, scheduled)

    def begin(self, step: int, batch: Any, count_live: bool = False, force: bool = False) -> bool:
        """Step ``step`` (0-based) starts: count it when it is sampled. Returns whether it is sampled (and on).

        ``count_live``: also count every live tensor (no allocator measures this step's peaks, as on the CPU).
        ``force`` counts it whatever the schedule (a batch larger than any replayed, replayed at its end).
        """
        sampled = self.next_step
        if sampled is not None and step >= sampled:
            if step > sampled:  # steps restored from a checkpoint
                sampled = self._config.next_sampled_step(step)
            self.next_step = self._config.next_sampled_step(step + 1) if sampled == step else sampled
        elif not force:  # every step but a few ends here
            return False
        if (sampled != step and not force) or not self._guard.enabled(Part.ATTRIBUTION):
            return False
        model = self._context.model
        if model is None or self._stands_aside(model):
            return True
        if any(other is not self for other in _ATTRIBUTING):  # saved-tensor hooks do not nest
            self._notes.setdefault("busy", BUSY)
            return True
        leave_abandoned()  # no other sampler counts now (checked above): a live count left on the stack is abandoned
        if dispatch_mode_active():  # the user's mode would see autograd save differently: stand aside, decided now
            self._notes.setdefault("user-mode", USER_MODE)
            return True
        if saved_tensor_hooks_active():  # the monitor's pair would replace the user's: stand aside, decided now
            self._notes.setdefault("user-hooks", USER_HOOKS)
            return True
        context = self._context
        started: list[StepAttributor] = []

        def open_attributor() -> StepAttributor:
            attributor = StepAttributor(step, model, context.current_optimizers(), context.device, self._notes)
            started.append(attributor)
            attributor.begin_forward(batch)
            return attributor

        attributor = self._guard.call(Part.ATTRIBUTION, open_attributor)
        if attributor is None:  # saved-tensor hooks refused, a model it cannot read: let go of what it hooked
            for opened in started:
                opened.close()
            return True
        self.attributor = attributor
        _ATTRIBUTING.add(self)
        if count_live:
            self._start_live(model, context, batch, attributor)
        if attributor.compiled and self._compiled_note is None:
            self._compiled_note = NotMeasured(
                "per-module activations inside compiled modules",
                f"{', '.join(attributor.compiled)} run(s) as torch.compile graphs: their saved tensors are counted"
                " and charged to the compiled module as a whole",
            )
        return True

    def _start_live(self, model: nn.Module, context: RunContext, batch: Any, attributor: StepAttributor) -> None:
        """Count every tensor alive on the device during this step, unless torch.compile or torch.jit.trace is at work.

        A compiled module or function would run differently under a dispatch mode (dynamo runs a compiled function
        eagerly there: it rounds differently): the step's peaks stay the sums of the counted parts (noted). (No
        dispatch mode is active here: :meth:`begin` stood aside for the step otherwise.) A traced module's graph
        holds what tracing saw as constants, and under a dispatch mode some of its ops raise (an ``aten::equal`` fed
        an int): the live count stands aside for it too, so training runs as it does without the monitor.
        """
        traced = traced_modules(model)
        if attributor.compiled or self._compiled_code or traced:
            if attributor.compiled:
                why = "torch.compile runs part of the model"
            elif traced:
                why = f"{traced[0]} is a torch.jit.trace module, whose graph can raise under a dispatch mode"
            else:
                first, *more = self._compiled_code
                also = f" and {len(more)} more" if more else ""
                why = f"the training code calls {first}{also}, compiled by torch.compile"
            self._notes.setdefault(
                "live",
                NotMeasured(LIVE_PEAK, f"{why}: the live count stood aside, those peaks are the counted parts"),
            )
            return

        def start() -> LiveTensors:
            live = LiveTensors(context.device)
            live.track(state_tensors(model, context.current_optimizers(), batch))
            ddp = find_ddp(context.wrapped_by())
            if ddp is not None:  # its buckets are alive from the step's start, held where no tensor reaches them
                live.hold(live_buckets(ddp))
            live.start()
            return live

        self._live_phase = Phase.FORWARD
        self._live = self._guard.call(Part.ATTRIBUTION, start)

    def _close_live_segment(self, ended: Phase, next_phase: Phase) -> None:
        """The segment that ran ``ended`` closes (as the attributor closes it); ``next_phase`` runs next."""
        live = self._live
        if live is not None:
            live.close_segment(ended)
            self._live_phase = next_phase

    def _stop_live(self, attribution: Attribution | None) -> Attribution | None:
        """Stop the live count; ``attribution`` with each phase's live peak as ``other`` (unchanged if not whole)."""
        live, self._live = self._live, None
        if live is None:
            return attribution
        live.close_segment(self._live_phase)
        whole = live.stop()
        if attribution is None:
            live.forget()
            return None
        self.forget_late_releases()
        self._stopped_live = live
        if not whole or any(phase not in live.phase_peaks for phase in attribution.phases):
            self._notes.setdefault(
                "live",
                NotMeasured(
                    LIVE_PEAK,
                    "the live count did not see the whole step (a dispatch mode entered in it stayed active, or"
                    " counting failed): those peaks are the counted parts",
                ),
            )
            return attribution
        phases = {
            phase: counted.with_measured_peak(live.phase_peaks[phase]) for phase, counted in attribution.phases.items()
        }
        return dataclasses.replace(attribution, phases=phases)

    def _stands_aside(self, model: nn.Module) -> bool:
        """Whether the training code uses saved-tensor-hook APIs the attribution's hooks would break or miss.

        Decided once per run, before any sampled step, from the code (the model's classes and what its instances
        hold, the step function, the optimizers), never by running it: ``torch.func.grad`` and ``vjp`` refuse to run
        under saved-tensor hooks, ``disable_saved_tensors_hooks`` refuses them, the code's own hooks hide what they
        pack; the report says so. The same walk finds what ``torch.compile`` made that the code calls: as for a
        compiled module, the live count stands aside for it (:meth:`_start_live`), and no step is replayed
        (:attr:`replay_refusal`).
        """
        if self._aside is None:
            context = self._context
            roots = [*code_roots(model, context.step_function, context.current_optimizers()), *instance_roots(model)]
            reach = reach_of(roots, inside_ids(model), data_roots(model))
            hook_apis = sorted(reach.hook_apis)
            if hook_apis:
                self._notes["hook-apis"] = NotMeasured(
                    "tensor-by-tensor attribution (parts, activations per module)",
                    f"the training code uses {', '.join(hook_apis)}, which the monitor's saved-tensor hooks"
                    " would break or not see: sampled steps were not counted tensor by tensor",
                )
            if reach.compiled:
                self._compiled_code = tuple(reach.compiled)
                self.replay_refusal = compiled_refusal(reach.compiled[0])
            in_place = [name or "the model" for name, child in model.named_modules() if compiled_in_place(child)]
            if in_place:  # its hooks run inside the compiled graph: dynamo would trace the monitor's hooks
                self._notes["compiled-in-place"] = NotMeasured(
                    "tensor-by-tensor attribution (parts, activations per module)",
                    f"{', '.join(in_place)} compiled in place (`module.compile()` or a compiled `forward`): the"
                    " monitor's hooks would run inside its compiled graph, so sampled steps were not counted tensor"
                    " by tensor",
                )
            self._aside = bool(hook_apis) or bool(in_place)
        return self._aside

    def _call(self, method: Callable[[StepAttributor], Any]) -> Any:
        attributor = self.attributor
        if attributor is None:
            return None

        def run() -> Any:
            if attributor.error is not None:
                raise attributor.error
            return method(attributor)

        result = self._guard.call(Part.ATTRIBUTION, run)
        if not self._guard.enabled(Part.ATTRIBUTION):
            self.close()
        return result

    def before_backward(self) -> None:
        """The counted step's backward pass is about to run."""
        if self.attributor is not None:
            self._close_live_segment(Phase.FORWARD, Phase.BACKWARD)
            self._call(StepAttributor.before_backward)

    def before_optimizer_step(self) -> None:
        """The counted step's optimizer is about to step."""
        if self.attributor is not None:
            self._close_live_segment(self._live_phase, Phase.OPTIMIZER)
            self._call(StepAttributor.before_optimizer_step)

    def after_backward(self) -> None:
        """The counted step's backward pass returned."""
        if self.attributor is not None:
            self._close_live_segment(Phase.BACKWARD, Phase.BACKWARD)
            self._call(StepAttributor.after_backward)

    def after_optimizer_step(self) -> None:
        """The counted step's optimizer update returned."""
        if self.attributor is not None:
            self._close_live_segment(Phase.OPTIMIZER, Phase.OPTIMIZER)
            self._call(StepAttributor.after_optimizer_step)

    def finish(self) -> Attribution | None:
        """The counted step ended: its counts (``None`` when no step was counted, or counting failed)."""
        if self.attributor is None:
            return None
        attribution: Attribution | None = self._call(StepAttributor.finish)
        attribution = self._stop_live(attribution)
        self.close()  # finish removed its hooks already; this frees the process-wide slot
        return attribution

    def released_late(self) -> dict[Phase, int]:
        """Of each live peak of the last counted step, the bytes another thread freed late, read now.

        Freed after the step's code had let go of them (gloo's worker thread):
        :meth:`~lightning_vram.measure.live.LiveTensors.released_late`.

        Empty where no live count ran, or after :meth:`forget_late_releases`.
        """
        live = self._stopped_live
        return live.released_late() if live is not None else {}

    def forget_late_releases(self) -> None:
        """Stop watching the last counted step's storages (once its replay has read :meth:`released_late`)."""
        live, self._stopped_live = self._stopped_live, None
        if live is not None:
            live.forget()

    def close(self) -> None:
        """Stop counting: remove the attributor's hooks (safe when none is open)."""
        attributor, self.attributor = self.attributor, None
        _ATTRIBUTING.discard(self)
        self._stop_live(None)
        if attributor is not None:
            attributor.close()

    def notes(self) -> list[NotMeasured]:
        """What sampled steps could not count, for the report's ``not_measured``."""
        compiled = [self._compiled_note] if self._compiled_note is not None else []
        return [*compiled, *self._notes.values()]
