"""How the rollout manager's engines take a new version from their relays.

Laminar's pull-when-idle: an engine that drained (no trajectory in flight) pulls the newest
version its relay holds and goes on (``_pull``). AReaL's interruptible generation
(``interrupt=True``): the engine is paused with abort, pulls at once and continues, and its
interrupted trajectories resume with their prefix on the new weights (``_interrupt_and_pull``,
``_resume_interrupted``). A pull that fails on the relay's side is retried; an engine that may
hold part of two versions is taken out of service, never left generating.

Mixed into ``RolloutManager`` (controller/manager.py), which provides ``engines``, ``stats``,
``poll_s``, ``wake_s``, ``on_event``, ``notify``, ``relay_version``, ``_mark_unhealthy``,
``_sleep_until_woken`` and ``_stop``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from ..data.pools import InFlight
from ..netutil import EngineError
from ..relay.client import RelayError, WeightApplyError
from ..weights.engine_layout import EngineLayoutError
from .engines import EngineHandle
from .episode import Discard, Stopped

SLOW_PAUSE_S = 5.0  # a pause slower than this is logged (SGLang's abort loop: ~1 s a round)

logger = logging.getLogger(__name__)


class WeightPulls:
    """The weight-update half of ``RolloutManager`` (see the module docstring)."""

    def _expecting(self, engine: EngineHandle) -> bool:
        """Whether trajectories are on their way to ``engine`` (repack or a leaving engine
        aborted them at their source to continue here): it must not pull before they land, or
        they find it on another version. One that landed, or ended or went elsewhere instead,
        is forgotten."""
        for rid, (source, item) in list(engine.incoming.items()):
            src = self._engine(source)
            if item.migrate_to != engine.name or item.engine != source or src is None \
                    or rid not in src.in_flight:
                del engine.incoming[rid]
        return bool(engine.incoming)

    async def _pull(self, engine: EngineHandle) -> None:
        engine.pulling = True
        try:
            await self._pull_once(engine)
        finally:
            engine.pulling = False
            engine.busy_until = time.time()  # the supervisor's check may have overlapped it
            self.notify(engine)  # its version moved: interrupted trajectories wait on it

    async def _pull_once(self, engine: EngineHandle) -> None:
        epoch = engine.epoch
        started = time.monotonic()
        try:
            version = await engine.puller.pull(engine.relay, engine.client, engine.version)
        except WeightApplyError as exc:
            logger.warning("engine %s could not take new weights: %s", engine.name, exc)
            if exc.mixed:  # it may hold part of two versions: it must not generate
                self._mark_unhealthy(engine, epoch)
            else:
                await asyncio.sleep(self.poll_s)  # still on its version; try again later
            return
        except RelayError as exc:
            # A slow or restarting relay: the engine still serves its version untouched (no
            # tensor was sent, or apply_version would have said so). Back off and try again.
            logger.warning("engine %s could not pull from its relay: %s; retrying", engine.name,
                           exc)
            self.stats.pull_retries += 1
            await asyncio.sleep(max(self.poll_s * 10, 0.5))
            return
        except EngineError as exc:
            logger.warning("engine %s could not pull: %s", engine.name, exc)
            self._mark_unhealthy(engine, epoch)
            return
        except EngineLayoutError as exc:  # a setting to change: a restart would not help
            self._fatal(f"engine {engine.name}'s weight pull", exc)
            return
        if engine.epoch != epoch:
            return  # the engine was replaced while this pull ran: the new one pulls itself
        if version is not None:
            engine.version = version
            engine.pulls += 1
            self.stats.pulls += 1
            self.stats.pull_seconds.observe(time.monotonic() - started)
            if engine.epoch > 0 and engine.pulls == 1 and self.on_event is not None:
                # a restarted engine holds the newest version: it is back in service
                self.on_event("engine", "serving", {"engine": engine.name, "version": version})
        else:  # nothing newer after all (its relay lost it?): back off instead of spinning
            await asyncio.sleep(self.poll_s)
        engine.draining = self.relay_version(engine) > engine.version

    async def _interrupt_and_pull(self, engine: EngineHandle) -> None:
        """AReaL's weight update: pause generation with abort (every running request returns
        what it has), take the new version, continue; the interrupted trajectories are then
        resubmitted with their prefix (``generate``) on the new weights."""
        # (an episode between turns is not generating: its next turn runs on the new version)
        items = [i for i in engine.in_flight.values() if i.migrate_to is None
                 and (i.generating or not i.multi_turn)]
        paused = False
        try:
            if items:
                for item in items:
                    item.interrupted_at = engine.version
                engine.paused = paused = True
                # SGLang answers once every running request is aborted (their streams end with
                # "abort" and resume after the update); a request that arrives while paused
                # waits for continue_generation and runs on the new weights.
                started = time.time()
                await engine.client.pause_generation("abort")
                took = time.time() - started
                if took > SLOW_PAUSE_S:  # slow, not failed: only its budget's end fails it
                    logger.info("engine %s took %.1f s to pause (%d requests aborted; "
                                "rollout.pause_timeout_s bounds it)", engine.name, took,
                                len(items))
            if engine.healthy and not self._stop.is_set():
                await self._pull(engine)
        except EngineError as exc:
            logger.warning("engine %s could not be paused for an update: %s", engine.name, exc)
            self._mark_unhealthy(engine)
        finally:
            # continue whatever happened: an engine that failed its update (or was marked
            # unhealthy meanwhile) may be alive, and a paused one would hold every request
            # that reaches it -- a health probe too -- until someone continues it
            if paused:
                try:
                    await engine.client.continue_generation()
                except EngineError as exc:
                    logger.warning("engine %s did not continue after an update: %s",
                                   engine.name, exc)
                    self._mark_unhealthy(engine)
            engine.paused = False
            engine.busy_until = time.time()
            self.notify(engine)

    async def _resume_interrupted(self, item: InFlight, engine: EngineHandle) -> EngineHandle:
        """Where an interrupted trajectory continues: its engine once that holds a newer
        version (or, if it failed, any healthy engine that is not paused)."""
        old, item.interrupted_at = item.interrupted_at, None
        engine.resuming += 1
        try:
            while not self._stop.is_set():
                if engine.healthy and engine.version > old and not engine.paused:
                    target = engine
                elif not engine.healthy:
                    others = [e for e in self.engines if e.healthy and not e.paused]
                    if not any(e.healthy or e.restarting for e in self.engines):
                        raise Discard("no_engine")
                    target = min(others, key=lambda e: len(e.in_flight)) if others else None
                else:
                    target = None
                if target is not None:
                    item.engine = target.name
                    target.in_flight[item.rid] = item
                    self.stats.interrupted += 1
                    return target
                # its engine failed: another engine's continue, a replacement or an eviction
                # notifies that engine, not this one, so look again every poll_s (as
                # _engine_of_version does)
                await self._sleep_until_woken(engine, self.wake_s if engine.healthy
                                              else self.poll_s, version=True)
            raise Stopped()
        finally:
            engine.resuming = max(engine.resuming - 1, 0)
            self.notify(engine, slots=True)  # its room changed

    async def _next_turn_engine(self, item: InFlight, engine: Optional[EngineHandle]):
        """Where a multi-turn episode's next turn runs: the engine that holds its place, or,
        if repack moved it meanwhile, its destination, or, if its engine failed (or, with
        ``interrupt``, took a new version), an engine as ``generate`` finds one after a failure.
        Returns (engine, how the request starts)."""
        if item.interrupted_at is not None and engine is not None:  # AReaL: updated between turns
            self._left(engine, item.rid)
            return await self._resume_interrupted(item, engine), "interrupt"
        target, item.migrate_to = self._engine(item.migrate_to), None
        if target is not None and target.healthy and not target.pulling and \
                target.version == item.traj.weight_version:
            if engine is not None:
                self._left(engine, item.rid)
            item.engine = target.name
            target.in_flight[item.rid] = item
            self.stats.repacked += 1
            return target, "repack"
        if engine is not None and engine.healthy and item.rid in engine.in_flight and (
                self.interrupt or engine.version == item.traj.weight_version):
            return engine, "turn" if item.traj.response_ids else "new"
        if engine is not None:
            self._left(engine, item.rid)
        self.stats.resumed += 1
        return await self._engine_of_version(item), "resume"
