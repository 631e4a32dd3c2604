"""How a new version reaches the engines, per system: Laminar's relays or a global NCCL update.

* ``laminar``: the trainer publishes to the master relay over the network (its stall), the
  relays forward it along Laminar's pipelined chain T(p, k), every hop a transfer on the
  machines' NICs (``network.py``: hops that share a NIC share its bandwidth), and each engine
  pulls from its own machine's relay over PCIe when it is between trajectories.
* ``broadcast`` (verl disaggregated, one-step, stream, AReaL): one NCCL broadcast from the
  trainer to every rollout GPU behind a barrier (``CostModel.broadcast_s``): the trainer and
  every engine stop for all of it. Modelled as every relay holding the version at once and each
  engine's update costing the broadcast, while the trainer stalls for it too.
* ``colocated`` (verl colocated): the reshard in place (``CostModel.colocated_sync_s``).

A relay here is what the manager sees of one (``RelayClient``'s ``url`` and ``latest``); a
machine's failure takes its relay out of the chain (the next alive one takes its place, the
first alive one is the master) and a replacement re-joins by fetching the newest version from
the master over the network.
"""

from __future__ import annotations

import asyncio
from typing import Callable, List, Optional

from .costs import LINKS, CostModel
from .engine import SimEngineClient
from .network import Network

TRAINER = "trainer"  # the trainer's machines, as one end of a transfer


class SimRelay:
    """A relay as the manager sees it (``RelayClient``'s ``url`` and ``latest``)."""

    def __init__(self, name: str):
        self.url = f"sim://{name}"
        self.version = 0
        self.alive = True
        self._newer = asyncio.Event()
        self.calls = 0  # /latest requests (control traffic)

    def hold(self, version: int) -> None:
        if version > self.version and self.alive:
            self.version = version
            event, self._newer = self._newer, asyncio.Event()
            event.set()

    async def latest(self, after: Optional[int] = None, wait_s: float = 0.0) -> dict:
        self.calls += 1
        if after is not None and wait_s > 0:
            async def newer():
                while self.version <= after:
                    await self._newer.wait()
            try:
                await asyncio.wait_for(newer(), wait_s)
            except asyncio.TimeoutError:
                pass
        return {"version": self.version}

    async def close(self) -> None:
        return None


class SimPuller:
    """An engine takes the newest version its relay holds: ``seconds`` without decoding (its
    shard over PCIe, the NCCL broadcast or the reshard in place); with ``flush`` its radix
    cache is flushed (SGLang's default), so prompts re-prefill."""

    def __init__(self, seconds: float, flush: bool = False):
        self.seconds = seconds
        self.flush = flush

    async def pull(self, relay: SimRelay, client: SimEngineClient, current: int) -> Optional[int]:
        version = relay.version
        if version <= current:
            return None
        client.engine.stall(self.seconds)
        if self.flush:
            client.engine.flush_cache()
        await asyncio.sleep(self.seconds)
        client.engine.version = version
        return version

    async def aclose(self) -> None:
        return None


class RelayTier:
    """The relays of the rollout machines (one each) and how versions reach them."""

    def __init__(self, cost: CostModel, machines: int, protocol: str,
                 network: Optional[Network] = None):
        if protocol not in ("laminar", "broadcast", "colocated"):
            raise ValueError(f"protocol={protocol!r}")
        self.cost, self.protocol = cost, protocol
        self.relays = [SimRelay(f"relay{i}") for i in range(machines)]
        self.network = network or Network()
        self.tasks: List[asyncio.Task] = []

    def alive(self) -> List[int]:
        return [i for i, r in enumerate(self.relays) if r.alive]

    def update_s(self) -> float:
        """An engine's update from its relay (what ``SimPuller`` stalls it for)."""
        if self.protocol == "broadcast":
            return self.cost.broadcast_s()
        if self.protocol == "colocated":
            return self.cost.colocated_sync_s()
        return self.cost.pull_s()

    async def publish(self, bump: Callable[[], int]) -> float:
        """The trainer hands its new version over; ``bump`` makes it the trainer's version
        (called when it becomes visible) and returns it. Returns the seconds the trainer
        stalled. The relays then hold it (laminar: along the chain, in the background)."""
        loop = asyncio.get_running_loop()
        if self.protocol == "colocated":
            version = bump()
            for r in self.relays:
                r.hold(version)
            return 0.0
        if self.protocol == "broadcast":  # the collective: every engine and the trainer stop
            version = bump()
            for r in self.relays:
                r.hold(version)
            seconds = self.cost.broadcast_s()
            await asyncio.sleep(seconds)
            return seconds
        order = self.alive()
        t0 = loop.time()
        if self.cost.publish_seconds >= 0 or not order:  # measured (calibration): as it was
            await asyncio.sleep(self.cost.publish_s())
        else:
            await self.network.transfer(TRAINER, order[0], self.cost.weight_bytes,
                                        LINKS["publish_bytes_s"])
        version = bump()
        if not order:
            return loop.time() - t0
        self.relays[order[0]].hold(version)
        if len(order) > 1:
            self.tasks.append(asyncio.ensure_future(self._chain(version, order)))
            self.tasks = [t for t in self.tasks if not t.done()]
        return loop.time() - t0

    async def _chain(self, version: int, order: List[int]) -> None:
        """Laminar's pipelined chain: hop i starts one chunk after hop i - 1 and ends no
        sooner than one chunk after it; alone, hop i ends (i + k - 1) chunk times after the
        master holds the version (``CostModel.chain_hop_s``)."""
        loop = asyncio.get_running_loop()
        p = len(order)
        k = self.cost._chain_chunks(p)
        chunk_s = self.cost.weight_bytes / k / LINKS["chain_bytes_s"] + LINKS["chain_start_s"]
        cap = self.cost.weight_bytes / (k * chunk_s)
        start = loop.time()
        done: List[asyncio.Future] = [loop.create_future() for _ in order]
        done[0].set_result(start)

        async def hop(i: int) -> None:
            await asyncio.sleep(max(0.0, start + (i - 1) * chunk_s - loop.time()))
            await self.network.transfer(order[i - 1], order[i], self.cost.weight_bytes, cap)
            upstream = await done[i - 1]
            await asyncio.sleep(max(0.0, upstream + chunk_s - loop.time()))
            self.relays[order[i]].hold(version)
            done[i].set_result(loop.time())

        await asyncio.gather(*(hop(i) for i in range(1, p)))

    def kill(self, machine: int) -> None:
        self.relays[machine].alive = False

    async def rejoin(self, machine: int) -> float:
        """A replacement relay fetches the newest version from the master (over the NICs,
        at the chain's link rate) and then serves it; returns the seconds it took."""
        relay = self.relays[machine]
        relay.alive, relay.version = True, 0
        order = [i for i in self.alive() if i != machine]
        if self.protocol != "laminar" or not order:
            version = max((self.relays[i].version for i in order), default=0)
            relay.hold(version)
            return 0.0
        source = order[0]
        version = self.relays[source].version
        seconds = await self.network.transfer(source, machine, self.cost.weight_bytes,
                                              LINKS["chain_bytes_s"])
        relay.hold(version)  # a newer one reaches it along the chain like any relay's
        return seconds

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
