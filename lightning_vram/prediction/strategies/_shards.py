"""What the sharded strategies' arithmetic (ZeRO, FSDP1) shares: sizes read from the module and the replay.

Every figure is in bytes. The single-process replay gives what does not depend on the strategy (the activations
autograd saves, the step's own temporaries); the module's parameters, in their order, give what the strategy
flattens and shards; the user's optimizer, stepped once on tiny flat tensors, gives its state per element.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_vram.measure.deepspeed_zero import full_numel
from lightning_vram.measure.tensors import iter_tensors
from lightning_vram.records import Breakdown, Phase, PhasePeak, ReplayedStep


def parameter_numels(module: nn.Module) -> list[int]:
    """Elements of each parameter that trains, in ``module.parameters()`` order (a tied one once).

    A parameter ZeRO-3 partitioned counts whole.
    """
    return [full_numel(parameter) for parameter in module.parameters() if parameter.requires_grad]


def padded(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple``.

    >>> padded(67594, 4)
    67596
    """
    return math.ceil(numel / multiple) * multiple


def optimizer_like(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with its first group's settings over ``parameters``, without state.

    >>> adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], lr=0.1, betas=(0.8, 0.9))
    >>> optimizer_like(adam, [torch.nn.Parameter(torch.zeros(2))]).param_groups[0]["betas"]
    (0.8, 0.9)
    """
    accepted = inspect.signature(type(optimizer)).parameters  # a scheduler's "initial_lr" is no setting
    settings = {key: value for key, value in optimizer.param_groups[0].items() if key != "params" and key in accepted}
    return type(optimizer)(parameters, **settings)


def flat_state_bytes(optimizer: torch.optim.Optimizer | None, numel: int) -> int:
    """Bytes of the state ``optimizer``'s class keeps for one flat fp32 tensor of ``numel`` elements.

    Stepped once for real on flat tensors of 1 and 2 elements with the optimizer's first group's settings: the
    state is ``a + b * numel`` for an optimizer whose state is element-wise (Adam's moments, SGD's momentum) with
    its scalars (Adam's step). Without an optimizer: Adam's (two moments and a step counter).

    >>> flat = torch.nn.Parameter(torch.zeros(3))
    >>> adam = torch.optim.Adam([flat], lr=0.1)
    >>> scheduler = torch.optim.lr_scheduler.StepLR(adam, 1)  # adds "initial_lr" to the group
    >>> flat_state_bytes(adam, 1000), flat_state_bytes(torch.optim.SGD([flat], lr=0.1, momentum=0.9), 1000)
    (8004, 4000)
    """
    if optimizer is None:
        return 8 * numel + 4
    sizes = []
    for elements in (1, 2):
        stepped, _ = _stepped_once(optimizer, elements)
        sizes.append(sum(tensor.untyped_storage().nbytes() for tensor in iter_tensors(list(stepped.state.values()))))
    per_element = sizes[1] - sizes[0]
    return sizes[0] - per_element + per_element * numel


def cpu_step_bytes(optimizer: torch.optim.Optimizer | None, numel: int) -> int | None:
    """The CPU's live count's peak while ``optimizer`` steps one flat fp32 tensor of ``numel`` elements.

    Beyond its gradient and state: the step's temporaries, and the parameter once an op writes it (the count does
    not see a ZeRO master partition before; torch's Adam writes it last, after its temporaries, AdamW scales it
    first, SGD adds to it last). ``None`` without an optimizer.

    Stepped for real on flat tensors of 1,000 and 2,000 elements (their second step: the state made), linear in
    between: ``a + b * numel``.

    >>> flat = torch.nn.Parameter(torch.zeros(3))
    >>> adam, adamw = torch.optim.Adam([flat]), torch.optim.AdamW([flat])
    >>> momentum = torch.optim.SGD([flat], lr=0.1, momentum=0.9)
    >>> [cpu_step_bytes(each, 1000) for each in (adam, adamw, momentum)]  # sqrt and div; the parameter; no temporary
    [8000, 12000, 4000]
    """
    if optimizer is None:
        return None
    peaks = [_step_peak(*_stepped_once(optimizer, elements)) for elements in (1000, 2000)]
    per_element = (peaks[1] - peaks[0]) / 1000
    return max(round(peaks[0] + per_element * (numel - 1000)), 0)


def _stepped_once(optimizer: torch.optim.Optimizer, elements: int) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """An optimizer like ``optimizer`` stepped once over a flat fp32 tensor of ``elements``, and that tensor.

    Its gradient is ones; the step makes the state (the moments, the momentum) the callers measure.
    """
    flat = torch.zeros(elements, requires_grad=True)
    flat.grad = torch.ones(elements)
    stepped = optimizer_like(optimizer, [flat])
    stepped.step()
    return stepped, flat


def _step_peak(optimizer: torch.optim.Optimizer, flat: torch.Tensor) -> int:
    """Bytes of the new tensors alive at once during ``optimizer.step()``, the parameter from its first write on."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    known = {id(flat), id(flat.grad), *(id(t) for t in iter_tensors(list(optimizer.state.values())))}
    live = [0, 0]  # bytes now, the peak

    def add(nbytes: int) -> None:
        live[0] += nbytes
        live[1] = max(live[1], live[0])

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch ships it without annotations
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in iter_tensors(out if isinstance(out, (list, tuple)) else [out]):
                if tensor is flat and "param" not in seen:
                    seen.add("param")
                    add(tensor.untyped_storage().nbytes())
                elif id(tensor) not in known and tensor.numel() > 1:
                    known.add(id(tensor))
                    nbytes = tensor.untyped_storage().nbytes()
                    add(nbytes)
                    weakref.finalize(tensor, add, -nbytes)
            return out

    seen: set[str] = set()
    with Count():  # type: ignore[no-untyped-call]
        optimizer.step()
    return live[1]


def first_optimizer(optimizers: Sequence[torch.optim.Optimizer] | None) -> torch.optim.Optimizer | None:
    """The run's first optimizer, or ``None`` where the module builds its own (``configure_optimizers``)."""
    return optimizers[0] if optimizers else None


def step_optimizer(predictor: Any) -> torch.optim.Optimizer | None:
    """The optimizer a rank's arithmetic sizes the state by: the run's first, else the module's own.

    A LightningModule (a plan's, ``predict()``'s) builds its own in ``configure_optimizers``, which a replay ran on
    its copy of the module: an optimizer of that class and settings over meta tensors of its groups' sizes
    (:class:`~lightning_vram.prediction.replay.optimizers.OptimizerShape`), or ``None`` where no replay built one
    (then Adam's state is assumed). The user's module is never asked: ``configure_optimizers`` is user code, run
    only inside the replay's containment. Before, every such module's state was taken as Adam's: a ResNet's ZeRO-2
    row under SGD with momentum said 230,284 B of optimizer state per rank on 2 gloo ranks, where the run held
    153,520 (the fp32 master partition and the momentum).
    """
    given = first_optimizer(predictor.optimizers)
    if given is not None:
        return given
    shape = getattr(predictor, "configured_optimizer", None)
    return shape.build() if shape is not None else None


def batch_bytes(batch: Any) -> int:
    """Bytes of the batch's tensors (each storage once)."""
    seen: dict[int, int] = {}
    for tensor in iter_tensors(batch if isinstance(batch, (list, tuple, dict)) else [batch]):
        storage = tensor.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def backward_activations(replayed: ReplayedStep) -> int:
    """Activations held where backward is first counted: the forward's, less the loss's and the last module's.

    The monitor counts backward at module hooks: its first count comes after the loss's ops (the step's own
    profiles, named in parentheses) and the last module the forward ran (the last one listed) have released what
    they saved. Under a sharded strategy whose gradients sit in a fixed buffer, that first count is backward's
    counted peak.
    """
    forward = replayed.phases[Phase.FORWARD].breakdown
    assert forward is not None
    step_own = sum(profile.activation_bytes for profile in replayed.modules if profile.name.startswith("("))
    modules = [profile for profile in replayed.modules if not profile.name.startswith("(")]
    last = modules[-1].activation_bytes if modules else 0
    return max(forward.activations - max(step_own, replayed.loss_activation_bytes) - last, 0)


def phase_peak(step: int, phase: Phase, parts: tuple[int, int, int, int], peak: int) -> PhasePeak:
    """A phase's peak with its counted parts (parameters, gradients, optimizer state, activations), in bytes.

    ``other`` is the peak beyond the counted parts; a peak under them is raised to them (as the report does).
    """
    breakdown = Breakdown(*parts, other=None).with_measured_peak(peak)
    return PhasePeak(step, phase, breakdown.peak_bytes, None, breakdown)


def other_bytes(replayed: ReplayedStep, phase: Phase) -> int:
    """The single-process replay's ``other`` in ``phase``: the step's own temporaries beyond the counted parts."""
    breakdown = replayed.phases[phase].breakdown
    return (breakdown.other or 0) if breakdown is not None else 0


def shard_communication(full_bytes: int, world_size: int, gathers: int) -> int:
    """Bytes one rank sends per step: ``gathers`` all-gathers and one reduce-scatter, each ``(N - 1) / N`` of it.

    >>> shard_communication(1000, 4, 2)
    2250
    """
    return (gathers + 1) * (world_size - 1) * full_bytes // world_size
