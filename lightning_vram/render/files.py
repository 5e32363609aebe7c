"""Writes the report's files (``vram_report.json``, ``.md``, ``.html``) and the OOM diagnosis's files."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_vram.codec import oom_diagnosis_to_dict, report_to_dict
from lightning_vram.records import OomDiagnosis, Report
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, oom_headline, oom_markdown

JSON_FILENAME = "vram_report.json"
MARKDOWN_FILENAME = "vram_report.md"
HTML_FILENAME = "vram_report.html"
OOM_STEM = "vram_oom_report"
SNAPSHOT_STEM = "vram_oom_snapshot"


def report_stem(stem: str, rank: int, world_size: int) -> str:
    """File stem for this rank: plain for one process, ``.rankN`` under distributed training.

    >>> report_stem("vram_oom_report", 1, 4), report_stem("vram_oom_report", 0, 1)
    ('vram_oom_report.rank1', 'vram_oom_report')
    """
    return f"{stem}.rank{rank}" if world_size > 1 else stem


def write_report_files(report: Report, directory: Path) -> Path:
    """Write the JSON, Markdown and HTML forms into ``directory`` (created if needed); returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / JSON_FILENAME
    path.write_text(json.dumps(report_to_dict(report), indent=2) + "\n", encoding="utf-8")
    (directory / MARKDOWN_FILENAME).write_text(markdown(report), encoding="utf-8")
    (directory / HTML_FILENAME).write_text(render_html(report), encoding="utf-8")
    return path


def write_diagnosis(diagnosis: OomDiagnosis, directory: Path, world_size: int) -> Path:
    """Write ``vram_oom_report[.rankN].json`` and ``.md`` into ``directory``; returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = report_stem(OOM_STEM, diagnosis.rank, world_size)
    path = directory / f"{stem}.json"
    data = oom_diagnosis_to_dict(diagnosis, oom_headline(diagnosis))
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (directory / f"{stem}.md").write_text(oom_markdown(diagnosis), encoding="utf-8")
    return path
