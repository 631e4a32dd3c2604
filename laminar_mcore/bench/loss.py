"""Peak memory and time of the loss path (log-probs + decoupled-PPO loss, forward and backward)
against a naive torch ``log_softmax`` implementation, at 4096 tokens x 151936 vocabulary
(Qwen2.5's).

    python -m laminar_mcore.bench.loss [--tokens 4096 --vocab 151936] [--device cuda|cpu]
        [--dtype bfloat16|float16|float32] [--repeats N] [--json PATH]

Each variant runs in a fresh child process; both start together (imports and inputs overlap),
then each in turn, the other idle and holding only its inputs, runs its path once at the
measured shapes (forward and backward, as timed: Triton compiles its kernels per
specialisation, and the CUDA allocator grows to its working set), then times ``--repeats`` calls -- with CUDA events and
synchronisation on a GPU, ``time.perf_counter`` on the CPU -- and reports the median
(``seconds``, ``naive_seconds``). Logits are bf16 on GPUs, as in training; fp32 on the CPU,
where the fused path's torch fallback is several times slower in bf16 (``dtype`` in the JSON
says which; ``--dtype`` overrides). Repeats
default to 10 on GPUs, 1 on the CPU (a call there takes seconds).

Memory: on the CPU, with a fixed glibc mmap threshold, the resident high-water mark is reset
after the warm-up; the peak beyond the inputs the child was handed (the logits) and beyond the
gradient it must return (same size as the logits, for any method) is what the loss path itself
needed. On a GPU the same is measured with CUDA's peak allocator statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _inputs(tokens: int, vocab: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    logits = randn(tokens, vocab, dt=dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    prox = -torch.rand(tokens, generator=g, device=device) * 5 - 8
    behav = prox + randn(tokens) * 0.1
    adv = randn(tokens)
    mask = (torch.rand(tokens, generator=g, device=device) > 0.1).float()
    return logits, targets, prox, behav, adv, mask


def _loss_fused(logits, targets, prox, behav, adv, mask):
    from ..algos import decoupled_ppo_loss
    from ..kernels.logprobs import logprobs_entropy

    lp, _ = logprobs_entropy(logits, targets)
    return decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip_high=0.28)[0]


def _load(variant: str):
    """The variant's loss function, its imports done (they are not the loss path's time)."""
    if variant == "naive":
        return _loss_naive
    import importlib

    importlib.import_module("laminar_mcore.algos")
    importlib.import_module("laminar_mcore.kernels.logprobs")
    return _loss_fused


def _loss_naive(logits, targets, prox, behav, adv, mask):
    logp = torch.log_softmax(logits.float(), dim=-1)  # [tokens, vocab] fp32
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ratio = torch.exp(lp - prox)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
    return (pg * torch.exp(prox - behav) * mask).sum() / mask.sum()


def child(variant: str, tokens: int, vocab: int, device: str, dtype: str = "float32",
          repeats: int = 1, loaded=None) -> dict:
    """One variant's figures. ``loaded()``, if given, is called once the inputs are made and
    before any loss computation (``main`` holds each child there until the other is done)."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cuda = device.startswith("cuda")
    fn = _load(variant)
    logits, *rest = _inputs(tokens, vocab, device, DTYPES[dtype])
    if cuda:
        torch.cuda.synchronize()
    if loaded is not None:
        loaded()
    logits.requires_grad_()
    grad_bytes = logits.numel() * logits.element_size()

    def step():
        loss = fn(logits, *rest)
        loss.backward()
        return loss

    # Warm-up at the measured shapes (imports, Triton's compilation of the specialisations the
    # timed calls launch, the allocator's growth): neither timed nor in the memory peak.
    step()
    logits.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_rss_peak()
    times, events = [], []
    for _ in range(repeats):
        logits.grad = None  # outside the timed region: every call allocates its gradient
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            events.append((start, end))
        else:
            start = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_peak_bytes() - base
    return {"variant": variant, "peak_bytes": max(peak - grad_bytes, 0), "raw_peak_bytes": peak,
            "seconds": statistics.median(times), "times": times,
            "loss": float(loss.detach())}


READY = "loaded"


def _run_children(cmd, variants, env) -> dict:
    """Run ``cmd + [variant]`` for each variant: all start together (imports and inputs overlap),
    then each in turn warms up and measures while the others wait, idle."""
    procs, errs = {}, {}

    def failed(v):
        procs[v].kill()
        procs[v].wait()
        errs[v].seek(0)
        return RuntimeError(f"bench.loss child {v} failed (exit {procs[v].returncode}):\n"
                            + errs[v].read().decode(errors="replace")[-4000:])

    try:
        for v in variants:
            errs[v] = tempfile.TemporaryFile()  # not a pipe: a chatty child cannot block on it
            procs[v] = subprocess.Popen(cmd + [v], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=errs[v], text=True, env=env)
        for v, p in procs.items():
            while (line := p.stdout.readline()) and line.strip() != READY:
                pass
            if not line:
                raise failed(v)
        results = {}
        for v, p in procs.items():
            out, _ = p.communicate("go\n")
            if p.returncode:
                raise failed(v)
            results[v] = json.loads(out.strip().splitlines()[-1])
        return results
    finally:
        for v, p in procs.items():
            if p.poll() is None:
                p.kill()
                p.wait()
            errs[v].close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="logits' dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed calls per path, median reported (default: 10 on cuda, 1 on cpu)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    repeats = args.repeats if args.repeats is not None else (10 if cuda else 1)
    if repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.child:
        def loaded():  # tell main, then wait for its go-ahead
            print(READY, flush=True)
            sys.stdin.readline()

        print(json.dumps(child(args.child, args.tokens, args.vocab, args.device, dtype, repeats,
                               loaded)))
        return {}

    from .common import report

    # A fixed mmap threshold: large tensors are mapped and unmapped with their lifetime instead of
    # lingering in glibc's heap, so the resident peak follows what the loss path really held.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    cmd = [sys.executable, "-m", "laminar_mcore.bench.loss", "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--device", args.device, "--dtype", dtype,
           "--repeats", str(repeats), "--child"]
    results = _run_children(cmd, ("fused", "naive"), env)
    fused, naive = results["fused"], results["naive"]
    if abs(fused["loss"] - naive["loss"]) > 1e-4 * max(1.0, abs(naive["loss"])):
        raise RuntimeError(f"the two loss paths disagree: {fused['loss']} vs {naive['loss']}")
    figures = {"peak_bytes": fused["peak_bytes"], "naive_peak_bytes": naive["peak_bytes"],
               "ratio": fused["peak_bytes"] / max(naive["peak_bytes"], 1),
               "seconds": fused["seconds"], "naive_seconds": naive["seconds"],
               "repeats": repeats, "dtype": dtype,
               "tokens": args.tokens, "vocab": args.vocab, "device": args.device,
               "loss": fused["loss"]}
    gib = 2**30
    report(figures, args.json, {
        "peak_bytes": f"{fused['peak_bytes'] / gib:.3f} GiB ({figures['ratio']:.3f}x naive log_softmax)",
        "naive_peak_bytes": f"{naive['peak_bytes'] / gib:.3f} GiB",
        "seconds": f"{fused['seconds']:.4f} s median of {repeats} after a warm-up "
                   f"({fused['seconds'] / naive['seconds']:.2f}x naive's {naive['seconds']:.4f} s)",
        "shape": f"{args.tokens} tokens x {args.vocab} vocab, {dtype} logits on {args.device}, "
                 "losses agree",
    })
    return figures


if __name__ == "__main__":
    main()
