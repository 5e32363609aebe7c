"""What tests/preloaded_python.py's server imports once, before forking any run: torch, Lightning, DeepSpeed, and
transformers' GPT-2 (the GPT-2-class ranks of tests/rank_prediction_train.py and tests/fsdp2_counting.py each
imported it, about 0.15 s a rank).

DeepSpeed picks its accelerator when first asked; every DeepSpeed script of the tests asks for the CPU's, as here.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning  # noqa: F401
import torch  # noqa: F401

with contextlib.suppress(ImportError):  # the ZeRO tests' extra: a run without it imports nothing more
    import deepspeed
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  # what each rank imports (forked_ranks.py)

import transformers.models.gpt2.modeling_gpt2  # noqa: F401
