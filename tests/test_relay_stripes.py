"""A striped relay tier (issue 52): a (TP2, PP2) trainer publishes into two master relays, one
per stripe of whole pipeline stages, each chaining its stripe to its own relay on the rollout
node; pulls through ``StripedRelay`` get one version from both stripes, bit for bit."""

import asyncio
import json
import os
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
from laminar_mcore.testing.dist import run_torchrun

from .conftest import WORKERS, wait_until
from .test_relay_chain import TOKEN, _get, _reference, _relay

pytestmark = pytest.mark.multiprocess
PARTS = 4  # per-rank export at TP2 x PP2: parts 0-1 are stage 0 (stripe 0), 2-3 stage 1


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


async def _pull_and_check(urls, references, seen, names):
    """Lease one version across the stripes; every tensor equals the reference's bit for bit;
    record which tensors each stripe served."""
    async with StripedRelay(urls, TOKEN) as relay:
        lease = await relay.lease()
        if lease is None:
            return
        try:
            data = await relay.buckets(lease)
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


@pytest.fixture
def stripes(tmp_path):
    """Two master relays (stripes 0/2 and 1/2) and the rollout node's relay of each stripe."""
    procs = []
    try:
        masters = [_relay(tmp_path, f"m{k}", master=True, trainer_stages=PARTS, stripe=k,
                          stripes=2) for k in range(2)]
        procs += masters
        nodes = [_relay(tmp_path, f"r{k}", master_url=masters[k].url, trainer_stages=PARTS,
                        stripe=k, stripes=2) for k in range(2)]
        procs += nodes
        for k in range(2):
            wait_until(lambda k=k: _get(masters[k].url, "/chain")["chain"] == [f"m{k}", f"r{k}"],
                       what=f"stripe {k}'s chain")
        yield masters, nodes
    finally:
        for p in procs:
            p.stop()


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
    assert refused.value.code == 409 and "LMC-E407" in refused.value.read().decode()
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
            except AssertionError as exc:
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
