"""The simulated trainer: takes complete groups FIFO as the controller's ``/batch`` does,
trains them as ``MINIBATCH_STEPS`` optimizer steps per iteration (each as long as its busiest
data-parallel rank, plus the step's own costs: ``CostModel.train_step_s``), sends its
data-parallel collectives over its machines' NICs (``network.py``) and publishes by its
system's weight protocol (``relays.RelayTier``)."""

from __future__ import annotations

import asyncio
from typing import Dict, List, Optional, Tuple

from ..controller.manager import RolloutManager
from ..data.pools import ExperienceBuffer
from .costs import MINIBATCH_STEPS, TRAINER, CostModel
from .engine import CpuShare
from .relays import TRAINER as TRAINER_NODE
from .relays import RelayTier

STREAM_MINIBATCHES = MINIBATCH_STEPS  # stream trains each mini-batch as it completes


class SimTrainer:
    """Takes a batch of complete groups (FIFO), trains, publishes; ``iterations`` times
    (and on until ``run_until``, virtual seconds, when a failure is being watched)."""

    def __init__(self, cfg, cost: CostModel, place, buffer: ExperienceBuffer,
                 tier: RelayTier, colocated: bool, share: Optional[CpuShare] = None):
        """``cfg``: the run's ``cluster.SimConfig``; ``place``: its ``cluster.Placement``
        (not imported here: cluster.py builds the trainer)."""
        self.cfg, self.cost, self.place, self.buffer = cfg, cost, place, buffer
        self.tier, self.colocated, self.share = tier, colocated, share
        self.version = 0
        self.manager: Optional[RolloutManager] = None
        self.marks: List[float] = []  # virtual time at the end of each step
        self.tokens: List[int] = []  # response tokens consumed per step (as the controller)
        self.all_tokens: List[int] = []  # prompt + response tokens per step (as the paper)
        self.stalls: List[float] = []
        self.staleness: Dict[int, int] = {}
        self.mixed = 0
        self.busy_s = 0.0
        self.busy_s_steady = 0.0
        self.idle_mark = (0.0, 0.0)
        self.run_until = 0.0

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

    def _bump(self) -> int:
        self.version += 1
        return self.version

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        w = self.cfg.workload
        # stream: the batch's groups in (up to) 16 mini-batches that add up to the batch (a
        # batch of fewer groups than that would otherwise wait for groups never admitted)
        minibatches = min(STREAM_MINIBATCHES, w.batch_prompts) if self.cfg.mode == "stream" \
            else 1
        sizes = [w.batch_prompts // minibatches + (i < w.batch_prompts % minibatches)
                 for i in range(minibatches)]
        warm = 1 if self.cfg.warmup is None else self.cfg.warmup
        step = 0
        while step < self.cfg.iterations or loop.time() < self.run_until:
            tokens = alltok = 0
            for i, size in enumerate(sizes):
                batch = await self._take(size)
                for t in batch:
                    if step >= warm:
                        s = self.version - t.weight_version
                        self.staleness[s] = self.staleness.get(s, 0) + 1
                    if t.versions_seen() not in ([], [str(t.weight_version)]):
                        self.mixed += 1
                # trained on prompt + response; the controller counts response tokens
                tokens += sum(len(t.response_ids) for t in batch)
                alltok += sum(t.num_tokens for t in batch)
                compute_s, steps = self._train_s([t.num_tokens for t in batch], len(sizes), i)
                seconds = await self._compute(compute_s)
                seconds += await self._dp_sync(steps)
                self.busy_s += seconds
                if step > 0:
                    self.busy_s_steady += seconds
            self.stalls.append(await self.tier.publish(self._bump))
            self.marks.append(loop.time())
            self.tokens.append(tokens)
            self.all_tokens.append(alltok)
            if step == 0:
                self.idle_mark = (loop.time(), self.manager.engine_idle_seconds())
            self.manager.notify()
            step += 1

    def _train_s(self, sequences: List[int], taken_in: int,
                 part: int = 0) -> Tuple[float, int]:
        """Training ``sequences`` (tokens each) as ``MINIBATCH_STEPS`` optimizer steps per
        iteration: a batch taken whole is split into that many mini-batches (trajectory i in
        mini-batch i mod steps, so a group's samples spread over them as a shuffled batch's
        do); ``stream`` takes its batch in ``taken_in`` parts (16 at the paper's batch, one
        step each), and part ``part`` gets its share of the 16 steps. Returns (the steps'
        seconds on the GPUs: compute, optimizer, fixed cost; the number of steps), their
        data-parallel collectives being ``_dp_sync``'s."""
        steps = max(1, MINIBATCH_STEPS // taken_in + (part < MINIBATCH_STEPS % taken_in))
        g, n = self.place.trainer_gpus, min(steps, len(sequences))
        return sum(self.cost.train_step_compute_s(sequences[i::steps], g) +
                   self.cost.step_overhead_s(g, network=False) for i in range(n)), n

    async def _dp_sync(self, steps: int) -> float:
        """The exposed data-parallel collectives of ``steps`` optimizer steps
        (``CostModel.dp_sync_s`` each). A trainer spanning machines sends them over its
        machines' NICs (``network.py``, the trainer's end of the publish as well: where both
        run at once they share it); inside one machine over NVLink. Returns the seconds."""
        cost, g = self.cost, self.place.trainer_gpus
        if steps <= 0 or cost.step_overhead_s(g) <= 0 or cost.dp_sync_bytes(g) <= 0:
            return 0.0
        if g <= 8:
            await asyncio.sleep(steps * cost.dp_sync_s(g))
            return steps * cost.dp_sync_s(g)
        per_machine = 8 * steps * cost.dp_sync_bytes(g) * TRAINER["dp_exposed"]
        return await self.tier.network.transfer(
            TRAINER_NODE, TRAINER_NODE, per_machine,
            self.tier.network.nic_bytes_s * TRAINER["dp_link_fraction"])

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
