"""The CPU compatibility layer: scoped to megatron.core, RNG tracker semantics kept."""

import pytest
import torch

from laminar_mcore.parallel.cpu_compat import CpuRNGStatesTracker, apply_cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_megatron_sees_cuda_factories_on_cpu_and_nothing_else_does():
    assert apply_cpu_compat() is True
    from megatron.core.pipeline_parallel import schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    with schedules.torch.cuda.stream(schedules.torch.cuda.Stream()):
        pass
    # Outside Megatron torch is untouched: asking for CUDA still fails loudly.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.Tensor.cuda is not None and schedules.torch is not torch


def test_rng_tracker_forks_named_cpu_states():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # default stream untouched
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(123)))
    assert not torch.equal(first, second)  # the named state advanced
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("other", 123)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass


def test_megatron_seeding_uses_the_cpu_tracker():
    apply_cpu_compat()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)
    assert isinstance(mrandom.get_cuda_rng_tracker(), CpuRNGStatesTracker)
