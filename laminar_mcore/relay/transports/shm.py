"""Shared-memory handles: the CPU engine on the relay's machine maps each bucket in place.

The CPU twin of the CUDA IPC transport: the same per-bucket protocol, so CPU runs exercise the
pull path GPU runs take."""

from __future__ import annotations

from ...weights.bucket import encode_handle
from .base import Exporter as _Exporter
from .base import Puller


def enabled(relay_cfg) -> bool:
    return False  # nothing to start: a handle is made per request


def spec_for(rollout_cfg, weight_sync, devices):
    from . import PullSpec

    return PullSpec("shm")


class Exporter(_Exporter):
    def __init__(self, relay_cfg=None):
        pass

    def serve(self, lease_id, index, bucket, params):
        return encode_handle(bucket.shm.handle(bucket.metas))


__all__ = ["Exporter", "Puller", "enabled", "spec_for"]
