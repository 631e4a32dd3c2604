import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")

os.environ.setdefault("PYTHONWARNINGS", "ignore")


@pytest.fixture
def repo_root():
    return ROOT


@pytest.fixture
def python():
    return sys.executable
