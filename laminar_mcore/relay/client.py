"""Clients of a relay: lease the newest version and apply it to a local engine.

``pull_latest_into_engine`` is how a rollout takes new weights when it is between trajectories:
lease the newest complete version from the relay on its machine, apply it to the engine in one
SGLang weight-update session (``apply_version``), then release the lease.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import aiohttp
import torch

from ..weights.bucket import decode_handle, open_handle


class RelayError(RuntimeError):
    pass


class WeightApplyError(RuntimeError):
    """A version could not be applied. ``mixed`` says whether the engine may now hold part of
    it (it must then not serve: take it out of service or reload it); otherwise the engine
    still serves its previous version, untouched."""

    def __init__(self, message: str, *, mixed: bool):
        super().__init__(message)
        self.mixed = mixed


@dataclass
class Lease:
    version: int
    lease_id: str
    # Per bucket: a shared-memory handle (format "shm"), or for "sglang_cuda_ipc" a list with
    # one SGLang payload per engine TP rank.
    serialized_buckets: List[Union[str, List[str]]]
    nbytes: int


@dataclass(frozen=True)
class PullSpec:
    """How an engine takes weights from its relay: ``fmt="shm"`` (the CPU engine) or
    ``fmt="sglang_cuda_ipc"`` with the engine's GPUs, one per TP rank, in rank order."""

    fmt: str = "shm"
    devices: Tuple[str, ...] = ()


class RelayClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"})
        try:
            async with self._session.request(method, self.url + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                text = await r.text()
                if r.status >= 400:
                    raise RelayError(f"{path}: HTTP {r.status}: {text[:300]}")
                return json.loads(text)
        except aiohttp.ClientError as exc:
            raise RelayError(f"{path}: relay {self.url} unreachable: {exc!r}") from None

    async def latest(self) -> dict:
        return await self._call("GET", "/latest")

    async def lease(self, min_version: int = -1, ttl_s: Optional[float] = None,
                    fmt: str = "shm", device: Optional[str] = None,
                    devices: Optional[Sequence[str]] = None) -> Optional[Lease]:
        """Lease the newest version at or above ``min_version``: shared-memory handles (CPU
        engines) or, with ``fmt="sglang_cuda_ipc"``, SGLang's CUDA IPC payloads for the
        engine's ``devices`` (one per TP rank; ``device`` is the one-GPU shorthand)."""
        body = {"min_version": min_version, "format": fmt}
        if devices is not None:
            body["devices"] = list(devices)
        elif device is not None:
            body["devices"] = [device]
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        out = await self._call("POST", "/pull", body)
        if out.get("version") is None:
            return None
        return Lease(out["version"], out["lease_id"], out["serialized_buckets"], out["nbytes"])

    async def release(self, lease: Lease) -> bool:
        return (await self._call("POST", "/release", {"lease_id": lease.lease_id}))["released"]


@contextlib.contextmanager
def open_lease(lease: Lease) -> Iterator[Dict[str, torch.Tensor]]:
    """Views of every tensor of a leased version (valid inside the block)."""
    with contextlib.ExitStack() as stack:
        named: Dict[str, torch.Tensor] = {}
        for data in lease.serialized_buckets:
            named.update(stack.enter_context(open_handle(decode_handle(data))))
        yield named


async def apply_version(engine, buckets: Sequence[Sequence[str]], version: int, *,
                        attempts: int = 2) -> None:
    """Apply one complete version to ``engine`` (an ``SGLangClient``) as SGLang 0.5.23 requires:
    ``begin_weight_update``, every bucket through ``update_weights_from_tensor`` (one payload
    per engine TP rank), the last one setting ``weight_version`` and flushing the cache (so no
    prompt KV of the old weights survives), ``end_weight_update`` -- also on errors.

    A failure before any tensor was sent leaves the previous version (``mixed=False``); one
    after is retried from the first bucket (``attempts`` in all), since the engine may hold
    part of the new version; if it still fails the error has ``mixed=True``. Never aborts
    requests."""
    from ..rollout.client import EngineError

    last_error: Optional[BaseException] = None
    for _ in range(attempts):
        try:
            await engine.begin_weight_update()
        except EngineError as exc:
            if "already open" not in exc.message:
                raise WeightApplyError(f"could not open a weight-update session for version "
                                       f"{version}: {exc}; the engine keeps its previous "
                                       "version", mixed=last_error is not None) from None
            await engine.end_weight_update()  # a session left open by an earlier failure
            await engine.begin_weight_update()
        try:
            for i, per_rank in enumerate(buckets):
                final = i == len(buckets) - 1
                await engine.update_weights_from_tensor(
                    list(per_rank), load_format="flattened_bucket", abort_all_requests=False,
                    flush_cache=final, weight_version=str(version) if final else None)
            last_error = None
        except EngineError as exc:
            last_error = exc
        finally:
            with contextlib.suppress(EngineError):
                await engine.end_weight_update()
        if last_error is None:
            return
    raise WeightApplyError(f"version {version} failed to apply {attempts} times ({last_error}); "
                           "the engine may hold a mix of two versions and must not serve until "
                           "it pulls a complete version", mixed=True)


async def pull_latest_into_engine(relay: RelayClient, engine, current_version: int, *,
                                  spec: PullSpec = PullSpec()) -> Optional[int]:
    """Apply the relay's newest version to ``engine`` (an ``SGLangClient``) if it is newer than
    ``current_version``; returns the new version, or None when there is nothing newer.
    ``spec`` says how: shared memory for the CPU engine, CUDA IPC to the engine's GPUs for
    SGLang (``rollout.launcher.engine_pull_spec`` builds it from the rollout config). The
    lease is held until the version is applied (``apply_version``) and released after."""
    lease = await relay.lease(min_version=current_version + 1, fmt=spec.fmt,
                              devices=spec.devices or None)
    if lease is None:
        return None
    try:
        await apply_version(engine, [data if isinstance(data, list) else [data]
                                     for data in lease.serialized_buckets], lease.version)
    finally:
        await relay.release(lease)
    return lease.version
