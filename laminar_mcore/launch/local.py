"""Start the trainer world on this machine with torchrun's API (``elastic_launch``).

Owns process start and teardown for single-machine runs: each trainer process gets
``RANK``/``WORLD_SIZE``/``MASTER_*`` from torchrun, a loopback rendezvous on a free port, and
its share of the CPU threads. An error in any process stops all of them.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, List

from ..netutil import free_port


def launch_trainer_world(entrypoint: Callable, args: tuple, nproc: int,
                         log_dir: str | None = None, max_restarts: int = 0) -> Dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` processes; return each rank's return value. A
    process that fails restarts the whole world, up to ``max_restarts`` times (the processes
    see ``TORCHELASTIC_RESTART_COUNT``; trainer/loop.py then resumes from a checkpoint)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"laminar-{uuid.uuid4().hex[:8]}",
        # torchrun's own single-node default: a TCPStore on the agent, no dynamic rendezvous
        # (whose bookkeeping walks the interpreter's stack, ~2 CPU-s per launch)
        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"rank": 0}, max_restarts=max_restarts, monitor_interval=0.5,
        start_method="spawn", logs_specs=None, local_addr="127.0.0.1",
    )
    return elastic_launch(config, entrypoint)(*args)


def trainer_nproc(cfg) -> int:
    t = cfg.cluster.trainer
    if t.nnodes != 1:
        raise ValueError("LMC-E203: "
                         "the local launcher runs one node; for cluster.trainer.nnodes > 1 "
                         "start each trainer node with torchrun (see README, 'Multi-node')")
    return t.nproc_per_node


__all__: List[str] = ["launch_trainer_world", "trainer_nproc", "free_port"]
