"""The report in words: the headline, the console summary and the Markdown report (and the OOM diagnosis's).

Every string that comes from the user's model or machine (module names, class names, device names, error messages)
enters Markdown through :mod:`lightning_vram.render.markup`, which escapes it; advice enters through
:func:`~lightning_vram.render.markup.safe_markdown`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from lightning_vram.records import (
    CATEGORIES,
    Advice,
    DeviceInfo,
    EvaluationPeak,
    FitRow,
    ModuleProfile,
    NotAdvised,
    OomDiagnosis,
    Phase,
    PreflightRemedy,
    PreflightVerdict,
    RankPreflight,
    Report,
    SavingBasis,
    expandable_lines,
    in_phase_order,
)
from lightning_vram.records.oom import oom_headline
from lightning_vram.render.diff import STEP_TIME_SPREAD_BOUND
from lightning_vram.render.markup import code_span, escape_markdown, printable, safe_markdown
from lightning_vram.render.shapes import lengths_line, lengths_table, longest_line, shapes_sentence, shows_lengths
from lightning_vram.render.simulation import Table, calibration_line, simulation_view
from lightning_vram.units import format_bytes, format_percent

"""How the monitor's warnings start."""
SUMMARY_TOP_MODULES = 3
"""How many of the top modules the console summary names."""

SUMMARY_WIDTH = 80
"""The console summary's width in characters where the output is not a terminal (piped, a file, a log)."""

DETAILS = "the Markdown report"
"""Where the summary says the reasons are when it is not told the report's file."""


def basis_word(advice: Advice) -> SavingBasis | None:
    """How the advice's memory figure is known, in a word: ``simulated``, ``modelled``, or ``None`` without one."""
    if advice.saving_basis is not None:
        return advice.saving_basis
    return SavingBasis.SIMULATED if advice.predicted_peak_bytes is not None else None


def saving_text(advice: Advice) -> str | None:
    """The expected saving in words, with how it is known; ``None`` when the advice estimates none.

    >>> from lightning_vram.records import AdviceId, Severity
    >>> fired = AdviceId.LARGE_LINEAR, Severity.INFO, "t", "d", "e", 2048
    >>> saving_text(Advice(*fired, saving_basis=SavingBasis.SIMULATED, predicted_peak_bytes=8192))
    'about 2.0 KiB of peak memory (simulated: replayed peak 8.0 KiB after the change)'
    >>> saving_text(Advice(*fired, saving_basis=SavingBasis.MODELLED))
    'about 2.0 KiB of peak memory (modelled)'
    """
    savings = []
    replayed = (
        f"replayed peak {format_bytes(advice.predicted_peak_bytes)} after the change"
        if advice.predicted_peak_bytes is not None
        else None
    )
    if advice.estimated_saving_bytes is not None:
        basis = advice.saving_basis
        how = (
            f" ({basis}: {replayed})" if basis == SavingBasis.SIMULATED and replayed else f" ({basis})" if basis else ""
        )
        savings.append(f"about {format_bytes(advice.estimated_saving_bytes)} of peak memory{how}")
    elif replayed is not None:
        savings.append(f"no memory to speak of (simulated: {replayed})")
    if advice.estimated_saving_seconds is not None:
        savings.append(f"up to {1000 * advice.estimated_saving_seconds:.1f} ms per step")
    return ", ".join(savings) if savings else None


def spread_note(spread: float | None) -> str | None:
    """Why the run's step-time figures are not to be trusted, where its step times varied too much (else ``None``).

    ``spread``: the recent step times' interquartile range over their median (a fraction; ``None``: not measured).
    Above :data:`~lightning_vram.render.diff.STEP_TIME_SPREAD_BOUND`, the bound ``lightning-vram diff`` holds a
    ratio of step times to (a machine loaded by other work).

    >>> spread_note(1.08)
    'step times varied 108.0% (interquartile range over the median): timings not reliable'
    >>> spread_note(0.25), spread_note(None)
    (None, None)
    """
    if spread is None or spread <= STEP_TIME_SPREAD_BOUND:
        return None
    return f"step times varied {format_percent(spread)} (interquartile range over the median): timings not reliable"


def has_step_time(advice: Advice) -> bool:
    """Whether the advice prints a step-time figure: a saving per step, a cost, or a predicted step."""
    return any(
        value is not None
        for value in (advice.estimated_saving_seconds, advice.cost_text, advice.predicted_step_seconds)
    )


def advice_summary(advice: Advice, spread: float | None = None) -> str:
    """One advice as the console leads with it: its title, then its expected saving, how that is known and its time.

    ``spread``: the run's step-time spread (:func:`spread_note`), noted after the step-time figures above the bound.

    >>> from lightning_vram.records import AdviceId, Severity
    >>> fired = AdviceId.LARGE_LINEAR, Severity.INFO, "Split the head", "d", "e", 2048
    >>> advice_summary(Advice(*fired, saving_basis=SavingBasis.SIMULATED, estimated_saving_seconds=0.0012))
    'advice: Split the head (saves about 2.0 KiB, simulated; up to 1.2 ms per step)'
    >>> from lightning_vram.records import CostBasis
    >>> advice_summary(Advice(*fired, estimated_cost_seconds=0.004, flop_ratio=1.2, cost_basis=CostBasis.SAME_FLOPS))
    'advice: Split the head (saves about 2.0 KiB; costs about +4.0 ms a step (+20.0% FLOPs, same FLOPs))'
    """
    figures = []
    word = basis_word(advice)
    saving = format_bytes(advice.estimated_saving_bytes) if advice.estimated_saving_bytes is not None else None
    if saving is not None and saving not in advice.title:  # a title that says its saving is not repeated
        figures.append(f"saves about {saving}" + (f", {word}" if word else ""))
    elif word is not None:
        figures.append(str(word))
    if advice.estimated_saving_seconds is not None:
        figures.append(f"up to {1000 * advice.estimated_saving_seconds:.1f} ms per step")
    if advice.cost_text is not None:
        figures.append(advice.cost_text)
    predicted = predicted_step_text(advice)
    if predicted is not None:
        figures.append(predicted)
    if has_step_time(advice) and (note := spread_note(spread)) is not None:
        figures.append(note)
    return f"advice: {advice.title}" + (f" ({'; '.join(figures)})" if figures else "")


def predicted_step_text(advice: Advice) -> str | None:
    """The step time predicted with the change, in words (``None``: not predicted).

    >>> from lightning_vram.records import AdviceId, Severity
    >>> advice = Advice(AdviceId.LARGE_LINEAR, Severity.INFO, "t", "d", "e", 1, predicted_step_seconds=0.0234)
    >>> predicted_step_text(advice)
    'predicted step 23.4 ms with the change (roofline, calibrated by this run)'
    """
    seconds = advice.predicted_step_seconds
    if seconds is None:
        return None
    return f"predicted step {1000 * seconds:.1f} ms with the change (roofline, calibrated by this run)"


def folded_line(label: str, names: list[str], why: str) -> str:
    """``names`` in one line after ``label``, then where to read why (the summary cuts it to its width).

    >>> folded_line("not advised", ["pin-memory", "mixed-precision"], "vram_report.md")
    'not advised: pin-memory, mixed-precision (why: vram_report.md)'
    """
    return f"{label}: {', '.join(names)} (why: {why})"


def wrapped(line: str, width: int) -> list[str]:
    """A summary line (its indent included) cut at spaces into lines of at most ``width`` characters.

    Continuation lines are indented two more spaces; a word longer than the width (a path) is kept whole.

    >>> wrapped("  advice: Checkpoint the encoder", 20)
    ['  advice: Checkpoint', '    the encoder']
    """
    indent = " " * (len(line) - len(line.lstrip(" ")))
    return textwrap.wrap(
        line.lstrip(" "),
        width,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]


def module_text(row: ModuleProfile) -> str:
    """A module as the report names it: its name, with its type where it has one.

    >>> module_text(ModuleProfile("net.0", "Linear", 1)), module_text(ModuleProfile("(training_step)", "-", 1))
    ('net.0 (Linear)', '(training_step)')
    """
    return row.name if row.type in ("", "-") else f"{row.name} ({row.type})"


def capacity_text(device: DeviceInfo) -> str:
    """The memory the device's share is of: a GPU's memory, or on the CPU the host's RAM, said so.

    >>> capacity_text(DeviceInfo("cpu", "x86_64", None, 8 * 1024**3))
    '8.00 GiB host RAM'
    >>> capacity_text(DeviceInfo("cuda", "NVIDIA A100", 0, 80 * 1024**3))
    '80.00 GiB'
    """
    if device.total_bytes is None:
        return "n/a"
    return format_bytes(device.total_bytes) + (" host RAM" if device.type != "cuda" else "")


def peak_label(report: Report) -> str:
    """What the report's peaks are: ``"live peak"`` where every live tensor was counted (the CPU), else ``"peak"``.

    On CUDA the allocator's peak is live already; on the CPU a peak whose breakdown has no ``other`` is the sum of
    the counted parts (the live count stood aside, or a report written before it existed).
    """
    peak = report.peak
    live = peak is not None and peak.breakdown is not None and peak.breakdown.other is not None
    return "live peak" if live and report.device.type != "cuda" else "peak"


def headline(report: Report) -> str:
    """One sentence: the peak, where it happened, and what held most of it; then the error the run ended with."""
    ended = (
        f" The run stopped with {report.ended_with}: these figures cover its steps until then."
        if report.ended_with
        else ""
    )
    peak = report.peak
    if peak is None:
        return "No step was measured." + ended
    capacity = report.device.total_bytes
    share = f" ({format_percent(peak.peak_bytes / capacity)} of {capacity_text(report.device)})" if capacity else ""
    label = peak_label(report).capitalize()
    text = f"{label} {format_bytes(peak.peak_bytes)}{share} in {peak.phase.value} of step {peak.step}"
    text += micro_batch_text(peak.micro_batch, report.accumulate_grad_batches)
    if peak.breakdown is None:
        return text + "." + ended
    largest = peak.breakdown.largest_part
    return f"{text}; {largest.replace('_', ' ')} held {format_bytes(peak.breakdown.to_dict()[largest])}.{ended}"


def micro_batch_text(micro_batch: int | None, window: int | None) -> str:
    """Under gradient accumulation, which micro-batch of its window a sampled step was (empty where not known).

    >>> micro_batch_text(2, 2), micro_batch_text(1, 4), micro_batch_text(None, 2), micro_batch_text(3, None)
    (' (micro-batch 2 of 2, which steps the optimizer)', ' (micro-batch 1 of 4)', '', ' (micro-batch 3)')
    """
    if micro_batch is None:
        return ""
    if window is None:
        return f" (micro-batch {micro_batch})"
    steps = ", which steps the optimizer" if micro_batch == window else ""
    return f" (micro-batch {micro_batch} of {window}{steps})"


def evaluation_text(peaks: tuple[EvaluationPeak, ...]) -> str:
    """Each evaluation stage's peak, in one line."""
    return ", ".join(
        f"{peak.stage} {format_bytes(peak.peak_bytes)}"
        + (f" (after step {peak.after_step})" if peak.after_step else "")
        for peak in peaks
    )


def ranks_line(report: Report) -> str | None:
    """Under distributed training: the highest rank's peak and the spread (one figure where every rank is alike)."""
    measured = [rank for rank in report.ranks if rank.peak_bytes is not None]
    if len(report.ranks) < 2 or not measured:
        return None
    highest = max(measured, key=lambda rank: rank.peak_bytes or 0)
    lowest = min(measured, key=lambda rank: rank.peak_bytes or 0)
    spread = (highest.peak_bytes or 0) - (lowest.peak_bytes or 0)
    if spread == 0 and len(measured) == len(report.ranks):  # not "rank 0 peaked highest, 0 B above rank 0"
        return f"{len(report.ranks)} ranks: every rank peaked at {format_bytes(highest.peak_bytes)}"
    return (
        f"{len(report.ranks)} ranks: rank {highest.rank} peaked highest ({format_bytes(highest.peak_bytes)}),"
        f" {format_bytes(spread)} above rank {lowest.rank}"
    )


def timing_line(report: Report) -> str:
    """Median step time, data wait and GPU utilization, in one line."""
    timing = report.timing
    step = f"{1000 * timing.step_seconds_median:.1f} ms" if timing.step_seconds_median is not None else "n/a"
    utilization = f"{timing.gpu_utilization_mean:.0f}%" if timing.gpu_utilization_mean is not None else "n/a"
    why = next((item.reason for item in report.not_measured if item.what == "GPU utilization"), None)
    if timing.gpu_utilization_mean is None and report.device.type == "cuda" and why is not None:
        utilization += f" ({why})"
    return f"step {step} median, data wait {format_percent(timing.data_wait_fraction)}, GPU utilization {utilization}"


def steps_text(batches: int, optimizer_steps: int | None, accumulate_grad_batches: int | None) -> str:
    """The steps monitored, in words, counted as Lightning's ``max_steps`` and ``global_step`` count them.

    Where each batch stepped the optimizer once, the batches alone; else the optimizer steps, then the batches they
    took (gradient accumulation: one step a window; manual optimization: each ``opt.step()``). Without a count of
    optimizer steps (``None``: an older report; ``0`` without accumulation: a loop that never said so), the
    batches, as "steps".

    >>> steps_text(40, 40, 1), steps_text(40, 20, 2), steps_text(4, 8, 1)
    ('40 steps', '20 optimizer steps (40 batches, accumulation 2)', '8 optimizer steps (4 batches)')
    >>> steps_text(1, 0, 4), steps_text(3, 0, 1), steps_text(1, None, None)
    ('0 optimizer steps (1 batch, accumulation 4)', '3 steps', '1 step')
    """
    accumulation = f", accumulation {accumulate_grad_batches}" if (accumulate_grad_batches or 1) > 1 else ""
    if optimizer_steps is None or (optimizer_steps in (0, batches) and not accumulation):
        return _count(batches, "step")
    return f"{_count(optimizer_steps, 'optimizer step')} ({_count(batches, 'batch')}{accumulation})"


def _count(number: int, noun: str) -> str:
    """``number`` of ``noun``, in words.

    >>> _count(1, "batch"), _count(2, "batch"), _count(0, "step")
    ('1 batch', '2 batches', '0 steps')
    """
    if number == 1:
        return f"{number} {noun}"
    return f"{number} {noun}es" if noun.endswith("ch") else f"{number} {noun}s"


def report_steps_text(report: Report) -> str:
    """:func:`steps_text` of ``report``."""
    return steps_text(report.steps, report.optimizer_steps, report.accumulate_grad_batches)


def device_line(report: Report) -> str:
    """The device and the steps monitored, in one line."""
    return f"{report.device.name} ({report.device.type}), {report_steps_text(report)}"


def summary_text(
    report: Report,
    top_modules: int = SUMMARY_TOP_MODULES,
    written_to: str | None = None,
    width: int = SUMMARY_WIDTH,
    details: str = DETAILS,
) -> str:
    """A few lines for the console at the end of training (plain text: control characters shown as escapes).

    The advice comes first after the headline; what was not advised or not measured is one entry each, naming
    ``details`` (the Markdown report's file) for the reasons. ``written_to``: where the report's files were written,
    said last (``None``: not said). ``width``: no line is longer, in characters, but for a word longer than it.
    """
    lines = [*lead_lines(report, width, details), *_fitted([f"  {line}" for line in peak_lines(report)], width)]
    return "\n".join(lines + fact_lines(report, top_modules, written_to, width, details))


def _fitted(lines: list[str], width: int) -> list[str]:
    """Each line with its control characters escaped, cut to ``width``."""
    return [part for line in lines for part in wrapped(printable(line), width)]  # a name's line break stays escaped


def lead_lines(report: Report, width: int, details: str = DETAILS) -> list[str]:
    """The summary's first lines, cut to ``width``: the device, the headline, the ranks, each advice, where to read it.

    The console leads with each advice's title; ``details`` (the Markdown report's file) holds its code and evidence.
    """
    lines = [f"VRAM report: {device_line(report)}", f"  {headline(report)}"]
    if (ranks := ranks_line(report)) is not None:
        lines.append(f"  {ranks}")
    lines += [f"  {advice_summary(advice, report.timing.step_time_iqr_fraction)}" for advice in report.advice]
    if report.advice:
        lines.append(f"  how to apply the advice (the code to change, the evidence): {details}")
    if not report.advice and report.peak is not None:
        lines.append("  no advice: no rule found a change worth making")
    return _fitted(lines, width)


def peak_lines(report: Report) -> list[str]:
    """The breakdown at the run's peak and each phase's peak, a line each (none without a measured step)."""
    lines: list[str] = []
    peak = report.peak
    if peak is not None:
        if peak.breakdown is not None:
            parts = peak.breakdown
            lines.append(
                f"parameters {format_bytes(parts.parameters)} | gradients {format_bytes(parts.gradients)}"
                f" | optimizer state {format_bytes(parts.optimizer_state)}"
                f" | activations {format_bytes(parts.activations)} | other {format_bytes(parts.other)}"
            )
        phases = ", ".join(f"{phase.value} {format_bytes(p.peak_bytes)}" for phase, p in in_phase_order(report.phases))
        several = " (each the highest of its kind in a batch)" if several_updates_note(report) is not None else ""
        lines.append(f"phase peaks{several}: {phases}{_no_optimizer_reason(report)}")
    return lines


def breakdown_instant_note(report: Report) -> str | None:
    """When the counted parts beside each phase's peak were read (``None`` where no phase has a breakdown).

    Each counted part is read where the counted parts' sum peaked in the phase, which need not be the peak's own
    instant (a checkpointed model's backward can peak at the loss's start, before any gradient, while its counted
    parts peak later, with gradients).
    """
    if not any(peak.breakdown is not None for peak in report.phases.values()):
        return None
    return (
        "Parameters, gradients, optimizer state and activations are counted tensor by tensor where their sum peaked"
        " in the phase, not always at the peak's own moment; other is the peak less them."
    )


def several_updates_note(report: Report) -> str | None:
    """What a phase's peak is where batches took several optimizer steps each (manual optimization); else ``None``.

    Each backward pass and each update is a segment of its own; a phase's peak is the highest of its segments.
    """
    stepped = report.optimizer_steps
    if stepped is None or stepped <= report.steps:
        return None
    return (
        f"The batches took {stepped} optimizer steps in {report.steps} (manual optimization): each phase's peak is"
        " the highest of its kind in a batch: forward of the code before each backward pass, backward of each"
        " backward pass, optimizer of each update (and the code after the last one)."
    )


def _no_optimizer_reason(report: Report) -> str:
    """Why the phase peaks hold no optimizer entry where the sampled step was a window's first micro-batch."""
    simulation = report.simulation
    match = simulation.match if simulation is not None else None
    if simulation is None or match is None or not match.window_first or Phase.OPTIMIZER in report.phases:
        return ""
    return (
        f" (no optimizer entry: sampled step {match.step} is the first micro-batch of an accumulation window of"
        f" {simulation.accumulate_grad_batches}, which takes no optimizer step)"
    )


def fact_lines(report: Report, top_modules: int, written_to: str | None, width: int, details: str) -> list[str]:
    """The summary's lines past the peaks, cut to ``width``.

    Evaluation, top modules, timing, what was not advised and not measured (one entry each, pointing at ``details``
    for why), where the files are.
    """
    lines = []
    if report.evaluation:
        lines.append(f"evaluation peaks: {evaluation_text(report.evaluation)}")
    if report.modules:
        top = ", ".join(
            f"{module_text(row)} {format_bytes(row.activation_bytes)}" for row in report.modules[:top_modules]
        )
        lines.append(f"most activations saved by: {top}")
    lines.append(timing_line(report))
    if report.simulation is not None and report.simulation.skipped is not None:
        lines.append(f"advice modelled, the step not replayed ({details} says more): {report.simulation.skipped}")
    if report.simulation is not None and report.simulation.calibration is not None:
        lines.append(calibration_line(report.simulation.calibration))
    if report.shapes is not None:  # the peak per length where the shapes varied; else the one predicted, if any
        lengths = lengths_line(report.shapes) if report.shapes.varies else longest_line(report.shapes)
        if lengths is not None:
            lines.append(lengths)
    if report.recovered_ooms:
        lines.append(
            f"recovered from {report.recovered_ooms} CUDA out-of-memory error(s) (caught by the training code)"
        )
    folded = [
        ("not advised", [str(item.id) for item in report.not_advised]),
        ("not measured", [item.what for item in report.not_measured]),
    ]
    lines += [folded_line(label, names, details) for label, names in folded if names]
    if written_to is not None:
        lines.append(f"report written to {written_to}")
    return _fitted([f"  {line}" for line in lines], width)


def advice_markdown(advice: tuple[Advice, ...], spread: float | None = None) -> str:
    """The advice as Markdown: one section each with evidence, saving and the change to make.

    ``spread``: the run's step-time spread (:func:`spread_note`), noted after the step-time figures above the bound.
    """
    if not advice:
        return "No advice: no rule found a change worth making in this run's measurements.\n"
    sections = []
    for item in advice:
        saving = saving_text(item)
        saving_line = f"\n**Expected saving:** {saving}\n" if saving else "\n"
        if item.cost_text is not None:
            saving_line += f"\n**Time cost:** {escape_markdown(item.cost_text)}\n"
        predicted = predicted_step_text(item)
        if predicted is not None:
            saving_line += f"\n**Step time:** {escape_markdown(predicted)}\n"
        if has_step_time(item) and (note := spread_note(spread)) is not None:
            saving_line += f"\n**Timing:** {escape_markdown(note)}\n"
        sections.append(
            f"### {safe_markdown(item.title, keep_lines=False)}\n\n{code_span(item.id)} ·"
            f" {escape_markdown(item.severity)}\n\n**Evidence:** {escape_markdown(item.evidence)}\n{saving_line}\n"
            f"{safe_markdown(item.detail)}\n"
        )
    return "\n".join(sections)


def not_advised_markdown(items: tuple[NotAdvised, ...]) -> list[str]:
    """The remedies weighed and not advised, as Markdown lines under their own heading (none without any)."""
    if not items:
        return []
    return ["", "### Not advised", "", *(f"- {code_span(item.id)}: {escape_markdown(item.reason)}" for item in items)]


def fit_assumption(rows: Sequence[FitRow]) -> str:
    """What the fit table assumed, one sentence: the simulated allocator and its settings, or the margin kept.

    Then, where the run's batch does not fit a GPU, the micro-batch and accumulation that keep its global batch.

    >>> fit_assumption([FitRow("H200", 141, 150, SavingBasis.SIMULATED, allocator="")]).split(" serves")[0]
    'A batch fits where the simulated CUDA caching allocator (torch defaults)'
    """
    return _fit_rule(rows) + _kept_global_batch(rows)


def _fit_rule(rows: Sequence[FitRow]) -> str:
    settings = sorted({row.allocator for row in rows if row.allocator is not None})
    if not settings:
        return "A batch fits where its tensor peak and the CUDA context leave 10% of the card free."
    named = ", ".join(setting or "torch defaults" for setting in settings)
    gaps = "".join(f" {row.device}: {row.note}." for row in rows if row.note is not None)
    gaps += "".join(f" {line[0].upper()}{line[1:]}." for line in expandable_lines(rows))
    return (
        f"A batch fits where the simulated CUDA caching allocator ({named}) serves its whole step in the card's"
        f" memory less the CUDA context, no margin kept.{gaps}"
    )


def _kept_global_batch(rows: Sequence[FitRow]) -> str:
    """Where the run's batch does not fit: the micro-batch and accumulation that keep its global batch, per GPU.

    >>> print(_kept_global_batch([FitRow("A100", 40, 10).keeping(16, 4)]).split(": ")[1])
    A100, micro-batch 10 with accumulate_grad_batches=7 (global batch 70, the run's 64).
    """
    kept = [f"{row.device}, {row.accumulation_text}" for row in rows if row.accumulation_text is not None]
    return f" Where this run's batch does not fit: {'; '.join(kept)}." if kept else ""


def markdown_table(table: Table) -> list[str]:
    """A table of plain-text cells as Markdown lines, every cell escaped."""
    align = "|" + "".join("---:|" if numeric else "---|" for numeric in table.numeric)
    lines = ["| " + " | ".join(escape_markdown(cell) for cell in table.header) + " |", align]
    lines += ["| " + " | ".join(escape_markdown(cell) for cell in row) + " |" for row in table.rows]
    return lines


def markdown(report: Report) -> str:
    """The whole report as Markdown, for a terminal or a pull-request comment."""
    device = report.device
    lines = [
        "# VRAM report",
        "",
        f"**{escape_markdown(headline(report))}**",
        "",
        *([ranks, ""] if (ranks := ranks_line(report)) is not None else []),
        f"Device: {escape_markdown(f'{device.name} ({device.type})')}, capacity {capacity_text(device)}; precision"
        f" {escape_markdown(report.precision or 'n/a')}; batch size {report.batch_size or 'n/a'};"
        f" {report_steps_text(report)}; {timing_line(report)}.",
        "",
        "## Advice",
        "",
        advice_markdown(report.advice, report.timing.step_time_iqr_fraction).rstrip(),
        *not_advised_markdown(report.not_advised),
        "",
        "## Breakdown at each phase's peak",
        "",
        f"| phase | {peak_label(report)} | " + " | ".join(name.replace("_", " ") for name in CATEGORIES) + " |",
        "|---|---:|" + "---:|" * len(CATEGORIES),
    ]
    for phase, peak in in_phase_order(report.phases):
        values = peak.breakdown.to_dict() if peak.breakdown is not None else {}
        cells = " | ".join(format_bytes(values.get(name)) for name in CATEGORIES)
        lines.append(f"| {phase.value} | {format_bytes(peak.peak_bytes)} | {cells} |")
    if (instant := breakdown_instant_note(report)) is not None:
        lines += ["", escape_markdown(instant)]
    if (several := several_updates_note(report)) is not None:
        lines += ["", escape_markdown(several)]
    if report.evaluation:
        lines += ["", f"Evaluation peaks: {escape_markdown(evaluation_text(report.evaluation))}."]
    if report.modules:
        lines += ["", "## Modules saving the most activations", "", "| module | type | saved |", "|---|---|---:|"]
        lines += [
            f"| {code_span(row.name, in_table=True)} | {escape_markdown(row.type)}"
            f" | {format_bytes(row.activation_bytes)} |"
            for row in report.modules
        ]
    if report.fit:
        lines += [
            "",
            "## Largest batch of this run per GPU",
            "",
            "| GPU | capacity | batch | with expandable_segments:True | basis |",
            "|---|---:|---:|---:|---|",
        ]
        lines += [
            f"| {escape_markdown(row.device)} | {format_bytes(row.capacity_bytes)} | {row.batch_text}"
            f" | {row.expandable_text} | {row.basis} |"
            for row in report.fit
        ]
        lines += ["", escape_markdown(fit_assumption(report.fit))]
    if report.shapes is not None and shows_lengths(report.shapes):
        lines += ["", "## Batch shapes", "", escape_markdown(shapes_sentence(report.shapes))]
        if (table := lengths_table(report.shapes)) is not None:
            lines += ["", *markdown_table(table)]
    if (view := simulation_view(report)) is not None:
        lines += ["", "## Simulation", "", escape_markdown(view.summary)]
        for table in (view.baseline, view.calibration, view.variants):
            if table is not None:
                lines += ["", *markdown_table(table)]
        if view.notes:
            lines += ["", *(f"- {escape_markdown(note)}" for note in view.notes)]
    if report.not_measured:
        lines += ["", "## Not measured", ""]
        lines += [f"- {escape_markdown(item.what)}: {escape_markdown(item.reason)}" for item in report.not_measured]
    return "\n".join(lines) + "\n"


def oom_markdown(diagnosis: OomDiagnosis) -> str:
    """The diagnosis as Markdown; its first line is the headline."""
    message = diagnosis.message
    lines = [
        f"# Out of memory: {escape_markdown(oom_headline(diagnosis))}",
        "",
        f"Rank {diagnosis.rank}. Tried to allocate {format_bytes(message.tried_bytes)} with"
        f" {format_bytes(message.free_bytes)} free of {format_bytes(diagnosis.capacity_bytes)};"
        f" allocated {format_bytes(diagnosis.allocated_bytes)}, reserved {format_bytes(diagnosis.reserved_bytes)}.",
    ]
    if diagnosis.breakdown is not None:
        lines += ["", "| at the failure | bytes |", "|---|---:|"]
        lines += [
            f"| {name.replace('_', ' ')} | {format_bytes(value)} |"
            for name, value in diagnosis.breakdown.to_dict().items()
        ]
    if diagnosis.last_good_step:
        peaks = ", ".join(f"{peak.phase.value} {format_bytes(peak.peak_bytes)}" for peak in diagnosis.last_good_step)
        lines += ["", f"Last good step ({diagnosis.last_good_step[0].step}): {peaks}."]
    lines += ["", "## What to change, largest saving first", "", advice_markdown(diagnosis.advice).rstrip()]
    if diagnosis.notes or diagnosis.snapshot is not None:
        lines += ["", "## Notes", ""] + [f"- {escape_markdown(note)}" for note in diagnosis.notes]
        if diagnosis.snapshot is not None:
            lines.append(
                f"- Allocator history: {code_span(str(diagnosis.snapshot))}; open it at https://pytorch.org/memory_viz"
            )
    return "\n".join(lines) + "\n"


def preflight_warning(
    verdict: PreflightVerdict, device: str, length: int | None = None, shape: tuple[int, ...] | None = None
) -> str:
    """The warning given before a first step that is predicted not to fit on ``device`` (its warner's name before it).

    ``length``: the step replayed was the first one with its batch resized to this length (the longest expected:
    ``max_length``, or the DataLoader's own). ``shape``: resized to this shape past the batch dimension
    (``max_shape``).
    """
    peak = verdict.step.peak
    shortfall = verdict.needed_bytes - verdict.available_bytes
    allocated = peak.peak_bytes - verdict.needed_bytes
    what = "the first training step"
    if length is not None:
        what = f"a training step on batches {length:,} long, the longest expected,"
    if shape is not None:
        what = f"a training step on batches of {shape_text(shape)} per sample, the largest expected,"
    text = (
        f"{what} is predicted to run out of memory in {peak.phase.value} on"
        f" {device}: replayed peak {format_bytes(peak.peak_bytes)}, of which {format_bytes(allocated)} is"
        f" allocated already; {format_bytes(verdict.available_bytes)} more is available, {format_bytes(shortfall)}"
        " short."
    )
    if verdict.shortfall is not None:
        text += f" The simulated caching allocator runs out {verdict.shortfall}."
    if not verdict.remedies:
        return text + " No replayed change saves memory."
    fitting = [remedy for remedy in verdict.remedies if verdict.remedy_fits(remedy)]
    short = [remedy for remedy in verdict.remedies if not verdict.remedy_fits(remedy)]
    if fitting:
        text += f" Replayed changes that fit, largest saving first: {_remedies_text(fitting)}."
    else:
        text += " No replayed change makes it fit."
    if short:
        text += f" Replayed changes that save memory but still do not fit: {_remedies_text(short)}."
    return text


def ranks_preflight_warning(agreed: Sequence[RankPreflight], rank: int, own: str | None) -> str:
    """The warning rank ``rank`` gives before step 0 when some rank's first step is predicted not to fit.

    ``agreed``: every rank's verdict, rank by rank, as the ranks gathered them. Each rank predicted to run out of
    memory is named with what its step still needs and what its device has; the others fit or were skipped. Every
    rank's warning starts with the same sentence; ``own``, this rank's :func:`preflight_warning` where its own step
    does not fit (its remedies), follows. The warner's name goes before it.
    """
    short = [row for row in agreed if row.fits is False]
    named = "; ".join(map(_rank_shortfall, short))
    fitting = [str(row.rank) for row in agreed if row.fits]
    skipped = [str(row.rank) for row in agreed if row.fits is None]
    text = (
        f"preflight on {len(agreed)} ranks before step 0: {len(short)} of {len(agreed)} ranks predicted"
        f" to run out of memory: {named}."
    )
    if fitting:
        text += f" Predicted to fit: rank {', '.join(fitting)}."
    if skipped:
        text += f" Not checked (preflight skipped there): rank {', '.join(skipped)}."
    if own is not None:
        text += f" Rank {rank}'s own check: {own}"
    return text


def _rank_shortfall(row: RankPreflight) -> str:
    """A rank predicted not to fit: what its step still needs and what its device has, in bytes."""
    needed, available = row.needed_bytes, row.available_bytes
    if needed is None or available is None:
        return f"rank {row.rank}"
    text = f"rank {row.rank} needs {format_bytes(needed)} more, {format_bytes(available)} available"
    if needed > available:
        return f"{text} ({format_bytes(needed - available)} short)"
    return f"{text} (the simulated caching allocator cannot serve it in that)"


def _remedies_text(remedies: Sequence[PreflightRemedy]) -> str:
    """Preflight's replayed changes, each with its peak and, where simulated, the allocator's reserved peak."""
    return "; ".join(
        f"{remedy.label}: peak {format_bytes(remedy.peak_bytes)}"
        + ("" if remedy.reserved_peak_bytes is None else f", reserved {format_bytes(remedy.reserved_peak_bytes)}")
        + ("" if remedy.accumulation is None else f", as {remedy.accumulation}")
        for remedy in remedies
    )


def shape_text(shape: tuple[int, ...]) -> str:
    """A shape as the warnings write it (elements per dimension).

    >>> shape_text((3, 512, 384))
    '3x512x384'
    """
    return "x".join(f"{size:,}" for size in shape)


def shape_mismatch_warning(shape: tuple[int, ...], batch_shape: tuple[int, ...] | None) -> str:
    """The warning given when ``max_shape`` does not have a size for each dimension of the batch past its first.

    The warner's name goes before it.
    """
    seen = "it has no tensor with two or more dimensions"
    if batch_shape is not None:
        sizes = f"{len(batch_shape)} past the batch's ({shape_text(batch_shape)})"
        seen = f"its first tensor with two or more dimensions has {sizes}"
    return (
        f"max_shape={shape} has {len(shape)} sizes but the first batch does not match: {seen}. The first"
        " step is checked as it is; give a size for each dimension past the batch's."
    )


def worst_batch_warning(step: int, length: int | None, peak_bytes: int, total_bytes: int) -> str:
    """The warning given at the step whose batch, the largest so far, is replayed beyond the device's memory.

    The warner's name goes before it.
    """
    size = f" ({length:,} long)" if length is not None else ""
    return (
        f"step {step}'s batch{size} is the largest so far and its step replayed needs"
        f" {format_bytes(peak_bytes)}, more than the device's {format_bytes(total_bytes)}: a batch like it is"
        " predicted to run out of memory. Cap the length, bucket batches by length or lower the batch size."
    )
