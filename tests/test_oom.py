"""Out-of-memory diagnosis: a real torch.cuda.OutOfMemoryError with torch's own message, raised inside training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models import FLOAT32, PARAMETER_COUNTS, Classifier, dataset_for, linear_net, loader, trainer

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.advice.oom import evaluation_batch_size, parse_oom_message
from lightning_vram.records import Phase
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

GIB = 1024**3
MIB = 1024**2
# torch 2.x's message, as users see it.
MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 16.00 GiB of which 512.00 MiB"
    " is free. Including non-PyTorch memory, this process has 15.48 GiB memory in use. Of the allocated memory"
    " 14.75 GiB is allocated by PyTorch, and 256.00 MiB is reserved by PyTorch but unallocated. If reserved but"
    " unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
    " fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html)"
)


def test_parse_messages_of_several_torch_versions() -> None:
    current = parse_oom_message(MESSAGE)
    assert (current.tried_bytes, current.capacity_bytes, current.free_bytes) == (3 * GIB // 2, 16 * GIB, 512 * MIB)
    assert current.process_bytes == round(15.48 * GIB)
    assert (current.allocated_bytes, current.reserved_unallocated_bytes) == (round(14.75 * GIB), 256 * MIB)
    other_process = parse_oom_message(
        "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 47.53 GiB of which"
        " 0 bytes is free. Process 3652628 has 47.51 GiB memory in use. Of the allocated memory 47.14 GiB is"
        " allocated by PyTorch, and 57.79 MiB is reserved by PyTorch but unallocated."
    )
    assert (other_process.free_bytes, other_process.process_bytes) == (0, None)
    old = parse_oom_message(
        "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already"
        " allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)"
    )
    assert (old.tried_bytes, old.capacity_bytes, old.allocated_bytes) == (36 * MIB, None, None)


def gpu_boundaries(ooms_from_read: int | None = None) -> list[ScriptedBoundary]:
    boundaries = []
    for read in range(40):
        ooms = 1 if ooms_from_read is not None and read >= ooms_from_read else 0
        boundaries.append(ScriptedBoundary(12 * GIB, 14 * GIB, 13 * GIB + read * MIB, ooms=ooms))
    return boundaries


def oom() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(MESSAGE)


class FailsAt(Classifier):
    """Raises a CUDA out-of-memory error at one batch, in one place: forward, backward or validation."""

    def __init__(self, where: str, batch: int = 3) -> None:
        super().__init__(linear_net())
        self.where = where
        self.batch = batch
        self.raised: BaseException | None = None

    def _raise(self) -> None:
        self.raised = oom()
        raise self.raised

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        if batch_idx == self.batch and self.where == "forward":
            self._raise()
        if batch_idx == self.batch and self.where == "backward":
            logits.register_hook(lambda gradient: self._raise())
        return torch.nn.functional.cross_entropy(logits, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        module = self

        class FailingSGD(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                loss = super().step(closure)
                if module.where == "optimizer" and module.trainer.global_step == module.batch:
                    module._raise()
                return loss

        return FailingSGD(self.parameters(), lr=0.01)


class FailsInValidation(FailsAt):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._raise()


def run_until_oom(tmp_path: Path, where: str, **options: Any) -> tuple[VramMonitor, FailsAt]:
    module = FailsInValidation(where) if where == "validation" else FailsAt(where)
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries()), attribution_start_step=2, console_summary=False)
    data = loader(dataset_for("linear"))
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        trainer(tmp_path, [monitor], max_steps=8, **options).fit(module, data, data if where == "validation" else None)
    assert caught.value is module.raised  # re-raised unchanged
    return monitor, module


@pytest.mark.replay  # the diagnosis's remedies and the run's advice, which the replays inform
@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_training_oom_is_diagnosed(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    monitor, _ = run_until_oom(tmp_path, where)
    written = json.loads((tmp_path / "vram_oom_report.json").read_text())
    diagnosis = monitor.oom_diagnosis
    assert diagnosis is not None and written == diagnosis.to_dict()
    assert (written["where"], written["step"], written["rank"]) == (where, 3, 0)
    assert (written["tried_bytes"], written["free_bytes"], written["needed_more_bytes"]) == (
        3 * GIB // 2,
        512 * MIB,
        GIB,
    )
    assert (written["capacity_bytes"], written["allocated_bytes"]) == (16 * GIB, round(14.75 * GIB))
    assert written["reserved_bytes"] == round(14.75 * GIB) + 256 * MIB
    breakdown = written["breakdown"]
    parameter_bytes = PARAMETER_COUNTS["linear"] * FLOAT32
    assert breakdown["parameters"] == parameter_bytes
    report = monitor.report
    assert report is not None
    sampled = report.phases[Phase(where)].breakdown  # counted on the sampled step 2
    assert sampled is not None and breakdown["activations"] == sampled.activations
    counted = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"] + breakdown["activations"]
    assert breakdown["other"] == round(14.75 * GIB) - counted
    assert written["headline"] == f"needed 1.00 GiB more in {where} of step 3; other held 14.75 GiB"
    assert [peak["step"] for peak in written["last_good_step"]] == [2, 2, 2]
    savings = [item["estimated_saving_bytes"] or 0 for item in written["advice"]]
    assert savings == sorted(savings, reverse=True)
    assert "near-capacity" in {item["id"] for item in written["advice"]}
    markdown = (tmp_path / "vram_oom_report.md").read_text()
    assert markdown.splitlines()[0] == f"# Out of memory: {written['headline']}"
    assert written["headline"] in capsys.readouterr().err
    # The run's report is written too, up to the failure.
    assert json.loads((tmp_path / "vram_report.json").read_text())["steps"] == 3


@pytest.mark.replay  # the diagnosis's remedies and the run's advice, which the replays inform
def test_validation_oom_gets_evaluation_advice_first(tmp_path: Path) -> None:
    monitor, _ = run_until_oom(
        tmp_path, "validation", val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0
    )
    diagnosis = monitor.oom_diagnosis
    assert diagnosis is not None
    assert (diagnosis.where, diagnosis.step) == ("validation", 4)
    assert diagnosis.advice[0].id == "evaluation-batch-size"
    assert "out of memory in validation after step 4" in diagnosis.advice[0].evidence


def test_oom_before_any_sampled_step_says_where_activations_went(tmp_path: Path) -> None:
    module = FailsAt("forward", batch=0)
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries()), console_summary=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer(tmp_path, [monitor], max_steps=4).fit(module, loader(dataset_for("linear")))
    assert monitor.oom_diagnosis is not None
    assert monitor.oom_diagnosis.breakdown is not None and monitor.oom_diagnosis.breakdown.activations == 0
    assert "activations are counted in 'other'" in monitor.oom_diagnosis.notes[0]
    assert monitor.oom_diagnosis.last_good_step == ()


@pytest.mark.replay  # the diagnosis's remedies and the run's advice, which the replays inform
def test_a_recovered_oom_is_counted_not_treated_as_the_end(tmp_path: Path) -> None:
    class RetriesHalfBatch(Classifier):
        """The user's own retry: step 1 runs out of memory once and is redone on half the batch."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            try:
                if batch_idx == 1:
                    raise oom()
                return super().training_step(batch, batch_idx)
            except torch.cuda.OutOfMemoryError:
                return super().training_step((inputs[:4], targets[:4]), batch_idx)

    # The allocator's OOM counter rises during step 1 (read 5 is its "before backward" boundary).
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries(ooms_from_read=5)), console_summary=False)
    trainer(tmp_path, [monitor], max_steps=4).fit(RetriesHalfBatch(linear_net()), loader(dataset_for("linear")))
    assert monitor.report is not None and monitor.report.steps == 4
    assert monitor.report.recovered_ooms == 1
    assert monitor.report.to_dict()["recovered_ooms"] == 1
    assert monitor.oom_diagnosis is None and not (tmp_path / "vram_oom_report.json").exists()
    near = next(item for item in monitor.report.advice if item.id == "near-capacity")
    assert "1 out-of-memory errors recovered from" in near.evidence


def test_record_history_without_cuda_warns_and_trains(tmp_path: Path) -> None:
    monitor = VramMonitor(record_history=True, console_summary=False)
    with pytest.warns(VramMonitorWarning, match="record_history is off: training does not run on CUDA"):
        trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(linear_net()), loader(dataset_for("linear")))
    assert monitor.report is not None and monitor.report.steps == 3
    assert any(item.what.startswith("allocator history") for item in monitor.report.not_measured)


def test_a_failing_diagnosis_never_replaces_the_users_error(tmp_path: Path) -> None:
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    module = FailsAt("forward")
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries()), console_summary=False)
    with pytest.warns(VramMonitorWarning) as warned, pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        trainer(blocked / "logs", [monitor], max_steps=8).fit(module, loader(dataset_for("linear")))
    assert caught.value is module.raised
    messages = [str(item.message) for item in warned]
    assert any(message.startswith("VramMonitor: out-of-memory diagnosis failed with") for message in messages)
    assert any(message.startswith("VramMonitor: report files failed with") for message in messages)
    assert monitor.report is not None
    assert {"out-of-memory diagnosis", "report files"} <= {item.what for item in monitor.report.not_measured}


def test_validation_oom_halves_the_validation_batch_that_ran_out(tmp_path: Path) -> None:
    # Training batches of 8, validation batches of 4 that run out. The printed `batch_size=train_batch_size // 2`
    # (4) left validation's batch as it was; where validation's is the smaller, it would have grown it.
    module = FailsInValidation("validation")
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries()), attribution_start_step=2, console_summary=False)
    data = dataset_for("linear")
    run = trainer(tmp_path, [monitor], max_steps=8, val_check_interval=4, limit_val_batches=1, num_sanity_val_steps=0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run.fit(module, loader(data), loader(data, batch_size=4))
    assert monitor.oom_diagnosis is not None
    advice = monitor.oom_diagnosis.advice[0]
    assert advice.id == "evaluation-batch-size" and "train_batch_size" not in advice.detail
    printed = "return DataLoader(val_set, ..., batch_size=2)  # half the validation batch of 4 that ran out"
    assert printed in advice.detail
    assert "the validation batch held 4 sample(s)" in advice.evidence
    # A validation batch of one has no half: what one sample holds is what to cut.
    alone = evaluation_batch_size(4, None, 1)
    assert "no smaller batch is left" in alone.detail and "```" not in alone.detail
