"""The relay process: one per rollout machine.

    LAMINAR_RUN_TOKEN=T python -m laminar_mcore.relay --master --trainer-stages P [--publish-port N]
    LAMINAR_RUN_TOKEN=T python -m laminar_mcore.relay --master-url http://HOST:PORT

Owns a ``VersionStore`` in shared host memory (at most ``weight_sync.relay_versions`` versions'
buffers; given ``model_bytes`` it refuses to start when /dev/shm cannot hold that many, naming
the mount to enlarge, rather than die of SIGBUS when the tmpfs fills), a TCP data port that
receives pushed versions (the chain's protocol and the ``Forwarder`` that pushes every newer
version to its downstream relay are relay/chain.py), and an HTTP control API: ``/pull`` (lease
the newest complete version), ``/bucket`` (one of its flattened buckets at a time:
shared-memory handles for local CPU engines, CUDA IPC for local SGLang engines, Mooncake
transfer-engine buffers for pullers on other machines when started with
``--mooncake-protocol``), ``/release``, ``/release_holder`` (every lease taken from a host that
is gone) -- those four, the leases and the transports' exporters are relay/pulls.py --
``/latest``, ``/digests`` (the newest version's bucket digests, computed from its bytes),
``/health``, ``/metrics`` (Prometheus text, relay/metrics.py); the formats are the weight
transports of ``relay/transports``. On the master also ``/register``,
``/report_failure`` and ``/chain``.
The master hosts the trainer's publish group (outside the trainer's world; a trainer joins it only
after proving the run token, relay/rendezvous.py), orders the chain, watches every relay's
heartbeat and rebuilds the chain around a dead one; a relay that restarts registers again, joins
the end of the chain and is caught up (that half, and promotion to master, is relay/master.py).

Every endpoint but ``/health`` (``{"ok": true}``; the relay's details only with the token) and
``/metrics`` requires the run's token; every body and query is checked field by field (a bad one
is a 400 naming the field, relay/requests.py). SIGTERM: long polls are answered at once (503
"shutting down"), handlers still running after ``SHUTDOWN_S`` are cancelled, and the shared
memory is released before the process exits.

A relay process never loads engine, trainer or Megatron code (tests/test_layering.py): it
moves flattened buckets only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Optional, Tuple

import torch
from aiohttp import web

from ..config.schema import WeightSyncConfig
from ..metrics.prometheus import Scrape
from ..errors import within
from ..netutil import (TOKEN_ENV, BadRequest, bearer_ok, error_response, read_json, read_query,
                       token_middleware)
from ..weights.bucket import SHM_DIR, reclaim_segments
from ..weights.delta import digest
from ..weights.shards import stripe_parts
from ..weights.transport import resolve_backend
from .chain import Forwarder, PushRefused, serve_push
from .master import MasterRelay
from .metrics import RelayBooks, relay_families
from .pulls import PullService
from .requests import LATEST, NO_QUERY, SET_DOWNSTREAM
from .store import VersionStore
from .tmpfs import ShmFull, shm_shortfall, shm_space, size_text
from .transports import TRANSPORTS, TransportUnavailable

logger = logging.getLogger("laminar_mcore.relay")


@dataclass
class RelayConfig:
    """One relay: its place in the tier and the run's ``weight_sync`` section (which the relay
    reads whole: a new weight-sync option needs the schema and the code that uses it only)."""

    token: str
    host: str = "127.0.0.1"
    port: int = 0  # control port; 0: pick one
    relay_id: Optional[str] = None
    master: bool = False  # trainers publish to the master; the others chain from it
    master_url: Optional[str] = None
    trainer_stages: int = 1  # the trainer's publishing parts (weights.shards.publish_parts)
    # a striped tier (weight_sync.master_relays): this relay's stripe of ``stripes``; its
    # master takes only that stripe's parts (weights.shards.stripe_parts), its chain carries them
    stripe: int = 0
    stripes: int = 1
    publish_port: int = 0
    chunk_bytes: int = 0  # chain push chunks; 0: Laminar's T(p, k) model or chain_chunks
    heartbeat_s: float = 0.5
    lease_ttl_s: float = 600.0
    # one version's bytes at the rollout dtype (config.plan.relay_model_bytes), for the
    # start-up check of /dev/shm; 0: unknown (the store checks once a version's size is known)
    model_bytes: int = 0
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def to_json(self) -> str:
        """Everything but the token (which travels in ``LAMINAR_RUN_TOKEN``)."""
        data = asdict(self)
        data.pop("token")
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, token: str) -> "RelayConfig":
        data = json.loads(text)
        ws = data.pop("weight_sync", {}) or {}
        return cls(token=token, weight_sync=WeightSyncConfig(**ws), **data)


def resolve_relay_device(name: str) -> Optional[str]:
    """``weight_sync.relay_device``: the GPU the relay stages NCCL publishes on and keeps its
    CUDA context on. ``auto``: the machine's last GPU (engines are placed from GPU 0 up, so
    it is the one least likely to serve an engine); ``cpu`` or no GPU: None."""
    if name == "cpu" or not torch.cuda.is_available():
        return None
    if name == "auto":
        return f"cuda:{torch.cuda.device_count() - 1}"
    device = torch.device(name)
    if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"LMC-E508: relay device {name!r} is not a GPU of this machine "
                         f"({torch.cuda.device_count()} visible); use auto, cpu or cuda:N")
    return name


OPEN_PATHS = ("/health", "/metrics")  # what answers without the token
SHUTDOWN_S = 1.0  # how long a SIGTERM waits for handlers still running before cancelling them


class RelayServer(PullService, MasterRelay):
    def __init__(self, cfg: RelayConfig):
        if not cfg.token:
            raise ValueError("LMC-E200: a relay needs the run's token (--token or "
                             "LAMINAR_RUN_TOKEN)")
        if cfg.master == bool(cfg.master_url):
            raise ValueError("LMC-E509: a relay is either the master (--master) or joins one "
                             "(--master-url)")
        ws = cfg.weight_sync
        need = ws.relay_versions * cfg.model_bytes
        short = need and shm_shortfall(need, f"weight_sync.relay_versions={ws.relay_versions} "
                                             f"versions of {size_text(cfg.model_bytes)} need")
        if short:
            raise ShmFull(within("cannot start", short, "LMC-E500"))
        free, total = shm_space()
        logger.info("%s: %.1f GB free of %.1f GB; weight_sync.relay_versions=%d", SHM_DIR,
                    free / 1e9, total / 1e9, ws.relay_versions)
        self.cfg = cfg
        self.token = cfg.token
        self.host = cfg.host
        self.relay_id = cfg.relay_id or f"relay-{uuid.uuid4().hex[:8]}"
        self.master = cfg.master
        self.master_url = cfg.master_url
        self.trainer_stages = cfg.trainer_stages
        self.trainer_parts = stripe_parts(cfg.stripe, cfg.stripes, cfg.trainer_stages)
        self.publish_port = cfg.publish_port
        # the trainer -> master relay backend as configured (auto: each session decides from
        # both ends, weights.transport.choose_channel); the GPU an NCCL session would stage on,
        # where no CUDA context is made until such a session forms
        self.publish_backend = resolve_backend(ws.publish_backend) if cfg.master else None
        self.relay_device = resolve_relay_device(ws.relay_device)
        self.heartbeat_s = cfg.heartbeat_s
        self.metrics = RelayBooks(formats=TRANSPORTS)
        self.store = VersionStore(lease_ttl_s=cfg.lease_ttl_s, max_versions=ws.relay_versions,
                                  model_bytes=cfg.model_bytes,
                                  full_wait_s=float(ws.relay_full_wait_s))
        # a listener runs under the store's lock right after ``latest`` became the version
        self.store.on_complete.append(lambda version: self.metrics.completed(self.store.latest))
        self.forwarder = Forwarder(self.store, cfg.chunk_bytes or None, self._downstream_failed,
                                   chain_chunks=ws.chain_chunks, token=cfg.token,
                                   on_pushed=self.metrics.forwarded_version)
        self.stop_event = threading.Event()
        self.control_url: Optional[str] = None
        self.data_sock = socket.socket()
        self.data_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.data_sock.bind((cfg.host, 0))
        self.data_sock.listen(16)
        self.data_port = self.data_sock.getsockname()[1]
        self._init_master()  # the chain, the publish group (relay/master.py)
        self._newer: Optional[asyncio.Event] = None  # set when a version completes (long polls)
        self.long_polls = 0  # long polls waiting now (/metrics)
        self.closing = False  # SIGTERM: long polls answer now, new requests get 503
        self._init_pulls(cfg)  # leases and the weight transports' exporters (relay/pulls.py)
        # every endpoint but /health and /metrics (read-only, as SGLang's) proves the run token;
        # bad input is a 400 naming the field
        self.app = web.Application(middlewares=[token_middleware(
            cfg.token, lambda request: not (request.method in ("GET", "HEAD")
                                            and request.path in OPEN_PATHS),
            lambda: self.closing)])
        self.app.on_shutdown.append(self._on_shutdown)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", Scrape(lambda: relay_families(self)).handle)
        r.add_get("/latest", self.latest)
        r.add_get("/digests", self.digests)
        self._add_pull_routes(r)
        r.add_post("/set_downstream", self.set_downstream)
        self._add_master_routes(r)

    # ------------------------------------------------------------------ lifecycle
    def start_background(self, control_url: str) -> None:
        self.control_url = control_url
        threading.Thread(target=self._accept_loop, name="laminar-relay-accept", daemon=True).start()
        self.forwarder.start()
        if self.master:
            threading.Thread(target=self._host_publish_group, name="laminar-relay-publish",
                             daemon=True).start()
            threading.Thread(target=self._heartbeat_loop, name="laminar-relay-heartbeat",
                             daemon=True).start()
        else:
            threading.Thread(target=self._register_loop, name="laminar-relay-register",
                             daemon=True).start()
            threading.Thread(target=self._membership_loop, name="laminar-relay-membership",
                             daemon=True).start()

    async def _on_shutdown(self, app) -> None:
        """SIGTERM (aiohttp's shutdown, before it waits for running handlers): answer every
        long poll now."""
        self.closing = True
        if self._newer is not None:
            self._announce()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the cleanup
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)

    def shutdown(self) -> None:
        """Stop every thread and free the shared memory -- the last whatever fails before."""
        self.stop_event.set()
        try:
            steps = [lambda: self.rendezvous and self.rendezvous.close(),
                     lambda: self.forwarder.stop(timeout_s=1.0), self.data_sock.close]
            steps += [exporter.close for exporter in self.exporters.values()]
            for step in steps:
                try:
                    step()
                except Exception:  # noqa: BLE001 - the next step, and the memory, still go
                    logger.exception("relay shutdown step failed")
        finally:
            self.store.close()

    def _accept_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                conn, _ = self.data_sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        # an upstream relay that vanishes mid-push (its machine gone, no RST) fails this
        # version after a minute of silence instead of holding its buffers forever
        conn.settimeout(60.0)
        with conn:
            try:
                peer = "%s:%s" % conn.getpeername()[:2]
            except OSError:
                peer = "?"
            try:
                # an owner of its own: a refusal of this push is not one of the next
                serve_push(conn, self.store, owner=f"push-{uuid.uuid4().hex[:12]}",
                           token=self.token, on_bucket=self.metrics.bucket)
            except PushRefused as exc:
                logger.warning("refused a push from %s: %s", peer, exc)
            except Exception as exc:  # noqa: BLE001 - a broken push only fails that version
                logger.warning("incoming push from %s failed: %s", peer, exc)

    # ------------------------------------------------------------------ HTTP
    async def health(self, request):
        """Alive; with the run token also what a controller electing a new master needs to know
        of this relay (its ports are nobody else's business)."""
        if not bearer_ok(request, self.token):
            return web.json_response({"ok": True})
        self.master_seen = time.monotonic()  # the master's heartbeat (or the controller)
        return web.json_response({"ok": True, "relay_id": self.relay_id, "master": self.master,
                                  "master_url": self.master_url,
                                  "control_url": self.control_url, "data_host": self.host,
                                  "data_port": self.data_port,
                                  "version": self.store.latest_version,
                                  "stripe": [self.cfg.stripe, self.cfg.stripes],
                                  "publish_port": self.publish_port if self.master else None})

    async def latest(self, request):
        """The newest version and this relay's state. ``?after=V&wait_s=T``: a long poll,
        answered as soon as a version newer than V is complete here (or after T s, at most
        60), so a rollout manager learns of new versions at once without polling. A relay
        shutting down answers its long polls at once: 503."""
        query = read_query(request, LATEST)
        after = query.get("after")
        wait_s = min(query.get("wait_s", 0.0), 60.0)
        if after is not None and wait_s > 0:
            await self._wait_newer(after, wait_s)
        if self.closing:
            return error_response(503, "LMC-E402", "shutting down")
        s = self.store
        with s.cond:
            latest = s.latest
            info = {"relay_id": self.relay_id, "master": self.master,
                    "stripe": [self.cfg.stripe, self.cfg.stripes],
                    "version": latest.version if latest else None,
                    "nbytes": latest.nbytes if latest else 0,
                    "receiving": sorted(s.receiving), "leases": len(s.leases),
                    "downstream": list(self.forwarder.downstream) if self.forwarder.downstream else None,
                    "transports": {name: e.info() for name, e in self.exporters.items()},
                    "last_push": self.forwarder.stats}
        return web.json_response(info)

    async def digests(self, request):
        """The newest version's bucket digests computed now from the bytes this relay holds
        (``weights.delta.digest``, in pull order), and those the trainer sent with them: equal
        lists mean this relay serves the version bit for bit (``bench.delta`` checks it)."""
        read_query(request, NO_QUERY)
        held = self.store.lease_latest()  # the relay's lease TTL (hashing takes a while)
        if held is None:
            return web.json_response({"version": None, "digests": [], "trainer": []})
        lease_id, sv = held
        try:
            buckets = sv.ordered()
            computed = await asyncio.to_thread(
                lambda: [digest(b.shm.buffer[:b.nbytes]) for b in buckets])
        finally:
            self.store.release(lease_id)
        return web.json_response({"version": sv.version, "digests": computed,
                                  "trainer": [b.digest for b in buckets]})

    async def _wait_newer(self, after: int, wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        if self._newer is None:  # the first long poll: hook the store
            self._newer = asyncio.Event()

            def completed(version: int) -> None:  # on the receiving thread, under the lock
                loop.call_soon_threadsafe(self._announce)
            self.store.on_complete.append(completed)
        deadline = loop.time() + wait_s
        self.long_polls += 1
        try:
            while self.store.latest_version <= after and not self.closing:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return
                try:
                    await asyncio.wait_for(self._newer.wait(), remaining)
                except asyncio.TimeoutError:
                    return
        finally:
            self.long_polls -= 1

    def _announce(self) -> None:
        """Wake every waiting long poll (a fresh event for the next version)."""
        event, self._newer = self._newer, asyncio.Event()
        event.set()


    async def set_downstream(self, request):
        body = await read_json(request, SET_DOWNSTREAM)
        self.master_seen = time.monotonic()
        if body.get("data_port") and not body.get("data_host"):
            raise BadRequest("data_host", "is missing (a downstream is data_host and data_port)")
        if body.get("relays_after_source"):
            self.forwarder.relays_after_source = int(body["relays_after_source"])
        if body.get("data_port"):
            self.forwarder.set_downstream((str(body["data_host"]), int(body["data_port"])))
        else:
            self.forwarder.set_downstream(None)
        return web.json_response({"ok": True})


def _stripe_arg(text: str) -> Tuple[int, int]:
    try:
        stripe, stripes = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not S/N (e.g. 0/2)") from None
    if not 0 <= stripe < stripes:
        raise argparse.ArgumentTypeError(f"stripe {text}: S must be one of 0..N-1")
    return stripe, stripes


def _config_from_args(args) -> RelayConfig:
    if args.config_json:  # the launchers: the whole relay section at once
        return RelayConfig.from_json(args.config_json, args.token)
    ws = WeightSyncConfig(chain_chunks=args.chain_chunks, publish_backend=args.publish_backend,
                          relay_device=args.relay_device,
                          mooncake_protocol=args.mooncake_protocol,
                          mooncake_device=args.mooncake_device,
                          relay_versions=args.relay_versions)
    return RelayConfig(token=args.token, host=args.host, port=args.port, relay_id=args.relay_id,
                       master=args.master, master_url=args.master_url,
                       trainer_stages=args.trainer_stages, stripe=args.stripe[0],
                       stripes=args.stripe[1], publish_port=args.publish_port,
                       chunk_bytes=args.chunk_bytes, heartbeat_s=args.heartbeat_s,
                       model_bytes=args.model_bytes, weight_sync=ws)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="laminar_mcore relay")
    ap.add_argument("--token", default=None,
                    help="deprecated: a token on a command line is visible to every user of "
                         "the machine (ps); export LAMINAR_RUN_TOKEN instead")
    ap.add_argument("--config-json", default=None,
                    help="a RelayConfig as JSON (what the launchers pass); the flags below are "
                         "then ignored")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="control port (0: pick one)")
    ap.add_argument("--relay-id", default=None)
    ap.add_argument("--master", action="store_true")
    ap.add_argument("--master-url", default=None)
    ap.add_argument("--trainer-stages", type=int, default=1)
    ap.add_argument("--stripe", type=_stripe_arg, default=(0, 1), metavar="S/N",
                    help="this relay's stripe S of N master relays (weight_sync.master_relays): "
                         "a master takes that stripe's trainer parts, a chained relay joins "
                         "only that stripe's master")
    ap.add_argument("--publish-port", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="chunk size of chain pushes; 0: from Laminar's T(p, k) model")
    ap.add_argument("--chain-chunks", type=int, default=None, help="a fixed chunk count k")
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--publish-backend", choices=["auto", "gloo", "nccl", "shm"],
                    default="auto",
                    help="trainer -> master relay channel: auto = decided per trainer from both "
                         "ends (shared memory on one host, NCCL across hosts with GPUs, else "
                         "gloo); a forced one that cannot work is refused with the reason")
    ap.add_argument("--relay-device", default="auto",
                    help="the GPU an NCCL publish session stages on (its CUDA context is made "
                         "only then): auto (the last GPU), cpu, or cuda:N "
                         "(weight_sync.relay_device)")
    ap.add_argument("--mooncake-protocol", choices=["tcp", "rdma"], default=None,
                    help="also serve cross-node pulls through Mooncake's transfer engine")
    ap.add_argument("--mooncake-device", default="",
                    help="RDMA NIC(s) for Mooncake, e.g. mlx5_0 (empty: auto-discover)")
    ap.add_argument("--relay-versions", type=int, default=2,
                    help="versions kept in /dev/shm at once (weight_sync.relay_versions)")
    ap.add_argument("--model-bytes", type=int, default=0,
                    help="one version's bytes: refuse to start if /dev/shm cannot hold "
                         "relay-versions of them (0: check once a version has arrived)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.token:
        logger.warning("--token is deprecated: every user of this machine can read a command "
                       "line; export %s instead", TOKEN_ENV)
    else:
        args.token = os.environ.get(TOKEN_ENV)
    if not args.token:
        ap.error("LMC-E200: --token (or LAMINAR_RUN_TOKEN) is required")
    try:
        cfg = _config_from_args(args)
        # Buckets of relays (or readers) killed with -9 on this machine: nobody else frees them.
        stale = reclaim_segments()
        if stale:
            logger.warning("reclaimed %d shared-memory buckets of dead processes", len(stale))
        server = RelayServer(cfg)
    except (TransportUnavailable, ValueError, TypeError) as exc:
        ap.exit(2, within("relay", exc) + "\n")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    port = sock.getsockname()[1]
    control_url = f"http://{cfg.host}:{port}"
    server.start_background(control_url)
    print(f"LAMINAR_RELAY_PORT={port}", flush=True)
    print(f"LAMINAR_RELAY_DATA_PORT={server.data_port}", flush=True)

    async def on_cleanup(app):
        server.shutdown()

    server.app.on_cleanup.append(on_cleanup)
    # SIGTERM/SIGINT: stop listening, answer the long polls (_on_shutdown), wait SHUTDOWN_S for
    # the handlers still running, then free the shared memory (on_cleanup) and exit
    web.run_app(server.app, sock=sock, access_log=None, print=None, shutdown_timeout=SHUTDOWN_S)


if __name__ == "__main__":
    main()
