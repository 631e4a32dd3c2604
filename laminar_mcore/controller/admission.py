"""Admission: which trajectories the rollout manager may start, and the capacity they hold.

AReaL's staleness admission control, ``(eta + v + 1) * B >= admitted + n`` (``can_admit``; off
by default as in Laminar), gated by ``rollout.generate_before_trainer`` and
``rollout.max_buffered_batches``; the one-step/sync baselines' global barrier
(``_barrier_ready``); Laminar's bound on the staleness trained on (``fresh_enough`` before work
starts, ``drop_stale`` at consumption); and the books of what ends unusable (``_discard``): a group with a lost
member is dropped whole and its admission capacity given back, so a bounded run admits a
replacement instead of waiting for a group that cannot come.

Mixed into ``RolloutManager`` (controller/manager.py), which provides ``engines``, ``buffer``,
``prompts``, ``stats``, ``batch``, ``max_staleness``, ``max_buffered``, ``admitting``,
``barrier``, ``consume_bound``, ``accepted``, ``trainer_version`` and ``notify``. It never starts or stops anything.
"""

from __future__ import annotations

import logging
from typing import Sequence

from ..data.trajectory import Trajectory
from ..netutil import EngineError

logger = logging.getLogger(__name__)


class Admission:
    """The admission half of ``RolloutManager`` (see the module docstring)."""

    def running(self) -> int:
        return sum(len(e.in_flight) for e in self.engines)

    def can_admit(self, n: int) -> bool:
        """AReaL's staleness admission: (eta + v + 1) * B >= admitted + n; whatever the bound,
        nothing before ``admitting`` (``rollout.generate_before_trainer``) or while
        ``rollout.max_buffered_batches`` batches wait (a stopped trainer's buffer is capped)."""
        if not self.admitting or (self.max_buffered and
                                  self.buffer.buffered >= self.max_buffered * self.batch):
            return False
        if self.max_staleness is None:
            return True
        v = self.trainer_version()
        return self.accepted + n <= (self.max_staleness + v + 1) * self.batch

    def fresh_enough(self, engine) -> bool:
        """Laminar with ``algo.max_staleness=eta`` (the bound on the staleness trained on): work
        started now is trained on no sooner than after the full batches already waiting, so an
        engine whose version would by then be more than eta behind the trainer's starts none
        (it pulls first, or waits until its relay holds a version recent enough)."""
        if self.consume_bound is None:
            return True
        ahead = self.buffer.ready_groups * self.prompts.n_samples // max(self.batch, 1)
        return engine.version >= self.trainer_version() + ahead - self.consume_bound

    def drop_stale(self) -> int:
        """The trainer's version moved: groups now more than eta behind it are discarded as
        "stale" (the buffer gives their admission capacity back, ``_stale_group``), and their
        members still generating are aborted, so the engine drains and pulls instead of
        finishing work nobody can train on; returns the groups dropped from the buffer. A
        no-op without Laminar's bound."""
        if self.consume_bound is None:
            return 0
        oldest = self.trainer_version() - self.consume_bound
        dropped = self.buffer.drop_older_than(oldest)
        for engine in self.engines:
            for item in list(engine.in_flight.values()):
                if item.traj.weight_version >= oldest or item.stale:
                    continue
                item.stale = True
                self.buffer.drop_stale_group(item.group_id)
                if item.generating and item.migrate_to is None:
                    self._spawn(self._abort_stale(engine, item), f"abort stale {item.rid}",
                                lambda what, exc: logger.warning("%s: %s", what, exc))
        if dropped:
            self.notify()
        return dropped

    async def _abort_stale(self, engine, item) -> None:
        """Abort ``item``'s request (``generate`` then discards it as "stale"); if the engine
        does not answer, the request ends on its own and is discarded when it finishes."""
        try:
            await engine.client.abort_request(item.rid)
        except EngineError as exc:
            logger.info("could not abort stale %s on %s: %s", item.rid, engine.name, exc)

    def _stale_group(self, group_id: str) -> None:
        """``buffer.on_stale``: a group too old to train on gives its admission capacity back
        (none of it was consumed), so a replacement can start."""
        self.accepted = max(self.accepted - self.prompts.n_samples, 0)

    def _barrier_ready(self) -> bool:
        """One-step / sync baselines: nobody pulls until every healthy engine is idle."""
        if not self.barrier:
            return True
        return all(not e.in_flight for e in self.engines if e.healthy)

    def _discard(self, group_id: str, count: int, reason: str,
                 trajs: Sequence[Trajectory] = ()) -> None:
        """Count ``count`` ended-but-unusable trajectories; a group with a lost member can never
        complete, so its members already buffered are dropped too (with their own reason), and
        so are those that finish later. The whole group's admission capacity is given back
        (none of it was consumed: groups are consumed whole), so a bounded-staleness run -- and
        ``mode=sync`` (bound 0) above all -- admits a replacement instead of waiting for a group
        that cannot come."""
        self.stats.generated += count
        self.buffer.discard(count, reason, trajs)
        first = not self.buffer.is_dropped(group_id)
        dropped = self.buffer.drop_group(group_id, f"{reason}_group")
        if first:
            self.accepted = max(self.accepted - self.prompts.n_samples, 0)
            self.notify()  # admission capacity came back
        self.stats.discarded[reason] = self.stats.discarded.get(reason, 0) + count + dropped
