"""The relay's client, and how one leased version is applied to an engine.

A rollout takes new weights when it is between trajectories through its weight transport's
``Puller`` (``relay/transports``): lease the newest complete version, apply it to the engine in
one SGLang weight-update session (``apply_version``), then release the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import aiohttp
import torch

from ..errors import code_of, coded
from ..netutil import EngineError
from ..weights.bucket import decode_handle, open_handle


logger = logging.getLogger(__name__)
# how long a lease whose relay could not be reached is tried again (RelayClient.release)
RELEASE_RETRY_S = 600.0


class RelayError(RuntimeError):
    """A relay call failed; ``status``: the relay's HTTP answer, None when it gave none."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class WeightApplyError(RuntimeError):
    """A version could not be applied. ``mixed`` says whether the engine may now hold part of
    it (it must then not serve: take it out of service or reload it); otherwise the engine
    still serves its previous version, untouched."""

    def __init__(self, message: str, *, mixed: bool):
        super().__init__(message)
        self.mixed = mixed


@dataclass
class Lease:
    """A leased version; its buckets are fetched one at a time (``RelayClient.bucket``):
    a shared-memory handle (format "shm"), a Mooncake handle ("mooncake"), or for
    "sglang_cuda_ipc" a list with one SGLang payload per engine TP rank."""

    version: int
    lease_id: str
    num_buckets: int
    nbytes: int


def probe_relay(url: str, timeout_s: float = 2.0,
                token: Optional[str] = None) -> Tuple[str, Optional[dict]]:
    """A relay's liveness from its ``/health``: ("alive", the answer), ("gone", None) when
    nothing listens (the process is dead) or ("silent", None) when it does not answer within
    ``timeout_s`` (maybe only busy). With the run's ``token`` the answer has the relay's
    details (id, master, control URL, data address, version); without it only ``ok``.
    Synchronous (for threads; wrap in ``asyncio.to_thread``)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/health")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return ("alive", json.loads(resp.read())) if resp.status == 200 else ("silent", None)
    except urllib.error.URLError as exc:
        return ("gone" if isinstance(exc.reason, ConnectionRefusedError) else "silent"), None
    except ConnectionRefusedError:
        return "gone", None
    except (OSError, ValueError):
        return "silent", None


class RelayClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._session: Optional[aiohttp.ClientSession] = None
        self.last_release: dict = {}  # the relay's answer to the last /release (peak, served)
        self._pending: set = set()  # releases being retried (``release``)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        for task in list(self._pending):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Optional[dict] = None,
                    extra_s: float = 0.0) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"})
        try:
            async with self._session.request(method, self.url + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s + extra_s)) as r:
                text = await r.text()
                if r.status >= 400:
                    raise RelayError(coded(code_of(text) or "LMC-E510",
                                           f"{path}: HTTP {r.status}: {text[:300]}"), r.status)
                return json.loads(text)
        except asyncio.TimeoutError:
            raise RelayError(f"LMC-E510: {path}: relay {self.url} did not answer within "
                             f"{self.timeout_s:g} s "
                             "(RelayClient timeout_s)") from None
        except aiohttp.ClientError as exc:
            raise RelayError(f"LMC-E510: {path}: relay {self.url} unreachable: {exc!r}") from None

    async def latest(self, after: Optional[int] = None, wait_s: float = 0.0) -> dict:
        """The relay's newest version and state; with ``after``, a long poll that answers once
        it holds a version newer than ``after`` (or after ``wait_s``)."""
        if after is None or wait_s <= 0:
            return await self._call("GET", "/latest")
        return await self._call("GET", f"/latest?after={int(after)}&wait_s={wait_s:g}",
                                extra_s=wait_s)

    async def lease(self, min_version: int = -1, ttl_s: Optional[float] = None,
                    fmt: str = "shm", device: Optional[str] = None,
                    devices: Optional[Sequence[str]] = None,
                    shard: Optional[dict] = None) -> Optional[Lease]:
        """Lease the newest version at or above ``min_version``: shared-memory handles (CPU
        engines) or, with ``fmt="sglang_cuda_ipc"``, SGLang's CUDA IPC payloads for the
        engine's ``devices`` (one per TP rank; ``device`` is the one-GPU shorthand). With
        ``shard`` ({tp_size, heads, tied, ep_size}) each bucket holds each rank's own parameters
        in SGLang's per-rank layout (``load_format="direct"``; relay/shard_pulls.py)."""
        body = {"min_version": min_version, "format": fmt}
        if shard is not None:
            body["shard"] = dict(shard)
        if devices is not None:
            body["devices"] = list(devices)
        elif device is not None:
            body["devices"] = [device]
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        out = await self._call("POST", "/pull", body)
        if out.get("version") is None:
            return None
        return Lease(out["version"], out["lease_id"], out["num_buckets"], out["nbytes"])

    async def bucket(self, lease: Lease, index: Optional[int],
                     applied: Sequence[int] = ()) -> Union[str, List[str], None]:
        """Bucket ``index`` of ``lease``; ``applied``: buckets the engine has finished applying,
        whose copies the relay may free. At most two may be outstanding (RelayError 409).
        ``index`` None: only the acknowledgements (answers None)."""
        body = {"lease_id": lease.lease_id, "applied": list(applied)}
        if index is not None:
            body["index"] = index
        out = await self._call("POST", "/bucket", body)
        return out["serialized"]

    async def buckets(self, lease: Lease) -> List[Union[str, List[str]]]:
        """Every bucket of a host-memory lease (shm, mooncake), in order, each acknowledged
        when the next is asked for (host handles stay valid until the lease is released)."""
        return [await self.bucket(lease, i, applied=[i - 1] if i else [])
                for i in range(lease.num_buckets)]

    async def release(self, lease: Lease) -> bool:
        """End ``lease``. A relay that cannot be reached now (its host's link down for a
        while) is told later, in the background, until it answers or ``RELEASE_RETRY_S``
        have passed (False here): a lease left behind holds its version's buffers until the
        relay's lease TTL (600 s), and with ``weight_sync.relay_versions`` of them held the
        relay takes no newer version meanwhile."""
        try:
            out = await self._call("POST", "/release", {"lease_id": lease.lease_id})
        except RelayError as exc:
            if exc.status is not None:  # it answered: nothing to try again
                raise
            task = asyncio.get_running_loop().create_task(self._release_later(lease, exc))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return False
        self.last_release = out
        return out["released"]

    async def _release_later(self, lease: Lease, first: RelayError) -> None:
        deadline = asyncio.get_running_loop().time() + RELEASE_RETRY_S
        last: Exception = first
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(1.0)
            try:
                self.last_release = await self._call("POST", "/release",
                                                     {"lease_id": lease.lease_id})
                logger.info("lease %s of version %d released at %s after %s", lease.lease_id,
                            lease.version, self.url, first)
                return
            except RelayError as exc:
                last = exc
                if exc.status is not None:
                    return
        logger.warning("lease %s of version %d at %s could not be released (%s); it lapses "
                       "with the relay's lease TTL", lease.lease_id, lease.version, self.url,
                       last)


@contextlib.contextmanager
def open_lease(serialized_buckets: Sequence[str]) -> Iterator[Dict[str, torch.Tensor]]:
    """Views of every tensor of a leased version's shared-memory buckets
    (``await relay.buckets(lease)``), valid inside the block."""
    with contextlib.ExitStack() as stack:
        named: Dict[str, torch.Tensor] = {}
        for data in serialized_buckets:
            named.update(stack.enter_context(open_handle(decode_handle(data))))
        yield named


BucketSource = Union[Sequence[Sequence[str]], Tuple[int, Callable[[int], Awaitable[List[str]]]]]


async def apply_version(engine, buckets: BucketSource, version: int, *,
                        attempts: int = 2, load_format: str = "flattened_bucket") -> None:
    """Apply one complete version to ``engine`` (an ``SGLangClient``) as SGLang 0.5.23 requires:
    ``begin_weight_update``, every bucket through ``update_weights_from_tensor`` (one payload
    per engine TP rank), the last one setting ``weight_version`` and flushing the cache (so no
    prompt KV of the old weights survives), ``end_weight_update`` -- also on errors.

    A failure before any tensor was sent leaves the previous version (``mixed=False``); one
    after is retried from the first bucket (``attempts`` in all), since the engine may hold
    part of the new version; if it still fails the error has ``mixed=True``. Never aborts
    requests.

    ``buckets``: per bucket the payloads (one per engine TP rank; ``load_format`` "direct" when
    each holds its rank's own parameters), or ``(count, fetch)`` where
    ``await fetch(i)`` returns bucket i's payloads: bucket i+1 is then fetched while the engine
    applies bucket i, never earlier, so the source holds at most two buckets at a time."""
    if isinstance(buckets, tuple) and len(buckets) == 2 and callable(buckets[1]):
        count, fetch = buckets
    else:
        listed = [list(b) for b in buckets]
        count = len(listed)

        async def fetch(i):
            return listed[i]

    last_error: Optional[BaseException] = None
    for _ in range(attempts):
        try:
            await engine.begin_weight_update()
        except EngineError as exc:
            if "already open" not in exc.message:
                raise WeightApplyError(f"LMC-E511: could not open a weight-update session for "
                                       f"version {version}: {exc}; the engine keeps its "
                                       "previous version", mixed=last_error is not None) from None
            await engine.end_weight_update()  # a session left open by an earlier failure
            await engine.begin_weight_update()
        nxt = None
        try:
            per_rank = await fetch(0) if count else []
            for i in range(count):
                final = i == count - 1
                apply = engine.update_weights_from_tensor(
                    list(per_rank), load_format=load_format, abort_all_requests=False,
                    flush_cache=final, weight_version=str(version) if final else None)
                if final:
                    await apply
                else:  # the next bucket is made ready while the engine loads this one
                    nxt = asyncio.ensure_future(fetch(i + 1))
                    await apply
                    per_rank, nxt = await nxt, None
            last_error = None
        except (EngineError, RelayError) as exc:
            last_error = exc
            if nxt is not None:
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
        finally:
            with contextlib.suppress(EngineError):
                await engine.end_weight_update()
        if last_error is None:
            return
    raise WeightApplyError(f"LMC-E512: version {version} failed to apply {attempts} times "
                           f"({last_error}); the engine may hold a mix of two versions and must "
                           "not serve until it pulls a complete version", mixed=True)
