"""Large linear: a Linear reads a flattened convolutional feature map; pooling it first removes most of its weights.

Global average pooling over the map's ``positions`` (H x W) turns ``Linear(C * positions, N)`` into
``Linear(C, N)``: it removes ``(positions - 1) / positions`` of the weight, with their gradients and optimizer state
(the model-state bytes per parameter byte measured at the peak). A weight tied to another module has no bytes of
its own and is never advised here. The saving is modelled: no replay changes the model's layers.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule, attributed_peak, no_changes, share_text
from lightning_vram.records import (
    Advice,
    AdviceId,
    Breakdown,
    LinearLayer,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.LARGE_LINEAR


def _with_model_state(removed: int, breakdown: Breakdown) -> int:
    """``removed`` weight bytes with their gradients and optimizer state, at the measured bytes per parameter byte."""
    model_state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
    return removed * model_state // breakdown.parameters


POOLING = {1: "AdaptiveAvgPool1d", 2: "AdaptiveAvgPool2d", 3: "AdaptiveAvgPool3d"}
"""The global average pooling layer for a map of 1, 2 or 3 dimensions past its channels."""


def _candidates(
    summary: RunSummary, setup: TrainingSetup
) -> list[tuple[int, LinearLayer, tuple[int, int], int | None]]:
    """Each Linear reading a flattened feature map: weight bytes pooling removes, the layer, (channels, positions).

    The last item is the map's dimensions past its channels (``None`` where not read).
    """
    maps = {profile.name: (profile.input_feature_map, profile.input_feature_map_dims) for profile in summary.modules}
    candidates = []
    for layer in setup.linear_layers:
        feature_map, dims = maps.get(layer.name, (None, None))
        if feature_map is None or feature_map[1] <= 1 or layer.weight_bytes <= 0:
            continue
        candidates.append((layer.weight_bytes - layer.weight_bytes // feature_map[1], layer, feature_map, dims))
    return candidates


def _pooled_code(channels: int, out_features: int, dims: int | None) -> str:
    """The printed head with global average pooling first, for a map of ``dims`` dimensions past its channels.

    >>> _pooled_code(64, 10, 1)
    'nn.Sequential(..., nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 10))'
    """
    pool = POOLING.get(dims) if dims is not None else None
    code = f"nn.Sequential(..., nn.{pool or POOLING[2]}(1), nn.Flatten(), nn.Linear({channels}, {out_features}))"
    return code if pool is not None else f"{code}  # AdaptiveAvgPool1d/3d for 1-D/3-D maps"


def large_linear(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """A Linear reads a flattened convolutional feature map: pooling it first removes most of the Linear's weights."""
    attributed = attributed_peak(summary)
    if attributed is None or attributed[1].parameters <= 0:
        return None
    peak, breakdown = attributed
    candidates = _candidates(summary, setup)
    if not candidates:
        return None
    removed, layer, (channels, positions), dims = max(candidates, key=lambda candidate: candidate[0])
    saving = _with_model_state(removed, breakdown)
    if saving < MIN_SAVING_SHARE * peak.peak_bytes:
        return None
    model_state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=(
            f"`{layer.name}` reads a flattened feature map of {positions} positions: pool it first to save"
            f" about {format_bytes(saving)}"
        ),
        detail=(
            f"Global average pooling before it averages each of the {channels} channels over the map's {positions}"
            f" positions, so Linear({layer.in_features}, {layer.out_features}) becomes"
            f" Linear({channels}, {layer.out_features}) and its weight, gradients and optimizer state shrink"
            f" {positions}-fold. Pooling drops where things are in the map: accuracy may change, so validate.\n"
            f"```python\n{_pooled_code(channels, layer.out_features, dims)}\n```"
        ),
        evidence=(
            f"{layer.name}: Linear({layer.in_features} -> {layer.out_features}) reads the flattened output of a"
            f" convolutional map of {channels} channels x {positions} positions; its weight is"
            f" {format_bytes(layer.weight_bytes)}, pooling removes {format_bytes(removed)} of it; parameters,"
            f" gradients and optimizer state are {model_state / breakdown.parameters:.2f}x the parameters at the"
            f" {peak.phase.value} peak ({format_bytes(peak.peak_bytes)})"
        ),
        estimated_saving_bytes=saving,
        saving_basis=SavingBasis.MODELLED,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why no Linear is advised pooled: none reads a flattened feature map, or pooling saves too little.

    ``None`` where the peak was not attributed or holds no parameters.
    """
    attributed = attributed_peak(summary)
    if attributed is None or attributed[1].parameters <= 0:
        return None
    peak, breakdown = attributed
    candidates = _candidates(summary, setup)
    if not candidates:
        return "no Linear reads a flattened convolutional feature map"
    removed, layer, (_, positions), _ = max(candidates, key=lambda candidate: candidate[0])
    saving = _with_model_state(removed, breakdown)
    return (
        f"pooling the {positions} positions before {layer.name} saves {format_bytes(saving)}"
        f" ({share_text(saving, peak.peak_bytes)} of the {peak.phase.value} peak): under the"
        f" {format_percent(MIN_SAVING_SHARE)} the rule needs"
    )


RULE = Rule(ID, large_linear, no_changes, why_not)
