"""Whether saved-tensor hooks are active: the user's pair around ``fit``, a callback's, ``save_on_cpu``.

torch runs only the innermost pair of ``saved_tensors_hooks``: a sampled step's counting hooks would replace the
user's (their compression, their offloading to the CPU) for that step. Where a pair is active when a step begins,
the monitor stands aside for it. ``torch._C._autograd._top_saved_tensors_default_hooks`` is private; where a torch
lacks it, no pair is known (and the walk of the code still finds ``saved_tensors_hooks`` and ``save_on_cpu``).
"""

from __future__ import annotations

import torch


def saved_tensor_hooks_active() -> bool:
    """Whether a pair of saved-tensor hooks is active on this thread now.

    >>> with torch.autograd.graph.save_on_cpu():
    ...     saved_tensor_hooks_active()
    True
    >>> saved_tensor_hooks_active()
    False
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None
