"""Each system at its best placement: the trainer/rollout splits a sweep tries and how it
picks one (the paper tuned every system's split; its Table 2: 7B on 256 GPUs, laminar 192 : 64,
AReaL 128 : 128, one-step 40 : 216).

Candidates are whole machines to the trainer at 1/(s+1), 2/(s+1), ... s/(s+1) of the machines
(``splits`` = s; at least the trainer's TP x PP, at least one engine left); ``sync`` (verl)
also tries colocation (every GPU generates, then trains). The best is the fastest
(``SimResult.tokens_per_s``) whose staleness stays within a limit; the fastest at any staleness
when none does. ``report.py`` runs the same sweep for every system at every point
(``--sweep-iterations``), and ``--sweep-placement`` for one system at one point.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List

from .cluster import GPUS_PER_MACHINE, placement_for
from .costs import CONCURRENCY_PER_REPLICA, CostModel
from .workload import Workload

BOUND_MARGIN = 1.15  # throughput_bound's allowance for a batch longer than the mean


def candidate_trainer_gpus(mode: str, gpus: int, cost: CostModel, splits: int = 3) -> List[int]:
    """The trainer GPU counts a sweep tries for ``mode`` on ``gpus`` (``gpus`` itself:
    colocated, sync only)."""
    machines = gpus // GPUS_PER_MACHINE
    out: List[int] = [gpus] if mode == "sync" else []
    if machines < 2:
        place = placement_for("one_step", gpus, cost, 0.5)
        return out + [place.trainer_gpus]
    for i in range(splits):
        t = min(max(round(machines * (i + 1) / (splits + 1)), 1), machines - 1)
        trainer = max(t * GPUS_PER_MACHINE, cost.min_trainer_gpus())
        if gpus - trainer >= cost.engine_tp and trainer not in out:
            out.append(trainer)
    return out


def staleness_max(result: dict) -> int:
    return max(map(int, result["staleness"]), default=0)


def best(results: List[dict], staleness_limit: int) -> dict:
    """The fastest run whose staleness stays within ``staleness_limit`` (else the fastest)."""
    ok = [r for r in results if staleness_max(r) <= staleness_limit]
    return max(ok or results, key=lambda r: r["tokens_per_s"])


def choose_splits(results: List[dict], staleness_limit: int) -> Dict[tuple, int]:
    """{(model, gpus, mode): trainer GPUs} from a sweep's runs."""
    groups: Dict[tuple, List[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["gpus"], r["mode"]), []).append(r)
    return {k: best(v, staleness_limit)["trainer_gpus"] for k, v in groups.items()}


def throughput_bound(mode: str, cost: CostModel, gpus: int, trainer_gpus: int,
                     workload: Workload) -> float:
    """A cheap upper bound on a split's tokens/s (prompt + response tokens of a batch over the
    seconds between updates), from the cost model alone: the sweep simulates the splits in
    decreasing order of it and skips those whose bound is below the best result it already
    has (they cannot win). Each iteration lasts at least the trainer's compute plus its own
    stall (publish, broadcast or reshard) and, where engines generate the batch, their
    generation at the best rate any batch size allows with every request at its prompt
    (prefill free), less the time they stop for an update; a barrier waits on the batch's
    longest response at batch 1 as well. ``BOUND_MARGIN`` covers the batch's tokens being
    the workload's mean."""
    place = placement_for(mode, gpus, cost, None, workload, trainer_gpus)
    s = workload.stats(500)
    prompt, response = workload.prompt_median, s["mean"]
    trajectories = workload.batch_trajectories
    tokens = trajectories * (prompt + response)
    train = cost.train_s(int(tokens), place.trainer_gpus)
    cap = cost.capacity(workload.mean_context(), workload.samples, cap=CONCURRENCY_PER_REPLICA)
    engines = max(place.rollout_gpus // cost.engine_tp, 1)
    rate = max(b / cost.decode_step_s(b, b * prompt) for b in (1, cap // 4 or 1, cap // 2 or 1,
                                                                  cap))
    generate = trajectories * response / (engines * rate)
    tail_s = _tail(workload) * cost.decode_step_s(1, prompt)
    colocated = mode == "sync" and place.trainer_gpus >= gpus
    if colocated:
        iteration = max(generate, tail_s) + train + cost.colocated_sync_s()
    elif mode == "sync":
        iteration = max(generate, tail_s) + train + cost.broadcast_s()
    elif mode in ("one_step", "stream"):
        iteration = max(generate, tail_s, train) + cost.broadcast_s()
    elif mode == "areal":
        iteration = max(generate, train) + cost.broadcast_s()
    else:  # laminar: the trainer stalls for its publish, each engine for its own pull
        iteration = max(train + cost.publish_s(), generate + cost.pull_s())
    return BOUND_MARGIN * tokens / iteration


@functools.lru_cache(maxsize=16)
def _tail(workload: Workload) -> int:
    """A response length that a batch almost surely exceeds: the 4th longest expected in it,
    read off 8,000 of the workload's lengths."""
    lengths = sorted(workload.response_length(p, k) for p in range(500)
                     for k in range(workload.samples))
    return lengths[max(0, len(lengths) - 1 - math.ceil(4 * len(lengths) /
                                                        workload.batch_trajectories))]


def prune(bounds: Dict[int, float], results: List[dict], staleness_limit: int) -> List[int]:
    """The candidates (trainer GPUs, by bound, highest first) still worth simulating after
    ``results``: those whose bound beats the best result within the staleness limit (with no
    such result yet, every one: a slower split within the limit would still win)."""
    done = {r["trainer_gpus"] for r in results}
    ok = [r["tokens_per_s"] for r in results if staleness_max(r) <= staleness_limit]
    floor = max(ok) if ok else 0.0
    return [t for t in sorted(bounds, key=lambda t: (-bounds[t], t))
            if t not in done and bounds[t] > floor]
