"""Start the trainer world on this machine with torchrun's API (``elastic_launch``).

Owns process start and teardown for single-machine runs: each trainer process gets
``RANK``/``WORLD_SIZE``/``MASTER_*`` from torchrun, a loopback rendezvous on a free port, and
its share of the CPU threads, and, on a GPU machine, the trainers' GPUs of the GPU map
(``CUDA_VISIBLE_DEVICES``, set in each process before anything touches CUDA). An error in any
process stops all of them.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..netutil import free_port


def launch_trainer_world(entrypoint: Callable, args: tuple, nproc: int,
                         log_dir: str | None = None, max_restarts: int = 0,
                         env: Optional[Mapping[str, str]] = None) -> Dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` processes; return each rank's return value. A
    process that fails restarts the whole world, up to ``max_restarts`` times (the processes
    see ``TORCHELASTIC_RESTART_COUNT``; trainer/loop.py then resumes from a checkpoint).
    ``env``: variables every process sets before it runs ``entrypoint`` (the GPU map's
    ``CUDA_VISIBLE_DEVICES``), the launcher's own environment untouched."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"laminar-{uuid.uuid4().hex[:8]}",
        # torchrun's own single-node default: a TCPStore on the agent, no dynamic rendezvous
        # (whose bookkeeping walks the interpreter's stack, ~2 CPU-s per launch)
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0}, max_restarts=max_restarts, monitor_interval=0.5,
        start_method="spawn", logs_specs=None, local_addr="127.0.0.1",
    )
    if env:
        return elastic_launch(config, with_env)(dict(env), entrypoint, *args)
    return elastic_launch(config, entrypoint)(*args)


def with_env(env: Mapping[str, str], entrypoint: Callable, *args):
    """In a trainer process: set ``env`` (before CUDA starts: it reads CUDA_VISIBLE_DEVICES
    once), then run ``entrypoint(*args)``."""
    os.environ.update(env)
    return entrypoint(*args)


def trainer_nproc(cfg) -> int:
    t = cfg.cluster.trainer
    if t.nnodes != 1:
        raise ValueError("LMC-E203: "
                         "the local launcher runs one node; for cluster.trainer.nnodes > 1 "
                         "start each trainer node with torchrun (see README, 'Multi-node')")
    return t.nproc_per_node


__all__: List[str] = ["launch_trainer_world", "trainer_nproc", "free_port", "with_env"]
