"""The chunked-loss advice's printed code, applied as a user pastes it to a ``transformers`` model trained on
``labels=``: the helper the code defines, the model's commented lines uncommented, and the check that they compute
the model's own loss and save what the advice said (tests/test_chunked_loss_masked_lm.py, _seq2seq.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import loader, trainer
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.records import Advice, AdviceId


class OwnOrPrinted(pl.LightningModule):
    """A model trained on its own loss (``labels=``), or (``usage``: the advice's lines) on the chunked loss.

    ``build``: makes the ``transformers`` model; a batch is its ids, attention mask and labels.
    """

    def __init__(
        self,
        build: Callable[[], torch.nn.Module],
        helper: Any = None,
        usage: str | None = None,
        features: bool = False,
    ) -> None:
        super().__init__()
        self.model = build()
        self.helper, self.usage, self.features = helper, usage, features

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask, labels = batch
        if self.usage is None:
            inputs = {"input_features": ids} if self.features else {"input_ids": ids, "attention_mask": mask}
            own: Tensor = self.model(**inputs, labels=labels).loss
            return own
        # a speech model's batch starts with its features (``features`` in the printed lines), a text model's ids
        namespace = {"model": self.model, "features" if self.features else "ids": ids, "mask": mask, "labels": labels}
        namespace["chunked_cross_entropy"] = self.helper
        exec(self.usage, namespace)  # the advice's own lines, as a user would paste them
        chunked: Tensor = namespace["loss"]
        return chunked

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _report(root: Path, module: OwnOrPrinted, data: TensorDataset, batch: int) -> Report:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(data, batch))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def printed(advice: Advice, header: str, first: str) -> tuple[Any, str]:
    """The advice's ``chunked_cross_entropy``, run as printed, and one model's commented lines, uncommented.

    The lines are those after the comment starting with ``header``, from the one starting with ``# {first}`` to the
    next ``# loss = ...``.
    """
    block = re.search(r"```python\n(.*?)```", advice.detail, re.S)
    assert block is not None, advice.detail
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)  # the advice's own code, as a user would paste it
    lines = block.group(1).splitlines()
    at = next((index for index, line in enumerate(lines) if line.startswith(header)), None)
    assert at is not None, block.group(1)  # before the fix: no such model's lines
    start = next(index for index in range(at, len(lines)) if lines[index].startswith(f"# {first}"))
    end = next(index for index in range(start, len(lines)) if lines[index].startswith("# loss ="))
    usage = [line.removeprefix("# ") for line in lines[start : end + 1]]
    return namespace["chunked_cross_entropy"], "\n".join(usage)


def check_printed_loss(
    root: Path,
    build: Callable[[], torch.nn.Module],
    data: TensorDataset,
    batch: int,
    header: str,
    first: str,
    features: bool = False,
) -> None:
    """Trained on its own loss the model is advised the chunked loss; its printed lines compute that loss (to float32
    rounding, on one batch in eval mode: no dropout) and, trained as printed, realise the saving the advice gave
    (within 10%), after which the advice is gone. ``features``: the model reads ``input_features`` (speech), the
    batch's first tensor, not ``input_ids``."""
    torch.manual_seed(0)
    before = _report(root / "before", OwnOrPrinted(build, features=features), data, batch)
    advice = next((item for item in before.advice if item.id is AdviceId.CHUNKED_LOSS), None)
    assert advice is not None, [item.id for item in before.advice]
    helper, usage = printed(advice, header, first)
    one = next(iter(loader(data, batch)))
    torch.manual_seed(0)
    own = OwnOrPrinted(build, features=features).eval().training_step(one, 0)
    torch.manual_seed(0)
    chunked = OwnOrPrinted(build, helper, usage, features).eval().training_step(one, 0)
    assert chunked.item() == pytest.approx(own.item(), rel=1e-5)
    torch.manual_seed(0)
    after = _report(root / "after", OwnOrPrinted(build, helper, usage, features), data, batch)
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    realised = before.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert AdviceId.CHUNKED_LOSS not in {item.id for item in after.advice}
