"""Starting a gloo test run's ranks by forking the script's process: each rank inherits its imports.

``torch.multiprocessing.spawn`` starts a new interpreter per rank, which imports torch, Lightning and DeepSpeed again
(about 4.5 CPU seconds a rank on this machine, more than half of a small run's CPU time). A forked rank starts with
them imported. The parent only parses its arguments and imports before forking: no tensor op has run in it, so no
thread pool of torch's (nor gloo, nor a process group) exists to be copied half-made into the ranks.

DeepSpeed's CPU backend builds a C++ op of its own when a rank starts its communication (``deepspeed_shm_comm``,
which only ``deepspeed.comm.inference_all_reduce`` uses: no ZeRO stage calls it, training's collectives are torch's
own on gloo). Built under ``~/.cache/torch_extensions`` for one venv's path, it compiles again for each new clone's
venv: 44 s of two compilers on the 2-core machine (about 80 CPU seconds) inside whichever test first starts DeepSpeed
ranks. The ranks here mark it unbuildable, as DeepSpeed marks it on a platform without its shared memory, and run
without it.

``deepspeed.initialize`` checks the optimizer against ZeRO's list after importing DeepSpeed's Muon optimizer, whose
import decorates its kernels with ``torch.compile`` and so imports torch's inductor: 1.5 of a ZeRO rank's 2.8 CPU
seconds of training, in every rank. The parent imports it before forking (no tensor op, no thread, no process).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

DEEPSPEED_OPTIMIZER_CHECK = "deepspeed.runtime.zero.muon.muon_optimizer"
"""What ``deepspeed.initialize`` imports in each rank to check the optimizer (see above)."""


def start_ranks(
    function: Callable[..., None], arguments: tuple[Any, ...], world_size: int, preload: Sequence[str] = ()
) -> None:
    """Run ``function(rank, *arguments)`` on ``world_size`` forked ranks and wait for all of them.

    ``preload``: modules the ranks import (``"deepspeed"``), imported here first so that each rank inherits them. A
    rank that fails raises here with its traceback, as ``torch.multiprocessing.spawn`` does.
    """
    for name in preload:
        importlib.import_module(name)
    if "deepspeed" in sys.modules:
        _without_deepspeed_shared_memory_op()
        importlib.import_module(DEEPSPEED_OPTIMIZER_CHECK)
    mp.start_processes(function, args=arguments, nprocs=world_size, start_method="fork")


def _without_deepspeed_shared_memory_op() -> None:
    """DeepSpeed's ranks start their communication without compiling ``deepspeed_shm_comm`` (see above)."""
    import deepspeed.ops  # type: ignore[import-untyped]

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def lightning_ranks(main: Callable[[], None], world_size: int, preload: Sequence[str] = ()) -> None:
    """Run a Lightning script's ``main`` on ``world_size`` forked ranks of one node, as a launcher would.

    Each rank finds ``LOCAL_RANK`` set, so Lightning's environment starts no process of its own (it launches the
    other ranks itself otherwise, by running the script again); the address and a free port are the parent's.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()), NODE_RANK="0")
    start_ranks(_as_rank, (main,), world_size, preload)


def _as_rank(rank: int, main: Callable[[], None]) -> None:
    """Rank ``rank``'s process: ``main`` with its local rank in the environment."""
    os.environ["LOCAL_RANK"] = str(rank)
    main()
