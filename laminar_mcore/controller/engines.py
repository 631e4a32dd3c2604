"""What the rollout manager knows of its engines: one ``EngineHandle`` per engine (its clients,
weight version, in-flight trajectories, health), the manager's counters and its view of the
controller's data module. Plain state: the manager (controller/manager.py) changes it, the repack
planner (controller/repack.py) reads it, the controller's API reports it; nothing here acts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..data.pools import ExperienceBuffer, InFlight, PartialResponsePool, PromptPool
from ..metrics.prometheus import SECONDS_BUCKETS, Histogram
from ..relay.client import RelayClient
from ..relay.transports import Puller
from ..rollout.client import SGLangClient


@dataclass
class EngineHandle:
    """One engine as the rollout manager sees it."""

    name: str
    client: SGLangClient
    relay: RelayClient
    # How it takes a version from its relay (relay/transports: shared memory for the CPU
    # engine, CUDA IPC to its GPUs for SGLang, Mooncake from a relay on another machine).
    puller: Puller
    version: int = 0
    capacity: int = 16
    in_flight: Dict[str, InFlight] = field(default_factory=dict)
    # trajectories repack (or a leaving engine) is moving here, by rid: (the engine it leaves,
    # the trajectory). Until they land (or end, or go elsewhere) it does not pull, or they
    # would find it on another version and be lost
    incoming: Dict[str, Tuple[str, InFlight]] = field(default_factory=dict)
    healthy: bool = True
    draining: bool = False
    paused: bool = False  # mode=areal: paused with abort for a weight update
    resuming: int = 0  # interrupted trajectories that come back once it holds the new version
    pulling: bool = False
    # A weight update runs on it outside a manager pull (``pulling`` covers those), e.g. the
    # final pull after training (controller/role.py). Paused, pulling or updating: "busy" --
    # its node's supervisor does not count a failed /health_generate then (a paused SGLang
    # holds the check's generation; GET /engine_states reports these flags).
    updating: bool = False
    # time.time() when it last stopped being paused, pulling or updating (None: never busy),
    # set by the manager where it clears those flags; GET /engine_states reports how long ago,
    # so a check that failed during a pause that has just ended is not counted either.
    busy_until: Optional[float] = None
    # Evaluations running on it (controller/evaluation.py): it keeps its version meanwhile (a
    # newer one makes it drain, as always, but it pulls only afterwards), so an evaluation
    # measures exactly one version and no new trajectory starts on weights being left behind.
    evaluating: int = 0
    pulls: int = 0
    idle_seconds: float = 0.0  # time with no trajectory in flight
    idle_since: Optional[float] = None
    # Fault isolation: a node's supervisor restarts a dead engine (``restarting`` meanwhile)
    # and the handle then stands for the new process (``epoch`` + 1): a failure seen through
    # the old one never marks the new one down. ``evicted``: out of the run for good.
    epoch: int = 0
    restarting: bool = False
    # leaving the run (its node stopped gracefully: controller/elastic.py): no new work, no pull
    leaving: bool = False
    evicted: Optional[str] = None
    # Why the controller found it lost with no report from its supervisor (its process gone
    # or silent, the supervisor with it: a host that went away); None while it answers.
    lost: Optional[str] = None


@dataclass
class ManagerStats:
    # Trajectories whose generation ended, kept or not: generated = consumed + buffered +
    # discarded (with a reason) holds at every moment.
    generated: int = 0
    # Trajectories started: started = generated + those still in flight (the partial pool);
    # any other difference is a trajectory lost without a record (``trajectories_lost``).
    started: int = 0
    resumed: int = 0
    pulls: int = 0
    repacked: int = 0  # trajectories moved off a long-tail engine (Laminar's repack)
    repack_rounds: int = 0
    pull_retries: int = 0  # pulls that failed on the relay's side and were tried again
    interrupted: int = 0  # mode=areal: requests aborted for a weight update and resubmitted
    # streams that could not be read as SGLang's protocol (their trajectories are discarded
    # with reason protocol_error; the engine stays in service)
    protocol_errors: int = 0
    # requests a working engine refused (a prompt too long, an invalid sampling parameter):
    # discarded with reason request_error:<code>, the engine stays in service
    request_errors: int = 0
    # prompts filtered before they were sent: longer than the engines' context with the
    # response budget (discarded with reason prompt_too_long)
    prompts_too_long: int = 0
    unhealthy: List[str] = field(default_factory=list)
    discarded: Dict[str, int] = field(default_factory=dict)
    engine_restarts: int = 0
    evicted: Dict[str, str] = field(default_factory=dict)  # engine -> why
    lost: Dict[str, str] = field(default_factory=dict)  # engine -> why (EngineHandle.lost)
    left: Dict[str, str] = field(default_factory=dict)  # engine -> its URL (left gracefully)
    # seconds of each completed pull (request to the new version applied), for /metrics
    pull_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))


@dataclass
class RolloutData:
    """The controller's data module as the manager sees it."""

    prompts: PromptPool
    partial: PartialResponsePool
    buffer: ExperienceBuffer
