"""The newest weight version each relay holds, as the rollout manager watches it.

One long poll per relay (``/latest?after=``, answered as soon as the relay holds a newer
version, at most ``wait_s``), so control traffic grows neither with time nor with the number of
engines. Relays down a chain lag the master: an engine drains and pulls only once its own relay
holds a version, so versions are kept per relay. It only reads relays: it never pulls, and what
an engine does about a new version is the manager's (controller/manager.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Dict

from ..relay.client import RelayClient, RelayError

logger = logging.getLogger(__name__)


class RelayVersions:
    def __init__(self, relays: Callable[[], Dict[str, RelayClient]],
                 on_newer: Callable[[bool], None], stopping: Callable[[], bool], *,
                 wake_s: float, poll_s: float, wait_s: float):
        """``relays()``: the relays to watch now (URL -> client); ``on_newer(newest)``: a relay
        holds a newer version (``newest``: newer than any relay held before)."""
        self._relays, self._on_newer, self._stopping = relays, on_newer, stopping
        self.wake_s, self.poll_s, self.wait_s = wake_s, poll_s, wait_s
        self.latest = 0  # the newest version any relay holds
        self._versions: Dict[str, int] = {}  # relay URL -> the newest version it holds
        self.changed = asyncio.Event()  # set: the relays to watch may have changed

    def of(self, url: str) -> int:
        """The newest version the relay at ``url`` holds (what its engines can pull)."""
        return self._versions.get(url, 0)

    def forget(self, url: str) -> None:
        """The relay at ``url`` was replaced: what it held says nothing of its successor."""
        self._versions.pop(url, None)
        self.changed.set()

    async def run(self) -> None:
        """Keep one long poll per relay ``relays()`` names, until ``stopping()``."""
        watchers: Dict[str, tuple] = {}  # url -> (its client, the task polling it)
        try:
            while not self._stopping():
                relays = self._relays()
                for url in [u for u, (client, task) in watchers.items()
                            if relays.get(u) is not client or task.done()]:
                    watchers.pop(url)[1].cancel()
                for url, relay in relays.items():
                    if url not in watchers:
                        watchers[url] = (relay, asyncio.create_task(
                            self._watch_one(url, relay), name=f"relay watcher {url}"))
                self.changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), self.wake_s)
        finally:
            tasks = [task for _, task in watchers.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_one(self, url: str, relay: RelayClient) -> None:
        while not self._stopping():
            known = self._versions.get(url, 0)
            try:
                latest = (await relay.latest(after=known, wait_s=self.wait_s)).get("version")
            except (RelayError, RuntimeError) as exc:  # (a client replaced meanwhile)
                logger.debug("relay %s: %s", url, exc)
                await asyncio.sleep(max(self.poll_s, 0.05))
                continue
            if latest is None or latest <= known:
                continue
            self._versions[url] = latest
            newest = latest > self.latest
            if newest:
                self.latest = latest
            self._on_newer(newest)
