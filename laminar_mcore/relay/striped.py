"""A striped relay tier read as one relay (issue 52): one version from every stripe.

With ``weight_sync.master_relays`` = N, a version is published in N stripes (whole pipeline
stages each, ``weights.shards.stripe_parts``), each received by its own master relay and
chained down its own relays; a rollout node holds one relay per stripe. ``StripedRelay`` gives
an engine's puller (``relay/transports``) and the rollout manager the same calls as a
``RelayClient`` over those N relays: a lease is the *same* version leased on every stripe
(never one stripe's newer weights with another's older ones), its buckets are stripe 0's, then
stripe 1's, ...; ``latest`` is the newest version every stripe holds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from .client import Lease, RelayClient, RelayError

logger = logging.getLogger("laminar_mcore.relay")

ALIGN_S = 30.0  # how long a lease waits for lagging stripes to hold the leading one's version


@dataclass
class StripedLease(Lease):
    """The same version leased on every stripe: ``parts[k]`` is stripe k's lease."""

    parts: List[Lease] = field(default_factory=list)

    def locate(self, index: int) -> Tuple[int, int]:
        """(stripe, that stripe's bucket index) of bucket ``index`` of the whole lease."""
        if not 0 <= index < self.num_buckets:
            raise RelayError(f"LMC-E405: bucket {index} is not one of the lease's "
                             f"{self.num_buckets}", 404)
        for k, part in enumerate(self.parts):
            if index < part.num_buckets:
                return k, index
            index -= part.num_buckets
        raise AssertionError("unreachable")


async def _all_or_none(calls: list) -> list:
    """Every call's answer, in order; the first to fail cancels the others (a stripe's relay
    that is down must not leave the other stripes' long polls running) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def relay_client(url: str, token: str, timeout_s: float = 30.0):
    """A client of the relay at ``url``, or of a striped node's relays when ``url`` joins
    theirs with commas in stripe order (``StripedRelay.url``): the same calls either way."""
    urls = [u for u in url.split(",") if u]
    if len(urls) > 1:
        return StripedRelay(urls, token, timeout_s)
    return RelayClient(url, token, timeout_s)


def replaced(url: str, old: str, new: str) -> str:
    """``url`` (one relay's, or a striped node's comma-joined ones) with relay ``old`` replaced
    by ``new``."""
    return ",".join(new if u.rstrip("/") == old.rstrip("/") else u for u in url.split(","))


class StripedRelay:
    """``RelayClient``'s calls over one relay per stripe (``urls[k]``: stripe k's relay, which
    ``check`` verifies from each relay's ``/latest``)."""

    def __init__(self, urls: Sequence[str], token: str, timeout_s: float = 30.0,
                 align_s: float = ALIGN_S):
        if not urls:
            raise ValueError("LMC-E102: a striped relay needs one relay URL per stripe")
        self.relays = [RelayClient(u, token, timeout_s) for u in urls]
        self.url = ",".join(r.url for r in self.relays)
        self.align_s = align_s
        self._checked = False

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        for relay in self.relays:
            await relay.close()

    async def check(self) -> None:
        """Each relay carries the stripe its place says (``[k, N]`` in its ``/latest``);
        RelayError LMC-E518 otherwise (relays given in another order, or of another tier)."""
        n = len(self.relays)
        for k, info in enumerate(await asyncio.gather(*(r.latest() for r in self.relays))):
            if info.get("stripe", [0, 1]) != [k, n]:
                raise RelayError(f"LMC-E518: relay {self.relays[k].url} carries stripe "
                                 f"{info.get('stripe')} (S, N) where stripe [{k}, {n}] was "
                                 "expected: give one relay per stripe, in stripe order", 409)
        self._checked = True

    async def latest(self, after: Optional[int] = None, wait_s: float = 0.0) -> dict:
        """The newest version every stripe holds (``version``: None while one holds none) and
        each stripe's answer (``stripes``); with ``after``, a long poll on every stripe at once,
        answered once each holds a version newer than ``after`` (or after ``wait_s``)."""
        infos = await _all_or_none([r.latest(after, wait_s) for r in self.relays])
        versions = [info.get("version") for info in infos]
        common = None if any(v is None for v in versions) else min(versions)
        return {"version": common, "stripes": list(infos)}

    async def lease(self, min_version: int = -1, ttl_s: Optional[float] = None,
                    fmt: str = "shm", device: Optional[str] = None,
                    devices: Optional[Sequence[str]] = None,
                    shard: Optional[dict] = None) -> Optional[StripedLease]:
        """Lease the newest version at or above ``min_version`` that every stripe holds: each
        stripe's newest, then the lagging stripes again once they hold the leading one's (the
        leading leases keep it held meanwhile). None when a stripe has nothing at or above
        ``min_version``, or the stripes do not meet within ``align_s`` (a stripe's master was
        lost: the engine keeps its weights and asks again later)."""
        if not self._checked:
            await self.check()
        kw = dict(ttl_s=ttl_s, fmt=fmt, device=device, devices=devices, shard=shard)
        leases: List[Optional[Lease]] = [None] * len(self.relays)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.align_s
        try:
            got = await asyncio.gather(*(self._lease_into(leases, k, min_version, kw)
                                         for k in range(len(self.relays))),
                                       return_exceptions=True)
            for g in got:
                if isinstance(g, BaseException):
                    raise g
            while all(lease is not None for lease in leases):
                target = max(lease.version for lease in leases)
                if all(lease.version == target for lease in leases):
                    out, leases = leases, []  # (nothing to let go in ``finally``)
                    return StripedLease(target, ",".join(p.lease_id for p in out),
                                        sum(p.num_buckets for p in out),
                                        sum(p.nbytes for p in out), parts=out)
                left = deadline - loop.time()
                if left <= 0:
                    logger.warning("the stripes hold versions %s and did not meet at %d within "
                                   "%g s", [p.version for p in leases], target, self.align_s)
                    return None
                for k, lease in enumerate(leases):
                    if lease.version < target:
                        leases[k] = None
                        if lease.lease_id:
                            await self.relays[k].release(lease)
                        await self.relays[k].latest(target - 1, min(left, 10.0))
                        leases[k] = await self.relays[k].lease(target, **kw) or \
                            Lease(-1, "", 0, 0)  # not there yet: ask again (until the deadline)
            return None
        finally:
            await self._release_all(leases)

    async def _lease_into(self, leases: list, k: int, min_version: int, kw: dict) -> None:
        """Stripe k's lease into ``leases[k]`` (so that a cancelled ``lease`` lets it go)."""
        leases[k] = await self.relays[k].lease(min_version, **kw)

    async def _release_all(self, leases: Sequence[Optional[Lease]]) -> bool:
        """Release every stripe's lease (one failing never keeps the others held)."""
        done = await asyncio.gather(*(relay.release(lease) for relay, lease
                                      in zip(self.relays, leases)
                                      if lease is not None and lease.lease_id),
                                    return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException):
                logger.warning("a striped lease's release failed: %s", outcome)
        return all(outcome is True for outcome in done)

    async def bucket(self, lease: StripedLease, index: int,
                     applied: Sequence[int] = ()) -> Union[str, List[str]]:
        """Bucket ``index`` of the whole lease; ``applied`` as ``RelayClient.bucket``: each
        stripe's relay hears of its own buckets (another stripe's in an acknowledgement of its
        own), so no relay keeps more than two outstanding across a stripe's end."""
        stripe, local = lease.locate(index)
        acks: dict = {}
        for k, j in map(lease.locate, applied):
            acks.setdefault(k, []).append(j)
        others = [self.relays[k].bucket(lease.parts[k], None, applied=js)
                  for k, js in acks.items() if k != stripe]
        if others:
            await asyncio.gather(*others)
        return await self.relays[stripe].bucket(lease.parts[stripe], local,
                                                applied=acks.get(stripe, []))

    async def buckets(self, lease: StripedLease) -> List[Union[str, List[str]]]:
        """Every bucket of a host-memory lease, stripe by stripe (``RelayClient.buckets``)."""
        out: list = []
        for relay, part in zip(self.relays, lease.parts):
            out.extend(await relay.buckets(part))
        return out

    async def release(self, lease: StripedLease) -> bool:
        """End the lease on every stripe (True when every relay took it now)."""
        return await self._release_all(lease.parts)
