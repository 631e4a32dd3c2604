"""Delta publication (weights/delta.py): the format round-trips bit for bit and refuses what is
malformed; through real relay processes on loopback a bf16 trainer's versions travel as deltas
(trainer -> master -> r1 -> r2, each relay rebuilding and checking the digest) and every relay
serves every version bit for bit, also when a base was corrupted (at the master: the trainer
sends that bucket again whole; down the chain: the upstream relay does), when a relay joins
late or misses versions (whole buckets), and at the anchor interval (a whole version)."""

import asyncio
import os
import signal
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from laminar_mcore.models.hf import tiny_hf_config
from laminar_mcore.netutil import TOKEN_ENV
from laminar_mcore.relay.client import RelayClient, open_lease
from laminar_mcore.weights import delta
from laminar_mcore.weights.bucket import decode_handle

from .conftest import wait_until
from .test_relay_chain import TOKEN as CHAIN_TOKEN, _get, _relay

TOKEN = CHAIN_TOKEN  # the relays of test_relay_chain._relay


def _adam_like(w: torch.Tensor, lr: float, generator) -> torch.Tensor:
    """``w`` after one step whose update is about ``lr`` per element (Adam's early steps)."""
    return (w.float() + lr * torch.randn(w.shape, generator=generator).sign()).to(w.dtype)


def test_delta_round_trips_bit_for_bit_and_refuses_what_is_malformed():
    g = torch.Generator().manual_seed(0)
    master = torch.randn(1 << 20, generator=g) * 0.02  # a 2 MB bf16 bucket
    base = master.to(torch.bfloat16)
    new = _adam_like(master, 1e-6, g).to(torch.bfloat16)
    a, b = new.view(torch.uint8), base.view(torch.uint8)
    payload = delta.encode(a, b, 2)
    target = b.clone()
    changed = delta.apply(payload, target)
    assert torch.equal(target, a)  # bit for bit
    assert 0 < changed < 0.1 * new.numel()
    assert len(payload) * 10 < a.numel()  # about 4% of bf16 elements change at 1e-6
    assert delta.digest(target) == delta.digest(a)
    # at 1e-4 most elements change: the dense layout (every element's XOR), also exact
    dense_new = _adam_like(master, 1e-4, g).to(torch.bfloat16).view(torch.uint8)
    dense = delta.encode(dense_new, b, 2)
    target = b.clone()
    assert delta.apply(dense, target) > delta.DENSE_FRACTION * master.numel()
    assert torch.equal(target, dense_new)
    # nothing changed: an empty delta; fp32 buckets compare 4-byte elements
    assert delta.apply(delta.encode(b, b, 2), b.clone()) == 0
    f_new, f_base = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    t = f_base.view(torch.uint8).clone()
    delta.apply(delta.encode(f_new.view(torch.uint8), f_base.view(torch.uint8), 4), t)
    assert torch.equal(t, f_new.view(torch.uint8))
    # malformed deltas are refused before a byte of the target changes
    import zstandard
    bad = [b"", b"not zstd", payload[: len(payload) // 2], dense[:-8],
           zstandard.ZstdCompressor().compress(b"\x05" + b"\x00" * 7 + b"\x02" + b"\x00" * 30),
           delta.encode(a[:1024], b[:1024], 2)]  # a delta of another bucket size is fine...
    for raw in bad[:-1]:
        target = b.clone()
        with pytest.raises(delta.DeltaError):
            delta.apply(raw, target)
        assert torch.equal(target, b)
    with pytest.raises(delta.DeltaError, match="4-byte"):
        delta.apply(payload, b.clone(), unit=4)
    big = delta.encode(torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8), 2)
    with pytest.raises(delta.DeltaError, match="outside|does not fit"):
        delta.apply(big, torch.zeros(1024, dtype=torch.uint8))
    # the choice per version: first whole, deltas, a whole anchor every 3
    enc = delta.DeltaEncoder(True, 2, anchor_interval=3)
    kinds = []
    for v in range(1, 8):
        enc.begin(v, base_ok=True)
        kinds.append(enc.encode(0, _adam_like(master, 1e-6, g).to(torch.bfloat16)
                                .view(torch.uint8))[0])
        enc.end([0])
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert delta.delta_enabled("auto", torch.bfloat16) and not delta.delta_enabled("auto", torch.float32)
    with pytest.raises(ValueError, match="weight_sync.delta"):
        delta.delta_enabled("sometimes", torch.bfloat16)


def test_auto_sends_deltas_only_where_they_reach_the_relays_sooner():
    """``weight_sync.delta=auto`` (issue 52, item 3): whole versions unless deltas are faster
    on the link the config names. The rule agrees with what ``bench.delta`` measured both ways
    (docs/benchmarks.md, a 0.63 B-parameter bf16 model, one stage lead, lr 1e-6): slower than
    whole over 10 Gbit/s (1.865 s whole, 2.983 s as deltas), faster over 1 Gbit/s (11.092 s,
    2.961 s)."""
    bench = dict(model_bytes=int(0.63e9 * 2), stages=1, lr=1e-6)
    on, why = delta.choose_delta("auto", torch.bfloat16, link_gbit=10, **bench)
    assert not on and "whole versions" in why and "10 Gbit/s" in why
    on, why = delta.choose_delta("auto", torch.bfloat16, link_gbit=1, **bench)
    assert on and why.startswith("weight_sync.delta=auto: deltas")
    # a link nobody named, 32-bit weights: whole, saying why and what to set
    on, why = delta.choose_delta("auto", torch.bfloat16, link_gbit=0, **bench)
    assert not on and "weight_sync.link_gbit" in why
    assert not delta.choose_delta("auto", torch.float32, link_gbit=1, **bench)[0]
    # on and off are kept whatever the links
    assert delta.choose_delta("on", torch.float32, link_gbit=0, **bench)[0]
    assert not delta.choose_delta("off", torch.bfloat16, link_gbit=1, **bench)[0]
    with pytest.raises(ValueError, match="LMC-E102"):
        delta.choose_delta("sometimes", torch.bfloat16, link_gbit=1, **bench)
    # the measured ratios, and between them log-log: more changes at higher learning rates
    assert delta.bytes_ratio_for_lr(1e-6) == 93.6 and delta.bytes_ratio_for_lr(1e-9) == 93.6
    assert 13.6 < delta.bytes_ratio_for_lr(3e-6) < 93.6 and delta.bytes_ratio_for_lr(1) == 5.37
    # many stage leads encode side by side: a 1T model at PP16 over 10 Gbit/s pays, and at
    # 400 Gbit/s (the paper's NICs) whole versions are faster (the relays' rebuild alone is)
    big = dict(model_bytes=int(1.04e12 * 2), stages=16, lr=1e-6)
    assert delta.choose_delta("auto", torch.bfloat16, link_gbit=10, **big)[0]
    assert not delta.choose_delta("auto", torch.bfloat16, link_gbit=400, **big)[0]


def test_the_plan_says_what_auto_chose_and_the_trainer_follows_it():
    """job=plan's ``weight_sync_delta`` and its reason for the 235B recipe (bf16, PP2, lr
    1e-6): whole versions with no link named and at 400 Gbit/s, deltas at 1 Gbit/s."""
    from hydra import compose, initialize_config_dir

    from laminar_mcore.config import register_configs
    from laminar_mcore.config.paths import conf_dir
    from laminar_mcore.config.plan import capacity_plan
    from laminar_mcore.config.plan_text import format_plan

    register_configs()

    def plan(*overrides):
        with initialize_config_dir(config_dir=conf_dir(), version_base=None):
            return capacity_plan(compose(config_name="config", overrides=[
                "experiment=qwen3_235b_a22b_math", *overrides]))

    unnamed = plan()
    assert unnamed["weight_sync_delta"] is False
    assert "weight_sync.link_gbit=0" in unnamed["weight_sync_delta_why"]
    assert f"weight sync: {unnamed['weight_sync_delta_why']}" in format_plan(unnamed)
    fast = plan("weight_sync.link_gbit=400")
    assert fast["weight_sync_delta"] is False and "470 GB" in fast["weight_sync_delta_why"]
    slow = plan("weight_sync.link_gbit=1")
    assert slow["weight_sync_delta"] is True and "2 stage leads" in slow["weight_sync_delta_why"]
    assert plan("weight_sync.delta=on")["weight_sync_delta"] is True
    # 72B (TP8 PP4) over 25 Gbit/s: its 4 stage leads encoding on their hosts would take
    # longer than the whole version; its 32 ranks finding their deltas on their GPUs (the
    # kernels, weights.delta.delta_placement) are faster, and the relays' rebuild sets the pace
    big = ["experiment=qwen2_5_72b_math", "weight_sync.link_gbit=25"]
    leads = plan(*big)
    assert leads["weight_sync_delta"] is False and "4 stage leads" in leads[
        "weight_sync_delta_why"]
    ranks = plan(*big, "weight_sync.export=per_rank")
    assert ranks["weight_sync_delta"] is True
    assert "32 ranks' GPUs" in ranks["weight_sync_delta_why"]
    assert ranks["trainer_first_delta_base_gb"] > 0 and leads["trainer_first_delta_base_gb"] == 0
    # the relay tier: one master relay per trainer node by default (4 nodes, PP4: 4 stripes),
    # one where engines read a single relay (Mooncake), or as set
    multi = ["experiment=qwen2_5_72b_math", "cluster=multinode"]
    assert plan(*multi, "cluster.trainer.nnodes=1")["weight_sync_stripes"] == 1
    assert plan(*multi)["weight_sync_stripes"] == 4
    assert "relay tier: 4 master relay(s)" in format_plan(plan(*multi))
    assert plan(*multi, "weight_sync.master_relays=2")["weight_sync_stripes"] == 2
    assert plan(*multi, "weight_sync.engine_transport=mooncake",
                "weight_sync.mooncake_protocol=tcp")["weight_sync_stripes"] == 1


# ---------------------------------------------------------------------------- relays
def _buckets(url):
    """{outcome: count} of a relay's laminar_relay_buckets_received_total, and its wire bytes."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "laminar_relay_buckets_received_total":
                out[s.labels["outcome"]] = int(s.value)
            elif s.name == "laminar_relay_wire_bytes_total":
                out["wire"] = int(s.value)
    return out


async def _pull(url):
    """(version, {name: bytes}) of a relay's newest version, and its bucket files."""
    async with RelayClient(url, TOKEN) as client:
        lease = await client.lease()
        serialized = await client.buckets(lease)
        try:
            with open_lease(serialized) as named:
                state = {k: v.clone() for k, v in named.items()}
            paths = [decode_handle(s)["path"] for s in serialized]
        finally:
            await client.release(lease)
    return lease.version, state, paths


def _corrupt(path):
    """Flip bytes of a relay's bucket in place (the relay maps the same file)."""
    with open(path, "r+b") as f:
        f.seek(256)
        data = bytearray(f.read(64))
        f.seek(256)
        f.write(bytes(x ^ 0xFF for x in data))


@pytest.mark.multiprocess
@pytest.mark.parametrize("channel", ["gloo", "shm"])
def test_versions_travel_as_deltas_down_the_chain_bit_for_bit(tmp_path, monkeypatch, channel):
    """Over gloo the master relay rebuilds each delta (digest checked); on one host (shm) the
    stage lead writes the whole bucket into the master's shared memory and sends the delta
    beside it, which the master forwards down its chain (the other relays rebuild it). Over
    gloo the host finds the changes; on shm the Triton kernels of kernels/delta.py do (on the
    host under Triton's interpreter, as on a GPU), and every relay rebuilds their payloads."""
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.export import iter_stage_hf_tensors
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    procs = []
    init_trainer_parallel(tp=1, pp=1, seed=0)
    publisher = None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1,
                        publish_backend=channel)
        procs.append(master)
        r1 = _relay(tmp_path, "r1", master_url=master.url)
        r2 = _relay(tmp_path, "r2", master_url=master.url)
        procs += [r1, r2]
        wait_until(lambda: _get(master.url, "/chain")["chain"] == ["master", "r1", "r2"],
                   what="chain")
        port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        cfg = tiny_hf_config("qwen2")
        model = build_gpt_model(cfg, dtype=torch.bfloat16)
        publisher = WeightPublisher(model, cfg, relay_host="127.0.0.1", publish_port=port,
                                    bucket_bytes=40_000, chunk_bytes=16384, token=TOKEN,
                                    delta="auto", anchor_interval=3,
                                    delta_device="host" if channel == "gloo" else "cpu")
        g = torch.Generator().manual_seed(1)
        fp32 = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        relays = {"master": master, "r1": r1, "r2": r2}

        def publish(version):
            """A step of ~1e-5 per element on fp32 master weights, cast to bf16; publish it and
            wait until every relay holds it; the trainer's exported reference."""
            with torch.no_grad():
                for n, p in model.named_parameters():
                    fp32[n] += 1e-5 * torch.randn(p.shape, generator=g).sign()
                    p.copy_(fp32[n].to(torch.bfloat16))
            publisher.publish(version)
            publisher.wait()
            for name, r in relays.items():
                wait_until(lambda: _get(r.url, "/latest")["version"] == version, timeout=60,
                           what=f"version {version} at {name}")
            return {k: v.clone() for k, v in iter_stage_hf_tensors(model, cfg)}

        def check(version, reference):
            for name, r in relays.items():
                got_version, state, _ = asyncio.run(_pull(r.url))
                assert got_version == version
                assert set(state) == set(reference)
                differ = [k for k in reference if not torch.equal(
                    state[k].view(torch.uint8), reference[k].contiguous().view(torch.uint8))]
                assert not differ, f"{name} version {version}: {differ[:3]} differ"
                held = _get(r.url, "/digests")  # computed by the relay from its bytes
                assert held["version"] == version and held["digests"] == held["trainer"]
                sent = publisher.sent_stats["digests"]  # the trainer's, of the same bytes
                assert held["digests"] == [sent[i] for i in range(len(sent))]

        check(1, publish(1))
        assert publisher.backend == channel
        assert (publisher.encoder.kernel is not None) == (channel == "shm")
        nb = publisher.sent_stats["buckets"]
        assert nb > 3 and publisher.sent_stats["delta_buckets"] == 0  # the first goes whole
        full_bytes = publisher.sent_stats["full_bytes"]
        before = {n: _buckets(r.url) for n, r in relays.items()}
        check(2, publish(2))
        sent = publisher.sent_stats
        assert sent["delta_buckets"] == nb and sent["base_version"] == 1
        assert sent["sent_bytes"] * 3 < full_bytes  # the tiny model changes in ~10% elements
        for name, r in relays.items():  # rebuilt from deltas at every relay, forwarded as such
            after = _buckets(r.url)
            assert after["delta"] - before[name]["delta"] == nb, name
            assert after["wire"] - before[name]["wire"] == sent["sent_bytes"], name

        # corrupted bases: the master's bucket 1 and r2's bucket 0 of version 2
        _corrupt(asyncio.run(_pull(master.url))[2][1])
        _corrupt(asyncio.run(_pull(r2.url))[2][0])
        before = {n: _buckets(r.url) for n, r in relays.items()}
        check(3, publish(3))
        after = {n: _buckets(r.url) for n, r in relays.items()}
        # over gloo the master rebuilds (its corrupted base fails: bucket 1 again, whole); on
        # one host it takes the trainer's bytes as they are, and its corrupted base is gone
        rebuilt_at_master = channel == "gloo"
        assert after["master"]["fallback"] - before["master"]["fallback"] == rebuilt_at_master
        assert after["r1"]["fallback"] == before["r1"]["fallback"]  # r1's base was intact
        assert after["r2"]["fallback"] - before["r2"]["fallback"] == 1
        if rebuilt_at_master:
            assert publisher.sent_stats["sent_bytes"] > sent["sent_bytes"]  # bucket 1 twice

        # a relay that joins late is caught up whole; the anchor (every 3rd) goes whole
        r3 = _relay(tmp_path, "r3", master_url=master.url)
        procs.append(r3)
        relays["r3"] = r3
        wait_until(lambda: _get(r3.url, "/latest")["version"] == 3, what="r3 caught up")
        assert _buckets(r3.url)["full"] == nb and _buckets(r3.url)["delta"] == 0
        check(4, publish(4))
        assert publisher.sent_stats["delta_buckets"] == 0
        assert _buckets(r3.url)["full"] == 2 * nb
        check(5, publish(5))
        assert _buckets(r3.url)["delta"] == nb

        # a relay that misses versions (stopped, cut out of the chain) takes the next whole
        os.kill(r3.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "r3" not in _get(master.url, "/chain")["chain"], timeout=30,
                       what="r3 cut out")
            del relays["r3"]
            publish(6)
            reference = publish(7)
        finally:
            os.kill(r3.proc.pid, signal.SIGCONT)
        relays["r3"] = r3
        wait_until(lambda: _get(r3.url, "/latest")["version"] == 7, timeout=60,
                   what="r3 rejoined")
        check(7, reference)
        assert _buckets(r3.url) == dict(_buckets(r3.url), full=3 * nb, delta=nb)
        publisher.close()
        publisher = None
    finally:
        if publisher is not None:
            publisher.close()
        destroy_trainer_parallel()
        for p in procs:
            p.stop()


def test_a_device_encoder_that_fails_sends_the_bucket_whole_and_goes_on_on_the_host(caplog):
    """Deltas found on the GPU can fail (out of memory beside a training step, a kernel that
    cannot compile): the bucket goes whole -- never a failover of a healthy master relay --
    and from then on the host finds the deltas, the same bytes as a host encoder's."""
    def out_of_memory(new, base, unit):
        raise RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB")

    host = delta.DeltaEncoder(True, 2)
    dev = delta.DeltaEncoder(True, 2, device="cpu", kernel=out_of_memory)
    g = torch.Generator().manual_seed(3)
    bucket = torch.randint(0, 256, (4000,), generator=g, dtype=torch.uint8)
    outs = []
    for version in (1, 2, 3, 4):
        if version > 1:
            bucket.view(torch.int16)[::50] ^= 1
        for enc in (host, dev):
            enc.begin(version, True)
        outs.append((host.encode(0, bucket), dev.encode(0, bucket)))
        for enc in (host, dev):
            enc.end([0])
    assert outs[0] == (("full", None), ("full", None))  # the first version: whole
    assert outs[1][0][0] == "delta" and outs[1][1] == ("full", None)  # the kernel failed
    assert dev.device is None and "found on the host from now on" in caplog.text
    assert outs[2][1] == ("full", None)  # its base went with the device: whole once more
    assert outs[3][1] == outs[3][0] and outs[3][0][0] == "delta"  # then the host's bytes
