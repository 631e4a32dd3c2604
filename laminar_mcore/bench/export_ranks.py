"""The trainer's blocked time per publish: stage-lead export against per-rank export (issue 52,
item 5), the same model in the same run, side by side.

    python -m laminar_mcore.bench.export_ranks [--tp 2] [--hidden 768 --layers 6 --vocab 32000]
        [--repeats 5] [--json PATH]

It runs this file under torchrun with ``--tp`` ranks (a TP-N stage of ``bench.weight_sync``'s
model, which reports the same keys prefixed ``export_`` with ``--export-tp N``; gloo on CPU,
NCCL where there are GPUs) and reads each rank's figures:

* stage lead (today's publisher): every rank of the stage takes part in the export's TP
  gathers (``iter_stage_hf_tensors``), and the lead copies the whole stage into its host
  buffer; a rank is blocked until its part is done;
* per rank: each rank copies its own slices (``iter_rank_hf_shards``, no collective) into its
  own host buffer.

Blocked = the slowest rank's seconds, median over ``--repeats`` after one warm-up (which
allocates the buffers). Keys (prefixed ``export_`` in bench.weight_sync's JSON):
``blocked_s_stage_lead``, ``blocked_s_per_rank``, ``blocked_ratio`` (stage lead / per rank),
``bytes_stage``, ``bytes_per_rank_max``, ``tp``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict

import torch


def _copy_into(buffer: torch.Tensor, tensors) -> int:
    """Copy each tensor's bytes into ``buffer`` back to back; returns the bytes."""
    offset = 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    return offset


def _worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from laminar_mcore.models.hf import tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.trainer.export import iter_rank_hf_shards, iter_stage_hf_tensors
    from laminar_mcore.trainer.model import build_gpt_model

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
    dtype = torch.bfloat16
    model = build_gpt_model(cfg, dtype=dtype)
    lead = dist.get_rank() == 0
    timings: Dict[str, list] = {"stage_lead": [], "per_rank": []}
    buffers: Dict[str, torch.Tensor] = {}
    sizes: Dict[str, int] = {}

    def run(kind: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "stage_lead":
            tensors = (t for _, t in iter_stage_hf_tensors(model, cfg))
            keep = lead
        else:
            tensors = (t for _, t, _, _ in iter_rank_hf_shards(model, cfg))
            keep = True
        if keep:
            if kind not in buffers:  # the warm-up sizes and allocates the host buffer
                items = [t.contiguous() for t in tensors]
                sizes[kind] = sum(t.numel() * t.element_size() for t in items)
                buffers[kind] = torch.empty(sizes[kind], dtype=torch.uint8,
                                            pin_memory=torch.cuda.is_available())
                tensors = iter(items)
            _copy_into(buffers[kind], tensors)
        else:
            for _ in tensors:  # the gathers this rank takes part in
                pass
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(1 + args.repeats):
        for kind in ("stage_lead", "per_rank"):  # interleaved: the machine's noise hits both
            seconds = run(kind)
            if i:
                timings[kind].append(seconds)
    write_rank_result(args.out, {"rank": dist.get_rank(),
                                 "stage_lead": timings["stage_lead"],
                                 "per_rank": timings["per_rank"],
                                 "bytes_stage_lead": sizes.get("stage_lead", 0),
                                 "bytes_per_rank": sizes.get("per_rank", 0)})
    dist.barrier()
    dist.destroy_process_group()


def measure(tp: int, hidden: int, layers: int, vocab: int, repeats: int = 5,
            timeout: float = 900.0) -> Dict[str, float]:
    """The figures above, from a torchrun of ``tp`` ranks."""
    from ..testing.dist import run_torchrun

    results = run_torchrun(os.path.abspath(__file__), tp,
                           ["--hidden", str(hidden), "--layers", str(layers),
                            "--vocab", str(vocab), "--repeats", str(repeats)],
                           timeout=timeout, env={"PYTHONPATH": _root_path()})
    out: Dict[str, float] = {"tp": tp}
    for kind in ("stage_lead", "per_rank"):
        # per repeat, the slowest rank; then the median over repeats
        slowest = [max(r[kind][i] for r in results) for i in range(repeats)]
        out[f"blocked_s_{kind}"] = statistics.median(slowest)
    out["blocked_ratio"] = out["blocked_s_stage_lead"] / max(out["blocked_s_per_rank"], 1e-12)
    out["bytes_stage"] = max(r["bytes_stage_lead"] for r in results)
    out["bytes_per_rank_max"] = max(r["bytes_per_rank"] for r in results)
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
