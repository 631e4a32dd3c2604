"""The trainer -> master relay channel, decided from both ends (weights.transport): shared
memory on one host, NCCL across hosts with GPUs, gloo otherwise; never NCCL on one GPU; forced
backends that cannot work refused with the reason, by the real relay at the join; the NCCL
group built to abort its communicator only; the same-host copy writes only relay segments."""

import os

import pytest
import torch

from laminar_mcore.netutil import TOKEN_ENV
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.relay.rendezvous import RendezvousRefused, join_publish_session
from laminar_mcore.relay.server import RelayConfig
from laminar_mcore.config.schema import WeightSyncConfig
from laminar_mcore.weights import transport
from laminar_mcore.weights.bucket import SHM_DIR, ShmBucket

TOKEN = "channel-token"
HERE = transport.host_identity()
GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


@pytest.mark.parametrize("trainer,relay,expected", [
    ({"host": HERE, "gpu": GPU_A}, {"host": HERE, "gpu": GPU_A}, "shm"),   # one GPU: never NCCL
    ({"host": HERE, "gpu": GPU_A}, {"host": HERE, "gpu": GPU_B}, "shm"),   # one host
    ({"host": HERE, "gpu": None}, {"host": HERE, "gpu": None}, "shm"),     # CPU machines
    ({"host": "a|1|x", "gpu": GPU_A}, {"host": "b|2|y", "gpu": GPU_B}, "nccl"),
    ({"host": "a|1|x", "gpu": None}, {"host": "b|2|y", "gpu": GPU_B}, "gloo"),
    ({"host": "a|1|x", "gpu": GPU_A}, {"host": "b|2|y", "gpu": None}, "gloo"),
    ({"host": None, "gpu": None}, {"host": HERE, "gpu": None}, "gloo"),    # an old trainer
    # containers on one machine with private /dev/shm that share a GPU: never NCCL on it
    ({"host": "a|1|x", "gpu": GPU_A}, {"host": "b|1|y", "gpu": GPU_A}, "gloo"),
    # one kernel, private /dev/shm mounts (containers, the tests' network namespaces)
    ({"host": HERE.rsplit("|", 1)[0] + "|0:0", "gpu": None}, {"host": HERE, "gpu": None}, "gloo"),
])
def test_auto_is_decided_from_both_ends(trainer, relay, expected):
    backend, why = transport.choose_channel("auto", trainer, relay)
    assert backend == expected and why


@pytest.mark.parametrize("requested,trainer,relay,code,words", [
    ("nccl", {"host": HERE, "gpu": GPU_A}, {"host": HERE, "gpu": GPU_A}, "LMC-E323",
     "two ranks of a communicator on one device"),
    ("nccl", {"host": "a", "gpu": None}, {"host": "b", "gpu": GPU_B}, "LMC-E321",
     "the trainer has no GPU"),
    ("shm", {"host": "a", "gpu": None}, {"host": "b", "gpu": None}, "LMC-E324",
     "different hosts"),
    ("tcp", {"host": HERE}, {"host": HERE}, "LMC-E102", "not one of auto, gloo, nccl, shm"),
])
def test_forced_backends_that_cannot_work_are_refused_with_the_reason(requested, trainer, relay,
                                                                      code, words):
    with pytest.raises(ValueError, match=code) as err:
        transport.choose_channel(requested, trainer, relay)
    assert words in str(err.value)


def test_forced_backends_that_work_are_taken():
    a, b = {"host": "a", "gpu": GPU_A}, {"host": "b", "gpu": GPU_B}
    assert transport.choose_channel("gloo", {"host": HERE}, {"host": HERE})[0] == "gloo"
    assert transport.choose_channel("nccl", a, b)[0] == "nccl"
    assert transport.choose_channel("nccl", dict(a, host=HERE), dict(b, host=HERE))[0] == "nccl"
    assert transport.choose_channel("shm", {"host": HERE}, {"host": HERE})[0] == "shm"


@pytest.mark.multiprocess
def test_the_relay_decides_at_the_join_and_refuses_what_cannot_work(tmp_path, monkeypatch):
    """A real master relay forced to shm: a trainer on this host gets shm; one whose facts
    name another host is refused at the join with the reason; facts altered on the way (the
    proof covers them) are refused as an authentication failure."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    relay = relay_process(RelayConfig(TOKEN, relay_id="m", master=True, trainer_stages=1,
                                      weight_sync=WeightSyncConfig(publish_backend="shm")),
                          str(tmp_path / "m.log")).start()
    try:
        port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        here = join_publish_session("127.0.0.1", port, TOKEN, 0, 30.0,
                                    facts={"host": HERE, "gpu": None})
        assert here.backend == "shm" and "forced" in here.why
        here.close()
        with pytest.raises(RendezvousRefused, match="LMC-E324") as err:
            join_publish_session("127.0.0.1", port, TOKEN, 0, 30.0,
                                 facts={"host": "elsewhere|0|0:0", "gpu": None})
        assert "different hosts" in str(err.value)
    finally:
        relay.stop()
    assert "refused a publish join" in (tmp_path / "m.log").read_text()


def test_facts_are_covered_by_the_join_proof():
    from laminar_mcore.relay.rendezvous import join_proof

    base = join_proof(TOKEN, "r" * 32, 0, "t" * 32)
    assert base == join_proof(TOKEN, "r" * 32, 0, "t" * 32, None, None)  # old trainers
    moved = join_proof(TOKEN, "r" * 32, 0, "t" * 32, HERE, None)
    assert len({base, moved, join_proof(TOKEN, "r" * 32, 0, "t" * 32, "other", None),
                join_proof(TOKEN, "r" * 32, 0, "t" * 32, HERE, GPU_A)}) == 4


def test_the_same_host_copy_writes_only_a_relays_segments(tmp_path):
    bucket = ShmBucket(64, prefix="laminar-relay")
    try:
        data = torch.arange(64, dtype=torch.uint8)
        transport.write_shm(bucket.path, data)
        assert torch.equal(bucket.buffer, data)  # the relay's own mapping sees the bytes
        with pytest.raises(ValueError, match="more than|fewer than"):
            transport.write_shm(bucket.path, torch.zeros(65, dtype=torch.uint8))
    finally:
        bucket.close()
    other = ShmBucket(8, prefix="laminar-engine")
    try:
        for path in (other.path, str(tmp_path / "laminar-relay-1-0123456789ab"),
                     os.path.join(SHM_DIR, "..", "etc", "passwd")):
            with pytest.raises(ValueError, match="LMC-E324: .* is not a relay's"):
                transport.write_shm(path, torch.zeros(4, dtype=torch.uint8))
    finally:
        other.close()


def test_the_nccl_data_group_aborts_its_communicator_only(monkeypatch):
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is read when each ProcessGroupNCCL is built (torch's
    default, 3, tears the process down): the publish group is built under 2 (CleanUpOnly),
    and the process's own setting is left as it was. (torch's class stands in: no NCCL here.)"""
    import torch.distributed as dist

    seen = {}

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            seen["mode"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            seen["timeout"] = options._timeout

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    import datetime

    transport.stage_group(dist.HashStore(), 0, 1, "nccl", datetime.timedelta(seconds=42))
    assert seen == {"mode": "2", "timeout": datetime.timedelta(seconds=42)}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_an_nccl_channel_takes_its_gpu_from_the_caller_never_from_the_thread():
    """``torch.cuda.current_device()`` is per thread: a failover reconnects on the publisher's
    sender thread, where it is GPU 0. An NCCL channel therefore refuses to be built without
    the device the stage lead captured on its training thread (WeightPublisher.device)."""
    with pytest.raises(ValueError, match="captured on the thread"):
        transport.Channel(object(), 0, "nccl", 1024, device=None)


def test_the_relays_answer_is_covered_by_its_proof():
    """The backend the relay chose is inside its proof: nobody on the way can make the two
    ends build different groups."""
    from laminar_mcore.relay.rendezvous import relay_proof

    assert relay_proof(TOKEN, "r" * 32, "t" * 32, 1, "shm") != \
        relay_proof(TOKEN, "r" * 32, "t" * 32, 1, "gloo")


def test_a_failed_nccl_operation_raises_instead_of_leaving_stale_bytes():
    """With the communicator-only abort, torch records the error on the operation's work
    object and raises nothing: the channel asks it (torch's Work stands in: no NCCL here)."""
    class Work:
        def __init__(self, err):
            self.err = err

        def exception(self):
            return self.err

    transport._raise_if_failed(Work(None))
    with pytest.raises(ConnectionError, match="NCCL operation failed: watchdog timeout"):
        transport._raise_if_failed(Work(RuntimeError("watchdog timeout")))


def test_over_nccl_a_whole_bucket_is_checked_against_the_trainers_digest():
    from types import SimpleNamespace

    from laminar_mcore.relay.publish_receiver import _intact
    from laminar_mcore.weights.delta import digest

    bucket = ShmBucket(64, prefix="laminar-relay")
    try:
        bucket.buffer.copy_(torch.arange(64, dtype=torch.uint8))
        good = {"nbytes": 64, "digest": digest(bucket.buffer), "index": 0, "version": 1}
        stale = dict(good, digest=digest(torch.zeros(64, dtype=torch.uint8)))
        nccl, gloo = SimpleNamespace(backend="nccl"), SimpleNamespace(backend="gloo")
        stored = SimpleNamespace(shm=bucket)  # the store's slot of the bucket
        assert _intact(nccl, stored, good) and not _intact(nccl, stored, stale)
        assert _intact(gloo, stored, stale)  # gloo's and shm's bytes are the sender's or raise
    finally:
        bucket.close()
