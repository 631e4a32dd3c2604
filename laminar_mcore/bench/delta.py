"""Delta publication against whole versions, through a real master relay and a chained relay.

    python -m laminar_mcore.bench.delta [--json PATH] [--lrs 1e-6,1e-5,1e-4] [--steps 10]
        [--link-gbit 10] [--bucket-mb 128] [--layers 24] [--loopback]

A Qwen2-0.5B-shaped model (hidden 896, 24 layers, vocabulary 151,936, untied head: 0.63 B
parameters; built from its config, random weights) trains with AdamW at each ``--lrs`` rate for
``--steps`` consecutive steps -- the real causal-LM loss on random token sequences, fp32 master
weights -- and after each step the bf16 weights are published by the trainer's own
``WeightPublisher`` (``weight_sync.delta=on``) to a master relay, which rebuilds each bucket and
forwards the delta to a second relay. With root, the two relays are separate hosts (network
namespaces, ``testing/netns.py``) and the link into and out of the second is rate-limited with
``tc ... tbf`` to ``--link-gbit``; without (or with ``--loopback``) both run on loopback.

In the same run, the same weights are published whole (``weight_sync.delta=off``) a few
times, so the two are measured side by side. Every version is checked bit for bit at both
relays: each relay computes the digests of the bytes it holds (``GET /digests``) and they must
equal the trainer's. Figures (flat JSON): ``changed_fraction``, ``delta_bytes_ratio`` (full
bytes / bytes sent), ``delta_bit_exact``, ``publish_s_full``, ``publish_s_delta`` (medians,
from ``publish`` until the far relay holds the version), ``publish_speedup``,
``encode_gb_per_s`` (bytes compared, encoded and hashed per second of the stage lead's sender
thread), ``rebuild_gb_per_s`` (a relay's copy, apply and digest check of one bucket); the same
per rate with a ``_lr<rate>`` suffix; the unsuffixed ones are the first rate's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

import torch

from .common import report

TOKEN = "bench-delta"
MASTER_PORT, RELAY_PORT = 18600, 18601


def qwen2_config(layers: int = 24, hidden: int = 896, intermediate: int = 4864,
                 vocab: int = 151936):
    """Qwen2-0.5B's shape (untied head), from its config: nothing is downloaded."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                       vocab_size=vocab, tie_word_embeddings=False,
                       max_position_embeddings=4096, hidden_act="silu")


def _get(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _wait(predicate, timeout: float, what: str, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")


# ------------------------------------------------------------------------------ the trainer
def worker(args) -> dict:
    """The trainer host: a master relay, the training loop and its publisher."""
    from ..config.schema import WeightSyncConfig
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel
    from ..relay.launch import relay_process
    from ..relay.server import RelayConfig
    from ..trainer.publisher import WeightPublisher
    from transformers import Qwen2ForCausalLM

    ws = WeightSyncConfig(publish_backend="gloo")
    logs = args.logs
    procs = [relay_process(RelayConfig(TOKEN, relay_id="master", host=args.master_host,
                                       port=MASTER_PORT, master=True, trainer_stages=1,
                                       weight_sync=ws, heartbeat_s=1.0),
                           os.path.join(logs, "relay-master.log")).start()]
    master_url = procs[0].url
    if args.relay_url is None:  # loopback: the second relay here too
        procs.append(relay_process(RelayConfig(TOKEN, relay_id="r1", host=args.master_host,
                                               master_url=master_url, weight_sync=ws,
                                               heartbeat_s=1.0),
                                   os.path.join(logs, "relay-r1.log")).start())
        args.relay_url = procs[1].url
    far = args.relay_url
    init_trainer_parallel(tp=1, pp=1, seed=0)
    publishers: List[WeightPublisher] = []
    try:
        _wait(lambda: len(_get(master_url, "/chain")["chain"]) == 2, 120, "the chain")
        port = int(procs[0].wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        cfg = qwen2_config(layers=args.layers)
        def initial_model():  # the same starting weights for every rate (no copy kept)
            torch.manual_seed(0)
            return Qwen2ForCausalLM(cfg)

        model = initial_model()
        params = sum(p.numel() for p in model.parameters())
        print(f"[bench.delta] Qwen2 shape, {args.layers} layers: {params / 1e9:.3f} B "
              f"parameters, {2 * params / 1e9:.2f} GB in bf16", flush=True)
        version = 0
        exact = True

        def publish(publisher) -> float:
            """Publish the model's weights as the next version; seconds until the far relay
            holds it; check both relays' bytes against the trainer's digests."""
            nonlocal version, exact
            version += 1
            named = ((k, v.detach()) for k, v in model.state_dict().items())
            start = time.perf_counter()
            publisher.publish(version, tensors=named)
            _wait(lambda: _get(far, "/latest")["version"] == version, 600,
                  f"version {version} at the far relay")
            seconds = time.perf_counter() - start
            publisher.wait()
            sent = publisher.sent_stats["digests"]
            for url in (master_url, far):
                held = _get(url, "/digests")
                ok = held["version"] == version and held["digests"] == [
                    sent[i] for i in range(len(sent))]
                exact &= ok
                if not ok:
                    print(f"[bench.delta] version {version} at {url} is NOT bit-exact",
                          flush=True)
            return seconds

        def make(delta: str):
            # no model: it publishes the tensors it is given (and holds no reference to them)
            pub = WeightPublisher(None, cfg, relay_host=args.master_host, publish_port=port,
                                  bucket_bytes=args.bucket_mb * 2**20, chunk_bytes=16 * 2**20,
                                  dtype=torch.bfloat16, token=TOKEN, delta=delta,
                                  anchor_interval=10_000)
            publishers.append(pub)
            return pub

        # whole versions: two warm-ups (every buffer allocated), then the measured ones
        full_pub = make("off")
        full_s = [publish(full_pub) for _ in range(2 + args.full_repeats)][2:]
        full_bytes = full_pub.sent_stats["full_bytes"]
        full_pub.close()
        publishers.remove(full_pub)
        print(f"[bench.delta] whole: {full_bytes / 1e9:.2f} GB in "
              f"{statistics.median(full_s):.2f} s (median of {len(full_s)})", flush=True)

        pub = make("on")
        runs: Dict[float, dict] = {}
        g = torch.Generator().manual_seed(1)
        for i, lr in enumerate(args.lrs):
            if i:
                del opt
                model = None
                model = initial_model()
            # fused: no temporaries the size of the model (this machine has 24 GB)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
            publish(pub)  # this rate's starting weights: the base of its first step
            rows = []
            for step in range(args.steps):
                tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                last = i == 0 and step == args.steps - 1
                base0 = pub.encoder._base[0].clone() if last else None
                seconds = publish(pub)
                if last:
                    rebuild = _rebuild_rate(base0, pub.packer.last_buckets[0].buffer)
                rows.append(dict(pub.sent_stats, seconds=seconds, loss=float(loss)))
                s = rows[-1]
                print(f"[bench.delta] lr {lr:g} step {step + 1}: loss {s['loss']:.3f}, "
                      f"{s['changed_elements'] / max(s['compared_elements'], 1):.4f} changed, "
                      f"{s['full_bytes'] / max(s['sent_bytes'], 1):.1f}x smaller, "
                      f"{s['delta_buckets']}/{s['buckets']} buckets as deltas, "
                      f"{seconds:.2f} s", flush=True)
            runs[lr] = {
                "changed_fraction": sum(r["changed_elements"] for r in rows)
                / max(sum(r["compared_elements"] for r in rows), 1),
                "delta_bytes_ratio": sum(r["full_bytes"] for r in rows)
                / max(sum(r["sent_bytes"] for r in rows), 1),
                "publish_s_delta": statistics.median(r["seconds"] for r in rows),
                "encode_gb_per_s": sum(r["full_bytes"] for r in rows)
                / max(sum(r["encode_s"] for r in rows), 1e-9) / 1e9,
                "delta_buckets_fraction": sum(r["delta_buckets"] for r in rows)
                / max(sum(r["buckets"] for r in rows), 1)}
        pub.close()
        publishers.remove(pub)
        return {"params": params, "full_bytes": full_bytes, "rebuild_gb_per_s": rebuild,
                "publish_s_full": statistics.median(full_s), "delta_bit_exact": exact,
                "runs": {repr(lr): r for lr, r in runs.items()}}
    finally:
        for p in publishers:
            p.close()
        destroy_trainer_parallel()
        for p in procs:
            p.stop()


def _rebuild_rate(base: torch.Tensor, new: torch.Tensor, repeats: int = 3) -> float:
    """GB/s of what a relay does per bucket that arrives as a delta (``VersionStore.rebuild``):
    copy the base, apply the delta, check the digest -- on one bucket of the run, best of
    ``repeats``."""
    from ..weights.delta import apply, digest, encode

    payload, want = encode(new, base), digest(new)
    target = torch.empty_like(base)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(base)
        apply(payload, target)
        assert digest(target) == want
        best = min(best, time.perf_counter() - start)
    return base.numel() / best / 1e9


# ------------------------------------------------------------------------------ the hosts
def _across_hosts(args, argv: List[str]) -> dict:
    """The trainer (with the master relay) and the second relay on two hosts, the second's
    link rate-limited both ways."""
    from ..config.schema import WeightSyncConfig
    from ..relay.launch import relay_command
    from ..relay.server import RelayConfig
    from ..testing.netns import Hosts

    out = os.path.join(args.logs, "worker.json")
    shm_mb = max(2048, int(3.3 * args.model_gb * 1024))  # a relay: <= 3 versions' buffers
    with Hosts(["trainer", "relay1"], shm_mb=shm_mb, workdir=args.logs) as hosts:
        hosts.limit_ingress(args.link_gbit)
        trainer, relay1 = hosts.addr("trainer"), hosts.addr("relay1")
        ws = WeightSyncConfig(publish_backend="gloo")
        env = Hosts.role_env(TOKEN)
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
        relay = hosts.start("relay1", relay_command(RelayConfig(
            TOKEN, relay_id="r1", host=relay1, port=RELAY_PORT,
            master_url=f"http://{trainer}:{MASTER_PORT}", weight_sync=ws, heartbeat_s=1.0)),
            os.path.join(args.logs, "relay-r1.log"), env=env)
        cmd = [sys.executable, "-m", "laminar_mcore.bench.delta", *argv, "--worker", out,
               "--master-host", trainer, "--relay-url", f"http://{relay1}:{RELAY_PORT}"]
        proc = hosts.start("trainer", cmd, os.path.join(args.logs, "trainer.log"), env=env)
        with open(os.path.join(args.logs, "trainer.log")) as log:
            while proc.poll() is None:
                line = log.readline()
                if line:
                    print(line, end="", flush=True)
                else:
                    if relay.poll() is not None:
                        raise RuntimeError(f"the relay on relay1 exited ({relay.returncode}); "
                                           f"see {args.logs}/relay-r1.log")
                    time.sleep(0.2)
            sys.stdout.write(log.read())
        if proc.returncode:
            raise RuntimeError(f"the trainer host's worker failed ({proc.returncode}); see "
                               f"{args.logs}/trainer.log")
    with open(out) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the figures here (one flat object)")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4",
                    help="learning rates, comma-separated; the first one's figures are the "
                         "unsuffixed keys")
    ap.add_argument("--steps", type=int, default=10, help="consecutive steps per rate")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=int, default=128)
    ap.add_argument("--full-repeats", type=int, default=3)
    ap.add_argument("--link-gbit", type=float, default=10.0,
                    help="the rate limit of the second relay's link (network namespaces)")
    ap.add_argument("--loopback", action="store_true",
                    help="both relays on loopback, no rate limit (also without root)")
    ap.add_argument("--logs", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--master-host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--relay-url", default=None, help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    args.lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    if not args.lrs or args.steps < 1:
        ap.error("--lrs needs at least one rate and --steps at least 1")
    if args.worker:
        result = worker(args)
        with open(args.worker, "w") as f:
            json.dump(result, f)
        return result
    args.logs = args.logs or tempfile.mkdtemp(prefix="laminar-bench-delta-")
    os.makedirs(args.logs, exist_ok=True)
    args.model_gb = 2 * (0.272 + 0.0149 * args.layers)  # bf16 GB: embeddings, head, layers
    from ..testing.netns import hosts_or_loopback

    link = args.link_gbit if hosts_or_loopback(args.loopback, "bench.delta", "both relays on "
                                                "loopback, no rate limit") else None
    passthrough = [a for a in raw if a not in ("--json",)]
    if "--json" in raw:
        i = raw.index("--json")
        passthrough = raw[:i] + raw[i + 2:]
    result = _across_hosts(args, passthrough) if link else worker(args)
    figures = _figures(result, args, link)
    lines = {k: str(v) for k, v in figures.items()}
    report(figures, args.json, lines)
    return figures


def _figures(result: dict, args, link: Optional[float]) -> dict:
    first = result["runs"][repr(args.lrs[0])]
    figures = {"params": result["params"], "full_bytes": result["full_bytes"],
               "link_gbit": link, "steps": args.steps, "lr": args.lrs[0],
               "bucket_mb": args.bucket_mb,
               "changed_fraction": round(first["changed_fraction"], 5),
               "delta_bytes_ratio": round(first["delta_bytes_ratio"], 2),
               "delta_bit_exact": bool(result["delta_bit_exact"]),
               "publish_s_full": round(result["publish_s_full"], 3),
               "publish_s_delta": round(first["publish_s_delta"], 3),
               "publish_speedup": round(result["publish_s_full"] / first["publish_s_delta"], 2),
               "encode_gb_per_s": round(first["encode_gb_per_s"], 3),
               "rebuild_gb_per_s": round(result["rebuild_gb_per_s"], 3)}
    for lr in args.lrs:
        run = result["runs"][repr(lr)]
        tag = f"_lr{lr:g}"
        figures.update({
            f"changed_fraction{tag}": round(run["changed_fraction"], 5),
            f"delta_bytes_ratio{tag}": round(run["delta_bytes_ratio"], 2),
            f"delta_buckets_fraction{tag}": round(run["delta_buckets_fraction"], 3),
            f"publish_s_delta{tag}": round(run["publish_s_delta"], 3),
            f"publish_speedup{tag}": round(result["publish_s_full"] / run["publish_s_delta"], 2),
            f"encode_gb_per_s{tag}": round(run["encode_gb_per_s"], 3)})
    return figures


if __name__ == "__main__":
    main()
