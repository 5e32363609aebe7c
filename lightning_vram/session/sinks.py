"""Where a run's results go: the report files, the publishers (one per logger), the console, and the OOM files.

Rank zero writes the report files and the console and publishes; every rank writes its own OOM diagnosis (with a
line on stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_vram._guard import Guard, Output, Part
from lightning_vram.measure import history
from lightning_vram.records import Advice, NotMeasured, OomDiagnosis, Report
from lightning_vram.records.oom import oom_headline
from lightning_vram.render.console import print_summary
from lightning_vram.render.figure_set import report_pngs
from lightning_vram.render.files import (
    HTML_FILENAME,
    JSON_FILENAME,
    MARKDOWN_FILENAME,
    SNAPSHOT_STEM,
    FilesNotWritten,
    Location,
    join,
    report_stem,
    write_diagnosis,
    write_report_files,
)
from lightning_vram.render.publishing import Publisher
from lightning_vram.render.scalars import MIB
from lightning_vram.render.tensorboard import ADVICE_TAG, report_images
from lightning_vram.render.text import DETAILS, advice_markdown

FIGURES = Output("figures")
"""The report's figures, drawn once for the HTML page and every publisher."""


def _takes_images(publisher: Publisher) -> bool:
    """Whether ``publisher`` keeps figures (overrides :meth:`Publisher.image`): for the others none is drawn."""
    return getattr(type(publisher), "image", None) is not Publisher.image


class Sinks:
    """The outputs of one run.

    Args:
        guard: the run's guard (files, console, and each publisher on its own).
        publishers: where scalars, figures, advice, the files, tags and the summary go (one per logger).
        console_summary: print the summary at the end.
    """

    def __init__(self, guard: Guard, publishers: Sequence[Publisher], console_summary: bool) -> None:
        self._guard, self._console = guard, console_summary
        self.publishers: tuple[tuple[Output, Publisher], ...] = ()
        self.attach(publishers)
        self._advice: tuple[str, int] | None = None  # an epoch's advice, Markdown, and its step: not yet written
        self.report_path: Location | None = None
        """Where ``vram_report.json`` was written; ``None`` when it was not."""

    def attach(self, publishers: Sequence[Publisher]) -> None:
        """Publish to ``publishers`` (none: let go of them), each guarded on its own."""
        self.publishers = tuple((Output(f"publishing to {each.name}"), each) for each in publishers)

    def _each(self, method: Callable[[Publisher], Callable[..., None]], *args: Any) -> None:
        for key, publisher in self.publishers:
            self._guard.call(key, method(publisher), *args)

    def scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """The interval's scalars (with their ``_mib`` twins) at ``step`` (after the advice of a past epoch's end)."""
        self._write_advice()
        self._each(lambda each: each.scalars, scalars, step)

    def advice(self, advice: tuple[Advice, ...], step: int) -> None:
        """``advice`` as Markdown text at ``step`` (an epoch's end), written once the run goes on past ``step``.

        The last epoch ends where the run does: its advice is then the report's, written once by :meth:`publish`.
        """
        self._write_advice()
        self._advice = (advice_markdown(advice), step)

    def _write_advice(self) -> None:
        if self._advice is not None:
            markdown, step = self._advice
            self._advice = None
            self._each(lambda each: each.text, ADVICE_TAG, markdown, step)

    def publish(
        self,
        report: Report,
        directory: Location | None,
        not_measured: Callable[[], tuple[NotMeasured, ...]],
        step: int,
    ) -> Report:
        """Show ``report`` to the publishers, write its files, print it; returns it with ``not_measured`` read again.

        ``directory`` is where the files go (``None``: none); each publisher gets the local files as artifacts. The
        files come after the publishers, so that they list every part that failed (or they are what failed); the
        console comes last, saying where the files are (a failure there warns, after the files were written).
        """
        guard = self._guard
        pngs: dict[str, bytes] | None = None  # each figure drawn once, when a publisher or the HTML page shows it
        if self.publishers:
            if any(_takes_images(each) for _, each in self.publishers):
                pngs = guard.call(FIGURES, report_pngs, report) or {}
                for name, pixels in (guard.call(FIGURES, report_images, pngs) or {}).items():
                    self._each(lambda each: each.image, name, pixels, step)
            if self._advice is not None and self._advice[1] == step:
                self._advice = None  # the last epoch's advice: the report's replaces it
            self._write_advice()
            self._each(
                lambda each: each.text,
                ADVICE_TAG,
                advice_markdown(report.advice, report.timing.step_time_iqr_fraction),
                step,
            )
            self._each(lambda each: each.tags, [item.id for item in report.advice])
            if report.peak is not None:
                peak = report.peak.peak_bytes
                self._each(lambda each: each.summary, {"vram/peak_mib": peak / MIB, "vram/peak_bytes": float(peak)})
        report = replace(report, not_measured=not_measured())
        if directory is not None:
            if pngs is None:
                pngs = guard.call(FIGURES, report_pngs, report) or {}  # figures that failed: a page without them
            written = guard.call(Part.FILES, self._write_files, report, directory, pngs) or ()
            local = [path for path in written if isinstance(path, Path)]
            if local:
                self._each(lambda each: each.artifacts, local)
        if self._console:
            where = str(self.report_path) if self.report_path is not None else None
            markdown_file = join(directory, MARKDOWN_FILENAME) if where is not None and directory is not None else None
            details = str(markdown_file) if markdown_file is not None else DETAILS  # the folder too, not only a name
            guard.call(Part.CONSOLE, print_summary, report, None, where, details)
        return replace(report, not_measured=not_measured())

    def _write_files(self, report: Report, directory: Location, pngs: Mapping[str, bytes]) -> tuple[Location, ...]:
        names = (JSON_FILENAME, MARKDOWN_FILENAME, HTML_FILENAME)
        try:
            self.report_path = write_report_files(report, directory, pngs)
        except FilesNotWritten as error:  # the others were written: say where, then let the guard report it
            self.report_path = error.json_path
            raise
        return tuple(join(directory, name) for name in names)

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
