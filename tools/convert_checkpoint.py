#!/usr/bin/env python
"""Convert checkpoints between Hugging Face safetensors and Megatron-Core dist_checkpointing.

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR --tp N --pp M [--ep E]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt DIR --out DIR [--origin-hf DIR]

hf-to-mcore starts its own M*lcm(N, E) processes (torchrun, gloo on CPU) when that is more than
one (``--ep``: expert parallelism of a mixture-of-experts model; each rank holds its experts,
saved with their global numbers, so the checkpoint loads at any other EP too); each rank reads
only the tensors of its own units, one layer at a time, and the model is saved with
dist_checkpointing (torch_dist), so it loads at any other TP/PP. mcore-to-hf loads whatever
layout the checkpoint was saved in and writes safetensors shards with an index, config.json and
the tokenizer files. Both use the model family adapters (the mapping the weight publisher
uses): a tensor that would be lost or renamed is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> int:
    """Reset the resident high-water mark (Linux) and return the current resident set."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_layout(hf_config, tp: int, pp: int, ep: int = 1) -> None:
    from laminar_mcore.models import get_adapter

    adapter = get_adapter(hf_config)
    s = adapter.shape(hf_config)
    problems = []
    if tp < 1 or pp < 1 or ep < 1:
        problems.append("--tp, --pp and --ep must be >= 1")
    experts = adapter.num_experts(hf_config)
    if ep > 1 and not experts:
        problems.append(f"--ep {ep} needs a mixture-of-experts model ({hf_config.model_type} "
                        "has no experts)")
    elif experts and ep >= 1 and experts % ep:
        problems.append(f"num_experts={experts} is not divisible by --ep {ep}")
    for name, value in (("num_attention_heads", s.heads), ("num_key_value_heads", s.groups),
                        ("vocab_size", s.vocab)):
        if tp >= 1 and value % tp:
            problems.append(f"{name}={value} is not divisible by --tp {tp}")
    if pp >= 1 and s.layers % pp:
        problems.append(f"num_hidden_layers={s.layers} is not divisible by --pp {pp}")
    if problems:
        fail("LMC-E312: " + "; ".join(problems))


def hf_to_mcore(args) -> None:
    from laminar_mcore.models import AdapterError, get_adapter
    from laminar_mcore.models.hf import SafetensorsReader, load_hf_config

    try:
        hf_config = load_hf_config(args.hf)
        get_adapter(hf_config)
        reader = SafetensorsReader(args.hf)
        get_adapter(hf_config).check_hf_names(hf_config, reader.names())
    except AdapterError as exc:
        fail(str(exc))
    check_layout(hf_config, args.tp, args.pp, args.ep)
    world = args.pp * math.lcm(args.tp, args.ep)
    if world > 1 and "RANK" not in os.environ:
        from laminar_mcore.netutil import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--local-addr=127.0.0.1",
               os.path.abspath(__file__), *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        sys.exit(subprocess.call(cmd, env=env))

    import torch
    import torch.distributed as dist
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.checkpoint import write_model_meta
    from laminar_mcore.trainer.dist_save import save_sharded
    from laminar_mcore.trainer.model import build_gpt_model, load_hf_checkpoint

    start = time.perf_counter()
    init_trainer_parallel(tp=args.tp, pp=args.pp, ep=args.ep, seed=0)
    rank = dist.get_rank()
    model = build_gpt_model(hf_config, dtype=torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    try:
        nbytes = load_hf_checkpoint(model, hf_config, reader)
    except AdapterError as exc:
        fail(str(exc))
    model_dir = os.path.join(args.out, "model")
    if rank == 0:
        os.makedirs(model_dir, exist_ok=True)  # dist_checkpointing needs the directory
    dist.barrier()
    save_sharded(model.sharded_state_dict(), model_dir)
    total = torch.tensor([float(nbytes)])
    dist.all_reduce(total)
    if rank == 0:
        write_model_meta(args.out, hf_config, tp=args.tp, pp=args.pp, dtype=args.dtype,
                         source=os.path.abspath(args.hf), hf_files_from=args.hf, ep=args.ep)
        seconds = time.perf_counter() - start
        print(f"converted {args.hf} -> {args.out} (tp={args.tp}, pp={args.pp}, ep={args.ep}): "
              f"{total.item() / 1e9:.4g} GB read in {seconds:.1f}s "
              f"({total.item() / 1e9 / seconds:.3g} GB/s)", flush=True)
    destroy_trainer_parallel()


def _same_architecture(a, b) -> bool:
    from laminar_mcore.models import get_adapter

    return a.model_type == b.model_type and get_adapter(a).shape(a) == get_adapter(b).shape(b) \
        and bool(getattr(a, "tie_word_embeddings", False)) == bool(getattr(b, "tie_word_embeddings", False))


def mcore_to_hf(args) -> None:
    from laminar_mcore.models import AdapterError
    from laminar_mcore.models.hf import load_hf_config
    from laminar_mcore.trainer.checkpoint import MODEL_META

    meta_path = os.path.join(args.ckpt, MODEL_META)
    if not os.path.isfile(meta_path):
        fail(f"LMC-E313: {args.ckpt} has no {MODEL_META}: not a checkpoint written by hf-to-mcore "
             "or the trainer")
    meta = json.load(open(meta_path))
    try:
        hf_config = load_hf_config(os.path.join(args.ckpt, "hf_meta"))
        if args.origin_hf:
            origin = load_hf_config(args.origin_hf)
            if not _same_architecture(origin, hf_config):
                fail(f"LMC-E313: --origin-hf {args.origin_hf} is a different model than the "
                     f"checkpoint ({origin.model_type} vs {hf_config.model_type} or different "
                     "sizes)")
    except AdapterError as exc:
        fail(str(exc))
    except (ValueError, OSError) as exc:  # transformers' own config validation
        fail(f"LMC-E313: cannot read the model config of {args.ckpt} (hf_meta/config.json): "
             f"{exc}")

    from laminar_mcore.models.hf import ShardWriter, copy_side_files
    from laminar_mcore.errors import within
    from laminar_mcore.trainer.checkpoint import CheckpointMismatch, iter_checkpoint_hf_tensors

    start = time.perf_counter()
    expected = _expected_hf_shapes(hf_config)
    base_rss = _reset_peak_rss()
    writer = ShardWriter(args.out, int(args.max_shard_gb * 1e9))
    try:
        for name, tensor in iter_checkpoint_hf_tensors(os.path.join(args.ckpt, "model"), hf_config):
            want = expected.pop(name, None)
            if want is None:
                fail(f"LMC-E303: the checkpoint produces {name!r}, which a "
                     f"{hf_config.model_type} model of its config does not have (or produces it "
                     "twice)")
            if tuple(tensor.shape) != want:
                fail(f"LMC-E303: {name}: the checkpoint holds shape {tuple(tensor.shape)}, the "
                     f"config predicts {want}; a checkpoint of another model?")
            writer.add(name, tensor)
    except CheckpointMismatch as exc:
        fail(within(f"cannot convert {args.ckpt}", exc, "LMC-E303"))
    except Exception as exc:  # noqa: BLE001 - dist_checkpointing raises many kinds
        fail(f"LMC-E303: cannot read {args.ckpt} as a {hf_config.model_type} checkpoint of its "
             f"config (truncated, or a checkpoint of another model?): {exc}")
    if expected:
        fail(f"LMC-E303: the checkpoint lacks {sorted(expected)[:5]} ({len(expected)} tensors): "
             "it would be an incomplete model")
    count, total = writer.close(), writer.total_bytes
    hf_config.save_pretrained(args.out)
    copy_side_files(args.origin_hf or os.path.join(args.ckpt, "hf_meta"), args.out)
    seconds = time.perf_counter() - start
    held = max(_peak_rss() - base_rss, 0)
    print(f"converted {args.ckpt} (saved at tp={meta.get('tp')}, pp={meta.get('pp')}, "
          f"ep={meta.get('ep', 1)}) -> {args.out}: "
          f"{count} tensors, {total / 1e9:.4g} GB in {seconds:.1f}s "
          f"({total / 1e9 / seconds:.3g} GB/s); peak memory {held / 1e9:.3g} GB above the start "
          f"(one unit and one shard of at most {args.max_shard_gb:g} GB, never the model)", flush=True)


def _expected_hf_shapes(hf_config) -> dict:
    """Name -> shape of every tensor a Hugging Face checkpoint of ``hf_config`` stores (tied
    weights once), from a model built on the meta device (no memory). Mixture-of-experts
    models: from the adapter (transformers keeps their experts fused in memory, checkpoints
    name each one)."""
    import torch
    from transformers import AutoModelForCausalLM

    from laminar_mcore.models import get_adapter

    adapter = get_adapter(hf_config)
    if adapter.is_moe:
        return dict(adapter.hf_shapes(hf_config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face safetensors -> Megatron torch_dist")
    a.add_argument("--hf", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models)")
    a.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    b = sub.add_parser("mcore-to-hf", help="Megatron torch_dist -> Hugging Face safetensors")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--origin-hf", default=None, help="take tokenizer files from this HF directory")
    b.add_argument("--max-shard-gb", type=float, default=5.0)
    args = ap.parse_args(argv)
    if args.command == "hf-to-mcore":
        hf_to_mcore(args)
    else:
        mcore_to_hf(args)


if __name__ == "__main__":
    main()
