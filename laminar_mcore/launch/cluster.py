"""Multi-node roles: the controller, a rollout node and a trainer rank, each its own process.

    # one machine (or any): the controller; prints its URL
    python -m laminar_mcore.launch job=controller cluster=multinode cluster.controller_addr=HOST
    # every rollout node: a relay and rollout.num_engines engines on this node
    python -m laminar_mcore.launch job=rollout cluster=multinode cluster.controller_addr=HOST \\
        rollout.host=$(hostname -i)
    # every trainer node: torchrun runs one trainer rank per process
    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        -m laminar_mcore.launch job=trainer cluster=multinode cluster.controller_addr=HOST

All roles share the run token through ``LAMINAR_RUN_TOKEN`` and find each other through the
controller (``cluster.controller_addr``:``cluster.controller_port``): the first rollout node to
register hosts the master relay that trainers publish to, the others chain from it; trainers
wait until ``cluster.rollout_nodes`` nodes have registered. When training ends the controller
evaluates, writes the summary and tells the rollout nodes to stop; a rollout node whose
controller is gone stops its engines on its own. This module only finds the token and the
controller and hands them to the role (controller/role.py, rollout/node.py, trainer/loop.py).
"""

from __future__ import annotations

import os

from ..config import typed
from ..controller.client import TOKEN_ENV, ControllerClient, ControllerError, controller_url

ClusterError = ControllerError


def run_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 8:
        raise ClusterError(f"multi-node roles share a secret run token: export {TOKEN_ENV}=<at "
                           "least 8 characters, e.g. $(openssl rand -hex 16)> on every node")
    return token


def run_role(job: str, cfg) -> object:
    cfg = typed(cfg)
    token = run_token()
    if job == "controller":
        from ..controller.role import run

        return run(cfg, token)
    if job == "rollout":
        from ..rollout.node import run

        return run(cfg, ControllerClient(controller_url(cfg), token))
    if job == "trainer":
        from ..trainer.loop import run

        return run(cfg, token)
    raise ValueError(f"job={job!r} is not a cluster role")
