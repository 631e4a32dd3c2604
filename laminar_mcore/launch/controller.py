"""The controller: data module, rollout manager, reward service and the trainer's REST API.

Runs an asyncio loop (in its own thread of the launcher, or as its own process on a cluster):
the RolloutManager keeps engines busy and fills the experience buffer; trainer rank 0 takes
batches with ``GET /batch`` and reports each step with ``POST /trained``. The controller records
per trajectory its version and staleness at consumption, and keeps the books:
generated = consumed + buffered + discarded (with reasons).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from aiohttp import web

from ..data.pools import ExperienceBuffer, PartialResponsePool, PromptPool
from ..relay.client import PullSpec, RelayClient
from ..reward import RewardService
from ..rollout.client import SGLangClient
from ..rollout.manager import EngineHandle, RolloutManager

logger = logging.getLogger(__name__)

MODES = {  # mode -> (global barrier, admission bound eta)
    "laminar": (False, None),
    "one_step": (True, 1),
    "sync": (True, 0),
}


@dataclass
class TaskCodec:
    encode_prompt: Callable[[dict], List[int]]
    decode: Callable[[List[int]], str]


class Controller:
    def __init__(self, *, mode: str, engine_urls: List[str], relay_url: str, token: str,
                 rows: List[dict], codec: TaskCodec, reward_fn: str, reward_workers: int,
                 n_samples: int, batch_prompts: int, sampling: dict, capacity: int,
                 max_staleness: Optional[int], metrics, seed: int = 0, host: str = "127.0.0.1",
                 port: int = 0, length_fn=None, initial_state: Optional[dict] = None,
                 info: Optional[dict] = None, repack: Optional[dict] = None,
                 pull_spec: Optional[Callable[[int], PullSpec]] = None,
                 reward_timeout_s: float = 60.0):
        """``engine_urls`` may be empty and ``relay_url`` None: on a cluster, rollout nodes
        register their relay and engines with ``POST /register`` (see launch/cluster.py);
        ``info`` (model path, trainer stages) is what ``GET /cluster`` tells the other roles.
        ``pull_spec(i)`` says how the i-th engine of a node takes weights from its relay
        (shared memory for CPU engines, CUDA IPC on its GPUs for SGLang)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
        barrier, eta = MODES[mode]
        self.mode = mode
        self.token = token
        self.metrics = metrics
        self.batch_prompts = batch_prompts
        self.n_samples = n_samples
        self.host, self.port = host, port
        # cluster bookkeeping (multi-node roles find each other here)
        self.info = dict(info or {})
        self.ready = False  # set by the launcher when training may start
        self.finished = False  # set by the launcher when the run's summary is written
        self.master_relay: Optional[dict] = None
        self.rollout_nodes: List[dict] = []
        self._master_claimed = False
        self.trainer_done: Optional[dict] = None
        self.trainer_done_event = threading.Event()
        self.trainer_version = 0
        self.trainer_wait_s = 0.0  # time trainer rank 0 spent waiting for batches
        self.first_request: Optional[float] = None
        self.consumed: List[dict] = []
        self.max_staleness_observed = 0
        self.last_step_time = time.time()
        self.step_marks: List[tuple] = []  # (time of /trained, tokens of the step, trainer wait s)
        self._idle_mark: Optional[tuple] = None  # (time, engine idle seconds) at the first step
        self.buffer = ExperienceBuffer(group_size=n_samples)
        self.partial = PartialResponsePool()
        self.prompts = PromptPool(rows, n_samples=n_samples, seed=seed)
        self.reward = RewardService(reward_fn, workers=reward_workers, timeout_s=reward_timeout_s)
        self._engine_urls, self._relay_url = engine_urls, relay_url
        self._codec, self._sampling, self._capacity = codec, sampling, capacity
        self._eta = eta if mode != "laminar" else max_staleness
        self._barrier = barrier
        self._length_fn = length_fn
        self._seed = seed
        self._repack = dict(repack or {})
        self._pull_spec = pull_spec or (lambda index: PullSpec())
        self._initial_state = initial_state
        self.manager: Optional[RolloutManager] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="laminar-controller", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(f"controller did not start: {self.error}")
        if self.error:
            raise RuntimeError(f"controller did not start: {self.error}")
        return self.url

    def stop(self) -> None:
        if self.loop is not None and not self._stopped.is_set():
            self.loop.call_soon_threadsafe(self._shutdown_event.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.reward.close()

    def stop_generation(self, timeout_s: float = 60.0) -> None:
        """Stop dispatching and generating (in-flight requests are cancelled) but keep serving
        the API, so that rollout nodes still learn when the run is done."""
        if self.loop is None or self._stopped.is_set():
            return

        async def stop_manager():
            self.manager.stop()
            await self._manager_task

        asyncio.run_coroutine_threadsafe(stop_manager(), self.loop).result(timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the launcher
            self.error = exc
            logger.exception("controller failed")
            self._ready.set()
        finally:
            self._stopped.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._shutdown_event = asyncio.Event()
        handles = [self._handle(f"engine{i}", url, self._relay_url, i)
                   for i, url in enumerate(self._engine_urls)]
        self.manager = RolloutManager(
            handles, self.prompts, self.partial, self.buffer, score=self.reward.score,
            encode_prompt=self._codec.encode_prompt, decode=self._codec.decode,
            sampling=self._sampling, trainer_version=lambda: self.trainer_version,
            batch_trajectories=self.batch_prompts * self.n_samples,
            max_staleness=self._eta, barrier=self._barrier, length_fn=self._length_fn,
            seed=self._seed, **self._repack)
        if self._initial_state:
            self.load_state_dict(self._initial_state)
        app = web.Application()
        app.router.add_get("/batch", self._batch)
        app.router.add_post("/trained", self._trained)
        app.router.add_get("/state", self._state)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True,
                                                                   "done": self.finished}))
        app.router.add_post("/relay_role", self._relay_role)
        app.router.add_post("/register", self._register)
        app.router.add_get("/cluster", self._cluster)
        app.router.add_post("/done", self._done)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        self._manager_task = asyncio.create_task(self.manager.run())
        self._ready.set()
        await self._shutdown_event.wait()
        self.manager.stop()
        await self._manager_task
        for h in self.manager.engines:
            await h.client.close()
            await h.relay.close()
        await runner.cleanup()

    def _handle(self, name: str, url: str, relay_url: str, index: int) -> EngineHandle:
        """``index``: the engine's position on its node (which GPUs it has)."""
        # engines of a run stream incrementally (rollout.launcher.engine_command_from_config)
        client = SGLangClient(url, retries=0, timeout_s=10, incremental_stream=True)
        return EngineHandle(name, client,
                            RelayClient(relay_url, self.token), capacity=self._capacity,
                            pull=self._pull_spec(index))

    # ------------------------------------------------------------------ cluster API
    async def _json_body(self, request: web.Request) -> Optional[dict]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    async def _relay_role(self, request: web.Request):
        """The first rollout node to ask hosts the master relay (trainers publish to it);
        the others chain from it once it has registered."""
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        if not self._master_claimed:
            self._master_claimed = True
            return web.json_response({"master": True, **self.info})
        deadline = time.time() + float(request.query.get("timeout", "600"))
        while self.master_relay is None and time.time() < deadline:
            await asyncio.sleep(0.2)
        if self.master_relay is None:
            return web.json_response({"error": "the master relay has not registered"}, status=503)
        return web.json_response({"master": False, "master_url": self.master_relay["url"],
                                  **self.info})

    async def _register(self, request: web.Request):
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        body = await self._json_body(request)
        if (body is None or not isinstance(body.get("relay_url"), str)
                or not isinstance(body.get("engines"), list)
                or not all(isinstance(u, str) for u in body["engines"])):
            return web.json_response({"error": "expected {relay_url: str, engines: [str], "
                                               "publish?: {host, port}}"}, status=400)
        publish = body.get("publish")
        if publish is not None:
            if self.master_relay is not None:
                return web.json_response({"error": "a master relay is already registered"},
                                         status=409)
            self.master_relay = {"url": body["relay_url"], "publish_host": str(publish["host"]),
                                 "publish_port": int(publish["port"])}
        node = len(self.rollout_nodes)
        names = []
        for i, url in enumerate(body["engines"]):
            handle = self._handle(f"node{node}-engine{i}", url, body["relay_url"], i)
            self.manager.add_engine(handle)
            names.append(handle.name)
        self.rollout_nodes.append({"relay_url": body["relay_url"], "engines": body["engines"]})
        logger.info("rollout node %d registered: relay %s, engines %s", node, body["relay_url"],
                    body["engines"])
        return web.json_response({"ok": True, "node": node, "engines": names})

    async def _cluster(self, request: web.Request):
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        ready = self.ready and self.master_relay is not None
        return web.json_response({"ready": ready, "master_relay": self.master_relay,
                                  "rollout_nodes": len(self.rollout_nodes), "done": self.finished,
                                  **self.info})

    async def _done(self, request: web.Request):
        """Trainer rank 0: training finished (``{"steps", "version"}``)."""
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        body = await self._json_body(request)
        if body is None or "version" not in body:
            return web.json_response({"error": "expected {steps, version}"}, status=400)
        self.trainer_done = body
        self.trainer_done_event.set()
        return web.json_response({"ok": True})

    # ------------------------------------------------------------------ trainer API
    def _authorized(self, request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def _batch(self, request: web.Request):
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        timeout = float(request.query.get("timeout", "30"))
        if self.first_request is None:
            self.first_request = time.time()
        batch = await asyncio.to_thread(self.buffer.take, self.batch_prompts, timeout)
        if batch is None:
            return web.Response(status=204)
        now = time.time()
        staleness = [self.trainer_version - t.weight_version for t in batch]
        for t in batch:
            t.timings["consumed"] = now
            self.consumed.append({"uid": t.uid, "version": t.weight_version,
                                  "staleness": self.trainer_version - t.weight_version,
                                  "reward": t.reward, "tokens": len(t.response_ids)})
        self.max_staleness_observed = max([self.max_staleness_observed] + staleness)
        return web.json_response({"trajectories": [t.to_dict() for t in batch],
                                  "staleness": staleness})

    async def _trained(self, request: web.Request):
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        body = await request.json()
        step, version = int(body["step"]), int(body["version"])
        self.trainer_version = version
        self.trainer_wait_s += float(body.get("wait_s", 0.0))
        now = time.time()
        elapsed, self.last_step_time = now - self.last_step_time, now
        batch = self.consumed[-self.batch_prompts * self.n_samples:]
        tokens = sum(c["tokens"] for c in batch)
        self.step_marks.append((now, tokens, float(body.get("wait_s", 0.0))))
        if len(self.step_marks) == 1:
            self._idle_mark = (now, self.manager.engine_idle_seconds())
        stats = {k: v for k, v in dict(body.get("stats", {})).items()
                 if isinstance(v, (int, float)) and k not in ("version", "step")}
        self.metrics.log(
            "train", step=step, version=version, reward_mean=sum(c["reward"] for c in batch) / max(len(batch), 1),
            staleness_mean=sum(c["staleness"] for c in batch) / max(len(batch), 1),
            staleness_max=max((c["staleness"] for c in batch), default=0),
            tokens_per_s=tokens / max(elapsed, 1e-9), step_seconds=elapsed,
            buffered=self.buffer.buffered, generated=self.manager.stats.generated,
            engine_pulls=self.manager.stats.pulls, repacked=self.manager.stats.repacked, publish_blocked_s=body.get("publish_blocked_s", 0.0),
            **stats)
        return web.json_response({"ok": True})

    async def _state(self, request: web.Request):
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        return web.json_response(self.state_dict())

    def state_dict(self) -> dict:
        """What a training checkpoint keeps of the controller (taken on its event loop)."""
        return {"prompt_pool": self.prompts.state_dict(), "buffer": self.buffer.state_dict(),
                "partial": self.partial.state_dict(), "trainer_version": self.trainer_version,
                "generated": self.manager.stats.generated if self.manager else 0,
                "accepted": self.manager.accepted if self.manager else 0,
                "max_staleness_observed": self.max_staleness_observed}

    def load_state_dict(self, state: dict) -> None:
        """Resume the data module. Trajectories in flight at the save were generated by
        engines that are gone: they are counted as discarded ("restart"), never lost."""
        self.prompts.load_state_dict(state["prompt_pool"])
        self.buffer.load_state_dict(state["buffer"])
        self.trainer_version = int(state["trainer_version"])
        self.max_staleness_observed = int(state.get("max_staleness_observed", 0))
        lost = len(state.get("partial", []))
        self.manager.stats.generated = int(state["generated"]) + lost
        if lost:
            self.buffer.discard(lost, "restart")
        for item in state.get("partial", []):
            self.buffer.drop_group(item["group_id"], "restart_group")
        # The admission budget resumes from what can still be trained on: consumed and
        # buffered trajectories, not those lost in flight at the save.
        self.manager.accepted = self.buffer.consumed + self.buffer.buffered

    def utilisation(self) -> dict:
        """Trainer-consumed tokens/s and idle fractions in the steady state: from the end of the
        first step (start-up, model build and the first batch excluded in every mode) to the
        end of the last; over the whole run when there is a single step."""
        if len(self.step_marks) >= 2:
            span = max(self.step_marks[-1][0] - self.step_marks[0][0], 1e-9)
            tokens = sum(t for _, t, _ in self.step_marks[1:])
            wait = sum(w for _, _, w in self.step_marks[1:])
        else:
            span = max(time.time() - (self.first_request or time.time()), 1e-9)
            tokens = sum(c["tokens"] for c in self.consumed)
            wait = self.trainer_wait_s
        return {"trainer_tokens_per_s": tokens / span,
                "trainer_idle_fraction": min(wait / span, 1.0),
                "engine_idle_fraction": (self.manager.engine_idle_fraction(self._idle_mark)
                                         if self.manager else 0.0),
                "consumed_tokens": sum(c["tokens"] for c in self.consumed), "span_s": span}

    def books(self) -> dict:
        s = self.manager.stats if self.manager else None
        return {"trajectories_generated": s.generated if s else 0,
                "trajectories_consumed": self.buffer.consumed,
                "trajectories_buffered": self.buffer.buffered,
                "trajectories_discarded": sum(self.buffer.discarded.values()),
                "discarded_reasons": dict(self.buffer.discarded),
                "max_staleness_observed": self.max_staleness_observed,
                "engine_pulls": s.pulls if s else 0, "resumed": s.resumed if s else 0,
                "repacked": s.repacked if s else 0, "repack_rounds": s.repack_rounds if s else 0,
                "reward_worker_restarts": self.reward.restarts,
                "engine_versions": ({e.name: e.version for e in self.manager.engines}
                                    if self.manager else {}),
                "unhealthy_engines": list(s.unhealthy) if s else []}
