"""Machines' NICs on virtual time: transfers that cross the same NIC share its bandwidth.

Each machine has ``nic_bytes_s`` out and as much in (``costs.NETWORK``: 8 x 400 Gbps, full
duplex). A transfer from machine ``src`` to machine ``dst`` runs at the least of its own cap
(what one such transfer reaches alone: the publish or chain link of ``costs.LINKS``), its
equal share of ``src``'s outgoing bandwidth and its equal share of ``dst``'s incoming one; the
rates are recomputed whenever a transfer starts or ends, and one timer waits for the next end.
It owns nothing else: who sends what, and when, is the relay tier's (``relays.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional

from .costs import NETWORK


@dataclass(eq=False)
class _Transfer:
    src: Hashable
    dst: Hashable
    left: float  # bytes still to send
    cap: float  # bytes/s this transfer reaches alone
    done: asyncio.Future = field(default=None)
    rate: float = 0.0


class Network:
    def __init__(self, nic_bytes_s: Optional[float] = None):
        self.nic_bytes_s = NETWORK["nic_bytes_s"] if nic_bytes_s is None else nic_bytes_s
        self.loop = asyncio.get_running_loop()
        self.active: List[_Transfer] = []
        self.t_last = 0.0
        self._timer: Optional[asyncio.TimerHandle] = None
        self.bytes_sent = 0.0
        self.shared_s = 0.0  # transfer-seconds spent below their own cap (contention)

    async def transfer(self, src: Hashable, dst: Hashable, nbytes: float, cap: float) -> float:
        """Send ``nbytes`` from ``src`` to ``dst``; returns the seconds it took."""
        t0 = self.loop.time()
        if nbytes <= 0:
            return 0.0
        self._advance()
        t = _Transfer(src, dst, float(nbytes), cap, self.loop.create_future())
        self.active.append(t)
        self._reschedule()
        await t.done
        return self.loop.time() - t0

    def _advance(self) -> None:
        now = self.loop.time()
        dt = now - self.t_last
        if dt > 0:
            for t in self.active:
                sent = min(t.left, t.rate * dt)
                t.left -= sent
                self.bytes_sent += sent
                if t.rate < t.cap * (1 - 1e-9):
                    self.shared_s += dt
        self.t_last = now

    def _rates(self) -> None:
        out: Dict[Hashable, int] = {}
        into: Dict[Hashable, int] = {}
        for t in self.active:
            out[t.src] = out.get(t.src, 0) + 1
            into[t.dst] = into.get(t.dst, 0) + 1
        for t in self.active:
            t.rate = min(t.cap, self.nic_bytes_s / out[t.src], self.nic_bytes_s / into[t.dst])

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        finished = [t for t in self.active if t.left <= 1e-6 * max(t.cap, 1.0)]
        for t in finished:
            self.active.remove(t)
            if not t.done.done():
                t.done.set_result(None)
        if not self.active:
            return
        self._rates()
        wait = min(t.left / t.rate for t in self.active)
        self._timer = self.loop.call_at(self.t_last + max(wait, 0.0), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        for t in self.active:  # round-off: what the timer was set for is done
            if t.left <= t.rate * 1e-9 + 1e-3:
                t.left = 0.0
        self._reschedule()
