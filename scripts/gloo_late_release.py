"""Show a finished gloo collective's tensor freed by gloo's worker thread, late, once that thread gets the GIL.

``python scripts/gloo_late_release.py``: two CPU processes (gloo). Rank 0 starts an all-reduce of a 4 MB tensor and
lets go of the tensor and the work at once; rank 1 joins 0.1 s later. Gloo's worker thread holds the finished work,
and through it the tensor, until it drops the work; the tensor's Python object outlived its Python references (torch
keeps it for the C++ tensor), so dropping it needs the GIL. Rank 0 runs Python for 0.3 s meanwhile (holding the GIL,
the interpreter's forced switches put off), then sleeps. The script prints, for rank 0, whether the tensor's storage was
still alive in C++ when the collective had finished (its memory allocated), when its Python object was freed (ms
after the all-reduce started) and on which thread. On this project's machine: still alive after the collective
finished, freed on gloo's thread (``Dummy-1``) only when rank 0 released the GIL (its sleep, at 300 ms).

This is what makes a rank's measured live peak on the CPU vary from run to run under gloo (docs/measurement.md).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.multiprocessing.spawn import spawn


def run(rank: int, port: int) -> None:
    """Rank ``rank`` of 2: rank 0 drops its tensor before the all-reduce finishes and keeps the GIL busy."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(1_000_000)
    if rank == 1:
        time.sleep(0.1)
        dist.all_reduce(tensor)
    else:
        sys.setswitchinterval(10.0)  # no forced switch in the demo (the default is every 5 ms)
        storage = tensor.untyped_storage()
        start = time.perf_counter()
        freed: list[tuple[str, float]] = []

        def note(_reference: object) -> None:
            freed.append((threading.current_thread().name, 1000 * (time.perf_counter() - start)))

        reference = weakref.ref(storage, note)  # noqa: F841 -- kept alive to the end: its callback reports the free
        held = StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch ships it unannotated
        del storage
        dist.all_reduce(tensor, async_op=True)  # the work dropped at once: gloo's worker holds the last reference
        del tensor
        alive_after = None
        while time.perf_counter() - start < 0.3:  # Python running: the GIL held
            if alive_after is None and time.perf_counter() - start > 0.25:  # the collective finished (rank 1 at 0.1 s)
                alive_after = not held.expired()  # type: ignore[no-untyped-call]
        time.sleep(0.05)
        print(f"storage alive in C++ at 0.25 s, the collective finished: {alive_after}; freed (thread, ms): {freed}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn(run, args=(29_431,), nprocs=2)  # type: ignore[no-untyped-call]
