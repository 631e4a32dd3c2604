"""The trainer's torch.distributed world and Megatron's parallel state.

Owns: choosing the backend, initialising the default group from torchrun's environment,
Megatron's tensor/pipeline/context/data-parallel groups, the model parallel seeds, and the group
that long waits (a batch, a checkpoint) go through.

With CUDA the world is ``cpu:gloo,cuda:nccl``: a collective runs on NCCL for CUDA tensors and on
gloo for CPU tensors (flags, counts, stats, object scatter), so a helper collective never fails
with "No backend type associated with device type cpu". Without CUDA it is gloo alone -- the
same groups, the same code. Groups *between* roles (trainer -> relay) are not here: they get their own store
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
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def local_device_index(environ=None) -> int:
    """This rank's CUDA device among those it sees: ``LOCAL_RANK % device_count()``. Under a
    mask of the node's trainer GPUs (the local launcher's GPU map) rank r takes the r-th; under
    a per-rank mask (SLURM ``--gpus-per-task``, Kubernetes) it sees one device, index 0."""
    environ = os.environ if environ is None else environ
    return int(environ.get("LOCAL_RANK", 0) or 0) % max(torch.cuda.device_count(), 1)


def device() -> torch.device:
    """Where this rank's model lives: its CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_WAIT_GROUP = None


def wait_group(timeout_s: float = 24 * 3600.0):
    """A gloo group over the whole world with a long timeout, created on first use (collective:
    every rank calls it the first time).

    Ranks that wait for rank 0 -- to fetch a batch that may take longer to generate than the
    world's collective timeout, or to finish a save -- wait here on a CPU tensor, so a slow
    rollout never trips the NCCL watchdog. The world's own timeout stays short, so a hung
    training collective still fails fast."""
    global _WAIT_GROUP
    if _WAIT_GROUP is None:
        _WAIT_GROUP = dist.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
    return _WAIT_GROUP


def broadcast_int(value: int, timeout_s: float = 24 * 3600.0) -> int:
    """Every rank calls it; returns rank 0's ``value`` (through ``wait_group``)."""
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.broadcast(t, src=0, group=wait_group(timeout_s))
    return int(t.item())


def agreed_restarts(timeout_s: float = 24 * 3600.0) -> int:
    """Every rank calls it: the most restarts any rank's torchrun agent counted
    (``TORCHELASTIC_RESTART_COUNT``). Across nodes each agent counts its own (a node that
    restarts because another joined does not count), and whether to resume must be one
    decision: ranks that disagreed would wait in different collectives."""
    t = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)],
                     dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=wait_group(timeout_s))
    return int(t.item())


def wait_for_rank0(ready: bool, timeout_s: float = 24 * 3600.0) -> bool:
    """Every rank calls it; returns rank 0's ``ready`` flag (broadcast through ``wait_group``)."""
    return bool(broadcast_int(1 if ready else 0, timeout_s))


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> "dist.Store":
    """torchrun's rendezvous store, seen under a prefix of its own for this restart attempt
    (``TORCHELASTIC_RESTART_COUNT``).

    torchrun's static rendezvous (one node, ``launch.local``) keeps its agent's store across
    restarts, and torch reuses it unprefixed ("we create a new TCPStore for every retry"), so
    the ranks of a restarted world read the gloo addresses their dead predecessors published:
    every restart of a world of two or more failed with ``Gloo connectFullMesh failed ...
    Connection refused`` (found when a TP2 trainer rank was killed). The store is made as
    torch's env:// rendezvous makes it: a client of the agent's store, or rank 0 hosting it.
    One node only: there one agent counts the restarts; across nodes each agent counts its
    own (a node that restarts because another joined does not count), so the prefixes would
    differ between nodes."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                              multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"laminar/attempt_{attempt}", store)


def init_trainer_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234,
                          timeout_s: float = 600.0, ep: int = 1, expert_tp: int = 1) -> None:
    """Initialise torch.distributed (from torchrun's env) and Megatron's parallel state.

    ``ep``/``expert_tp``: expert parallelism and the experts' own tensor parallelism (MoE
    models); Megatron lays the expert grid (expert_tp x ep x expert-DP x pp) over the same
    world as the dense one (tp x cp x dp x pp)."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device_index())
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and os.environ.get("LOCAL_WORLD_SIZE") == \
                os.environ.get("WORLD_SIZE"):  # torchrun on one node
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend=backend(), timeout=timeout, rank=rank,
                                    world_size=world, store=attempt_store(rank, world, timeout))
        elif "RANK" in os.environ:  # torchrun on several nodes: its own rendezvous
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
    if world % (expert_tp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by expert_tp*ep*pp = "
                         f"{expert_tp}*{ep}*{pp}; change parallel.ep / parallel.expert_tp")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        # Megatron's TP/PP/DP/EP subgroups take their timeout from here, not from the world
        # group (default 30 minutes): a hung TP collective fails after timeout_s as well.
        distributed_timeout_minutes=timeout_s / 60.0)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_trainer_parallel() -> None:
    from megatron.core import parallel_state

    global _WAIT_GROUP
    _WAIT_GROUP = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
