"""Process groups of the trainer world and the CPU compatibility layer for Megatron-Core."""

from .cpu_compat import apply_cpu_compat
from .groups import (destroy_trainer_parallel, device, init_trainer_parallel, wait_for_rank0,
                     wait_group)

__all__ = ["apply_cpu_compat", "init_trainer_parallel", "destroy_trainer_parallel", "device",
           "wait_for_rank0", "wait_group"]
