"""The GPU check: every GPU-only path of the project, on one GPU, in one command.

    python -m laminar_mcore.bench.gpu --json out.json          # on a GPU machine
    python -m laminar_mcore.bench.gpu --cpu-rehearsal          # the same logic on CPU (make test)
    tools/gpu_check.sh WHEELS OUTDIR                            # on an offline GPU machine

Checks, each printed as pass/fail with its figure:

1. ``kernels``: the Triton log-prob/entropy kernel (forward and backward) and the decoupled-PPO
   kernel against an fp32 torch reference at (4096, 151936) and (16384, 152064) bf16 -- the second
   has more than 2**31 logits, so an int32 offset would fail it -- with time and peak memory
   against a naive ``log_softmax``;
2. ``train_step``: a tiny model's decoupled-PPO step on CUDA in the trainer's
   ``cpu:gloo,cuda:nccl`` world with Megatron's distributed optimizer (helper collectives on CPU
   tensors included, attention masks built on the GPU);
3. ``checkpoint``: the distributed-optimizer checkpoint round trip (weights, Adam's moments and
   step; the next step equal to the uninterrupted one);
4. ``publish``: the export of a Qwen2.5-7B-shaped pipeline stage (7 of its 28 layers) into pinned
   host buckets -- the time training is blocked, and the pinned bytes;
5. ``staging``: the publish channel's host-to-device staging on its own stream while GEMMs are
   queued on the default stream (how long a chunk waits, against the default stream);
6. ``cuda_ipc``: the relay's CUDA-IPC exporter pulling that stage bucket by bucket -- payload bytes
   and the engine GPU's peak memory, at most two buckets (SGLang's classes when importable, a
   stand-in of the same format otherwise);
7. ``plan``: the capacity plan's activation bytes per token and layer against a measured
   Qwen2.5-7B-shaped layer at 16,384 tokens in eight packed sequences (the attention the run
   uses: Transformer Engine's, else ``trainer.attention``'s varlen/SDPA kernels), and no
   ``[s, s]`` score tensor kept;
8. ``moe``: a tiny Qwen3-MoE built as the trainer builds it on this machine (Transformer
   Engine's grouped-GEMM experts when TE is installed on a GPU, Megatron's SequentialMLP
   otherwise): its log-probs against the CPU engine's forward of the same weights, the export's
   Hugging Face tensors (experts under their per-expert names) equal to the source, and a
   decoupled-PPO step with routing replay whose recomputed log-probs match the engine's;
9. ``loop``: the demo's train job (``python -m laminar_mcore.launch``: the trainer on the GPU in
   bf16, a relay, two CPU engines, the controller) for 10 steps (4 in the rehearsal), saved,
   its last checkpoint removed and resumed: the books balanced, the engines at the trained
   version, the trainer's tokens/s, the engine mismatch and the publish figures
   (``gpu_checks/loop.py``; the one check whose child processes import Hydra and aiohttp).

``--pytest`` then runs the tests that compute on the GPU (``pytest -m gpu``) from the source tree.

Each check also says what it exercised and what it did not, computed from the run (world size,
device, which classes ran, whether a second process opened what was exported): two lists of
"what: how" / "what: why" entries, printed under its PASS/FAIL line and written as
``<check>_exercised`` / ``<check>_not_exercised``; ``coverage`` sums them up and lists every entry
not exercised. Beyond one process and one GPU:

- ``cuda_ipc`` hands each payload to a second process, which rebuilds the bucket as SGLang does
  (SGLang's serializer with its patched reductions when importable, the stand-in otherwise) and
  returns a SHA-256 of its bytes, compared with the exported bucket's (on CPU the payload carries
  shared memory instead of CUDA IPC handles);
- ``staging`` sends a buffer over the trainer -> relay publish channel (``weights.transport``)
  to a second process: NCCL with two or more GPUs, gloo otherwise;
- ``checkpoint`` reports the Adam class Megatron picked (Transformer Engine's ``FusedAdam`` when
  TE is importable); the CPU rehearsal runs its round trip a second time with the CPU twin of
  TE's ``FusedAdam`` (``testing.fused_adam``);
- ``train_step`` runs a second, two-rank NCCL world (distributed optimizer at DP2; both ranks
  must end with the same weights) when two GPUs are visible.

What one GPU cannot reach stays in the ``not_exercised`` lists: the multi-rank NCCL world, the
NCCL publish channel, MoE all-to-all between ranks.

Needs torch >= 2.11, triton, transformers, megatron-core, safetensors and this package -- no
Hydra, OmegaConf, SGLang or Transformer Engine -- so it runs on a bare GPU machine after
``pip install --no-deps`` of those wheels (README, "Checking the GPU paths"). Without a GPU it
exits 2 unless ``--cpu-rehearsal``: then every check's logic runs on CPU (gloo for NCCL, the
Triton interpreter at small shapes, the CPU twin of IPC) so that a GPU run can fail only for GPU
reasons. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from typing import Dict, Tuple

import torch

from .gpu_checks.common import QWEN2_5_7B, Bench
from .gpu_checks.loop import check_loop
from .gpu_checks.train import check_checkpoint, check_kernels, check_train_step
from .gpu_checks.transfer import check_cuda_ipc, check_publish, check_staging


# ---------------------------------------------------------------------- 7. plan vs measured
def check_plan(b: Bench) -> Tuple[bool, str]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from ..config.plan import _activation_bytes_per_token_layer, arch_of_hf_config
    from ..models.hf import build_hf_config, tiny_hf_config
    from ..trainer.attention import choose_kernel
    from ..trainer.model import build_gpt_model, te_available

    if b.cuda:  # the 7B recipe's micro-batch: 16,384 tokens, eight packed sequences
        cfg = build_hf_config("qwen2", hidden_act="silu", num_hidden_layers=1, **QWEN2_5_7B)
        tokens, seqs, dtype = 16384, 8, torch.bfloat16
    else:
        cfg, tokens, seqs, dtype = tiny_hf_config("qwen2", num_hidden_layers=1), 256, 4, \
            torch.float32
    model = build_gpt_model(cfg, dtype=dtype)
    layer = model.decoder.layers[0]
    h = cfg.hidden_size
    x = torch.randn(tokens, 1, h, device=b.device, dtype=dtype, requires_grad=True)
    seen, saved = set(), {"linear": 0, "scores": 0}
    seen.update((p.untyped_storage().data_ptr(), p.device.type) for p in model.parameters())
    longest = tokens // seqs

    def pack(t):  # every tensor autograd keeps for backward, counted once per storage
        key = (t.untyped_storage().data_ptr(), t.device.type)
        if key not in seen and t.data_ptr() != x.data_ptr():
            seen.add(key)
            # [.., s, s]: an unfused attention's scores/probabilities/mask, which flash
            # attention (what the plan assumes) never stores
            square = t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] >= longest
            saved["scores" if square else "linear"] += t.untyped_storage().nbytes()
        return t

    cu = torch.arange(0, tokens + 1, longest, dtype=torch.int32, device=b.device)
    te = te_available()
    if te:  # THD, as the trainer passes it to Transformer Engine's attention
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        rope = model.rotary_pos_emb(longest, packed_seq=True)
    else:  # the row in sbhd with its boundaries, as the trainer passes it without TE
        params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=tokens, max_seqlen_kv=tokens)
        rope = model.rotary_pos_emb(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=params)
    planned = _activation_bytes_per_token_layer(arch_of_hf_config(cfg), 1, False) * tokens
    planned *= (torch.finfo(dtype).bits // 8) / 2  # the plan counts bf16 bytes
    measured = saved["linear"]
    ratio = measured / planned
    x = None
    kernel = "Transformer Engine" if te else choose_kernel(device_type=b.device.type, dtype=dtype)
    b.figures.update({"plan_activation_bytes_per_token_layer": planned / tokens,
                      "measured_activation_bytes_per_token_layer": measured / tokens,
                      "measured_unfused_attention_bytes": saved["scores"],
                      "plan_activation_ratio": ratio, "plan_attention": kernel,
                      "plan_tokens": tokens})
    # On CPU the SwiGLU and RoPE run unfused (bias_activation_fusion needs CUDA) and keep a few
    # more f-wide tensors: the rehearsal checks the logic, the GPU the figure.
    low, high = (0.7, 1.3) if b.cuda else (0.5, 2.5)
    b.exercised("activation_bytes_vs_plan", f"one layer of hidden size {h}, {tokens} tokens in "
                f"{seqs} packed sequences, {'Transformer Engine' if te else 'local'} layers, "
                f"ratio band {low}-{high}")
    b.covered("flash_attention", saved["scores"] == 0,
              f"no [s, s] scores kept ({kernel} attention over packed sequences)",
              f"{kernel} attention kept {saved['scores']} bytes of [s, s] scores")
    b.covered("fused_swiglu_rope", b.cuda, "bias_activation_fusion on CUDA",
              "no GPU (CPU rehearsal: unfused, so the wider ratio band)")
    ok = low <= ratio <= high and saved["scores"] == 0
    return ok, (f"{tokens} tokens in {seqs} sequences, one layer, {kernel} attention: "
                f"{measured / 2**20:.1f} MiB saved for backward vs the plan's "
                f"{planned / 2**20:.1f} MiB: ratio {ratio:.2f}; [s, s] scores kept: "
                f"{saved['scores'] / 2**20:.1f} MiB")


# ---------------------------------------------------------------------- 8. moe
def check_moe(b: Bench) -> Tuple[bool, str]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..config.schema import AlgoConfig, TrainerConfig
    from ..models import get_adapter
    from ..testing.moe import engine_trajectories, near_tie_model
    from ..trainer.actor import MegatronActor
    from ..trainer.export import iter_stage_hf_tensors
    from ..trainer.model import te_available

    # near-tie routers: without replay the trainer would route differently from the engine
    cfg, hf = near_tie_model(mlp_only_layers=[1])
    adapter = get_adapter(cfg)
    trajs = engine_trajectories(cfg, hf, n=4)
    full = adapter.hf_to_mcore(cfg, hf)
    actor = MegatronActor(cfg, AlgoConfig(routing_replay=True),
                          TrainerConfig(lr=1e-4, max_tokens_per_microbatch=64), full_state=full,
                          dtype=torch.float32)
    grouped = bool(actor.config.moe_grouped_gemm)
    exported = {n: t.detach().float().cpu() for n, t in iter_stage_hf_tensors(actor.model, cfg)}
    export_ok = set(exported) == set(hf) and all(torch.equal(exported[n], hf[n]) for n in hf)
    mbs = actor.distribute(trajs)
    actor.compute_logprobs(mbs)
    gap = max(float((mb.prox_logprobs - mb.behav_logprobs)[mb.loss_mask > 0].abs().max())
              for mb in mbs)
    stats = actor.train_step(trajs)
    b.figures.update({"moe_grouped_gemm": grouped, "moe_logprob_gap": gap,
                      "moe_export_equal": export_ok, "moe_mismatch_max": stats["mismatch_max"]})
    ok = export_ok and gap < 1e-3 and stats["skipped"] == 0.0 and \
        grouped == bool(b.cuda and te_available())
    ep, world = ps.get_expert_model_parallel_world_size(), dist.get_world_size()
    b.exercised("moe_experts", f"{'TE grouped GEMM' if grouped else 'SequentialMLP'} on "
                f"{next(actor.model.parameters()).device.type}")
    b.covered("te_grouped_gemm", grouped, "Transformer Engine's grouped GEMM",
              "no GPU (CPU rehearsal)" if not b.cuda else "Transformer Engine not importable")
    b.exercised("routing_replay", f"recomputed log-probs within {gap:.1e} of the engine's")
    b.exercised("expert_export", f"{len(exported)} Hugging Face tensors, experts by name")
    b.covered("moe_all_to_all", ep > 1, f"EP={ep}", f"EP={ep} in a world of {world} rank(s): "
              "no token leaves its rank")
    return ok, (f"experts {'TE grouped GEMM' if grouped else 'SequentialMLP'}, export "
                f"{'equal' if export_ok else 'DIFFERENT'} ({len(exported)} tensors), replayed "
                f"log-prob gap to the engine {gap:.1e}, step mismatch max "
                f"{stats['mismatch_max']:.1e}")


CHECKS = [("kernels", check_kernels), ("train_step", check_train_step),
          ("checkpoint", check_checkpoint), ("publish", check_publish),
          ("staging", check_staging), ("cuda_ipc", check_cuda_ipc), ("plan", check_plan),
          ("moe", check_moe), ("loop", check_loop)]
NEEDS = {"checkpoint": "train_step", "cuda_ipc": "publish"}


def _versions() -> Dict[str, str]:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("triton", "megatron-core", "transformers", "safetensors", "sglang",
                 "transformer-engine"):
        try:
            out[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = "absent"
    out["cuda"] = str(torch.version.cuda)
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return out


def _run_gpu_tests(b: Bench) -> bool:
    """``pytest -m gpu`` over this source tree's tests (kernels, packed attention, the GPU
    decisions): on a GPU machine they compute on it. Its summary line goes into the figures."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tests = os.path.join(root, "tests")
    if not os.path.isdir(tests):
        print("[FAIL] pytest: no tests/ beside this package (run from a source checkout)",
              flush=True)
        b.figures.update({"pytest_passed": False, "pytest_summary": "no tests/ folder"})
        return False
    t0 = time.perf_counter()
    # --show-capture=no: a failure's captured log can be megabytes of torch's DEBUG trace
    # records (the H200 run of 2026-11-28 lost its traceback behind them)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--tb=short", "--show-capture=no", "-m", "gpu", tests], cwd=root,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    print(out[-12000:], flush=True)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if " passed" in ln or " failed" in ln or " error" in ln), lines[-1] if lines
                   else "no output")
    ok = proc.returncode == 0
    b.figures.update({"pytest_passed": ok, "pytest_summary": summary})
    print(f"[{'PASS' if ok else 'FAIL'}] pytest -m gpu ({time.perf_counter() - t0:.1f} s): "
          f"{summary}", flush=True)
    return ok


def _report_coverage(b: Bench, name: str) -> None:
    """Check ``name``'s two lists: into the figures, and printed under its PASS/FAIL line."""
    done, nots = b.coverage[name]
    b.figures[f"{name}_exercised"], b.figures[f"{name}_not_exercised"] = list(done), list(nots)
    for label, entries in (("exercised", done), ("not exercised", nots)):
        for entry in entries:
            print(f"    {label:>13}: {entry}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run every check's logic on CPU (gloo, Triton interpreter, shm twin)")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--pytest", action="store_true",
                    help="also run the tests that compute on the GPU (pytest -m gpu) from this "
                         "source tree")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        print("bench.gpu: no GPU on this machine (torch.cuda.is_available() is False); run it on "
              "a GPU machine, or --cpu-rehearsal to check its logic here", file=sys.stderr)
        return 2
    if args.cpu_rehearsal:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
            print("bench.gpu: --cpu-rehearsal needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel

    b = Bench(args.cpu_rehearsal)
    if not b.cuda:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    b.figures.update(_versions())
    b.figures["mode"] = "gpu" if b.cuda else "cpu_rehearsal"
    print(f"bench.gpu ({b.figures['mode']}): torch {b.figures['torch']}, triton "
          f"{b.figures['triton']}, megatron-core {b.figures['megatron_core']}, GPU "
          f"{b.figures['gpu']}, CUDA {b.figures['cuda']}", flush=True)
    only = {n for n in args.only.split(",") if n}
    init_trainer_parallel(tp=1, pp=1, seed=1)
    passed: Dict[str, bool] = {}
    try:
        for name, fn in CHECKS:
            if only and name not in only:
                continue
            b.check = name
            b.coverage[name] = ([], [])
            if NEEDS.get(name) and not passed.get(NEEDS[name]):
                passed[name] = False
                b.not_exercised("everything", f"skipped: needs {NEEDS[name]}, which failed")
                print(f"[FAIL] {name}: skipped, needs {NEEDS[name]}", flush=True)
                _report_coverage(b, name)
                continue
            t0 = time.perf_counter()
            try:
                ok, note = fn(b)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the others
                ok, note = False, f"{type(exc).__name__}: {exc}"
                b.not_exercised("the rest of the check", f"stopped by {type(exc).__name__}")
                traceback.print_exc()
            passed[name] = bool(ok)
            b.figures[f"{name}_passed"] = bool(ok)
            print(f"[{'PASS' if ok else 'FAIL'}] {name} ({time.perf_counter() - t0:.1f} s): {note}",
                  flush=True)
            _report_coverage(b, name)
    finally:
        destroy_trainer_parallel()
    if args.pytest:
        passed["pytest"] = _run_gpu_tests(b)
    b.figures["all_passed"] = all(passed.values())
    missed = [f"[{name}] {entry}" for name, (_, nots) in b.coverage.items() for entry in nots]
    b.figures["coverage"] = {
        "checks": {name: f"exercised {len(done)} / not exercised {len(nots)}"
                   for name, (done, nots) in b.coverage.items()},
        "not_exercised": missed}
    print(f"bench.gpu: not exercised in this run ({len(missed)}):", flush=True)
    for entry in missed:
        print(f"    {entry}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(b.figures, f, indent=2)
    print(f"bench.gpu: {sum(passed.values())}/{len(passed)} checks passed", flush=True)
    return 0 if b.figures["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
