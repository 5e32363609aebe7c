"""The CPU's live count runs a dispatch mode through every op of a sampled step: training must not notice.

Every step from step 1 is counted live; the weights, buffers (BatchNorm's running statistics), losses, optimizer
state and random generators must be bit-identical to a run without the monitor, on a ResNet-style block with
BatchNorm and an inplace ReLU, a transformer encoder (dropout) and an LSTM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, assert_untouched
from models import OPTIMIZERS, Classifier, loader
from replay_models import encoder, images, lstm, resnet, sequences, tokens

CASES = {
    "resnet": lambda: Case(Classifier(resnet(), OPTIMIZERS["sgd_momentum"]), loader(images(48), 8)),
    "encoder": lambda: Case(Classifier(encoder(), OPTIMIZERS["adamw"]), loader(sequences(48), 8)),
    "lstm": lambda: Case(Classifier(lstm(), OPTIMIZERS["adam"]), loader(tokens(48), 8)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_counting_every_live_tensor_leaves_training_bit_identical(tmp_path: Path, name: str) -> None:
    monitor = assert_untouched(CASES[name], tmp_path, "cpu", steps=5, attribution_every_n_steps=1)
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert report.peak.breakdown.other is not None  # the live count ran: its peak is more than the counted parts
    assert report.peak.peak_bytes == report.peak.breakdown.counted_bytes + report.peak.breakdown.other
    assert not [note for note in report.not_measured if "live peak" in note.what]


class CountsOps(Classifier):
    """A training step run under the user's own dispatch mode, which counts the ops it sees."""

    def __init__(self) -> None:
        super().__init__(resnet(), OPTIMIZERS["sgd_momentum"])
        self.ops: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops

        class Counting(TorchDispatchMode):  # type: ignore[misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        with Counting():
            return super().training_step(batch, batch_idx)


def test_a_users_dispatch_mode_inside_the_step_sees_the_same_ops_and_the_count_stays_whole(tmp_path: Path) -> None:
    def case() -> Case:
        module = CountsOps()
        # The attribution's saved-tensor hooks keep a detached alias of each saved tensor: the user's mode sees those
        # detaches on sampled steps; every op that computes is the same.
        return Case(module, loader(images(48), 8), observe=lambda: [op for op in module.ops if "detach" not in op])

    monitor = assert_untouched(case, tmp_path, "cpu", steps=4, attribution_every_n_steps=1)
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert report.peak.breakdown.other is not None
