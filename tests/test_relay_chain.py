"""Weight publication through real relay processes on loopback: a (TP2, PP2) trainer publishes
once, a chain of 3 relays spreads it, pullers reconstruct it bit for bit; concurrent pulls never
see a mix; a relay killed mid-chain is bypassed, and a restarted one catches up."""

import asyncio
import contextlib
import glob
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
from laminar_mcore.relay.client import RelayClient, open_lease
from laminar_mcore.config.schema import WeightSyncConfig
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.netutil import TOKEN_ENV
from laminar_mcore.relay.server import RelayConfig
from laminar_mcore.weights.bucket import SHM_DIR
from laminar_mcore.testing.dist import run_torchrun

from .conftest import WORKERS, wait_until

pytestmark = pytest.mark.multiprocess
TOKEN = "run-token"


def _relay(tmp_path, name, mooncake_protocol=None, publish_backend="auto", **kw):
    ws = WeightSyncConfig(mooncake_protocol=mooncake_protocol, publish_backend=publish_backend)
    return relay_process(RelayConfig(TOKEN, relay_id=name, heartbeat_s=0.2, weight_sync=ws, **kw),
                         str(tmp_path / f"{name}.log")).start()


def _get(url, path, token=TOKEN, timeout=5):
    """GET ``path`` with the run token (every relay endpoint but /health and /metrics needs it)."""
    req = urllib.request.Request(url + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _reference(version):
    cfg = tiny_hf_config("qwen2")
    adapter = get_adapter(cfg)
    state = initial_hf_state(type("M", (), {"path": None})(), cfg, version)
    return adapter.mcore_to_hf(cfg, adapter.hf_to_mcore(cfg, state))


async def _lease_and_check(url, references, seen):
    async with RelayClient(url, TOKEN) as client:
        lease = await client.lease()
        if lease is None:
            return
        try:
            with open_lease(await client.buckets(lease)) as named:
                ref = references[lease.version]
                assert set(named) == set(ref), "a pull returned a partial version"
                mixed = [k for k in ref if not torch.equal(named[k], ref[k])]
                assert not mixed, f"version {lease.version} mixed: {mixed[:3]}"
            seen.add(lease.version)
        finally:
            await client.release(lease)


@pytest.fixture
def chain(tmp_path):
    procs = []
    try:
        # up to 4 publishing parts: 2 stage leads, or 2x2 ranks with per-rank export
        master = _relay(tmp_path, "master", master=True, trainer_stages=4)
        procs.append(master)
        for name in ("r1", "r2"):
            procs.append(_relay(tmp_path, name, master_url=master.url))
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r1", "r2"], what="chain")
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_tp2_pp2_publish_reaches_the_end_of_the_chain_bit_exact(chain, tmp_path):
    """Stage leads gather and publish their stages (versions 1-3); then, in the same world,
    every rank publishes its own shard (per-rank export, no gather: versions 4-6) and the
    relays put the slices together as engines pull: both reach the end of the chain bit for
    bit, pulled all through the publishes."""
    master, r1, r2 = chain
    port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
    references = {v: _reference(v) for v in range(1, 7)}
    seen, errors, stop = set(), [], threading.Event()

    hold = tmp_path / "stage_lead.go"  # the publisher waits for it between the two ways

    def puller():  # pulls from the last relay all through the publishes
        while not stop.is_set():
            try:
                asyncio.run(_lease_and_check(r2.url, references, seen))
            except Exception as exc:  # noqa: BLE001 - a mixed version, or any failed pull
                errors.append(exc)
                hold.touch()  # so the publisher goes on and the test reports the error
                return
            if 3 in seen and not hold.exists():
                hold.touch()
            time.sleep(0.01)

    thread = threading.Thread(target=puller)
    thread.start()
    try:
        results = run_torchrun(os.path.join(WORKERS, "publish.py"), 4,
                               ["--publish-port", str(port), "--versions", "3",
                                "--export", "stage_lead,per_rank", "--hold-dir", str(tmp_path)],
                               timeout=600,
                               env={TOKEN_ENV: TOKEN})  # the publisher proves it
        wait_until(lambda: _get(r2.url, "/latest")["version"] == 6, what="version 6 at the last relay")
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]
    asyncio.run(_lease_and_check(r2.url, references, seen))  # version 6, now the newest
    assert {3, 6} <= seen  # each way's last version was pulled and checked bit for bit
    whole = sum(t.numel() * t.element_size() for t in references[1].values())
    for export, versions in (("stage_lead", [1, 2, 3]), ("per_rank", [4, 5, 6])):
        ranks = [r[export] for r in results]
        leads = [r for r in ranks if r["lead"]]
        # one sender per pipeline stage, or per rank
        assert len(leads) == (2 if export == "stage_lead" else 4)
        assert sorted(r["part"] for r in leads) == list(range(len(leads)))
        # the relay is on the trainer's host: each lead copied its buckets into the relay's
        # shared memory (weight_sync.publish_backend=auto), and the versions arrived bit for bit
        assert {lead["backend"] for lead in leads} == {"shm"}
        for lead in leads:
            assert [s["version"] for s in lead["stats"]] == versions
            assert all(s["buckets"] > 1 for s in lead["stats"])  # bucketed (40 kB buckets)
            assert lead["host_buffer_bytes"] >= lead["stats"][0]["nbytes"]
        # The stages' other TP ranks take part in the gathers but pack (and hold) nothing.
        assert all(r["host_buffer_bytes"] == 0 for r in ranks if not r["lead"])
        total = sum(lead["stats"][0]["nbytes"] for lead in leads)
        assert whole <= total <= whole + 64 * len(references[1]) * 2  # (64-byte alignment)
        if export == "per_rank":  # each rank held about half its stage (TP2), not all of it
            stage = {p: sum(r["stats"][0]["nbytes"] for r in leads if r["part"] // 2 == p)
                     for p in (0, 1)}
            for r in leads:
                assert r["stats"][0]["nbytes"] < 0.6 * stage[r["part"] // 2]
            assert _get(r2.url, "/latest")["nbytes"] == total


def _publish_in_process(port, versions):
    """A one-process trainer (TP1, PP1) publishing versions of seed v."""
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state
    from laminar_mcore.trainer.publisher import WeightPublisher

    init_trainer_parallel(tp=1, pp=1, seed=0)
    try:
        cfg = tiny_hf_config("qwen2")
        model = build_gpt_model(cfg)
        publisher = WeightPublisher(model, cfg, relay_host="127.0.0.1", publish_port=port,
                                    bucket_bytes=100_000, chunk_bytes=16384, token=TOKEN)
        blocked = []
        for v in versions:
            state = initial_hf_state(type("M", (), {"path": None})(), cfg, v)
            load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, state))
            blocked.append(publisher.publish(v).blocked_s)
            publisher.wait()
            yield v
        publisher.close()
    finally:
        destroy_trainer_parallel()


def test_killed_relay_is_bypassed_and_a_restarted_one_catches_up(tmp_path):
    procs, publishes, killed = [], None, []
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1)
        procs.append(master)
        r1 = _relay(tmp_path, "r1", master_url=master.url)
        r2 = _relay(tmp_path, "r2", master_url=master.url)
        procs += [r1, r2]
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r1", "r2"], what="chain")
        port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        publishes = _publish_in_process(port, [1, 2, 3])
        next(publishes)
        wait_until(lambda: _get(r2.url, "/latest")["version"] == 1, what="v1 at r2")

        os.killpg(r1.proc.pid, signal.SIGKILL)  # a relay dies mid-chain
        killed.append(r1.proc.pid)
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r2"], timeout=30,
              what="chain rebuilt without r1")
        next(publishes)
        wait_until(lambda: _get(r2.url, "/latest")["version"] == 2, what="v2 at r2 around the dead relay")

        r1b = _relay(tmp_path, "r1", master_url=master.url)  # restarted: rejoins at the end
        procs.append(r1b)
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r2", "r1"], what="rejoined")
        wait_until(lambda: _get(r1b.url, "/latest")["version"] == 2, what="restarted relay caught up")
        next(publishes)
        wait_until(lambda: _get(r1b.url, "/latest")["version"] == 3, what="v3 through the new chain")
        seen = set()
        asyncio.run(_lease_and_check(r1b.url, {3: _reference(3)}, seen))
        assert seen == {3}
        with pytest.raises(StopIteration):
            next(publishes)
    finally:
        if publishes is not None:
            publishes.close()
        for p in procs:
            p.stop()
        # A relay killed with -9 cannot unlink its version buffers; the test reclaims them as
        # the node's supervisor would (production reclaiming is the fault-isolation issue's).
        for pid in killed:
            for leftover in glob.glob(os.path.join(SHM_DIR, f"laminar-relay-{pid}-*")):
                os.unlink(leftover)


def test_state_changing_endpoints_need_the_token(tmp_path):
    """Control endpoints answer 401 without the token; a push to the data port without an
    HMAC proof of it (or with a wrong one) is refused and logged, and nothing reaches the store."""
    import socket

    from laminar_mcore.relay.chain import push_proof, recv_frame, send_frame

    master = _relay(tmp_path, "solo", master=True, trainer_stages=1)
    try:
        data_port = int(master.wait_printed("LAMINAR_RELAY_DATA_PORT"))
        for proof in (None, "0" * 64, "wrong-token"):
            with socket.create_connection(("127.0.0.1", data_port), timeout=10) as sock:
                challenge = recv_frame(sock)
                assert challenge["type"] == "challenge" and len(challenge["nonce"]) == 32
                hello = {"type": "version", "version": 7, "num_stages": 1}
                if proof == "wrong-token":
                    hello["proof"] = push_proof("not-the-token", challenge["nonce"], 7, 1)
                elif proof is not None:
                    hello["proof"] = proof
                send_frame(sock, hello)
                reply = recv_frame(sock)
                assert reply["accept"] is False and "authentication failed" in reply["reason"]
                with contextlib.suppress(OSError):  # the relay has closed the connection
                    send_frame(sock, {"type": "chunk", "nbytes": 4}, b"evil")
        wait_until(lambda: (tmp_path / "solo.log").read_text().count("refused a push from") == 3,
              what="three refusals logged")
        assert _get(master.url, "/latest")["version"] is None  # nothing reached the store
        for path, body in (("/pull", {}), ("/release", {"lease_id": "x"}),
                           ("/register", {}), ("/set_downstream", {})):
            req = urllib.request.Request(master.url + path, data=json.dumps(body).encode(),
                                         method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=5)
            assert err.value.code == 401, path
        req = urllib.request.Request(master.url + "/pull", data=b"[1,2]", method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 400
        assert _get(master.url, "/latest")["version"] is None  # still serving
    finally:
        master.stop()


def test_pulls_go_bucket_by_bucket_and_bad_pulls_are_refused(tmp_path):
    """A lease's buckets come one at a time, at most two outstanding (the one an engine applies
    and the next: on GPUs, the relay's copies on an engine GPU); CUDA IPC without a GPU, a bad
    format, a bad index and an unknown lease are refused clearly."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    master = _relay(tmp_path, "solo2", master=True, trainer_stages=1)
    publishes = None
    try:
        port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        publishes = _publish_in_process(port, [1])
        next(publishes)
        wait_until(lambda: _get(master.url, "/latest")["version"] == 1, what="v1")

        async def go():
            async with RelayClient(master.url, TOKEN) as client:
                from laminar_mcore.relay.client import RelayError

                with pytest.raises(RelayError, match="cannot serve format .sglang_cuda_ipc.: CUDA IPC serving needs a GPU"):
                    await client.lease(fmt="sglang_cuda_ipc", devices=["cuda:0", "cuda:1"])
                with pytest.raises(RelayError, match="HTTP 400.*one per engine TP rank"):
                    await client.lease(fmt="sglang_cuda_ipc", devices=[])
                with pytest.raises(RelayError, match="not one of shm, sglang_cuda_ipc, mooncake"):
                    await client.lease(fmt="pickle")
                refused = await client.latest()

                lease = await client.lease()
                assert lease.num_buckets >= 3
                first = [await client.bucket(lease, 0), await client.bucket(lease, 1)]
                with pytest.raises(RelayError, match="HTTP 409.*at most 2 may be outstanding"):
                    await client.bucket(lease, 2)
                third = await client.bucket(lease, 2, applied=[0])
                with pytest.raises(RelayError, match="HTTP 400.*bucket index 99"):
                    await client.bucket(lease, 99)
                with open_lease(first + [third] + [await client.bucket(lease, i, applied=[i - 2])
                                                   for i in range(3, lease.num_buckets)]) as named:
                    reference = _reference(1)
                    assert set(named) == set(reference)
                    assert all(torch.equal(named[k], reference[k]) for k in reference)
                await client.release(lease)
                assert client.last_release["peak_outstanding"] == 2
                assert client.last_release["buckets_served"] == lease.num_buckets
                with pytest.raises(RelayError, match="HTTP 404.*unknown, released or expired"):
                    await client.bucket(lease, 0)
                return refused

        latest = asyncio.run(go())
        assert latest["leases"] == 0  # refused pulls hold nothing
    finally:
        if publishes is not None:
            publishes.close()
        master.stop()


def test_nccl_publish_without_a_gpu_is_refused_before_serving():
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.relay", "--master",
                          "--publish-backend", "nccl"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **{TOKEN_ENV: TOKEN}))
    assert out.returncode == 2
    assert "needs a GPU" in out.stderr and "--publish-backend gloo" in out.stderr
    assert "LAMINAR_RELAY_PORT" not in out.stdout


def test_latest_long_poll_answers_when_a_version_completes(tmp_path):
    """``/latest?after=V&wait_s=T`` (the rollout manager's relay watcher) answers as soon as
    a version newer than V is complete, waits at most T otherwise, and refuses bad input."""
    procs, publishes = [], None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1)
        procs.append(master)
        port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        t0 = time.time()
        assert _get(master.url, "/latest?after=0&wait_s=0.5")["version"] is None
        assert 0.4 < time.time() - t0 < 25.0  # nothing newer: it waited, then answered

        answers = []

        def long_poll():
            t = time.time()
            answers.append((_get(master.url, "/latest?after=0&wait_s=50", timeout=70)["version"],
                            t))
            answers[-1] += (time.time(),)

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(0.5)
        assert not answers  # still waiting
        publishes = _publish_in_process(port, [1])
        next(publishes)
        published = time.time()
        poller.join(timeout=30)
        version, started, answered = answers[0]
        assert version == 1
        # it answered on the publish, not at the end of its 50 s (bounds far from both)
        assert answered - published < 25.0 and answered - started < 40.0
        t0 = time.time()
        assert _get(master.url, "/latest?after=0&wait_s=50")["version"] == 1  # already newer
        assert time.time() - t0 < 25.0  # at once, not after 50 s
        for bad in ("after=x&wait_s=1", "after=0&wait_s=soon"):
            with pytest.raises(urllib.error.HTTPError) as err:
                _get(master.url, f"/latest?{bad}")
            assert err.value.code == 400
        assert _get(master.url, "/latest")["version"] == 1  # and it keeps serving
    finally:
        if publishes is not None:
            publishes.close()
        for p in procs:
            p.stop()
