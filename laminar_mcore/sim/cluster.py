"""One simulated run: a placement, a mode, the production ``RolloutManager`` on virtual time.

Simulated here: the relays (the master holds a version after the trainer's publish stall,
the others after their hop of Laminar's chain), the engines' pulls (their shard over PCIe),
the trainer (takes complete groups FIFO as the controller's ``/batch`` does, trains for
``CostModel.train_s``, publishes) and the episode (lengths from the workload; the reward is
free). Everything between -- admission, per-engine versions, pull-when-idle, barriers,
interrupts, repack, the partial and experience pools -- is the production code.

Modes, each with its own system's weight protocol (``relays.py``): ``sync`` (verl: generate,
train, update behind a barrier; colocated -- every GPU generates, then trains, then reshards in
place -- or disaggregated with a global NCCL broadcast, whichever split is given),
``one_step`` and ``stream`` (one batch of staleness behind a global barrier and the same NCCL
broadcast; ``stream`` trains on its 16 mini-batches as they complete), ``areal``
(interruptible generation, staleness bound eta, the NCCL broadcast, interrupted requests
re-prefilled), ``laminar`` and ``laminar_norepack`` (relays). ``protocols=False`` gives every
mode laminar's relays (the simulator before issue 33), as explicit placements do.

Measured as the paper measures: throughput of an iteration = the prompt + response tokens of
its batch / the seconds since the previous trainer update, averaged over the iterations after
``warmup`` (the report: 10 + 5), with their spread.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..config.schema import RolloutConfig
from ..controller.episode import Episode
from ..controller.manager import EngineHandle, RolloutData, RolloutManager
from ..modes import policy_for
from ..data.pools import ExperienceBuffer, InFlight, PartialResponsePool, PromptGroup, PromptPool
from ..data.trajectory import Trajectory
from .clock import run_virtual
from .costs import CONCURRENCY_PER_REPLICA, CostModel, cost_for, system_of
from .engine import CpuShare, SimEngine, SimEngineClient, TokenCount
from .faults import FailureRecord, fail_machine
from .network import Network
from .relays import RelayTier, SimPuller
from .training import SimTrainer
from .workload import Workload, group_lengths

SIM_MODES = ("sync", "one_step", "stream", "areal", "areal_eta4", "laminar", "laminar_norepack")
GPUS_PER_MACHINE = 8
SIM_ROWS = 17000  # the prompt pool's rows: DAPO-Math-17k's size
# AReaL's staleness bound: infinite in the paper's throughput runs (Laminar section 8.1: the
# ``areal`` mode); 4 in AReaL's own published runs (max_head_offpolicyness), the labelled
# second row ``areal_eta4``.
AREAL_ETA = 4
AREAL_ETAS = {"areal": None, "areal_eta4": AREAL_ETA}


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
                  workload: Optional[Workload] = None,
                  trainer_gpus: Optional[int] = None) -> Placement:
    """Whole machines to the trainer (at least its TP x PP) and the rest to rollouts;
    ``trainer_fraction`` None: ``balanced_fraction``. ``trainer_gpus`` (a sweep's choice)
    wins over both; for ``sync`` it may be ``gpus`` (colocated, verl's default)."""
    if trainer_gpus is not None:
        if mode == "sync" and trainer_gpus >= gpus:
            return Placement(gpus, gpus)
        if not cost.min_trainer_gpus() <= trainer_gpus <= gpus - cost.engine_tp:
            raise ValueError(f"trainer_gpus={trainer_gpus} does not leave {cost.model} a "
                             f"trainer of {cost.min_trainer_gpus()}+ GPUs and an engine of "
                             f"{cost.engine_tp} in {gpus}")
        return Placement(gpus, trainer_gpus)
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
    # iterations before the measured ones (None: 1, the first; the report: 10 of 15)
    warmup: Optional[int] = None
    # the trainer's GPUs as a placement sweep chose them (sync: == gpus for colocated)
    split_trainer_gpus: Optional[int] = None
    # each system's own weight protocol (False: laminar's relays for every mode)
    protocols: bool = True
    # (rollout machine, virtual seconds): kill that machine then (faults.py); the run goes on
    # until ``fail_horizon_s`` after it as well as for ``iterations``
    fail: Optional[Tuple[int, float]] = None
    fail_horizon_s: float = 600.0
    nic_bytes_s: Optional[float] = None  # costs.NETWORK's per machine NIC bandwidth
    concurrency: int = CONCURRENCY_PER_REPLICA  # requests the manager gives one engine
    # the manager's polling period (virtual seconds); a failure run polls every second: its
    # stranded trajectories poll for an engine of their version, thousands at a time
    poll_s: Optional[float] = None
    # engine TP (None: the paper's for this system and model, costs.ENGINE_TP_PAPER; an
    # explicit placement keeps MODELS' default)
    engine_tp: Optional[int] = None
    eta: Optional[int] = None  # AReaL's staleness bound (None: the mode's, AREAL_ETAS)


# ---------------------------------------------------------------------- the episode
def group_key(group_id: str) -> int:
    """The workload's key of a prompt pool's group: its lengths are ``group_lengths`` of it."""
    return zlib.crc32(group_id.encode())


class SimEpisode(Episode):
    """Trajectories whose lengths come from the workload (a pure function of the group)."""

    def __init__(self, workload: Workload):
        self.workload = workload

    def start(self, group: PromptGroup, version: int, engine: str) -> List[InFlight]:
        prompt, lengths = group_lengths(self.workload, group_key(group.group_id))
        items = []
        for k in range(group.n):
            traj = Trajectory(prompt_ids=TokenCount(prompt), response_ids=TokenCount(0),
                              behav_logprobs=TokenCount(0), weight_version=version,
                              group_id=group.group_id, uid=f"{group.group_id}/{k}")
            items.append(InFlight(traj, engine, sampling={"sim_prompt_tokens": prompt},
                                  max_new_tokens=lengths[k]))
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
    response_tokens_per_s: float = 0.0  # consumed response tokens / s after the first step
    tokens_per_s_min: float = 0.0  # over the measured iterations
    tokens_per_s_max: float = 0.0
    tokens_per_s_spread: float = 0.0  # (max - min) / mean over the measured iterations
    measured_iterations: int = 0
    protocol: str = "laminar"
    update_s: float = 0.0  # an engine's weight update (pull, broadcast or reshard)
    trainer_update_stall_s: float = 0.0  # the trainer's stall per update, measured mean
    network_shared_s: float = 0.0  # transfer-seconds slowed by a shared NIC
    failure: Optional[Dict[str, Optional[float]]] = None
    prefill_tokens: int = 0  # tokens the engines prefilled (prompts, resumes, re-prefills)
    marks: List[float] = field(default_factory=list)  # virtual time of each trainer update
    engine_tp: int = 0  # GPUs per engine (the paper's for the system: costs.ENGINE_TP_PAPER)


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg`` on a fresh virtual clock."""
    t0 = time.perf_counter()
    result = run_virtual(_simulate(cfg))
    result.wall_s = time.perf_counter() - t0
    return result


def protocol_of(mode: str, place: Placement, explicit: bool, protocols: bool) -> str:
    """Which weight protocol a mode runs (``relays.RelayTier``)."""
    if mode == "sync" and not explicit and place.trainer_gpus >= place.gpus:
        return "colocated"
    if not protocols or explicit or mode.startswith("laminar"):
        return "laminar"
    return "broadcast"  # verl disaggregated, one_step, stream, areal: a global NCCL update


async def _simulate(cfg: SimConfig) -> SimResult:
    if cfg.mode not in SIM_MODES:
        raise ValueError(f"mode={cfg.mode!r} is not one of {', '.join(SIM_MODES)}")
    loop = asyncio.get_running_loop()
    w = cfg.workload
    explicit = cfg.engines is not None
    cost = cfg.cost or (CostModel(cfg.model, tp=cfg.engine_tp or 0) if explicit
                        else cost_for(cfg.model, cfg.mode, cfg.engine_tp))
    if explicit:
        place = Placement(cfg.engines * cost.engine_tp + (cfg.trainer_gpus or 1),
                          cfg.trainer_gpus or 1)
    else:
        place = placement_for(cfg.mode, cfg.gpus, cost, cfg.trainer_fraction, w,
                              cfg.split_trainer_gpus)
    protocol = protocol_of(cfg.mode, place, explicit, cfg.protocols)
    colocated = protocol == "colocated"
    n_engines = cfg.engines if explicit else place.rollout_gpus // cost.engine_tp
    if n_engines < 1:
        raise ValueError(f"{cfg.gpus} GPUs leave no engine of {cost.engine_tp} GPUs for "
                         f"{cfg.model} beside a trainer of {place.trainer_gpus}")
    machines = max(1, math.ceil(place.rollout_gpus / GPUS_PER_MACHINE))
    per_machine = max(1, GPUS_PER_MACHINE // cost.engine_tp)
    tier = RelayTier(cost, machines, protocol, Network(cfg.nic_bytes_s))
    relays = tier.relays
    if explicit:  # calibration: the capacities it measured, as before
        capacity = running_cap = cost.capacity(w.mean_context(), w.samples)
    else:  # the paper's 1,024 concurrent requests per replica, as far as its KV cache holds
        # them at the mean context (SGLang sizes max_running_requests from its KV pool)
        capacity = running_cap = cost.capacity(w.mean_context(), w.samples,
                                               cap=cfg.concurrency)
    kv = cost.kv_tokens()
    share = CpuShare(cfg.cpu_cores) if cfg.cpu_cores else None
    flush = not explicit  # SGLang flushes its radix cache on every update (flush_cache=True)

    def make_engine(name: str) -> SimEngine:
        return SimEngine(name, cost, running_cap, kv, share)

    engines = []
    for i in range(n_engines):
        sim = make_engine(f"engine{i}")
        engines.append(EngineHandle(name=sim.name, client=SimEngineClient(sim),
                                    relay=relays[min(i // per_machine, machines - 1)],
                                    puller=SimPuller(tier.update_s(), flush), capacity=capacity))
    system = system_of(cfg.mode)
    policy_mode = "one_step" if system == "stream" else system  # stream: one-step's bound
    bound = (AREAL_ETAS[cfg.mode] if cfg.eta is None else cfg.eta) if cfg.mode in AREAL_ETAS \
        else cfg.max_staleness
    policy = policy_for(policy_mode, bound)
    rollout_cfg = RolloutConfig(repack=cfg.mode == "laminar",
                                repack_interval_s=cfg.repack_interval_s,
                                max_buffered_batches=cfg.max_buffered_batches)
    rows = [{} for _ in range(SIM_ROWS)]  # lengths come from the group
    buffer = ExperienceBuffer(w.samples)
    data = RolloutData(PromptPool(rows, w.samples, seed=w.seed), PartialResponsePool(), buffer)
    trainer = SimTrainer(cfg, cost, place, buffer, tier, colocated, share)
    manager = RolloutManager(engines, data, SimEpisode(w), policy, rollout_cfg,
                             trainer_version=lambda: trainer.version,
                             batch_trajectories=w.batch_trajectories,
                             poll_s=cfg.poll_s or (1.0 if cfg.fail else 0.05), wake_s=30.0,
                             relay_wait_s=3600.0, clock=loop.time)
    trainer.manager = manager
    manager.routed_experts = cfg.routed_experts
    record, fault = None, None
    if cfg.fail is not None:
        machine, at = cfg.fail
        if not 0 <= machine < machines:
            raise ValueError(f"--fail {machine}@{at}: there are {machines} rollout machines "
                             f"(0-{machines - 1})")
        record = FailureRecord(machine, at)
        trainer.run_until = at + cfg.fail_horizon_s
        fault = asyncio.ensure_future(fail_machine(
            manager, tier, [e for i, e in enumerate(engines)
                            if min(i // per_machine, machines - 1) == machine],
            make_engine, record))
    run = asyncio.create_task(manager.run())
    try:
        await trainer.run()  # (prefill counted until here: the shutdown's order is the loop's)
        prefilled = sum(e.client.engine.prefill_tokens for e in engines)
    finally:
        if fault is not None:
            fault.cancel()
            await asyncio.gather(fault, return_exceptions=True)
        manager.stop()
        await run
        await tier.close()
    marks, alltok = trainer.marks, trainer.all_tokens
    start, end = marks[0], marks[-1]
    span = max(end - start, 1e-9)
    warm = max(1, 1 if cfg.warmup is None else cfg.warmup)
    thr = [alltok[i] / max(marks[i] - marks[i - 1], 1e-9) for i in range(warm, len(marks))] \
        or [alltok[-1] / max(marks[-1], 1e-9)]
    mean_thr = statistics.mean(thr)
    sims = [e.client.engine for e in engines]
    busy = sum(s.busy_seconds for s in sims)
    steady = sum(trainer.tokens[1:])
    idle = manager.engine_idle_fraction(since=trainer.idle_mark)
    if colocated:  # the same GPUs trained meanwhile: they were not idle
        idle = max(0.0, idle - trainer.busy_s / max(loop.time() - trainer.idle_mark[0], 1e-9))
    return SimResult(
        model=cfg.model, mode=cfg.mode, gpus=cfg.gpus, trainer_gpus=place.trainer_gpus,
        engines=n_engines, relays=machines,
        tokens_per_s=mean_thr,
        generation_tokens_per_s=sum(s.tokens for s in sims) / max(busy, 1e-9) * len(sims),
        kv_utilisation=sum(s.kv_token_seconds for s in sims) / max(busy * kv, 1e-9),
        engine_idle_fraction=idle,
        trainer_idle_fraction=1.0 - trainer.busy_s_steady / span,
        staleness=dict(sorted(trainer.staleness.items())), repacked=manager.stats.repacked,
        interrupted=manager.stats.interrupted,
        iteration_s=span / max(len(marks) - 1, 1),
        chain_s=cost.chain_s(machines) if protocol == "laminar" else 0.0,
        publish_s=0.0 if colocated else (cost.broadcast_s() if protocol == "broadcast"
                                         else cost.publish_s()),
        virtual_s=loop.time(), wall_s=0.0, consumed=buffer.consumed,
        mixed_version_trajectories=trainer.mixed,
        relay_requests=sum(r.calls for r in relays),
        books_balance=manager.stats.generated == buffer.consumed + buffer.buffered + sum(
            buffer.discarded.values()),
        response_tokens_per_s=steady / span, tokens_per_s_min=min(thr),
        tokens_per_s_max=max(thr), tokens_per_s_spread=(max(thr) - min(thr)) / mean_thr,
        measured_iterations=len(thr), protocol=protocol, update_s=tier.update_s(),
        trainer_update_stall_s=statistics.mean(trainer.stalls) if trainer.stalls else 0.0,
        network_shared_s=tier.network.shared_s,
        prefill_tokens=prefilled, marks=[round(m, 3) for m in marks],
        engine_tp=cost.engine_tp,
        failure=record.figures(marks, alltok, cfg.fail_horizon_s) if record else None)


def summary_line(r: SimResult) -> str:
    stale = ", ".join(f"{k}:{v}" for k, v in r.staleness.items())
    return (f"{r.model} {r.mode:16s} {r.gpus:5d} GPUs (trainer {r.trainer_gpus}, "
            f"{r.engines} engines): {r.tokens_per_s:,.0f} tokens/s, iteration "
            f"{r.iteration_s:.0f} s, engines idle {r.engine_idle_fraction:.0%}, KV "
            f"{r.kv_utilisation:.0%}, staleness {{{stale}}}, {r.wall_s:.1f} s wall")
