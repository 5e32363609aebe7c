import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# The tests' models are tiny: one intra-op thread keeps their step times steady on a busy or 2-core machine,
# where spinning worker threads otherwise stretch a millisecond step to a hundred.
torch.set_num_threads(1)
