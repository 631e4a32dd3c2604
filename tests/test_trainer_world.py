"""The local trainer world (launch.local) survives a rank killed with -9: torchrun restarts the
world, and the restarted ranks rendezvous afresh. torchrun's static rendezvous keeps its store
across restarts, so ranks that read it unprefixed found their dead predecessors' gloo addresses
(``Gloo connectFullMesh failed ... Connection refused``) and every restart of a world of two or
more failed; ``parallel.groups.attempt_store`` gives each attempt its own keys."""

import os
import signal

import pytest

pytestmark = pytest.mark.multiprocess


def _killed_once():
    import torch
    import torch.distributed as dist

    from laminar_mcore.parallel import init_trainer_parallel

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_trainer_parallel(tp=2, pp=1, seed=0, timeout_s=60)
    if attempt == 0 and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # as the chaos test kills a trainer rank
    t = torch.ones(1)
    dist.all_reduce(t)
    # across nodes each torchrun agent counts its own restarts: the world agrees on the most
    # (whether to resume is one decision: trainer/loop.py)
    from laminar_mcore.parallel.groups import agreed_restarts

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(3 * dist.get_rank())
    return attempt, float(t), agreed_restarts()


def test_a_world_of_two_restarts_after_a_rank_is_killed():
    from laminar_mcore.launch.local import launch_trainer_world

    results = launch_trainer_world(_killed_once, (), 2, max_restarts=1)
    assert results == {0: (1, 2.0, 3), 1: (1, 2.0, 3)}
