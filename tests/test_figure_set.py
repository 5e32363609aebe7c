"""The report's figures at the end of a run: each drawn once, shared by the HTML page and every publisher."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure

from lightning_vram._guard import Guard
from lightning_vram.codec import report_from_dict
from lightning_vram.records import Report
from lightning_vram.render import figure_set
from lightning_vram.render.files import as_location
from lightning_vram.render.publishing import Publisher
from lightning_vram.session.sinks import Sinks

REPORT = Path(__file__).parent / "data" / "reports" / "0.10.0" / "cuda.json"


class Images(Publisher):
    """Keeps every figure it is shown."""

    name = "images"

    def __init__(self) -> None:
        self.images: dict[str, np.ndarray] = {}

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        self.images[name] = pixels


class Scalars(Publisher):
    """A destination that holds no figures (as the CSV logger)."""

    name = "scalars"


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Every figure saved to PNG, in order."""
    figures: list[Figure] = []
    real = figure_set.png_bytes

    def counting(figure: Figure) -> bytes:
        figures.append(figure)
        return real(figure)

    monkeypatch.setattr(figure_set, "png_bytes", counting)
    return figures


def report() -> Report:
    return report_from_dict(json.loads(REPORT.read_text()))


def published(directory: Path | None, publishers: list[Publisher]) -> None:
    Sinks(Guard(), publishers, console_summary=False).publish(
        report(), None if directory is None else as_location(directory), lambda: (), 7
    )


@pytest.mark.figures
def test_each_figure_is_drawn_once_for_the_page_and_every_publisher(tmp_path: Path, drawn: list[Figure]) -> None:
    first, second = Images(), Images()
    published(tmp_path, [first, Scalars(), second])
    expected = figure_set.report_pngs(report())
    assert len(drawn) == 2 * len(expected)  # once in publish, once for `expected` here
    assert len(expected) == 3  # breakdown, memory over steps, top modules (this report replayed no timeline)
    assert set(first.images) == set(expected)
    page = (tmp_path / "vram_report.html").read_text()
    embedded = [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    assert len(embedded) == len(expected)
    for tag, png in expected.items():
        assert png in embedded  # the page's PNG is the publishers' figure, byte for byte
        pixels = figure_set.png_pixels(png)
        assert np.array_equal(first.images[tag], pixels) and np.array_equal(second.images[tag], pixels)
        assert pixels.dtype == np.uint8 and pixels.shape[2] == 3


def test_nothing_is_drawn_where_nobody_shows_a_figure(drawn: list[Figure]) -> None:
    published(None, [Scalars()])  # no files, no publisher that keeps images
    assert drawn == []
