"""Elastic rollout capacity: engines that join a running job (a rollout node registering,
``RolloutManager.add_engine``) and engines that leave it gracefully (a rollout node stopped with
SIGTERM asks the controller, ``POST /leave``).

A leaving engine takes no new trajectory and pulls no new version from the moment it is
retired. Its trajectories finish where they run, for up to ``grace_s``; whatever still runs then
is handed back: aborted on the leaving engine and continued, with the tokens it has, on an
engine of the same version with room (a repack move, so it stays one version's), or, where none
exists, discarded with a reason (``engine_left``; counted, never lost). Then the
engine is out of the run: no restart, no fault, no lost trajectory; the books list it in
``engines_left``.

Mixed into ``RolloutManager`` (controller/manager.py), which provides ``engines``, ``stats``,
``notify``, ``stopping`` and ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Dict, List, Optional

from ..netutil import EngineError
from .engines import EngineHandle

logger = logging.getLogger("laminar_mcore.controller.manager")


class Elastic:
    """Engines that leave a running job (see the module docstring)."""

    def _hand_back_target(self, item, leaving: EngineHandle) -> Optional[EngineHandle]:
        """An engine to continue ``item`` on: same version, in service, room, the emptiest."""
        version = item.traj.weight_version
        candidates = [e for e in self.engines
                      if e is not leaving and e.healthy and not e.leaving and not e.paused
                      and not e.draining and e.version == version
                      and len(e.in_flight) + e.resuming < e.capacity]
        return min(candidates, key=lambda e: len(e.in_flight), default=None)

    async def retire(self, engines: List[EngineHandle], grace_s: float) -> Dict[str, int]:
        """Take ``engines`` out of the run gracefully; returns how their trajectories ended
        (``finished`` where they ran, ``handed_back``, ``discarded``)."""
        for engine in engines:
            engine.leaving = True
        self.notify()
        running = sum(len(e.in_flight) for e in engines)
        deadline = time.monotonic() + max(float(grace_s), 0.0)
        while any(e.in_flight for e in engines) and time.monotonic() < deadline \
                and not self.stopping:
            await asyncio.sleep(0.05)
        handed = discarded = 0
        for engine in engines:
            for rid, item in list(engine.in_flight.items()):
                if item.migrate_to is not None:
                    continue
                dest = self._hand_back_target(item, engine)
                if item.multi_turn and not item.generating:  # between turns: its place moves
                    if dest is None:
                        continue  # its next turn finds an engine of its version, or none
                    self._left(engine, rid)  # (its loop hears of it: it may end now)
                    dest.in_flight[rid] = item
                    item.engine = dest.name
                    handed += 1
                    continue
                item.migrate_to = dest.name if dest is not None else None
                if dest is not None:
                    dest.incoming[rid] = (engine.name, item)
                with contextlib.suppress(EngineError):
                    await engine.client.abort_request(rid)
                handed += dest is not None
                discarded += dest is None
        settle = time.monotonic() + 30.0
        while any(e.in_flight for e in engines) and time.monotonic() < settle \
                and not self.stopping:
            await asyncio.sleep(0.05)
        for engine in engines:
            if engine in self.engines:
                self.engines.remove(engine)
            self.stats.left[engine.name] = engine.client.base_url
        self.relay_versions.changed.set()  # (its relay is watched no more)
        finished = running - handed - discarded
        logger.info("engines %s left the run: %d trajectories finished there, %d handed back, "
                    "%d discarded", ", ".join(e.name for e in engines), finished, handed,
                    discarded)
        self.notify()
        return {"finished": finished, "handed_back": handed, "discarded": discarded}
