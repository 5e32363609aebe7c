import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# The tests' models are tiny: one intra-op thread keeps their step times steady on a busy or 2-core machine,
# where spinning worker threads otherwise stretch a millisecond step to a hundred.
torch.set_num_threads(1)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Helper scripts beside the tests are not test modules: ``--doctest-modules`` would import them (and deepspeed)."""
    if collection_path.parent == HERE and collection_path.suffix == ".py":
        return not collection_path.name.startswith(("test_", "conftest"))
    return None
