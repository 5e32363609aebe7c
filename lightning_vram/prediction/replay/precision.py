"""Lightning's precision settings as a replay applies them: autocast around ``training_step``, or a cast model.

As Lightning's plugins do: ``*-mixed`` runs the training step under ``torch.autocast`` on the device type (backward
and the optimizer outside it), with autocast's weight cache as the run's plugin has it (off under the Trainer's
``MixedPrecision``, ``cache_enabled=False``: each op casts the weights it uses, and a cast no op saved for backward is
freed at once; on under Fabric's, FSDP's and a plain ``torch.autocast``, where the cache holds a cast weight until the
training step returns and shares it between the calls of a module used twice; docs/measurement.md); ``*-true``
casts the module's floating parameters and buffers, the batch's floating tensors, and makes the dtype the default
while the training step runs. ``16-mixed`` replays without the gradient
scaler: its few scalar tensors do not change the counted parts. Under Fabric the precision applies to the module's
forward only, as ``_FabricModule`` runs it (:class:`FabricForward`): the rest of the step (the loss) runs as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn


@contextlib.contextmanager
def _fake_cuda_autocast(dtype: torch.dtype, cache: bool) -> Iterator[None]:
    """CUDA's autocast for fake CUDA tensors without a CUDA device, which ``torch.autocast("cuda")`` turns off.

    ``torch.autocast`` disables itself there ("CUDA is not available"); this sets what its ``__enter__`` sets,
    the weight cache (``cache``) included.
    """
    enabled, previous_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_cache_enabled(cache)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous_dtype)
        torch.set_autocast_cache_enabled(cached)


AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types whose autocast a replay turns off around itself."""


SPANNING_AUTOCAST_NOTE = (
    "replayed with autocast's weight cache off: the run's own autocast spans the replay, and its cache is the run's"
    " (the casts it keeps, across the optimizer's updates too, are not predicted)"
)
"""A replayed step's note where the run's autocast caches weights and spans the replay (:func:`outside_autocast`)."""


def autocast_spans_the_replay() -> bool:
    """Whether an autocast of the user's is on where the replay starts (one spanning the session's calls)."""
    return any(torch.is_autocast_enabled(device) for device in AUTOCAST_DEVICES)


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """The replay outside any autocast of the user's that spans it: its own precision plan says what runs under it.

    A plain loop's ``torch.autocast`` may span the whole step, the session's calls (and so the replay) included.
    Autocast's weight cache is the thread's own, shared by nested autocasts and emptied only when the outermost one
    exits: a replay under the user's autocast must neither add its fake casts to it nor empty it (the user's cached
    casts are kept across the optimizer's updates while their autocast spans them, stale, and training with them
    differs from training with fresh casts). Its plan runs with the cache off there
    (:func:`autocast_spans_the_replay`), and the cache is left as it was.
    """
    enabled = {device: torch.is_autocast_enabled(device) for device in AUTOCAST_DEVICES}
    for device in AUTOCAST_DEVICES:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device, was in enabled.items():
            torch.set_autocast_enabled(device, was)


@dataclass(frozen=True)
class PrecisionPlan:
    """How to replay one precision: an autocast dtype, or a dtype the whole model is cast to (or neither)."""

    name: str
    autocast_dtype: torch.dtype | None = None
    true_dtype: torch.dtype | None = None
    autocast_cache: bool = False
    """Whether autocast caches cast weights: off as the Trainer's ``MixedPrecision`` plugin runs it, on as Fabric's,
    FSDP's and a plain ``torch.autocast`` do (:class:`~lightning_vram.prediction.predictor.Predictor`'s
    ``autocast_cache``)."""
    module_scope: bool = False
    """Whether the precision applies to the module's forward only, as Fabric's ``_FabricModule`` applies it
    (:meth:`scoped`), rather than to the whole training step, as a Trainer's plugin does."""

    @property
    def converts(self) -> torch.dtype | None:
        """The dtype the precision runs the forward pass in (``None``: ``32-true``, nothing converted)."""
        return self.autocast_dtype or self.true_dtype

    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager[None]:
        """Around ``training_step``: autocast, or the true dtype as the default dtype.

        Nothing where the plan is :attr:`module_scope`: the module's forward has it (:meth:`scoped`).
        """
        return contextlib.nullcontext() if self.module_scope else self.context(device_type)

    @contextlib.contextmanager
    def context(self, device_type: str) -> Iterator[None]:
        """Autocast, or the true dtype as the default dtype."""
        if self.autocast_dtype is not None:
            if device_type == "cuda" and not torch.cuda.is_available():
                with _fake_cuda_autocast(self.autocast_dtype, self.autocast_cache):
                    yield
                return
            with torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=self.autocast_cache):
                yield
        elif self.true_dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.true_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)
        else:
            yield

    def cast_module(self, module: nn.Module) -> None:
        """Cast the (fake) module's floating parameters and buffers to the true dtype, if there is one, in place.

        In place (``.data``), as ``module.to(dtype)`` would, but keeping each parameter object: the replay maps
        the user's parameters to these.
        """
        dtype = self.true_dtype
        if dtype is None:
            return
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)

    def cast_batch(self, batch: Any) -> Any:
        """The batch with its floating tensors in the true dtype, if there is one (Lightning's ``convert_input``).

        Under :attr:`module_scope` the batch is left as it is: Fabric converts the module's inputs instead.
        """
        dtype = self.true_dtype
        if dtype is None or self.module_scope:
            return batch
        return _floating_to(batch, dtype)

    def scoped(self, module: nn.Module, device_type: str) -> Any:
        """What the training step is handed as the model: ``module``, or ``module`` as Fabric runs it.

        :class:`FabricForward` where the plan is :attr:`module_scope` and its precision converts (not ``32-true``).
        """
        if not self.module_scope or self.converts is None:
            return module
        return FabricForward(module, self, device_type)


def _floating_to(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with its floating tensors in ``dtype`` (Fabric's ``_convert_fp_tensor`` over a collection)."""
    return apply_to_collection(data, Tensor, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


class FabricForward:
    """A module as Fabric's ``_FabricModule`` runs it under a precision that converts (``*-mixed``, ``*-true``).

    Calling it converts the floating inputs to the precision's dtype, runs the module's forward under the
    precision's context (autocast, or the true dtype as the default dtype) and converts the floating outputs to the
    default dtype (``float32``): a language model's logits leave its forward in ``float32``, and the loss computed
    from them runs outside autocast. Any other attribute is the module's (a submodule called directly runs outside
    the precision, as Fabric runs it).
    """

    def __init__(self, module: nn.Module, plan: PrecisionPlan, device_type: str) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_device_type", device_type)

    @property
    def module(self) -> nn.Module:
        """The module itself, as ``_FabricModule.module`` gives it."""
        module: nn.Module = self._module
        return module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward as ``_FabricModule.forward`` runs it: inputs converted, forward, outputs converted."""
        dtype = self._plan.converts
        if dtype is not None:
            args, kwargs = _floating_to((args, kwargs), dtype)
        with self._plan.context(self._device_type):
            output = self._module(*args, **kwargs)
        return _floating_to(output, torch.get_default_dtype())

    def __getattr__(self, name: str) -> Any:
        if name in ("_module", "_plan", "_device_type"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)


PLANS = {
    "bf16-mixed": PrecisionPlan("bf16-mixed", autocast_dtype=torch.bfloat16),
    "16-mixed": PrecisionPlan("16-mixed", autocast_dtype=torch.float16),
    "bf16-true": PrecisionPlan("bf16-true", true_dtype=torch.bfloat16),
    "16-true": PrecisionPlan("16-true", true_dtype=torch.float16),
    "64-true": PrecisionPlan("64-true", true_dtype=torch.float64),
}


def precision_plan(precision: str) -> PrecisionPlan:
    """The plan for a Lightning precision name; ``ValueError`` for one a replay cannot reproduce.

    >>> precision_plan("bf16-mixed").autocast_dtype
    torch.bfloat16
    """
    name = f"{precision}-true" if precision in ("32", "64") else precision
    if name == "32-true":
        return PrecisionPlan(name)
    plan = PLANS.get(name)
    if plan is None:
        supported = ", ".join(sorted({"32-true", *PLANS}))
        raise ValueError(f"precision {precision!r} cannot be replayed (supported: {supported})")
    return plan
