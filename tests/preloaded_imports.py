"""What tests/preloaded_python.py's server imports once, before forking any run: torch, Lightning, DeepSpeed.

DeepSpeed picks its accelerator when first asked; every DeepSpeed script of the tests asks for the CPU's, as here.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning  # noqa: F401
import torch  # noqa: F401

with contextlib.suppress(ImportError):  # the ZeRO tests' extra: a run without it imports nothing more
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  # what each rank imports (forked_ranks.py)
