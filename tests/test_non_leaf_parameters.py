"""Stand-ins for parameters that are not leaves (FSDP's views of its flat parameter) are counted without a warning.

On an H100, Lightning's ``fsdp`` strategy on one GPU failed ``tests/test_gpu.py::test_lightning_fsdp_counts_this_ranks_
shards``: the sampled step read ``.grad`` of a non-leaf tensor, and torch warned ("The .grad attribute of a Tensor that
is not a leaf Tensor is being accessed"), out of the user's run (the suite turns warnings into errors). A non-leaf
tensor holds no parameter's gradient: the counts skip it.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_vram.measure.storages import gradient_of, gradient_storages


def test_a_non_leaf_stand_in_is_skipped_without_a_warning_and_the_gradients_still_count() -> None:
    module = nn.Linear(4, 2)
    module(torch.ones(3, 4)).sum().backward()  # type: ignore[no-untyped-call]
    flat = torch.zeros(10, requires_grad=True)
    stand_in = flat[:8].view(2, 4)  # as FSDP's unsharded view of a parameter: not a leaf
    assert not stand_in.is_leaf
    storages = gradient_storages(module, torch.device("cpu"), sharded=[stand_in])  # warnings are errors here
    assert sum(storages.values()) == (8 + 2) * 4  # the weight's and the bias's gradients, float32
    assert gradient_of(stand_in) is None and gradient_of(module.weight) is module.weight.grad
