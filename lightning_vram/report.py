"""The end-of-run report: one ``Report`` value, its JSON (schema ``lightning_vram.report/1``), a console summary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_vram.records import DeviceInfo, ModuleActivations, NotMeasured, Phase, PhasePeak
from lightning_vram.units import format_bytes, format_percent

SCHEMA = "lightning_vram.report/1"
REPORT_FILENAME = "vram_report.json"


@dataclass(frozen=True)
class Advice:
    """One piece of advice: what to change, the figures that fired it, and what it should save (bytes)."""

    id: str
    severity: str
    title: str
    detail: str
    evidence: str
    estimated_saving_bytes: int | None


@dataclass(frozen=True)
class TimingSummary:
    """Run timing: median step in seconds, share of step time waiting for data, mean GPU utilization in percent."""

    step_seconds_median: float | None
    data_wait_fraction: float | None
    gpu_utilization_mean: float | None


@dataclass(frozen=True)
class RankSummary:
    """One process's headline: its global rank, device index and highest peak in bytes."""

    rank: int
    device_index: int | None
    peak_bytes: int | None
    steps: int


@dataclass(frozen=True)
class Report:
    """Everything the monitor learned about one run."""

    device: DeviceInfo
    steps: int
    peak: PhasePeak | None
    phases: dict[Phase, PhasePeak]
    modules: tuple[ModuleActivations, ...]
    timing: TimingSummary
    advice: tuple[Advice, ...]
    ranks: tuple[RankSummary, ...]
    not_measured: tuple[NotMeasured, ...]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, exactly as written to ``vram_report.json``."""
        return {
            "schema": SCHEMA,
            "device": {
                "type": self.device.type,
                "name": self.device.name,
                "index": self.device.index,
                "total_bytes": self.device.total_bytes,
            },
            "steps": self.steps,
            "peak": _peak_dict(self.peak),
            "phases": {
                phase.value: {
                    "peak_bytes": peak.peak_bytes,
                    "breakdown": peak.breakdown.to_dict() if peak.breakdown is not None else None,
                }
                for phase, peak in sorted(self.phases.items(), key=lambda item: list(Phase).index(item[0]))
            },
            "modules": [
                {"name": row.name, "type": row.type, "activation_bytes": row.activation_bytes} for row in self.modules
            ],
            "timing": {
                "step_seconds_median": self.timing.step_seconds_median,
                "data_wait_fraction": self.timing.data_wait_fraction,
                "gpu_utilization_mean": self.timing.gpu_utilization_mean,
            },
            "advice": [
                {
                    "id": advice.id,
                    "severity": advice.severity,
                    "title": advice.title,
                    "detail": advice.detail,
                    "evidence": advice.evidence,
                    "estimated_saving_bytes": advice.estimated_saving_bytes,
                }
                for advice in self.advice
            ],
            "ranks": [
                {
                    "rank": rank.rank,
                    "device_index": rank.device_index,
                    "peak_bytes": rank.peak_bytes,
                    "steps": rank.steps,
                }
                for rank in self.ranks
            ],
            "not_measured": [{"what": item.what, "reason": item.reason} for item in self.not_measured],
        }

    def write_json(self, directory: Path) -> Path:
        """Write ``vram_report.json`` into ``directory`` (created if needed) and return its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / REPORT_FILENAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def _peak_dict(peak: PhasePeak | None) -> dict[str, Any] | None:
    if peak is None:
        return None
    return {
        "step": peak.step,
        "phase": peak.phase.value,
        "allocated_bytes": peak.peak_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "breakdown": peak.breakdown.to_dict() if peak.breakdown is not None else None,
    }


def summary_text(report: Report, top_modules: int = 3) -> str:
    """A few lines for the console at the end of training."""
    device = report.device
    lines = [f"VRAM report: {device.name} ({device.type}), {report.steps} steps"]
    peak = report.peak
    if peak is None:
        lines.append("  no step was measured")
    else:
        capacity = f" of {format_bytes(device.total_bytes)}" if device.total_bytes else ""
        lines.append(f"  peak {format_bytes(peak.peak_bytes)}{capacity} in {peak.phase.value} of step {peak.step}")
        if peak.breakdown is not None:
            parts = peak.breakdown
            lines.append(
                f"  parameters {format_bytes(parts.parameters)} | gradients {format_bytes(parts.gradients)}"
                f" | optimizer state {format_bytes(parts.optimizer_state)}"
                f" | activations {format_bytes(parts.activations)} | other {format_bytes(parts.other)}"
            )
        phases = ", ".join(f"{phase.value} {format_bytes(p.peak_bytes)}" for phase, p in report.phases.items())
        lines.append(f"  phase peaks: {phases}")
    if report.modules:
        top = ", ".join(
            f"{row.name} ({row.type}) {format_bytes(row.activation_bytes)}" for row in report.modules[:top_modules]
        )
        lines.append(f"  most activations saved by: {top}")
    timing = report.timing
    step = f"{1000 * timing.step_seconds_median:.1f} ms" if timing.step_seconds_median is not None else "n/a"
    utilization = f"{timing.gpu_utilization_mean:.0f}%" if timing.gpu_utilization_mean is not None else "n/a"
    lines.append(
        f"  step {step} median, data wait {format_percent(timing.data_wait_fraction)}, GPU utilization {utilization}"
    )
    for advice in report.advice:
        lines.append(f"  advice [{advice.id}]: {advice.title}")
    for item in report.not_measured:
        lines.append(f"  not measured: {item.what} ({item.reason})")
    return "\n".join(lines)
