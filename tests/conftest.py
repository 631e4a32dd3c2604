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
    # Strict device mode (tests/test_kernel_devices.py): the kernel tests' device is the one
    # LAMINAR_KERNEL_STRICT_DEVICE names, while a tensor created without device= lands on
    # "meta", which the kernels' entry points refuse (kernels/_device.py) -- as a compiled
    # kernel on a GPU machine refuses host memory.
    if os.environ.get("LAMINAR_KERNEL_STRICT_DEVICE"):
        torch.set_default_device("meta")
    # `make test` runs files side by side in pytest-xdist workers: each worker computes on its
    # share of the cores (two workers with a thread per core each would oversubscribe them,
    # and OpenMP's spinning threads then slow both down several times over)
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
except ImportError:  # pragma: no cover
    pass

# One warm-up cache for the whole session (data/warmup.py: keyed by recipe, written atomically):
# the train jobs of many tests start from the same warm-up checkpoints. Set before any worker
# process starts, so they all inherit it; removed by the process that made it.
if not os.environ.get("LAMINAR_CACHE_DIR"):
    import tempfile

    os.environ["LAMINAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="laminar-test-cache-")
    _CACHE_OWNER = os.getpid()


def pytest_unconfigure(config):
    if globals().get("_CACHE_OWNER") == os.getpid():
        import shutil

        shutil.rmtree(os.environ["LAMINAR_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def repo_root():
    return ROOT


@pytest.fixture
def python():
    return sys.executable


@pytest.fixture
def kernel_device():
    """Where kernel tests put every tensor they hand to a kernel: the GPU when there is one
    (compiled Triton), else the CPU (Triton's interpreter); strict mode's declared device."""
    import torch

    strict = os.environ.get("LAMINAR_KERNEL_STRICT_DEVICE")
    if strict:
        return torch.device(strict)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wait_until(predicate, timeout=60.0, what="condition"):
    """Poll ``predicate`` every 50 ms until it holds; fail the test after ``timeout`` s."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def running_controller(tmp_path, token):
    """A real controller on loopback with a toy task and no engines; yields it, stops it."""
    from laminar_mcore.config.schema import LaminarConfig
    from laminar_mcore.controller.episode import TaskCodec
    from laminar_mcore.controller.server import Controller, TaskData
    from laminar_mcore.metrics import MetricsWriter

    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    c = Controller(LaminarConfig(output_dir=str(tmp_path)), task, metrics, token,
                   info={"model_path": "/none"})
    c.start()
    try:
        yield c
    finally:
        c.stop()
        metrics.close()
