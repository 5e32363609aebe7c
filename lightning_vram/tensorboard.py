"""TensorBoard output beyond scalars: advice as text. Used only when a TensorBoardLogger is present."""

from __future__ import annotations

from typing import Protocol

from lightning_vram.advice import Advice
from lightning_vram.report import advice_markdown

ADVICE_TAG = "vram/advice"


class TextWriter(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` this module uses."""

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None:
        """Write Markdown text under ``tag`` at ``global_step``."""
        ...


def write_advice(writer: TextWriter, advice: tuple[Advice, ...], step: int) -> None:
    """The run's advice so far, as Markdown text under ``vram/advice``."""
    writer.add_text(ADVICE_TAG, advice_markdown(advice), global_step=step)
