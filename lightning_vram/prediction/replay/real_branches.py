"""Libraries that take a tracing branch when they see a fake tensor, told otherwise where the replay knows the value.

transformers (``transformers.utils.import_utils.is_tracing``) treats a ``FakeTensor`` as a sign of tracing: its
masking code then materialises the full attention mask (where the real step passes none and lets
``scaled_dot_product_attention`` be causal), and grouped-query attention repeats the key/value heads. For a fake tensor
whose real value :class:`~lightning_vram.prediction.replay.known_values.KnownValues` holds (an attention mask from the
batch), the check answers as it does for the real tensor, so the replay takes the real step's branch. Every other
check (compiling, exporting, torch.fx proxies, a fake tensor without a known value) answers as before. The library's
function is put back when the replay ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_vram.prediction.replay.known_values import KnownValues

TRACING_CHECKS = (("transformers.utils.import_utils", "is_fake_tensor"),)
"""``(module, function)``: the checks, read at call time by the library, that treat a fake tensor as tracing."""


@contextmanager
def real_branches(values: KnownValues) -> Iterator[None]:
    """While it lasts, each library's fake-tensor check is false for a tensor whose value ``values`` knows."""
    replaced: list[tuple[Any, str, Callable[[Any], bool]]] = []
    try:
        for module_name, name in TRACING_CHECKS:
            module = sys.modules.get(module_name)  # a library not imported has no branch to take
            original = getattr(module, name, None)
            if module is None or not callable(original):
                continue
            setattr(module, name, _unless_known(original, values))
            replaced.append((module, name, original))
        yield
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)


def _unless_known(check: Callable[[Any], bool], values: KnownValues) -> Callable[[Any], bool]:
    def is_fake_tensor(tensor: Any) -> bool:
        return check(tensor) and tensor not in values

    return is_fake_tensor
