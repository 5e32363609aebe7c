"""FSDP1 (``FullyShardedDataParallel``, flat parameters): one rank at any world size, by FSDP's arithmetic.

FSDP1 runs under torch's fake process group, with real and with fake tensors (torch 2.13: a ``FakeStore`` group of
4, the module wrapped, one step; it reads a fake tensor's ``data_ptr()`` on the way, which torch warns "will error").
The replay does not wrap its twin in it yet, so the figures here are FSDP1's arithmetic on the single-process
replay of one rank's batch, labelled so; checked against torch's FSDP1 on gloo at world sizes 2 and 4
(tests/test_rank_prediction_zero.py). Each wrapped unit (a module of the types given, the root the rest) holds one
flat parameter of its own parameters, padded to a multiple of ``N`` elements, and this rank's ``1/N`` of it between
uses (``FULL_SHARD``, ``SHARD_GRAD_OP``; ``NO_SHARD`` holds it whole and unpadded, gathers nothing and all-reduces
the gradients; ``HYBRID_SHARD`` is not modelled yet; CPU offload under ``FULL_SHARD`` and ``SHARD_GRAD_OP`` moves the
shards, their gradients and the optimizer's state to the host as lines of their own, :class:`Offloaded`):

- parameters, gradients (after the reduce-scatter) and the optimizer's state: over the units' shards, the state
  of one flat tensor per unit;
- activations: the replay's. Autograd saves views of each unit's unsharded flat parameter (the module's parameters
  are views of it while it runs), but FSDP1 frees it by ``resize_(0)`` after the unit's forward and gathers it
  again for backward, so autograd's saving holds none of its bytes: the monitor leaves it out of the activations
  (:mod:`~lightning_vram.measure.fsdp1`), and so does this model. It is in ``other`` here, every unit at its
  gathered size, as the CPU's live count meets them (it counts a storage from its first op until the storage object
  dies, and FSDP1 keeps each, only resized);
- backward's peak: the unit's unsharded gradient reduce-scattered into a shard of its own, the largest unit's;
- the optimizer step's peak: the batch, three temporaries the size of the largest shard (fitted: Adam over the
  units' flat shards on gloo), and on the CPU the unsharded flat parameters the live count met in forward
  (FSDP1 frees them by resizing their storage to zero, which a count of storages does not see).

``SHARD_GRAD_OP`` counts as ``FULL_SHARD`` on the CPU (the same figures on gloo: the count does not see either free
its unsharded parameters) and sends one all-gather fewer; on a GPU it keeps them from forward to backward, which the
allocator's peak would show (not checked here).

A live FSDP1 rank (:func:`predict_live`) is the same arithmetic on its module's unsharded copy
(:mod:`~lightning_vram.prediction.replay.unsharded`), sized by the run's own flat parameters and sharding strategy
(:func:`live_flats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vram.measure.fsdp1 import flat_parameters, fsdp1_wrappers
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies._shards import (
    batch_bytes,
    flat_state_bytes,
    optimizer_like,
    other_bytes,
    padded,
    phase_peak,
    shard_communication,
    step_optimizer,
)
from lightning_vram.prediction.strategies.deepspeed import FIRST_MICRO_BATCH, element_bytes
from lightning_vram.records import (
    Phase,
    PhasePeak,
    PrecisionChange,
    RankLine,
    RankStep,
    ReplaySkipped,
    StepChange,
    StrategySpec,
)

METHOD = (
    "arithmetic on the single-process replay: FSDP1's flat parameters per wrapped unit, padded to N and sharded"
    "; FSDP1 runs under the fake process group, the replay does not wrap it yet"
)
"""How an FSDP1 rank is predicted."""
GATHERS = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 1, "NO_SHARD": 0}
"""All-gathers of the parameters per step under each sharding modelled (FULL_SHARD gathers again for backward)."""
OPTIMIZER_TEMPORARIES = 3
"""Temporaries the size of the largest flat shard at the optimizer step's peak (fitted on gloo with Adam)."""


LIVE_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
"""The sharding strategies of a live FSDP1 run that are modelled (``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2``
shard within a node and replicate across: not yet)."""


LIVE_OFFLOAD_SKIP = (
    "fsdp (FSDP1) with CPU offload: a live rank is not modelled yet (FSDP1 pins its offloaded shards, which torch"
    " refuses without an accelerator, so no CPU run checks it)"
)
"""Why a live FSDP1 rank offloading its parameters is not replayed (torch 2.13 on a CPU-only machine:
``RuntimeError: Cannot access accelerator device when none is available`` from ``pin_memory`` in
``FlatParamHandle``'s init): :func:`predict_units`'s arithmetic predicts it from a plan, unchecked."""


@dataclass(frozen=True)
class LiveFlats:
    """A live FSDP1 run's flat parameters as the run made them, and its optimizer.

    ``numels``: each flat parameter's elements before FSDP1 pads it to the world size (``_unpadded_unsharded_size``:
    the unit's parameters, with ``use_orig_params=True`` the alignment padding between them). ``optimizer``: the
    run's (its class and first group's settings): the replay builds one like it on its copy's whole parameters where
    the module has no ``configure_optimizers``, and it sizes the state per flat shard.
    """

    numels: tuple[int, ...]
    optimizer: torch.optim.Optimizer | None = None


def live_flats(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[str, LiveFlats] | str:
    """A live FSDP1 ``module``'s sharding strategy's name and flat parameters; or why it is not modelled (a reason).

    Read from its wrappers' settings (``sharding_strategy``, ``cpu_offload``) and its flat parameters; nothing is
    changed, no collective runs.
    """
    wrappers = fsdp1_wrappers(module)
    strategies = {getattr(wrapper.sharding_strategy, "name", str(wrapper.sharding_strategy)) for wrapper in wrappers}
    if any(getattr(getattr(wrapper, "cpu_offload", None), "offload_params", False) for wrapper in wrappers):
        return LIVE_OFFLOAD_SKIP
    if len(strategies) > 1:
        return f"fsdp (FSDP1) with several sharding strategies ({', '.join(sorted(strategies))}): not modelled yet"
    sharding = strategies.pop() if strategies else "FULL_SHARD"
    if sharding not in LIVE_SHARDINGS:
        return f"fsdp (FSDP1) {sharding}: a live rank is not modelled yet (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD are)"
    flats = flat_parameters(module)
    if not flats:
        return "fsdp (FSDP1): no flat parameter found on the module"
    numels = tuple(flat._unpadded_unsharded_size.numel() for flat in flats if flat.requires_grad)
    return sharding, LiveFlats(numels, optimizer)


def unit_numels(module: nn.Module, units: tuple[type[nn.Module], ...]) -> list[int]:
    """Elements of each FSDP1 unit's flat parameter, units first in module order, the root's (the rest) last.

    A unit is a module of one of ``units``' types (``ModuleWrapPolicy``); a unit inside a unit is its own.
    """
    owner: dict[int, int] = {}
    sizes: list[int] = []
    for child in module.modules():
        if child is not module and isinstance(child, units):
            sizes.append(0)
            for parameter in child.parameters():
                owner[id(parameter)] = len(sizes) - 1
    sizes.append(0)
    seen: set[int] = set()
    for parameter in module.parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            sizes[owner.get(id(parameter), len(sizes) - 1)] += parameter.numel()
    return [size for size in sizes if size]


def predict_units(
    predictor: Predictor,
    spec: StrategySpec,
    change: StepChange | None,
    units: tuple[type[nn.Module], ...] = (),
    live: LiveFlats | None = None,
    window: bool = False,
) -> RankStep | ReplaySkipped:
    """One rank of ``spec`` (FSDP1) with ``units`` wrapped (``ModuleWrapPolicy(units)``; none: the root alone).

    ``live``: a live run's flat parameters and optimizer, in place of the units' and the predictor's.
    ``window``: a later micro-batch of a window accumulated without ``no_sync`` (:func:`predict_window`).
    """
    sharding = spec.sharding or "FULL_SHARD"
    if sharding not in GATHERS or (spec.offload and sharding not in OFFLOADED):
        return ReplaySkipped(f"{spec.label}: FSDP1's {sharding} with offload={spec.offload} is not modelled yet")
    replayed = predictor.replay(change)
    if isinstance(replayed, ReplaySkipped):
        return replayed
    world = spec.world_size
    divisor = 1 if sharding == "NO_SHARD" else world  # NO_SHARD keeps each unit's flat parameter whole, unpadded
    precision = change.precision if isinstance(change, PrecisionChange) else predictor.precision
    element = next(predictor.module.parameters()).element_size()  # FSDP1 shards the parameters as they are
    gathered = element_bytes(precision) if precision.endswith("-mixed") else element  # MixedPrecision's param_dtype
    numels = list(live.numels) if live is not None else unit_numels(predictor.module, units)
    flats = [padded(numel, divisor) for numel in numels]
    shards = [flat // divisor for flat in flats]
    parameters = sum(shards) * element
    optimizer = live.optimizer if live is not None else step_optimizer(predictor)
    state = sum(flat_state_bytes(optimizer, shard) for shard in shards)
    forward = replayed.phases[Phase.FORWARD].breakdown
    assert forward is not None
    held = parameters if forward.gradients > 0 else 0  # the previous step's gradients, where the loop keeps them
    # accumulating under no_sync(): each unit keeps its unsharded gradient across the window, reduced on its last
    # micro-batch (NO_SHARD's gradients are whole anyway)
    accumulating = predictor.accumulate > 1 and divisor > 1
    if accumulating:
        held = sum(numels) * element
    unsharded = sum(flats) * gathered if divisor > 1 else 0  # NO_SHARD's parameters are the flat ones
    activations = forward.activations  # the gathered flat parameters autograd saves views of are not activations
    # the largest unit's reduce-scattered shard; a root wrapped alone reduce-scatters after its backward, its
    # activations freed (Lightning's fsdp without a wrap policy: on 2 gloo ranks a transformer LM's backward
    # peaked 13,938,064 B where this shard beside it said 14,981,932; accumulating, it is held)
    scattered = max(flats) * gathered // world if divisor > 1 and (len(flats) > 1 or window) else 0
    # the previous step's gradients, held in forward where the loop sets them to None only before backward
    # (Lightning's order: training_step, zero_grad, backward), are gone in backward; a window's are not
    backward_held = held if predictor.accumulate > 1 or window else 0
    seen_in_forward = unsharded if predictor.device_type == "cpu" else 0
    temporaries = OPTIMIZER_TEMPORARIES * max(shards) * element
    optimizer_other = batch_bytes(predictor.batch) + seen_in_forward + temporaries
    phases = {  # the live count holds each unsharded storage it met from forward on, at its gathered size
        Phase.FORWARD: ((parameters, held, state, activations), other_bytes(replayed, Phase.FORWARD) + unsharded),
        Phase.BACKWARD: (
            (parameters, backward_held, state, activations),
            other_bytes(replayed, Phase.BACKWARD) + unsharded + scattered,
        ),
        Phase.OPTIMIZER: ((parameters, parameters, state, 0), optimizer_other),
    }
    step = replayed.phases[Phase.FORWARD].step
    peaks = {phase: phase_peak(step, phase, parts, sum(parts) + other) for phase, (parts, other) in phases.items()}
    whole = sum(flats) * gathered
    lines: tuple[RankLine, ...] = (
        RankLine("FSDP1 unsharded unit (largest)", max(flats) * gathered, f"the largest unit, padded to {divisor}"),
        RankLine("FSDP1 reduce-scatter shard", scattered, "the largest unit's gradient shard, in backward"),
        RankLine("FSDP1 padding", (sum(flats) - sum(numels)) * element, f"each unit's flat parameter to {divisor}"),
    )
    if sharding == "NO_SHARD":
        sent = 2 * (world - 1) * whole // world  # an all-reduce of the gradients
    else:
        sent = shard_communication(whole, world, GATHERS[sharding] * predictor.accumulate)  # gathers each micro-batch
    method = f"{METHOD} ({sharding})"
    transfer = 0
    if spec.offload:
        # each all-gather copies the shards to the device, each reduce-scatter their gradients to _cpu_grad
        transfer = (GATHERS[sharding] * predictor.accumulate + 1) * parameters
        host = Offloaded(parameters, state, max(shards) * element, held if accumulating else 0)
        peaks = host.device_peaks(step, phases, batch_bytes(predictor.batch), predictor.device_type)
        lines = (*lines, *host.lines(divisor))
        method += f"; {OFFLOAD_METHOD}"
    notes = (*replayed.notes, *((FIRST_MICRO_BATCH,) if predictor.accumulate > 1 else ()))
    return RankStep(spec, peaks, lines, sent, method, notes, replayed, host_transfer_bytes=transfer)


OFFLOADED = ("FULL_SHARD", "SHARD_GRAD_OP")
"""The sharding strategies whose CPU offload (``CPUOffload(offload_params=True)``) is modelled (``NO_SHARD`` copies
its whole flat parameters to the device and back: not yet)."""
OFFLOAD_METHOD = (
    "CPUOffload(offload_params=True) by FSDP1's arithmetic (torch 2.13 _flat_param.py, _runtime_utils.py): each"
    " flat parameter's shard (_local_shard) and its gradient (_cpu_grad, allocated once and held) on the host, the"
    " optimizer stepping there; on the device the shard's copy for the all-gather, the unsharded unit in forward and"
    " backward, the reduce-scatter output before its copy to _cpu_grad and the activations; not checked against a"
    " run (FSDP1 offload pins memory, which a CPU-only machine refuses)"
)
"""How an FSDP1 rank with CPU offload is split between the device and the host."""


@dataclass(frozen=True)
class Offloaded:
    """What an FSDP1 rank with CPU offload holds on the host, and what it copies to the device, in bytes.

    ``parameters``: the flat parameters' shards (``_local_shard``); their gradients (``_cpu_grad``) the same size.
    ``state``: the optimizer's, over the shards. ``copied``: the largest shard, copied to the device before its
    all-gather (``FlatParamHandle.pre_unshard``: ``flat_param_to(device)``). ``window``: the unsharded gradients
    kept on the device under ``no_sync`` while accumulating (0 otherwise).
    """

    parameters: int
    state: int
    copied: int
    window: int

    def device_peaks(
        self, step: int, phases: dict[Phase, tuple[tuple[int, int, int, int], int]], batch: int, device_type: str
    ) -> dict[Phase, PhasePeak]:
        """Each phase's peak on the device: the host's parts out; the copy to the device where it is not the host.

        The optimizer steps on the host: its device peak is the batch (and under ``no_sync`` the window's
        gradients, reduced before it).
        """
        copied = self.copied if device_type != "cpu" else 0  # on the CPU the copy is the shard itself
        device = {}
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            (_, _, _, activations), other = phases[phase]
            parts = (0, self.window, 0, activations)
            device[phase] = phase_peak(step, phase, parts, sum(parts) + other + copied)
        device[Phase.OPTIMIZER] = phase_peak(step, Phase.OPTIMIZER, (0, 0, 0, 0), batch)
        return device

    def lines(self, divisor: int) -> tuple[RankLine, ...]:
        """The host lines: the shards, their gradients, the optimizer's state."""
        basis = f"{OFFLOAD_METHOD}; 1/{divisor} of each unit's flat parameter, padded"
        return (
            RankLine("FSDP1 offloaded flat parameter shards (host)", self.parameters, basis, on_host=True),
            RankLine("FSDP1 offloaded gradient shards, _cpu_grad (host)", self.parameters, basis, on_host=True),
            RankLine("FSDP1 offloaded optimizer state (host)", self.state, basis, on_host=True),
            RankLine("FSDP1 shard copied to the device (largest)", self.copied, basis),
        )


def predict(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """One rank of ``spec`` with the root as the only unit (Lightning's ``FSDPStrategy`` without a wrap policy).

    Its rows without accumulation: each step's gradients set to None before its backward (Lightning's order).
    """
    return predict_units(predictor, spec, change)


def predict_window(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """:func:`predict` for a rank accumulating gradients as Lightning's ``fsdp`` does (no ``no_sync``).

    Each micro-batch reduce-scatters into the shard's gradient, which the window's later micro-batches hold in
    backward beside the reduce-scattered shard; the optimizer step's temporaries fitted on the flat shards.

    On 2 gloo ranks (a transformer LM wrapped alone, AdamW, 4 micro-batches of 4) backward measured 11,484,240 B:
    this said 11,666,652 (+1.6%); :func:`predict`'s figure for a step without a window, 9,578,812, is 17% under.
    """
    return predict_units(predictor, spec, change, window=True)


def predict_live(
    predictor: Predictor, spec: StrategySpec, change: StepChange | None, live: LiveFlats
) -> RankStep | ReplaySkipped:
    """One rank of a live FSDP1 run: its module's unsharded twin replayed, sized by the run's flat parameters.

    The twin holds the whole original parameters (:mod:`~lightning_vram.prediction.replay.unsharded`); a module
    without ``configure_optimizers`` (a plain loop's) is given one building an optimizer like the run's on them.
    """
    optimizer = live.optimizer
    if optimizer is None and not callable(getattr(predictor.module, "configure_optimizers", None)):
        return ReplaySkipped("fsdp (FSDP1): the run's optimizer is not known to build the replay's on")
    replays = predictor.sharing_walk()
    replays.optimizers = None  # built on the twin's whole parameters
    replays.shard = _optimizer_builder(optimizer)
    return predict_units(replays, spec, change, live=live)


def _optimizer_builder(optimizer: torch.optim.Optimizer | None) -> Callable[[nn.Module], None]:
    """What gives a replay's twin without ``configure_optimizers`` one building an optimizer like ``optimizer``."""

    def prepare(module: nn.Module) -> None:
        if optimizer is not None and not callable(getattr(module, "configure_optimizers", None)):
            # an instance attribute of the replay's copy only
            vars(module)["configure_optimizers"] = lambda: optimizer_like(optimizer, module.parameters())

    return prepare
