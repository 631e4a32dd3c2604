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
import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, Iterable, List, Tuple

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
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.figures: Dict[str, object] = {}
        self.results: List[Tuple[str, bool, str]] = []
        self.shared: Dict[str, object] = {}
        # check name -> (exercised, not exercised): "what: how" / "what: why" entries
        self.coverage: Dict[str, Tuple[List[str], List[str]]] = {}
        self.check = ""  # the running check, whose lists exercised()/not_exercised() extend

    def exercised(self, what: str, how: str) -> None:
        self.coverage.setdefault(self.check, ([], []))[0].append(f"{what}: {how}")

    def not_exercised(self, what: str, why: str) -> None:
        self.coverage.setdefault(self.check, ([], []))[1].append(f"{what}: {why}")

    def covered(self, what: str, done: bool, how: str, why: str) -> None:
        """``what`` exercised (``how``) if ``done``, else not exercised (``why``)."""
        if done:
            self.exercised(what, how)
        else:
            self.not_exercised(what, why)

    def short_of(self, gpus: int) -> str:
        """Why a path that needs ``gpus`` GPUs did not run on this machine."""
        return f"{self.gpus} GPU (needs {gpus})" if self.cuda else "no GPU (CPU rehearsal)"

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


def _digest(named: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of tensors' names, dtypes, shapes and bytes, in order (compared across processes)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _own(name: str) -> Callable:
    """This module's function ``name`` as a spawned process can find it: through the module's
    importable name (run with ``python -m`` or ``runpy``, this file's functions belong to a
    ``__main__`` that a child cannot import)."""
    return getattr(importlib.import_module("laminar_mcore.bench.gpu"), name)


class _Peer:
    """A helper process (spawned: CUDA is initialised here) running ``_own(target)(conn,
    *args)``, spoken to over a pipe. The child sends its pid once it is ready, then answers;
    a child that fails sends ``{"error": traceback}``, raised here as ``RuntimeError``."""

    def __init__(self, target: str, *args, timeout_s: float = 300.0):
        import torch.multiprocessing

        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(target=_own(target), args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.pid = self.recv()
        except BaseException:
            self.close()
            raise

    def recv(self):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"helper process {self.proc.pid} did not answer within "
                               f"{self.timeout_s:.0f} s")
        msg = self.conn.recv()  # EOFError if it died
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"helper process {self.proc.pid} failed:\n{msg['error']}")
        return msg

    def ask(self, msg):
        self.conn.send(msg)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)  # "stop"
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _child_failed(conn) -> None:
    """In a helper process: report the exception being handled to the parent."""
    with contextlib.suppress(OSError, ValueError):
        conn.send({"error": traceback.format_exc()})


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
    how = f"{'compiled' if b.cuda else 'interpreted'} Triton, {str(dtype)[6:]}"
    b.exercised("logprob_entropy_kernel", f"{how}, forward and backward at "
                f"{', '.join(f'{n}x{v}' for n, v in shapes)} against fp32 torch")
    b.exercised("ppo_kernel", f"{how}, forward and backward against torch")
    most = max(n * v for n, v in shapes)
    b.covered("int64_logit_offsets", most > 2**31 - 1, f"{most / 1e9:.2f}e9 logits > 2**31",
              f"at most {most} logits, below 2**31 (the interpreter runs small shapes)")
    b.covered("compiled_triton", b.cuda, f"on {b.figures.get('gpu')}",
              "no GPU (CPU rehearsal: the Triton interpreter)")
    b.covered("bf16_logits", dtype == torch.bfloat16, "bf16 in, fp32 math",
              f"{str(dtype)[6:]} in (the interpreter computes in numpy)")
    b.exercised("packing", f"on {b.device.type} against the CPU reference")
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
    """Adam's state: each parameter's (moments, and torch Adam's per-parameter ``step``) and,
    for TE's and Apex's ``FusedAdam``, each param group's ``step`` (where they keep it; a load
    also writes one into torch Adam's groups, which never read it)."""
    out = {}
    for c, opt in enumerate(actor.optimizer.chained_optimizers):
        per_group = not isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        for g, group in enumerate(opt.optimizer.param_groups):
            if per_group and "step" in group:
                out[f"{c}.{g}.step"] = torch.tensor(float(group["step"]))
            for i, param in enumerate(group["params"]):
                for key, value in opt.optimizer.state[param].items():
                    out[f"{c}.{g}.{i}.{key}"] = value.detach().float().cpu().clone()
    return out


def _optimizer_class(actor) -> str:
    """The Adam Megatron picked at import (TE's ``FusedAdam``, Apex's, or torch's), qualified."""
    inner = type(actor.optimizer.chained_optimizers[0].optimizer)
    return f"{inner.__module__}.{inner.__qualname__}"


def check_train_step(b: Bench) -> Tuple[bool, str]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

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
    world, dp = dist.get_world_size(), ps.get_data_parallel_world_size()
    opt = type(actor.optimizer.chained_optimizers[0]).__name__
    b.figures.update({"train_step_grad_norm": stats["grad_norm"], "train_step_weight_change": moved,
                      "world_backend": world_backend})
    ok = (stats["skipped"] == 0.0 and moved > 0 and flag and on_device
          and world_backend == backend() and opt == "DistributedOptimizer")
    note = (f"world {world_backend}, grad norm {stats['grad_norm']:.3f}, max weight change "
            f"{moved:.2e}, {opt}, model on {b.device}")
    b.exercised("decoupled_ppo_step", f"tiny qwen2 on {b.device.type}, "
                f"{str(next(actor.model.parameters()).dtype)[6:]}")
    b.exercised("trainer_world", f"{world_backend}, a world of {world} rank(s)")
    b.exercised("cpu_helper_collectives", "a flag over the long-timeout gloo group")
    b.covered("distributed_optimizer", opt == "DistributedOptimizer", f"{opt} at DP={dp}",
              f"{opt} built instead")
    if b.cuda and world < 2 and b.gpus >= 2:  # a real NCCL world of its own, in two processes
        try:
            two = _two_rank_train_step()
        except Exception as exc:  # noqa: BLE001 - the single-rank figures above still stand
            traceback.print_exc()
            ok = False
            note += f"; two ranks FAILED: {type(exc).__name__}: {exc}"
            b.not_exercised("nccl_multi_rank", f"the two-rank run failed ({type(exc).__name__})")
        else:
            two_ok, two_note = _ranks_agree(two)
            ok &= two_ok
            note += f"; two ranks: {two_note}"
            b.figures.update({"train_step_two_rank_agree": two_ok,
                              "train_step_two_rank_weight_digests": [r["digest"] for r in two]})
            b.exercised("nccl_multi_rank", f"{two_note}")
            b.exercised("distributed_optimizer_sharding", f"DP={two[0]['dp']} in the two-rank "
                        "world")
    else:
        b.covered("nccl_multi_rank", world > 1 and "nccl" in world_backend,
                  f"{world_backend}, a world of {world} ranks",
                  f"{b.short_of(2)}, a world of {world} rank(s)")
        b.covered("distributed_optimizer_sharding", dp > 1, f"DP={dp}",
                  f"DP={dp}: one rank holds every shard, nothing is sharded")
    b.covered("nccl_backend", "nccl" in world_backend, world_backend,
              "no GPU (CPU rehearsal: gloo for every collective)")
    return ok, note


def _train_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of ``_two_rank_train_step`` (``torch.multiprocessing`` target): the trainer's
    world from torchrun's variables, a tiny model's step with the distributed optimizer at
    DP=``world``, and what the ranks must agree on, written to ``out/rank{rank}.json``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..parallel import destroy_trainer_parallel, init_trainer_parallel
    from ..testing.synthetic import random_trajectories

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    init_trainer_parallel(tp=1, pp=1, seed=1, timeout_s=300)
    try:
        b = Bench(rehearsal=not torch.cuda.is_available())
        cfg, actor = _tiny_actor(b)
        before = _weights(actor)
        # rank 0's batch, scattered over DP as the trainer does
        batch = random_trajectories(8, 4, cfg.vocab_size, seed=7) if rank == 0 else None
        stats = actor.train_step(batch)
        after = _weights(actor)
        result = {
            "rank": rank, "world": dist.get_world_size(), "backend": str(dist.get_backend()),
            "dp": ps.get_data_parallel_world_size(), "skipped": stats["skipped"],
            "grad_norm": stats["grad_norm"], "digest": _digest(sorted(after.items())),
            "moved": max((after[k] - before[k]).abs().max().item() for k in before),
            "optimizer": type(actor.optimizer.chained_optimizers[0]).__name__,
            # the distributed optimizer's main parameters on this rank: its shard
            "optimizer_numel": sum(p.numel() for opt in actor.optimizer.chained_optimizers
                                   for g in opt.optimizer.param_groups for p in g["params"]),
            "model_numel": sum(p.numel() for p in actor.model.parameters())}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        destroy_trainer_parallel()


def _two_rank_train_step(world: int = 2, timeout_s: float = 600.0) -> List[dict]:
    """``_train_rank`` in ``world`` spawned processes (NCCL with GPUs, one each; gloo without):
    each rank's result."""
    import torch.multiprocessing as mp

    from ..netutil import free_port

    with tempfile.TemporaryDirectory(prefix="laminar-bench-dp2-") as out:
        ctx = mp.start_processes(_own("_train_rank"), args=(world, free_port(), out),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):  # raises if a rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world}-rank train step took over {timeout_s:.0f} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def _ranks_agree(results: List[dict]) -> Tuple[bool, str]:
    """Every rank stepped (no skip, weights moved), at DP=world with the distributed optimizer
    holding a part of the model's values only, and ends with the same weights and grad norm."""
    r0 = results[0]
    same = all(r["digest"] == r0["digest"] and r["grad_norm"] == r0["grad_norm"] for r in results)
    each = all(r["skipped"] == 0.0 and r["moved"] > 0 and r["dp"] == len(results) and
               r["optimizer"] == "DistributedOptimizer" and
               0 < r["optimizer_numel"] < r["model_numel"] for r in results)
    return same and each, (f"{r0['backend']} world of {len(results)}, DP={r0['dp']}, weights "
                           f"{'equal' if same else 'DIFFER'} across ranks, Adam shards "
                           f"{[r['optimizer_numel'] for r in results]} of {r0['model_numel']}")


def _round_trip(b: Bench, cfg, actor) -> Dict[str, float]:
    """Save ``actor``, load it into a new one, compare weights and Adam state; then one more
    step on both must give the same weights."""
    from ..testing.synthetic import random_trajectories
    from ..trainer.checkpoint import load_checkpoint, save_checkpoint

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
    return {"weights_err": w_err, "adam_err": m_err, "next_step_err": step_err, "save_s": save_s}


def _round_trip_ok(r: Dict[str, float]) -> bool:
    return r["weights_err"] == 0.0 and r["adam_err"] == 0.0 and r["next_step_err"] <= 1e-6


def check_checkpoint(b: Bench) -> Tuple[bool, str]:
    import torch.distributed as dist

    from ..testing.synthetic import random_trajectories
    from ..trainer.model import te_importable

    cfg, actor = b.shared["actor"]
    optimizer = _optimizer_class(actor)  # read before the round trip: what the step ran with
    r = _round_trip(b, cfg, actor)
    b.figures.update({"checkpoint_weights_err": r["weights_err"],
                      "checkpoint_adam_err": r["adam_err"],
                      "checkpoint_next_step_err": r["next_step_err"],
                      "checkpoint_save_s": r["save_s"], "checkpoint_optimizer_class": optimizer})
    ok = _round_trip_ok(r)
    note = (f"{optimizer.rsplit('.', 1)[-1]}: weights err {r['weights_err']:.1e}, Adam "
            f"moments/step err {r['adam_err']:.1e}, next step err {r['next_step_err']:.1e}, "
            f"save {r['save_s']:.2f} s")
    world = dist.get_world_size()
    b.exercised("distributed_optimizer_round_trip", f"{actor.trainer.ckpt_optim_sharding}, "
                f"a world of {world} rank(s)")
    b.exercised("optimizer_class", optimizer)
    te_ran = optimizer.startswith("transformer_engine.")
    if te_ran:
        b.exercised("te_fused_adam_state_contract", "Transformer Engine's FusedAdam")
    else:
        if te_importable():
            why = f"Transformer Engine imports but Megatron picked {optimizer}"
        else:
            why = "Transformer Engine not importable" + (" (CPU rehearsal)" if b.rehearsal else "")
        b.not_exercised("te_fused_adam", why)
        if b.rehearsal:
            # TE's FusedAdam keeps the step per param group and refuses a per-parameter one;
            # its CPU twin, selected as Megatron selects TE, runs the same round trip.
            from ..testing.fused_adam import megatron_selects

            with megatron_selects("te"):
                cfg2, first = _tiny_actor(b)
                twin = _optimizer_class(first)
                first.train_step(random_trajectories(4, 4, cfg2.vocab_size, seed=7))
                t = _round_trip(b, cfg2, first)
            twin_ok = _round_trip_ok(t) and twin.endswith(".TEFusedAdamTwin")
            ok &= twin_ok
            b.figures.update({"checkpoint_te_twin_optimizer_class": twin,
                              "checkpoint_te_twin_weights_err": t["weights_err"],
                              "checkpoint_te_twin_adam_err": t["adam_err"],
                              "checkpoint_te_twin_next_step_err": t["next_step_err"]})
            b.exercised("te_fused_adam_state_contract", f"CPU twin ({twin})")
            note += (f"; TE FusedAdam's CPU twin: {'equal' if twin_ok else 'DIFFERS'} "
                     f"(Adam err {t['adam_err']:.1e}, next step err {t['next_step_err']:.1e})")
        else:
            b.not_exercised("te_fused_adam_state_contract", f"{optimizer} ran instead")
    b.covered("multi_rank_checkpoint", world > 1, f"{world} ranks",
              f"a world of {world} rank(s): every shard written and read by one rank")
    return ok, note


# ---------------------------------------------------------------------- 4. publish export
def check_publish(b: Bench) -> Tuple[bool, str]:
    from megatron.core import parallel_state as ps

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
    tp = ps.get_tensor_model_parallel_world_size()
    b.exercised("stage_export", f"{cfg.num_hidden_layers} layers of hidden size "
                f"{cfg.hidden_size}, {str(dtype)[6:]}, into {len(sizes)} host buckets")
    b.covered("pinned_host_buckets", packer.pin_memory, f"{packer.nbytes() / GB:.2f} GB pinned",
              "no GPU (CPU rehearsal: pageable host memory)")
    b.covered("qwen2.5_7b_stage_size", b.cuda, "a PP4 stage (7 of 28 layers)",
              "no GPU (CPU rehearsal: a tiny model)")
    b.covered("tp_gathers_in_export", tp > 1, f"TP={tp}", f"TP={tp}: nothing to gather")
    return ok, (f"{nbytes / GB:.2f} GB in {len(sizes)} buckets: blocked {steady:.2f} s "
                f"({nbytes / GB / max(steady, 1e-9):.1f} GB/s; first {first:.2f} s), "
                f"{packer.nbytes() / GB:.2f} GB {'pinned' if packer.pin_memory else 'host'}")


# ---------------------------------------------------------------------- 5. staging
def check_staging(b: Bench) -> Tuple[bool, str]:
    """How long one chunk's host-to-device copy takes to complete while a long queue of GEMMs
    waits on the default stream: on the channel's own stream (what ``Channel.send`` does) and,
    for comparison, on the default stream (what it did). Then the channel itself: chunks of a
    bucket sent to a relay in a second process (``_publish_channel``)."""
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
    note = (f"a {chunk / 2**20:.0f} MiB chunk completes in {side * 1e3:.1f} ms on its own stream, "
            f"{default * 1e3:.1f} ms behind {gemm_s * 1e3:.0f} ms of queued GEMMs on the default "
            "stream" + ("" if b.cuda else " (CPU: streams are no-ops, logic only)"))
    b.covered("side_stream_h2d_staging", b.cuda, f"{chunk / 2**20:.0f} MiB chunks behind queued "
              "GEMMs", "no GPU (CPU rehearsal: streams are no-ops)")
    # The channel itself: NCCL needs one GPU per rank (the relay's and the trainer's).
    backend = "nccl" if b.gpus >= 2 else "gloo"
    channel_ok, channel_note = _publish_channel(b, backend, chunk)
    b.covered("nccl_publish_channel", backend == "nccl", "GPU 0 -> GPU 1",
              f"{b.short_of(2)}: NCCL needs one GPU per rank (gloo ran instead)")
    return ok and channel_ok, f"{note}; publish channel: {channel_note}"


def _publish_channel(b: Bench, backend: str, chunk: int) -> Tuple[bool, str]:
    """A buffer of 3.5 chunks sent as the publisher sends a bucket (a header, then chunk by
    chunk through ``weights.transport.Channel`` over a two-rank ``stage_group``) to a relay in
    a second process (on GPU 1 over NCCL), which returns a SHA-256 of what it received."""
    import torch.distributed as dist

    from ..weights.transport import Channel, stage_group

    nbytes = chunk * 3 + chunk // 2 + 13  # a short, odd last chunk
    g = torch.Generator().manual_seed(11)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if b.cuda:
        host = host.pin_memory()
    timeout = datetime.timedelta(seconds=300)
    # The relay's rendezvous store: here, hosted by this (the trainer's) end.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout)
    relay = _Peer("_relay_main", backend, store.port, chunk, 1 if backend == "nccl" else None)
    try:
        pg = stage_group(store, 0, 1, backend, timeout)  # rank 1: the stage's lead
        channel = Channel(pg, 0, backend, chunk)
        channel.send_header({"type": "bucket", "nbytes": nbytes, "chunk_bytes": chunk})
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            channel.send(host[off:off + chunk])
        channel.flush()
        send_s = time.perf_counter() - t0
        digest, where = relay.recv()
    finally:
        relay.close()
    equal = digest == hashlib.sha256(host.numpy()).hexdigest()
    rate = nbytes / GB / max(send_s, 1e-9)
    b.figures.update({"staging_channel_backend": backend, "staging_channel_equal": equal,
                      "staging_channel_gb_per_s": rate})
    b.exercised("publish_channel", f"{backend}: stage_group + Channel to a second process "
                f"(pid {relay.pid}, staged on {where}), {nbytes} bytes in "
                f"{-(-nbytes // chunk)} chunks, bytes {'equal' if equal else 'DIFFERENT'}")
    return equal, (f"{backend} to pid {relay.pid}, {nbytes / 2**20:.1f} MiB "
                   f"{'equal' if equal else 'DIFFERENT'}, {rate:.2f} GB/s")


def _relay_main(conn, backend: str, port: int, chunk: int, device) -> None:
    """The relay end of ``_publish_channel`` (a ``_Peer``): receive one bucket as
    ``relay/chain.py`` does and answer (SHA-256, where it was staged)."""
    try:
        import torch.distributed as dist

        from ..weights.transport import Channel, stage_group

        if device is not None:
            torch.cuda.set_device(device)
        conn.send(os.getpid())
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        pg = stage_group(store, 0, 0, backend, timeout)  # rank 0: the relay
        channel = Channel(pg, 1, backend, chunk)
        header = channel.recv_header()
        host = torch.empty(header["nbytes"], dtype=torch.uint8)
        for off in range(0, header["nbytes"], header["chunk_bytes"]):
            channel.recv_into(host[off:off + header["chunk_bytes"]])
        where = str(channel.staging.device) if channel.staging is not None else "host"
        conn.send((hashlib.sha256(host.numpy()).hexdigest(), where))
        conn.recv()  # stop: the groups live until the sender has flushed
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        _child_failed(conn)


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
    devices = [str(b.device)]  # the engine's GPUs, one per TP rank: an engine at TP=1
    mem: Dict[str, float] = {}
    payload_bytes = 0
    buffers = packer.last_buckets
    # The engine: a second process that opens each payload as SGLang's TP worker does, before
    # the next bucket is served (started first: its imports and CUDA context are not measured).
    engine = _Peer("_engine_main", which == "SGLang's")
    opened, equal, where = 0, True, set()
    try:
        with b.peak(mem, "pull"):
            for i, bucket in enumerate(buffers):
                if i >= 2:  # the engine applied bucket i-2 (the relay's /bucket protocol)
                    exporter.free("lease", [i - 2])
                named = read_bucket(bucket.buffer, bucket.metas)
                per_rank = exporter.payload("lease", i, named, devices)
                payload_bytes += sum(len(p) for p in per_rank)
                index, digest, on = engine.ask((i, per_rank[0]))
                opened += index == i
                equal &= digest == _digest(named.items())
                where.add(on)
            held = exporter.held("lease")
            exporter.release("lease")
    finally:
        engine.close()
    left = (torch.cuda.memory_allocated() / GB) if b.cuda else 0.0
    b.figures.update({"cuda_ipc_gpu_peak_gb": mem["pull"], "cuda_ipc_largest_bucket_gb": largest / GB,
                      "cuda_ipc_payload_bytes": payload_bytes, "cuda_ipc_peak_buckets":
                      exporter.peak_buckets_held, "cuda_ipc_classes": which,
                      "cuda_ipc_second_process_buckets": opened,
                      "cuda_ipc_second_process_equal": equal,
                      "cuda_ipc_second_process_device": ",".join(sorted(where))})
    reopened = opened == len(buffers) and equal and where == {b.device.type}
    ok = (exporter.peak_buckets_held <= 2 and held == sorted(held)[-2:] and
          mem["pull"] <= 2 * largest / GB * 1.05 + 0.01 and not exporter.held("lease") and
          reopened)
    carrier = "CUDA IPC handles" if b.cuda else "CPU shared memory (torch's fd passing)"
    b.exercised("ipc_payloads", f"{which} classes, {len(buffers)} buckets, at most "
                f"{exporter.peak_buckets_held} held")
    b.covered("second_process_open", opened > 0, f"pid {engine.pid} rebuilt {opened} of "
              f"{len(buffers)} buckets from {carrier} on {','.join(sorted(where))}, bytes "
              f"{'equal (SHA-256)' if equal else 'DIFFERENT'}", "the engine process opened none")
    b.covered("cuda_ipc_handles", b.cuda, "opened by another process",
              "no GPU (CPU rehearsal: the same payload over CPU shared memory)")
    b.covered("sglang_format_and_patched_reductions", which == "SGLang's",
              "SGLang's MultiprocessingSerializer/SafeUnpickler, device UUIDs",
              "SGLang not importable (stand-in classes, handles by device index)")
    b.covered("one_payload_per_engine_tp_rank", len(devices) > 1, f"{len(devices)} GPUs",
              f"an engine on {len(devices)} device: one payload per bucket")
    return ok, (f"{len(buffers)} buckets, {which} classes: at most {exporter.peak_buckets_held} "
                f"held, engine-GPU peak {mem['pull']:.2f} GB (largest bucket {largest / GB:.2f} GB), "
                f"{payload_bytes} payload bytes, {left:.2f} GB allocated after release; "
                f"{opened} rebuilt in pid {engine.pid}, bytes {'equal' if equal else 'DIFFERENT'}")


def _engine_main(conn, sglang: bool) -> None:
    """The engine of ``check_cuda_ipc`` (a ``_Peer``): for each ``(index, payload)``, what an
    SGLang TP worker does with its entry of ``serialized_named_tensors`` -- deserialize it
    (SGLang's serializer after its ``monkey_patch_torch_reductions``, or, with the stand-in
    classes, the pickle they make), rebuild the bucket's tensors by their metadata -- and answer
    ``(index, SHA-256 of the tensors, device type)``, dropping them before it answers."""
    try:
        if sglang:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
            from sglang.srt.weight_sync.tensor_bucket import (FlattenedTensorBucket,
                                                              FlattenedTensorMetadata)

            monkey_patch_torch_reductions()  # device UUIDs back to this process's indices

            def rebuild(payload):  # weight_updater._update_weights_from_flattened_bucket
                obj = MultiprocessingSerializer.deserialize(payload)
                meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                                start_idx=m.start_idx, end_idx=m.end_idx,
                                                numel=m.numel) for m in obj["metadata"]]
                flat = obj["flattened_tensor"]
                return flat, FlattenedTensorBucket(flattened_tensor=flat,
                                                   metadata=meta).reconstruct_tensors()
        else:
            import base64
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401 - registers torch's reductions

            from ..relay.transports.cuda_ipc import reconstruct_tensors

            def rebuild(payload):
                obj = ForkingPickler.loads(base64.b64decode(payload))
                flat = obj["flattened_tensor"]
                return flat, reconstruct_tensors(flat, obj["metadata"])
        conn.send(os.getpid())
        while (msg := conn.recv()) is not None:
            index, payload = msg
            flat, named = rebuild(payload)
            answer = (index, _digest(named), flat.device.type)
            del flat, named  # the exporter may free the bucket once we answer
            conn.send(answer)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        _child_failed(conn)


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
    te = any(type(m).__module__.startswith("transformer_engine") for m in layer.modules())
    b.exercised("activation_bytes_vs_plan", f"one layer of hidden size {h}, {tokens} tokens, "
                f"{'Transformer Engine' if te else 'local'} layers, ratio band {low}-{high}")
    b.covered("flash_attention", saved["scores"] == 0, "no [s, s] scores kept",
              f"unfused attention keeps {saved['scores']} bytes of scores ("
              + ("no GPU (CPU rehearsal)" if not b.cuda else "Transformer Engine not used") + ")")
    b.covered("fused_swiglu_rope", b.cuda, "bias_activation_fusion on CUDA",
              "no GPU (CPU rehearsal: unfused, so the wider ratio band)")
    return low <= ratio <= high, (f"{tokens} tokens, one layer: {measured / 2**20:.1f} MiB saved for "
                                 f"backward vs the plan's {planned / 2**20:.1f} MiB: ratio "
                                 f"{ratio:.2f} (plus {saved['scores'] / 2**20:.1f} MiB of unfused "
                                 "attention scores, which flash attention does not keep)")


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
