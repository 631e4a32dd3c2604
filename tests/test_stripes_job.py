"""A striped relay tier in a real run (issue 52): ``weight_sync.master_relays=2`` over a PP2
trainer publishing per-rank shards, two rollout nodes each with one relay per stripe, each
stripe's master on a node of its own, TP2 engines pulling each rank's own shard; a stripe's
master relay and a trainer rank are killed with -9 mid-run (real processes on loopback, the
chaos harness of test_faults)."""

import contextlib
import time

import pytest


@contextlib.contextmanager
def striped_controller(tmp_path, stripes=2, rollout_nodes=2):
    """A real controller of a PP2 run striped over ``stripes`` master relays and
    ``rollout_nodes`` nodes (a toy task, no engines); yields a ``ControllerClient`` of it."""
    from dataclasses import replace

    from laminar_mcore.config.schema import LaminarConfig
    from laminar_mcore.controller.client import ControllerClient
    from laminar_mcore.controller.episode import TaskCodec
    from laminar_mcore.controller.server import Controller, TaskData
    from laminar_mcore.metrics import MetricsWriter

    from .test_relay_chain import TOKEN

    base = LaminarConfig(output_dir=str(tmp_path))
    cfg = replace(base, parallel=replace(base.parallel, pp=2),
                  weight_sync=replace(base.weight_sync, master_relays=stripes),
                  cluster=replace(base.cluster, rollout_nodes=rollout_nodes))
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    controller = Controller(cfg, task, metrics, TOKEN, info={"model_path": "/none"})
    try:
        yield ControllerClient(controller.start(), TOKEN)
    finally:
        controller.stop()
        metrics.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_striped_tier_survives_a_stripe_master_and_a_trainer_killed(tmp_path, monkeypatch):
    from .test_faults import assert_the_run_lost_nothing, run_chaos

    result, seed = run_chaos(tmp_path, monkeypatch, ("master_relay", "trainer"), [
        "parallel.pp=2", "cluster.trainer.nproc_per_node=2", "weight_sync.master_relays=2",
        "weight_sync.export=per_rank",
        # bf16 weights sent as deltas (on loopback no link is named for auto to weigh)
        "model.dtype=bf16", "weight_sync.delta=on",
        # engines of TP2 (the trainer's stages are TP1): each rank pulls its own shard from
        # both stripes' relays, SGLang's per-rank layout
        "rollout.engine_tp=2"])
    # nothing lost: the books, one version per trajectory (the same on both stripes),
    # versions monotone across the trainer's restart (its first newer than any stripe holds),
    # both engines on the last version with equal weights, nothing left behind
    assert_the_run_lost_nothing(result, seed)
    records = result.records
    # each stripe's master took its own stages' parts: stage 0 and stage 1 published to two
    # different relays, one on each node
    channels = [line for line in result.output.splitlines() if "[publish] stage" in line
                and "channel" in line]
    stage_ports = {line.split()[2].rstrip(":"): line.split(" to ")[1].split()[0]
                   for line in channels[:2]}
    assert len(set(stage_ports.values())) == 2, channels
    masters = [line for line in result.output.splitlines() if "master relay(s)" in line]
    assert masters and len(masters[0].split("master relay(s) ")[1].split(")")[0]
                           .split(", ")) == 2, masters
    # the killed master's stripe elected (or restarted) a master
    elected = [r for r in records if r["kind"] == "fault" and r["fault"] == "master_relay"]
    assert elected and all("stripe" in r for r in elected), elected
    s = result.summary
    assert s["relay_failovers"] >= 1 and s["trainer_restarts"] == 1
    assert s["engine_pull"] == "shard" and s["engine_pull_loads"]["direct"] >= 2
    assert "flattened_bucket" not in s["engine_pull_loads"]


@pytest.mark.multiprocess
def test_the_controller_places_each_stripes_master_on_a_node_of_its_own(tmp_path, monkeypatch):
    """``/relay_role`` of a run striped over two master relays and two rollout nodes: the
    first node to ask hosts stripe 0's master and waits for another node's stripe 1 (its share
    is one); a claim whose relay never registers lapses to the next asker; real master relays
    register per stripe, a node's relay of a stripe chains from that stripe's, ``GET /cluster``
    names both; a node registering one relay for two stripes, or a stripe the run has not,
    is refused with what to fix."""
    from laminar_mcore.controller import masters
    from laminar_mcore.controller.client import ControllerError

    from .test_relay_chain import _relay

    monkeypatch.setattr(masters, "CLAIM_S", 1.0)
    relays = []
    with striped_controller(tmp_path) as client:
        try:
            first = client.relay_role(5, stripe=0, node="a")
            assert first["master"] is True and first["stripes"] == 2
            with pytest.raises(ControllerError, match="LMC-E406"):  # a hosts its one master
                client.relay_role(0, stripe=1, node="a")
            assert client.relay_role(5, stripe=1, node="b")["master"] is True
            assert client.relay_role(0, stripe=1, node="b")["master"] is True  # b asks again
            time.sleep(1.2)  # b's relay never registered: its claim lapses
            assert client.relay_role(0, stripe=1, node="c")["master"] is True
            for stripe in (0, 1):
                relay = _relay(tmp_path, f"m{stripe}", master=True, trainer_stages=2, stripe=stripe,
                               stripes=2)
                relays.append(relay)
                port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
                client.call_post("/register_relay", {
                    "relay_url": relay.url, "stripe": stripe,
                    "publish": {"host": "127.0.0.1", "port": port}})
                if stripe == 0:  # one stripe's master is not the run's: not ready for trainers
                    assert client.cluster()["master_relays"][1] is None
            role = client.relay_role(5, stripe=0, node="b")
            assert role["master"] is False and role["master_url"] == relays[0].url
            assert [m["url"] for m in client.cluster()["master_relays"]] == [r.url for r in relays]
            with pytest.raises(ControllerError, match="LMC-E518"):  # one relay for two stripes
                client.register(relays[0].url, ["http://127.0.0.1:9"])
            with pytest.raises(ControllerError, match="'stripe' is 2"):
                client.relay_role(0, stripe=2, node="a")
        finally:
            for relay in relays:
                relay.stop()
