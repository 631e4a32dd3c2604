"""The relay's version store: complete versions only, leases pin buffers, versions increase."""

import time

import pytest
import torch

from laminar_mcore.relay.store import BusyError, VersionError, VersionStore
from laminar_mcore.weights.bucket import layout, open_handle, read_bucket, write_bucket


def _fill(store, version, value, stages=1, owner="t"):
    sv = store.begin(version, stages, owner=owner)
    for stage in range(stages):
        named = {f"s{stage}.w": torch.full((8, 4), float(value)), f"s{stage}.b": torch.arange(3)}
        metas, nbytes = layout(named)
        bucket = store.add_bucket(sv, (stage, 0), nbytes, metas, last_of_stage=True)
        write_bucket(bucket.shm.buffer, named, metas)
        store.progress(sv, bucket, nbytes)
    return sv


def test_only_complete_versions_are_visible():
    store = VersionStore()
    try:
        sv = store.begin(1, 2, owner="t")
        named = {"w": torch.ones(4)}
        metas, nbytes = layout(named)
        b = store.add_bucket(sv, (0, 0), nbytes, metas, last_of_stage=True)
        store.progress(sv, b, nbytes)
        assert not store.try_complete(sv) and store.lease_latest() is None  # stage 1 missing
        b2 = store.add_bucket(sv, (1, 0), nbytes, metas, last_of_stage=True)
        store.progress(sv, b2, nbytes // 2)
        assert not store.try_complete(sv)  # half a bucket
        store.progress(sv, b2, nbytes)
        assert store.try_complete(sv) and store.lease_latest()[1].version == 1
    finally:
        store.close()


def test_versions_only_increase_and_sources_do_not_mix():
    store = VersionStore()
    try:
        assert store.try_complete(_fill(store, 3, 3.0))
        with pytest.raises(VersionError, match="not newer"):
            store.begin(3, 1, owner="t")
        with pytest.raises(VersionError):
            store.begin(2, 1, owner="t")
        store.begin(4, 1, owner="relay-a")
        with pytest.raises(BusyError):
            store.begin(4, 1, owner="relay-b")
    finally:
        store.close()


def test_a_leased_buffer_is_never_overwritten():
    store = VersionStore()
    try:
        store.try_complete(_fill(store, 1, 1.0))
        lease_id, held = store.lease_latest()
        handle = held.ordered()[0].shm.handle(held.ordered()[0].metas)
        for version in range(2, 6):  # newer versions arrive while the lease is held
            assert store.try_complete(_fill(store, version, float(version)))
        with open_handle(handle) as named:
            assert torch.equal(named["s0.w"], torch.full((8, 4), 1.0))
        paths_in_use = {b.shm.path for b in store.latest.buckets.values()}
        assert handle["path"] not in paths_in_use
        assert store.release(lease_id) and not store.release(lease_id)
        # Once released, the buffer may be recycled for a later version.
        store.try_complete(_fill(store, 6, 6.0))
        store.try_complete(_fill(store, 7, 7.0))
        assert store.latest.version == 7
        _, latest = store.lease_latest()
        data = read_bucket(latest.ordered()[0].shm.buffer, latest.ordered()[0].metas)
        assert torch.equal(data["s0.w"], torch.full((8, 4), 7.0))
    finally:
        store.close()


def test_leases_of_dead_pullers_lapse():
    store = VersionStore(lease_ttl_s=60)
    try:
        store.try_complete(_fill(store, 1, 1.0))
        lease_id, sv = store.lease_latest()
        store.try_complete(_fill(store, 2, 2.0))
        assert len(store.retired) == 1  # held by the lease
        # the puller died: its lease's TTL passes (set, not slept: a slow _fill under load
        # must not let it lapse before the check above)
        with store.cond:
            store.leases[lease_id] = (sv, time.time() - 1)
        store.try_complete(_fill(store, 3, 3.0))
        assert store.retired == [] and not store.leases
    finally:
        store.close()


def test_a_failed_version_is_dropped_and_min_version_is_respected():
    store = VersionStore()
    try:
        store.try_complete(_fill(store, 1, 1.0))
        sv = store.begin(2, 1, owner="t")
        store.fail(sv, "sender died")
        assert store.latest.version == 1 and 2 not in store.receiving
        assert store.lease_latest(min_version=2) is None
        assert store.try_complete(_fill(store, 2, 2.0))  # a retry of the same version works
    finally:
        store.close()


def test_laminar_chunk_model():
    from laminar_mcore.relay.chain import chain_time, optimal_chunks

    M, t_byte, t_start = 2**30, 1 / 2e9, 2e-4
    k = optimal_chunks(4, M, t_byte, t_start)
    best = min(range(1, 400), key=lambda kk: chain_time(4, M, kk, t_byte, t_start))
    assert abs(k - best) <= 1
    assert optimal_chunks(1, M) == 1  # a single hop gains nothing from chunking
    assert chain_time(4, M, k, t_byte, t_start) < chain_time(4, M, 1, t_byte, t_start) / 2


def test_a_version_being_forwarded_keeps_its_buffers_while_newer_ones_complete():
    """A forwarder pushing version 1 down a slow chain pins it: versions 2..5 complete meanwhile
    (version 1 retires) and none of them is written into version 1's buffers."""
    store = VersionStore()
    try:
        v1 = _fill(store, 1, 1.0)
        store.try_complete(v1)
        store.pin(v1)
        pinned = {b.shm.path for b in v1.buckets.values()}
        for version in range(2, 6):
            sv = _fill(store, version, float(version))
            assert not pinned & {b.shm.path for b in sv.buckets.values()}
            assert store.try_complete(sv)
        data = read_bucket(v1.ordered()[0].shm.buffer, v1.ordered()[0].metas)
        assert torch.equal(data["s0.w"], torch.full((8, 4), 1.0))  # still version 1's bytes
        store.unpin(v1)
        reused = set()
        for version in range(6, 9):  # once unpinned, its buffers are recycled
            sv = _fill(store, version, float(version))
            reused |= pinned & {b.shm.path for b in sv.buckets.values()}
            store.try_complete(sv)
        assert reused
    finally:
        store.close()


def test_a_relay_slower_than_the_timeout_is_a_relay_error():
    """A timeout is a RelayError (which the manager handles), never a bare asyncio error that
    would silently end an engine's loop or the relay watcher."""
    import asyncio

    from aiohttp import web

    from laminar_mcore.relay.client import RelayClient, RelayError

    async def slow(request):
        await asyncio.sleep(2)
        return web.json_response({"version": 1})

    async def go():
        app = web.Application()
        app.router.add_get("/latest", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with RelayClient(f"http://127.0.0.1:{port}", "t", timeout_s=0.3) as relay:
                with pytest.raises(RelayError, match=r"did not answer within 0.3 s"):
                    await relay.latest()
        finally:
            await runner.cleanup()

    asyncio.run(go())
