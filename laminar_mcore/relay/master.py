"""The master relay's half of a relay: the trainers' publish group, the chain and promotion.

The master hosts the trainer's publish group (outside the trainer's world: one two-rank group
per trainer stage and session, so a restarted trainer connects again; a trainer joins only after
proving the run token, relay/rendezvous.py), orders the
chain of relays that registered with it (``/register``; ``/chain`` shows it), watches each one's
heartbeat and rebuilds the chain around a dead one (also when a relay reports that its
downstream failed, ``/report_failure``). A relay that is not the master registers with it, again
after a restart -- or once the master's heartbeat has stopped reaching it (the master cut it out
while its host's link was down) -- and joins the end of the chain. When the master dies, the controller promotes
another relay (``/promote``: it starts hosting the publish group and orders the chain of the
others) and points the rest at it (``/set_master``).

Mixed into ``RelayServer`` (relay/server.py), which provides ``cfg``, ``token``, ``host``,
``relay_id``, ``master``, ``master_url``, ``trainer_stages``, ``publish_port``,
``publish_backend``, ``relay_device``, ``heartbeat_s``, ``store``, ``forwarder``, ``stop_event``,
``control_url``, ``data_port`` and ``metrics`` (relay/metrics.py).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from aiohttp import web

from ..weights.transport import (abort_group, choose_channel, gpu_uuid, host_identity,
                                 open_channel, resolve_backend)
from .publish_receiver import receive_publishes
from .client import probe_relay
from ..netutil import error_response, read_json, read_query
from .rendezvous import PublishRendezvous
from .requests import NO_QUERY, PROMOTE, REGISTER, REPORT_FAILURE, SET_MASTER

logger = logging.getLogger("laminar_mcore.relay")
SILENT_S = 5.0  # how long a relay that does not answer the master's probes stays in the chain


def _http(method: str, url: str, body: Optional[dict] = None, token: Optional[str] = None,
          timeout: float = 5.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith("{") else {}


def _chain_entry(body: dict) -> dict:
    """A relay's place in the master's chain, from its registration (or its /health)."""
    return {"relay_id": str(body["relay_id"]), "control_url": str(body["control_url"]),
            "data_host": str(body["data_host"]), "data_port": int(body["data_port"])}


class MasterRelay:
    """The master's duties of ``RelayServer`` (see the module docstring)."""

    def _init_master(self) -> None:
        self.relays: "OrderedDict[str, dict]" = OrderedDict()  # master: the chain, in order
        self.chain_lock = threading.Lock()
        self.chain_rebuilds = 0
        self.publish_threads: List[threading.Thread] = []
        self.publish_ready = threading.Event()
        self.rendezvous: Optional[PublishRendezvous] = None
        # a chained relay: when the master last reached it (its heartbeat, /set_downstream);
        # silence means the master cut it out of the chain (_membership_loop)
        self.master_seen = time.monotonic()

    def _add_master_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/register", self.register)
        router.add_post("/report_failure", self.report_failure)
        router.add_get("/chain", self.chain)
        router.add_post("/promote", self.promote)
        router.add_post("/set_master", self.set_master)

    # ------------------------------------------------------------------ master: trainer group
    def _host_publish_group(self) -> None:
        """Open the publish port: a trainer stage lead that proves the run token gets a session
        of its own -- its own store and group (relay/rendezvous.py); nothing else reaches it."""
        self.rendezvous = PublishRendezvous(
            self.host, self.publish_port, self.token, self.trainer_parts, self._choose_channel,
            self._start_session, self.stop_event).start()
        self.publish_port = self.rendezvous.port
        self.publish_ready.set()
        print(f"LAMINAR_RELAY_PUBLISH_PORT={self.publish_port}", flush=True)

    def _choose_channel(self, hello: dict):
        """This session's channel from both ends' facts (``weights.transport.choose_channel``):
        the trainer's in its join, this relay's host and the GPU it would stage NCCL on."""
        requested = self.publish_backend or "auto"
        relay = {"host": host_identity(), "gpu": None}
        # the relay's GPU matters only where NCCL may be chosen: no CUDA call otherwise
        if self.relay_device and (requested == "nccl" or (
                requested == "auto" and hello.get("host") != relay["host"])):
            relay["gpu"] = gpu_uuid(torch.device(self.relay_device))
        backend, why = choose_channel(requested, {"host": hello.get("host"),
                                                  "gpu": hello.get("gpu")}, relay)
        logger.info("publish channel for stage %s: %s (%s)", hello.get("stage"), backend, why)
        return backend, why

    def _start_session(self, stage: int, session: int, store, backend: str) -> None:
        """Every trainer process that joins for ``stage`` (the first, or one restarted after a
        crash) gets a new session: its own group and receiver."""
        t = threading.Thread(target=self._receive_stage, args=(store, stage, session, backend),
                             name=f"laminar-relay-publish-{stage}-s{session}", daemon=True)
        t.start()
        self.publish_threads.append(t)

    def _receive_stage(self, store, stage: int, session: int, backend: str) -> None:
        """One trainer stage's publish stream, over that stage's own two-rank group(s)."""
        channel = None
        try:
            device = torch.device(self.relay_device) if backend == "nccl" else None
            if device is not None:  # the CUDA context is made now, on the NCCL session's GPU
                torch.cuda.set_device(device)
            # the relay waits for the trainer's next publish, however long a step takes: over
            # gloo (headers), never inside an NCCL collective, whose data group times out
            channel = open_channel(
                store, stage, 0, backend, session=session,
                wait_timeout=datetime.timedelta(days=30),
                data_timeout=datetime.timedelta(seconds=self.cfg.weight_sync.publish_timeout_s),
                chunk_bytes=8 * 2**20, device=device)
            logger.info("publish group of trainer stage %d formed (%s, session %d)", stage,
                        backend, session)
            receive_publishes(channel, self.store, self.stop_event,
                              lambda v: logger.info("version %d complete", v),
                              on_bucket=self.metrics.bucket, stripes=self.cfg.stripes)
        except Exception as exc:  # noqa: BLE001 - the trainer went away
            if not self.stop_event.is_set():
                logger.warning("publish stream from stage %d (session %d) ended: %s", stage,
                               session, exc)
            if channel is not None:
                for pg in channel.groups():
                    abort_group(pg)

    # ------------------------------------------------------------------ chain management
    def _downstream_failed(self, data_addr: str) -> None:
        self.metrics.fault("downstream_failed")
        if self.master:
            self._check_and_remove(data_addr)
        else:
            try:
                _http("POST", self.master_url + "/report_failure", {"data_addr": data_addr},
                      self.token)
            except (urllib.error.URLError, OSError) as exc:
                logger.warning("cannot report failure to the master: %s", exc)

    def _check_and_remove(self, data_addr: str) -> None:
        with self.chain_lock:
            victim = next((rid for rid, r in self.relays.items()
                           if f"{r['data_host']}:{r['data_port']}" == data_addr), None)
        if victim is None or self._alive(self.relays.get(victim, {})):
            return
        self._remove(victim)

    def _alive(self, relay: dict) -> bool:
        return self._probe(relay) == "alive"

    def _probe(self, relay: dict) -> str:
        """alive, gone (nothing listens: the process is dead) or silent (no answer in 1 s)."""
        return probe_relay(relay["control_url"], 1.0, self.token)[0] if relay else "gone"

    def _remove(self, relay_id: str) -> None:
        with self.chain_lock:
            if self.relays.pop(relay_id, None) is None:
                return
        logger.warning("relay %s is gone; rebuilding the chain", relay_id)
        self.metrics.fault("relay_lost")
        self._rebuild("failure")
        self.metrics.recovery("rechained")

    def _rebuild(self, reason: str) -> None:
        """Tell every relay of the chain its downstream; ``reason``: register, failure or
        promotion (a /metrics label)."""
        with self.chain_lock:
            order = list(self.relays.values())
            self.chain_rebuilds += 1
        self.metrics.rebuilt(reason)
        first = order[0] if order else None
        self.forwarder.relays_after_source = max(len(order) + 1, 1)
        self.forwarder.set_downstream((first["data_host"], first["data_port"]) if first else None)
        for i, relay in enumerate(order):
            nxt = order[i + 1] if i + 1 < len(order) else None
            body = {"data_host": nxt["data_host"], "data_port": nxt["data_port"]} if nxt else {}
            body["relays_after_source"] = len(order) + 1
            try:
                _http("POST", relay["control_url"] + "/set_downstream", body, self.token)
            except (urllib.error.URLError, OSError) as exc:
                logger.warning("cannot reach relay %s: %s", relay["relay_id"], exc)

    def _heartbeat_loop(self) -> None:
        silent_since: Dict[str, Tuple[float, int]] = {}  # relay -> (first silent probe, misses)
        while not self.stop_event.wait(self.heartbeat_s):
            with self.chain_lock:
                relays = list(self.relays.values())
            for relay in relays:
                state = self._probe(relay)
                rid = relay["relay_id"]
                if state == "alive":
                    silent_since.pop(rid, None)
                    continue
                # a refused connection is a dead process: cut it out now; a relay that does
                # not answer may only be busy (a loaded host): after two probes and SILENT_S
                since, misses = silent_since.get(rid, (time.monotonic(), 0))
                silent_since[rid] = (since, misses + 1)
                if state == "gone" or (misses + 1 >= 2
                                       and time.monotonic() - since >= SILENT_S):
                    silent_since.pop(rid, None)
                    self._remove(rid)

    def _register_with(self, url: str) -> None:
        """Join the chain of the master relay at ``url`` (at its end)."""
        _http("POST", url + "/register", {
            "relay_id": self.relay_id, "control_url": self.control_url,
            "data_host": self.host, "data_port": self.data_port,
            "stripe": [self.cfg.stripe, self.cfg.stripes],
            "trainer_stages": self.trainer_stages}, self.token)

    def _register_loop(self) -> None:
        url = self.master_url
        while not self.stop_event.is_set() and not self.master and url == self.master_url:
            try:
                self._register_with(url)
                logger.info("registered with the master relay %s", url)
                return
            except (urllib.error.URLError, OSError) as exc:
                if getattr(exc, "code", None) == 409:  # another stripe's master: no retry
                    logger.error("the master relay %s refused this relay: %s", url,
                                 exc.read().decode(errors="replace"))
                    return
                logger.info("master relay not reachable yet (%s); retrying", exc)
                self.stop_event.wait(0.5)

    def _membership_loop(self) -> None:
        """A chained relay stays in the chain. The master probes every relay of its chain each
        heartbeat and cuts out one that does not answer twice (a dead process -- or a host whose
        link was down for a while, its relay alive). When the master's probes have stopped
        reaching this relay, it asks the master for its chain and registers again if it is not
        in it: it rejoins the end of the chain and is caught up. (Nothing is asked while the
        probes arrive; the master it asks is the current one, after a promotion too.)"""
        quiet_s = max(4 * self.heartbeat_s, 2.0)
        while not self.stop_event.wait(quiet_s / 2) and not self.master:
            if time.monotonic() - self.master_seen < quiet_s:
                continue
            url = self.master_url
            try:
                chain = _http("GET", url + "/chain", None, self.token, timeout=2.0)
                if self.relay_id in chain.get("chain", ()) or self.master:
                    continue
                self._register_with(url)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                logger.debug("master relay %s not reachable (%s)", url, exc)
                continue
            self.master_seen = time.monotonic()
            self.metrics.recovery("rejoined")
            logger.warning("the master relay %s had cut this relay out of its chain (its "
                           "heartbeat did not reach it); registered again", url)

    # ------------------------------------------------------------------ HTTP
    async def register(self, request):
        if not self.master:
            return error_response(404, "LMC-E405", "only the master relay keeps the chain")
        body = await read_json(request, REGISTER)
        mine = [self.cfg.stripe, self.cfg.stripes]
        if body.get("stripe", [0, 1]) != mine:
            return error_response(409, "LMC-E518", (
                f"relay {body['relay_id']} carries stripe {body.get('stripe', [0, 1])} (S, N) "
                f"and this master relay stripe {mine}: a chained relay joins its own stripe's "
                "master (--stripe S/N, weight_sync.master_relays)"))
        # (in a striped tier a promoted relay takes its stripe's parts of these)
        if self.cfg.stripes > 1 and body.get("trainer_stages") != self.trainer_stages:
            return error_response(409, "LMC-E518", (
                f"relay {body['relay_id']} was started for {body['trainer_stages']} trainer "
                f"parts and this master relay for {self.trainer_stages} (--trainer-stages): "
                "start every relay of the tier from one config"))
        entry = _chain_entry(body)
        with self.chain_lock:
            self.relays.pop(entry["relay_id"], None)  # a restarted relay rejoins at the end
            self.relays[entry["relay_id"]] = entry
        await asyncio.to_thread(self._rebuild, "register")
        return web.json_response({"ok": True, "position": list(self.relays).index(entry["relay_id"])})

    async def report_failure(self, request):
        if not self.master:
            return error_response(404, "LMC-E405", "only the master relay keeps the chain")
        body = await read_json(request, REPORT_FAILURE)
        self.metrics.fault("failure_reported")
        await asyncio.to_thread(self._check_and_remove, body["data_addr"])
        return web.json_response({"ok": True})

    async def chain(self, request):
        read_query(request, NO_QUERY)
        with self.chain_lock:
            order = list(self.relays)
        return web.json_response({"chain": [self.relay_id] + order, "rebuilds": self.chain_rebuilds,
                                  "publish_port": self.publish_port})

    async def promote(self, request):
        """The controller elected this relay master (the old one is dead): host the trainers'
        publish group and order the chain of ``relays`` (the other live relays), which the
        controller tells to register here. Answers once trainers can connect."""
        others = (await read_json(request, PROMOTE)).get("relays", [])
        if not self.master:
            self.publish_backend = resolve_backend(self.cfg.weight_sync.publish_backend)
            self.master, self.master_url, self.publish_port = True, None, 0
            with self.chain_lock:
                self.relays.clear()
                for r in others:
                    if r.get("relay_id") != self.relay_id:
                        entry = _chain_entry(r)
                        self.relays[entry["relay_id"]] = entry
            threading.Thread(target=self._host_publish_group, name="laminar-relay-publish",
                             daemon=True).start()
            threading.Thread(target=self._heartbeat_loop, name="laminar-relay-heartbeat",
                             daemon=True).start()
            await asyncio.to_thread(self._rebuild, "promotion")
            self.metrics.recovery("promoted")
            logger.warning("promoted to master relay (chain: %s)", list(self.relays))
        for _ in range(300):  # (on the loop, not a thread: a shutdown cancels it at once)
            if self.publish_ready.is_set():
                break
            await asyncio.sleep(0.1)
        else:
            return error_response(503, "LMC-E406", "the publish group did not start in 30 s")
        return web.json_response({"ok": True, "publish_port": self.publish_port,
                                  "version": self.store.latest_version})

    async def set_master(self, request):
        """A new master was elected or restarted: chain from it (register there)."""
        url = (await read_json(request, SET_MASTER))["master_url"]
        if self.master:
            return error_response(409, "LMC-E404", "this relay is the master")
        if url != self.master_url:
            self.master_url = url
            self.metrics.recovery("master_changed")
            threading.Thread(target=self._register_loop, name="laminar-relay-register",
                             daemon=True).start()
        return web.json_response({"ok": True})
