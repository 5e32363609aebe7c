"""Lightning's manual optimization inside a replay: the copy's own optimizers and backward, never the trainer's.

Under ``automatic_optimization = False`` the user's ``training_step`` calls ``self.optimizers()``,
``self.manual_backward(loss)``, ``opt.zero_grad()``, ``opt.step()`` and ``self.toggle_optimizer(opt)`` as it needs.
On a LightningModule these reach the Trainer (its strategy's optimizers and backward); the replay's copy has no
Trainer, so :func:`bind_manual` gives the copy (its root module, as instance attributes of the copy only) stand-ins
that act on the replay's fake optimizers and run backward as the replay does, telling the counters of each boundary
where the monitor hears of it: ``on_before_backward`` and ``on_after_backward`` in ``manual_backward``,
``on_before_optimizer_step`` in each optimizer's ``step`` (after a closure it is given, as Lightning's precision plugin
runs it) and torch's step post-hook where the update returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

Boundary = Callable[[], None]
"""Tells the replay's counters of a phase boundary (a no-op where the step is not counted)."""


class ReplayOptimizer:
    """Stands in for a ``LightningOptimizer`` in a replay's copy: the fake optimizer, with the step's boundary.

    Any other attribute is the fake optimizer's (``param_groups``, ``state``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, before_step: Boundary, after_step: Boundary) -> None:
        self.optimizer = optimizer
        self._before_step = before_step
        self._after_step = after_step

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure`` (if any), tell the boundary, step the fake optimizer, tell its end; the closure's result."""
        result = closure() if closure is not None else None
        self._before_step()
        self.optimizer.step(**kwargs)
        self._after_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The fake optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class ReplayScheduler:
    """Stands in for a learning-rate scheduler in a replay's copy (``self.lr_schedulers()``): ``step`` does nothing.

    A learning rate is a Python number: stepping one changes no memory, and the real scheduler and its optimizer are
    the user's, never the replay's. Any other attribute is not there (the replay is skipped, naming it).
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing (a ``ReduceLROnPlateau``'s metric, an epoch, are taken and ignored)."""


def replay_schedulers(trainer: Any) -> Callable[[], Any] | None:
    """``lr_schedulers()`` for a replay's copy of a module ``trainer`` trains, answering as Lightning's does.

    One :class:`ReplayScheduler` per scheduler of the Trainer's ``lr_scheduler_configs`` (``None`` where there is none,
    one alone where there is one, else a list); ``None`` where ``trainer`` is no Trainer (a plain module, Fabric).
    """
    configs = getattr(trainer, "lr_scheduler_configs", None)
    if not isinstance(configs, list):
        return None
    stand_ins = [ReplayScheduler() for _ in configs]

    def lr_schedulers() -> Any:
        return None if not stand_ins else stand_ins[0] if len(stand_ins) == 1 else list(stand_ins)

    return lr_schedulers


def _unwrapped(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, ReplayOptimizer) else optimizer


def bind_manual(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    backward: Callable[..., None],
    before_backward: Boundary,
    before_step: Boundary,
    after_backward: Boundary,
    after_step: Boundary,
) -> None:
    """Give the replay's copy ``module`` the manual-optimization methods, acting on its fake ``optimizers``.

    ``backward(loss, *args, **kwargs)`` runs the replay's backward; ``before_backward``, ``after_backward``,
    ``before_step`` and ``after_step`` tell its counters. ``self.optimizers()`` returns one stand-in, or a list of
    them, as Lightning does (``use_pl_optimizer=False``: the fake optimizers themselves); ``toggle_optimizer`` and
    ``untoggle_optimizer`` (and so ``toggled_optimizer``) set ``requires_grad`` as Lightning's do, over the fake
    optimizers.
    """
    wrapped = [ReplayOptimizer(optimizer, before_step, after_step) for optimizer in optimizers]
    toggled: dict[Tensor, bool] = {}

    def replay_optimizers(use_pl_optimizer: bool = True) -> Any:
        listed: list[Any] = list(wrapped) if use_pl_optimizer else list(optimizers)
        return listed[0] if len(listed) == 1 else listed

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        before_backward()
        backward(loss, *args, **kwargs)
        after_backward()

    def toggle_optimizer(optimizer: Any) -> None:
        toggled.clear()
        for each in optimizers:
            for group in each.param_groups:
                for parameter in group["params"]:
                    if parameter not in toggled:
                        toggled[parameter] = parameter.requires_grad
                        parameter.requires_grad = False
        for group in _unwrapped(optimizer).param_groups:
            for parameter in group["params"]:
                parameter.requires_grad = toggled[parameter]

    def untoggle_optimizer(optimizer: Any) -> None:
        for each in optimizers:
            if each is not _unwrapped(optimizer):
                for group in each.param_groups:
                    for parameter in group["params"]:
                        if parameter in toggled:
                            parameter.requires_grad = toggled[parameter]
        toggled.clear()

    attributes = vars(module)  # instance attributes of the copy only, past nn.Module's __setattr__
    attributes["optimizers"] = replay_optimizers
    attributes["manual_backward"] = manual_backward
    attributes["toggle_optimizer"] = toggle_optimizer
    attributes["untoggle_optimizer"] = untoggle_optimizer
