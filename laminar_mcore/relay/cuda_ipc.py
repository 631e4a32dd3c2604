"""GPU twin of the shared-memory pull: SGLang's CUDA-IPC flattened-bucket payload.

On a GPU rollout machine, a relay serves a leased version to local SGLang engines as CUDA IPC
handles: each host bucket is copied once to each GPU of the engine (one per engine TP rank:
SGLang's ``serialized_named_tensors`` holds one payload per TP rank, and rank r reads entry r),
wrapped in SGLang's own
``FlattenedTensorBucket`` and serialized with SGLang's ``MultiprocessingSerializer`` -- the
exact payload of ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"`` -- so
the format is SGLang's by construction. Before serialising, SGLang's own
``monkey_patch_torch_reductions`` is applied (as SGLang's senders do): CUDA tensors are then
reduced by device UUID instead of index, so the relay and an engine may see different
``CUDA_VISIBLE_DEVICES``. The GPU copies live as long as the lease (an engine must not read
freed memory through a handle). CPU machines use ``weights.bucket`` handles.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch


def _sglang_bucket_classes():
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:  # older SGLang releases keep it in the model runner
        from sglang.srt.model_executor.model_runner import FlattenedTensorBucket
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # idempotent: device UUIDs in IPC handles
    return FlattenedTensorBucket, MultiprocessingSerializer


class CudaIpcExporter:
    """Builds SGLang payloads for leased versions and keeps their GPU copies alive."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA IPC serving needs a GPU; CPU machines pull shared-memory handles")
        self._alive: Dict[str, List[torch.Tensor]] = {}

    def payloads(self, lease_id: str, named_buckets: List[Dict[str, torch.Tensor]],
                 devices: Sequence[str]) -> List[List[str]]:
        """Per bucket, one serialized payload per engine TP rank (``devices[r]`` is rank r's GPU)."""
        if not devices:
            raise ValueError("CUDA IPC payloads need the engine's GPUs (one device per TP rank)")
        targets = [torch.device(d) for d in devices]
        for d in targets:
            if d.type != "cuda" or (d.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"device {d} is not a GPU of this machine "
                                 f"({torch.cuda.device_count()} visible)")
        bucket_cls, serializer = _sglang_bucket_classes()
        out, keep = [], []
        for named in named_buckets:
            per_rank = []
            for device in targets:
                gpu = [(name, t.to(device, non_blocking=True)) for name, t in named.items()]
                bucket = bucket_cls(named_tensors=gpu)
                flat = bucket.get_flattened_tensor()
                keep.append(flat)
                per_rank.append(serializer.serialize(
                    {"flattened_tensor": flat, "metadata": bucket.get_metadata()}, output_str=True))
            out.append(per_rank)
        for device in targets:
            torch.cuda.synchronize(device)
        self._alive[lease_id] = keep
        return out

    def release(self, lease_id: str) -> None:
        self._alive.pop(lease_id, None)
