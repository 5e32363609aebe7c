"""A gloo collective's tensor released late into a live count's optimizer peak, on two CPU ranks.

Run by tests/test_released_late.py: ``python tests/gloo_released_late.py PORT OUT_DIR``. As
scripts/gloo_late_release.py shows the mechanism: rank 0 counts a step with
:class:`~lightning_vram.measure.live.LiveTensors`, starts an all-reduce of a 4 MB tensor made in the step and lets go
of the tensor and the work at once; rank 1 joins 0.1 s later. Gloo's worker thread holds the finished work, and
through it the tensor, until it gets the GIL; rank 0 keeps the GIL (Python running, no forced switch) past the
collective's end while its optimizer segment makes a 40 KB tensor, closes the segment, stops the count, then sleeps:
the worker frees the tensor then, on its own thread. Rank 0 writes ``late.json``: the phase's live peak, the bytes
released late of it, the storage's size and the thread that freed it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from forked_ranks import start_ranks

from lightning_vram.measure.live import LiveTensors
from lightning_vram.records import Phase


def run(rank: int, port: int, out: Path) -> None:
    """Rank ``rank`` of 2; rank 0 counts."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        tensor = torch.ones(1_000_000)
        time.sleep(0.1)
        dist.all_reduce(tensor)
    else:
        sys.setswitchinterval(10.0)  # no forced switch (the default is every 5 ms): gloo's thread waits for the GIL
        live = LiveTensors(torch.device("cpu"))
        live.start()
        tensor = torch.ones(1_000_000)  # made in the step: counted
        freed_on: list[str] = []
        reference = weakref.ref(tensor.untyped_storage(), lambda _: freed_on.append(threading.current_thread().name))
        start = time.perf_counter()
        dist.all_reduce(tensor, async_op=True)  # the work dropped at once: gloo's worker holds the last reference
        del tensor
        update = torch.zeros(10_000)  # the optimizer segment's own tensor
        while time.perf_counter() - start < 0.3:  # Python running, the GIL held, past the collective's end (0.1 s)
            pass
        live.close_segment(Phase.OPTIMIZER)
        live.stop()
        del update
        time.sleep(0.1)  # the GIL released: gloo's thread frees the tensor
        record = {
            "peak": live.phase_peaks[Phase.OPTIMIZER],
            "released_late": {phase.value: nbytes for phase, nbytes in live.released_late().items()},
            "freed_on": freed_on,
            "main_thread": threading.current_thread().name,
        }
        live.forget()
        del reference
        (out / "late.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run, (int(sys.argv[1]), Path(sys.argv[2])), 2)
