"""Preflight on two DDP ranks on the CPU (gloo), each on a scripted CUDA device, run by test_preflight_ranks.py:
``python tests/preflight_ranks_train.py OUT_DIR FREE_BYTES [rank1-skips | no-monitor]``.

The model and data of tests/ddp_replay_train.py (rank 1 doubles its batch inside the step), 2 steps. Each rank's
monitor reads a :class:`~lightning_vram.testing.ScriptedProbe` whose device has ``FREE_BYTES`` free, so rank 0's
first step may fit where rank 1's larger one does not. Rank ``r`` writes ``preflight<r>.json``: the rows the ranks
agreed on, its own verdict and the monitor's warnings; and ``training<r>.json`` (what training did, to compare with
``no-monitor``). With ``rank1-skips`` rank 1 reads its loss's value in its step (a replay cannot), so its preflight
is skipped while rank 0's runs: both must still agree, and neither wait for ever.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp, features
from ddp_replay_train import BATCH, WIDTH, RankOneDiffers, Training
from forked_ranks import lightning_ranks
from models import loader
from preflight_records import preflight_record

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

WORLD_SIZE = 2


def main() -> None:
    out, free_bytes, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    monitored = mode != ["no-monitor"]
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=free_bytes)
    monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy="ddp",
        max_steps=2,
        logger=False,
        default_root_dir=out,
        callbacks=[monitor, Training(out)] if monitored else [Training(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = RankOneDiffers(activation_mlp(nn.LeakyReLU, width=WIDTH))
    module.skips_on = 1 if mode == ["rank1-skips"] else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        trainer.fit(module, loader(features(2 * BATCH * WORLD_SIZE, WIDTH), BATCH))
    if not monitored:
        return
    session = monitor.session
    record = preflight_record(session, caught)
    (out / f"preflight{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    lightning_ranks(main, WORLD_SIZE)
