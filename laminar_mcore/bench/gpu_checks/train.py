"""The GPU check, 1-3: kernels, the train step (and, with two GPUs, a DP2 NCCL world), the optimizer checkpoint round trip (``bench/gpu.py``)."""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import traceback
from typing import Dict, List, Tuple

import torch

from .common import Bench, _digest, _own


# ---------------------------------------------------------------------- 1. kernels
def check_kernels(b: Bench) -> Tuple[bool, str]:
    from ...kernels.logprobs import logprobs_entropy_triton
    from ...kernels.ppo import ppo_terms_torch, ppo_terms_triton

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
    from ...data.trajectory import Trajectory
    from ...trainer.packing import pack_trajectories

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
    ok &= _delta_kernel(b, notes)
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


def _delta_kernel(b: Bench, notes: List[str]) -> bool:
    """Delta compaction on the device (kernels/delta.py) against the CPU encoder
    (weights/delta.py): one bf16 bucket of ``weight_sync.bucket_mb`` (512 MiB; 256 KiB in the
    rehearsal) with 1% of its elements changed by one ulp: the same payload, and each one's
    bucket bytes per second (the device's including the copy of the compacted changes to the
    host and zstd)."""
    from ...kernels import delta as kdelta
    from ...weights import delta as wdelta

    mb = 512 if b.cuda else 0.25
    n = int(mb * 2**20) // 2
    g = torch.Generator(device=b.device).manual_seed(11)
    base = torch.randn(n, generator=g, device=b.device).to(torch.bfloat16)
    new = base.clone()
    hit = torch.rand(n, generator=g, device=b.device) < 0.01
    new.view(torch.int16)[hit] ^= 1
    del hit
    new_u8, base_u8 = new.view(torch.uint8), base.view(torch.uint8)
    out: dict = {}
    on_device = b.timed(lambda: out.update(
        device=kdelta.encode(new_u8, base_u8, 2, use_triton=True)), 3 if b.cuda else 1)
    new_h, base_h = new_u8.cpu(), base_u8.cpu()
    on_host = b.timed(lambda: out.update(host=wdelta.encode_counted(new_h, base_h, 2)), 1)
    payload, count = out["device"]
    same = out["device"] == out["host"]
    target = base_h.clone()
    wdelta.apply(payload, target)
    same &= torch.equal(target, new_h)
    # the publisher's encoder (weights.delta.DeltaEncoder on the device): its bases kept
    # there, each packed host bucket copied up and compared by the kernels
    pinned = {k: v.pin_memory() if b.cuda else v for k, v in (("base", base_h), ("new", new_h))}
    encoder = wdelta.DeltaEncoder(True, 2, device=b.device, kernel=functools.partial(
        kdelta.encode, use_triton=True))
    encoder.begin(1, True)
    encoder.encode(0, pinned["base"])
    encoder.end([0])
    encoder.begin(2, True)
    in_publisher = b.timed(lambda: out.update(encoder=encoder.encode(0, pinned["new"])), 1)
    same &= out["encoder"] == ("delta", out["host"][0])
    bytes_ = n * 2
    b.figures["delta_encoder_device_gb_per_s"] = bytes_ / in_publisher / 1e9
    b.figures.update({"delta_kernel_bucket_mb": mb, "delta_kernel_equal": same,
                      "delta_kernel_gb_per_s": bytes_ / on_device / 1e9,
                      "delta_cpu_gb_per_s": bytes_ / on_host / 1e9,
                      "delta_kernel_speedup": on_host / on_device,
                      "delta_kernel_changed": count})
    verdict = "the CPU encoder's bytes" if same else "DIFFERS from the CPU encoder"
    notes.append(f"delta compaction of a {mb:g} MiB bf16 bucket (1% changed): {verdict}, "
                 f"{bytes_ / on_device / 1e9:.2f} GB/s on {b.device.type} vs "
                 f"{bytes_ / on_host / 1e9:.2f} GB/s on the host; the publisher's encoder "
                 f"from a host bucket {bytes_ / in_publisher / 1e9:.2f} GB/s")
    b.exercised("delta_kernel", f"{'compiled' if b.cuda else 'interpreted'} Triton compaction "
                f"of a {mb:g} MiB bucket: payload equal to the CPU encoder's, applied bit for bit")
    return same


# ---------------------------------------------------------------------- 2-3. train, checkpoint
def _tiny_actor(b: Bench, algo=None, **kw):
    from ...config.schema import AlgoConfig, TrainerConfig
    from ...models import get_adapter
    from ...models.hf import initial_hf_state, tiny_hf_config
    from ...trainer.actor import MegatronActor

    cfg = tiny_hf_config("qwen2")
    full = get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(),
                                                              cfg, 3))
    dtype = torch.bfloat16  # the GPU's dtype in the rehearsal too (fp32 hid a mixed group)
    actor = MegatronActor(cfg, algo or AlgoConfig(eps_clip_high=0.28),
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

    from ...parallel import wait_for_rank0
    from ...parallel.groups import backend
    from ...testing.synthetic import random_trajectories

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
    ref_ok, ref_note = _reference_steps(b)
    return ok and ref_ok, f"{note}; {ref_note}"


def _reference_steps(b: Bench) -> Tuple[bool, str]:
    """Two steps with algo.kl_coef (k3) and algo.ref_offload: the reference visits the device
    for its pass and goes back to host memory; the first step's KL is 0 (the policy is the
    reference), the second's positive and finite."""
    from ...config.schema import AlgoConfig
    from ...testing.synthetic import random_trajectories

    try:
        cfg, actor = _tiny_actor(b, AlgoConfig(eps_clip_high=0.28, kl_coef=0.1, kl_estimator="k3",
                                               entropy_coef=0.001, ref_offload=True))
        batch = random_trajectories(4, 4, cfg.vocab_size, seed=7)
        first, second = actor.train_step(batch), actor.train_step(batch)
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        traceback.print_exc()
        b.not_exercised("reference_model", f"failed: {type(exc).__name__}: {exc}")
        return False, f"reference model FAILED: {type(exc).__name__}: {exc}"
    where = next(actor.ref_model.parameters()).device.type
    kl0, kl1 = first["kl_loss"], second["kl_loss"]
    ok = where == "cpu" and abs(kl0) < 1e-3 and 0 < kl1 < float("inf")
    b.figures.update({"reference_kl_step1": kl0, "reference_kl_step2": kl1,
                      "reference_between_passes_on": where})
    b.covered("reference_offload", b.cuda, f"reference on {b.device.type} for its pass, then "
              f"{where}", "no GPU: host and device are the same memory")
    b.exercised("reference_model", f"k3 KL {kl0:.2e} then {kl1:.2e}, entropy bonus")
    return ok, f"reference model: KL {kl0:.2e} -> {kl1:.2e}, held on {where} between passes"


def _train_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of ``_two_rank_train_step`` (``torch.multiprocessing`` target): the trainer's
    world from torchrun's variables, a tiny model's step with the distributed optimizer at
    DP=``world``, and what the ranks must agree on, written to ``out/rank{rank}.json``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ...parallel import destroy_trainer_parallel, init_trainer_parallel
    from ...testing.synthetic import random_trajectories

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

    from ...netutil import free_port

    with tempfile.TemporaryDirectory(prefix="laminar-bench-dp2-") as out:
        ctx = mp.start_processes(_own("train:_train_rank"), args=(world, free_port(), out),
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
    from ...testing.synthetic import random_trajectories
    from ...trainer.checkpoint import load_checkpoint, save_checkpoint

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

    from ...testing.synthetic import random_trajectories
    from ...trainer.model import te_importable

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
            from ...testing.fused_adam import megatron_selects

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
