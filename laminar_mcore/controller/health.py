"""Supervision and fault isolation of the rollout manager's engines and tasks.

Every task the manager runs is supervised (``_spawn``): an engine loop that fails takes its
engine out of service, a trajectory that fails is discarded with ``internal_error``, the relay
watcher or the repack loop failing stops the run, and so do failures that repeat for every
trajectory (a bug is not a state to spin in). An engine is taken out of service when it fails a
request, when its node's supervisor reports it dead (``engine_down``; restarted or evicted), or
when the controller finds its host gone (``engine_lost``: its open streams end now); its
trajectories resume on healthy engines of their own version (``_engine_of_version``) or are
discarded with a reason. A restarted engine or relay takes the old one's place
(``replace_engine``, ``replace_relay``).

Mixed into ``RolloutManager`` (controller/manager.py), which provides ``engines``, ``stats``,
``poll_s``, ``interrupt``, ``relay_versions``, ``notify``, ``_drop``, ``_discard``,
``_start_engine_loop``, ``_tasks``, ``_internal_errors``, ``error`` and ``_stop``. It never
decides what runs where (admission, pulls and repack do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Optional

from ..data.pools import InFlight
from ..relay.client import RelayClient
from ..rollout.client import EngineError, SGLangClient
from .engines import EngineHandle
from .episode import Discard, Stopped

# the manager's logger: one name to silence or capture (laminar_mcore/sim sets its level)
logger = logging.getLogger("laminar_mcore.controller.manager")


class EngineHealth:
    """The supervision half of ``RolloutManager`` (see the module docstring)."""

    def _spawn(self, coro, what: str, on_error: Callable[[str, BaseException], None]):
        """Start ``coro`` as a supervised task: if it ends with an exception, ``on_error`` is
        told (never a silent end of an engine's loop or of the relay watcher)."""
        task = asyncio.create_task(coro, name=what)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled() or t.exception() is None:
                return
            on_error(what, t.exception())

        task.add_done_callback(done)
        self._tasks.add(task)
        return task

    def _fatal(self, what: str, exc: BaseException) -> None:
        logger.error("rollout manager: %s failed: %r; stopping the run", what, exc,
                     exc_info=exc)
        if self.error is None:
            self.error = exc
        self._stop.set()

    def _engine_failed(self, engine: EngineHandle):
        epoch = engine.epoch

        def on_error(what: str, exc: BaseException) -> None:
            logger.error("%s failed: %r; engine %s is taken out of service", what, exc,
                         engine.name, exc_info=exc)
            self._mark_unhealthy(engine, epoch)
        return on_error

    # internal errors in a row (no trajectory finishing in between) that stop the run: one
    # trajectory's bad luck is isolated, a bug that fails every trajectory is not a state to
    # spin in
    MAX_INTERNAL_ERRORS_IN_A_ROW = 64

    def _trajectory_failed(self, item: InFlight):
        def on_error(what: str, exc: BaseException) -> None:
            self._internal_errors += 1
            if self._internal_errors <= 3:
                logger.error("%s failed: %r; the trajectory is discarded", what, exc, exc_info=exc)
            self._drop(item)
            self._discard(item.group_id, 1, "internal_error", [item.traj])
            if self._internal_errors >= self.MAX_INTERNAL_ERRORS_IN_A_ROW and self.error is None:
                self._fatal(f"{self._internal_errors} trajectories in a row ({what})", exc)
        return on_error

    async def _protocol_error(self, engine: EngineHandle, item: InFlight,
                              exc: BaseException) -> None:
        """Count it (``protocol_errors``), abort what may still run of the request, and stop the
        run when every trajectory fails so (a client and an engine that disagree)."""
        self.stats.protocol_errors += 1
        self._internal_errors += 1
        if self.stats.protocol_errors <= 3:
            logger.error("engine %s: stream of %s could not be read: %s; the trajectory is "
                         "discarded", engine.name, item.rid, exc)
        with contextlib.suppress(EngineError):
            await engine.client.abort_request(item.rid)
        if self._internal_errors >= self.MAX_INTERNAL_ERRORS_IN_A_ROW and self.error is None:
            self._fatal(f"{self._internal_errors} trajectories in a row (stream protocol)", exc)

    async def _request_error(self, engine: EngineHandle, item: InFlight,
                             exc: BaseException) -> None:
        """A working engine refused one request (``RequestError``): count it
        (``request_errors``), keep the engine in service, and stop the run when every
        trajectory is refused so (a setting every request carries, e.g. a sampling parameter
        the engines reject), naming the engine's words."""
        self.stats.request_errors += 1
        self._internal_errors += 1
        if self.stats.request_errors <= 3:
            logger.warning("engine %s refused %s: %s; the trajectory is discarded (the engine "
                           "stays in service)", engine.name, item.rid, exc)
        if self._internal_errors >= self.MAX_INTERNAL_ERRORS_IN_A_ROW and self.error is None:
            self._fatal(f"{self._internal_errors} trajectories in a row refused by the engines "
                        "(request errors: check rollout.sampling and the prompts)", exc)

    def _mark_unhealthy(self, engine: EngineHandle, epoch: Optional[int] = None) -> None:
        """Take ``engine`` out of service (``epoch``: the process the failure was seen on; a
        failure of a process already replaced says nothing of the new one)."""
        if epoch is not None and epoch != engine.epoch:
            return
        if engine.healthy:
            engine.healthy = False
            self.stats.unhealthy.append(engine.name)
            logger.warning("engine %s marked unhealthy", engine.name)
            self.notify()  # its loop ends; with a barrier, the others need not wait for it
            self.relay_versions.changed.set()

    def engine_down(self, engine: EngineHandle, reason: str, evict: bool) -> None:
        """Its node's supervisor found it dead or hung: no more work for it. Unless
        ``evict``, a replacement is on its way (``replace_engine``)."""
        self._mark_unhealthy(engine)
        if evict:
            engine.restarting, engine.evicted = False, reason
            self.stats.evicted[engine.name] = reason
        else:
            engine.restarting = True

    def engine_lost(self, engine: EngineHandle, reason: str) -> int:
        """The controller found ``engine`` gone or silent and no supervisor reported it (its
        host went away): no more work for it, and the streams still open to it end now, so
        their trajectories resume on engines of their version (or are discarded with a
        reason) rather than wait for a host that may never answer. Returns how many streams
        were ended. A supervisor that comes back restarts it (``replace_engine``)."""
        self._mark_unhealthy(engine)
        engine.lost = reason
        self.stats.lost[engine.name] = reason
        return engine.client.break_streams(f"engine {engine.name} lost: {reason}")

    def replace_engine(self, engine: EngineHandle, client: SGLangClient) -> SGLangClient:
        """The restarted engine takes ``engine``'s place: it holds the starting weights
        (version 0) and pulls the newest version before it takes work, like an engine that
        joins. Returns the old client (the caller closes it). Call on the manager's loop."""
        old, engine.client = engine.client, client
        engine.epoch += 1
        engine.version, engine.pulls = 0, 0
        engine.healthy, engine.restarting, engine.evicted, engine.lost = True, False, None, None
        engine.draining = engine.paused = engine.pulling = False
        engine.resuming = 0
        engine.in_flight = {}  # its trajectories moved on when it failed
        engine.idle_since = None
        self.stats.engine_restarts += 1
        self.relay_versions.changed.set()
        self._start_engine_loop(engine)
        return old

    def replace_relay(self, old_url: str, new_url: str,
                      client: Callable[[str], RelayClient]) -> list:
        """A relay restarted (or its engines now pull from another): engines that pulled from
        ``old_url`` -- alone, or as one stripe of their node's relays -- pull from ``new_url``
        in its place, through ``client(url)`` (``relay.striped.relay_client``). Returns the
        old clients (the caller closes them)."""
        from ..relay.striped import replaced

        old, new, gone = [], {}, {old_url}  # (engines of one node share their new client)
        for e in self.engines:
            url = replaced(e.relay.url, old_url, new_url)
            if url != e.relay.url:
                gone.add(e.relay.url)
                old.append(e.relay)
                if url not in new:
                    new[url] = client(url)
                e.relay = new[url]
        for url in gone:
            self.relay_versions.forget(url)
        return old

    async def _engine_of_version(self, item: InFlight) -> EngineHandle:
        """A healthy engine of ``item``'s version to continue on (the least loaded), waiting
        while one may still come; the trajectory is placed on it. (With ``interrupt``, AReaL's
        mode, a trajectory spans versions anyway: any healthy engine that is not paused.)"""
        while not self._stop.is_set():
            candidates = [e for e in self.engines if e.healthy and not e.paused
                          and not e.leaving and (
                self.interrupt or (e.version == item.traj.weight_version and not e.draining))]
            if candidates:
                target = min(candidates, key=lambda e: len(e.in_flight))
                item.engine = target.name
                target.in_flight[item.rid] = item
                return target
            # a restarting engine comes back at version 0 and pulls the newest: it can take
            # the trajectory only if that is its version
            may_come = any(e.restarting for e in self.engines) and (
                self.interrupt or item.traj.weight_version in (0, self.relay_versions.latest))
            if not may_come and (not any(e.healthy for e in self.engines) or not self.interrupt
                                 and all(e.version > item.traj.weight_version
                                         for e in self.engines if e.healthy)):
                raise Discard("no_engine_of_its_version")
            await asyncio.sleep(self.poll_s)
        raise Stopped()
