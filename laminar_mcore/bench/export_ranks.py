"""The trainer's blocked time per publish: stage-lead export against per-rank export (issue 52,
item 5), the same model in the same run, side by side, through the real publisher.

    python -m laminar_mcore.bench.export_ranks [--tp 2] [--hidden 768 --layers 6 --vocab 32000]
        [--repeats 5] [--json PATH]

It starts a master relay and runs this file under torchrun with ``--tp`` ranks (a TP-N stage of
``bench.weight_sync``'s model, which reports the same keys prefixed ``export_`` with
``--export-tp N``; gloo on CPU, NCCL where there are GPUs). Each rank holds two
``WeightPublisher``s on that relay and publishes alternately through them
(``weight_sync.export``):

* ``stage_lead`` (the default): every rank of the stage takes part in the export's TP gathers
  (``iter_stage_hf_tensors``), and the lead packs the whole stage into its host buckets;
* ``per_rank``: each rank packs its own slices (``iter_rank_hf_shards``, no collective) into
  its own buckets, a part of its own at the relay.

Blocked = ``PublishStats.blocked_s``, what ``publish`` returns after (the export into host
buckets: what training waits for), of the slowest rank, median over ``--repeats`` after one
warm-up (which allocates the buffers); each publish's send to the relay finishes before the
next starts. Every version must complete at the relay with the model's bytes. Keys (prefixed
``export_`` in bench.weight_sync's JSON): ``blocked_s_stage_lead``, ``blocked_s_per_rank``,
``blocked_ratio`` (stage lead / per rank), ``bytes_stage``, ``bytes_per_rank_max``, ``tp``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Dict

import torch

EXPORTS = ("stage_lead", "per_rank")


def _worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--publish-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from laminar_mcore.models.hf import tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    tp = int(os.environ["WORLD_SIZE"])
    init_trainer_parallel(tp=tp, pp=1, seed=0)
    # bench.weight_sync's model, with query groups that divide over the TP ranks
    heads = args.hidden // 64
    groups = next(g for g in range(tp, heads + 1, tp) if g >= args.hidden // 256 and
                  heads % g == 0)
    cfg = tiny_hf_config("qwen2", hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=groups, vocab_size=args.vocab)
    torch.set_num_threads(1)
    model = build_gpt_model(cfg, dtype=torch.bfloat16)
    publishers = {kind: WeightPublisher(model, cfg, relay_host="127.0.0.1",
                                        publish_port=args.publish_port, export=kind)
                  for kind in EXPORTS}
    timings: Dict[str, list] = {kind: [] for kind in EXPORTS}
    sizes: Dict[str, int] = {}
    version = 0
    for i in range(1 + args.repeats):
        for kind in EXPORTS:  # interleaved: the machine's noise hits both
            version += 1
            dist.barrier()
            stats = publishers[kind].publish(version)
            publishers[kind].wait()  # its send ends before the next export starts
            sizes[kind] = stats.nbytes
            if i:
                timings[kind].append(stats.blocked_s)
    dist.barrier()
    for publisher in publishers.values():
        publisher.close()
    write_rank_result(args.out, {"rank": dist.get_rank(), **timings,
                                 "bytes_stage_lead": sizes["stage_lead"],
                                 "bytes_per_rank": sizes["per_rank"], "versions": version})
    dist.barrier()
    dist.destroy_process_group()


def measure(tp: int, hidden: int, layers: int, vocab: int, repeats: int = 5,
            timeout: float = 900.0) -> Dict[str, float]:
    """The figures above, from a master relay and a torchrun of ``tp`` ranks."""
    import secrets
    import urllib.request
    import json

    from ..netutil import TOKEN_ENV
    from ..relay.launch import relay_process
    from ..relay.server import RelayConfig
    from ..testing.dist import run_torchrun

    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="laminar-export-ranks-") as tmp:
        relay = relay_process(RelayConfig(token, master=True, trainer_stages=tp,
                                          relay_id="master"),
                              os.path.join(tmp, "relay.log")).start()
        try:
            port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
            results = run_torchrun(os.path.abspath(__file__), tp,
                                   ["--hidden", str(hidden), "--layers", str(layers),
                                    "--vocab", str(vocab), "--repeats", str(repeats),
                                    "--publish-port", str(port)],
                                   timeout=timeout,
                                   env={"PYTHONPATH": _root_path(), TOKEN_ENV: token})
            req = urllib.request.Request(relay.url + "/latest",
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                latest = json.loads(resp.read())
        finally:
            relay.stop()
    out: Dict[str, float] = {"tp": tp}
    for kind in EXPORTS:
        # per repeat, the slowest rank; then the median over repeats
        slowest = [max(r[kind][i] for r in results) for i in range(repeats)]
        out[f"blocked_s_{kind}"] = statistics.median(slowest)
    out["blocked_ratio"] = out["blocked_s_stage_lead"] / max(out["blocked_s_per_rank"], 1e-12)
    out["bytes_stage"] = max(r["bytes_stage_lead"] for r in results)
    out["bytes_per_rank_max"] = max(r["bytes_per_rank"] for r in results)
    whole = sum(r["bytes_per_rank"] for r in results)
    if latest.get("version") != results[0]["versions"] or latest.get("nbytes") != whole:
        raise RuntimeError(f"the relay holds {latest} after {results[0]['versions']} "
                           f"versions of {whole} bytes: a publish did not complete")
    return out


def _root_path() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def main(argv=None) -> Dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tp < 1 or args.repeats < 1:
        ap.error("--tp and --repeats must be >= 1")
    from .common import report

    figures = measure(args.tp, args.hidden, args.layers, args.vocab, args.repeats)
    report(figures, args.json, {"blocked_ratio": (
        f"{figures['blocked_ratio']:.1f}x less blocking per rank at TP{args.tp}: stage lead "
        f"{figures['blocked_s_stage_lead']:.4f} s, per rank {figures['blocked_s_per_rank']:.4f} s "
        f"(each copies at most {figures['bytes_per_rank_max'] / 1e9:.3f} of "
        f"{figures['bytes_stage'] / 1e9:.3f} GB)")})
    return figures


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # a rank of measure()'s torchrun (run by path)
        _worker()
    else:
        main()
