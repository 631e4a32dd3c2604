"""Peak memory of the loss path (log-probs + decoupled-PPO loss, forward and backward) against a
naive torch ``log_softmax`` implementation, at 4096 tokens x 151936 vocabulary (Qwen2.5's).

    python -m laminar_mcore.bench.loss [--tokens 4096 --vocab 151936] [--json PATH]

Each variant runs in a fresh child process (fixed glibc mmap threshold, resident high-water
mark reset just before the measured call); its peak resident memory beyond the inputs it was
handed (the logits) and beyond the gradient it must return (same size as the logits, for any
method) is what the loss path itself needed. On a GPU the same is measured with CUDA's peak
allocator statistics, with the time of both paths.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_rss_peak() -> int:
    """Reset the kernel's resident-set high-water mark (Linux ``clear_refs`` 5) and return the
    current resident set; falls back to the process-lifetime peak where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except OSError:
        return _rss_peak_bytes()


def _rss_peak_bytes() -> int:
    try:
        return _status_bytes("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(tokens: int, vocab: int, device: str):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    prox = -torch.rand(tokens, generator=g).to(device) * 5 - 8
    behav = prox + torch.randn(tokens, generator=g).to(device) * 0.1
    adv = torch.randn(tokens, generator=g).to(device)
    mask = (torch.rand(tokens, generator=g) > 0.1).float().to(device)
    return logits, targets, prox, behav, adv, mask


def _loss_fused(logits, targets, prox, behav, adv, mask):
    from ..algos import decoupled_ppo_loss
    from ..kernels.logprobs import logprobs_entropy

    lp, _ = logprobs_entropy(logits, targets)
    return decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip_high=0.28)[0]


def _loss_naive(logits, targets, prox, behav, adv, mask):
    logp = torch.log_softmax(logits.float(), dim=-1)  # [tokens, vocab] fp32
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ratio = torch.exp(lp - prox)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
    return (pg * torch.exp(prox - behav) * mask).sum() / mask.sum()


def child(variant: str, tokens: int, vocab: int, device: str) -> dict:
    from ..algos import decoupled_ppo_loss  # noqa: F401 - imports are not the loss path's memory
    from ..kernels.logprobs import logprobs_entropy  # noqa: F401

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    inputs = _inputs(tokens, vocab, device)
    small = [t[:2].clone() for t in inputs]  # warm up kernels/allocator outside the measurement
    (_loss_fused if variant == "fused" else _loss_naive)(small[0].requires_grad_(), *small[1:]).backward()
    logits = inputs[0].requires_grad_()
    grad_bytes = logits.numel() * logits.element_size()
    fn = _loss_fused if variant == "fused" else _loss_naive
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_rss_peak()
    start = time.perf_counter()
    loss = fn(logits, *inputs[1:])
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_peak_bytes() - base
    return {"variant": variant, "peak_bytes": max(peak - grad_bytes, 0), "raw_peak_bytes": peak,
            "seconds": time.perf_counter() - start, "loss": float(loss)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.device)))
        return {}

    from .common import report

    # A fixed mmap threshold: large tensors are mapped and unmapped with their lifetime instead of
    # lingering in glibc's heap, so the resident peak follows what the loss path really held.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    results = {}
    for variant in ("fused", "naive"):
        out = subprocess.run([sys.executable, "-m", "laminar_mcore.bench.loss", "--child", variant,
                              "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                              "--device", args.device], capture_output=True, text=True, check=True,
                             env=env)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    fused, naive = results["fused"], results["naive"]
    if abs(fused["loss"] - naive["loss"]) > 1e-4 * max(1.0, abs(naive["loss"])):
        raise RuntimeError(f"the two loss paths disagree: {fused['loss']} vs {naive['loss']}")
    figures = {"peak_bytes": fused["peak_bytes"], "naive_peak_bytes": naive["peak_bytes"],
               "ratio": fused["peak_bytes"] / max(naive["peak_bytes"], 1),
               "seconds": fused["seconds"], "naive_seconds": naive["seconds"],
               "tokens": args.tokens, "vocab": args.vocab, "device": args.device,
               "loss": fused["loss"]}
    gib = 2**30
    report(figures, args.json, {
        "peak_bytes": f"{fused['peak_bytes'] / gib:.3f} GiB ({figures['ratio']:.3f}x naive log_softmax)",
        "naive_peak_bytes": f"{naive['peak_bytes'] / gib:.3f} GiB",
        "seconds": f"{fused['seconds']:.2f} s ({fused['seconds'] / naive['seconds']:.2f}x naive)",
        "shape": f"{args.tokens} tokens x {args.vocab} vocab on {args.device}, losses agree",
    })
    return figures


if __name__ == "__main__":
    main()
