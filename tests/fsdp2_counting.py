"""Two processes shard a GPT-2-class model with FSDP2 (``fully_shard``) on the CPU (gloo); each counts one step.

Run by tests/test_distributed.py: ``python tests/fsdp2_counting.py PORT OUT_DIR``. On each rank, step 1 is counted
by the monitor's ``StepAttributor``, step 2 (the same shapes) by torch's own ``FSDPMemTracker``, and an unsharded
copy of the model (what each DDP rank holds) is counted on the same per-rank batch. Each rank writes
``rankN.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.records import Attribution

CPU = torch.device("cpu")
BATCH, LENGTH, VOCAB = 4, 32, 1000


def language_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0)
    return GPT2LMHeadModel(config)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, attributor: Any = None) -> None:
    if attributor is not None:
        attributor.begin_forward(tokens)
    loss = model(input_ids=tokens, labels=tokens).loss
    if attributor is not None:
        attributor.before_backward()
    loss.backward()
    if attributor is not None:
        attributor.before_optimizer_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def counted(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> Attribution:
    step(model, optimizer, tokens)
    attributor = StepAttributor(1, model, [optimizer], CPU)
    step(model, optimizer, tokens, attributor)
    return attributor.finish()


def as_record(attribution: Attribution) -> dict[str, Any]:
    return {
        "phases": {phase.value: breakdown.to_dict() for phase, breakdown in attribution.phases.items()},
        "modules": {profile.name: profile.activation_bytes for profile in attribution.modules},
    }


def run(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = language_model()
    plain = copy.deepcopy(model)  # what each DDP rank holds: the whole model
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(rank))
    mesh = init_device_mesh("cpu", (2,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    sharded = counted(model, optimizer, tokens)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((tokens,))
    with tracker:
        step(model, optimizer, tokens)
    peak = {str(category): nbytes for category, nbytes in tracker.get_tracker_snapshot("peak")[CPU].items()}
    plain_optimizer = torch.optim.AdamW(plain.parameters(), foreach=False)
    unsharded = counted(plain, plain_optimizer, tokens)
    record = {
        "full_parameter_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
        "fsdp2": as_record(sharded),
        "ddp": as_record(unsharded),
        "tracker_peak": peak,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run, (int(sys.argv[1]), Path(sys.argv[2])), 2)
