"""The pull agent: pulls run on the engine's machine when the engine's relay is on another one.

A rollout node started with ``rollout.relay=remote`` runs no relay: its engines take every
version from a relay on another node through Mooncake's transfer engine
(``weight_sync.engine_transport``: ``mooncake``). The read must land in the memory of the
engine's machine, so the rollout node process serves a small HTTP agent (``POST /pull``,
run-token auth) that runs the engine's ``Puller`` locally; the controller, which decides *when*
an engine pulls (between trajectories), calls it through ``AgentPuller``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Dict, List, Optional

import aiohttp
from aiohttp import web

from ..netutil import engine_api_key, error_response, token_middleware
from ..relay.client import RelayClient, RelayError, WeightApplyError
from ..relay.transports import Puller, PullSpec, make_puller
from ..weights.engine_layout import EngineLayoutError
from .client import EngineError, SGLangClient

logger = logging.getLogger(__name__)


class PullAgent:
    """Serves ``POST /pull {"engine": i, "current_version": v}`` for this node's engines: runs
    engine i's puller against ``relay_url`` here and answers ``{"version": v or null}``; a
    relay failure is a 502 with ``kind: relay``, an engine failure ``kind: engine``, a version
    that failed to apply a 500 with ``kind: apply`` and ``mixed``."""

    def __init__(self, relay_url: str, engine_urls: List[str], specs: List[PullSpec], token: str,
                 host: str = "127.0.0.1"):
        self.relay_url, self.engine_urls, self.specs = relay_url, list(engine_urls), list(specs)
        self.token, self.host = token, host
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self.error: Optional[BaseException] = None

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="laminar-pull-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self.error is not None:
            raise RuntimeError(f"LMC-E209: the pull agent did not start: {self.error}")
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self.error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        relay = RelayClient(self.relay_url, self.token, timeout_s=60)
        engines = [SGLangClient(u, retries=0, timeout_s=60, api_key=engine_api_key(self.token))
                   for u in self.engine_urls]
        pullers: List[Puller] = [make_puller(s) for s in self.specs]
        locks: Dict[int, asyncio.Lock] = {i: asyncio.Lock() for i in range(len(engines))}

        async def pull(request):
            try:
                body = await request.json()
                i, current = int(body["engine"]), int(body["current_version"])
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                    ValueError) as exc:
                return error_response(400, "LMC-E400", f"bad request: expected {{engine, "
                                      f"current_version}}: {exc!r}")
            if not 0 <= i < len(engines):
                return error_response(400, "LMC-E400", f"bad request: engine {i} is not one of "
                                      f"this node's {len(engines)}")
            async with locks[i]:
                try:
                    version = await pullers[i].pull(relay, engines[i], current)
                except WeightApplyError as exc:
                    return web.json_response({"error": str(exc), "kind": "apply",
                                              "mixed": exc.mixed}, status=500)
                except RelayError as exc:
                    return web.json_response({"error": str(exc), "kind": "relay"}, status=502)
                except EngineError as exc:
                    return web.json_response({"error": str(exc), "kind": "engine"}, status=502)
                except EngineLayoutError as exc:  # engine_pull=shard where it cannot be
                    return web.json_response({"error": str(exc), "kind": "layout"}, status=409)
            return web.json_response({"version": version})

        app = web.Application(middlewares=[token_middleware(self.token)])
        app.router.add_post("/pull", pull)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.url = f"http://{self.host}:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await relay.close()
            for e in engines:
                await e.close()
            for p in pullers:
                p.close()


class AgentPuller(Puller):
    """The controller's side: engine ``index`` of a node pulls through that node's agent
    (``relay`` and ``engine`` clients are the controller's; the agent has its own)."""

    def __init__(self, agent_url: str, index: int, token: str, timeout_s: float = 3600.0):
        super().__init__(PullSpec("agent"))
        self.agent_url, self.index, self.token, self.timeout_s = agent_url, index, token, timeout_s
        self._session: Optional[aiohttp.ClientSession] = None

    async def pull(self, relay, engine, current_version: int) -> Optional[int]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"})
        try:
            async with self._session.post(
                    self.agent_url + "/pull",
                    json={"engine": self.index, "current_version": current_version},
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                body = json.loads(await r.text() or "{}")
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
            raise EngineError("pull agent", None,
                              f"LMC-E600: {self.agent_url} failed: {exc!r}") from None
        if r.status == 200:
            return body.get("version")
        kind, message = body.get("kind"), body.get("error", f"HTTP {r.status}")
        if kind == "apply":
            raise WeightApplyError(message, mixed=bool(body.get("mixed")))
        if kind == "relay":
            raise RelayError(message)
        if kind == "layout":
            raise EngineLayoutError(message)
        raise EngineError("pull agent", r.status, message)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
