"""The private torch names the replay needs, in one place: fake tensors, dispatch modes, pytree.

torch documents fake tensors (``torch._subclasses.fake_tensor``) but keeps them under a private module; these names
have been stable since torch 2.2, the oldest the project supports.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeCopyMode",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "UnsupportedFakeTensorException",
    "tree_leaves",
    "tree_map_only",
    "unset_fake_temporarily",
]
