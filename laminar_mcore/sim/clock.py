"""A virtual-time asyncio event loop: whenever nothing is ready, the clock jumps to the next
timer instead of waiting for it, so hours of cluster time run in seconds.

Everything scheduled through the loop (``asyncio.sleep``, ``wait_for``, ``call_at``) sees
virtual time through ``loop.time()``; the simulated components and the manager (its ``clock``)
read it there. Real I/O still works (it is polled without waiting, every ``POLL_EVERY`` iterations), but a simulation must not
rely on it: its time would not advance while waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from typing import Awaitable, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is scheduled: every task waits for something that no
    simulated component will ever do."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _InstantSelector(selectors.DefaultSelector):
    # real I/O is polled once every this many loop iterations (and before a stall is
    # declared): a system call per iteration was a tenth of a simulation's time
    POLL_EVERY = 256

    def __init__(self, clock: _Clock):
        super().__init__()
        self.clock = clock
        self._calls = 0

    def select(self, timeout=None):
        self._calls += 1
        if timeout is None or self._calls % self.POLL_EVERY == 0:
            events = super().select(0)
            if events:
                return events
        else:
            events = []
        if timeout is None:
            raise SimulationStalled("the simulation has nothing ready and nothing scheduled: "
                                    "a task waits for an event no component will set")
        if timeout > 0:
            self.clock.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _Clock()
        super().__init__(selector=_InstantSelector(self._virtual))

    def time(self) -> float:
        return self._virtual.now


# The cyclic garbage collector's thresholds while a simulation runs (Python's: 700, 10, 10;
# 0: no automatic collection). A run keeps hundreds of
# thousands of objects alive (the buffer's trajectories, a task and a future per request),
# and at Python's thresholds a full collection walked all of them every few thousand
# requests: half a run's CPU time (32B on 128 GPUs, laminar, 5 iterations: 14.5 s at
# Python's, 7.6 s at (50000, 20, 100), 6.7 s with none), for nothing: the run's objects are
# freed by their reference counts (7B on 256 GPUs, AReaL, 15 iterations: the same 847 MB
# peak with and without collections; the cycles left after a run: 20 objects, collected by
# the caller's own thresholds, restored after it; a full collection after each run cost
# more than the collections it saved).
GC_THRESHOLDS = (0,)


@contextlib.contextmanager
def gc_thresholds():
    """The collector at ``GC_THRESHOLDS`` inside the block, as it was after it."""
    old = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def run_virtual(main: Awaitable[T]) -> T:
    """Run ``main`` to its end on a fresh virtual-time loop (virtual time starts at 0), with
    the collector at ``GC_THRESHOLDS``."""
    loop = VirtualTimeLoop()
    try:
        with gc_thresholds():
            return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
