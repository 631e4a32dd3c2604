"""GPU twin of the shared-memory pull: SGLang's CUDA-IPC flattened-bucket payload.

On a GPU rollout machine, a relay serves a leased version to local SGLang engines as CUDA IPC
handles, one bucket at a time (the relay's ``/bucket``): the bucket is copied once to each GPU of
the engine (one per engine TP rank: SGLang's ``serialized_named_tensors`` holds one payload per
TP rank, and rank r reads entry r), wrapped in SGLang's own
``FlattenedTensorBucket`` and serialized with SGLang's ``MultiprocessingSerializer`` -- the
exact payload of ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"`` -- so
the format is SGLang's by construction. Before serialising, SGLang's own
``monkey_patch_torch_reductions`` is applied (as SGLang's senders do): CUDA tensors are then
reduced by device UUID instead of index, so the relay and an engine may see different
``CUDA_VISIBLE_DEVICES``. A bucket's GPU copies live until the engine has applied it (an engine
must not read freed memory through a handle) and no longer: at most two buckets per engine GPU.
CPU machines use ``weights.bucket`` handles through the same per-bucket protocol.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence

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
    """Builds SGLang payloads for one bucket of a lease at a time and keeps their GPU copies
    alive until the engine has applied them.

    ``payload(lease, i, ...)`` copies bucket i to each engine GPU; ``free(lease, indices)``
    (the relay calls it for the buckets the engine has applied) and ``release(lease)`` give the
    copies back to the driver (``torch.cuda.ipc_collect`` for blocks the engine held through
    IPC, then ``empty_cache``). The relay's ``/bucket`` never lets a lease hold more than two.
    """

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA IPC serving needs a GPU; CPU machines pull shared-memory handles")
        self._alive: Dict[str, Dict[int, List[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.peak_buckets_held = 0  # the most buckets one lease ever held at once

    @staticmethod
    def check_devices(devices: Sequence[str]) -> List[torch.device]:
        if not devices:
            raise ValueError("CUDA IPC payloads need the engine's GPUs (one device per TP rank)")
        targets = [torch.device(d) for d in devices]
        for d in targets:
            if d.type != "cuda" or (d.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"device {d} is not a GPU of this machine "
                                 f"({torch.cuda.device_count()} visible)")
        return targets

    def payload(self, lease_id: str, index: int, named: Dict[str, torch.Tensor],
                devices: Sequence[str]) -> List[str]:
        """Bucket ``index`` of a lease: one serialized payload per engine TP rank
        (``devices[r]`` is rank r's GPU)."""
        targets = self.check_devices(devices)
        bucket_cls, serializer = _sglang_bucket_classes()
        keep, per_rank = [], []
        for device in targets:
            gpu = [(name, t.to(device, non_blocking=True)) for name, t in named.items()]
            bucket = bucket_cls(named_tensors=gpu)
            flat = bucket.get_flattened_tensor()
            keep.append(flat)
            per_rank.append(serializer.serialize(
                {"flattened_tensor": flat, "metadata": bucket.get_metadata()}, output_str=True))
            del gpu, bucket
        for device in targets:
            torch.cuda.synchronize(device)
        with self._lock:
            held = self._alive.setdefault(lease_id, {})
            held[index] = keep
            self.peak_buckets_held = max(self.peak_buckets_held, len(held))
        return per_rank

    def held(self, lease_id: str) -> List[int]:
        with self._lock:
            return sorted(self._alive.get(lease_id, {}))

    def free(self, lease_id: str, indices: Optional[Sequence[int]] = None) -> None:
        """Free the copies of ``indices`` (all of the lease's when None)."""
        with self._lock:
            held = self._alive.get(lease_id, {})
            drop = [i for i in held if indices is None or i in indices]
            for i in drop:
                del held[i]
            if indices is None:
                self._alive.pop(lease_id, None)
        if drop:
            torch.cuda.ipc_collect()  # blocks the engine's IPC handles no longer reference
            torch.cuda.empty_cache()

    def release(self, lease_id: str) -> None:
        self.free(lease_id)
