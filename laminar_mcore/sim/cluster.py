"""One simulated run: a placement, a mode, the production ``RolloutManager`` on virtual time.

Simulated here: the relays (the master holds a version after the trainer's publish stall,
the others after their hop of Laminar's chain), the engines' pulls (their shard over PCIe),
the trainer (takes complete groups FIFO as the controller's ``/batch`` does, trains for
``CostModel.train_s``, publishes) and the episode (lengths from the workload; the reward is
free). Everything between -- admission, per-engine versions, pull-when-idle, barriers,
interrupts, repack, the partial and experience pools -- is the production code.

Modes: ``sync`` (verl: colocated, every GPU generates a batch, then every GPU trains, then the
weights are resharded in place), ``one_step`` and ``stream`` (one batch of staleness behind a
global barrier; ``stream`` also trains on mini-batches as they complete, the stream-generation
baseline), ``areal`` (interruptible generation, staleness bound eta), ``laminar`` and
``laminar_norepack``. All but ``sync`` are disaggregated: the trainer has its own GPUs.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..config.schema import RolloutConfig
from ..controller.episode import Episode
from ..controller.manager import EngineHandle, RolloutData, RolloutManager
from ..controller.modes import policy_for
from ..data.pools import ExperienceBuffer, InFlight, PartialResponsePool, PromptGroup, PromptPool
from ..data.trajectory import Trajectory
from .clock import run_virtual
from .costs import CostModel
from .engine import CpuShare, SimEngine, SimEngineClient, TokenCount
from .workload import Workload

SIM_MODES = ("sync", "one_step", "stream", "areal", "laminar", "laminar_norepack")
GPUS_PER_MACHINE = 8
STREAM_MINIBATCHES = 4  # the stream baseline trains on quarter batches as they complete
AREAL_ETA = 4  # AReaL's staleness bound in its published runs (max_head_offpolicyness)


@dataclass(frozen=True)
class Placement:
    gpus: int
    trainer_gpus: int  # sync: every GPU (colocated)

    @property
    def rollout_gpus(self) -> int:
        return self.gpus if self.trainer_gpus >= self.gpus else self.gpus - self.trainer_gpus


def balanced_fraction(cost: CostModel, workload: Workload) -> float:
    """The trainer's share of GPUs at which it consumes tokens as fast as full engines make
    them (rates per GPU from the cost model): Laminar's way of giving the trainer more GPUs
    than a generation-bound baseline would."""
    ctx = workload.mean_context()
    batch = cost.capacity(ctx, workload.samples)
    gen_per_gpu = batch / cost.decode_step_s(batch, batch * ctx) / cost.engine_tp
    # the trainer consumes prompt + response tokens; engines make response tokens
    response_share = workload.stats(500)["mean"] / (workload.stats(500)["mean"] +
                                                    workload.prompt_median)
    train_per_gpu = 1.0 / cost.train_s(1_000_000, 1) * 1_000_000 * response_share
    return gen_per_gpu / (gen_per_gpu + train_per_gpu)


def placement_for(mode: str, gpus: int, cost: CostModel, trainer_fraction: Optional[float],
                  workload: Optional[Workload] = None) -> Placement:
    """Whole machines to the trainer (at least its TP x PP) and the rest to rollouts;
    ``trainer_fraction`` None: ``balanced_fraction``."""
    if trainer_fraction is None:
        trainer_fraction = balanced_fraction(cost, workload or Workload())
    if mode == "sync":
        return Placement(gpus, gpus)
    machines = gpus // GPUS_PER_MACHINE
    if machines < 2:
        trainer = max(cost.min_trainer_gpus(), int(gpus * trainer_fraction))
        trainer = min(trainer, gpus - cost.engine_tp)
        return Placement(gpus, trainer)
    t = min(max(round(machines * trainer_fraction), 1), machines - 1)
    return Placement(gpus, max(t * GPUS_PER_MACHINE, cost.min_trainer_gpus()))


@dataclass
class SimConfig:
    model: str = "7B"
    mode: str = "laminar"
    gpus: int = 64
    trainer_fraction: Optional[float] = None  # None: balanced_fraction
    iterations: int = 10
    workload: Workload = field(default_factory=Workload)
    cost: Optional[CostModel] = None
    repack_interval_s: float = 5.0
    max_staleness: Optional[int] = None  # laminar's (None: unbounded, Laminar's default)
    max_buffered_batches: int = 8  # rollout.max_buffered_batches (the production default)
    # explicit placement (calibration against this machine): engines and trainer "GPUs";
    # sync is then this repository's disaggregated sync mode, not verl's colocated one
    engines: Optional[int] = None
    trainer_gpus: Optional[int] = None
    # CPU machines: engines and trainer share this many cores (None: each has its own GPUs)
    cpu_cores: Optional[float] = None
    # the manager asks engines for routed experts (algo.routing_replay), which simulated
    # engines cannot return: every trajectory fails (tests a run that must stop, not spin)
    routed_experts: bool = False


# ---------------------------------------------------------------------- relays and pulls
class SimRelay:
    """A relay as the manager sees it (``RelayClient``'s ``url`` and ``latest``)."""

    def __init__(self, name: str):
        self.url = f"sim://{name}"
        self.version = 0
        self._newer = asyncio.Event()
        self.calls = 0  # /latest requests (control traffic)

    def hold(self, version: int) -> None:
        if version > self.version:
            self.version = version
            event, self._newer = self._newer, asyncio.Event()
            event.set()

    async def latest(self, after: Optional[int] = None, wait_s: float = 0.0) -> dict:
        self.calls += 1
        if after is not None and wait_s > 0:
            async def newer():
                while self.version <= after:
                    await self._newer.wait()
            try:
                await asyncio.wait_for(newer(), wait_s)
            except asyncio.TimeoutError:
                pass
        return {"version": self.version}

    async def close(self) -> None:
        return None


class SimPuller:
    """An engine takes the newest version its relay holds (its shard over PCIe)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    async def pull(self, relay: SimRelay, client: SimEngineClient, current: int) -> Optional[int]:
        version = relay.version
        if version <= current:
            return None
        client.engine.stall(self.seconds)
        await asyncio.sleep(self.seconds)
        client.engine.version = version
        return version

    async def aclose(self) -> None:
        return None


# ---------------------------------------------------------------------- the episode
class SimEpisode(Episode):
    """Trajectories whose lengths come from the workload (a pure function of the group)."""

    def __init__(self, workload: Workload):
        self.workload = workload

    def start(self, group: PromptGroup, version: int, engine: str) -> List[InFlight]:
        key = zlib.crc32(group.group_id.encode())
        prompt = self.workload.prompt_length(key)
        items = []
        for k in range(group.n):
            traj = Trajectory(prompt_ids=TokenCount(prompt), response_ids=TokenCount(0),
                              behav_logprobs=TokenCount(0), weight_version=version,
                              group_id=group.group_id, uid=f"{group.group_id}/{k}")
            items.append(InFlight(traj, engine, sampling={"sim_prompt_tokens": prompt},
                                  max_new_tokens=self.workload.response_length(key, k)))
        return items

    async def arun(self, ctx, item: InFlight, row: dict) -> None:
        item.traj.finish_reason = await ctx.generate(item)
        item.traj.reward = 0.0


# ---------------------------------------------------------------------- one run
@dataclass
class SimResult:
    model: str
    mode: str
    gpus: int
    trainer_gpus: int
    engines: int
    relays: int
    tokens_per_s: float  # trainer-consumed response tokens per second, steady state (as the
    # controller's trainer_tokens_per_s)
    generation_tokens_per_s: float  # tokens generated per second while an engine was busy
    kv_utilisation: float  # KV tokens in use / capacity, over engines' busy time
    engine_idle_fraction: float
    trainer_idle_fraction: float
    staleness: Dict[int, int]
    repacked: int
    interrupted: int
    iteration_s: float  # mean seconds per iteration, steady state
    chain_s: float
    publish_s: float
    virtual_s: float
    wall_s: float
    consumed: int = 0  # trajectories the trainer took
    mixed_version_trajectories: int = 0  # consumed trajectories generated by more than one version
    books_balance: bool = True  # generated = consumed + buffered + discarded
    relay_requests: int = 0  # the manager's /latest requests to all relays


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg`` on a fresh virtual clock."""
    t0 = time.perf_counter()
    result = run_virtual(_simulate(cfg))
    result.wall_s = time.perf_counter() - t0
    return result


async def _simulate(cfg: SimConfig) -> SimResult:
    if cfg.mode not in SIM_MODES:
        raise ValueError(f"mode={cfg.mode!r} is not one of {', '.join(SIM_MODES)}")
    loop = asyncio.get_running_loop()
    cost = cfg.cost or CostModel(cfg.model)
    w = cfg.workload
    explicit = cfg.engines is not None
    if explicit:
        place = Placement(cfg.engines * cost.engine_tp + (cfg.trainer_gpus or 1),
                          cfg.trainer_gpus or 1)
    else:
        place = placement_for(cfg.mode, cfg.gpus, cost, cfg.trainer_fraction, w)
    colocated = cfg.mode == "sync" and not explicit
    n_engines = cfg.engines if explicit else place.rollout_gpus // cost.engine_tp
    if n_engines < 1:
        raise ValueError(f"{cfg.gpus} GPUs leave no engine of {cost.engine_tp} GPUs for "
                         f"{cfg.model} beside a trainer of {place.trainer_gpus}")
    machines = max(1, math.ceil(place.rollout_gpus / GPUS_PER_MACHINE))
    per_machine = max(1, GPUS_PER_MACHINE // cost.engine_tp)
    relays = [SimRelay(f"relay{i}") for i in range(machines)]
    capacity = cost.capacity(w.mean_context(), w.samples)
    kv = cost.kv_tokens()
    pull_s = cost.colocated_sync_s() if colocated else cost.pull_s()
    share = CpuShare(cfg.cpu_cores) if cfg.cpu_cores else None
    engines = []
    for i in range(n_engines):
        sim = SimEngine(f"engine{i}", cost, capacity, kv, share)
        engines.append(EngineHandle(name=sim.name, client=SimEngineClient(sim),
                                    relay=relays[min(i // per_machine, machines - 1)],
                                    puller=SimPuller(pull_s), capacity=capacity))
    policy_mode = {"stream": "one_step", "laminar_norepack": "laminar"}.get(cfg.mode, cfg.mode)
    bound = AREAL_ETA if cfg.mode == "areal" else cfg.max_staleness
    policy = policy_for(policy_mode, bound)
    rollout_cfg = RolloutConfig(repack=cfg.mode == "laminar",
                                repack_interval_s=cfg.repack_interval_s,
                                max_buffered_batches=cfg.max_buffered_batches)
    rows = [{} for _ in range(17000)]  # DAPO-Math-17k's size; lengths come from the group
    buffer = ExperienceBuffer(w.samples)
    data = RolloutData(PromptPool(rows, w.samples, seed=w.seed), PartialResponsePool(), buffer)
    trainer = SimTrainer(cfg, cost, place, buffer, relays, colocated, share)
    manager = RolloutManager(engines, data, SimEpisode(w), policy, rollout_cfg,
                             trainer_version=lambda: trainer.version,
                             batch_trajectories=w.batch_trajectories, poll_s=0.05, wake_s=30.0,
                             relay_wait_s=3600.0, clock=loop.time)
    trainer.manager = manager
    manager.routed_experts = cfg.routed_experts
    run = asyncio.create_task(manager.run())
    try:
        await trainer.run()
    finally:
        manager.stop()
        await run
    start, end = trainer.marks[0], trainer.marks[-1]
    span = max(end - start, 1e-9)
    sims = [e.client.engine for e in engines]
    busy = sum(s.busy_seconds for s in sims)
    steady = sum(trainer.tokens[1:])
    idle = manager.engine_idle_fraction(since=trainer.idle_mark)
    if colocated:  # the same GPUs trained meanwhile: they were not idle
        idle = max(0.0, idle - trainer.busy_s / max(loop.time() - trainer.idle_mark[0], 1e-9))
    return SimResult(
        model=cfg.model, mode=cfg.mode, gpus=cfg.gpus, trainer_gpus=place.trainer_gpus,
        engines=n_engines, relays=machines,
        tokens_per_s=steady / span,
        generation_tokens_per_s=sum(s.tokens for s in sims) / max(busy, 1e-9) * len(sims),
        kv_utilisation=sum(s.kv_token_seconds for s in sims) / max(busy * kv, 1e-9),
        engine_idle_fraction=idle,
        trainer_idle_fraction=1.0 - trainer.busy_s_steady / span,
        staleness=dict(sorted(trainer.staleness.items())), repacked=manager.stats.repacked,
        interrupted=manager.stats.interrupted,
        iteration_s=span / max(len(trainer.marks) - 1, 1),
        chain_s=cost.chain_s(machines), publish_s=0.0 if colocated else cost.publish_s(),
        virtual_s=loop.time(), wall_s=0.0, consumed=buffer.consumed,
        mixed_version_trajectories=trainer.mixed,
        relay_requests=sum(r.calls for r in relays),
        books_balance=manager.stats.generated == buffer.consumed + buffer.buffered + sum(
            buffer.discarded.values()))


class SimTrainer:
    """Takes a batch of complete groups (FIFO), trains, publishes; ``iterations`` times."""

    def __init__(self, cfg: SimConfig, cost: CostModel, place: Placement,
                 buffer: ExperienceBuffer, relays: List[SimRelay], colocated: bool,
                 share: Optional[CpuShare] = None):
        self.cfg, self.cost, self.place, self.buffer = cfg, cost, place, buffer
        self.relays, self.colocated, self.share = relays, colocated, share
        self.version = 0
        self.manager: Optional[RolloutManager] = None
        self.marks: List[float] = []  # virtual time at the end of each step
        self.tokens: List[int] = []
        self.staleness: Dict[int, int] = {}
        self.mixed = 0
        self.busy_s = 0.0
        self.busy_s_steady = 0.0
        self.idle_mark = (0.0, 0.0)

    async def _take(self, groups: int):
        """``groups`` complete groups, FIFO (the controller's ``/batch``), once ready."""
        while True:
            batch = self.buffer.take(groups, timeout=0)
            if batch is not None:
                self.manager.notify()  # the buffer has room again
                return batch
            ready = asyncio.Event()
            self.buffer.on_ready.append(ready.set)
            try:
                await ready.wait()
            finally:
                self.buffer.on_ready.remove(ready.set)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        w = self.cfg.workload
        minibatches = STREAM_MINIBATCHES if self.cfg.mode == "stream" else 1
        for step in range(self.cfg.iterations):
            tokens = 0
            for _ in range(minibatches):
                batch = await self._take(w.batch_prompts // minibatches)
                for t in batch:
                    s = self.version - t.weight_version
                    self.staleness[s] = self.staleness.get(s, 0) + 1
                    if t.versions_seen() not in ([], [str(t.weight_version)]):
                        self.mixed += 1
                # trained on prompt + response; counted as the controller counts: response
                tokens += sum(len(t.response_ids) for t in batch)
                seconds = self.cost.train_s(sum(t.num_tokens for t in batch),
                                            self.place.trainer_gpus)
                seconds = await self._compute(seconds)
                self.busy_s += seconds
                if step > 0:
                    self.busy_s_steady += seconds
            if not self.colocated:
                await asyncio.sleep(self.cost.publish_s())  # the actor's stall
            self.version += 1
            self.marks.append(loop.time())
            self.tokens.append(tokens)
            if step == 0:
                self.idle_mark = (loop.time(), self.manager.engine_idle_seconds())
            self._publish(self.version)
            self.manager.notify()

    async def _compute(self, work_s: float) -> float:
        """``work_s`` seconds of training; on shared CPU cores, slower while engines are busy
        (in slices). Returns the seconds it took."""
        if self.share is None:
            await asyncio.sleep(work_s)
            return work_s
        loop = asyncio.get_running_loop()
        t0, left, slice_s = loop.time(), work_s, 0.02
        self.share.set_busy(self, True)
        try:
            while left > 1e-12:
                f = self.share.factor()
                step = min(slice_s, left * f)
                await asyncio.sleep(step)
                left -= step / f
        finally:
            self.share.set_busy(self, False)
        return loop.time() - t0

    def _publish(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        p = len(self.relays)
        self.relays[0].hold(version)
        for i, relay in enumerate(self.relays[1:], start=1):
            loop.call_later(self.cost.chain_hop_s(p, i), relay.hold, version)


def summary_line(r: SimResult) -> str:
    stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
    return (f"{r.model} {r.mode:16s} {r.gpus:5d} GPUs (trainer {r.trainer_gpus}, "
            f"{r.engines} engines): {r.tokens_per_s:,.0f} tokens/s, iteration "
            f"{r.iteration_s:.0f} s, engines idle {r.engine_idle_fraction:.0%}, KV "
            f"{r.kv_utilisation:.0%}, staleness {{{stale}}}, {r.wall_s:.1f} s wall")
