import sys
from pathlib import Path

# The hostile cases share harness.py; the tests' models.py is one folder up (the parent conftest puts it on the path).
sys.path.insert(0, str(Path(__file__).parent))
