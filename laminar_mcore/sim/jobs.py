"""The report's runs on a process pool: the per-point placement sweeps and the measured runs in
one stream of jobs, so that ``--jobs N`` workers stay busy to the end.

A sweep is a group per (model, GPUs, system): its candidate splits (``placement.py``) are
simulated one at a time, highest ``throughput_bound`` first, and a candidate whose bound is
below the best result within the staleness limit is never simulated (``placement.prune``:
it cannot win). The groups run side by side; as soon as a group has chosen its split, its
measured run joins the queue (and those of the modes measured at its split, ``SWEPT_AS``).
The pool takes the longest waiting job first (iterations, and AReaL's interrupts at twice the
cost). Every run is a pure function of its spec and every
choice a pure function of its group's results, so the outcome does not depend on ``--jobs``
or on which worker finished first. Owns no figures: ``report.py`` makes them.
"""

from __future__ import annotations

import heapq
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Tuple

from .cluster import SimConfig, SimResult, simulate, summary_line
from .costs import cost_for
from .placement import best, candidate_trainer_gpus, prune, throughput_bound
from .sensitivity import applied, with_settings, workload_with
from .workload import Workload


# A mode measured at another's chosen split rather than swept: AReaL at eta = 4 (the labelled
# row beside the paper's eta = infinity) at AReaL's own placement, so that the two rows differ
# by eta alone (and the table skips a sweep that no average reads).
SWEPT_AS = {"areal_eta4": "areal"}


def run_one(spec: dict) -> dict:
    """One run from a picklable spec: SimConfig's fields plus ``overrides`` (cost constants,
    ``sensitivity.applied``)."""
    spec = with_settings(spec, spec.get("overrides"))
    overrides = spec.pop("overrides", None)
    spec["workload"] = workload_with(spec["workload"], overrides)
    with applied(overrides):
        r = asdict(simulate(SimConfig(**spec)))
    r["overrides"] = overrides
    return r


def line(r: dict) -> str:
    return summary_line(SimResult(**{k: v for k, v in r.items() if k != "overrides"}))


def _cost(spec: dict) -> float:
    """A job's relative cost, for longest-first scheduling."""
    return spec.get("iterations", 10) * (2.0 if str(spec.get("mode")).startswith("areal") else 1.0)


class Jobs:
    """A priority queue of run specs over ``jobs`` worker processes (in-process for 1)."""

    def __init__(self, jobs: int, log=print):
        self.jobs, self.log = jobs, log
        self.pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None
        self.queue: List[tuple] = []
        self.running: Dict[Future, tuple] = {}
        self.seq = 0
        self.runs = 0

    def submit(self, spec: dict, done: Callable[[dict], None]) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (-_cost(spec), self.seq, spec, done))

    def drain(self) -> None:
        """Run until nothing is queued or running (``done`` callbacks may submit more)."""
        try:
            while self.queue or self.running:
                if self.pool is None:
                    _, _, spec, done = heapq.heappop(self.queue)
                    self._finish(run_one(spec), done)
                    continue
                while self.queue and len(self.running) < self.jobs:
                    _, _, spec, done = heapq.heappop(self.queue)
                    self.running[self.pool.submit(run_one, spec)] = (spec, done)
                finished, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
                for f in finished:  # (any order: choices depend on each group's results only)
                    _, done = self.running.pop(f)
                    self._finish(f.result(), done)
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)

    def _finish(self, result: dict, done: Callable[[dict], None]) -> None:
        self.runs += 1
        self.log(line(result))
        done(result)


def run_points(points: List[dict], jobs: int, log=print) -> List[dict]:
    """Every spec of ``points`` (results in their order)."""
    out: List[Optional[dict]] = [None] * len(points)
    q = Jobs(jobs, log)
    for i, p in enumerate(points):
        q.submit(p, lambda r, i=i: out.__setitem__(i, r))
    q.drain()
    return out  # type: ignore[return-value]


def sweep_and_measure(groups: List[Tuple[str, int, str]], base: dict, given: Dict[tuple, int],
                      measured: Callable[[tuple, int], List[dict]], jobs: int,
                      sweep_iterations: int, splits_per_point: int, staleness_limit: int,
                      workload: Workload, log=print) -> Tuple[List[dict], Dict[tuple, int], dict]:
    """For every (model, gpus, mode) of ``groups``: its split (``given``, or the pruned sweep),
    then the specs ``measured(group, split)`` returns. Returns (the measured results in
    ``groups`` order, the splits, the sweep's counts: ``sweep_runs``, ``sweep_pruned``,
    ``sweep_bound_violations`` -- runs faster than their bound, which must stay 0)."""
    q = Jobs(jobs, log)
    splits: Dict[tuple, int] = {}
    results: Dict[tuple, List[dict]] = {}
    counts = {"sweep_runs": 0, "sweep_pruned": 0, "sweep_bound_violations": 0}

    followers: Dict[tuple, List[tuple]] = {}

    def chosen(group: tuple, t: int) -> None:
        splits[group] = t
        results[group] = []
        for spec in measured(group, t):
            q.submit(spec, results[group].append)
        for follower in followers.pop(group, []):
            chosen(follower, t)

    def sweep_group(group: tuple, bounds: Dict[int, float]) -> Callable[[Optional[dict]], None]:
        """The callback that takes each of ``group``'s sweep results and queues the next."""
        state: List[dict] = []

        def step(r: Optional[dict]) -> None:
            if r is not None:
                state.append(r)
                counts["sweep_runs"] += 1
                if r["tokens_per_s"] > bounds[r["trainer_gpus"]]:
                    counts["sweep_bound_violations"] += 1
                    log(f"warning: {group} trainer {r['trainer_gpus']} beat its bound "
                        f"{bounds[r['trainer_gpus']]:,.0f} tokens/s")
            left = prune(bounds, state, staleness_limit)
            if left:
                m, g, mode = group
                q.submit(dict(base, model=m, mode=mode, gpus=g, iterations=sweep_iterations,
                              warmup=1, split_trainer_gpus=left[0]), step)
                return
            counts["sweep_pruned"] += len(bounds) - len(state)
            chosen(group, best(state, staleness_limit)["trainer_gpus"])
        return step

    for group in groups:
        m, g, mode = group
        leader = (m, g, SWEPT_AS.get(mode))
        if group not in given and leader in groups:  # at its leader's split, once chosen
            if leader in splits:
                chosen(group, splits[leader])
            else:
                followers.setdefault(leader, []).append(group)
            continue
        cost = cost_for(m, mode, base.get("engine_tp"))
        cands = candidate_trainer_gpus(mode, g, cost, splits_per_point)
        if group in given or len(cands) == 1:
            chosen(group, given.get(group, cands[0]))
            continue
        bounds = {t: throughput_bound(mode, cost, g, t, workload, sweep_iterations)
                  for t in cands}
        sweep_group(group, bounds)(None)
    log(f"{len(groups)} groups queued over {jobs} job(s)")
    q.drain()
    final = [r for group in groups for r in results.get(group, [])]
    return final, splits, counts
