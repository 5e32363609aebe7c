"""The end-of-run report: one ``Report``; its JSON (schema ``lightning_vram.report/1``), Markdown and console text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_vram.advice import Advice, FitRow
from lightning_vram.records import (
    Breakdown,
    DeviceInfo,
    EvaluationPeak,
    ModuleProfile,
    NotMeasured,
    Phase,
    PhasePeak,
)
from lightning_vram.tracker import StepPoint
from lightning_vram.units import format_bytes, format_percent

SCHEMA = "lightning_vram.report/1"
JSON_FILENAME = "vram_report.json"
MARKDOWN_FILENAME = "vram_report.md"
HTML_FILENAME = "vram_report.html"
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")


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
    precision: str | None
    steps: int
    peak: PhasePeak | None
    phases: dict[Phase, PhasePeak]
    modules: tuple[ModuleProfile, ...]
    timing: TimingSummary
    advice: tuple[Advice, ...]
    fit: tuple[FitRow, ...]
    batch_size: int | None
    recovered_ooms: int | None
    recent_peaks: tuple[StepPoint, ...]
    evaluation: tuple[EvaluationPeak, ...]
    ranks: tuple[RankSummary, ...]
    not_measured: tuple[NotMeasured, ...]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, exactly as written to ``vram_report.json``."""
        capability = self.device.compute_capability
        return {
            "schema": SCHEMA,
            "device": {
                "type": self.device.type,
                "name": self.device.name,
                "index": self.device.index,
                "total_bytes": self.device.total_bytes,
                "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
            },
            "precision": self.precision,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "recovered_ooms": self.recovered_ooms,
            "peak": _peak_dict(self.peak),
            "phases": {
                phase.value: {
                    "step": peak.step,
                    "peak_bytes": peak.peak_bytes,
                    "breakdown": _breakdown_dict(peak.breakdown),
                }
                for phase, peak in in_phase_order(self.phases)
            },
            "modules": [
                {"name": row.name, "type": row.type, "activation_bytes": row.activation_bytes} for row in self.modules
            ],
            "timing": {
                "step_seconds_median": self.timing.step_seconds_median,
                "data_wait_fraction": self.timing.data_wait_fraction,
                "gpu_utilization_mean": self.timing.gpu_utilization_mean,
            },
            "advice": [advice_to_dict(advice) for advice in self.advice],
            "fit": [
                {"device": row.device, "capacity_bytes": row.capacity_bytes, "max_batch_size": row.max_batch_size}
                for row in self.fit
            ],
            "recent_peaks": [{"step": point.step, "peak_bytes": point.peak_bytes} for point in self.recent_peaks],
            "evaluation": {
                peak.stage: {
                    "peak_bytes": peak.peak_bytes,
                    "reserved_bytes": peak.reserved_bytes,
                    "after_step": peak.after_step,
                }
                for peak in self.evaluation
            },
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


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    """One piece of advice as JSON-ready data (the schema's ``advice`` entries)."""
    return {
        "id": advice.id,
        "severity": advice.severity,
        "title": advice.title,
        "detail": advice.detail,
        "evidence": advice.evidence,
        "estimated_saving_bytes": advice.estimated_saving_bytes,
        "estimated_saving_seconds": advice.estimated_saving_seconds,
    }


def saving_text(advice: Advice) -> str | None:
    """The expected saving in words, or ``None`` when the advice estimates none."""
    savings = []
    if advice.estimated_saving_bytes is not None:
        savings.append(f"about {format_bytes(advice.estimated_saving_bytes)} of peak memory")
    if advice.estimated_saving_seconds is not None:
        savings.append(f"up to {1000 * advice.estimated_saving_seconds:.1f} ms per step")
    return ", ".join(savings) if savings else None


class ReportFormatError(ValueError):
    """A file is not a readable ``lightning_vram.report/1`` report."""


def _breakdown_from(data: dict[str, Any] | None) -> Breakdown | None:
    if data is None:
        return None
    return Breakdown(
        parameters=int(data["parameters"]),
        gradients=int(data["gradients"]),
        optimizer_state=int(data["optimizer_state"]),
        activations=int(data["activations"]),
        other=None if data["other"] is None else int(data["other"]),
    )


def _capability_from(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    major, minor = text.split(".")
    return int(major), int(minor)


def report_from_dict(data: Any) -> Report:
    """Rebuild a :class:`Report` from its JSON form (what ``to_dict`` wrote).

    Raises:
        ReportFormatError: not a JSON object of schema ``lightning_vram.report/1``, or a field is missing or mistyped.
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportFormatError(f"not a lightning_vram report (schema {SCHEMA!r} expected, found {found!r})")
    try:
        device = data["device"]
        capability = device["compute_capability"]
        peak = data["peak"]
        timing = data["timing"]
        return Report(
            device=DeviceInfo(
                type=str(device["type"]),
                name=str(device["name"]),
                index=device["index"],
                total_bytes=device["total_bytes"],
                compute_capability=_capability_from(capability),
            ),
            precision=data["precision"],
            steps=int(data["steps"]),
            peak=None
            if peak is None
            else PhasePeak(
                step=int(peak["step"]),
                phase=Phase(peak["phase"]),
                peak_bytes=int(peak["allocated_bytes"]),
                reserved_bytes=peak["reserved_bytes"],
                breakdown=_breakdown_from(peak["breakdown"]),
            ),
            phases={
                Phase(name): PhasePeak(
                    step=int(value["step"]),
                    phase=Phase(name),
                    peak_bytes=int(value["peak_bytes"]),
                    reserved_bytes=None,
                    breakdown=_breakdown_from(value["breakdown"]),
                )
                for name, value in data["phases"].items()
            },
            modules=tuple(
                ModuleProfile(str(row["name"]), str(row["type"]), int(row["activation_bytes"]))
                for row in data["modules"]
            ),
            timing=TimingSummary(
                step_seconds_median=timing["step_seconds_median"],
                data_wait_fraction=timing["data_wait_fraction"],
                gpu_utilization_mean=timing["gpu_utilization_mean"],
            ),
            advice=tuple(
                Advice(
                    id=str(item["id"]),
                    severity=str(item["severity"]),
                    title=str(item["title"]),
                    detail=str(item["detail"]),
                    evidence=str(item["evidence"]),
                    estimated_saving_bytes=item["estimated_saving_bytes"],
                    estimated_saving_seconds=item["estimated_saving_seconds"],
                )
                for item in data["advice"]
            ),
            fit=tuple(
                FitRow(str(row["device"]), int(row["capacity_bytes"]), int(row["max_batch_size"]))
                for row in data["fit"]
            ),
            batch_size=data["batch_size"],
            recovered_ooms=data["recovered_ooms"],
            recent_peaks=tuple(
                StepPoint(int(point["step"]), int(point["peak_bytes"])) for point in data["recent_peaks"]
            ),
            evaluation=tuple(
                EvaluationPeak(stage, int(peak["peak_bytes"]), int(peak["reserved_bytes"]), int(peak["after_step"]))
                for stage, peak in data["evaluation"].items()
            ),
            ranks=tuple(
                RankSummary(int(rank["rank"]), rank["device_index"], rank["peak_bytes"], int(rank["steps"]))
                for rank in data["ranks"]
            ),
            not_measured=tuple(NotMeasured(str(item["what"]), str(item["reason"])) for item in data["not_measured"]),
        )
    except KeyError as error:
        raise ReportFormatError(f"malformed lightning_vram report: missing field {error}") from error
    except (TypeError, ValueError, AttributeError) as error:
        raise ReportFormatError(f"malformed lightning_vram report: {error}") from error


def largest_savers(profiles: tuple[ModuleProfile, ...]) -> tuple[ModuleProfile, ...]:
    """The modules that saved activations themselves, largest first (ties by name)."""
    savers = [profile for profile in profiles if profile.activation_bytes > 0]
    return tuple(sorted(savers, key=lambda profile: (-profile.activation_bytes, profile.name)))


def in_phase_order(phases: dict[Phase, PhasePeak]) -> list[tuple[Phase, PhasePeak]]:
    """The phases present, in the order a training step runs them."""
    return [(phase, phases[phase]) for phase in Phase if phase in phases]


def _breakdown_dict(breakdown: Breakdown | None) -> dict[str, int | None] | None:
    return breakdown.to_dict() if breakdown is not None else None


def _peak_dict(peak: PhasePeak | None) -> dict[str, Any] | None:
    if peak is None:
        return None
    return {
        "step": peak.step,
        "phase": peak.phase.value,
        "allocated_bytes": peak.peak_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "breakdown": _breakdown_dict(peak.breakdown),
    }


def headline(report: Report) -> str:
    """One sentence: the peak, where it happened, and what held most of it."""
    peak = report.peak
    if peak is None:
        return "No step was measured."
    capacity = report.device.total_bytes
    share = f" ({format_percent(peak.peak_bytes / capacity)} of {format_bytes(capacity)})" if capacity else ""
    text = f"Peak {format_bytes(peak.peak_bytes)}{share} in {peak.phase.value} of step {peak.step}"
    if peak.breakdown is None:
        return text + "."
    parts = {name: value for name, value in peak.breakdown.to_dict().items() if value is not None}
    largest = max(parts, key=lambda name: parts[name])
    return f"{text}; {largest.replace('_', ' ')} held {format_bytes(parts[largest])}."


def evaluation_text(peaks: tuple[EvaluationPeak, ...]) -> str:
    """Each evaluation stage's peak, in one line."""
    return ", ".join(
        f"{peak.stage} {format_bytes(peak.peak_bytes)}"
        + (f" (after step {peak.after_step})" if peak.after_step else "")
        for peak in peaks
    )


def ranks_line(report: Report) -> str | None:
    """Under distributed training: the rank with the highest peak and the spread between ranks."""
    measured = [rank for rank in report.ranks if rank.peak_bytes is not None]
    if len(report.ranks) < 2 or not measured:
        return None
    highest = max(measured, key=lambda rank: rank.peak_bytes or 0)
    lowest = min(measured, key=lambda rank: rank.peak_bytes or 0)
    spread = (highest.peak_bytes or 0) - (lowest.peak_bytes or 0)
    return (
        f"{len(report.ranks)} ranks: rank {highest.rank} peaked highest ({format_bytes(highest.peak_bytes)}),"
        f" {format_bytes(spread)} above rank {lowest.rank}"
    )


def _timing_line(report: Report) -> str:
    timing = report.timing
    step = f"{1000 * timing.step_seconds_median:.1f} ms" if timing.step_seconds_median is not None else "n/a"
    utilization = f"{timing.gpu_utilization_mean:.0f}%" if timing.gpu_utilization_mean is not None else "n/a"
    return f"step {step} median, data wait {format_percent(timing.data_wait_fraction)}, GPU utilization {utilization}"


def summary_text(report: Report, top_modules: int = 3) -> str:
    """A few lines for the console at the end of training."""
    device = report.device
    lines = [f"VRAM report: {device.name} ({device.type}), {report.steps} steps", f"  {headline(report)}"]
    if (ranks := ranks_line(report)) is not None:
        lines.append(f"  {ranks}")
    peak = report.peak
    if peak is not None:
        if peak.breakdown is not None:
            parts = peak.breakdown
            lines.append(
                f"  parameters {format_bytes(parts.parameters)} | gradients {format_bytes(parts.gradients)}"
                f" | optimizer state {format_bytes(parts.optimizer_state)}"
                f" | activations {format_bytes(parts.activations)} | other {format_bytes(parts.other)}"
            )
        phases = ", ".join(f"{phase.value} {format_bytes(p.peak_bytes)}" for phase, p in in_phase_order(report.phases))
        lines.append(f"  phase peaks: {phases}")
    if report.evaluation:
        lines.append(f"  evaluation peaks: {evaluation_text(report.evaluation)}")
    if report.modules:
        top = ", ".join(
            f"{row.name} ({row.type}) {format_bytes(row.activation_bytes)}" for row in report.modules[:top_modules]
        )
        lines.append(f"  most activations saved by: {top}")
    lines.append(f"  {_timing_line(report)}")
    if report.recovered_ooms:
        lines.append(
            f"  recovered from {report.recovered_ooms} CUDA out-of-memory error(s) (caught by the training code)"
        )
    for advice in report.advice:
        lines.append(f"  advice [{advice.id}]: {advice.title}")
    for item in report.not_measured:
        lines.append(f"  not measured: {item.what} ({item.reason})")
    return "\n".join(lines)


def advice_markdown(advice: tuple[Advice, ...]) -> str:
    """The advice as Markdown: one section each with evidence, saving and the change to make."""
    if not advice:
        return "No advice: no rule found a change worth making in this run's measurements.\n"
    sections = []
    for item in advice:
        saving = saving_text(item)
        saving_line = f"\n**Expected saving:** {saving}\n" if saving else "\n"
        sections.append(
            f"### {item.title}\n\n`{item.id}` · {item.severity}\n\n**Evidence:** {item.evidence}\n"
            f"{saving_line}\n{item.detail}\n"
        )
    return "\n".join(sections)


def markdown(report: Report) -> str:
    """The whole report as Markdown, for a terminal or a pull-request comment."""
    device = report.device
    lines = [
        "# VRAM report",
        "",
        f"**{headline(report)}**",
        "",
        *([ranks, ""] if (ranks := ranks_line(report)) is not None else []),
        f"{device.name} ({device.type}), capacity {format_bytes(device.total_bytes)}; precision"
        f" {report.precision or 'n/a'}; batch size {report.batch_size or 'n/a'}; {report.steps} steps; "
        + _timing_line(report)
        + ".",
        "",
        "## Breakdown at each phase's peak",
        "",
        "| phase | peak | " + " | ".join(name.replace("_", " ") for name in CATEGORIES) + " |",
        "|---|---:|" + "---:|" * len(CATEGORIES),
    ]
    for phase, peak in in_phase_order(report.phases):
        values = peak.breakdown.to_dict() if peak.breakdown is not None else {}
        cells = " | ".join(format_bytes(values.get(name)) for name in CATEGORIES)
        lines.append(f"| {phase.value} | {format_bytes(peak.peak_bytes)} | {cells} |")
    if report.evaluation:
        lines += ["", f"Evaluation peaks: {evaluation_text(report.evaluation)}."]
    if report.modules:
        lines += ["", "## Modules saving the most activations", "", "| module | type | saved |", "|---|---|---:|"]
        lines += [f"| `{row.name}` | {row.type} | {format_bytes(row.activation_bytes)} |" for row in report.modules]
    lines += ["", "## Advice", "", advice_markdown(report.advice).rstrip()]
    if report.fit:
        lines += ["", "## Largest batch of this run per GPU", "", "| GPU | capacity | batch |", "|---|---:|---:|"]
        lines += [f"| {row.device} | {format_bytes(row.capacity_bytes)} | {row.max_batch_size} |" for row in report.fit]
    if report.not_measured:
        lines += ["", "## Not measured", ""]
        lines += [f"- {item.what}: {item.reason}" for item in report.not_measured]
    return "\n".join(lines) + "\n"
