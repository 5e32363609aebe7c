"""What a counted step adds up to: each module's tallies and profile, and each phase's counted peak, in bytes.

The same rules count sampled steps and replayed ones (see :class:`~lightning_vram.measure.accounting.StepAttributor`
for the definitions of each phase's peak).
"""

from __future__ import annotations

from torch import nn

from lightning_vram.measure.ledgers import ActivationLedger
from lightning_vram.measure.observations import ModuleFacts, ModuleObserver, stored_attribute
from lightning_vram.records import Breakdown, ModuleProfile, Phase

OUTSIDE_MODULES = "(training_step)"
"""Name given to activations saved outside any submodule's forward, such as the loss computation."""

ROOT_MODULE = "(root)"
"""Name given to the LightningModule itself."""


class ModuleTally:
    """Mutable tallies of one module during a sampled (or replayed) forward pass, in bytes."""

    __slots__ = ("calls", "input_bytes", "input_saved_for_backward", "output_bytes")

    def __init__(self) -> None:
        self.calls = 0
        self.input_bytes = 0
        self.output_bytes = 0
        self.input_saved_for_backward = False


def phase_breakdown(
    phase: Phase,
    parameter_bytes: int,
    start: tuple[int, int],
    now: tuple[int, int],
    activations: ActivationLedger,
    backward_peak: tuple[int, int] | None,
) -> Breakdown:
    """The counted peak of a segment of a step that ran ``phase``.

    ``start`` and ``now`` are (gradient bytes, optimizer-state bytes) when the segment began and now;
    ``backward_peak`` is (gradients, activations) at backward's highest sum of the two, where it was followed.
    """
    (start_gradients, start_state), (gradient_bytes, state_bytes) = start, now
    if phase is Phase.BACKWARD and backward_peak is not None:
        gradients, live = backward_peak
        return Breakdown(parameter_bytes, gradients, max(start_state, state_bytes), live, None)
    if phase is Phase.OPTIMIZER:  # the gradients it consumes, even if it frees them (DeepSpeed ZeRO-1/2)
        return Breakdown(
            parameter_bytes, max(start_gradients, gradient_bytes), state_bytes, activations.live_bytes, None
        )
    # A forward pass: the gradients alive when it began stayed alive through it.
    return Breakdown(parameter_bytes, start_gradients, max(start_state, state_bytes), activations.peak_live_bytes, None)


def module_profile(
    label: str, module: nn.Module, saved_bytes: int, tally: ModuleTally, facts: ModuleFacts
) -> ModuleProfile:
    """What module ``label`` did in a counted forward pass, from its tally and what the observer saw of it."""
    inplace = stored_attribute(module, "inplace")
    return ModuleProfile(
        name=label,
        type=type(module).__name__,
        activation_bytes=saved_bytes,
        input_bytes=tally.input_bytes,
        output_bytes=tally.output_bytes,
        inplace=inplace if isinstance(inplace, bool) else None,
        input_saved_for_backward=tally.input_saved_for_backward,
        input_saved_bytes=facts.input_saved_bytes,
        output_saved_bytes=facts.output_saved_bytes,
        output_saved_for_backward=facts.output_saved_for_backward,
        input_feature_map=facts.input_feature_map,
        input_feature_map_dims=facts.input_feature_map_dims,
        calls=tally.calls,
    )


def module_profiles(
    modules: dict[str, nn.Module], tallies: dict[str, ModuleTally], saved: dict[str, int], observer: ModuleObserver
) -> tuple[ModuleProfile, ...]:
    """Every module called during the forward pass, in registration order (``modules``'), then code outside modules.

    ``saved`` is the bytes each module saved for backward, by name.
    """
    profiles = []
    for label, tally in tallies.items():
        profiles.append(module_profile(label, modules[label], saved.get(label, 0), tally, observer.facts(label)))
    order = {label: index for index, label in enumerate(modules)}
    profiles.sort(key=lambda profile: order[profile.name])
    if saved.get(OUTSIDE_MODULES):
        profiles.append(ModuleProfile(OUTSIDE_MODULES, "-", saved[OUTSIDE_MODULES]))
    return tuple(profiles)
