"""SGLang's weight-update group (``/init_weights_update_group`` +
``/update_weights_from_distributed``), both ends, in the neutral weights package.

The rendezvous is SGLang 0.5.23's ``init_custom_process_group``: torch's ``tcp://`` rendezvous
at the sender's address, the store prefixed with the group name, the group made by torch's own
process-group helper -- so a trainer that speaks to real SGLang engines and the CPU engine join
groups the same way. Payloads are SGLang's: one broadcast from rank 0 per tensor, or with
``load_format="flattened_bucket"`` one uint8 buffer with the tensors packed back to back.
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch

TensorSpec = Tuple[str, torch.dtype, Tuple[int, ...]]


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: Optional[datetime.timedelta] = None):
    """A process group outside the default world, joined as SGLang joins it."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world,
                                                    default_pg_timeout, rendezvous)

    timeout = timeout or default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def join_update_group(master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, backend: str = "gloo",
                      timeout_s: float = 600.0):
    """The engine's side of /init_weights_update_group (rank = rank_offset + its TP rank)."""
    return init_custom_process_group(backend, f"tcp://{master_address}:{master_port}",
                                     world_size, rank, group_name,
                                     datetime.timedelta(seconds=timeout_s))


def flattened_layout(specs: Sequence[TensorSpec]) -> Tuple[List[Tuple[int, int]], int]:
    """Byte ranges of SGLang's flattened bucket (``FlattenedTensorBucket.empty``): tensors
    back to back, each at an offset aligned to its own element size."""
    ranges, offset = [], 0
    for name, dtype, shape in specs:
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        ranges.append((offset, size))
        offset += size
    return ranges, offset


def receive_tensors(pg, specs: Sequence[TensorSpec], load_format: Optional[str] = None
                    ) -> Dict[str, torch.Tensor]:
    """Receive one update from rank 0 of ``pg`` (the sender)."""
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        ranges, total = flattened_layout(specs)
        flat = torch.empty(total, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=pg)
        return {name: flat[a:a + n].view(dtype).view(shape).clone()
                for (name, dtype, shape), (a, n) in zip(specs, ranges)}
    out = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in specs}
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in out.values()]
    for handle in handles:
        handle.wait()
    return out


def send_tensors(pg, named: Dict[str, torch.Tensor], load_format: Optional[str] = None) -> None:
    """The sender's side (rank 0): what SGLang's receiver expects, in ``named``'s order."""
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in named.items()]
        ranges, total = flattened_layout(specs)
        flat = torch.empty(total, dtype=torch.uint8)
        for t, (a, n) in zip(named.values(), ranges):
            flat[a:a + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        dist.broadcast(flat, src=0, group=pg)
        return
    for t in named.values():
        dist.broadcast(t.detach().contiguous(), src=0, group=pg)
