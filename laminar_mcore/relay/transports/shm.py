"""Shared-memory handles: the CPU engine on the relay's machine maps each bucket in place.

The CPU twin of the CUDA IPC transport: the same per-bucket protocol, so CPU runs exercise the
pull path GPU runs take."""

from __future__ import annotations

import threading
from typing import Dict, List

from ...weights.bucket import ShmBucket, encode_handle, read_bucket
from .base import Exporter as _Exporter
from .base import Puller


def enabled(relay_cfg) -> bool:
    return False  # nothing to start: a handle is made per request


def spec_for(rollout_cfg, weight_sync, devices):
    """A CPU engine of ``rollout.engine_tp`` ranks gets each whole bucket's handle once per
    rank (SGLang reads entry r on rank r; shared memory needs no copy per rank)."""
    from . import PullSpec

    ranks = int(getattr(rollout_cfg, "engine_tp", 1) or 1)
    return PullSpec("shm", options=(("ranks", ranks),) if ranks > 1 else ())


class Exporter(_Exporter):
    """Whole buckets are handed out in place; a shard pull's group is cut into one new
    shared-memory bucket per engine rank, kept until the engine has applied it."""

    shards = True

    def __init__(self, relay_cfg=None):
        self._alive: Dict[str, Dict[int, List[ShmBucket]]] = {}
        self._lock = threading.Lock()

    def serve(self, lease_id, index, bucket, params):
        return encode_handle(bucket.shm.handle(bucket.metas))

    def serve_shard(self, lease_id, index, plan, params):
        from ..tmpfs import reserve

        metas, nbytes = plan.group_layout(index)
        made: List[ShmBucket] = []
        try:
            for rank in range(plan.layout.tp):
                made.append(ShmBucket(nbytes, prefix="laminar-shard"))
                reserve(made[-1])  # a full /dev/shm: an error to this pull, never SIGBUS
                plan.fill(index, rank, read_bucket(made[-1].buffer, metas))
        except BaseException:
            for shm in made:
                shm.close()
            raise
        self.free(lease_id, [index])
        with self._lock:
            self._alive.setdefault(lease_id, {})[index] = made
        return [encode_handle(shm.handle(metas)) for shm in made]

    def free(self, lease_id, indices):
        with self._lock:
            held = self._alive.get(lease_id, {})
            gone = [held.pop(i) for i in list(held) if indices is None or i in indices]
            if indices is None:
                self._alive.pop(lease_id, None)
        for made in gone:
            for shm in made:
                shm.close()

    def release(self, lease_id):
        self.free(lease_id, None)

    def close(self):
        for lease_id in list(self._alive):
            self.release(lease_id)


__all__ = ["Exporter", "Puller", "enabled", "spec_for"]
