import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")

os.environ.setdefault("PYTHONWARNINGS", "ignore")
# Triton kernels run in Triton's interpreter on CPU machines; it must be set before any kernel
# is defined (at import of laminar_mcore.kernels).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def repo_root():
    return ROOT


@pytest.fixture
def python():
    return sys.executable
