"""Host seconds of ``plan()`` against model size and world size: a GPT-2 124M-class and a 1B-class model.

Both are built on the meta device (``torch.device("meta")``: no memory of the model's size is allocated, so a 1B
model plans on a laptop); ``plan()`` replays a module on the meta device there (its kernels' saved tensors, as the
CPU's; torch's autocast has no meta device, so the mixed precisions are left out: bf16-true by default). Each row is
one ``plan()`` over every common GPU, checkpointing off and on, at world sizes 1, 2, 4 and 8, with every strategy
modelled; printed: the seconds, the replays it ran, its rows (and those that fit) per world size, its best row. A
replay serves every world size of a strategy whose rank is the replay with arithmetic (DDP, ZeRO, FSDP1); FSDP2 is
replayed per world size, but not on the meta device (torch's ``fully_shard`` cannot run there: its rows are left
out, saying why). The table's budget (``--seconds``) is shared among the plans, counted after the imports: a plan
that reaches it lists what it left out. Seconds are printed, not asserted.

    python benchmarks/plan_cost.py              # the full table, within 60 s
    python benchmarks/plan_cost.py --small      # 2-layer versions (a few seconds)

The classes are LightningModules the command takes too::

    lightning-vram plan benchmarks/plan_cost.py:Gpt2 --init-kwargs '{"size": "124m"}' --batch "int64[8,1024]"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_vram.plan import plan
from lightning_vram.records.plan import PlanRow, short_gpu

SIZES: dict[str, dict[str, int]] = {
    "124m": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "1b": {"n_layer": 20, "n_embd": 2048, "n_head": 16},
    "small": {"n_layer": 2, "n_embd": 64, "n_head": 4},
}
"""GPT-2 configurations by name: GPT-2's own 124M; a 1.1B one (20 layers of 2048, its 50,257-token vocabulary)."""
SEQUENCE = 1024
"""Tokens a sample: GPT-2's context."""


class Gpt2(pl.LightningModule):
    """A GPT-2 of ``size`` (a key of :data:`SIZES`) trained with AdamW on its tokens; ``meta``: on the meta device."""

    def __init__(self, size: str = "124m", meta: bool = True) -> None:
        super().__init__()
        import transformers

        shape = SIZES[size]
        config = transformers.GPT2Config(
            n_layer=shape["n_layer"],
            n_embd=shape["n_embd"],
            n_head=shape["n_head"],
            vocab_size=50257,
            n_positions=SEQUENCE,
            bos_token_id=0,
            eos_token_id=0,
        )
        with torch.device("meta" if meta else "cpu"):
            self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


WORLD_SIZES = (1, 2, 4, 8)
"""The world sizes of each model's plan: a node's common counts."""


def _count(rows: Sequence[PlanRow], gpus: int) -> str:
    """The rows of ``gpus`` GPUs, and those that fit: ``"22 (20)"``."""
    mine = [row for row in rows if row.gpus == gpus]
    return f"{len(mine)} ({sum(row.fits for row in mine)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2-layer models (a few seconds)")
    parser.add_argument("--batch", type=int, default=8, help="sequences a rank (default 8)")
    parser.add_argument("--seconds", type=float, default=55.0, help="budget for the whole table (default 55)")
    parser.add_argument("--precision", action="append", help="default: bf16-true (autocast has no meta device)")
    arguments = parser.parse_args()
    models = ("small",) if arguments.small else ("124m", "1b")
    precisions = tuple(arguments.precision or ("bf16-true",))
    batch = torch.zeros(arguments.batch, SEQUENCE, dtype=torch.int64)
    deadline = time.perf_counter() + arguments.seconds
    print(f"{', '.join(precisions)}; checkpointing off and on; every common GPU; {arguments.batch} x {SEQUENCE} tokens")
    print(f"{'model':<6}{'params':>8}{'seconds':>9}{'replays':>8}  {'GPUs: rows (fit)':<44}best row")
    for index, size in enumerate(models):
        module = Gpt2(size)
        params = sum(parameter.numel() for parameter in module.parameters())
        budget = max((deadline - time.perf_counter()) / (len(models) - index), 1.0)
        started = time.perf_counter()
        result = plan(module, batch, world_sizes=WORLD_SIZES, precisions=precisions, budget_seconds=budget)
        seconds = time.perf_counter() - started
        best = result.best
        summary = (
            "none"
            if best is None
            else f"{best.gpus} x {short_gpu(best.gpu)} {best.strategy} {best.micro_batch}x{best.accumulation}"
            + (" ckpt" if best.checkpointing else "")
        )
        counts = " ".join(f"{n}: {_count(result.rows, n)}" for n in WORLD_SIZES)
        print(f"{size:<6}{params / 1e6:>7.0f}M{seconds:>9.1f}{result.replays:>8}  {counts:<44}{summary}")
        for item in result.left_out:
            print(f"{'':<6}left out: {item}")


if __name__ == "__main__":
    main()
