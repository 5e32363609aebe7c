import sys
from pathlib import Path

import pytest

# The hostile cases share harness.py; the tests' models.py is one folder up (the parent conftest puts it on the path).
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every hostile case tests the replay's containment: it keeps the library's replay defaults (``replay``)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.replay)
