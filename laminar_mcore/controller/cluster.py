"""The controller's cluster and fault-isolation API: how the roles of a run find each other and
how failures are isolated.

Rollout nodes register their relay and engines (``POST /register``; a master relay before its
engines, ``/register_relay``) and ask whether their relay is the master (``/relay_role``); every
role learns where the others are from ``GET /cluster``. Node supervisors report an engine that
died or hung (``/engine_down``), its replacement (``/engine_replaced``) and a restarted relay
(``/relay_replaced``), and ask whether an engine whose health check failed was busy -- paused,
pulling or updating weights -- which is not a failure (``GET /engine_states``); trainer rank 0
a restart of the trainer world (``/resumed``). The master
relay is watched: when it is gone (or silent for 30 s) while other relays live, the first live
one is promoted and the rest chain from it. Engines are watched too, for the case no supervisor
reports: a host that went away (every process killed, powered off, its link down for long) --
its engines are ``lost``, their streams ended, and relays on other hosts release the leases its
pull agent held. Every event is recorded (``faults``, metrics "fault" records) and counted in
the books.

Mixed into ``Controller`` (controller/server.py), which provides ``cfg``, ``token``, ``info``,
``metrics``, ``manager``, ``trainer_version``, ``ready``, ``finished``, ``closing`` and the
event loop this runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from typing import List, Optional

from aiohttp import web

from ..netutil import (Field, engine_api_key, error_response, is_loopback, read_json,
                       read_query)
from ..relay.client import RelayClient, RelayError, probe_relay
from ..relay.transports import make_puller
from ..rollout.client import SGLangClient
from ..rollout.launcher import engine_pull_spec
from ..rollout.pull_agent import AgentPuller
from .engines import EngineHandle

logger = logging.getLogger(__name__)

# what each cluster endpoint accepts (netutil.check_fields: a bad field is a 400 naming it)
URL = Field("url", max_len=300)
PUBLISH = Field("dict", fields={"host": Field("str", required=True, max_len=255),
                                "port": Field("int", required=True, low=1, high=65535)})
REGISTER = {"relay_url": Field("url", required=True, max_len=300),
            "engines": Field("list", required=True, max_len=4096, item=URL),
            "publish": PUBLISH, "pull_agent": URL}
REGISTER_RELAY = {"relay_url": Field("url", required=True, max_len=300),
                  "publish": Field("dict", required=True, fields=PUBLISH.fields)}
LEAVE = {"engines": Field("list", required=True, max_len=4096, item=URL),
         "grace_s": Field("number", low=0, high=86400)}
ENGINE_DOWN = {"url": Field("url", required=True, max_len=300),
               "reason": Field("str", max_len=65536), "evict": Field("bool")}
ENGINE_REPLACED = {"old_url": Field("url", required=True, max_len=300),
                   "new_url": Field("url", required=True, max_len=300)}
RELAY_REPLACED = {**ENGINE_REPLACED, "publish": PUBLISH}
RESUMED = {"step": Field("int", low=0), "version": Field("int", required=True, low=0),
           "restarts": Field("int", low=0)}
RELAY_ROLE_QUERY = {"timeout": Field("number", low=0, high=86400)}
ENGINE_STATES_QUERY = {"url": Field("list", max_len=4096, item=URL)}


async def reach(url: str, timeout_s: float = 2.0) -> str:
    """Whether a TCP connection to ``url``'s host and port opens: alive, gone (refused:
    nothing listens, the process is dead) or silent (no answer within ``timeout_s``: the host
    is off or cut off)."""
    parts = urllib.parse.urlsplit(url)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port or 80), timeout_s)
    except ConnectionRefusedError:
        return "gone"
    except (OSError, asyncio.TimeoutError):
        return "silent"
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return "alive"


class ClusterAPI:
    """The cluster and fault-isolation half of ``Controller`` (see the module docstring)."""

    def _init_cluster(self) -> None:
        self.master_relay: Optional[dict] = None
        self.rollout_nodes: List[dict] = []
        self._nodes_registered = 0  # names stay unique when nodes leave and others join
        self._master_claimed = False
        # fault isolation: what failed and came back (books, metrics "fault" records)
        self.faults: List[dict] = []
        self.trainer_restarts = 0
        self.relay_failovers = 0
        self._retired_clients: list = []
        self.background: List[asyncio.Task] = []  # cancelled when the controller stops

    def _add_cluster_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/relay_role", self._relay_role)
        router.add_post("/register", self._register)
        router.add_get("/cluster", self._cluster)
        router.add_get("/engine_states", self._engine_states)
        router.add_post("/resumed", self._resumed)
        router.add_post("/register_relay", self._register_relay)
        router.add_post("/engine_down", self._engine_down)
        router.add_post("/engine_replaced", self._engine_replaced)
        router.add_post("/relay_replaced", self._relay_replaced)
        router.add_post("/leave", self._leave)

    # ------------------------------------------------------------------ engines
    def _add_node(self, relay_url: str, engine_urls: List[str],
                  pull_agent: Optional[str] = None) -> List[str]:
        """Register a rollout node's relay and engines (``POST /register``); returns the
        engines' names. They start on their own weights and pull from ``relay_url`` between
        trajectories, through ``weight_sync.engine_transport``. ``pull_agent``: the URL of the
        node's pull agent when its engines pull from a relay on another node
        (``rollout.relay=remote``): pulls then run there, not here."""
        node = self._nodes_registered
        self._nodes_registered += 1
        names = []
        for i, url in enumerate(engine_urls):
            if pull_agent:
                puller = AgentPuller(pull_agent, i, self.token)
            else:
                puller = make_puller(engine_pull_spec(self.cfg.rollout, i, self.cfg.weight_sync))
            # engines of a run stream incrementally (rollout.launcher.engine_command_from_config)
            handle = EngineHandle(
                f"node{node}-engine{i}",
                SGLangClient(url, retries=0, timeout_s=10, incremental_stream=True,
                             pause_timeout_s=self.cfg.rollout.pause_timeout_s,
                             api_key=engine_api_key(self.token)),
                RelayClient(relay_url, self.token), puller,
                capacity=self.cfg.rollout.max_running_requests)
            self.manager.add_engine(handle)
            names.append(handle.name)
        self.rollout_nodes.append({"relay_url": relay_url, "engines": list(engine_urls)})
        logger.info("rollout node %d registered: relay %s, engines %s", node, relay_url,
                    engine_urls)
        return names

    # ------------------------------------------------------------------ cluster API
    async def _relay_role(self, request: web.Request):
        """The first rollout node to ask hosts the master relay (trainers publish to it);
        the others chain from it once it has registered."""
        timeout = read_query(request, RELAY_ROLE_QUERY).get("timeout", 600.0)
        await read_json(request, {}, RELAY_ROLE_QUERY)
        if not self._master_claimed:
            self._master_claimed = True
            return web.json_response({"master": True, **self.info})
        deadline = time.time() + timeout
        while self.master_relay is None and time.time() < deadline and not self.closing:
            await asyncio.sleep(0.2)
        if self.closing:
            return error_response(503, "LMC-E402", "shutting down")
        if self.master_relay is None:
            return error_response(503, "LMC-E406", "the master relay has not registered yet")
        async with self._election:
            # A relay restarting after a crash: join the master if it lives; else one of the
            # other relays is elected; if none is left, the asker becomes the master.
            # (a master that is only slow is waited for: two masters would split the chain)
            state = "silent"
            for _ in range(15):
                state, _info = await self._relay_probe(self.master_relay["url"])
                if state != "silent":
                    break
            if state == "gone" and await self._elect() is None:
                return web.json_response({"master": True, **self.info})
        return web.json_response({"master": False, "master_url": self.master_relay["url"],
                                  **self.info})

    # ------------------------------------------------------------------ fault isolation
    async def _relay_health(self, url: str) -> Optional[dict]:
        """A relay's /health answer, or None if it does not answer within 2 s."""
        return (await self._relay_probe(url))[1]

    async def _relay_probe(self, url: str):
        """``relay.client.probe_relay`` (alive / gone / silent within 2 s), off the loop."""
        return await asyncio.to_thread(probe_relay, url, 2.0, self.token)

    async def _relay_post(self, url: str, path: str, body: dict, timeout: float = 40.0) -> dict:
        relay = RelayClient(url, self.token, timeout_s=timeout)
        try:
            return await relay._call("POST", path, body)
        finally:
            await relay.close()

    async def _elect(self) -> Optional[dict]:
        """The master relay is dead: promote the first live relay of the others (in the order
        they registered), point the rest at it; returns the new ``master_relay`` or None when
        no relay is left. Call holding ``self._election``."""
        dead = self.master_relay["url"] if self.master_relay else None
        live = []
        for node in self.rollout_nodes:
            url = node["relay_url"]
            if url != dead:
                info = await self._relay_health(url)
                if info is not None:
                    live.append((url, info))
        for url, info in live:
            t0 = time.time()
            entries = [{k: i[k] for k in ("relay_id", "control_url", "data_host", "data_port")}
                       for u, i in live if u != url]
            try:
                answer = await self._relay_post(url, "/promote", {"relays": entries})
            except RelayError as exc:
                logger.warning("relay %s could not be promoted: %s", url, exc)
                continue
            self.master_relay = {"url": url, "publish_host": str(info["data_host"]),
                                 "publish_port": int(answer["publish_port"])}
            await self._tell_master(exclude=url)
            self.relay_failovers += 1
            self._fault("master_relay", "elected", url=url, dead=dead,
                        seconds=round(time.time() - t0, 3))
            return self.master_relay
        return None

    async def _tell_master(self, exclude: str) -> None:
        """Every other live relay chains from the current master from now on."""
        for node in self.rollout_nodes:
            url = node["relay_url"]
            if url in (exclude, self.master_relay["url"]):
                continue
            try:
                await self._relay_post(url, "/set_master", {"master_url": self.master_relay["url"]},
                                       timeout=5.0)
            except RelayError as exc:
                logger.info("relay %s did not take the new master: %s", url, exc)

    async def _watch_master(self) -> None:
        """Elect a new master relay when the master is gone (nothing listens on its port,
        twice in a row) or silent for 30 s, while other relays live (a lone master is
        restarted by its node's supervisor instead). A master that is only slow must not be
        replaced: trainers would go on publishing to it and the chain would split."""
        misses, silent_since = 0, None
        while True:
            await asyncio.sleep(0.5)
            master = self.master_relay
            if master is None or len(self.rollout_nodes) < 2:
                continue
            state, _ = await self._relay_probe(master["url"])
            if state == "alive":
                misses, silent_since = 0, None
                continue
            if state == "silent":
                silent_since = silent_since or time.time()
            misses += 1
            if misses >= 2 and (state == "gone" or time.time() - silent_since > 30.0):
                async with self._election:
                    if self.master_relay is master and \
                            (await self._relay_probe(master["url"]))[0] != "alive":
                        await self._elect()
                misses, silent_since = 0, None

    async def _watch_engines(self) -> None:
        """Engines whose host went away. A node's supervisor reports an engine that died or
        hung, but a host that goes away takes its supervisor with it: every
        ``rollout.engine_heartbeat_s`` the controller opens a connection to each engine's port,
        and an engine that nothing listens for any more (refused) for ``2 x
        engine_heartbeat_s + 5`` s -- long enough for a living supervisor to have reported
        it -- or that does not answer at all for ``2 x rollout.engine_heartbeat_timeout_s``
        (a host that is silent: powered off, or its link down that long) is ``lost``: out of
        service, its open streams ended (``RolloutManager.engine_lost``), a fault recorded.
        A silence shorter than that (a link down for seconds) costs nothing: streams resume
        when the link does. A lost engine's supervisor that comes back restarts it."""
        r = self.cfg.rollout
        period = max(float(r.engine_heartbeat_s), 0.5)
        gone_s, silent_s = 2 * period + 5.0, 2 * float(r.engine_heartbeat_timeout_s)
        down: dict = {}  # engine name -> [its epoch, unreachable since, refused every time]
        while True:
            await asyncio.sleep(period)
            try:
                self._check_engines(down, await self._reach_engines(), gone_s, silent_s)
            except Exception:  # noqa: BLE001 - a watch that dies would leave hosts unwatched
                logger.exception("watching the engines failed; watching on")

    async def _reach_engines(self) -> list:
        engines = [e for e in self.manager.engines if not (e.restarting or e.evicted or e.lost)]
        return list(zip(engines, await asyncio.gather(*(reach(e.client.base_url)
                                                        for e in engines))))

    def _check_engines(self, down: dict, states: list, gone_s: float, silent_s: float,
                       now: Optional[float] = None) -> None:
        """One round of ``_watch_engines``: ``states``, (engine, reach()) pairs, seen ``now``."""
        now = time.time() if now is None else now
        for e, state in states:
            mark = down.get(e.name)
            if state == "alive" or (mark is not None and mark[0] != e.epoch):
                down.pop(e.name, None)
                mark = None
            if state == "alive" or e.restarting or e.evicted or e.lost:
                continue
            if mark is None:
                down[e.name] = [e.epoch, now, state == "gone"]
                continue
            mark[2] = mark[2] and state == "gone"
            waited = now - mark[1]
            if waited < (gone_s if mark[2] else silent_s):
                continue
            down.pop(e.name)
            reason = (f"nothing has listened on its port for {waited:.0f} s" if mark[2] else
                      f"it has not answered for {waited:.0f} s (2 x rollout."
                      f"engine_heartbeat_timeout_s)") + \
                " and its node's supervisor did not report it: its host is gone"
            ended = self.manager.engine_lost(e, reason)
            self._fault("engine", "lost", engine=e.name, url=e.client.base_url,
                        reason=reason, streams_ended=ended, seconds=round(waited, 1))
            self._maybe_host_lost(e)

    def _maybe_host_lost(self, engine) -> None:
        """Every engine of ``engine``'s host is lost: the host is (a fault record), and the
        leases its pull agent took from relays on other hosts (``rollout.relay=remote``) are
        released there now rather than at the lease TTL (a relay whose buffers they hold
        takes no newer version). Never for loopback: that host is the controller's own."""
        host = urllib.parse.urlsplit(engine.client.base_url).hostname or ""
        same = [e for e in self.manager.engines
                if urllib.parse.urlsplit(e.client.base_url).hostname == host]
        if not all(e.lost for e in same):
            return
        self._fault("host", "lost", host=host, engines=",".join(e.name for e in same))
        if not is_loopback(host):
            self.background.append(asyncio.get_running_loop().create_task(
                self._release_leases_of(host)))

    async def _release_leases_of(self, host: str) -> None:
        urls = {n["relay_url"] for n in self.rollout_nodes}
        if self.master_relay:
            urls.add(self.master_relay["url"])
        for url in sorted(urls):
            if urllib.parse.urlsplit(url).hostname == host:
                continue  # that host's own relay went with it
            try:
                answer = await self._relay_post(url, "/release_holder", {"host": host}, 5.0)
            except RelayError as exc:
                logger.info("relay %s could not release the leases of %s: %s", url, host, exc)
                continue
            if answer.get("released"):
                self._fault("host", "leases_released", host=host, relay=url,
                            leases=int(answer["released"]))

    def _fault(self, kind: str, what: str, **info) -> None:
        event = {"kind": kind, "what": what, "time": time.time(), **info}
        self.faults.append(event)
        self.metrics.log("fault", fault=kind, event=what,
                         **{k: v for k, v in info.items() if isinstance(v, (int, float, str))})
        logger.warning("fault %s: %s %s", kind, what, info)

    def _handle_by_url(self, url: str) -> Optional[EngineHandle]:
        return next((e for e in self.manager.engines if e.client.base_url == url.rstrip("/")),
                    None)

    async def _engine_states(self, request: web.Request):
        """Per engine URL (``?url=...``, repeated, to ask for some; else all): whether the
        manager has it paused, pulling or updating weights now, and ``busy_ago_s``, how long
        ago it last stopped being so (null: never, or busy now: 0). Node supervisors ask when
        a health check fails: a busy engine's failed check does not count."""
        wanted = {u.rstrip("/") for u in read_query(request, ENGINE_STATES_QUERY).get("url", [])}
        now = time.time()
        states = {}
        for e in self.manager.engines:
            url = e.client.base_url
            if wanted and url not in wanted:
                continue
            paused, pulling = bool(e.paused), bool(e.pulling)
            updating = bool(getattr(e, "updating", False))
            until = getattr(e, "busy_until", None)
            busy = paused or pulling or updating
            states[url] = {"name": e.name, "paused": paused, "pulling": pulling,
                           "updating": updating, "busy": busy,
                           "busy_ago_s": 0.0 if busy else (
                               None if until is None else round(max(0.0, now - until), 3)),
                           "healthy": bool(e.healthy), "restarting": bool(e.restarting),
                           "lost": e.lost,
                           "version": e.version, "in_flight": len(e.in_flight),
                           "relay": e.relay.url}
        return web.json_response({"engines": states})

    async def _engine_down(self, request: web.Request):
        body = await read_json(request, ENGINE_DOWN)
        engine = self._handle_by_url(body["url"])
        if engine is None:
            return error_response(404, "LMC-E405", f"no engine at {body['url']}")
        evict = bool(body.get("evict"))
        self.manager.engine_down(engine, str(body.get("reason", "")), evict)
        self._fault("engine", "evicted" if evict else "down", engine=engine.name,
                    reason=str(body.get("reason", ""))[:300])
        return web.json_response({"ok": True, "engine": engine.name})

    async def _engine_replaced(self, request: web.Request):
        body = await read_json(request, ENGINE_REPLACED)
        engine = self._handle_by_url(body["old_url"])
        if engine is None:
            return error_response(404, "LMC-E405", f"no engine at {body['old_url']}")
        old = self.manager.replace_engine(engine, SGLangClient(
            body["new_url"], retries=0, timeout_s=10, incremental_stream=True,
            pause_timeout_s=self.cfg.rollout.pause_timeout_s, api_key=engine.client.api_key))
        self._retire(old)
        for node in self.rollout_nodes:
            node["engines"] = [body["new_url"] if u == body["old_url"] else u
                               for u in node["engines"]]
        self._fault("engine", "restarted", engine=engine.name, url=body["new_url"])
        return web.json_response({"ok": True, "engine": engine.name})

    async def _relay_replaced(self, request: web.Request):
        """A node's supervisor restarted its relay (``publish``: as the master)."""
        body = await read_json(request, RELAY_REPLACED)
        old_url, new_url = body["old_url"].rstrip("/"), body["new_url"].rstrip("/")
        for node in self.rollout_nodes:
            if node["relay_url"] == old_url:
                node["relay_url"] = new_url
        for client in self.manager.replace_relay(old_url, RelayClient(new_url, self.token)):
            self._retire(client)
        publish = body.get("publish")
        if isinstance(publish, dict):
            async with self._election:
                self.master_relay = {"url": new_url, "publish_host": str(publish["host"]),
                                     "publish_port": int(publish["port"])}
                await self._tell_master(exclude=new_url)
            self.relay_failovers += 1
            self._fault("master_relay", "restarted", url=new_url)
        else:
            self._fault("relay", "restarted", url=new_url)
        return web.json_response({"ok": True})

    def _retire(self, client) -> None:
        """A replaced client is closed when the controller stops: calls still under way on it
        fail on their own (the process behind it is gone), never on a closed session."""
        self._retired_clients.append(client)

    async def _resumed(self, request: web.Request):
        """Trainer rank 0: the trainer world (re)started from a checkpoint and published."""
        body = await read_json(request, RESUMED)
        self.trainer_version = max(self.trainer_version, int(body["version"]))
        self.manager.drop_stale()
        self.manager.notify()
        restarts = int(body.get("restarts", 0))
        if restarts:
            self.trainer_restarts = max(self.trainer_restarts, restarts)
            self._fault("trainer", "resumed", step=int(body.get("step", 0)),
                        version=int(body["version"]), restarts=restarts)
        return web.json_response({"ok": True})

    async def _register(self, request: web.Request):
        body = await read_json(request, REGISTER)
        publish = body.get("publish")
        if publish is not None:
            if self.master_relay is not None and self.master_relay["url"] != body["relay_url"]:
                return error_response(409, "LMC-E404", "a master relay is already registered")
            self.master_relay = {"url": body["relay_url"], "publish_host": str(publish["host"]),
                                 "publish_port": int(publish["port"])}
        node = self._nodes_registered
        names = self._add_node(body["relay_url"], body["engines"], body.get("pull_agent"))
        return web.json_response({"ok": True, "node": node, "engines": names})

    async def _leave(self, request: web.Request):
        """A rollout node stopped gracefully: its engines leave (controller/elastic.py), and
        the node with them (its relay no longer counts for the master's election). The node
        of the master relay cannot leave this way: trainers publish to it."""
        body = await read_json(request, LEAVE)
        urls = {u.rstrip("/") for u in body["engines"]}
        engines = [e for e in self.manager.engines if e.client.base_url in urls]
        node = next((n for n in self.rollout_nodes if urls & {u.rstrip("/") for u in
                                                              n["engines"]}), None)
        if node is not None and self.master_relay is not None and \
                node["relay_url"].rstrip("/") == self.master_relay["url"].rstrip("/"):
            return error_response(409, "LMC-E404", "the master relay's node cannot leave a "
                                  "running job (trainers publish to it); stop it as a fault "
                                  "(a failover follows) or leave another node")
        grace = float(body.get("grace_s") or self.cfg.cluster.shutdown_grace_s)
        ended = await self.manager.retire(engines, grace)
        if node is not None:
            self.rollout_nodes.remove(node)
        logger.info("rollout node left: engines %s (%s)", ", ".join(e.name for e in engines),
                    ended)
        return web.json_response({"ok": True, "engines": [e.name for e in engines], **ended})

    async def _register_relay(self, request: web.Request):
        """A master relay, before its node's engines register (trainers may connect now)."""
        body = await read_json(request, REGISTER_RELAY)
        publish = body["publish"]
        if self.master_relay is not None and \
                await self._relay_health(self.master_relay["url"]) is not None:
            return error_response(409, "LMC-E404", "a master relay is already registered")
        self._master_claimed = True
        self.master_relay = {"url": body["relay_url"].rstrip("/"),
                             "publish_host": str(publish["host"]),
                             "publish_port": int(publish["port"])}
        return web.json_response({"ok": True})

    async def _cluster(self, request: web.Request):
        read_query(request, {})
        ready = self.ready and self.master_relay is not None
        # the newest version anyone holds (trainer, engines, relays): a restarted trainer
        # numbers its weights above it
        newest = max([self.trainer_version, self.manager.latest_relay_version]
                     + [e.version for e in self.manager.engines])
        return web.json_response({"ready": ready, "master_relay": self.master_relay,
                                  "rollout_nodes": len(self.rollout_nodes), "done": self.finished,
                                  "trainer_version": newest, **self.info})
