"""A relay's ``GET /metrics`` (relay/metrics.py), scraped from real relay processes and parsed
with prometheus_client's own parser: the counts are the events the test made happen (two
versions published, forwarded to a chained relay and received there, one pull, a relay gone
and the chain rebuilt), and the endpoint is open to reading while every POST still needs the
run's token."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from laminar_mcore.metrics.prometheus import Histogram, SECONDS_BUCKETS
from laminar_mcore.relay.client import RelayClient, open_lease

from .test_relay_chain import TOKEN, _get, _publish_in_process, _relay
from .conftest import wait_until


def _scrape(url, token=None):
    """(Content-Type, {"name{label=value,...}": value}) of ``url``'s /metrics."""
    req = urllib.request.Request(url + "/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        content_type, text = resp.headers["Content-Type"], resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return content_type, samples


def _value(url, name):
    return _scrape(url)[1][name]


async def _pull_all(url):
    """One engine's pull of the newest version: lease, every bucket, release; its bytes."""
    async with RelayClient(url, TOKEN) as client:
        lease = await client.lease()
        with open_lease(await client.buckets(lease)) as named:
            assert named
        await client.release(lease)
        return lease.version, lease.nbytes


def test_running_histogram_is_a_prometheus_histogram():
    hist = Histogram(SECONDS_BUCKETS)
    for v in (0.001, 0.2, 0.2, 7.0, 1000.0):
        hist.observe(v)
    family = hist.family("laminar_relay_pull_seconds", "doc")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("laminar_relay_pull_seconds_bucket", "0.01")] == 1
    assert samples[("laminar_relay_pull_seconds_bucket", "0.5")] == 3
    assert samples[("laminar_relay_pull_seconds_bucket", "10.0")] == 4
    assert samples[("laminar_relay_pull_seconds_bucket", "+Inf")] == 5
    assert samples[("laminar_relay_pull_seconds_count", None)] == 5
    assert samples[("laminar_relay_pull_seconds_sum", None)] == pytest.approx(1007.401)


@pytest.mark.multiprocess
def test_relay_metrics_count_publishes_pulls_and_chain_changes(tmp_path):
    procs, publishes = [], None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1)
        procs.append(master)
        r1 = _relay(tmp_path, "r1", master_url=master.url)
        procs.append(r1)
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r1"], what="chain")
        port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        publishes = _publish_in_process(port, [1, 2])
        for v in (1, 2):  # one at a time: the master forwards each whole
            next(publishes)
            wait_until(lambda: _get(r1.url, "/latest")["version"] == v, what=f"v{v} at r1")
        assert next(publishes, None) is None  # the trainer closed its publisher
        version, nbytes = asyncio.run(_pull_all(r1.url))
        assert version == 2 and nbytes > 0

        # the master: published by the trainer, forwarded to r1 (booked once r1 answers)
        wait_until(lambda: _value(master.url, "laminar_relay_versions_forwarded_total") == 2,
              what="two versions forwarded")
        content_type, m = _scrape(master.url)
        assert content_type.startswith("text/plain") and "version=" in content_type
        assert m["laminar_relay_master"] == 1
        assert m["laminar_relay_versions_published_total"] == 2
        assert m["laminar_relay_published_bytes_total"] == 2 * nbytes
        assert m["laminar_relay_publish_seconds_count"] == 2
        assert m["laminar_relay_publish_seconds_sum"] > 0
        assert m["laminar_relay_versions_received_total"] == 0
        assert m["laminar_relay_forwarded_bytes_total"] == 2 * nbytes
        assert m["laminar_relay_forward_seconds_count"] == 2
        assert m["laminar_relay_latest_version"] == 2
        assert m["laminar_relay_versions_held"] == 1
        assert m["laminar_relay_held_bytes"] == nbytes
        assert m["laminar_relay_host_memory_bytes"] >= nbytes
        assert m["laminar_relay_pulls_total{format=shm}"] == 0
        assert m["laminar_relay_chain_relays"] == 2
        # r1 joined (once, or again after a registration the master answered too late). Under
        # heavy load the master may also have lost it once (a probe timed out) and taken it back
        # when it registered again: each such loss is a fault, a recovery and two downstream
        # changes (r1 -> none -> r1), counted exactly
        assert m["laminar_relay_chain_rebuilds_total{reason=register}"] >= 1
        lost = m.get("laminar_relay_faults_total{kind=relay_lost}", 0)
        assert m.get("laminar_relay_recoveries_total{kind=rechained}", 0) == lost
        assert m["laminar_relay_downstream_changes_total"] == 1 + 2 * lost  # none -> r1 (...)
        before = m

        # r1: received from the master, pulled once, the end of the chain
        _, r = _scrape(r1.url)
        assert r["laminar_relay_master"] == 0
        assert r["laminar_relay_versions_published_total"] == 0
        assert r["laminar_relay_versions_received_total"] == 2
        assert r["laminar_relay_received_bytes_total"] == 2 * nbytes
        assert r["laminar_relay_receive_seconds_count"] == 2
        assert r["laminar_relay_versions_forwarded_total"] == 0
        assert r["laminar_relay_pulls_total{format=shm}"] == 1
        assert r["laminar_relay_pulls_total{format=sglang_cuda_ipc}"] == 0
        assert r["laminar_relay_pulled_bytes_total"] == nbytes
        assert r["laminar_relay_pull_seconds_count"] == 1
        assert r["laminar_relay_pull_seconds_sum"] > 0
        assert r["laminar_relay_leases_active"] == 0
        assert r["laminar_relay_downstream_changes_total"] == 0
        assert "laminar_relay_chain_relays" not in r  # the master's gauge only
        assert all(v == 0 for k, v in r.items() if k.startswith(("laminar_relay_faults_total",
                                                                 "laminar_relay_recoveries")))

        # read-only and open: a wrong token still reads; every POST still needs the token
        assert _scrape(master.url, token="not-the-token")[1] == m
        for path in ("/metrics", "/pull", "/set_downstream"):
            req = urllib.request.Request(master.url + path, data=json.dumps({}).encode(),
                                         method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=5)
            assert err.value.code == 401, path

        # r1 goes away: a fault, the chain rebuilt around it, a recovery
        r1.stop()
        # the chain loses r1 before the master counts the fault, rebuilds and recovers: wait
        # for the last of them
        wait_until(lambda: _scrape(master.url)[1].get(
            "laminar_relay_recoveries_total{kind=rechained}") == lost + 1, timeout=30,
            what="the chain rebuilt without r1")
        assert _get(master.url, "/chain")["chain"] == ["master"]
        _, m = _scrape(master.url)

        def grew(key):
            return m.get(key, 0) - before.get(key, 0)

        assert grew("laminar_relay_faults_total{kind=relay_lost}") == 1
        assert grew("laminar_relay_recoveries_total{kind=rechained}") == 1
        assert grew("laminar_relay_chain_rebuilds_total{reason=failure}") == 1
        assert m["laminar_relay_chain_relays"] == 1
        assert grew("laminar_relay_downstream_changes_total") == 1  # r1 -> none
        assert m["laminar_relay_faults_total{kind=version_failed}"] == 0
    finally:
        if publishes is not None:
            publishes.close()
        for p in procs:
            p.stop()
