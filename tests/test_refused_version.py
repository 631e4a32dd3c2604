"""Sync mode never waits on a version the relay refused (issue 50): when the master relay
refuses the trainer's version (every buffer held past weight_sync.relay_full_wait_s), the
trainer's stage lead says so (POST /refused) and the barrier modes generate with the newest
version the relays hold, instead of waiting until trainer.batch_timeout_s for a version no
engine can get."""

import asyncio
import time

import pytest

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

from .test_rollout_manager import RecordingBuffer, _handle, _manager, _master_relay, _state

pytestmark = pytest.mark.multiprocess


def test_a_sync_run_goes_on_with_the_relays_version_when_the_trainers_was_refused(tmp_path):
    cfg = tiny_hf_config("qwen2")
    save_hf_checkpoint(str(tmp_path / "m"), cfg, _state(cfg, 0))
    relay = _master_relay(tmp_path)
    engine = EngineProcess(cpu_engine_command(str(tmp_path / "m"), incremental_streaming_output=True,
                                              stream_interval=4),
                           log_path=str(tmp_path / "e.log"))
    rows = [{"prompt_ids": [i % 50 + 1, 7, 3], "answer": ""} for i in range(50)]
    try:
        engine.start()

        async def scenario():
            buffer = RecordingBuffer(group_size=4)
            handle = _handle("e0", engine.url, relay.url, 8, timeout_s=10,
                             incremental_stream=True)
            manager = _manager([handle], rows, buffer, {"max_new_tokens": 4, "temperature": 1.0},
                               rollout=RolloutConfig(repack=False), mode="sync")
            trainer = {"version": 1}  # the trainer made version 1; the relays hold only 0
            manager.trainer_version = lambda: trainer["version"]
            runner = asyncio.create_task(manager.run())
            await asyncio.sleep(3.0)
            waited = manager.stats.started  # sync: nobody generates with version 0
            manager.refused_versions.add(1)  # what POST /refused records
            manager.notify()
            deadline = time.time() + 60
            while len(buffer.seen) < 8:
                assert time.time() < deadline and not runner.done(), manager.stats
                await asyncio.sleep(0.05)
            target = manager.sync_target()
            manager.stop()
            await runner
            await handle.client.close()
            await handle.relay.close()
            return waited, target, buffer

        waited, target, buffer = asyncio.run(scenario())
    finally:
        engine.stop()
        relay.stop()
    assert waited == 0  # the barrier held while version 1 could still come
    assert target == 0 and all(t.weight_version == 0 for t in buffer.seen)


def test_the_trainers_publisher_reports_a_version_the_relay_refused(tmp_path):
    """A real master relay with relay_versions=2 and a 1 s wait: version 1 leased by a slow
    pull, 2 published, 3 refused -- the publisher calls ``on_refused`` (the trainer loop's
    ``ControllerClient.refused``) with the version and the relay's reason."""
    import json
    import urllib.request

    from laminar_mcore.config.schema import WeightSyncConfig
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    from .test_rollout_manager import TOKEN

    cfg = tiny_hf_config("qwen2")
    relay = _master_relay(tmp_path, weight_sync=WeightSyncConfig(relay_versions=2,
                                                                 relay_full_wait_s=1.0))
    init_trainer_parallel(tp=1, pp=1, seed=0)
    refused = []
    try:
        publisher = WeightPublisher(build_gpt_model(cfg), cfg, relay_host="127.0.0.1", token=TOKEN,
                                    publish_port=int(relay.wait_printed(
                                        "LAMINAR_RELAY_PUBLISH_PORT")))
        publisher.on_refused = lambda version, reason: refused.append((version, reason))
        publisher.publish(1)
        publisher.wait()
        req = urllib.request.Request(relay.url + "/pull", data=json.dumps({"format": "shm"}).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {TOKEN}",
                                                             "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:  # a slow pull holds version 1
            assert json.loads(resp.read())["version"] == 1
        for version in (2, 3):
            publisher.publish(version)
            publisher.wait()
        publisher.close()
    finally:
        destroy_trainer_parallel()
        relay.stop()
    assert [v for v, _ in refused] == [3], refused
    assert "relay_versions=2" in refused[0][1] and "within 1 s" in refused[0][1]
