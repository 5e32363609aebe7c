"""``lightning-vram plan``: its exit status (0: a configuration fits, 1: none does, 3: none could be predicted, 2: bad
input in one line naming the argument), its table and its JSON, on the README's quickstart."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from preloaded_python import run_script

from lightning_vram.cli import main

# The command replays the step under fake tensors.
pytestmark = pytest.mark.replay

ROOT = Path(__file__).parents[1]
QUICKSTART = f"{ROOT / 'examples' / 'quickstart.py'}:SmallCNN"
BATCH = "float32[16,3,32,32] int64[16]"
ONE_CONFIGURATION = ["--gpus", "1", "--precision", "32-true", "--checkpointing", "off"]


def test_a_configuration_that_fits_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", QUICKSTART, "--batch", BATCH, "--gpu", "T4", "--gpu", "H100", *ONE_CONFIGURATION])
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "Plan: 2 of 2 configurations fit; best: 1 x H100 SXM, single, 32-true"
    assert lines[1] == "  batch: given; each rank trains on the batch's own size per optimizer step"
    assert [line.split()[0] for line in lines[3:5]] == ["H100", "T4"]
    assert all(line.split()[-4] == "yes" for line in lines[3:5])  # fits, then the step in ms and samples/s


def test_json_has_every_row_and_none_fitting_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["plan", QUICKSTART, "--batch", BATCH, "--gpu", str(2**20), *ONE_CONFIGURATION, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert status == 1
    assert data["fits"] is False and len(data["rows"]) == 1
    row = data["rows"][0]
    assert (row["gpu"], row["gpu_bytes"], row["fits"], row["micro_batch"], row["accumulation"]) == (
        "1.0 MiB",
        2**20,
        False,
        1,
        16,
    )
    assert row["step_seconds"] is None  # a card given by its memory alone has no peak rates


READS_ITS_LOSS = """
import sys
sys.path.insert(0, {examples!r})
from quickstart import SmallCNN


class ReadsItsLoss(SmallCNN):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()  # a value read in the step: fake tensors have none
        return loss
"""


def test_a_step_that_cannot_be_replayed_exits_3_saying_why_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing was weighed: not "none fits" (1), which a script would read as "rent a larger GPU".
    module = tmp_path / "reads_its_loss.py"
    module.write_text(READS_ITS_LOSS.format(examples=str(ROOT / "examples")))
    status = main(["plan", f"{module}:ReadsItsLoss", "--batch", BATCH, "--gpu", "H100", *ONE_CONFIGURATION])
    first = capsys.readouterr().out.splitlines()[0]
    assert status == 3
    assert first.startswith("Plan: no configuration predicted: ") and "reads a tensor's value (.item()" in first
    assert "self.log takes tensors" in first  # what to change for the step to be replayed


def test_the_first_line_gives_the_reason_that_left_out_the_most_configurations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A new user's plan of a step reading .item() on every common card: the first line blamed the T4's bf16 (one
    # configuration left out for it, noted first), the value read (every other one) a note below.
    module = tmp_path / "reads_its_loss.py"
    module.write_text(READS_ITS_LOSS.format(examples=str(ROOT / "examples")))
    cards = ["--gpu", "T4", "--gpu", "H100", "--gpus", "1", "--checkpointing", "off"]
    status = main(["plan", f"{module}:ReadsItsLoss", "--batch", BATCH, *cards])
    lines = capsys.readouterr().out.splitlines()
    assert status == 3
    assert lines[0].startswith("Plan: no configuration predicted: the step reads a tensor's value (.item()"), lines[0]
    assert lines[0].endswith("2 configurations (single, 32-true, micro-batch 16, ...)"), lines[0]
    assert "  - left out: T4 has no bf16 tensor cores (bf16 runs at its fp32 rate; plan it in 16-mixed):" in lines


def test_the_first_line_gives_the_step_that_cannot_be_replayed_before_a_card_without_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A new user's plan on one T4: one configuration left out for the T4's bf16, one for the value read; the tie kept
    # the bf16 first and the headline blamed the card. Nothing could be replayed: the value read is why.
    module = tmp_path / "reads_its_loss.py"
    module.write_text(READS_ITS_LOSS.format(examples=str(ROOT / "examples")))
    cards = ["--gpu", "T4", "--gpus", "1", "--checkpointing", "off"]
    status = main(["plan", f"{module}:ReadsItsLoss", "--batch", BATCH, *cards])
    lines = capsys.readouterr().out.splitlines()
    assert status == 3
    assert lines[0].startswith("Plan: no configuration predicted: the step reads a tensor's value (.item()"), lines[0]
    assert lines[0].endswith(": single, 32-true, micro-batch 16"), lines[0]
    assert "  - left out: T4 has no bf16 tensor cores (bf16 runs at its fp32 rate; plan it in 16-mixed):" in lines


def test_the_exit_status_reaches_the_shell() -> None:
    """``lightning-vram plan ... && sbatch train.sh``: the process exits 1 where nothing fits.

    ``python -m lightning_vram.cli`` in a process forked from tests/preloaded_python.py's server (torch imported
    already: 5 CPU seconds less than a new interpreter), through tests/cli_module.py.
    """
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    arguments = ["plan", QUICKSTART, "--batch", BATCH, "--gpu", "1048576", *ONE_CONFIGURATION]
    result = run_script(ROOT / "tests" / "cli_module.py", *arguments, env=environment, timeout=900)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("Plan: none of 1 configurations fits")


@pytest.mark.parametrize(
    ("arguments", "starts"),
    [
        ([QUICKSTART, "--batch", BATCH, "--gpu", "Z80"], "lightning-vram: error: --gpu must name one of: RTX 3060,"),
        ([QUICKSTART, "--batch", BATCH, "--gpu", "A100"], "lightning-vram: error: --gpu must name one of:"),
        ([QUICKSTART, "--batch", "float32[16,3"], "lightning-vram: error: --batch must be dtype[sizes] items"),
        ([QUICKSTART, "--batch", "complex[4]"], "lightning-vram: error: --batch must name a dtype of float32,"),
        ([QUICKSTART, "--batch", "x=float32[4] int64[4]"], "lightning-vram: error: --batch must name every tensor"),
        ([QUICKSTART], "lightning-vram: error: --batch must be given"),
        (["no_such_package.models:Net"], "lightning-vram: error: MODULE 'no_such_package.models:Net' cannot be"),
        (["examples.quickstart"], "lightning-vram: error: MODULE must be package.module:ClassName"),
        ([f"{ROOT / 'examples' / 'quickstart.py'}:Missing"], "lightning-vram: error: MODULE '"),
        ([QUICKSTART, "--init-kwargs", "[1]"], "lightning-vram: error: --init-kwargs must be a JSON object"),
        ([QUICKSTART, "--init-kwargs", '{"depth": 3}'], "lightning-vram: error: MODULE SmallCNN(**{'depth': 3})"),
        ([QUICKSTART, "--batch", BATCH, "--gpus", "0"], "lightning-vram: error: --gpus must hold ints from 1"),
        ([QUICKSTART, "--batch", BATCH, "--strategy", "x"], "lightning-vram: error: --strategy must be one of ddp,"),
        ([QUICKSTART, "--batch", BATCH, "--precision", "8"], "lightning-vram: error: --precision must be one of 32"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_argument(
    capsys: pytest.CaptureFixture[str], arguments: list[str], starts: str
) -> None:
    status = main(["plan", *arguments])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(starts), captured.err


UNPACKS_ONE = """
import torch
import lightning.pytorch as pl
from torch import nn


class UnpacksOne(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        (ids,) = batch  # a batch of one tensor in a tuple: a DataLoader over TensorDataset(ids)
        return nn.functional.cross_entropy(self.head(self.embed(ids[:, :-1])).flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_trailing_comma_describes_a_tuple_of_one_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trial's step unpacked ``(ids,) = batch``: no description gave it a tuple of one, and its plan exited 3."""
    module = tmp_path / "unpacks_one.py"
    module.write_text(UNPACKS_ONE)
    bare = main(["plan", f"{module}:UnpacksOne", "--batch", "int64[4,16]", "--gpu", "H100", *ONE_CONFIGURATION])
    assert bare == 3 and "ValueError" in capsys.readouterr().out
    command = ["plan", f"{module}:UnpacksOne", "--batch", "int64[4,16],", "--gpu", "H100", *ONE_CONFIGURATION, "--json"]
    status = main(command)
    data = json.loads(capsys.readouterr().out)
    assert status == 0 and data["fits"] is True and len(data["rows"]) == 1
    row = data["rows"][0]
    assert (row["micro_batch"], row["method"]) == (4, "replayed: the single-process step, as it is")
    parameters = 4 * (64 * 16 + 16 * 64 + 64)  # the embedding's and the head's float32 parameters, in bytes
    assert row["peak_bytes"] > 2 * parameters  # the step replayed: parameters and their gradients held at least


IMPORTS_ITS_NEIGHBOURS = """
import torch
import lightning.pytorch as pl
from torch import nn
from plan_cli_neighbour_layers import layers  # a neighbour file, as python imports it for python path/to/file.py


class ImportsItsNeighbours(pl.LightningModule):
    def __init__(self):
        super().__init__()
        from plan_cli_neighbour_loss import loss  # imported when built, after the file was

        self.net, self.loss = layers(), loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_file_imports_its_neighbours_while_the_command_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trial's gpt2.py imported its neighbour common.py: ``No module named 'common'``, exit 2, unless PYTHONPATH."""
    folder = tmp_path / "trial"
    folder.mkdir()
    layers = "nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))"
    (folder / "plan_cli_neighbour_layers.py").write_text(
        f"from torch import nn\n\n\ndef layers():\n    return {layers}\n"
    )
    (folder / "plan_cli_neighbour_loss.py").write_text("from torch import nn\n\nloss = nn.functional.mse_loss\n")
    (folder / "imports_its_neighbours.py").write_text(IMPORTS_ITS_NEIGHBOURS)
    path_before = list(sys.path)
    target = f"{folder / 'imports_its_neighbours.py'}:ImportsItsNeighbours"
    try:
        status = main(["plan", target, "--batch", "float32[8,16] float32[8,1]", "--gpu", "H100", *ONE_CONFIGURATION])
        captured = capsys.readouterr()
        assert status == 0, captured.out + captured.err
        assert captured.out.startswith("Plan: 1 of 1 configurations fit; best: 1 x H100 SXM, single, 32-true")
        assert sys.path == path_before  # the directory is taken out when the command returns
    finally:
        for name in ("plan_cli_neighbour_layers", "plan_cli_neighbour_loss"):
            sys.modules.pop(name, None)
