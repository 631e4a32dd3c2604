"""The controller's cluster and fault-isolation API: how the roles of a run find each other and
how failures are isolated.

Rollout nodes register their relays and engines (``POST /register``); every role learns where
the others are from ``GET /cluster``. The master relays -- which relay of each stripe the
trainers publish to, and the election when one dies -- are controller/masters.py's. Node
supervisors report an engine that died or hung (``/engine_down``) and its replacement
(``/engine_replaced``), and ask whether an engine whose health check failed was busy --
paused, pulling or updating weights -- which is not a failure (``GET /engine_states``); trainer
rank 0 a restart of the trainer world (``/resumed``). Engines are watched too, for the case no
supervisor reports: a host that went away (every process killed, powered off, its link down
for long) -- its engines are ``lost``, their streams ended, and relays on other hosts release
the leases its pull agent held. Every event is recorded (``faults``, metrics "fault" records)
and counted in the books.

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

from ..netutil import (BadRequest, Field, engine_api_key, error_response, is_loopback,
                       read_json, read_query)
from ..relay.client import RelayError
from ..relay.striped import relay_client
from ..relay.transports import make_puller
from ..rollout.client import SGLangClient
from ..rollout.launcher import engine_pull_spec
from ..rollout.pull_agent import AgentPuller
from .engines import EngineHandle
from .masters import PUBLISH, MasterRelays

logger = logging.getLogger(__name__)

# what each cluster endpoint accepts (netutil.check_fields: a bad field is a 400 naming it)
URL = Field("url", max_len=300)
REGISTER = {"relay_url": Field("url", required=True, max_len=300),
            "engines": Field("list", required=True, max_len=4096, item=URL),
            "publish": PUBLISH, "pull_agent": URL,
            # a striped tier (weight_sync.master_relays): the node's relay of every stripe
            "relay_urls": Field("list", max_len=4096, item=URL)}
LEAVE = {"engines": Field("list", required=True, max_len=4096, item=URL),
         "grace_s": Field("number", low=0, high=86400)}
ENGINE_DOWN = {"url": Field("url", required=True, max_len=300),
               "reason": Field("str", max_len=65536), "evict": Field("bool")}
ENGINE_REPLACED = {"old_url": Field("url", required=True, max_len=300),
                   "new_url": Field("url", required=True, max_len=300)}
RESUMED = {"step": Field("int", low=0), "version": Field("int", required=True, low=0),
           "restarts": Field("int", low=0)}
ENGINE_STATES_QUERY = {"url": Field("list", max_len=4096, item=URL)}
CLUSTER_QUERY = {"newest": Field("bool")}  # trainer_version counts every stripe's relays


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


class ClusterAPI(MasterRelays):
    """The cluster and fault-isolation half of ``Controller`` (see the module docstring)."""

    def _init_cluster(self) -> None:
        self._init_masters()  # each stripe's master relay (controller/masters.py)
        self.rollout_nodes: List[dict] = []
        self._nodes_registered = 0  # names stay unique when nodes leave and others join
        # fault isolation: what failed and came back (books, metrics "fault" records)
        self.faults: List[dict] = []
        self.trainer_restarts = 0
        self.relay_failovers = 0
        self._retired_clients: list = []
        self.background: List[asyncio.Task] = []  # cancelled when the controller stops

    def _add_cluster_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/register", self._register)
        router.add_get("/cluster", self._cluster)
        router.add_get("/engine_states", self._engine_states)
        router.add_post("/resumed", self._resumed)
        router.add_post("/engine_down", self._engine_down)
        router.add_post("/engine_replaced", self._engine_replaced)
        router.add_post("/leave", self._leave)
        self._add_master_routes(router)  # controller/masters.py

    # ------------------------------------------------------------------ engines
    def _add_node(self, relay_url: str, engine_urls: List[str],
                  pull_agent: Optional[str] = None,
                  relay_urls: Optional[List[str]] = None) -> List[str]:
        """Register a rollout node's relay and engines (``POST /register``); returns the
        engines' names. They start on their own weights and pull from ``relay_url`` between
        trajectories, through ``weight_sync.engine_transport``. ``pull_agent``: the URL of the
        node's pull agent when its engines pull from a relay on another node
        (``rollout.relay=remote``): pulls then run there, not here. ``relay_urls``: the node's
        relay of every stripe, in stripe order (``weight_sync.master_relays``), read by its
        engines as one (``relay.striped.StripedRelay``)."""
        relays = [u.rstrip("/") for u in (relay_urls or [relay_url])]
        if len(relays) != self.stripes:
            raise BadRequest("relay_urls", f"names {len(relays)} relays where this run's "
                             f"versions take {self.stripes} stripes (weight_sync.master_relays):"
                             " register one relay per stripe, in stripe order", "LMC-E518")
        node = self._nodes_registered
        self._nodes_registered += 1
        names = []
        for i, url in enumerate(engine_urls):
            if pull_agent:
                puller = AgentPuller(pull_agent, i, self.token)
            else:
                puller = make_puller(engine_pull_spec(self.cfg.rollout, i, self.cfg.weight_sync,
                                                      self.task.model_path))
            # engines of a run stream incrementally (rollout.launcher.engine_command_from_config)
            handle = EngineHandle(
                f"node{node}-engine{i}",
                SGLangClient(url, retries=0, timeout_s=10, incremental_stream=True,
                             pause_timeout_s=self.cfg.rollout.pause_timeout_s,
                             api_key=engine_api_key(self.token)),
                relay_client(",".join(relays), self.token), puller,
                capacity=self.cfg.rollout.max_running_requests)
            self.manager.add_engine(handle)
            names.append(handle.name)
        self.rollout_nodes.append({"relay_url": relays[0], "relay_urls": relays,
                                   "engines": list(engine_urls)})
        logger.info("rollout node %d registered: relay %s, engines %s", node,
                    ",".join(relays), engine_urls)
        return names

    # ------------------------------------------------------------------ cluster API
    # ------------------------------------------------------------------ fault isolation
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
        urls = set(self.relay_urls())
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
        if publish is not None:  # (an unstriped tier's master, registered with its engines)
            if self.stripes > 1:
                return error_response(409, "LMC-E518", "a striped tier's master relays "
                                      "register by stripe (POST /register_relay)")
            if self.master_relay is not None and self.master_relay["url"] != body["relay_url"]:
                return error_response(409, "LMC-E404", "a master relay is already registered")
        node = self._nodes_registered
        names = self._add_node(body["relay_url"], body["engines"], body.get("pull_agent"),
                               body.get("relay_urls"))
        if publish is not None:
            self._set_master(0, body["relay_url"], publish["host"], publish["port"])
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
        masters = {m["url"].rstrip("/") for m in self.master_relays if m is not None}
        if node is not None and masters & set(node["relay_urls"]):
            return error_response(409, "LMC-E404", "a master relay's node cannot leave a "
                                  "running job (trainers publish to it); stop it as a fault "
                                  "(a failover follows) or leave another node")
        grace = float(body.get("grace_s") or self.cfg.cluster.shutdown_grace_s)
        ended = await self.manager.retire(engines, grace)
        for e in engines:  # their clients close when the controller stops (none is used now)
            self._retire(e.client)
            if not any(o.relay is e.relay for o in self.manager.engines) and \
                    not any(c is e.relay for c in self._retired_clients):
                self._retire(e.relay)  # (a node's engines share theirs: once all have left)
        if node is not None:
            self.rollout_nodes.remove(node)
        logger.info("rollout node left: engines %s (%s)", ", ".join(e.name for e in engines),
                    ended)
        return web.json_response({"ok": True, "engines": [e.name for e in engines], **ended})

    async def _cluster(self, request: web.Request):
        newest_asked = read_query(request, CLUSTER_QUERY).get("newest", False)
        ready = self.ready and all(m is not None for m in self.master_relays)
        # the newest version anyone holds (trainer, engines, relays; with ?newest=1 in a
        # striped tier every relay of every stripe): a restarted trainer numbers its weights
        # above it
        newest = max([self.trainer_version, self.manager.latest_relay_version,
                      await self.newest_at_masters() if newest_asked else 0]
                     + [e.version for e in self.manager.engines])
        return web.json_response({"ready": ready, "master_relay": self.master_relay,
                                  "master_relays": self.master_relays,
                                  "rollout_nodes": len(self.rollout_nodes), "done": self.finished,
                                  "trainer_version": newest, **self.info})
