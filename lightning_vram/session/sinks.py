"""Where a run's results go: the report files, TensorBoard, the console, and the OOM files with a line on stderr.

Rank zero writes the report files, TensorBoard and the console; every rank writes its own OOM diagnosis.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from lightning_vram._guard import Guard, Part
from lightning_vram.measure import history
from lightning_vram.records import Advice, NotMeasured, OomDiagnosis, Report
from lightning_vram.records.oom import oom_headline
from lightning_vram.render.console import print_summary
from lightning_vram.render.files import (
    SNAPSHOT_STEM,
    FilesNotWritten,
    Location,
    report_stem,
    write_diagnosis,
    write_report_files,
)
from lightning_vram.render.tensorboard import TensorBoardWriter, write_advice, write_figures, write_layout


class Sinks:
    """The outputs of one run.

    Args:
        guard: the run's guard (files, TensorBoard, console).
        writers: TensorBoard SummaryWriters for the layout, the advice text and the figures.
        console_summary: print the summary at the end.
    """

    def __init__(self, guard: Guard, writers: Sequence[TensorBoardWriter], console_summary: bool) -> None:
        self._guard, self.writers, self._console = guard, writers, console_summary
        self.report_path: Location | None = None
        """Where ``vram_report.json`` was written; ``None`` when it was not."""

    def layout(self) -> None:
        """Give every TensorBoard writer the custom-scalars layout of the ``vram/...`` scalars."""
        for writer in self.writers:
            self._guard.call(Part.TENSORBOARD, write_layout, writer)

    def advice(self, advice: tuple[Advice, ...], step: int) -> None:
        """Write ``advice`` as TensorBoard text at ``step``."""
        for writer in self.writers:
            write_advice(writer, advice, step)

    def publish(
        self, report: Report, directory: Location | None, not_measured: Callable[[], tuple[NotMeasured, ...]]
    ) -> Report:
        """Show ``report`` (TensorBoard, console), write its files; returns it with ``not_measured`` read again.

        ``directory`` is where the files go (``None``: none).
        The files come last, so that they list every part that failed (or they are what failed).
        """
        guard = self._guard
        for writer in self.writers:
            guard.call(Part.TENSORBOARD, _write_tensorboard, writer, report)
        if self._console:
            guard.call(Part.CONSOLE, print_summary, report)
        report = replace(report, not_measured=not_measured())
        if directory is not None:
            guard.call(Part.FILES, self._write_files, report, directory)
        return replace(report, not_measured=not_measured())

    def _write_files(self, report: Report, directory: Location) -> None:
        try:
            self.report_path = write_report_files(report, directory)
        except FilesNotWritten as error:  # the others were written: say where, then let the guard report it
            self.report_path = error.json_path
            raise

    def snapshot(self, directory: Location | None, rank: int, world_size: int) -> tuple[Path | None, tuple[str, ...]]:
        """Save the allocator history (being recorded) into ``directory``: its path, or a note why it was not."""
        if isinstance(directory, Path):
            directory.mkdir(parents=True, exist_ok=True)
            return history.dump_snapshot(directory / (report_stem(SNAPSHOT_STEM, rank, world_size) + ".pickle")), ()
        if directory is not None:
            return None, (f"allocator history not saved: torch writes it to local files, and {directory} is remote",)
        return None, ()

    def diagnosis(self, diagnosis: OomDiagnosis, directory: Location | None, rank: int, world_size: int) -> None:
        """Write the rank's OOM diagnosis files into ``directory`` and say where on stderr (``None``: nothing)."""
        if directory is not None:
            path = write_diagnosis(diagnosis, directory, world_size)
            print(f"VramMonitor (rank {rank}): {oom_headline(diagnosis)}; see {path}", file=sys.stderr)


def _write_tensorboard(writer: TensorBoardWriter, report: Report) -> None:
    write_advice(writer, report.advice, report.steps)
    write_figures(writer, report, report.steps)
