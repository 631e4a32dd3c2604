"""Cross-node pulls through Mooncake's transfer engine: RDMA on clusters, TCP on CPU machines.

A relay started with ``--mooncake-protocol rdma|tcp`` registers its version buffers (the same
shared-memory buckets that local engines map) with a Mooncake ``TransferEngine`` and answers
``/pull`` with ``format="mooncake"``: per bucket, the relay's transfer-engine session, the
buffer's address and size and the tensor layout. A puller on another machine reads each bucket
straight out of the relay's memory into a local shared-memory bucket with one-sided reads
(``transfer_sync_read``), then releases the lease: the relay's CPU does no copying, and the
lease keeps the remote buffers from being reused while they are read.

The transport's engine side (``Puller``, ``PullSpec("mooncake")``) leases remotely, reads,
releases, and hands the local buckets to the engine in one weight-update session
(``relay.client.apply_version``). It runs where the engine is: the engine maps the local
buckets, so an engine on a node without a relay of its own takes weights from a relay on
another machine (``rollout.relay: remote`` on a cluster; see README).

Mooncake is optional: ``pip install mooncake-transfer-engine`` on GPU clusters (RDMA), or
``mooncake-transfer-engine-non-cuda`` on CPU machines, which also needs the system's
``libibverbs1`` even for TCP (``make test`` installs both where it can).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from ...weights.bucket import (ShmBucket, TensorMeta, checked_metas, decode_handle,
                               encode_handle)
from ..client import apply_version
from .base import Exporter as _Exporter
from .base import Puller as _Puller
from .base import TransportUnavailable

logger = logging.getLogger(__name__)
PROTOCOLS = ("tcp", "rdma")
# Mooncake writes its own glog lines to stderr; keep warnings and errors only.
os.environ.setdefault("GLOG_minloglevel", "1")


class MooncakeUnavailable(TransportUnavailable):
    """Mooncake's transfer engine cannot be imported or started on this machine."""


def transfer_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the package, or libibverbs.so.1 that its module links
        raise MooncakeUnavailable(
            f"LMC-E506: Mooncake's transfer engine is not usable here ({exc}). Install it with "
            "`pip install mooncake-transfer-engine` (GPU/RDMA clusters) or "
            "`pip install mooncake-transfer-engine-non-cuda` (CPU machines, TCP), plus the "
            "system package libibverbs1 (`apt-get install libibverbs1`).") from None
    return TransferEngine


def available() -> bool:
    try:
        transfer_engine_class()
    except MooncakeUnavailable:
        return False
    return True


def start_engine(host: str, protocol: str, device_name: str = ""):
    """A transfer engine on ``host`` that peers reach by its P2P handshake port (no metadata
    server). Returns (engine, session id "host:port")."""
    if protocol not in PROTOCOLS:
        raise ValueError("LMC-E102: "
                         f"Mooncake protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    engine = transfer_engine_class()()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise MooncakeUnavailable(f"LMC-E506: Mooncake transfer engine failed to start on {host} "
                                  f"with protocol {protocol!r} (code {rc}); for rdma, name the NIC "
                                  "with --mooncake-device (e.g. mlx5_0)")
    return engine, f"{host}:{engine.get_rpc_port()}"


class MooncakeExporter:
    """Relay side: registers version buffers once (the store reuses them) and describes them."""

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = ""):
        self.engine, self.session = start_engine(host, protocol, device_name)
        self.protocol = protocol
        self._registered: Dict[int, int] = {}
        self._lock = threading.Lock()

    def _register(self, addr: int, nbytes: int) -> None:
        with self._lock:
            if self._registered.get(addr) == nbytes:
                return
            if addr in self._registered:
                self.engine.unregister_memory(addr)
            rc = self.engine.register_memory(addr, nbytes)
            if rc != 0:
                raise RuntimeError("LMC-E507: "
                                   f"Mooncake could not register {nbytes} bytes (code {rc})")
            self._registered[addr] = nbytes

    def handles(self, buckets: Sequence[Tuple[ShmBucket, List[TensorMeta]]]) -> List[str]:
        out = []
        for shm, metas in buckets:
            addr = shm.buffer.data_ptr()
            self._register(addr, shm.nbytes)
            handle = shm.handle(metas)
            handle.pop("path")
            handle.update(kind="mooncake", session=self.session, addr=addr,
                          protocol=self.protocol)
            out.append(encode_handle(handle))
        return out

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                with contextlib.suppress(Exception):
                    self.engine.unregister_memory(addr)
            self._registered.clear()


def decode_remote_handle(data: str) -> dict:
    handle = decode_handle(data, kind="mooncake")
    for key in ("session", "addr", "nbytes", "tensors"):
        if key not in handle:
            raise ValueError(f"Mooncake handle lacks {key!r}")
    return handle


class MooncakeReader:
    """Puller side: reads leased buckets out of a remote relay's memory into local shared
    memory (the buckets a local engine maps). Local buckets are registered once and reused
    (``give_back``), so steady-state pulls neither allocate nor fault pages; ``close`` frees them."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        self.engine, self.session = start_engine(host, protocol, device_name)
        self._pool: Dict[int, List[ShmBucket]] = {}
        self._owned: Dict[str, ShmBucket] = {}
        self._lock = threading.Lock()

    def _local(self, nbytes: int) -> ShmBucket:
        with self._lock:
            pool = self._pool.get(nbytes)
            if pool:
                return pool.pop()
        local = ShmBucket(nbytes, prefix="laminar-pull")
        local.buffer.zero_()  # fault the pages in once, not during every read
        if self.engine.register_memory(local.buffer.data_ptr(), local.nbytes) != 0:
            local.close()
            raise RuntimeError("LMC-E507: "
                               f"Mooncake could not register a {nbytes}-byte local buffer")
        with self._lock:
            self._owned[local.path] = local
        return local

    def give_back(self, local: ShmBucket) -> None:
        """Return a bucket from ``read`` for reuse (after the engine has applied it)."""
        with self._lock:
            if local.path in self._owned:
                self._pool.setdefault(local.nbytes, []).append(local)

    def read(self, data: str) -> Tuple[ShmBucket, List[TensorMeta]]:
        handle = decode_remote_handle(data)
        nbytes = int(handle["nbytes"])
        metas = checked_metas(handle["tensors"], nbytes)
        local = self._local(nbytes)
        rc = self.engine.transfer_sync_read(handle["session"], local.buffer.data_ptr(),
                                            int(handle["addr"]), nbytes)
        if rc < 0:
            self.give_back(local)
            raise RuntimeError("LMC-E507: "
                               f"Mooncake read of {nbytes} bytes from {handle['session']} "
                               f"failed (code {rc}): is the relay reachable and its lease alive?")
        return local, metas

    def close(self) -> None:
        with self._lock:
            owned, self._owned, self._pool = list(self._owned.values()), {}, {}
        for local in owned:
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(local.buffer.data_ptr())
            local.close()

    def __enter__(self) -> "MooncakeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def pull_remote_into_engine(relay, engine, current_version: int,
                                  reader: MooncakeReader) -> Optional[int]:
    """``pull_latest_into_engine`` for a relay on another machine: lease the
    newest version with ``format="mooncake"``, read every bucket into local shared memory,
    release the remote lease, then apply the local buckets to ``engine`` (a CPU engine, or any
    engine that maps shared-memory handles). Returns the new version, or None."""
    lease = await relay.lease(min_version=current_version + 1, fmt="mooncake")
    if lease is None:
        return None
    local: List[Tuple[ShmBucket, List[TensorMeta]]] = []
    try:
        try:
            for data in await relay.buckets(lease):
                local.append(await asyncio.to_thread(reader.read, data))
        finally:
            await relay.release(lease)
        await apply_version(engine, [[encode_handle(shm.handle(metas))] for shm, metas in local],
                            lease.version)
    finally:
        for shm, _ in local:
            reader.give_back(shm)
    return lease.version


# ---------------------------------------------------------------------- the transport
def enabled(relay_cfg) -> bool:
    """A relay with ``weight_sync.mooncake_protocol`` registers its buffers from the start."""
    return bool(relay_cfg.weight_sync.mooncake_protocol)


def spec_for(rollout_cfg, weight_sync, devices):
    """Read on the engine's machine (``rollout.host``) with the run's Mooncake settings."""
    from . import PullSpec

    return PullSpec("mooncake", options=(("host", rollout_cfg.host),
                                         ("protocol", weight_sync.mooncake_protocol or "tcp"),
                                         ("device", weight_sync.mooncake_device)))


class Exporter(_Exporter):
    def __init__(self, relay_cfg):
        ws = relay_cfg.weight_sync
        if not ws.mooncake_protocol:
            raise TransportUnavailable("LMC-E506: this relay does not serve Mooncake pulls: "
                                       "start it with --mooncake-protocol tcp|rdma "
                                       "(weight_sync.mooncake_protocol)")
        self.exporter = MooncakeExporter(relay_cfg.host, ws.mooncake_protocol,
                                         ws.mooncake_device)

    def serve(self, lease_id, index, bucket, params):
        return self.exporter.handles([(bucket.shm, bucket.metas)])[0]

    def info(self):
        return {"session": self.exporter.session, "protocol": self.exporter.protocol}

    def close(self):
        self.exporter.close()


class Puller(_Puller):
    """Options: ``host`` (this machine's address for the transfer engine), ``protocol``
    (tcp | rdma), ``device`` (RDMA NIC). The transfer engine starts on the first pull."""

    def __init__(self, spec):
        super().__init__(spec)
        self.reader: Optional[MooncakeReader] = None

    async def pull(self, relay, engine, current_version: int) -> Optional[int]:
        if self.reader is None:
            self.reader = await asyncio.to_thread(
                MooncakeReader, str(self.spec.option("host", "127.0.0.1")),
                str(self.spec.option("protocol", "tcp")), str(self.spec.option("device", "")))
        return await pull_remote_into_engine(relay, engine, current_version, self.reader)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
