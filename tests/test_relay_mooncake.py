"""Cross-node pulls through Mooncake's transfer engine (TCP transport on loopback): a relay
started with --mooncake-protocol serves leased versions as transfer-engine buffers; a puller
reads them bit for bit with one-sided reads and applies them to a real CPU engine, whose
log-probs then match the published weights. A relay without Mooncake refuses such pulls."""

import asyncio
import os

import pytest
import torch

from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.relay.transports import mooncake
from laminar_mcore.relay.client import RelayClient, RelayError
from laminar_mcore.config.schema import WeightSyncConfig
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.relay.server import RelayConfig
from laminar_mcore.rollout.client import SGLangClient
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
from laminar_mcore.weights.bucket import read_bucket

from .test_relay_chain import TOKEN, _get, _publish_in_process, _reference
from .conftest import wait_until
from .test_rollout_manager import _reference_logprobs, _state

pytestmark = pytest.mark.multiprocess

if not mooncake.available():
    pytest.skip("Mooncake's transfer engine is not usable here: make test installs "
                "mooncake-transfer-engine-non-cuda, which needs the system's libibverbs1 "
                "(apt-get install libibverbs1)", allow_module_level=True)


def _relay(tmp_path, name, mooncake_protocol=None, **kw):
    ws = WeightSyncConfig(mooncake_protocol=mooncake_protocol)
    return relay_process(RelayConfig(TOKEN, relay_id=name, heartbeat_s=0.2, weight_sync=ws, **kw),
                         str(tmp_path / f"{name}.log")).start()


def test_mooncake_pull_is_bit_exact_and_updates_an_engine(tmp_path):
    cfg = tiny_hf_config("qwen2")
    save_hf_checkpoint(tmp_path / "m", cfg, _state(cfg, 0))
    procs, publishes = [], None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1, mooncake_protocol="tcp")
        plain = _relay(tmp_path, "plain", master_url=master.url)  # chained, no Mooncake
        engine = EngineProcess(cpu_engine_command(str(tmp_path / "m"), kv_capacity_tokens=512),
                               log_path=str(tmp_path / "engine.log")).start()
        procs += [master, plain, engine]
        assert _get(master.url, "/latest")["transports"]["mooncake"]["session"].startswith("127.0.0.1:")
        publishes = _publish_in_process(int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")),
                                        [1, 2])
        next(publishes)
        wait_until(lambda: _get(plain.url, "/latest")["version"] == 1, what="v1 at both relays")
        reader = mooncake.MooncakeReader("127.0.0.1", "tcp")

        async def read_version():
            async with RelayClient(master.url, TOKEN) as relay:
                lease = await relay.lease(fmt="mooncake")
                assert _get(master.url, "/latest")["leases"] == 1  # the lease pins the buffers
                local = [reader.read(data) for data in await relay.buckets(lease)]
                await relay.release(lease)
                named = {}
                for shm, metas in local:
                    named.update({k: v.clone() for k, v in read_bucket(shm.buffer, metas).items()})
                    reader.give_back(shm)
                return lease.version, len(local), named

        version, buckets, named = asyncio.run(read_version())
        reference = _reference(1)
        assert version == 1 and buckets > 1  # several 100 kB buckets
        assert set(named) == set(reference)
        assert all(torch.equal(named[k], reference[k]) for k in reference), "not bit-exact"
        assert _get(master.url, "/latest")["leases"] == 0

        next(publishes)  # version 2 arrives; the engine (at 0) pulls it across "nodes"
        wait_until(lambda: _get(master.url, "/latest")["version"] == 2, what="v2")

        async def pull_and_generate():
            async with RelayClient(master.url, TOKEN) as relay, SGLangClient(engine.url) as eng:
                got = await mooncake.pull_remote_into_engine(relay, eng, 0, reader)
                again = await mooncake.pull_remote_into_engine(relay, eng, got, reader)
                out = await eng.generate(input_ids=[5, 9, 2], return_logprob=True,
                                         sampling_params={"max_new_tokens": 8, "temperature": 0.0})
                return got, again, await eng.get_weight_version(), out

        got, again, engine_version, out = asyncio.run(pull_and_generate())
        assert (got, again, str(engine_version)) == (2, None, "2")
        tokens = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        logprobs = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        expected = _reference_logprobs(cfg, _state(cfg, 2), [5, 9, 2], tokens)
        assert torch.allclose(logprobs, expected, atol=1e-4)  # the engine runs version 2's weights
        assert _get(master.url, "/latest")["leases"] == 0
        reader.close()
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"laminar-pull-{os.getpid()}")]

        async def refused():
            async with RelayClient(plain.url, TOKEN) as relay:
                with pytest.raises(RelayError, match="HTTP 400.*--mooncake-protocol"):
                    await relay.lease(fmt="mooncake")
                return (await relay.latest())["leases"]

        assert asyncio.run(refused()) == 0  # a refused pull holds nothing
    finally:
        if publishes is not None:
            publishes.close()
        for p in procs:
            p.stop()


def test_a_bad_mooncake_handle_is_refused_before_any_read():
    with mooncake.MooncakeReader("127.0.0.1", "tcp") as reader:
        with pytest.raises(ValueError, match="kind 'mooncake'"):
            reader.read("eyJraW5kIjogInNobSJ9")  # {"kind": "shm"}
        with pytest.raises(ValueError, match="base64 JSON"):
            reader.read("not base64!")
