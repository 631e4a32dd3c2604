"""A relay's versioned weight store in shared host memory.

Invariants (each tested: tests/test_relay_store.py, tests/test_host_memory.py):
  * pullers only ever see a *complete* version, and a lease pins exactly one version;
  * a buffer is never overwritten while a lease holds it (or a forwarder pushing it pins it): a
    new version is written into fresh buffers or into buffers of a retired version that nobody
    holds any more;
  * versions only increase: a version at or below the latest complete one is refused;
  * with ``max_versions`` (``weight_sync.relay_versions``) at most that many versions hold
    buffers at once -- the newest complete one, those being received, retired ones still leased
    or pinned -- and the free buffers kept for reuse are trimmed so that all of them together
    stay within that many of the largest version's bytes. A new version that would be one too
    many *waits* in ``begin`` until a lease is released or lapses (its TTL) or a pin ends; a
    lease is never cut short, since its puller may still be reading the buffers. After
    ``full_wait_s`` it is refused with ``StoreFull`` (a ``BusyError``: a pushing relay tries
    again), and the same sender's later ``begin`` of that version is refused at once, so a
    stream that goes on sending it bucket by bucket (the trainer's) never starts a partial copy;
  * /dev/shm is a tmpfs: writing past its size kills the writer with SIGBUS. A fresh buffer is
    therefore allocated whole up front (``posix_fallocate``), and ``begin`` checks the free space
    for one more version once its size is known (``model_bytes``, or the last version's); both
    refuse with ``ShmFull``, naming the mount to enlarge, instead.

Buckets are keyed by (pipeline stage, index within the stage). Writers report progress in bytes
so that forwarders can stream a version down the chain while it is still arriving.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import within
from ..weights.bucket import ShmBucket, TensorMeta
from ..weights.shards import assemble, is_sharded, served_layout, whole_plan
from ..weights.delta import apply as apply_delta, digest as bucket_digest

BucketKey = Tuple[int, int]
logger = logging.getLogger(__name__)


# (BusyError, ShmFull, StoreFull, VersionError: the store's errors, imported from here)
from .tmpfs import BusyError, ShmFull, StoreFull, VersionError, reserve, shm_shortfall


@dataclass
class StoredBucket:
    key: BucketKey
    shm: ShmBucket
    metas: List[TensorMeta]
    nbytes: int
    received: int = 0
    last_of_stage: bool = False
    digest: Optional[str] = None  # digest of the full bytes (weights/delta.py), from the trainer
    delta: Optional[bytes] = None  # how it arrived, if as a delta (forwarded as such) ...
    base_version: Optional[int] = None  # ... against this version


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
    # published as per-rank shards (weights/shards.py): the whole tensors of each bucket an
    # engine pulls, made when the version completes (None: the stored buckets are served)
    whole: Optional[list] = None
    assembled: dict = field(default_factory=dict)  # served index -> its bucket, once made

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets.values())

    def ordered(self) -> List[StoredBucket]:
        """Buckets in (stage, index) order: the order pullers apply them in."""
        return [self.buckets[k] for k in sorted(self.buckets)]

    @property
    def held_bytes(self) -> int:
        """Its buffers' bytes: the stored buckets and any whole tensors assembled for pulls."""
        return self.nbytes + sum(b.nbytes for b in self.assembled.values())

    @property
    def num_served(self) -> int:
        """How many buckets a pull of this version gets."""
        return len(self.whole) if self.whole is not None else len(self.buckets)


class VersionStore:
    def __init__(self, lease_ttl_s: float = 600.0, max_versions: Optional[int] = None,
                 model_bytes: int = 0, full_wait_s: float = 30.0):
        """``max_versions``: how many versions may hold buffers at once (None: no bound; a
        relay passes ``weight_sync.relay_versions``); ``model_bytes``: one version's size if
        known beforehand (0: learnt from the first complete version); ``full_wait_s``: how long
        ``begin`` waits for a lease or pin to end when ``max_versions`` are held."""
        if max_versions is not None and max_versions < 2:
            raise ValueError(f"LMC-E103: weight_sync.relay_versions={max_versions} must be >= 2: a "
                             "relay "
                             "keeps the newest complete version for pulls while it receives "
                             "the next")
        self.cond = threading.Condition()
        self.latest: Optional[StoredVersion] = None
        self.receiving: Dict[int, StoredVersion] = {}
        self.retired: List[StoredVersion] = []
        self.leases: Dict[str, Tuple[StoredVersion, float]] = {}
        self.lease_ttl_s = lease_ttl_s
        self.max_versions = max_versions
        self.version_bytes = int(model_bytes)  # the largest version's bytes (once known)
        self.full_wait_s = full_wait_s
        self._refused: Dict[Tuple[int, Optional[str]], VersionError] = {}  # (version, owner)
        self._pool: Dict[int, List[ShmBucket]] = {}
        self._assembly = threading.Lock()  # served(): one assembly at a time
        self.versions_failed = 0  # broken while arriving (for /metrics)
        # called (under the lock: keep them short) with each version that becomes the newest
        self.on_complete: List[Callable[[int], None]] = []

    # ------------------------------------------------------------------ writers
    @property
    def latest_version(self) -> int:
        return self.latest.version if self.latest else -1

    def begin(self, version: int, num_stages: int, owner: Optional[str] = None,
              wait_s: Optional[float] = None) -> StoredVersion:
        """Start receiving ``version`` from ``owner`` (the same owner may call it again, e.g.
        one call per trainer stage; another owner is refused while it is being received).
        With ``max_versions`` held, waits up to ``wait_s`` (default ``full_wait_s``) for one
        to be let go, then raises ``StoreFull``; ``ShmFull`` when /dev/shm has no room."""
        wait_s = self.full_wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if version <= self.latest_version:
                    raise VersionError(f"LMC-E502: version {version} is not newer than "
                                       f"{self.latest_version}")
                if version in self.receiving:
                    current = self.receiving[version]
                    if current.owner != owner:
                        raise BusyError(f"LMC-E502: version {version} is being received from "
                                        f"{current.owner}")
                    return current
                refused = self._refused.get((version, owner))
                if refused is not None:
                    raise type(refused)(str(refused))
                self._recycle()  # leases that lapsed let their versions go
                if not self._full():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._refuse(version, owner, StoreFull(
                        f"LMC-E501: version {version} refused: weight_sync.relay_versions="
                        f"{self.max_versions} versions hold this relay's buffers ("
                        f"{self._holders()}) and no lease or pin ended within "
                        f"{wait_s:g} s; a newer version will be taken (raise "
                        "weight_sync.relay_versions, with its host memory, to let slow pulls "
                        "hold on without delaying versions)"))
                # woken by a release, an unpin or a completion; at least every second, so a
                # lease that lapses lets its version go
                self.cond.wait(min(remaining, 1.0))
            need = self.version_bytes - self.pooled_bytes
            short = need > 0 and shm_shortfall(need, f"version {version} needs")
            if short:
                self._refuse(version, owner,
                             ShmFull(within(f"version {version} refused", short, "LMC-E500")))
            sv = StoredVersion(version, num_stages, owner=owner)
            self.receiving[version] = sv
            self.cond.notify_all()
            return sv

    def _holders(self) -> str:
        """Which versions hold buffers, and why (for messages)."""
        def why(v: StoredVersion) -> str:
            if v is self.latest:
                return "newest"
            return "arriving" if v.version in self.receiving else "leased or pinned"

        return ", ".join(f"{v.version} ({why(v)})" for v in self._holding())

    def _full(self) -> bool:
        return self.max_versions is not None and len(self._holding()) >= self.max_versions

    def _refuse(self, version: int, owner: Optional[str], exc: VersionError) -> None:
        """Refuse ``version`` from ``owner``, now and on its later ``begin`` calls."""
        self._refused[(version, owner)] = exc
        logger.error("%s", exc)
        raise exc

    def add_bucket(self, sv: StoredVersion, key: BucketKey, nbytes: int,
                   metas: List[TensorMeta], last_of_stage: bool, digest: Optional[str] = None,
                   delta: Optional[bytes] = None,
                   base_version: Optional[int] = None) -> StoredBucket:
        with self.cond:
            if key in sv.buckets:
                raise ValueError(f"bucket {key} of version {sv.version} arrived twice")
            if sv.failed:  # superseded or broken meanwhile: its buffers may be reused already
                raise VersionError(f"LMC-E502: version {sv.version} is no longer received "
                                   f"({sv.failed})")
            pool = self._pool.get(nbytes)
            shm = pool.pop() if pool else None
            if shm is None:
                self._trim_pool(nbytes)
        if shm is None:  # outside the lock: allocating touches every page
            shm = ShmBucket(nbytes, prefix="laminar-relay")
            try:
                reserve(shm)
            except ShmFull as exc:
                # the whole version is refused, as at ``begin``: its other buckets are drained
                # by the receiver, and its buffers go back for the next one
                refused = ShmFull(within(f"version {sv.version} refused", exc, "LMC-E500"))
                with self.cond:
                    self._refused[(sv.version, sv.owner)] = refused
                    if not sv.complete:
                        self.versions_failed += sv.failed is None
                        sv.failed = str(refused)
                        self._drop(sv)
                    self.cond.notify_all()
                logger.error("%s", refused)
                raise refused from None
        with self.cond:
            if key in sv.buckets or sv.failed:
                self._pool.setdefault(nbytes, []).append(shm)
                if sv.failed:
                    raise VersionError(f"LMC-E502: version {sv.version} is no longer "
                                       f"received ({sv.failed})")
                raise ValueError(f"bucket {key} of version {sv.version} arrived twice")
            bucket = StoredBucket(key, shm, metas, nbytes, last_of_stage=last_of_stage,
                                  digest=digest, delta=delta, base_version=base_version)
            sv.buckets[key] = bucket
            sv.order.append(key)
            self.cond.notify_all()
            return bucket

    def _base(self, version: int, stage: int) -> Optional[StoredVersion]:
        """``version`` if it can be the base of ``stage``'s deltas: the newest complete one, or
        one still arriving whose ``stage`` part is complete (another pipeline stage may still
        be sending it when this one moves on to the next version). Call under ``cond``."""
        if self.latest is not None and self.latest.version == version:
            return self.latest
        sv = self.receiving.get(version)
        if sv is not None and not sv.failed and stage in sv.stages_done and all(
                b.received >= b.nbytes for k, b in sv.buckets.items() if k[0] == stage):
            return sv
        return None

    def holds(self, version: int, stage: int) -> bool:
        """Whether a delta of ``stage``'s buckets against ``version`` can be rebuilt here."""
        with self.cond:
            base = self._base(version, stage)
            return base is not None and any(k[0] == stage for k in base.buckets)

    def rebuild(self, sv: StoredVersion, bucket: StoredBucket) -> bool:
        """Fill ``bucket`` (added with its ``delta``, ``base_version`` and ``digest``) from the
        same bucket of the base version (``_base``: the newest complete one here, or one whose
        pipeline stage has fully arrived), and mark it received. False -- nothing marked --
        when the base is not held, its bucket has another layout, the delta is malformed or
        the result's digest differs: the caller gets the bucket whole instead."""
        with self.cond:
            base = self._base(bucket.base_version, bucket.key[0]) \
                if bucket.base_version is not None else None
            held = base.buckets.get(bucket.key) if base is not None else None
            if held is None or held.nbytes != bucket.nbytes or held.metas != bucket.metas:
                return False
            base.leases += 1  # pinned: its buffer is read outside the lock
        try:
            bucket.shm.buffer.copy_(held.shm.buffer)
            apply_delta(bucket.delta, bucket.shm.buffer)
            ok = bucket.digest is not None and bucket_digest(bucket.shm.buffer) == bucket.digest
        except Exception as exc:  # noqa: BLE001 - any failure: the bucket is fetched whole
            logger.warning("bucket %s of version %d: %s", bucket.key, sv.version, exc)
            ok = False
        finally:
            self.unpin(base)
        if ok:
            self.progress(sv, bucket, bucket.nbytes)
        else:
            logger.warning("bucket %s of version %d did not rebuild from version %s; fetching it "
                           "whole", bucket.key, sv.version, bucket.base_version)
        return ok

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
            if sv.failed:
                return False
            if len(sv.stages_done) < sv.num_stages or any(
                    b.received < b.nbytes for b in sv.buckets.values()):
                return False
            if sv.version <= self.latest_version:  # a newer one won meanwhile
                self._drop(sv)
                return False
            metas = [b.metas for b in sv.ordered()]
            try:  # per-rank shards: engines pull whole tensors, put together from them
                sv.whole = whole_plan(metas) if is_sharded(metas) else None
            except ValueError as exc:
                logger.error("version %d: %s", sv.version, exc)
                self.versions_failed, sv.failed = self.versions_failed + 1, str(exc)
                self._drop(sv)
                self.cond.notify_all()
                return False
            sv.complete, sv.finished = True, time.time()
            # (per-rank shards: a relay also holds the whole tensors it assembles for pulls)
            self.version_bytes = max(self.version_bytes, sv.nbytes * (1 + (sv.whole is not None)))
            self._refused = {k: why for k, why in self._refused.items() if k[0] > sv.version}
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
        if self.receiving.get(sv.version) is sv:
            del self.receiving[sv.version]
        sv.failed = sv.failed or "superseded"
        if not any(v is sv for v in self.retired):  # (failed twice: listed once)
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
            for made in sv.assembled.values():  # (pulls of per-rank shards): kept for reuse, at
                self._pool.setdefault(made.nbytes, []).append(made.shm)  # the same addresses
            sv.assembled = {}
        self.retired = keep

    def _trim_pool(self, nbytes: int) -> None:
        """Before a fresh ``nbytes`` buffer: close free buffers (of other sizes) while all the
        buffers would exceed ``max_versions`` of the largest version."""
        if self.max_versions is None or not self.version_bytes:
            return
        budget = self.max_versions * self.version_bytes
        held = self.held_bytes
        for size in sorted(self._pool, reverse=True):
            pool = self._pool[size]
            while pool and held + nbytes > budget:
                pool.pop().close()
                held -= size
        self._pool = {size: pool for size, pool in self._pool.items() if pool}

    def _holding(self) -> List[StoredVersion]:
        """The versions holding buffers."""
        return (([self.latest] if self.latest else []) + list(self.receiving.values())
                + [v for v in self.retired if v.buckets])

    @property
    def held_bytes(self) -> int:
        """Bytes of every buffer the store holds, free ones included (read it under ``cond``)."""
        return self.pooled_bytes + sum(sv.held_bytes for sv in self._holding())

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the free buffers kept for reuse (read it under ``cond``)."""
        return sum(len(pool) * nbytes for nbytes, pool in self._pool.items())

    # ------------------------------------------------------------------ readers
    def served(self, sv: StoredVersion, index: int) -> StoredBucket:
        """Bucket ``index`` of what a pull of ``sv`` gets: a stored bucket, or for per-rank
        shards (``sv.whole``) the whole tensors put together from them (weights/shards.py)
        once per version, one at a time (pulls of the same bucket wait for the first), in a
        pooled buffer (stable addresses for registered transports), ``sv`` pinned meanwhile;
        freed with ``sv``'s buffers, so valid as long as the lease."""
        if sv.whole is None:
            return sv.ordered()[index]
        with self._assembly:
            with self.cond:
                made = sv.assembled.get(index)
                if made is not None:
                    return made
                if not sv.buckets:
                    raise VersionError(f"LMC-E502: version {sv.version} is no longer held here")
                sv.leases += 1
                sources = [b.shm.buffer for b in sv.ordered()]
                metas, nbytes = served_layout(sv.whole[index])
                pool = self._pool.get(max(nbytes, 1))
                shm = pool.pop() if pool else None
            try:
                if shm is None:
                    shm = ShmBucket(nbytes, prefix="laminar-whole")
                    reserve(shm)  # a full /dev/shm: LMC-E500 to this pull, never SIGBUS
                assemble(sv.whole[index], sources, shm.buffer)
                made = StoredBucket((-1, index), shm, metas, shm.nbytes, received=shm.nbytes)
                with self.cond:
                    sv.assembled[index] = made
                return made
            except BaseException:
                if shm is not None and shm.buffer is not None:
                    with self.cond:
                        self._pool.setdefault(shm.nbytes, []).append(shm)
                raise
            finally:
                self.unpin(sv)

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
            self.cond.notify_all()  # a begin may be waiting for room

    def release(self, lease_id: str) -> bool:
        with self.cond:
            entry = self.leases.pop(lease_id, None)
            if entry is None:
                return False
            entry[0].leases -= 1
            self._recycle()
            self.cond.notify_all()  # a begin may be waiting for room
            return True

    def wait_for(self, predicate, timeout: Optional[float] = None) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout=timeout)

    def close(self) -> None:
        with self.cond:
            versions = [self.latest] if self.latest else []
            versions += list(self.receiving.values()) + self.retired
            for sv in versions:
                for bucket in list(sv.buckets.values()) + list(sv.assembled.values()):
                    bucket.shm.close()
            for pool in self._pool.values():
                for shm in pool:
                    shm.close()
            self._pool.clear()
