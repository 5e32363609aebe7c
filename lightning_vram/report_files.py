"""Writes a report's files: ``vram_report.json``, ``vram_report.md`` and ``vram_report.html``."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_vram.html_report import render_html
from lightning_vram.report import HTML_FILENAME, JSON_FILENAME, MARKDOWN_FILENAME, Report, markdown


def write_report_files(report: Report, directory: Path) -> Path:
    """Write the JSON, Markdown and HTML forms into ``directory`` (created if needed); returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / JSON_FILENAME
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    (directory / MARKDOWN_FILENAME).write_text(markdown(report), encoding="utf-8")
    (directory / HTML_FILENAME).write_text(render_html(report), encoding="utf-8")
    return path
