"""What a replay must leave as it found it: random number generators, default dtype, grad mode, output, warnings.

The replay runs the user's ``training_step`` on a fake copy, so the user's module, optimizer and gradients are never
touched; the process-wide state below is what such code could still change.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Restore the process-wide state on exit; silence the replayed code's prints and warnings meanwhile.

    Saved and restored: torch's CPU generator, every initialised CUDA generator, Python's ``random``, NumPy's
    global generator (when NumPy is imported), the default dtype and grad mode.
    """
    cpu_state = torch.get_rng_state()
    # torch ships is_initialized without annotations.
    cuda_initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_states = torch.cuda.get_rng_state_all() if cuda_initialized else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    default_dtype = torch.get_default_dtype()
    grad_enabled = torch.is_grad_enabled()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
