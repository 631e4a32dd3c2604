"""SGLang's weight-update group (``/init_weights_update_group`` +
``/update_weights_from_distributed``), both ends, in the neutral weights package.

The rendezvous is SGLang 0.5.23's ``init_custom_process_group``: torch's ``tcp://`` rendezvous
at the sender's address, the store prefixed with the group name, the group made by torch's own
process-group helper -- so a trainer that speaks to real SGLang engines and the CPU engine join
groups the same way. Payloads are SGLang's: one broadcast from rank 0 per tensor, or with
``load_format="flattened_bucket"`` one uint8 buffer with the tensors packed back to back.

The flattened bucket is *not* padded: SGLang 0.5.23's receiver
(``srt/model_executor/model_runner_components/weight_updater.py:300-310``) allocates it with
``FlattenedTensorBucket.empty(names, dtypes, shapes, device)``
(``srt/weight_sync/tensor_bucket.py:86-112``), which computes every offset itself from the
request's names/dtypes/shapes, tensors back to back in the request's order with no padding,
and raises ``ValueError("Unaligned received tensor ...")`` -- before joining the broadcast --
when an offset is not a multiple of that tensor's element size (so that its ``.view(dtype)`` on
the uint8 slice is legal). A sender must match that layout byte for byte, so
``flattened_layout`` is that same computation and ``send_tensors`` refuses an order SGLang
would refuse *before* broadcasting (the receiver would never join, and the sender would hang
until the group's timeout). ``flattened_order`` gives an order SGLang always accepts: element
sizes are powers of two, so with the largest first every offset is a multiple of every later
element size.
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple, Union

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


def destroy_update_group(pg) -> None:
    """Tear a group down as SGLang's ``destroy_weights_update_group`` does. A process that exits
    with a gloo group alive can abort in the group's destructor ("terminate called without an
    active exception"), so every side destroys its group before it goes, and then drops its last
    reference to it while the interpreter still runs (a group freed in the exit's teardown aborts
    about one process in 30)."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def flattened_layout(specs: Sequence[TensorSpec]) -> Tuple[List[Tuple[int, int]], int]:
    """(offset, nbytes) of each tensor in SGLang's flattened bucket and its total size, exactly as
    ``FlattenedTensorBucket.empty`` computes them: back to back, no padding, each offset a
    multiple of its tensor's element size (``ValueError`` otherwise, with SGLang's message)."""
    ranges, offset = [], 0
    for name, dtype, shape in specs:
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {tuple(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, "
                             f"dtype {dtype} (SGLang's flattened bucket packs tensors back to "
                             "back; send larger element sizes first, see flattened_order)")
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        ranges.append((offset, size))
        offset += size
    if not ranges:
        raise ValueError("Cannot create empty tensor bucket")
    return ranges, offset


def flattened_order(named: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``named`` reordered (stably) by decreasing element size: an order whose back-to-back
    layout SGLang's receiver always accepts. Send the names/dtypes/shapes in this order too."""
    return dict(sorted(named.items(), key=lambda kv: -kv[1].element_size()))


def _one_device(named: Dict[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError("a flattened bucket is one buffer on one device: its tensors are on "
                         f"{sorted(str(d) for d in devices) or 'no device'}")
    return devices.pop()


def receive_tensors(pg, specs: Sequence[TensorSpec], load_format: Optional[str] = None,
                    device: Union[str, torch.device] = "cpu") -> Dict[str, torch.Tensor]:
    """Receive one update from rank 0 of ``pg`` (the sender) into tensors on ``device`` (the
    engine's: CPU for gloo, its GPU for NCCL, as SGLang's ``self.device``)."""
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        ranges, total = flattened_layout(specs)  # refuses before the broadcast, as SGLang does
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return {name: flat[a:a + n].view(dtype).view(shape).clone()
                for (name, dtype, shape), (a, n) in zip(specs, ranges)}
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, dtype, shape in specs}
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in out.values()]
    for handle in handles:
        handle.wait()
    return out


def send_tensors(pg, named: Dict[str, torch.Tensor], load_format: Optional[str] = None) -> None:
    """The sender's side (rank 0): what SGLang's receiver expects, in ``named``'s order (the
    order of the request's names/dtypes/shapes). The flattened bucket is built on the tensors'
    device (they must share one: NCCL needs the buffer on the GPU, gloo on the CPU); an order
    SGLang's receiver would refuse raises ``ValueError`` before anything is sent."""
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in named.items()]
        ranges, total = flattened_layout(specs)
        device = _one_device(named)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        for t, (a, n) in zip(named.values(), ranges):
            flat[a:a + n].view(t.dtype).view(t.shape).copy_(t.detach())  # one copy, strided ok
        dist.broadcast(flat, src=0, group=pg)
        return
    for t in named.values():
        dist.broadcast(t.detach().contiguous(), src=0, group=pg)
