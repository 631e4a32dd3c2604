"""The trainer's torch.distributed world and Megatron's parallel state.

Owns: choosing the backend (NCCL with CUDA, gloo without), initialising the default group from
torchrun's environment, Megatron's tensor/pipeline/context/data-parallel groups, and the model
parallel seeds. Groups *between* roles (trainer -> relay) are not here: they get their own store
in ``weights/`` and never join this world.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..netutil import free_port
from .cpu_compat import apply_cpu_compat


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_trainer_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234,
                          timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed (from torchrun's env) and Megatron's parallel state."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # under torchrun
            dist.init_process_group(backend=backend(), timeout=timeout)
        else:
            # A single process outside torchrun: a world of one on a private loopback store
            # (os.environ is left alone, so child processes do not think they are rank 0).
            dist.init_process_group(backend=backend(), timeout=timeout, rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{free_port()}")
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
                         "change parallel.* or the number of trainer processes")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_trainer_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
