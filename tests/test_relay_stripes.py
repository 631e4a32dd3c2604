"""A striped relay tier (issue 52): a (TP2, PP2) trainer publishes into two master relays, one
per stripe of whole pipeline stages, each chaining its stripe to its own relay on the rollout
node; pulls through ``StripedRelay`` get one version from both stripes, bit for bit."""

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

from laminar_mcore.netutil import TOKEN_ENV
from laminar_mcore.relay.client import RelayError, open_lease
from laminar_mcore.relay.rendezvous import RendezvousRefused, join_publish_session
from laminar_mcore.relay.striped import StripedRelay
from laminar_mcore.weights.bucket import SHM_DIR
from laminar_mcore.testing.dist import run_torchrun

from .conftest import WORKERS, wait_until
from .test_relay_chain import TOKEN, _get, _reference, _relay
from .test_stripes_job import striped_controller

pytestmark = pytest.mark.multiprocess
PARTS = 4  # per-rank export at TP2 x PP2: parts 0-1 are stage 0 (stripe 0), 2-3 stage 1


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


async def _pull_and_check(urls, references, seen, names, align_s=120.0):
    """Lease one version across the stripes; every tensor equals the reference's bit for bit;
    record which tensors each stripe served."""
    async with StripedRelay(urls, TOKEN, align_s=align_s) as relay:
        lease = await relay.lease()
        if lease is None:
            return
        try:
            # as an engine's puller asks: bucket i acknowledging i-1, across the stripes' seam
            # too (stripe 0's last bucket is acknowledged to its relay when stripe 1's first is
            # asked for), then bucket 0 again, as a retried apply does
            data = [await relay.bucket(lease, i, applied=[i - 1] if i else [])
                    for i in range(lease.num_buckets)]
            assert await relay.bucket(lease, 0, applied=[lease.num_buckets - 1]) == data[0]
            with open_lease(data) as named:
                ref = references[lease.version]
                assert set(named) == set(ref), "a pull returned a partial version"
                mixed = [k for k in ref if not torch.equal(named[k], ref[k])]
                assert not mixed, f"version {lease.version} mixed: {mixed[:3]}"
            for k, part in enumerate(lease.parts):
                assert part.version == lease.version
                with open_lease(data[sum(p.num_buckets for p in lease.parts[:k]):][
                        :part.num_buckets]) as mine:
                    names.setdefault(k, set()).update(mine)
            seen.add(lease.version)
        finally:
            await relay.release(lease)


@contextlib.contextmanager
def _tier(tmp_path, parts):
    """Two master relays (stripes 0/2 and 1/2) of a trainer publishing ``parts`` parts, and the
    rollout node's relay of each stripe; relays killed with -9 have their buffers reclaimed."""
    procs, killed = [], []
    try:
        masters = [_relay(tmp_path, f"m{k}", master=True, trainer_stages=parts, stripe=k,
                          stripes=2) for k in range(2)]
        procs += masters
        nodes = [_relay(tmp_path, f"r{k}", master_url=masters[k].url, trainer_stages=parts,
                        stripe=k, stripes=2) for k in range(2)]
        procs += nodes
        for k in range(2):
            wait_until(lambda k=k: _get(masters[k].url, "/chain")["chain"] == [f"m{k}", f"r{k}"],
                       what=f"stripe {k}'s chain")
        yield masters, nodes, killed
    finally:
        for p in procs:
            p.stop()
        for pid in killed:
            for leftover in glob.glob(os.path.join(SHM_DIR, f"laminar-relay-{pid}-*")):
                os.unlink(leftover)


@pytest.fixture
def stripes(tmp_path):
    with _tier(tmp_path, PARTS) as (masters, nodes, _):
        yield masters, nodes


def test_two_stripes_carry_their_stages_and_pulls_meet_on_one_version(stripes, tmp_path):
    """Every rank publishes its shard (versions 1-3) to its stripe's master only; each stripe's
    relay holds its stage's tensors and no others; pulls through both stripes all through the
    publishes are whole versions bit for bit. A relay of the other stripe, relays in the wrong
    order and a part of the other stripe are refused with what to fix."""
    masters, nodes = stripes
    ports = [int(m.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")) for m in masters]

    # refusals first (nothing is published yet)
    with pytest.raises(urllib.error.HTTPError) as refused:  # a relay of stripe 1 joins 0's chain
        _post(masters[0].url, "/register", {"relay_id": "x", "control_url": "http://127.0.0.1:9",
                                            "data_host": "127.0.0.1", "data_port": 9,
                                            "stripe": [1, 2]})
    assert refused.value.code == 409 and "LMC-E518" in refused.value.read().decode()
    assert _get(masters[0].url, "/chain")["chain"] == ["m0", "r0"]
    with pytest.raises(RelayError, match="LMC-E518"):  # the stripes' relays in the wrong order
        asyncio.run(_pull_and_check([nodes[1].url, nodes[0].url], {}, set(), {}))
    with pytest.raises(RendezvousRefused, match=r"LMC-E504: .*stage 2 is not one .*\(0\.\.1;"):
        join_publish_session("127.0.0.1", ports[0], TOKEN, 2, timeout_s=10)  # stripe 1's part

    references = {v: _reference(v) for v in range(1, 4)}
    urls = [n.url for n in nodes]
    seen, names, errors, stop = set(), {}, [], threading.Event()

    def puller():
        while not stop.is_set():
            try:
                asyncio.run(_pull_and_check(urls, references, seen, names))
            except Exception as exc:  # noqa: BLE001 - a mixed version, or any failed pull
                errors.append(exc)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=puller)
    thread.start()
    try:
        results = run_torchrun(os.path.join(WORKERS, "publish.py"), 4,
                               ["--master-relays", ",".join(f"127.0.0.1:{p}" for p in ports),
                                "--versions", "3", "--export", "per_rank"],
                               timeout=600, env={TOKEN_ENV: TOKEN})
        for node in nodes:
            wait_until(lambda n=node: _get(n.url, "/latest")["version"] == 3, what="version 3")
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[0]
    asyncio.run(_pull_and_check(urls, references, seen, names))  # version 3, now the newest
    assert 3 in seen

    # each stripe carried its own pipeline stage: disjoint tensors, together the model
    assert names[0] and names[1] and not names[0] & names[1]
    assert names[0] | names[1] == set(references[1])
    assert any(".layers.0." in n for n in names[0]) and not any(".layers.0." in n
                                                                for n in names[1])
    leads = [r["per_rank"] for r in results]
    assert sorted((r["part"], r["stripe"]) for r in leads) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    # a stripe's relays hold about half a version (its stage), not the whole
    whole = sum(t.numel() * t.element_size() for t in references[3].values())
    held = [_get(n.url, "/latest")["nbytes"] for n in nodes]
    assert all(0.2 * whole < h < 0.8 * whole for h in held), (held, whole)


def test_a_stripes_master_killed_is_replaced_and_a_pull_waits_for_its_version(tmp_path):
    """Stage leads publish a stripe each (versions 1-4). Stripe 0's master is killed after
    version 2; stripe 1 goes on to version 3 while stripe 0 cannot: a pull across both stripes
    then waits for stripe 0's version 3 (never version 3 beside stripe 0's version 2), which
    arrives once stripe 0's rollout relay is promoted and stage 0's lead fails over to it."""
    with _tier(tmp_path, parts=2) as (masters, nodes, killed):
        ports = [int(m.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")) for m in masters]
        references = {v: _reference(v) for v in range(1, 5)}
        urls = [n.url for n in nodes]
        out = {}

        def publish():
            try:
                out["results"] = run_torchrun(
                    os.path.join(WORKERS, "publish.py"), 4,
                    ["--master-relays", ",".join(f"127.0.0.1:{p}" for p in ports),
                     "--versions", "4", "--export", "stage_lead", "--hold-dir", str(tmp_path),
                     "--hold-at", "3,4", "--locate-dir", str(tmp_path)],
                    timeout=600, env={TOKEN_ENV: TOKEN})
            except BaseException as exc:  # noqa: BLE001 - reported below
                out["error"] = exc
                for v in (3, 4):
                    (tmp_path / f"v{v}.go").touch()

        trainer = threading.Thread(target=publish)
        trainer.start()
        try:
            for node in nodes:
                wait_until(lambda n=node: _get(n.url, "/latest")["version"] == 2 or "error" in out,
                           timeout=300, what="version 2 on both stripes")
            assert "error" not in out, out["error"]
            os.killpg(masters[0].proc.pid, signal.SIGKILL)  # stripe 0's master dies
            killed.append(masters[0].proc.pid)
            (tmp_path / "v3.go").touch()
            wait_until(lambda: _get(nodes[1].url, "/latest")["version"] == 3, what="v3, stripe 1")
            assert _get(nodes[0].url, "/latest")["version"] == 2  # stripe 0 cannot go on
            # a trainer restarting now must number its weights above 3, the newest version
            # any stripe holds, not above 2, the newest both do (a second "version 3" on
            # stripe 0 beside stripe 1's would be mixed): the controller's floor says 3
            with striped_controller(tmp_path, rollout_nodes=1) as client:
                for stripe, master in enumerate(masters):
                    client.call_post("/register_relay", {
                        "relay_url": master.url, "stripe": stripe,
                        "publish": {"host": "127.0.0.1", "port": ports[stripe]}})
                client.register(nodes[0].url, [], relay_urls=urls)
                assert client.cluster(newest=True)["trainer_version"] == 3

            seen, names = set(), {}
            pull = threading.Thread(target=lambda: asyncio.run(
                _pull_and_check(urls, references, seen, names)))
            pull.start()  # leases stripe 1's version 3 and waits for stripe 0's
            wait_until(lambda: _get(nodes[1].url, "/latest")["leases"] == 1, what="the lease")
            promoted = _post(nodes[0].url, "/promote", {"relays": []})  # (the controller's job)
            (tmp_path / f"successor-{ports[0]}").write_text(
                f"127.0.0.1:{promoted['publish_port']}")
            pull.join(timeout=120)
            assert not pull.is_alive()
            assert seen == {3}  # version 3 from both stripes, bit for bit
        finally:
            for v in (3, 4):  # (stage 1 would otherwise publish version 4 at once)
                (tmp_path / f"v{v}.go").touch()
            trainer.join()
        assert "error" not in out, out["error"]
        for node in nodes:
            wait_until(lambda n=node: _get(n.url, "/latest")["version"] == 4, what="version 4")
        asyncio.run(_pull_and_check(urls, references, seen, names))
        assert seen == {3, 4}
        leads = sorted((r["stage_lead"]["part"], r["stage_lead"]["failovers"])
                       for r in out["results"] if r["stage_lead"]["lead"])
        assert leads == [(0, 1), (1, 0)]  # stage 0's lead failed over once; stage 1's never
