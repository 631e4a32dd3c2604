"""The controller's master relays: which relay of each stripe the trainers publish to, and
who takes over when it dies.

A version is published to one master relay, or striped over ``weight_sync.master_relays`` of
them (issue 52: whole pipeline stages each, ``weights/shards.py``); every rollout node runs one
relay per stripe, chained from that stripe's master. Rollout nodes ask each of their relays'
role (``POST /relay_role`` with ``stripe`` and ``node``): a stripe's master is the relay of
the first node to ask that hosts fewer than ``ceil(stripes / cluster.rollout_nodes)`` masters
(so the trainers' versions enter the tier through as many hosts as there are stripes, up to
the rollout nodes); the others chain from it once it has registered (``/register_relay``). A
claim whose relay has not registered within ``CLAIM_S`` lapses (its node died starting it) and
the next asker may take it. Unstriped, the first node to ask hosts the master.

Each stripe's master is watched: when it is gone (or silent for 30 s) while other relays of the
stripe live, the first live one of them is promoted and the rest chain from it; a node's
supervisor that restarts a relay asks its role again (``/relay_role``: it rejoins its stripe's
chain, or hosts the stripe's master when no other relay of the stripe is left) and reports it
(``/relay_replaced``). Trainers find each stripe's master in ``GET /cluster``
(``master_relays``; ``master_relay`` is stripe 0's).

Mixed into ``Controller`` with ``ClusterAPI`` (controller/cluster.py), whose ``rollout_nodes``
(each with ``relay_urls``, one per stripe), ``_fault``, ``_retire`` and ``manager`` it uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, List, Optional

from aiohttp import web

from ..netutil import BadRequest, Field, error_response, read_json, read_query
from ..relay.client import RelayClient, RelayError, probe_relay
from ..relay.striped import relay_client
from ..weights.shards import run_stripes

logger = logging.getLogger(__name__)

STRIPE = Field("int", low=0, high=4095)
PUBLISH = Field("dict", fields={"host": Field("str", required=True, max_len=255),
                                "port": Field("int", required=True, low=1, high=65535)})
RELAY_ROLE = {"stripe": STRIPE, "node": Field("str", max_len=255)}
RELAY_ROLE_QUERY = {"timeout": Field("number", low=0, high=86400)}
REGISTER_RELAY = {"relay_url": Field("url", required=True, max_len=300),
                  "publish": Field("dict", required=True, fields=PUBLISH.fields),
                  "stripe": STRIPE, "node": Field("str", max_len=255)}
RELAY_REPLACED = {"old_url": Field("url", required=True, max_len=300),
                  "new_url": Field("url", required=True, max_len=300), "publish": PUBLISH,
                  "stripe": STRIPE}
SILENT_S = 30.0  # a master relay silent this long while others live is replaced
# A master's claim lapses if its relay has not registered by then: longer than a relay's start
# budget (ServerProcess: 180 s, its publish port 60 s, the report's retries 60 s).
CLAIM_S = 360.0


class MasterRelays:
    """The master relays half of ``Controller`` (see the module docstring)."""

    def _init_masters(self) -> None:
        self.stripes = run_stripes(self.cfg)
        # stripe -> {"url", "publish_host", "publish_port"} of its master relay (None: none yet)
        self.master_relays: List[Optional[dict]] = [None] * self.stripes
        self._claims: Dict[int, tuple] = {}  # stripe -> (the claiming node, when)
        self._locks: Dict[int, asyncio.Lock] = {}  # one election at a time per stripe

    def _election_of(self, stripe: int) -> asyncio.Lock:
        return self._locks.setdefault(stripe, asyncio.Lock())

    @property
    def _master_claimed(self) -> List[bool]:
        """Per stripe: whether a node has claimed (or registered) its master."""
        return [s in self._claims for s in range(self.stripes)]

    @property
    def master_relay(self) -> Optional[dict]:
        """Stripe 0's master relay (the only one of an unstriped tier)."""
        return self.master_relays[0]

    def _add_master_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/relay_role", self._relay_role)
        router.add_post("/register_relay", self._register_relay)
        router.add_post("/relay_replaced", self._relay_replaced)

    def _stripe(self, body: dict) -> int:
        stripe = int(body.get("stripe", 0))
        if stripe >= self.stripes:
            raise BadRequest("stripe", f"is {stripe}, not one of this run's {self.stripes} "
                             "stripes (weight_sync.master_relays)")
        return stripe

    def _set_master(self, stripe: int, url: str, publish_host, publish_port) -> None:
        """Stripe ``stripe``'s master relay: its URL and where trainers publish to it."""
        self.master_relays[stripe] = {"url": url, "publish_host": str(publish_host),
                                      "publish_port": int(publish_port)}

    def stripe_relays(self, stripe: int) -> List[str]:
        """Every registered rollout node's relay of ``stripe``, in the order they registered."""
        return [n["relay_urls"][stripe] for n in self.rollout_nodes]

    def relay_urls(self) -> List[str]:
        """Every relay the controller knows now: each node's, of every stripe, and the masters."""
        urls = [u for n in self.rollout_nodes for u in n["relay_urls"]]
        urls += [m["url"] for m in self.master_relays if m is not None]
        return list(dict.fromkeys(urls))

    def _claim(self, node: Optional[str], stripe: int) -> bool:
        """Whether ``node`` now hosts ``stripe``'s master (claimed here): the stripe has none
        and no live claim, and ``node`` hosts fewer than its share of the masters
        (``ceil(stripes / cluster.rollout_nodes)``; unstriped, or a node that gives no name:
        the first to ask)."""
        if self.master_relays[stripe] is not None:
            return False
        claim = self._claims.get(stripe)
        if claim is not None and node and claim[0] == node:
            return True  # the claimant asks again (its relay's start failed, an answer lost)
        if claim is not None and time.time() - claim[1] < CLAIM_S:
            return False
        if self.stripes > 1 and node:
            share = -(-self.stripes // max(1, int(self.cfg.cluster.rollout_nodes)))
            held = sum(1 for s, (n, _t) in self._claims.items() if n == node and s != stripe)
            if held >= share:
                return False
        if claim is not None:
            logger.warning("the claim of node %s on stripe %d's master lapsed (no relay "
                           "registered within %g s); %s takes it", claim[0], stripe, CLAIM_S,
                           node)
        self._claims[stripe] = (node, time.time())
        return True

    async def _relay_role(self, request: web.Request):
        """Whether the asking relay of ``stripe`` is its master (trainers publish to it), or
        which master it chains from (answered once that master has registered)."""
        timeout = read_query(request, RELAY_ROLE_QUERY).get("timeout", 600.0)
        body = await read_json(request, RELAY_ROLE, RELAY_ROLE_QUERY)
        stripe = self._stripe(body)
        answer = {"stripe": stripe, "stripes": self.stripes, **self.info}
        deadline = time.time() + timeout
        while self.master_relays[stripe] is None and not self.closing:
            if self._claim(body.get("node"), stripe):
                return web.json_response({"master": True, **answer})
            if time.time() >= deadline:
                break
            await asyncio.sleep(0.2)
        if self.closing:
            return error_response(503, "LMC-E402", "shutting down")
        if self.master_relays[stripe] is None:
            claim = self._claims.get(stripe)
            return error_response(503, "LMC-E406", f"the master relay of stripe {stripe} has "
                                  "not registered yet" + (
                                      f" (rollout node {claim[0]} is starting it)"
                                      if claim and claim[0] else ""))
        async with self._election_of(stripe):
            # A relay restarting after a crash: join the master if it lives; else one of the
            # other relays is elected; if none is left, the asker becomes the master.
            # (a master that is only slow is waited for: two masters would split the chain)
            state = "silent"
            for _ in range(15):
                state, _info = await self._relay_probe(self.master_relays[stripe]["url"])
                if state != "silent":
                    break
            if state == "gone" and await self._elect(stripe) is None:
                return web.json_response({"master": True, **answer})
        return web.json_response({"master": False,
                                  "master_url": self.master_relays[stripe]["url"], **answer})

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

    async def _elect(self, stripe: int = 0) -> Optional[dict]:
        """``stripe``'s master relay is dead: promote the first live relay of the stripe's
        others (in the order their nodes registered), point the rest at it; returns the new
        master or None when no relay of the stripe is left. Call holding ``self._election_of(stripe)``."""
        master = self.master_relays[stripe]
        dead = master["url"] if master else None
        live = []
        for url in self.stripe_relays(stripe):
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
            self._set_master(stripe, url, info["data_host"], answer["publish_port"])
            await self._tell_master(stripe, exclude=url)
            self.relay_failovers += 1
            self._fault("master_relay", "elected", url=url, dead=dead, stripe=stripe,
                        seconds=round(time.time() - t0, 3))
            return self.master_relays[stripe]
        return None

    async def _tell_master(self, stripe: int, exclude: str) -> None:
        """Every other live relay of ``stripe`` chains from its current master from now on."""
        master = self.master_relays[stripe]["url"]
        for url in self.stripe_relays(stripe):
            if url in (exclude, master):
                continue
            try:
                await self._relay_post(url, "/set_master", {"master_url": master}, timeout=5.0)
            except RelayError as exc:
                logger.info("relay %s did not take the new master: %s", url, exc)

    async def _watch_masters(self) -> None:
        await asyncio.gather(*(self._watch_master(s) for s in range(self.stripes)))

    async def _watch_master(self, stripe: int = 0) -> None:
        """Elect a new master relay of ``stripe`` when its master is gone (nothing listens on
        its port, twice in a row) or silent for 30 s, while other relays live (a lone master
        is restarted by its node's supervisor instead). A master that is only slow must not be
        replaced: trainers would go on publishing to it and the chain would split."""
        misses, silent_since = 0, None
        while True:
            await asyncio.sleep(0.5)
            master = self.master_relays[stripe]
            if master is None or len(self.rollout_nodes) < 2:
                continue
            state, _ = await self._relay_probe(master["url"])
            if state == "alive":
                misses, silent_since = 0, None
                continue
            if state == "silent":
                silent_since = silent_since or time.time()
            misses += 1
            if misses >= 2 and (state == "gone" or time.time() - silent_since > SILENT_S):
                async with self._election_of(stripe):
                    if self.master_relays[stripe] is master and \
                            (await self._relay_probe(master["url"]))[0] != "alive":
                        await self._elect(stripe)
                misses, silent_since = 0, None

    async def _register_relay(self, request: web.Request):
        """A master relay, before its node's engines register (trainers may connect now)."""
        body = await read_json(request, REGISTER_RELAY)
        stripe, publish = self._stripe(body), body["publish"]
        master = self.master_relays[stripe]
        if master is not None and await self._relay_health(master["url"]) is not None:
            return error_response(409, "LMC-E404", f"a master relay of stripe {stripe} is "
                                  "already registered")
        self._claims[stripe] = (body.get("node"), time.time())
        self._set_master(stripe, body["relay_url"].rstrip("/"), publish["host"], publish["port"])
        return web.json_response({"ok": True})

    async def _relay_replaced(self, request: web.Request):
        """A node's supervisor restarted its relay of ``stripe`` (``publish``: as the master)."""
        body = await read_json(request, RELAY_REPLACED)
        stripe = self._stripe(body)
        old_url, new_url = body["old_url"].rstrip("/"), body["new_url"].rstrip("/")
        for node in self.rollout_nodes:
            node["relay_urls"] = [new_url if u == old_url else u for u in node["relay_urls"]]
            node["relay_url"] = node["relay_urls"][0]
        for client in self.manager.replace_relay(
                old_url, new_url, lambda url: relay_client(url, self.token)):
            self._retire(client)
        publish = body.get("publish")
        if isinstance(publish, dict):
            async with self._election_of(stripe):
                self._set_master(stripe, new_url, publish["host"], publish["port"])
                await self._tell_master(stripe, exclude=new_url)
            self.relay_failovers += 1
            self._fault("master_relay", "restarted", url=new_url, stripe=stripe)
        else:
            self._fault("relay", "restarted", url=new_url, stripe=stripe)
        return web.json_response({"ok": True})

    async def newest_at_masters(self) -> int:
        """The newest version any relay of any stripe holds (0: none, or unstriped: the relay
        watcher sees it). A striped node's relays count a version once every stripe holds it;
        a restarted trainer must number its weights above each stripe's newest -- its master's,
        or, when that master died with the trainer, its chained relays' -- or one number would
        name two different versions on the stripes that kept the old one. Asked of every relay
        at once (2 s each), only when a restarted trainer asks (``GET /cluster?newest=1``)."""
        if self.stripes == 1:
            return 0

        async def one(url: str) -> int:
            client = RelayClient(url, self.token, timeout_s=2.0)
            try:
                return int((await client.latest()).get("version") or 0)
            except (RelayError, OSError, asyncio.TimeoutError):
                return 0  # gone: what it held is no longer anyone's to pull
            finally:
                await client.close()

        return max([0] + list(await asyncio.gather(*(one(u) for u in self.relay_urls()))))
