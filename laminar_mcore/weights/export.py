"""Export a Megatron-Core model stage as Hugging Face tensors, packed into flattened buckets.

Per pipeline stage, unit by unit (embedding, each layer, final norm, output layer): gather the
tensor-parallel shards (column, row and vocab-parallel; gate/up of linear_fc1 per rank), undo
Megatron's layouts with the model family's adapter (the one the checkpoint tools use), cast to
the rollout dtype and write into buckets of at most ``bucket_bytes``. Only the exported tensors
of one bucket are alive at a time. Collective over the stage's tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..models import get_adapter
from .bucket import TensorMeta, layout, write_bucket


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def iter_stage_hf_tensors(model, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for everything this pipeline stage holds, in order.

    Every rank of the stage's TP group must iterate together (the gathers are collective).
    """
    from megatron.core import parallel_state as ps

    from ..trainer.model import global_param_name

    model = _unwrap(model)
    adapter = get_adapter(hf_config)
    tied = adapter.tied_embeddings(hf_config)
    params = {}
    for local, param in model.named_parameters():
        if tied and local == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding: the first stage exports it
        params[global_param_name(model, local)] = param
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    for unit, names in adapter.export_units(hf_config):
        if not all(n in params for n in names):
            if any(n in params for n in names):
                missing = [n for n in names if n not in params]
                raise RuntimeError(f"stage holds part of unit {unit}; missing {missing}")
            continue
        full = {}
        for name in names:
            shard = params[name].detach()
            if adapter.tp_dim(name) is not None and tp > 1:
                shards = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(shards, shard.contiguous(), group=tp_group)
                full[name] = adapter.unshard(name, shards)
            else:
                full[name] = shard
        yield from adapter.convert_unit_to_hf(hf_config, unit, full)


@dataclass
class Bucket:
    metas: List[TensorMeta]
    buffer: torch.Tensor  # uint8, at least layout's nbytes

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class BucketPacker:
    """Packs a stream of named tensors into reusable byte buffers of about ``bucket_bytes``.

    Buffers are kept between publishes (weights have the same sizes every time), so a publish
    allocates nothing after the first. ``dtype`` casts floating tensors (the rollout dtype).
    """

    def __init__(self, bucket_bytes: int, dtype: Optional[torch.dtype] = None,
                 device: str = "cpu", pin_memory: bool = False):
        if bucket_bytes < 1:
            raise ValueError("bucket size must be >= 1 byte")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: List[torch.Tensor] = []

    def _buffer(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                               pin_memory=self.pin_memory)
        return self._buffers[index]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def pack(self, named: Iterator[Tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Yield filled buckets as they complete (the caller may send bucket k while this
        generator gathers bucket k+1)."""
        pending, size, index = {}, 0, 0
        self.last_buckets: List[Bucket] = []  # this publish's buckets (views of the buffers)
        for name, tensor in named:
            tensor = self._cast(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > self.bucket_bytes:
                yield self._fill(index, pending)
                index += 1
                pending, size = {}, 0
            pending[name] = tensor
            size += -(-nbytes // 64) * 64
        if pending:
            yield self._fill(index, pending)

    def _fill(self, index: int, pending) -> Bucket:
        metas, nbytes = layout(pending)
        buffer = self._buffer(index, nbytes)[:nbytes]
        write_bucket(buffer, pending, metas)
        bucket = Bucket(metas, buffer)
        self.last_buckets.append(bucket)
        return bucket
