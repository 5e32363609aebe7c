"""Layer stacks inside layer stacks: a mixture-of-experts language model (a ``ModuleList`` of blocks, each with a
``ModuleList`` of experts chosen by top-k routing, and a load-balancing loss).

A new user's trial (session 15) was told "Checkpoint `blocks.0`, `blocks.0.moe.experts.0-3`, `blocks.1`, ... (15
units) to free about 9.9 MiB (modelled)": the plan over several stacks put the experts' stack beside the blocks' that
hold them, so each expert was checkpointed inside its checkpointed block (backward recomputing it twice) and its
activations counted twice in the modelled saving. Applied as printed, the peak fell by 8.0 MiB (42,891,200 to
34,455,440 bytes), under the saving the advice calls a bound from below. A unit inside another stack's unit is left
out of the plan: the blocks' plan alone frees as much (the same 34,455,440 bytes once applied).

The routing's ``torch.where`` has a data-dependent shape, so the step is never replayed: the saving is modelled.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from models import loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.records import CheckpointPlan

VOCAB, WIDTH, LENGTH = 1000, 32, 32


class Experts(nn.Module):
    """Top-2 routing over four MLP experts, each token's outputs added back with ``index_add``."""

    def __init__(self, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(experts)
        )
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        share = F.one_hot(chosen[:, 0], len(self.experts)).float().mean(0)
        balance = len(self.experts) * (share * probs.mean(0)).sum()
        return out.reshape(x.shape), balance


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.moe = Experts()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        mixed, balance = self.moe(self.norm2(x))
        return x + mixed, balance


class MixtureLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((LENGTH, LENGTH), float("-inf")), 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        x = self.embedding(ids[:, :-1])
        balance = x.new_zeros(())
        for block in self.blocks:
            x, extra = block(x, self.mask)
            balance = balance + extra
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.01 * balance

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(tmp_path: Path, module: pl.LightningModule) -> Report:
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (32, LENGTH + 1), generator=torch.Generator().manual_seed(1)))
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(data, 8))
    assert monitor.report is not None
    return monitor.report


def apply_printed(module: pl.LightningModule, code: str) -> None:
    """The advice's code as a user pastes it: its definitions, then its lines in the module's ``__init__``."""
    printed: dict[str, object] = {}
    definitions, _, lines = code.partition("\n# in ")
    exec(definitions, printed)
    exec("\n".join(lines.split("\n")[1:]), {**printed, "self": module})


def advised_plan(report: Report) -> tuple[CheckpointPlan, int] | None:
    advice = next((advice for advice in report.advice if advice.id == "activation-checkpointing"), None)
    if advice is None:
        return None
    assert advice.saving_basis == "modelled" and advice.estimated_saving_bytes is not None
    plans = [
        plan for plan in checkpoint_candidates(report.summary.modules) if checkpoint_snippet(plan)[1] in advice.detail
    ]
    assert len(plans) == 1, advice.detail
    return plans[0], advice.estimated_saving_bytes


def test_no_unit_is_checkpointed_inside_another_and_the_modelled_saving_is_realised(tmp_path: Path) -> None:
    before = run(tmp_path, MixtureLM())
    advised = advised_plan(before)
    assert advised is not None
    plan, saving = advised
    names = [unit[0] for unit in plan.units]
    nested = [name for name in names for outer in names if name.startswith(f"{outer}.")]
    assert not nested, names  # before: blocks.0.moe.experts.0-3 inside blocks.0, and so on (15 units)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    module = MixtureLM()
    apply_printed(module, checkpoint_snippet(plan)[1])  # the code the advice printed
    after = run(tmp_path, module)
    assert before.peak is not None and after.peak is not None
    # The modelled saving is a bound from below: the change realises at least it.
    assert before.peak.peak_bytes - after.peak.peak_bytes >= saving
    assert advised_plan(after) is None
