"""CPU engine decode throughput against transformers' ``generate`` on the same model and prompts,
and the controller's CPU cost per streamed token at two response lengths.

    python -m laminar_mcore.bench.engine [--requests 32] [--json PATH]

The requests have a long-tailed mix of lengths (most short, a few 10x+ longer, as in Laminar's
traces). The CPU engine serves them all at once over HTTP with continuous batching: a request
leaves the batch when it is done. transformers runs them as one static batch (left-padded),
which must decode until its longest member finishes. Both count only the tokens each request
asked for, with EOS ignored, on the same number of threads, in one run.

The controller figures stream one response of 512 and one of 8,192 tokens from an engine run
as the launcher runs it (``--incremental-streaming-output``, ``--stream-interval``) through
the client and the partial pool the RolloutManager uses, and divide this process's CPU time by
the tokens: ``controller_cost_ratio`` (8,192 over 512) stays near 1 when the cost is O(L).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time

import torch


def long_tailed_lengths(n: int, short: int, long: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    for i in range(n):
        u = float(torch.rand(1, generator=gen))
        lengths.append(long if u < 0.08 else int(short * (0.5 + float(torch.rand(1, generator=gen)))))
    lengths[0] = long  # at least one long-tail request
    return lengths


def bench_engine(model_dir: str, prompts, lengths, threads: int) -> float:
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import EngineProcess, cpu_engine_command

    cmd = cpu_engine_command(model_dir, threads=threads, max_running_requests=len(prompts),
                             kv_capacity_tokens=sum(len(p) + n for p, n in zip(prompts, lengths)))
    log = os.path.join(os.path.dirname(model_dir), "engine.log")

    async def run(url):
        async with SGLangClient(url) as client:
            await client.generate(prompts[0], {"max_new_tokens": 4, "ignore_eos": True})  # warm-up
            start = time.perf_counter()
            outs = await asyncio.gather(*[
                client.generate(p, {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": i})
                for i, (p, n) in enumerate(zip(prompts, lengths))])
            elapsed = time.perf_counter() - start
            assert [len(o["output_ids"]) for o in outs] == list(lengths)
            return sum(lengths) / elapsed

    with EngineProcess(cmd, log_path=log, env={"OMP_NUM_THREADS": str(threads)}) as proc:
        return asyncio.run(run(proc.url))


def bench_controller(model_dir: str, lengths, threads: int, interval: int) -> dict:
    """Controller CPU microseconds per generated token, per response length."""
    from ..data.pools import InFlight, PartialResponsePool
    from ..data.trajectory import Trajectory
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import EngineProcess, cpu_engine_command

    cmd = cpu_engine_command(model_dir, threads=threads, kv_capacity_tokens=max(lengths) + 64,
                             incremental_streaming_output=True, stream_interval=interval)
    log = os.path.join(os.path.dirname(model_dir), "engine-stream.log")

    async def one(client, n: int) -> float:
        pool = PartialResponsePool()
        rid = f"bench-{n}"
        pool.start(InFlight(Trajectory([1, 2, 3], [], [], 0, "g", uid=rid), engine="e"))
        start = time.process_time()
        async for chunk in client.stream_tokens([1, 2, 3], {"max_new_tokens": n, "ignore_eos": True},
                                                rid=rid):
            pool.append(rid, chunk.new_ids, chunk.new_logprobs)
        cpu = time.process_time() - start
        assert len(pool.finish(rid).traj.response_ids) == n
        return cpu / n * 1e6

    async def run(url):
        async with SGLangClient(url, incremental_stream=True, generate_timeout_s=None) as client:
            await one(client, 8)  # warm-up
            return {n: await one(client, n) for n in lengths}

    with EngineProcess(cmd, log_path=log, env={"OMP_NUM_THREADS": str(threads)}) as proc:
        return asyncio.run(run(proc.url))


def bench_transformers(model_dir: str, prompts, lengths, threads: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=True, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lengths),
                             min_new_tokens=max(lengths), **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == max(lengths)
    return sum(lengths) / elapsed  # only the tokens the requests asked for are useful


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--short", type=int, default=16, help="typical response length")
    ap.add_argument("--long", type=int, default=256, help="long-tail response length")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream-interval", type=int, default=8,
                    help="tokens per stream chunk for the controller figures (rollout.stream_interval)")
    ap.add_argument("--controller-lengths", default="512,8192",
                    help="the two response lengths of the controller figures")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from ..models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
    from .common import report

    cfg = tiny_hf_config("qwen2", hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 2),
                         num_key_value_heads=max(args.hidden // 128, 1), vocab_size=args.vocab,
                         max_position_embeddings=16384)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, args.vocab, (int(torch.randint(8, 32, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(args.requests)]
    lengths = long_tailed_lengths(args.requests, args.short, args.long, args.seed)
    with tempfile.TemporaryDirectory(prefix="laminar-bench-engine-") as tmp:
        model_dir = os.path.join(tmp, "model")
        save_hf_checkpoint(model_dir, cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0))
        engine_tps = bench_engine(model_dir, prompts, lengths, args.threads)
        hf_tps = bench_transformers(model_dir, prompts, lengths, args.threads)
        short_len, long_len = (int(x) for x in args.controller_lengths.split(","))
        # The controller figures need only a token stream: a 1-layer model keeps 8k tokens quick.
        small = tiny_hf_config("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                               max_position_embeddings=long_len + 64)
        small_dir = os.path.join(tmp, "small")
        save_hf_checkpoint(small_dir, small, initial_hf_state(type("M", (), {"path": None})(), small, 0))
        cost = bench_controller(small_dir, (short_len, long_len), args.threads, args.stream_interval)
    p50 = statistics.median(lengths)
    p99 = sorted(lengths)[math.ceil(0.99 * len(lengths)) - 1]  # nearest-rank percentile
    figures = {"engine_tokens_per_s": engine_tps, "hf_tokens_per_s": hf_tps,
               "ratio": engine_tps / hf_tps, "requests": args.requests,
               "tokens": sum(lengths), "length_p50": p50, "length_p99": p99,
               "threads": args.threads,
               "controller_us_per_token_512": cost[short_len],
               "controller_us_per_token_8192": cost[long_len],
               "controller_cost_ratio": cost[long_len] / cost[short_len],
               "stream_interval": args.stream_interval}
    report(figures, args.json, {
        "engine_tokens_per_s": f"{engine_tps:.1f} tokens/s ({engine_tps / hf_tps:.2f}x transformers)",
        "hf_tokens_per_s": f"{hf_tps:.1f} tokens/s (static batch, runs to the longest request)",
        "lengths": f"{args.requests} requests, {sum(lengths)} tokens, p50 {p50}, p99 {p99}",
        "controller_us_per_token_512": f"{cost[short_len]:.1f} us/token ({short_len} tokens)",
        "controller_us_per_token_8192": f"{cost[long_len]:.1f} us/token ({long_len} tokens; "
                                        f"{cost[long_len] / cost[short_len]:.2f}x the short one, "
                                        "goal <= 1.5)",
    })
    return figures


if __name__ == "__main__":
    main()
