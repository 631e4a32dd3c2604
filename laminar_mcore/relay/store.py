"""A relay's versioned weight store in shared host memory.

Invariants (each tested):
  * pullers only ever see a *complete* version, and a lease pins exactly one version;
  * a buffer is never overwritten while a lease holds it (or a forwarder pushing it pins it): a
    new version is written into fresh buffers or into buffers of a retired version that nobody
    holds any more;
  * versions only increase: a version at or below the latest complete one is refused.

Buckets are keyed by (pipeline stage, index within the stage). Writers report progress in bytes
so that forwarders can stream a version down the chain while it is still arriving.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..weights.bucket import ShmBucket, TensorMeta

BucketKey = Tuple[int, int]


class VersionError(ValueError):
    """A version that is not newer than what the relay already has."""


class BusyError(VersionError):
    """The version is being received from another source right now."""


@dataclass
class StoredBucket:
    key: BucketKey
    shm: ShmBucket
    metas: List[TensorMeta]
    nbytes: int
    received: int = 0
    last_of_stage: bool = False


@dataclass
class StoredVersion:
    version: int
    num_stages: int
    buckets: Dict[BucketKey, StoredBucket] = field(default_factory=dict)
    order: List[BucketKey] = field(default_factory=list)  # arrival order (forwarding order)
    stages_done: set = field(default_factory=set)
    complete: bool = False
    failed: Optional[str] = None
    owner: Optional[str] = None
    leases: int = 0
    started: float = field(default_factory=time.time)
    finished: Optional[float] = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets.values())

    def ordered(self) -> List[StoredBucket]:
        """Buckets in (stage, index) order: the order pullers apply them in."""
        return [self.buckets[k] for k in sorted(self.buckets)]


class VersionStore:
    def __init__(self, lease_ttl_s: float = 600.0):
        self.cond = threading.Condition()
        self.latest: Optional[StoredVersion] = None
        self.receiving: Dict[int, StoredVersion] = {}
        self.retired: List[StoredVersion] = []
        self.leases: Dict[str, Tuple[StoredVersion, float]] = {}
        self.lease_ttl_s = lease_ttl_s
        self._pool: Dict[int, List[ShmBucket]] = {}
        self.versions_failed = 0  # broken while arriving (for /metrics)
        # called (under the lock: keep them short) with each version that becomes the newest
        self.on_complete: List[Callable[[int], None]] = []

    # ------------------------------------------------------------------ writers
    @property
    def latest_version(self) -> int:
        return self.latest.version if self.latest else -1

    def begin(self, version: int, num_stages: int, owner: Optional[str] = None) -> StoredVersion:
        """Start receiving ``version`` from ``owner`` (the same owner may call it again, e.g.
        one call per trainer stage; another owner is refused while it is being received)."""
        with self.cond:
            if version <= self.latest_version:
                raise VersionError(f"version {version} is not newer than {self.latest_version}")
            if version in self.receiving:
                current = self.receiving[version]
                if current.owner != owner:
                    raise BusyError(f"version {version} is being received from {current.owner}")
                return current
            sv = StoredVersion(version, num_stages, owner=owner)
            self.receiving[version] = sv
            self.cond.notify_all()
            return sv

    def add_bucket(self, sv: StoredVersion, key: BucketKey, nbytes: int,
                   metas: List[TensorMeta], last_of_stage: bool) -> StoredBucket:
        with self.cond:
            if key in sv.buckets:
                raise ValueError(f"bucket {key} of version {sv.version} arrived twice")
            pool = self._pool.get(nbytes)
            shm = pool.pop() if pool else ShmBucket(nbytes, prefix="laminar-relay")
            bucket = StoredBucket(key, shm, metas, nbytes, last_of_stage=last_of_stage)
            sv.buckets[key] = bucket
            sv.order.append(key)
            self.cond.notify_all()
            return bucket

    def progress(self, sv: StoredVersion, bucket: StoredBucket, received: int) -> None:
        with self.cond:
            bucket.received = received
            if received >= bucket.nbytes and bucket.last_of_stage:
                sv.stages_done.add(bucket.key[0])
            self.cond.notify_all()

    def try_complete(self, sv: StoredVersion) -> bool:
        """Promote ``sv`` when every stage's last bucket has fully arrived."""
        with self.cond:
            if sv.complete:
                return True
            if len(sv.stages_done) < sv.num_stages or any(
                    b.received < b.nbytes for b in sv.buckets.values()):
                return False
            if sv.version <= self.latest_version:  # a newer one won meanwhile
                self._drop(sv)
                return False
            sv.complete, sv.finished = True, time.time()
            self.receiving.pop(sv.version, None)
            if self.latest is not None:
                self.retired.append(self.latest)
            self.latest = sv
            for old in [v for v in self.receiving.values() if v.version < sv.version]:
                self._drop(old)
            self._recycle()
            self.cond.notify_all()
            for listener in self.on_complete:
                listener(sv.version)
            return True

    def fail(self, sv: StoredVersion, reason: str) -> None:
        with self.cond:
            if not sv.complete:
                self.versions_failed += sv.failed is None  # not one superseded meanwhile
                sv.failed = reason
                self._drop(sv)
                self.cond.notify_all()

    def _drop(self, sv: StoredVersion) -> None:
        self.receiving.pop(sv.version, None)
        sv.failed = sv.failed or "superseded"
        self.retired.append(sv)
        self._recycle()

    def _recycle(self) -> None:
        """Buffers of retired versions that no lease holds go back to the pool."""
        now = time.time()
        for lease_id, (sv, expires) in list(self.leases.items()):
            if expires < now:  # a puller that died: its lease lapses
                del self.leases[lease_id]
                sv.leases -= 1
        keep = []
        for sv in self.retired:
            if sv.leases > 0:
                keep.append(sv)
                continue
            for bucket in sv.buckets.values():
                self._pool.setdefault(bucket.nbytes, []).append(bucket.shm)
            sv.buckets = {}
        self.retired = keep

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the free buffers kept for reuse (read it under ``cond``)."""
        return sum(len(pool) * nbytes for nbytes, pool in self._pool.items())

    # ------------------------------------------------------------------ readers
    def lease_latest(self, min_version: int = -1, ttl_s: Optional[float] = None
                     ) -> Optional[Tuple[str, StoredVersion]]:
        with self.cond:
            self._recycle()
            if self.latest is None or self.latest.version < min_version:
                return None
            lease_id = uuid.uuid4().hex
            self.latest.leases += 1
            self.leases[lease_id] = (self.latest, time.time() + (ttl_s or self.lease_ttl_s))
            return lease_id, self.latest

    def pin(self, sv: StoredVersion) -> None:
        """Keep ``sv``'s buffers from being recycled (a forwarder pushing it down the chain
        while newer versions arrive) until ``unpin``."""
        with self.cond:
            sv.leases += 1

    def unpin(self, sv: StoredVersion) -> None:
        with self.cond:
            sv.leases -= 1
            self._recycle()

    def release(self, lease_id: str) -> bool:
        with self.cond:
            entry = self.leases.pop(lease_id, None)
            if entry is None:
                return False
            entry[0].leases -= 1
            self._recycle()
            return True

    def wait_for(self, predicate, timeout: Optional[float] = None) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout=timeout)

    def close(self) -> None:
        with self.cond:
            versions = [self.latest] if self.latest else []
            versions += list(self.receiving.values()) + self.retired
            for sv in versions:
                for bucket in sv.buckets.values():
                    bucket.shm.close()
            for pool in self._pool.values():
                for shm in pool:
                    shm.close()
            self._pool.clear()
