"""A relay's pull service: ``/pull`` leases the newest complete version, ``/bucket`` serves its
flattened buckets one at a time in the lease's transport format, ``/release`` and
``/release_holder`` give leases back. Owns the per-lease state (``PullState``), the relay
halves of the weight transports (``relay/transports`` exporters: started with the relay when
the config enables them, else on their first ``/pull``) and the bound on what an engine may
hold at once: ``MAX_BUCKETS_OUTSTANDING`` buckets served and not yet applied.

Mixed into ``RelayServer`` (relay/server.py), which provides ``cfg``, ``store`` and ``metrics``
and calls ``_init_pulls`` and ``_add_pull_routes``; it closes the exporters at shutdown. It
never writes a version (the store's buffers are read through leases only), never touches the
chain, and imports no engine code: an exporter hands out handles, the engine's puller applies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from aiohttp import web

from ..errors import split
from ..netutil import error_response, read_json
from .requests import BUCKET, PULL, RELEASE, RELEASE_HOLDER
from .shard_pulls import ShardPlan
from .transports import (TRANSPORTS, Exporter, TransportUnavailable, enabled_at_start,
                         make_exporter)

logger = logging.getLogger("laminar_mcore.relay")

MAX_BUCKETS_OUTSTANDING = 2


@dataclass
class PullState:
    """One lease's per-bucket pull: its transport, what the transport's ``check`` returned for
    it (CUDA IPC: the engine's GPUs), the buckets served and not yet applied, and the most ever
    outstanding at once."""

    fmt: str
    params: Any
    holder: str = ""  # the address the lease was taken from
    outstanding: set = field(default_factory=set)
    applied: set = field(default_factory=set)
    peak: int = 0
    # bytes served: what the engine pulled, every serve of a bucket counted (a CUDA IPC bucket
    # once per engine GPU it is copied to; a shard group, each rank's part)
    nbytes: int = 0
    shard: Any = None  # a ShardPlan: each engine rank's own parameters (relay/shard_pulls.py)
    started: float = field(default_factory=time.monotonic)


class PullService:
    """The pull endpoints of ``RelayServer`` (see the module docstring)."""

    def _init_pulls(self, cfg) -> None:
        self.pulls: Dict[str, PullState] = {}  # lease id -> how its buckets are being served
        # the weight transports' relay halves; those a config enables start now (Mooncake
        # registers its buffers), the others on their first /pull
        self.exporters: Dict[str, Exporter] = {}
        for name in enabled_at_start(cfg):
            self.exporters[name] = make_exporter(name, cfg)

    def _add_pull_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/pull", self.pull)
        router.add_post("/bucket", self.bucket)
        router.add_post("/release", self.release)
        router.add_post("/release_holder", self.release_holder)

    async def pull(self, request):
        """Lease the newest complete version; its buckets are then fetched one at a time with
        ``/bucket`` (every format: the CPU engine's shared memory as SGLang's CUDA IPC)."""
        body = await read_json(request, PULL)
        min_version = body.get("min_version", -1)
        ttl = body.get("ttl_s")
        fmt = body.get("format", "shm")
        if fmt not in TRANSPORTS:
            return error_response(400, "LMC-E400", f"format {fmt!r} is not one of "
                                  f"{', '.join(TRANSPORTS)}", field="format")
        try:
            exporter = await asyncio.to_thread(self._exporter, fmt)
            params = await asyncio.to_thread(exporter.check, body)
        except (TransportUnavailable, ValueError, RuntimeError) as exc:
            # e.g. no GPU on this machine for CUDA IPC, Mooncake not configured
            code, why = split(exc)
            return error_response(400, code or "LMC-E506", f"cannot serve format {fmt!r}: {why}")
        shard = body.get("shard")
        if shard is not None and not exporter.shards:
            return error_response(400, "LMC-E519", f"format {fmt!r} serves whole tensors only: "
                                  "pull without 'shard' (weight_sync.engine_pull=whole)",
                                  field="shard")
        leased = self.store.lease_latest(min_version, float(ttl) if ttl is not None else None)
        if leased is None:
            return web.json_response({"version": None})
        lease_id, sv = leased
        with self.store.cond:  # leases the store let expire: free what they held
            expired = [k for k in self.pulls if k not in self.store.leases]
        for stale in expired:
            await asyncio.to_thread(self._forget_lease, stale)
        state = PullState(fmt, params, holder=request.remote or "")
        count, nbytes = sv.num_served, sv.nbytes
        if shard is not None:
            try:
                state.shard = await asyncio.to_thread(ShardPlan.of_version, self.store, sv,
                                                      shard["tp_size"], shard["heads"],
                                                      bool(shard.get("tied")),
                                                      int(shard.get("ep_size", 1)))
                exporter.check_shard(params, shard["tp_size"])
            except BaseException as exc:  # e.g. a model the layout cannot hold at this TP
                self.store.release(lease_id)
                if not isinstance(exc, (ValueError, ArithmeticError)):
                    raise
                code, why = split(exc)
                return error_response(400, code or "LMC-E519", why, field="shard")
            count, nbytes = len(state.shard.groups), state.shard.nbytes
        self.pulls[lease_id] = state
        self.metrics.leased(fmt)
        return web.json_response({"version": sv.version, "lease_id": lease_id, "format": fmt,
                                  "num_buckets": count, "nbytes": nbytes})

    async def bucket(self, request):
        """One bucket of a lease, in the lease's format. ``applied`` lists the buckets the engine
        has finished applying: the relay frees their copies (CUDA IPC: GPU memory back to the
        driver). At most two buckets may be outstanding (served, not applied) -- the one being
        applied and the next -- so an engine GPU never holds more than two of the relay's;
        asking for a third is refused with 409. Every format follows the same protocol, so the
        CPU pull exercises what the GPU pull does. Without ``index`` it only takes the
        ``applied`` acknowledgements (a striped pull done with one stripe's relay)."""
        body = await read_json(request, BUCKET)
        lease_id, index, applied = body["lease_id"], body.get("index"), body.get("applied", [])
        with self.store.cond:
            entry = self.store.leases.get(lease_id)
        state = self.pulls.get(lease_id)
        if entry is None or state is None:
            await asyncio.to_thread(self._forget_lease, lease_id)
            return error_response(404, "LMC-E405", f"lease {lease_id!r} is unknown, released or "
                                  "expired; pull again")
        sv = entry[0]
        count = len(state.shard.groups) if state.shard is not None else sv.num_served
        if index is not None and not 0 <= index < count:
            return error_response(400, "LMC-E400", f"bucket index {index} is not in "
                                  f"[0, {count})", field="index")
        exporter = self.exporters[state.fmt]
        done = [i for i in applied if i in state.outstanding]
        state.outstanding.difference_update(done)
        state.applied.update(done)
        if done:
            await asyncio.to_thread(exporter.free, lease_id, done)
        if index is None:
            return web.json_response({"index": None, "serialized": None, "freed": done})
        if index not in state.outstanding and len(state.outstanding) >= MAX_BUCKETS_OUTSTANDING:
            return error_response(
                409, "LMC-E404", f"buckets {sorted(state.outstanding)} of lease {lease_id} are "
                f"not applied yet: at most {MAX_BUCKETS_OUTSTANDING} may be outstanding; list "
                "the applied ones in 'applied'")
        try:
            if state.shard is not None:
                data = await asyncio.to_thread(exporter.serve_shard, lease_id, index,
                                               state.shard, state.params)
                nbytes = state.shard.rank_bytes(index) * state.shard.layout.tp
            else:
                bucket = await asyncio.to_thread(self.store.served, sv, index)
                data = await asyncio.to_thread(exporter.serve, lease_id, index, bucket,
                                               state.params)
                nbytes = bucket.nbytes * exporter.copies(state.params)
        except Exception as exc:  # noqa: BLE001 - e.g. a GPU error: say it, keep serving
            code, why = split(exc)
            return error_response(500, code or "LMC-E506", f"cannot serve bucket {index} as "
                                  f"{state.fmt!r}: {why}")
        if self.pulls.get(lease_id) is not state:  # released while this bucket was made
            await asyncio.to_thread(exporter.free, lease_id, [index])
            return error_response(404, "LMC-E405", f"lease {lease_id!r} was released while "
                                  f"bucket {index} was being served; pull again")
        state.outstanding.add(index)
        state.peak = max(state.peak, len(state.outstanding))
        state.nbytes += nbytes
        self.metrics.served(nbytes)
        return web.json_response({"index": index, "serialized": data})

    def _exporter(self, name: str) -> Exporter:
        if name not in self.exporters:
            self.exporters[name] = make_exporter(name, self.cfg)
        return self.exporters[name]

    def _forget_lease(self, lease_id: str) -> Optional[PullState]:
        state = self.pulls.pop(lease_id, None)
        if state is not None:
            self.exporters[state.fmt].release(lease_id)
        return state

    async def release(self, request):
        lease_id = (await read_json(request, RELEASE))["lease_id"]
        # GPU copies first: the lease pins the host buffers they were made from.
        state = await asyncio.to_thread(self._forget_lease, lease_id)
        out = {"released": self.store.release(lease_id)}
        if state is not None:
            self.metrics.released(time.monotonic() - state.started)
            out.update(peak_outstanding=state.peak,
                       buckets_served=len(state.applied | state.outstanding),
                       bytes_served=state.nbytes)
        return web.json_response(out)

    async def release_holder(self, request):
        """Release every lease taken from ``host``: the controller found that host gone (its
        engines lost, no supervisor left to report them), so the pull agent that took them
        will never release them; without this they would hold their versions' buffers for
        the lease TTL and, with ``weight_sync.relay_versions`` of them held, keep this relay
        from taking newer versions (a master relay: from the trainer)."""
        host = (await read_json(request, RELEASE_HOLDER))["host"]
        leases = [k for k, state in self.pulls.items() if state.holder == host]
        for lease_id in leases:
            await asyncio.to_thread(self._forget_lease, lease_id)
            self.store.release(lease_id)
        if leases:
            logger.warning("released %d leases of %s, whose host is gone", len(leases), host)
        return web.json_response({"released": len(leases)})
