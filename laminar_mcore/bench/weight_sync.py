"""Weight publication and relay chain throughput, against this machine's raw memcpy and gloo.

    python -m laminar_mcore.bench.weight_sync [--hidden 768 --layers 6 --relays 3] [--json PATH]

In one run: a one-process trainer publishes a Megatron-Core model to a chain of relays
(real processes on loopback); we measure the trainer's blocked seconds per publish, the
end-to-end GB/s until the last relay holds the version, the GB/s of an engine pulling it from
its relay (the CPU engine, ``update_weights_from_tensor``), and, for calibration, one host copy
of the same bytes (memcpy) and a raw gloo broadcast of them to as many processes as relays.
The trainer -> master relay channel is then measured alone, side by side: the same-host
shared-memory channel (``publish_gb_per_s_same_host``, what ``publish_backend=auto`` picks with
the relay on the trainer's host) against gloo (``publish_gb_per_s_gloo``, forced), each to a
master relay of its own: the seconds from a publish's export to the relay's "end" answer.
The first two publishes allocate every host and shared-memory buffer (a relay keeps the newest
version and the one arriving); the next ``--repeats`` reuse them and are measured, and the
trainer-blocked, chain and host-copy figures are medians (the machines are noisy).
``sim.calibrate`` runs this module as its own process and reads ``pull_s`` from its ``--json``
(the simulator never imports the trainer): its flags and keys are an interface.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import urllib.request

import torch


def _gloo_receiver(port: int, rank: int, world: int, nbytes: int, repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(1 + repeats):  # warm-up, then measured
        pg.broadcast(buf, 0).wait()
        pg.barrier().wait()


def gloo_broadcast_seconds(nbytes: int, receivers: int, repeats: int = 1) -> float:
    """Median seconds of a raw gloo broadcast of ``nbytes`` to ``receivers`` processes."""
    import torch.distributed as dist

    from ..netutil import free_port

    port, world = free_port(), receivers + 1
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True,
                          timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_gloo_receiver, args=(port, r, world, nbytes, repeats))
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), 0, world)
        buf = torch.ones(nbytes, dtype=torch.uint8)
        pg.broadcast(buf, 0).wait()
        pg.barrier().wait()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            pg.broadcast(buf, 0).wait()
            pg.barrier().wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _bit_exact(named, reference) -> bool:
    return set(named) == set(reference) and all(torch.equal(named[k], reference[k])
                                                for k in reference)


def _mooncake_pull(relay_url: str, token: str, model_dir: str, tmp: str, reference, procs,
                   final_version: int) -> dict:
    """A puller on "another machine": read the leased buckets through Mooncake (timed alone,
    checked bit for bit), then a full pull into a second CPU engine."""
    from ..relay.client import RelayClient
    from ..relay.transports.mooncake import MooncakeReader, pull_remote_into_engine
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import EngineProcess, cpu_engine_command
    from ..weights.bucket import read_bucket

    reader = MooncakeReader("127.0.0.1", "tcp")
    engine = EngineProcess(cpu_engine_command(model_dir, kv_capacity_tokens=256),
                           log_path=os.path.join(tmp, "engine-mooncake.log")).start()
    procs.append(engine)

    async def run():
        async with RelayClient(relay_url, token) as relay, SGLangClient(engine.url) as eng:
            lease = await relay.lease(fmt="mooncake")
            handles = await relay.buckets(lease)
            for shm, _ in [reader.read(data) for data in handles]:
                reader.give_back(shm)  # warm-up: opens the relay's segment, allocates buffers
            t = time.perf_counter()
            local = [reader.read(data) for data in handles]
            read_s = time.perf_counter() - t
            await relay.release(lease)
            named = {}
            for shm, metas in local:
                named.update(read_bucket(shm.buffer, metas))
            exact = _bit_exact(named, reference)
            del named
            for shm, _ in local:
                reader.give_back(shm)
            t = time.perf_counter()
            version = await pull_remote_into_engine(relay, eng, 0, reader)
            pull_s = time.perf_counter() - t
            assert version == final_version
            return {"read_s": read_s, "pull_s": pull_s, "bit_exact": bool(exact)}

    try:
        return asyncio.run(run())
    finally:
        reader.close()


def _get(url: str, path: str, token: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--relays", type=int, default=3, help="relays in the chain, master included")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--chunk-mb", type=int, default=0, help="0: from Laminar's T(p, k) model")
    ap.add_argument("--repeats", type=int, default=5,
                    help="measured publishes (after two that allocate buffers) and host copies; "
                         "the figures are their medians")
    ap.add_argument("--mooncake", choices=["auto", "on", "off"], default="auto",
                    help="also measure a cross-node pull through Mooncake's transfer engine (TCP) "
                         "from the last relay; auto: when Mooncake is installed")
    ap.add_argument("--export-tp", type=int, default=2,
                    help="also time the trainer's export at TP N, stage lead against per rank "
                         "(bench/export_ranks.py: export_* keys); 0: skip")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from ..models import get_adapter
    from ..models.hf import save_hf_checkpoint, tiny_hf_config
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel
    from ..relay.chain import optimal_chunks
    from ..config.schema import WeightSyncConfig
    from ..relay.client import RelayClient, open_lease
    from ..relay.launch import relay_process
    from ..relay.server import RelayConfig
    from ..relay.transports import PullSpec, mooncake, pull_latest_into_engine
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import EngineProcess, cpu_engine_command
    from ..trainer.model import build_gpt_model, stage_full_tensors
    from ..trainer.publisher import WeightPublisher
    from .common import report

    torch.set_num_threads(1)
    cfg = tiny_hf_config("qwen2", hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(args.hidden // 256, 1), vocab_size=args.vocab)
    token = "bench-token"
    use_mooncake = args.mooncake == "on" or (args.mooncake == "auto" and mooncake.available())
    if use_mooncake:
        mooncake.transfer_engine_class()  # a clear error now if it was asked for and is missing
    mc_proto = "tcp" if use_mooncake else None
    mc = {}
    init_trainer_parallel(tp=1, pp=1, seed=0)
    procs = []
    with tempfile.TemporaryDirectory(prefix="laminar-bench-sync-") as tmp:
        try:
            model = build_gpt_model(cfg)
            adapter = get_adapter(cfg)
            reference = adapter.mcore_to_hf(cfg, stage_full_tensors(model, cfg))
            nbytes = sum(t.numel() * t.element_size() for t in reference.values())
            chunk = args.chunk_mb * 2**20 or max(2**20, nbytes // optimal_chunks(args.relays, nbytes))
            ws = WeightSyncConfig(mooncake_protocol=mc_proto)
            master = relay_process(RelayConfig(token, master=True, chunk_bytes=chunk,
                                               relay_id="master", weight_sync=ws),
                                   os.path.join(tmp, "master.log")).start()
            procs.append(master)
            for i in range(1, args.relays):
                procs.append(relay_process(
                    RelayConfig(token, master_url=master.url, chunk_bytes=chunk, relay_id=f"r{i}",
                                weight_sync=ws), os.path.join(tmp, f"r{i}.log")).start())
            last = procs[-1]
            deadline = time.time() + 60
            while len(_get(master.url, "/chain", token)["chain"]) < args.relays:
                if time.time() > deadline:
                    raise RuntimeError("relays did not form a chain")
                time.sleep(0.05)
            port = int(master.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
            publisher = WeightPublisher(model, cfg, relay_host="127.0.0.1", publish_port=port,
                                        bucket_bytes=args.bucket_mb * 2**20, chunk_bytes=chunk,
                                        token=token)
            blocked, chains = [], []
            final_version = 2 + args.repeats
            for version in range(1, final_version + 1):  # 1, 2 allocate every buffer
                start = time.perf_counter()
                stats = publisher.publish(version)
                while _get(last.url, "/latest", token)["version"] != version:
                    time.sleep(0.002)
                if version > 2:
                    chains.append(time.perf_counter() - start)
                    blocked.append(stats.blocked_s)
                publisher.wait()
            publisher.close()
            blocked_s, chain_s = statistics.median(blocked), statistics.median(chains)
            # the trainer -> master relay channel alone, side by side: the same-host shared-memory
            # channel (what auto picks here) against gloo (forced), each to a master of its own
            send_s = {}
            for backend in ("shm", "gloo"):
                alone = relay_process(RelayConfig(
                    token, master=True, chunk_bytes=chunk, relay_id=f"{backend}-master",
                    weight_sync=WeightSyncConfig(publish_backend=backend)),
                    os.path.join(tmp, f"{backend}-master.log")).start()
                procs.append(alone)
                sender = WeightPublisher(
                    model, cfg, relay_host="127.0.0.1",
                    publish_port=int(alone.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")),
                    bucket_bytes=args.bucket_mb * 2**20, chunk_bytes=chunk, token=token)
                assert sender.backend == backend, (sender.backend, backend)
                sends = []
                for version in range(1, final_version + 1):
                    sender.publish(version)
                    t0 = time.perf_counter()
                    sender.wait()  # the buckets are at the relay (its "end" answered)
                    if version > 2:
                        sends.append(time.perf_counter() - t0)
                sender.close()
                alone.stop()
                send_s[backend] = statistics.median(sends)

            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            dst.copy_(src)
            copies = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - t0)
            host_copy_s = statistics.median(copies)
            del src, dst

            async def pulled():
                async with RelayClient(last.url, token) as relay:
                    lease = await relay.lease()
                    with open_lease(await relay.buckets(lease)) as named:
                        exact = _bit_exact(named, reference)
                    await relay.release(lease)
                    return exact

            bit_exact = asyncio.run(pulled())
            model_dir = os.path.join(tmp, "model")
            save_hf_checkpoint(model_dir, cfg, {k: torch.zeros_like(v) for k, v in reference.items()})
            engine = EngineProcess(cpu_engine_command(model_dir, kv_capacity_tokens=256),
                                   log_path=os.path.join(tmp, "engine.log")).start()
            procs.append(engine)

            async def pull_into_engine():
                async with RelayClient(last.url, token) as relay, SGLangClient(engine.url) as eng:
                    t = time.perf_counter()
                    version = await pull_latest_into_engine(relay, eng, current_version=0)
                    # the bytes the relay served this engine's lease (its /release answer)
                    return version, time.perf_counter() - t, relay.last_release["bytes_served"]

            pulled_version, pull_s, engine_pull_bytes = asyncio.run(pull_into_engine())
            assert pulled_version == final_version
            # a TP2 engine: every rank reading each whole bucket, then each rank its own shard
            engine2 = EngineProcess(cpu_engine_command(model_dir, kv_capacity_tokens=256, tp=2),
                                    log_path=os.path.join(tmp, "engine-tp2.log")).start()
            procs.append(engine2)
            tp2 = {"whole": PullSpec("shm", options=(("ranks", 2),)),
                   "shard": PullSpec("shm", options=(
                       ("shard", (2, cfg.num_attention_heads, False, 1)),))}

            async def tp2_pulls():
                out = {}
                async with RelayClient(last.url, token) as relay, \
                        SGLangClient(engine2.url) as eng:
                    for how, spec in tp2.items():
                        t = time.perf_counter()
                        assert await pull_latest_into_engine(relay, eng, 0, spec=spec) == \
                            final_version
                        served = relay.last_release["bytes_served"]
                        # bytes each rank reads: every whole bucket, or its own shard
                        out[how] = (time.perf_counter() - t, served / (2 if how == "shard" else 1))
                return out

            tp2_pull = asyncio.run(tp2_pulls())
            if use_mooncake:
                mc = _mooncake_pull(last.url, token, model_dir, tmp, reference, procs, final_version)
            gloo_s = gloo_broadcast_seconds(nbytes, args.relays, args.repeats)
        finally:
            for p in procs:
                p.stop()
            destroy_trainer_parallel()

    gb = nbytes / 1e9
    figures = {
        "bytes": nbytes, "relays": args.relays, "chunk_bytes": chunk,
        "trainer_blocked_s": blocked_s, "host_copy_s": host_copy_s,
        "blocked_vs_host_copy": blocked_s / host_copy_s,
        "chain_s": chain_s, "chain_gbps": gb / chain_s, "pull_s": pull_s, "pull_gbps": gb / pull_s,
        # issue 52: what one engine pulled against the whole version (1.0: whole versions)
        "engine_pull_bytes": engine_pull_bytes, "engine_pull_fraction": engine_pull_bytes / nbytes,
        # a TP2 engine's rank: its own shard (SGLang's per-rank layout) against whole buckets
        "tp2_rank_pull_fraction_shard": tp2_pull["shard"][1] / nbytes,
        "tp2_rank_pull_fraction_whole": tp2_pull["whole"][1] / nbytes,
        "tp2_pull_s_shard": tp2_pull["shard"][0], "tp2_pull_s_whole": tp2_pull["whole"][0],
        "gloo_broadcast_gbps": gb / gloo_s, "memcpy_gbps": gb / host_copy_s,
        "chain_vs_gloo": (gb / chain_s) / (gb / gloo_s), "bit_exact": bool(bit_exact),
        "publish_gb_per_s_same_host": gb / send_s["shm"],
        "publish_gb_per_s_gloo": gb / send_s["gloo"],
        "publish_same_host_vs_gloo": send_s["gloo"] / send_s["shm"],
        "mooncake_read_gbps": gb / mc["read_s"] if mc else None,
        "mooncake_pull_gbps": gb / mc["pull_s"] if mc else None,
        "mooncake_pull_vs_shm_pull": pull_s / mc["pull_s"] if mc else None,
        "mooncake_bit_exact": mc.get("bit_exact"),
    }
    if args.export_tp > 0:  # its own torchrun world, after this one's trainer is gone
        from .export_ranks import measure

        figures.update({f"export_{k}": v for k, v in measure(
            args.export_tp, args.hidden, args.layers, args.vocab, args.repeats).items()})
    report(figures, args.json, {
        "trainer_blocked_s": f"{blocked_s:.3f} s ({figures['blocked_vs_host_copy']:.2f}x one host copy of {gb:.2f} GB)",
        "host_copy_s": f"{host_copy_s:.3f} s",
        "chain_gbps": f"{figures['chain_gbps']:.2f} GB/s to relay {args.relays} of {args.relays} "
                      f"({figures['chain_vs_gloo']:.2f}x raw gloo broadcast)",
        "pull_gbps": f"{figures['pull_gbps']:.2f} GB/s into a CPU engine",
        "gloo_broadcast_gbps": f"{figures['gloo_broadcast_gbps']:.2f} GB/s to {args.relays} processes",
        "memcpy_gbps": f"{figures['memcpy_gbps']:.2f} GB/s",
        "publish_gb_per_s_same_host": f"{figures['publish_gb_per_s_same_host']:.2f} GB/s trainer -> "
                                      f"master relay through shared memory "
                                      f"({figures['publish_same_host_vs_gloo']:.1f}x gloo's "
                                      f"{figures['publish_gb_per_s_gloo']:.2f} GB/s)",
        "bit_exact": str(bit_exact),
    })
    if args.export_tp > 0:
        report({}, None, {"export_blocked_s": (
            f"stage lead {figures['export_blocked_s_stage_lead']:.4f} s (TP gathers, the lead "
            f"copies {figures['export_bytes_stage'] / 1e9:.3f} GB), per rank "
            f"{figures['export_blocked_s_per_rank']:.4f} s (each copies at most "
            f"{figures['export_bytes_per_rank_max'] / 1e9:.3f} GB): "
            f"{figures['export_blocked_ratio']:.1f}x less at TP{args.export_tp}")})
    if mc:
        report({}, None, {
            "mooncake_read_gbps": f"{figures['mooncake_read_gbps']:.2f} GB/s read out of the last "
                                  f"relay's memory (Mooncake TCP on loopback), bit_exact "
                                  f"{mc['bit_exact']}",
            "mooncake_pull_gbps": f"{figures['mooncake_pull_gbps']:.2f} GB/s into a CPU engine "
                                  f"across \"nodes\" ({figures['mooncake_pull_vs_shm_pull']:.2f}x the "
                                  "local shared-memory pull)"})
    return figures


if __name__ == "__main__":
    main()
