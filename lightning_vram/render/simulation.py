"""The report's simulation section as plain-text tables: the replayed baseline, and each change replayed on it.

The replayed baseline is set against the measured step; the Markdown and HTML reports render the same tables, each
escaping the cells its own way.

Peaks are read as the report measures them: on CUDA the allocator's, elsewhere the live peak (every tensor alive).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.advice.rules.mixed_precision import not_advised
from lightning_vram.records import (
    COUNTED_PARTS,
    LIVE_PEAK_PART,
    BaselineMatch,
    Calibration,
    Phase,
    ReplayedStep,
    Report,
    Simulation,
    in_phase_order,
)
from lightning_vram.units import format_bytes

SHOWN_REASON_CHARACTERS = 200
"""How much of a discarded change's reason a table cell quotes."""


@dataclass(frozen=True)
class Table:
    """Rows of plain-text cells under a header; ``numeric`` marks the columns aligned right."""

    header: tuple[str, ...]
    numeric: tuple[bool, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class SimulationView:
    """What the report says about its simulation: a sentence, the baseline's table, the changes' table, notes.

    ``calibration``: the replay's error, the sampled step's allocator peaks beside the replay's (CUDA only).
    """

    summary: str
    baseline: Table | None
    variants: Table | None
    notes: tuple[str, ...]
    calibration: Table | None = None


def signed_bytes(num_bytes: int) -> str:
    """A change in bytes with its sign.

    >>> signed_bytes(-2048), signed_bytes(0), signed_bytes(512)
    ('-2.0 KiB', '+0 B', '+512 B')
    """
    return ("-" if num_bytes < 0 else "+") + format_bytes(abs(num_bytes))


def shortened(text: str, limit: int = SHOWN_REASON_CHARACTERS) -> str:
    """``text`` cut to ``limit`` characters, marked where cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _summary(simulation: Simulation) -> str:
    baseline = simulation.baseline
    if baseline is None:
        return f"The step was not replayed: {simulation.skipped}. Every saving in this report is modelled."
    step = next(iter(baseline.phases.values())).step if baseline.phases else 0
    batch = f", batch size {baseline.batch_size}" if baseline.batch_size is not None else ""
    replayed = (
        f"Step {step} was replayed under fake tensors on {simulation.device_type} in {simulation.seconds:.2f} s"
        f" (precision {baseline.precision}{batch})"
    )
    if simulation.skipped is not None:
        return f"{replayed}, but not trusted: {simulation.skipped}. Every saving in this report is modelled."
    measure = "the allocator's peak" if simulation.device_type == "cuda" else "the live peak (every tensor alive)"
    match = simulation.match
    compared = (
        "; no measured counts to compare it with"
        if match is None
        else f"; it matches the measured step, every counted part within {match.tolerance:.0%}"
    )
    return f"{replayed}{compared}{_window_text(simulation)}. Each change below was replayed on it; a peak is {measure}."


def _window_text(simulation: Simulation) -> str:
    """Under gradient accumulation, which micro-batch the sampled step was matched against, and which the advice is.

    >>> from lightning_vram.records import Simulation
    >>> match = BaselineMatch(2, (), 0.01, window_first=True)
    >>> print(_window_text(Simulation("cpu", None, match, None, (), 0.0, accumulate_grad_batches=2))[:108], "...")
    , with accumulate_grad_batches=2: sampled step 2 is the first micro-batch of its window (no optimizer step), ...
    """
    window = simulation.accumulate_grad_batches
    if window <= 1:
        return ""
    match = simulation.match
    steady = "the steady micro-batch's (a later one of the window, with the optimizer step), which holds the most"
    if match is None:
        return f", with accumulate_grad_batches={window}; the advice's figures are {steady}"
    if match.window_first:
        return (
            f", with accumulate_grad_batches={window}: sampled step {match.step} is the first micro-batch of its window"
            " (no optimizer step), and the table sets it against the replay of a window's first micro-batch; the"
            f" advice's figures are {steady}"
        )
    return (
        f", with accumulate_grad_batches={window}: sampled step {match.step} is a later micro-batch of its window, set"
        f" against the replay of one; the advice's figures are {steady}"
    )


def _largest_difference(match: BaselineMatch, phase: Phase) -> str:
    parts = [part for part in match.parts if part.phase is phase]
    worst = max(parts, key=lambda part: part.relative_error, default=None)
    if worst is None or worst.replayed_bytes == worst.measured_bytes:
        return "none"
    if worst.measured_bytes == 0:
        return f"{worst.part.replace('_', ' ')} {signed_bytes(worst.replayed_bytes)}"
    share = (worst.replayed_bytes - worst.measured_bytes) / worst.measured_bytes
    return f"{worst.part.replace('_', ' ')} {share:+.2%}"


def _baseline_table(report: Report, simulation: Simulation, baseline: ReplayedStep) -> Table:
    match = simulation.match
    on_cuda = simulation.device_type == "cuda"
    measured_live = any(p.breakdown is not None and p.breakdown.other is not None for p in report.phases.values())
    header = ["phase", "measured counted", "replayed counted", "largest difference"]
    carried = simulation.calibration is not None and simulation.calibration.carries
    if on_cuda:
        predicted = "predicted allocator peak (replayed + carried)" if carried else "replayed allocator peak"
        header += ["measured peak (run's highest)", predicted]
    elif measured_live:
        header += [
            "measured live peak (run's highest)",
            "predicted peak (replayed + carried)" if carried else "replayed live peak",
        ]
    if match is not None and match.window_first:
        header = [name.replace("(run's highest)", "(sampled step)") if measured_live else name for name in header]
        rows = _window_first_rows(report, match, baseline, on_cuda or measured_live)
        return Table(tuple(header), _numeric(header), tuple(rows))
    rows = []
    for phase, peak in in_phase_order(baseline.phases):
        measured = (
            format_bytes(
                sum(part.measured_bytes for part in match.parts if part.phase is phase and part.part in COUNTED_PARTS)
            )
            if match is not None
            else "n/a"
        )
        counted = format_bytes(peak.breakdown.counted_bytes) if peak.breakdown is not None else "n/a"
        row = [phase.value, measured, counted, _largest_difference(match, phase) if match is not None else "n/a"]
        if on_cuda or measured_live:
            run_peak = report.phases.get(phase)
            row += [format_bytes(run_peak.peak_bytes if run_peak is not None else None), format_bytes(peak.peak_bytes)]
        rows.append(tuple(row))
    return Table(tuple(header), _numeric(header), tuple(rows))


def _numeric(header: list[str]) -> tuple[bool, ...]:
    return tuple(name not in ("phase", "largest difference") for name in header)


def _window_first_rows(
    report: Report, match: BaselineMatch, baseline: ReplayedStep, peaks: bool
) -> list[tuple[str, ...]]:
    """The rows of a sampled first micro-batch: each phase it counted, against the replayed first micro-batch's.

    The replayed bytes are the match's own (what the sampled step was compared with); the peaks are the sampled
    step's live peak and the replay's where the match compared them (the CPU), else the run's highest and the
    replayed first micro-batch's (``n/a`` read back from a file, which keeps only the steady micro-batch's phases).
    """
    rows = []
    for phase in [phase for phase in Phase if any(part.phase is phase for part in match.parts)]:
        parts = [part for part in match.parts if part.phase is phase]
        counted = [part for part in parts if part.part in COUNTED_PARTS]
        row = [
            f"{phase.value} (first micro-batch)",
            format_bytes(sum(part.measured_bytes for part in counted)),
            format_bytes(sum(part.replayed_bytes for part in counted)),
            _largest_difference(match, phase),
        ]
        if peaks:
            live = next((part for part in parts if part.part == LIVE_PEAK_PART), None)
            first = baseline.window_first.get(phase) if baseline.window_first is not None else None
            run_peak = report.phases.get(phase)
            measured = live.measured_bytes if live is not None else run_peak.peak_bytes if run_peak else None
            replayed = live.replayed_bytes if live is not None else first.peak_bytes if first is not None else None
            row += [format_bytes(measured), format_bytes(replayed)]
        rows.append(tuple(row))
    return rows


def error_text(error: float | None) -> str:
    """A relative error as a signed percentage (``n/a`` when unknown).

    >>> error_text(-0.0312), error_text(None)
    ('-3.12%', 'n/a')
    """
    return "n/a" if error is None else f"{error:+.2%}"


def calibration_table(calibration: Calibration) -> Table:
    """The replay's error: each phase's replayed and measured allocated and reserved peaks, and what is carried."""
    header = (
        "phase",
        "replayed allocated",
        "measured allocated",
        "the replay's error",
        "replayed reserved",
        "measured reserved",
        "the replay's error (reserved)",
        "carried",
    )
    rows = tuple(
        (
            phase.phase.value,
            format_bytes(phase.replayed_allocated_bytes),
            format_bytes(phase.measured_allocated_bytes),
            error_text(phase.allocated_error),
            format_bytes(phase.replayed_reserved_bytes),
            format_bytes(phase.measured_reserved_bytes),
            error_text(phase.reserved_error),
            format_bytes(phase.unseen_bytes),
        )
        for phase in calibration.phases
    )
    return Table(header, (False, True, True, True, True, True, True, True), rows)


def calibration_line(calibration: Calibration) -> str:
    """The replay's error in one line of the console summary: each phase's errors, and what was carried.

    >>> from lightning_vram.records import PhaseCalibration
    >>> print(calibration_line(Calibration(1, (PhaseCalibration(Phase.FORWARD, 97, 100, 200, 200),))))
    the replay's error on step 1: forward -3.00% allocated, +0.00% reserved; carried into predictions: 3 B
    """
    phases = "; ".join(
        f"{item.phase.value} {error_text(item.allocated_error)} allocated, {error_text(item.reserved_error)} reserved"
        for item in calibration.phases
    )
    carried = sum(calibration.unseen_bytes.values())
    return f"the replay's error on step {calibration.step}: {phases}; carried into predictions: {format_bytes(carried)}"


def _calibration_notes(simulation: Simulation) -> tuple[str, ...]:
    """What the calibration carried, in words (none when nothing was)."""
    calibration = simulation.calibration
    if calibration is None or not calibration.carries:
        return ()
    carried = sum(calibration.unseen_bytes.values())
    return (
        f"The replay's error: sampled step {calibration.step} held more than the replay in some phase (cuDNN or"
        " cuBLASLt workspaces, anything else the replay cannot see); what it held beyond the replay, phase by phase"
        f" ({format_bytes(carried)} in all), is carried into every prediction of this run (the replayed baseline,"
        " each change, the batch sizes of the fit table).",
    )


def _variants_table(baseline: ReplayedStep, simulation: Simulation) -> Table | None:
    if not simulation.variants:
        return None
    baseline_bytes = baseline.reported_bytes(baseline.reported_peak) if baseline.phases else None
    rows = []
    for variant in simulation.variants:
        replayed = variant.replayed
        if replayed is None:
            rows.append((variant.change.label, "n/a", "n/a", f"discarded: {shortened(variant.discarded or '')}"))
            continue
        if not replayed.phases:  # a report edited by hand
            rows.append((variant.change.label, "n/a", "n/a", "replayed, no phase recorded"))
            continue
        peak = replayed.reported_peak
        predicted = replayed.reported_bytes(peak)
        rows.append(
            (
                variant.change.label,
                format_bytes(predicted),
                signed_bytes(predicted - baseline_bytes) if baseline_bytes is not None else "n/a",
                f"replayed, peak in {peak.phase.value}"
                + (f"; {reason}" if (reason := not_advised(simulation.device_type, variant.change)) else ""),
            )
        )
    header = ("change", "predicted peak", "against the replayed baseline", "result")
    return Table(header, (False, True, True, False), tuple(rows))


def simulation_view(report: Report) -> SimulationView | None:
    """The report's simulation in words and tables, or ``None`` when the report has none."""
    simulation = report.simulation
    if simulation is None:
        return None
    baseline = simulation.baseline
    if baseline is None:
        return SimulationView(_summary(simulation), None, None, ())
    trusted = simulation.skipped is None
    return SimulationView(
        summary=_summary(simulation),
        baseline=_baseline_table(report, simulation, baseline),
        variants=_variants_table(baseline, simulation) if trusted else None,
        notes=_strategy_notes(baseline) + _calibration_notes(simulation) + baseline.notes + _fit_notes(simulation),
        calibration=calibration_table(simulation.calibration) if simulation.calibration is not None else None,
    )


def _strategy_notes(baseline: ReplayedStep) -> tuple[str, ...]:
    """What the strategy holds beyond the replayed step, added to it, in words (none without a strategy's line).

    >>> from lightning_vram.records import StrategyBuffers
    >>> buckets = StrategyBuffers("DDP gradient buckets", (1048576, 1048576), "by hand")
    >>> print(_strategy_notes(ReplayedStep("cpu", "32-true", 8, {}, (), 0, 0.0, strategy=buckets))[0])
    DDP gradient buckets: 2.0 MiB (2 buffers) held in every phase of each rank, inside 'other' (by hand).
    """
    strategy = baseline.strategy
    if strategy is None:
        return ()
    count = len(strategy.buffers)
    return (
        f"{strategy.label}: {format_bytes(strategy.total_bytes)} ({count} buffer{'s' if count != 1 else ''}) held in"
        f" every phase of each rank, inside 'other' ({strategy.basis}).",
    )


def _fit_notes(simulation: Simulation) -> tuple[str, ...]:
    """Why the replayed fit table lacks rows, as a note (none when it lacks none)."""
    if simulation.fit_note is None:
        return ()
    return (f"Largest batch per GPU: {simulation.fit_note}.",)
