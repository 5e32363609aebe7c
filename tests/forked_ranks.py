"""Starting a gloo test run's ranks by forking the script's process: each rank inherits its imports.

``torch.multiprocessing.spawn`` starts a new interpreter per rank, which imports torch, Lightning and DeepSpeed again
(about 4.5 CPU seconds a rank on this machine, more than half of a small run's CPU time). A forked rank starts with
them imported. The parent only parses its arguments and imports before forking: no tensor op has run in it, so no
thread pool of torch's (nor gloo, nor a process group) exists to be copied half-made into the ranks.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port


def start_ranks(
    function: Callable[..., None], arguments: tuple[Any, ...], world_size: int, preload: Sequence[str] = ()
) -> None:
    """Run ``function(rank, *arguments)`` on ``world_size`` forked ranks and wait for all of them.

    ``preload``: modules the ranks import (``"deepspeed"``), imported here first so that each rank inherits them. A
    rank that fails raises here with its traceback, as ``torch.multiprocessing.spawn`` does.
    """
    for name in preload:
        importlib.import_module(name)
    mp.start_processes(function, args=arguments, nprocs=world_size, start_method="fork")


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
