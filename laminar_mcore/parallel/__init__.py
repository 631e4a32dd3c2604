"""Process groups of the trainer world and the CPU compatibility layer for Megatron-Core."""

from .cpu_compat import apply_cpu_compat
from .groups import destroy_trainer_parallel, init_trainer_parallel

__all__ = ["apply_cpu_compat", "init_trainer_parallel", "destroy_trainer_parallel"]
