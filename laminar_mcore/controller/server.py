"""The controller: data module, rollout manager, reward service and the trainer's REST API.

Runs an asyncio loop (in its own thread of the launcher, or as its own process on a cluster):
the RolloutManager keeps engines busy and fills the experience buffer; trainer rank 0 takes
batches with ``GET /batch`` and reports each step with ``POST /trained`` (controller/batches.py).
The controller records per trajectory its version and staleness at consumption, and keeps the
books: generated = consumed + buffered + discarded (with reasons; controller/books.py). What
rollout nodes, relays and their supervisors call (registration, failures, the master relay's
election) is controller/cluster.py; trainer nodes' liveness controller/trainers.py.

Every endpoint but ``/health``, ``/metrics`` and ``/metrics/targets`` (Prometheus' discovery: the
addresses of those ``/metrics``) proves the run token; every body and query is checked field by
field (a bad one is a 400 naming the field). Stopping (``stop()``, or SIGTERM when the controller
runs in a process's main thread) answers the long polls (``/batch``, ``/relay_role``) at once
with 503 "shutting down" and cancels handlers still running after ``SHUTDOWN_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

from aiohttp import web

from ..config.budgets import raise_open_files_limit
from ..config.schema import LaminarConfig
from ..data.pools import ExperienceBuffer, PartialResponsePool, PromptPool
from ..data.trace import TrajectoryTrace
from ..data.trajectory import Trajectory
from ..errors import within
from ..metrics.prometheus import STALENESS_BUCKETS, Histogram, Scrape
from ..netutil import read_query, token_middleware
from ..reward import RewardService
from ..rollout.launcher import served_context_length
from .batches import TrainerAPI
from .books import RunBooks
from .cluster import ClusterAPI
from .engines import RolloutData
from .episode import SingleTurn, TaskCodec, episode_plugin
from .evaluation import evaluate
from .manager import RolloutManager
from .metrics import controller_metrics, scrape_targets
from ..modes import policy_for
from .trainers import TrainerWatch

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics", "/metrics/targets")  # what answers without the token
SHUTDOWN_S = 1.0  # how long a stop waits for handlers still running before cancelling them
# what each trainer endpoint accepts (controller/batches.py; the cluster's: controller/cluster.py)
NO_QUERY: dict = {}


@dataclass
class TaskData:
    """What the run trains and evaluates on (``controller.role.load_task``)."""

    rows: List[dict]
    evals: List[dict]
    codec: TaskCodec
    model_path: str
    # The longest response the verifier can accept for an evaluation row (None: the run's
    # max_new_tokens): evaluations stop there, since a longer answer is wrong anyway.
    eval_max_new_tokens: Optional[Callable[[dict], int]] = None
    # Agent episodes (data.agent): the tokenizer with its chat template (data/chat.py)
    chat: Optional[object] = None


def length_fn_from_config(rollout_cfg):
    """Deterministic per-trajectory lengths for ``rollout.forced_*`` (same in every mode)."""
    if not rollout_cfg.forced_short_length:
        return None
    import zlib

    short, long_ = rollout_cfg.forced_short_length, rollout_cfg.forced_long_length
    fraction = rollout_cfg.forced_long_fraction

    def length(group_id: str, k: int) -> int:
        u = zlib.crc32(f"{group_id}/{k}".encode()) / 2**32
        if long_ and u < fraction:
            return long_
        return max(1, int(short * (0.5 + (u - fraction) / max(1 - fraction, 1e-9))))

    return length


class Controller(TrainerAPI, RunBooks, ClusterAPI, TrainerWatch):
    def __init__(self, cfg: LaminarConfig, task: TaskData, metrics, token: str, *,
                 listen: Tuple[str, int] = ("127.0.0.1", 0), info: Optional[dict] = None,
                 initial_state: Optional[dict] = None):
        """Engines join with ``add_node`` (the local launcher) or ``POST /register`` (rollout
        nodes of a cluster, see controller/role.py); ``info`` (model path, checkpoint
        directory) is what ``GET /cluster`` tells the other roles."""
        self.cfg = cfg
        self.task = task
        self.policy = policy_for(cfg.mode, cfg.algo.max_staleness)
        self.mode = cfg.mode
        self.token = token
        self.metrics = metrics
        self.batch_prompts = cfg.trainer.train_batch_prompts
        self.n_samples = cfg.algo.n_samples_per_prompt
        self.host, self.port = listen
        # cluster bookkeeping (multi-node roles find each other here)
        self.info = dict(info or {})
        # ``touch outputs/<run>/STOP``: the trainer stops after its current step and the run
        # ends as if trainer.total_steps were reached (evaluation, summary, books)
        self.stop_file = os.path.join(cfg.output_dir, cfg.run_name, "STOP")
        if os.path.exists(self.stop_file):  # left by an earlier run of this name
            os.unlink(self.stop_file)
        self.ready = False  # set by the launcher when training may start
        self.finished = False  # set by the launcher when the run's summary is written
        self._init_cluster()  # rollout nodes, the master relay, faults (controller/cluster.py)
        self._init_trainer_watch()  # trainer ranks' reports (controller/trainers.py)
        self.trainer_done: Optional[dict] = None
        self.trainer_done_event = threading.Event()
        self.trainer_version = 0
        self.trainer_wait_s = 0.0  # time trainer rank 0 spent waiting for batches
        self.first_request: Optional[float] = None
        self.consumed: List[dict] = []
        self.max_staleness_observed = 0
        self.last_step_time = time.time()
        self.step_marks: List[tuple] = []  # (time of /trained, tokens of the step, trainer wait s)
        self.version_times: Dict[int, float] = {}  # version -> when /trained reported it
        self._eval_tasks: List[asyncio.Task] = []
        # consumed trajectories whose tokens came from more than their one version (only
        # mode=areal's interruptible generation may make such)
        self.mixed_version_consumed = 0
        # (time, engine idle seconds, seconds with no engine generating) at the first step
        self._idle_mark: Optional[tuple] = None
        self._idle_last: Optional[tuple] = None  # the same at the latest step
        self.buffer = ExperienceBuffer(group_size=self.n_samples)
        # outputs/<run>/trajectories.jsonl: every trajectory that leaves (data/trace.py)
        self.trace = TrajectoryTrace(os.path.join(cfg.output_dir, cfg.run_name),
                                     resume=initial_state is not None)
        self.buffer.on_discard.append(
            lambda trajs, reason: self.trace.discarded(trajs, reason, self.trainer_version))
        self.staleness = Histogram(STALENESS_BUCKETS)  # at consumption, for /metrics
        self.partial = PartialResponsePool()
        self.prompts = PromptPool(task.rows, n_samples=self.n_samples, seed=cfg.seed)
        d = cfg.data
        self.reward = RewardService(d.reward_fn, workers=d.reward_workers,
                                    timeout_s=d.reward_timeout_s)
        plugin = episode_plugin(cfg)  # e.g. agents (data.agent), through their gateway
        if plugin is not None:
            self.episode = plugin.build_episode(cfg, task, self.reward.score)
        else:
            self.episode = SingleTurn(task.codec, asdict(cfg.rollout.sampling),
                                      self.reward.score, seed=cfg.seed,
                                      length_fn=length_fn_from_config(cfg.rollout))
        self._initial_state = initial_state
        self.manager: Optional[RolloutManager] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.url: Optional[str] = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.closing = False  # stopping: long polls answer 503 now, new requests too
        self._previous_sigterm = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        # thousands of streams: the soft RLIMIT_NOFILE raised to the hard one, or a refusal
        self.open_files, self.open_files_needed = raise_open_files_limit(self.cfg)
        self._install_sigterm()
        self._thread = threading.Thread(target=self._run, name="laminar-controller", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError(within("controller did not start", self.error, "LMC-E209"))
        if self.error:
            raise RuntimeError(within("controller did not start", self.error, "LMC-E209"))
        return self.url

    def _install_sigterm(self) -> None:
        """In a process's main thread with no SIGTERM handler of its own (``job=controller``,
        ``job=train``): SIGTERM answers the long polls at once and raises SystemExit there, so
        the launcher's ``finally`` stops the controller (and what it started) promptly."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum, frame):
            if self.closing:  # already stopping: let it finish
                return
            logger.warning("SIGTERM: stopping the controller")
            self.begin_shutdown()
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def begin_shutdown(self) -> None:
        """Answer every long poll now (503 "shutting down") and every new request (any
        thread)."""
        self.closing = True
        if self.loop is not None and not self._stopped.is_set():
            try:
                self.loop.call_soon_threadsafe(self._wake_long_polls)
            except RuntimeError:  # the loop has just closed
                pass

    def _wake_long_polls(self) -> None:
        with self.buffer.cond:
            self.buffer.cond.notify_all()

    def stop(self) -> None:
        self.begin_shutdown()
        if self.loop is not None and not self._stopped.is_set():
            self.loop.call_soon_threadsafe(self._shutdown_event.set)
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._previous_sigterm is not None and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self.reward.close()
        # what the run leaves buffered and in flight (a resumed run writes their final record)
        self.trace.left_over(self.buffer.held(), self.partial.trajectories(),
                             self.trainer_version)
        self.trace.close()

    def stop_generation(self, timeout_s: float = 60.0) -> None:
        """Stop dispatching and generating (in-flight requests are cancelled) but keep serving
        the API, so that rollout nodes still learn when the run is done."""
        if self.loop is None or self._stopped.is_set():
            return

        async def stop_manager():
            self.manager.stop()
            await self._manager_task
            await self._stop_evals()

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
        self.manager = RolloutManager(
            [], RolloutData(self.prompts, self.partial, self.buffer), self.episode, self.policy,
            self.cfg.rollout, trainer_version=lambda: self.trainer_version,
            batch_trajectories=self.batch_prompts * self.n_samples)
        self.manager.on_event = lambda kind, what, info: self._fault(kind, what, **info)
        self.manager.routed_experts = bool(self.cfg.algo.routing_replay)
        self.manager.context_length = served_context_length(self.cfg.rollout,
                                                            self.task.model_path)
        if self._initial_state:
            self.load_state_dict(self._initial_state)
        # every endpoint but /health and /metrics (read-only, as SGLang's; /metrics/targets
        # lists where those are) proves the run token; bad input is a 400 naming the field
        app = web.Application(middlewares=[token_middleware(
            self.token, lambda request: not (request.method in ("GET", "HEAD")
                                             and request.path in OPEN_PATHS),
            lambda: self.closing)])
        app.router.add_get("/metrics", Scrape(lambda: controller_metrics(self)).handle)
        app.router.add_get("/metrics/targets",
                           lambda r: web.json_response(scrape_targets(self)))
        self._add_batch_routes(app.router)  # controller/batches.py
        app.router.add_get("/state", self._state)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True,
                                                                   "done": self.finished}))
        self._add_cluster_routes(app.router)
        self._add_trainer_routes(app.router)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        await self.episode.astart()
        self._manager_task = asyncio.create_task(self.manager.run())
        watches = [asyncio.create_task(self._watch_masters()),
                   asyncio.create_task(self._watch_engines())]  # controller/cluster.py
        self._ready.set()
        await self._shutdown_event.wait()
        self.closing = True
        self._wake_long_polls()
        for task in watches + self.background:
            task.cancel()
        await asyncio.gather(*watches, *self.background, return_exceptions=True)
        self.manager.stop()
        await self._manager_task
        await self._stop_evals()
        for h in self.manager.engines:
            await h.client.close()
            await h.relay.close()
            await h.puller.aclose()
        for client in self._retired_clients:
            await client.close()
        await self.episode.aclose()
        await runner.cleanup()

    # ------------------------------------------------------------------ evaluation
    def version_wall_s(self, version: Optional[int]) -> Optional[float]:
        """Seconds from the trainer's first batch request until ``version`` was trained (0 for
        the starting weights): the time axis of accuracy curves, the same in every mode."""
        if version == 0:
            return 0.0
        if version not in self.version_times or self.first_request is None:
            return None
        return self.version_times[version] - self.first_request

    async def _evaluate_version(self, step: int, version: int) -> None:
        """``trainer.eval_interval``: evaluate on the least loaded healthy engine once one holds
        ``version`` (or newer: the record names the version that served). The engine keeps its
        version until the evaluation ends (it generates meanwhile, but does not pull)."""
        engine = None
        try:
            while True:
                ready = [e for e in self.manager.engines if e.healthy and e.version >= version
                         and not e.pulling and not e.paused]
                if ready:
                    break
                await asyncio.sleep(0.05)
            engine = min(ready, key=lambda e: (e.evaluating, len(e.in_flight)))
            engine.evaluating += 1
            plugin = episode_plugin(self.cfg)
            if plugin is not None:
                result = await plugin.evaluate(self.cfg, self.task, engine.client.base_url,
                                               engine.client.api_key)
            else:
                result = await evaluate(engine.client.base_url, self.task.evals,
                                        self.task.codec, asdict(self.cfg.rollout.sampling),
                                        self.cfg.data.reward_fn, api_key=engine.client.api_key,
                                        greedy=self.cfg.trainer.eval_greedy,
                                        max_new_tokens_fn=self.task.eval_max_new_tokens)
            self.metrics.log("eval", step=step, **result.record(),
                             wall_s=self.version_wall_s(result.version), engine=engine.name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an evaluation must not stop the run
            logger.warning("evaluation at step %d failed: %r", step, exc)
        finally:
            if engine is not None:
                engine.evaluating -= 1
                self.manager.notify(engine)

    def finish_evals(self, timeout_s: float = 120.0) -> None:
        """Let the evaluations under way end (the run's last steps may have started some)."""
        if self.loop is None or self._stopped.is_set() or not self._eval_tasks:
            return

        async def wait():
            await asyncio.wait(list(self._eval_tasks), timeout=timeout_s)

        asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout_s + 10)

    async def _stop_evals(self) -> None:
        for task in self._eval_tasks:
            task.cancel()
        await asyncio.gather(*self._eval_tasks, return_exceptions=True)
        self._eval_tasks = []

    async def _state(self, request: web.Request):
        read_query(request, NO_QUERY)
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
        self.manager.stats.started = self.manager.stats.generated  # nothing in flight yet
        if lost:
            self.buffer.discard(lost, "restart", [
                Trajectory.from_dict(item["traj"]) for item in state["partial"]])
        for item in state.get("partial", []):
            self.buffer.drop_group(item["traj"]["group_id"], "restart_group")
        # The admission budget resumes from what can still be trained on: consumed and
        # buffered trajectories, not those lost in flight at the save.
        self.manager.accepted = self.buffer.consumed + self.buffer.buffered
        self.manager.drop_stale()  # (laminar's bound: what the trainer can no longer take)
