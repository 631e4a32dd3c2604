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

Layout (``ipc_layout``): each tensor starts at a multiple of ``IPC_ALIGN`` = 16 bytes, with
explicit ``start_idx``/``end_idx`` per tensor. SGLang 0.5.23's receiver of this payload
(``srt/model_executor/model_runner_components/weight_updater.py:383-413``
``_update_weights_from_flattened_bucket``) copies ``start_idx``/``end_idx`` from our metadata and
rebuilds each tensor as ``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)``
(``srt/weight_sync/tensor_bucket.py:118-131``): it never recomputes offsets, so padding between
tensors is read past, and 16-byte starts keep every ``.view(dtype)`` legal and every tensor
aligned for vectorised loads, whatever mix of dtypes and odd sizes a bucket holds. (The
``/update_weights_from_distributed`` bucket is different: its receiver computes the offsets
itself, unpadded -- see ``weights.update_group``.)
"""

from __future__ import annotations

import base64
import io
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .base import Exporter as _Exporter
from .base import Puller


IPC_ALIGN = 16  # bytes: every tensor's start_idx in a CUDA-IPC flattened bucket


def ipc_layout(named: Dict[str, torch.Tensor], meta_cls=None) -> Tuple[list, int]:
    """Metadata (``meta_cls``: SGLang's ``FlattenedTensorMetadata`` or the stand-in) of
    ``named`` in one flattened bucket, and the bucket's size in bytes: tensors in ``named``'s
    order, each at the next multiple of ``IPC_ALIGN``, ``end_idx - start_idx`` its byte size
    and ``numel`` that byte size too (what SGLang's own bucket records: the uint8 count)."""
    meta_cls = meta_cls or StandinTensorMetadata
    metadata, offset = [], 0
    for name, t in named.items():
        offset = -(-offset // IPC_ALIGN) * IPC_ALIGN
        nbytes = t.numel() * t.element_size()
        metadata.append(meta_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                 end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return metadata, offset


def reconstruct_tensors(flattened_tensor: torch.Tensor, metadata) -> List[Tuple[str, torch.Tensor]]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors``: views of each tensor, placed by
    its metadata's ``start_idx``/``end_idx`` (never by a running offset)."""
    return [(m.name, flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
            for m in metadata]


def _sglang_bucket_classes():
    """SGLang 0.5.23's bucket, metadata and serializer classes (the payload's format)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    monkey_patch_torch_reductions()  # idempotent: device UUIDs in IPC handles
    return FlattenedTensorBucket, FlattenedTensorMetadata, MultiprocessingSerializer


@dataclass
class StandinTensorMetadata:
    """SGLang's ``FlattenedTensorMetadata`` fields, for ``standin_bucket_classes``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class StandinTensorBucket:
    def __init__(self, flattened_tensor, metadata):
        self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return reconstruct_tensors(self.flattened_tensor, self.metadata)


class StandinSerializer:
    """What SGLang's ``MultiprocessingSerializer.serialize`` does: torch's ``ForkingPickler``
    (CUDA tensors become IPC handles), then base64."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions
        from multiprocessing.reduction import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode() if output_str else data


def standin_bucket_classes():
    """Classes of SGLang's payload format for machines without SGLang (``bench.gpu``): a
    flattened uint8 tensor with (name, shape, dtype, start_idx, end_idx, numel) metadata,
    pickled as SGLang does. An engine cannot unpickle these (other class names): measurement
    only."""
    return StandinTensorBucket, StandinTensorMetadata, StandinSerializer


class CudaIpcExporter:
    """Builds SGLang payloads for one bucket of a lease at a time and keeps their GPU copies
    alive until the engine has applied them.

    ``payload(lease, i, ...)`` copies bucket i to each engine GPU; ``free(lease, indices)``
    (the relay calls it for the buckets the engine has applied) and ``release(lease)`` give the
    copies back to the driver (``torch.cuda.ipc_collect`` for blocks the engine held through
    IPC, then ``empty_cache``). The relay's ``/bucket`` never lets a lease hold more than two.
    """

    def __init__(self, classes=None, require_cuda: bool = True):
        """``classes``: (bucket, metadata, serializer) classes, SGLang's by default;
        ``require_cuda=False`` lets ``bench.gpu --cpu-rehearsal`` run the same logic on CPU."""
        if require_cuda and not torch.cuda.is_available():
            raise RuntimeError("LMC-E506: CUDA IPC serving needs a GPU; CPU machines pull "
                               "shared-memory handles")
        self.require_cuda = require_cuda
        self._classes = classes
        self._alive: Dict[str, Dict[int, List[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.peak_buckets_held = 0  # the most buckets one lease ever held at once

    def check_devices(self, devices: Sequence[str]) -> List[torch.device]:
        if not devices:
            raise ValueError("CUDA IPC payloads need the engine's GPUs (one device per TP rank)")
        targets = [torch.device(d) for d in devices]
        for d in targets:
            if d.type == "cpu" and not self.require_cuda:
                continue
            if d.type != "cuda" or (d.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"device {d} is not a GPU of this machine "
                                 f"({torch.cuda.device_count()} visible)")
        return targets

    def payload(self, lease_id: str, index: int, named: Dict[str, torch.Tensor],
                devices: Sequence[str]) -> List[str]:
        """Bucket ``index`` of a lease: one serialized payload per engine TP rank
        (``devices[r]`` is rank r's GPU)."""
        targets = self.check_devices(devices)
        if self._classes is None:
            self._classes = _sglang_bucket_classes()
        metadata, total = ipc_layout(named, self._classes[1])  # 16-byte starts, explicit ends

        def fill(flat: torch.Tensor) -> None:
            # One allocation of the bucket's size per GPU, filled in place (building it with
            # SGLang's torch.cat would hold the bucket twice while it is made). Padding bytes
            # are zeroed so that a payload's bytes never depend on stale GPU memory.
            end = 0
            for meta, t in zip(metadata, named.values()):
                if meta.start_idx > end:
                    flat[end:meta.start_idx].zero_()
                flat[meta.start_idx:meta.end_idx].view(t.dtype).view(t.shape).copy_(
                    t.detach(), non_blocking=True)
                end = meta.end_idx

        return self._flat_payloads(lease_id, index, targets, total, metadata, fill)

    def _flat_payloads(self, lease_id: str, index: int, targets, total: int, metadata,
                       fill) -> List[str]:
        """One flattened bucket of ``total`` bytes per GPU of ``targets``, ``fill``-ed in place,
        serialized as SGLang's payload with ``metadata`` and kept until the engine applied it."""
        bucket_cls, _, serializer = self._classes
        keep, per_rank = [], []
        for device in targets:
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            fill(flat)
            bucket = bucket_cls(flattened_tensor=flat, metadata=metadata)
            keep.append(flat)
            per_rank.append(serializer.serialize(
                {"flattened_tensor": flat, "metadata": bucket.get_metadata()}, output_str=True))
        self._keep(lease_id, index, keep, targets)
        return per_rank

    def payload_stored(self, lease_id: str, index: int, buffer: torch.Tensor, metas,
                       devices: Sequence[str]) -> List[str]:
        """Bucket ``index`` of a lease straight from the relay's stored bucket (``buffer``, its
        ``weights.bucket.TensorMeta`` list): one host-to-device copy of the whole bucket per
        engine GPU instead of one per tensor, the payload's metadata the stored offsets (64-byte
        starts: multiples of ``IPC_ALIGN``; SGLang reads ``start_idx``/``end_idx`` as given).
        A bucket of slices, or with an offset SGLang could not view, is served tensor by tensor
        (``payload``). The bytes between tensors are the stored bucket's (SGLang never reads
        them), not zeroes as ``payload`` writes."""
        from ...weights.bucket import dtype_from_name, read_bucket

        if any(m.offset % IPC_ALIGN or m.full_shape is not None for m in metas):
            return self.payload(lease_id, index, read_bucket(buffer, metas), devices)
        targets = self.check_devices(devices)
        if self._classes is None:
            self._classes = _sglang_bucket_classes()
        meta_cls = self._classes[1]
        metadata = [meta_cls(name=m.name, shape=torch.Size(m.shape),
                             dtype=dtype_from_name(m.dtype), start_idx=m.offset,
                             end_idx=m.offset + m.nbytes, numel=m.nbytes) for m in metas]
        end = max((m.offset + m.nbytes for m in metas), default=0)
        # one copy of the stored bytes, the gaps between tensors too
        return self._flat_payloads(lease_id, index, targets, end, metadata,
                                   lambda flat: flat.copy_(buffer[:end], non_blocking=True))

    def payload_shard(self, lease_id: str, index: int, plan, devices: Sequence[str]) -> List[str]:
        """Group ``index`` of a shard pull (``relay.shard_pulls.ShardPlan``): rank r's own
        parameters cut straight onto ``devices[r]`` (only its slices cross the bus), serialized
        as SGLang's ``load_format="direct"`` payload -- a list of (name, tensor), the tensors
        views of one allocation per GPU (``weight_updater._model_load_weights_direct``)."""
        from ...weights.bucket import read_bucket

        targets = self.check_devices(devices)
        if len(targets) != plan.layout.tp:
            raise ValueError(f"{len(targets)} GPUs for an engine of TP {plan.layout.tp}: name one "
                             "device per TP rank")
        if self._classes is None:
            self._classes = _sglang_bucket_classes()
        serializer = self._classes[2]
        metas, total = plan.group_layout(index)
        keep, views = [], []
        for rank, device in enumerate(targets):  # every rank filled before any is shared
            keep.append(torch.zeros(total, dtype=torch.uint8, device=device))
            views.append(read_bucket(keep[-1], metas))
            plan.fill(index, rank, views[-1])
        per_rank = [serializer.serialize([(m.name, v[m.name]) for m in metas], output_str=True)
                    for v in views]
        self._keep(lease_id, index, keep, targets)
        return per_rank

    def _keep(self, lease_id: str, index: int, keep: List[torch.Tensor], targets) -> None:
        for device in targets:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        with self._lock:
            held = self._alive.setdefault(lease_id, {})
            held[index] = keep
            self.peak_buckets_held = max(self.peak_buckets_held, len(held))

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
        if drop and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # blocks the engine's IPC handles no longer reference
            torch.cuda.empty_cache()

    def release(self, lease_id: str) -> None:
        self.free(lease_id)


# ---------------------------------------------------------------------- the transport
def enabled(relay_cfg) -> bool:
    return False  # the exporter (and its CUDA context) starts when a GPU engine first pulls


def spec_for(rollout_cfg, weight_sync, devices):
    """An SGLang engine's GPUs (``devices``), one per TP rank, in rank order."""
    from . import PullSpec

    return PullSpec("sglang_cuda_ipc", tuple(devices))


class Exporter(_Exporter):
    """The relay side: a lease names the engine's GPUs (``devices``, one per TP rank)."""

    shards = True

    def __init__(self, relay_cfg=None):
        self._ipc: Optional[CudaIpcExporter] = None

    @property
    def ipc(self) -> CudaIpcExporter:
        if self._ipc is None:  # needs a GPU: a bad request is refused first, also on CPU
            self._ipc = CudaIpcExporter()
        return self._ipc

    def check(self, body: dict) -> List[str]:
        devices = body.get("devices", [body["device"]] if "device" in body else ["cuda:0"])
        if not isinstance(devices, list) or not devices or \
                not all(isinstance(d, str) for d in devices):
            raise ValueError("devices must be a non-empty list of GPU names, one per engine TP "
                             "rank (e.g. [\"cuda:0\"])")
        self.ipc.check_devices(devices)
        return devices

    def serve(self, lease_id, index, bucket, devices):
        return self.ipc.payload_stored(lease_id, index, bucket.shm.buffer, bucket.metas,
                                       devices)

    def copies(self, devices):
        return len(devices)  # the bucket on every GPU of the engine

    def check_shard(self, devices, tp):
        if len(devices) != tp:
            raise ValueError(f"LMC-E519: {len(devices)} GPUs for an engine of TP {tp}: name one "
                             "device per TP rank")

    def serve_shard(self, lease_id, index, plan, devices):
        return self.ipc.payload_shard(lease_id, index, plan, devices)

    def free(self, lease_id, indices):
        if self._ipc is not None:
            self._ipc.free(lease_id, indices)

    def release(self, lease_id):
        if self._ipc is not None:
            self._ipc.release(lease_id)


__all__ = ["IPC_ALIGN", "CudaIpcExporter", "Exporter", "Puller", "enabled", "ipc_layout",
           "reconstruct_tensors", "spec_for", "standin_bucket_classes"]
