"""Each system at its best placement: the trainer/rollout splits a sweep tries and how it
picks one (the paper tuned every system's split; its Table 2: 7B on 256 GPUs, laminar 192 : 64,
AReaL 128 : 128, one-step 40 : 216, ``paper.PAPER_SPLITS``).

Candidates are whole machines to the trainer at 1/(s+1), 2/(s+1), ... s/(s+1) of the machines
(``splits`` = s, 5 by default; at least the trainer's TP x PP, at least one engine left), plus
the paper's own split where its Table 2 gives one; ``sync`` (verl) also tries colocation
(every GPU generates, then trains). Each runs long enough for a staleness limit to bind (the
report: 1 warm-up + 4 measured iterations). The best is the fastest
(``SimResult.tokens_per_s``) whose staleness stays within a limit; the fastest at any staleness
when none does. ``report.py`` runs the same sweep for every system at every point
(``--sweep-iterations``), and ``--sweep-placement`` for one system at one point.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List

from ..data.pools import PromptPool
from .cluster import (AREAL_ETAS, GPUS_PER_MACHINE, SIM_ROWS, SimConfig, group_key,
                      placement_for)
from .costs import CONCURRENCY_PER_REPLICA, MINIBATCH_STEPS, CostModel
from .paper import PAPER_SPLITS
from .workload import Workload, group_lengths

BOUND_MARGIN = 1.05  # throughput_bound's allowance for what its cost terms leave out


def candidate_trainer_gpus(mode: str, gpus: int, cost: CostModel, splits: int = 5) -> List[int]:
    """The trainer GPU counts a sweep tries for ``mode`` on ``gpus`` (``gpus`` itself:
    colocated, sync only; the paper's Table 2 split of ``cost.model`` last, where it has
    one)."""
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
    paper = PAPER_SPLITS.get((cost.model, gpus, mode))
    if paper is not None and paper not in out and \
            cost.min_trainer_gpus() <= paper <= gpus - cost.engine_tp:
        out.append(paper)
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
                     workload: Workload, iterations: int = 2) -> float:
    """A cheap upper bound on a split's tokens/s (prompt + response tokens of a batch over the
    seconds between updates), from the cost model alone: the sweep simulates the splits in
    decreasing order of it and skips those whose bound is below the best result it already
    has (they cannot win). Every term is a lower bound on an iteration:

    * the trainer's compute at its layout's MFU with perfect balance and no attention
      (``train_s``: the simulated step, ``train_step_s``, only adds to it) plus its own stall
      (publish, broadcast or reshard);
    * for the barrier systems only (verl, one-step, stream), whose measured window must hold
      the batch's generation: the engines' best rate at any concurrency up to the replica's
      cap with every request at its prompt (prefill free), and the batch's longest response
      decoded at batch 1. AReaL and laminar keep generating between updates, so a window
      can consume trajectories generated before it (a sweep measures one iteration after
      one of warm-up): their generation bounds nothing.

    The terms take the workload's mean batch; the tokens over them are the most a batch of
    a run of ``iterations`` can hold: its longest groups among those the system can have
    admitted by then (a window's batch may be longer than the mean -- FIFO by completion
    leaves the long groups to later batches -- and the constant terms, the tail and the
    stall, do not grow with it).
    ``BOUND_MARGIN`` covers what the terms leave out."""
    place = placement_for(mode, gpus, cost, None, workload, trainer_gpus)
    s = workload.stats(500)
    prompt, response = workload.prompt_median, s["mean"]
    trajectories = workload.batch_trajectories
    mean_tokens = trajectories * (prompt + response)
    train = cost.train_s(int(mean_tokens), place.trainer_gpus) + \
        MINIBATCH_STEPS * cost.step_overhead_s(place.trainer_gpus)
    engines = max(place.rollout_gpus // cost.engine_tp, 1)
    rate = max(b / cost.decode_step_s(b, b * prompt)
               for b in (1, 16, 64, 256, CONCURRENCY_PER_REPLICA))
    generate = trajectories * response / (engines * rate)
    tail_s = _tail(workload) * cost.decode_step_s(1, prompt)
    colocated = mode == "sync" and place.trainer_gpus >= gpus
    if colocated:
        iteration = max(generate, tail_s) + train + cost.colocated_sync_s()
    elif mode == "sync":
        iteration = max(generate, tail_s) + train + cost.broadcast_s()
    elif mode in ("one_step", "stream"):
        iteration = max(generate, tail_s, train) + cost.broadcast_s()
    elif mode.startswith("areal"):
        iteration = train + cost.broadcast_s()
    else:  # laminar: the trainer stalls for its publish
        iteration = train + cost.publish_s()
    seen = (iterations + 1 + _batches_ahead(mode)) * workload.batch_prompts
    if _batches_ahead(mode) == SimConfig.max_buffered_batches:  # no admission bound
        seen += engines * CONCURRENCY_PER_REPLICA // workload.samples  # (+ the engines' groups)
    return BOUND_MARGIN * _most_batch_tokens(workload, seen) / iteration


def _batches_ahead(mode: str) -> int:
    """How many batches beyond the trainer's a system may have admitted: its pool of groups a
    batch can be taken from (FIFO by completion, so a later batch gathers the long ones)."""
    ahead = {"sync": 0, "one_step": 1, "stream": 1, **AREAL_ETAS}.get(mode)
    return SimConfig.max_buffered_batches if ahead is None else ahead


@functools.lru_cache(maxsize=64)
def _most_batch_tokens(workload: Workload, groups: int) -> int:
    """The most prompt + response tokens a batch of ``workload.batch_prompts`` groups can hold
    when taken from the first ``groups`` groups the run's prompt pool issues (their lengths
    keyed by their group ids, as ``SimEpisode`` keys them): its longest groups."""
    pool = PromptPool([{}] * SIM_ROWS, workload.samples, seed=workload.seed)
    sizes = []
    for _ in range(groups):
        prompt, lengths = group_lengths(workload, group_key(pool.next_group().group_id))
        sizes.append(prompt * workload.samples + sum(lengths))
    sizes.sort(reverse=True)
    return sum(sizes[:workload.batch_prompts])


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
