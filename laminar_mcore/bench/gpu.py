"""The GPU check: every GPU-only path of the project, on one GPU, in one command.

    python -m laminar_mcore.bench.gpu --json out.json          # on a GPU machine
    python -m laminar_mcore.bench.gpu --cpu-rehearsal          # the same logic on CPU (make test)

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
   Qwen2.5-7B-shaped layer;
8. ``moe``: a tiny Qwen3-MoE built as the trainer builds it on this machine (Transformer
   Engine's grouped-GEMM experts when TE is installed on a GPU, Megatron's SequentialMLP
   otherwise): its log-probs against the CPU engine's forward of the same weights, the export's
   Hugging Face tensors (experts under their per-expert names) equal to the source, and a
   decoupled-PPO step with routing replay whose recomputed log-probs match the engine's.

Needs torch >= 2.11, triton, transformers, megatron-core, safetensors and this package -- no
Hydra, OmegaConf, SGLang or Transformer Engine -- so it runs on a bare GPU machine after
``pip install --no-deps`` of those wheels (README, "Checking the GPU paths"). Without a GPU it
exits 2 unless ``--cpu-rehearsal``: then every check's logic runs on CPU (gloo for NCCL, the
Triton interpreter at small shapes, the CPU twin of IPC) so that a GPU run can fail only for GPU
reasons. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Tuple

import torch

GB = 1e9
QWEN2_5_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)


class Bench:
    def __init__(self, rehearsal: bool):
        self.rehearsal = rehearsal
        self.cuda = torch.cuda.is_available() and not rehearsal
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")
        self.figures: Dict[str, object] = {}
        self.results: List[Tuple[str, bool, str]] = []
        self.shared: Dict[str, object] = {}

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable, repeat: int = 1) -> float:
        """Median seconds of ``fn()``."""
        times = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    @contextlib.contextmanager
    def peak(self, out: dict, key: str):
        """Peak device memory above the level at entry (GB); 0 on CPU."""
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        yield
        if self.cuda:
            self.sync()
            out[key] = (torch.cuda.max_memory_allocated() - base) / GB
        else:
            out[key] = 0.0


# ---------------------------------------------------------------------- 1. kernels
def check_kernels(b: Bench) -> Tuple[bool, str]:
    from ..kernels.logprobs import logprobs_entropy_triton
    from ..kernels.ppo import ppo_terms_torch, ppo_terms_triton

    shapes = [(4096, 151936), (16384, 152064)] if b.cuda else [(48, 1000), (17, 4099)]
    dtype = torch.bfloat16 if b.cuda else torch.float32  # the interpreter computes in numpy
    ok, notes = True, []
    for n, v in shapes:
        g = torch.Generator(device=b.device).manual_seed(n)
        logits = (torch.randn(n, v, generator=g, device=b.device) * 3).to(dtype)
        targets = torch.randint(0, v, (n,), generator=g, device=b.device)
        w1 = torch.randn(n, generator=g, device=b.device)
        w2 = torch.randn(n, generator=g, device=b.device)
        tag = f"kernel_{n}x{v}"

        def naive():
            x = logits.detach().requires_grad_()
            ls = torch.log_softmax(x.float(), -1)
            lp, ent = ls.gather(-1, targets[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
            (lp * w1 + ent * w2).sum().backward()
            return lp.detach(), ent.detach(), x.grad

        def fused():
            x = logits.detach().requires_grad_()
            lp, ent = logprobs_entropy_triton(x, targets, 0, None, None)
            (lp.float() * w1 + ent.float() * w2).sum().backward()
            return lp.detach(), ent.detach(), x.grad

        mem: Dict[str, float] = {}
        with b.peak(mem, "naive"):
            ref_lp, ref_ent, ref_grad = naive()
        with b.peak(mem, "fused"):
            lp, ent, grad = fused()
        err_lp = (lp.float() - ref_lp).abs().max().item()
        err_ent = (ent.float() - ref_ent).abs().max().item()
        err_grad = (grad.float() - ref_grad.float()).abs().max().item()
        del ref_grad, grad
        repeat = 3 if b.cuda else 1
        t_naive, t_fused = b.timed(naive, repeat), b.timed(fused, repeat)
        # bf16 logits in, fp32 math in both: the log-probs agree to fp32 rounding; the bf16
        # gradient to bf16 rounding of values below 1.
        good = err_lp < 1e-3 and err_ent < 1e-3 and err_grad < 2e-2
        ok &= good
        b.figures.update({f"{tag}_lp_err": err_lp, f"{tag}_entropy_err": err_ent,
                          f"{tag}_grad_err": err_grad, f"{tag}_ms": t_fused * 1e3,
                          f"{tag}_naive_ms": t_naive * 1e3, f"{tag}_peak_gb": mem["fused"],
                          f"{tag}_naive_peak_gb": mem["naive"]})
        notes.append(f"{n}x{v}: err lp {err_lp:.1e} grad {err_grad:.1e}, {t_fused * 1e3:.1f} ms "
                     f"vs naive {t_naive * 1e3:.1f} ms, peak {mem['fused']:.2f} vs "
                     f"{mem['naive']:.2f} GB")
        logits = None  # free it before the next shape
        # the decoupled-PPO kernel on the same number of tokens
        lp_t = (torch.randn(n, generator=g, device=b.device) - 3).requires_grad_()
        prox = lp_t.detach() + torch.randn(n, generator=g, device=b.device) * 0.1
        wts = torch.rand(n, generator=g, device=b.device)
        adv = torch.randn(n, generator=g, device=b.device)
        mask = (torch.rand(n, generator=g, device=b.device) > 0.1).float()
        outs = []
        for fn in (ppo_terms_triton, ppo_terms_torch):
            x = lp_t.detach().clone().requires_grad_()
            terms = fn(x, prox, wts, adv, mask, 0.2, 0.28, 3.0)
            terms.sum().backward()
            outs.append((terms.detach(), x.grad))
        err_ppo = max((outs[0][0] - outs[1][0]).abs().max().item(),
                      (outs[0][1] - outs[1][1]).abs().max().item())
        b.figures[f"ppo_kernel_{n}_err"] = err_ppo
        ok &= err_ppo < 1e-5
    # the trainer's packing on the model's device (the Triton kernel on GPUs) against CPU's
    from ..data.trajectory import Trajectory
    from ..trainer.packing import pack_trajectories

    g = torch.Generator().manual_seed(7)
    trajs = [Trajectory(torch.randint(1, 150_000, (p,), generator=g).tolist(),
                        torch.randint(1, 150_000, (r,), generator=g).tolist(),
                        (-torch.rand(r, generator=g)).tolist(), 0, "g")
             for p, r in [(7, 30), (120, 1), (33, 400)]]
    on_device = pack_trajectories(trajs, [0.5, -1.0, 2.0], [0, 1, 2], tp=2, device=b.device)
    on_cpu = pack_trajectories(trajs, [0.5, -1.0, 2.0], [0, 1, 2], tp=2)
    same = all(torch.equal(getattr(on_device, k).cpu(), getattr(on_cpu, k))
               for k in ("tokens", "labels", "position_ids", "loss_mask", "behav_logprobs",
                         "advantages", "seq_ids", "cu_seqlens_padded"))
    b.figures["packing_matches_cpu"] = same
    ok &= same
    notes.append(f"packing on {b.device}: {'equal' if same else 'DIFFERS from'} the CPU reference")
    return ok, "; ".join(notes)


# ---------------------------------------------------------------------- 2-3. train, checkpoint
def _tiny_actor(b: Bench, **kw):
    from ..config.schema import AlgoConfig, TrainerConfig
    from ..models import get_adapter
    from ..models.hf import initial_hf_state, tiny_hf_config
    from ..trainer.actor import MegatronActor

    cfg = tiny_hf_config("qwen2")
    full = get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(),
                                                              cfg, 3))
    dtype = torch.bfloat16 if b.cuda else torch.float32
    actor = MegatronActor(cfg, AlgoConfig(eps_clip_high=0.28),
                          TrainerConfig(lr=1e-3, total_steps=10, max_tokens_per_microbatch=64),
                          full_state=full, dtype=dtype, **kw)
    return cfg, actor


def _weights(actor) -> Dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone()
            for k, v in actor.model.module.state_dict().items() if isinstance(v, torch.Tensor)}


def _adam(actor) -> Dict[str, torch.Tensor]:
    out = {}
    for opt in actor.optimizer.chained_optimizers:
        for g, group in enumerate(opt.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                for key, value in opt.optimizer.state[param].items():
                    out[f"{g}.{i}.{key}"] = value.detach().float().cpu().clone()
    return out


def check_train_step(b: Bench) -> Tuple[bool, str]:
    import torch.distributed as dist

    from ..parallel import wait_for_rank0
    from ..parallel.groups import backend
    from ..testing.synthetic import random_trajectories

    cfg, actor = _tiny_actor(b)
    before = _weights(actor)
    stats = actor.train_step(random_trajectories(4, 4, cfg.vocab_size, seed=7))
    after = _weights(actor)
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    flag = wait_for_rank0(True)  # the batch-wait path: a CPU flag on the long-timeout gloo group
    on_device = next(actor.model.parameters()).device.type == b.device.type
    b.shared["actor"] = (cfg, actor)
    world_backend = str(dist.get_backend())
    b.figures.update({"train_step_grad_norm": stats["grad_norm"], "train_step_weight_change": moved,
                      "world_backend": world_backend})
    ok = (stats["skipped"] == 0.0 and moved > 0 and flag and on_device
          and world_backend == backend() and
          type(actor.optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer")
    return ok, (f"world {world_backend}, grad norm {stats['grad_norm']:.3f}, max weight change "
                f"{moved:.2e}, DistributedOptimizer, model on {b.device}")


def check_checkpoint(b: Bench) -> Tuple[bool, str]:
    from ..testing.synthetic import random_trajectories
    from ..trainer.checkpoint import load_checkpoint, save_checkpoint

    cfg, actor = b.shared["actor"]
    with tempfile.TemporaryDirectory(prefix="laminar-bench-ckpt-") as root:
        t0 = time.perf_counter()
        path = save_checkpoint(root, 1, actor)
        save_s = time.perf_counter() - t0
        _, resumed = _tiny_actor(b)
        load_checkpoint(path, resumed)
        w_err = max((resumed_w - saved).abs().max().item() for saved, resumed_w in
                    zip(_weights(actor).values(), _weights(resumed).values()))
        ma, mb = _adam(actor), _adam(resumed)
        m_err = max((ma[k] - mb[k]).abs().max().item() for k in ma) if ma.keys() == mb.keys() \
            else float("inf")
        batch = random_trajectories(4, 4, cfg.vocab_size, seed=8)
        actor.train_step(batch)
        resumed.train_step(batch)
        step_err = max((x - y).abs().max().item() for x, y in
                       zip(_weights(actor).values(), _weights(resumed).values()))
    b.figures.update({"checkpoint_weights_err": w_err, "checkpoint_adam_err": m_err,
                      "checkpoint_next_step_err": step_err, "checkpoint_save_s": save_s})
    ok = w_err == 0.0 and m_err == 0.0 and step_err <= 1e-6
    return ok, (f"weights err {w_err:.1e}, Adam moments/step err {m_err:.1e}, next step err "
                f"{step_err:.1e}, save {save_s:.2f} s")


# ---------------------------------------------------------------------- 4. publish export
def check_publish(b: Bench) -> Tuple[bool, str]:
    from ..models.hf import build_hf_config, tiny_hf_config
    from ..trainer.model import build_gpt_model
    from ..trainer.export import iter_stage_hf_tensors
    from ..weights.bucket import BucketPacker

    if b.cuda:  # one PP4 stage of Qwen2.5-7B with the embedding and the output layer
        cfg = build_hf_config("qwen2", hidden_act="silu", num_hidden_layers=7, **QWEN2_5_7B)
        bucket_bytes, dtype = 512 * 2**20, torch.bfloat16
    else:
        cfg, bucket_bytes, dtype = tiny_hf_config("qwen2"), 40_000, torch.float32
    with torch.no_grad():
        model = build_gpt_model(cfg, dtype=dtype)
    packer = BucketPacker(bucket_bytes, pin_memory=b.cuda)

    def publish():
        return [bkt.nbytes for bkt in packer.pack(iter_stage_hf_tensors(model, cfg))]

    first = b.timed(publish)  # allocates the pinned buffers
    sizes = publish()
    steady = b.timed(publish, 3 if b.cuda else 1)
    nbytes = sum(sizes)
    b.shared["publish"] = (packer, len(sizes), max(sizes))
    b.figures.update({"publish_blocked_s": steady, "publish_first_s": first,
                      "publish_bytes_gb": nbytes / GB, "publish_pinned_gb": packer.nbytes() / GB,
                      "publish_gb_per_s": nbytes / GB / max(steady, 1e-9), "publish_buckets": len(sizes)})
    model = None
    if b.cuda:
        torch.cuda.empty_cache()
    ok = packer.nbytes() >= nbytes and len(sizes) > 1 and (packer.pin_memory or not b.cuda)
    return ok, (f"{nbytes / GB:.2f} GB in {len(sizes)} buckets: blocked {steady:.2f} s "
                f"({nbytes / GB / max(steady, 1e-9):.1f} GB/s; first {first:.2f} s), "
                f"{packer.nbytes() / GB:.2f} GB {'pinned' if packer.pin_memory else 'host'}")


# ---------------------------------------------------------------------- 5. staging
def check_staging(b: Bench) -> Tuple[bool, str]:
    """How long one chunk's host-to-device copy takes to complete while a long queue of GEMMs
    waits on the default stream: on the channel's own stream (what ``Channel.send`` does) and,
    for comparison, on the default stream (what it did)."""
    chunk = (64 if b.cuda else 1) * 2**20
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=b.cuda)
    dev = torch.empty(chunk, dtype=torch.uint8, device=b.device)
    n = 4096 if b.cuda else 64
    a = torch.randn(n, n, device=b.device, dtype=torch.bfloat16 if b.cuda else torch.float32)

    def gemms():
        for _ in range(40 if b.cuda else 2):
            a @ a

    def copy_latency(side: bool) -> float:
        b.sync()
        stream = torch.cuda.Stream() if (side and b.cuda) else None
        gemms()  # queued, not finished
        t0 = time.perf_counter()
        with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            dev.copy_(host, non_blocking=True)
            if b.cuda:
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
        latency = time.perf_counter() - t0
        b.sync()
        return latency

    gemm_s = b.timed(gemms)
    side = min(copy_latency(True) for _ in range(3))
    default = min(copy_latency(False) for _ in range(3))
    b.figures.update({"staging_chunk_mb": chunk / 2**20, "staging_side_stream_ms": side * 1e3,
                      "staging_default_stream_ms": default * 1e3, "staging_gemm_queue_ms": gemm_s * 1e3})
    ok = side < 0.5 * default if b.cuda else True  # CPU: no streams to compare
    return ok, (f"a {chunk / 2**20:.0f} MiB chunk completes in {side * 1e3:.1f} ms on its own stream, "
                f"{default * 1e3:.1f} ms behind {gemm_s * 1e3:.0f} ms of queued GEMMs on the default "
                "stream" + ("" if b.cuda else " (CPU: streams are no-ops, logic only)"))


# ---------------------------------------------------------------------- 6. CUDA IPC
def check_cuda_ipc(b: Bench) -> Tuple[bool, str]:
    from ..relay.transports.cuda_ipc import CudaIpcExporter, standin_bucket_classes
    from ..weights.bucket import read_bucket

    packer, count, largest = b.shared["publish"]
    try:
        from ..relay.transports.cuda_ipc import _sglang_bucket_classes

        classes, which = _sglang_bucket_classes(), "SGLang's"
    except ImportError:
        classes, which = standin_bucket_classes(), "stand-in"
    exporter = CudaIpcExporter(classes=classes, require_cuda=b.cuda)
    device = str(b.device)
    mem: Dict[str, float] = {}
    payload_bytes = 0
    buffers = packer.last_buckets
    with b.peak(mem, "pull"):
        for i, bucket in enumerate(buffers):
            if i >= 2:  # the engine applied bucket i-2 (the relay's /bucket protocol)
                exporter.free("lease", [i - 2])
            per_rank = exporter.payload("lease", i, read_bucket(bucket.buffer, bucket.metas),
                                        [device])
            payload_bytes += sum(len(p) for p in per_rank)
        held = exporter.held("lease")
        exporter.release("lease")
    left = (torch.cuda.memory_allocated() / GB) if b.cuda else 0.0
    b.figures.update({"cuda_ipc_gpu_peak_gb": mem["pull"], "cuda_ipc_largest_bucket_gb": largest / GB,
                      "cuda_ipc_payload_bytes": payload_bytes, "cuda_ipc_peak_buckets":
                      exporter.peak_buckets_held, "cuda_ipc_classes": which})
    ok = (exporter.peak_buckets_held <= 2 and held == sorted(held)[-2:] and
          mem["pull"] <= 2 * largest / GB * 1.05 + 0.01 and not exporter.held("lease"))
    return ok, (f"{len(buffers)} buckets, {which} classes: at most {exporter.peak_buckets_held} "
                f"held, engine-GPU peak {mem['pull']:.2f} GB (largest bucket {largest / GB:.2f} GB), "
                f"{payload_bytes} payload bytes, {left:.2f} GB allocated after release")


# ---------------------------------------------------------------------- 7. plan vs measured
def check_plan(b: Bench) -> Tuple[bool, str]:
    from ..config.plan import _activation_bytes_per_token_layer, arch_of_hf_config
    from ..models.hf import build_hf_config, tiny_hf_config
    from ..trainer.model import build_gpt_model

    if b.cuda:
        cfg = build_hf_config("qwen2", hidden_act="silu", num_hidden_layers=1, **QWEN2_5_7B)
        tokens, dtype = 2048, torch.bfloat16
    else:
        cfg, tokens, dtype = tiny_hf_config("qwen2", num_hidden_layers=1), 64, torch.float32
    model = build_gpt_model(cfg, dtype=dtype)
    layer = model.decoder.layers[0]
    h = cfg.hidden_size
    x = torch.randn(tokens, 1, h, device=b.device, dtype=dtype, requires_grad=True)
    seen, saved = set(), {"linear": 0, "scores": 0}
    seen.update((p.untyped_storage().data_ptr(), p.device.type) for p in model.parameters())

    def pack(t):  # every tensor autograd keeps for backward, counted once per storage
        key = (t.untyped_storage().data_ptr(), t.device.type)
        if key not in seen and t.data_ptr() != x.data_ptr():
            seen.add(key)
            # [.., s, s]: the unfused attention's scores/probabilities/mask, which flash
            # attention (Transformer Engine, what the plan assumes) never stores
            kind = "scores" if t.dim() >= 2 and tuple(t.shape[-2:]) == (tokens, tokens) else "linear"
            saved[kind] += t.untyped_storage().nbytes()
        return t

    rope = model.rotary_pos_emb(tokens)
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool, device=b.device), 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=mask.view(1, 1, tokens, tokens), rotary_pos_emb=rope)
    planned = _activation_bytes_per_token_layer(arch_of_hf_config(cfg), 1, False) * tokens
    planned *= (torch.finfo(dtype).bits // 8) / 2  # the plan counts bf16 bytes
    measured = saved["linear"]
    ratio = measured / planned
    x = None
    b.figures.update({"plan_activation_bytes_per_token_layer": planned / tokens,
                      "measured_activation_bytes_per_token_layer": measured / tokens,
                      "measured_unfused_attention_bytes": saved["scores"],
                      "plan_activation_ratio": ratio})
    # On CPU the SwiGLU and RoPE run unfused (bias_activation_fusion needs CUDA) and keep a few
    # more f-wide tensors: the rehearsal checks the logic, the GPU the figure.
    low, high = (0.7, 1.3) if b.cuda else (0.5, 2.5)
    return low <= ratio <= high, (f"{tokens} tokens, one layer: {measured / 2**20:.1f} MiB saved for "
                                 f"backward vs the plan's {planned / 2**20:.1f} MiB: ratio "
                                 f"{ratio:.2f} (plus {saved['scores'] / 2**20:.1f} MiB of unfused "
                                 "attention scores, which flash attention does not keep)")


# ---------------------------------------------------------------------- 8. moe
def check_moe(b: Bench) -> Tuple[bool, str]:
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
    return ok, (f"experts {'TE grouped GEMM' if grouped else 'SequentialMLP'}, export "
                f"{'equal' if export_ok else 'DIFFERENT'} ({len(exported)} tensors), replayed "
                f"log-prob gap to the engine {gap:.1e}, step mismatch max "
                f"{stats['mismatch_max']:.1e}")


CHECKS = [("kernels", check_kernels), ("train_step", check_train_step),
          ("checkpoint", check_checkpoint), ("publish", check_publish),
          ("staging", check_staging), ("cuda_ipc", check_cuda_ipc), ("plan", check_plan),
          ("moe", check_moe)]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run every check's logic on CPU (gloo, Triton interpreter, shm twin)")
    ap.add_argument("--only", default="", help="comma-separated check names")
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
            if NEEDS.get(name) and not passed.get(NEEDS[name]):
                passed[name] = False
                print(f"[FAIL] {name}: skipped, needs {NEEDS[name]}", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                ok, note = fn(b)
            except Exception as exc:  # noqa: BLE001 - report it and go on with the others
                ok, note = False, f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            passed[name] = bool(ok)
            b.figures[f"{name}_passed"] = bool(ok)
            print(f"[{'PASS' if ok else 'FAIL'}] {name} ({time.perf_counter() - t0:.1f} s): {note}",
                  flush=True)
    finally:
        destroy_trainer_parallel()
    b.figures["all_passed"] = all(passed.values())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(b.figures, f, indent=2)
    print(f"bench.gpu: {sum(passed.values())}/{len(passed)} checks passed", flush=True)
    return 0 if b.figures["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
