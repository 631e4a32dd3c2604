"""Elastic rollout capacity inside the rollout manager (controller/elastic.py), with real CPU
engines: an engine added while trajectories run takes work at once; an engine retired with
trajectories in flight hands them back -- aborted and continued, with their tokens, on an
engine of the same version -- and leaves the run: nothing lost or discarded, no fault."""

import asyncio
import time

import pytest

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config

from .test_rollout_manager import (RecordingBuffer, _handle, _manager, _master_relay,
                                  _incremental_engines, _state, _stop_manager)

pytestmark = pytest.mark.multiprocess


def test_an_engine_joins_and_one_leaves_with_its_trajectories_handed_back(tmp_path):
    cfg = tiny_hf_config("qwen2", max_position_embeddings=512)
    save_hf_checkpoint(str(tmp_path / "m"), cfg, _state(cfg, 0))
    relay = _master_relay(tmp_path)
    procs = [relay]
    rows = [{"prompt_ids": [i % 50 + 1, 7, 3], "answer": ""} for i in range(200)]
    try:
        # (120 tokens take at least 0.6 s: none finishes between the poll and the retire)
        engines = _incremental_engines(tmp_path, procs, n=2, decode_delay_s=0.005)

        async def scenario():
            buffer = RecordingBuffer(group_size=4)
            handles = [_handle(f"e{i}", e.url, relay.url, 8, timeout_s=10,
                               incremental_stream=True) for i, e in enumerate(engines)]
            manager = _manager(handles[:1], rows, buffer,
                               {"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True},
                               rollout=RolloutConfig(repack=False))
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 120
            while len(handles[0].in_flight) < 8 or not any(
                    i.traj.response_ids for i in handles[0].in_flight.values()):
                assert time.time() < deadline
                await asyncio.sleep(0.05)
            manager.admitting = False  # (so that the new engine has room for what moves)
            manager.add_engine(handles[1])  # joins while trajectories run
            moving = set(handles[0].in_flight)
            ended = await manager.retire([handles[0]], grace_s=0.0)  # leaves at once
            manager.admitting = True
            while len(buffer.seen) < 24:
                assert time.time() < deadline and not runner.done(), manager.error
                await asyncio.sleep(0.05)
            await _stop_manager(manager, runner, handles)
            return manager, handles, buffer, ended, moving

        manager, handles, buffer, ended, moving = asyncio.run(scenario())
    finally:
        for p in procs:
            p.stop()
    assert ended == {"finished": 0, "handed_back": 8, "discarded": 0}, ended
    assert manager.engines == [handles[1]] and "e0" in manager.stats.left
    assert not buffer.discarded and not manager.stats.unhealthy and manager.error is None
    moved = [t for t in buffer.seen
             if [seg["engine"] for seg in t.metadata.get("segments", ())] == ["e0", "e1"]]
    assert len(moved) == len(moving) == 8, [t.metadata.get("segments") for t in buffer.seen
                                            if t not in moved][:4]
    for t in moved:  # continued with its tokens, all of one version
        assert len(t.response_ids) == 120 and t.versions_seen() == ["0"]
    assert manager.stats.generated == buffer.consumed + buffer.buffered
