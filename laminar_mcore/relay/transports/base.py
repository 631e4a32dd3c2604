"""The two halves of a weight transport, and the per-bucket pull every transport shares."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence


class TransportUnavailable(RuntimeError):
    """This relay or machine cannot serve or use the transport; the message says why and how."""


class Exporter:
    """Relay side. ``check`` runs once per lease (on ``/pull``) and returns what ``serve``
    needs for it, raising ``ValueError`` for a bad request (answered 400); ``serve`` returns
    bucket ``index``'s JSON-ready payload; ``free`` is told the buckets the engine has
    applied, ``release`` that the lease ended. ``serve``/``free``/``release`` run in a worker
    thread. ``info`` goes into the relay's ``/latest``. A transport that can serve each
    engine rank its own shard (``shards``) has ``serve_shard``: group ``index`` of a
    ``relay.shard_pulls.ShardPlan``, one payload per rank."""

    shards = False

    def check(self, body: dict) -> Any:
        return None

    def serve(self, lease_id: str, index: int, bucket, params: Any) -> Any:
        raise NotImplementedError

    def copies(self, params: Any) -> int:
        """How many copies of a whole bucket ``serve`` makes (what ``bytes_served`` counts)."""
        return 1

    def check_shard(self, params: Any, tp: int) -> None:
        """Whether a shard lease of TP ``tp`` can be served with ``params`` (``ValueError``)."""

    def serve_shard(self, lease_id: str, index: int, plan, params: Any) -> List[Any]:
        raise TransportUnavailable("LMC-E519: this transport serves whole tensors only")

    def free(self, lease_id: str, indices: Sequence[int]) -> None:
        pass

    def release(self, lease_id: str) -> None:
        pass

    def info(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        """``close`` from an event loop (pullers holding HTTP sessions close them here)."""
        self.close()


class Puller:
    """Engine side: ``await pull(relay, engine, current_version)`` applies the relay's newest
    version to ``engine`` if newer, in one SGLang weight-update session, and returns it (None:
    nothing newer). The default leases in ``lease_format()``, fetches bucket i+1 while the
    engine applies bucket i, and acknowledges applied buckets, so the relay holds at most two."""

    def __init__(self, spec):
        self.spec = spec
        self.loads: Dict[str, int] = {}  # versions applied, by load_format (a run's summary)
        self.shard = spec.option("shard")  # (tp, heads, tied, ep): each rank its own shard
        self._verified = not spec.option("verify")

    async def _verify(self, engine) -> None:
        """An engine holds the layout a shard pull serves only if its resolved arguments say so
        (``engine_layout.sglang_layout_mismatch`` of its ``/server_info``, asked once): if not,
        ``verify`` auto pulls whole tensors from then on, shard refuses."""
        import logging

        from ...weights.engine_layout import EngineLayoutError, sglang_layout_mismatch

        why = sglang_layout_mismatch(await engine.get_server_info(), self.shard[0],
                                     self.shard[3], bool(self.spec.option("moe")))
        if why and self.spec.option("verify") == "shard":
            raise EngineLayoutError(f"LMC-E519: weight_sync.engine_pull=shard: {why}; use "
                                    "engine_pull=auto (whole tensors there) or change it")
        if why:
            logging.getLogger(__name__).warning(
                "engine %s pulls whole tensors: %s", getattr(engine, "url", "?"), why)
            self.shard = None
        self._verified = True

    def lease_format(self) -> str:
        return self.spec.fmt

    async def pull(self, relay, engine, current_version: int) -> Optional[int]:
        if not self._verified:
            await self._verify(engine)
        shard = self.shard
        lease = await relay.lease(min_version=current_version + 1, fmt=self.lease_format(),
                                  devices=self.spec.devices or None,
                                  shard=dict(zip(("tp_size", "heads", "tied", "ep_size"), shard))
                                  if shard else None)
        if lease is None:
            return None
        from ..client import apply_version

        given: set = set()

        async def fetch(i) -> List[str]:
            # Asked while the engine applies bucket i-1: every other bucket given is done with
            # (also after a failed attempt, when apply_version starts again from bucket 0).
            done = sorted(given - {i - 1})
            data = await relay.bucket(lease, i, applied=done)
            given.difference_update(done)
            given.add(i)
            # one payload per engine TP rank (a host handle: the same one for every rank)
            return data if isinstance(data, list) else [data] * int(self.spec.option("ranks", 1))

        try:
            fmt = "direct" if shard else "flattened_bucket"
            await apply_version(engine, (lease.num_buckets, fetch), lease.version,
                                load_format=fmt)
            self.loads[fmt] = self.loads.get(fmt, 0) + 1
        finally:
            await relay.release(lease)
        return lease.version

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        """``close`` from an event loop (pullers holding HTTP sessions close them here)."""
        self.close()
