"""A plain loop on 2 gloo CPU ranks whose :class:`~lightning_vram.VramSession` is started without ``rank`` or
``world_size``: run by tests/test_session_rank.py, ``python tests/session_rank_train.py PORT OUT_DIR``.

Each rank trains a ``Linear`` 2 steps under DDP, step 1 sampled, and writes ``rank<r>.json``: the rank and world size
its session took, and the ranks its report's headline names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from torch import nn

from lightning_vram import VramSession

WORLD = 2


def run_rank(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = VramSession(attribution_start_step=1, console_summary=False, replay_budget_seconds=0.0, preflight=False)
    session.start(model, [optimizer], device=torch.device("cpu"))
    for index in range(2):
        session.batch_start(None)
        loss = model(torch.randn(8, 16)).square().mean()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end(index)
    report = session.finish(gather_ranks=False)
    assert report is not None
    context = session._context
    record = {"rank": context.rank, "world_size": context.world_size, "ranks": [r.rank for r in report.ranks]}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run_rank, (int(sys.argv[1]), Path(sys.argv[2])), WORLD)
